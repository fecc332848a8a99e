"""What packing documents back to back (issue 11) costs and gains, on the wt103-70m model shape
(configs/wt103-70m.toml: d_model 512, MAMMAMMA, 8 memory tokens, 512-token KV window; random
weights, bf16 autocast, fast paths, each block compiled (--compile: the trainer's other forms;
train.py's default on the GPU is window); 32 lanes x 512 tokens).
A step is what the trainer does: `bptt_chunks` chunks, one backward; a packed step takes the
boundary path only for chunks where a document starts inside (the batcher's `inner_starts`) and
computes the initial-memory prefix once per step (in the step of its first chunk with an inner start).

  paths       forward+backward tokens/s, the paths timed in turns over --rounds rounds.
              fill 1.0, on rows without padding: today's path (no `starts`); the packing path on
              chunks without an inner start (it takes today's path); the boundary path forced on
              them (`starts` given, the cost of the boundary machinery alone); the packing path with
              the boundaries of a FineWeb-like length distribution, with the prefix once per step
              in the first such chunk's step (the trainer's way) and, for comparison, once per step
              in a call of its own (as before) and in every chunk.
              real tok/s: batches from RollingChunkBatcher over a corpus of log-normal document
              lengths (median 600 tokens, sigma 1), unpacked (pack=False, padded rows) against packed
              (pack=True): predicted (unmasked) tokens per second; packing should raise it by the
              fill gained, less its own overhead. lognormal_packed_conv_tiles: the packed path
              with the Mamba conv's other form with segments (conv_triton.SEGMENT_FORM "tiles",
              the default until 2026-11-26), in turns with the others (its own compiled graph).
  breakdown   each cost of the boundary path alone, forward+backward ms on the model's shapes
              (one layer, lanes x (n_mem + T + n_mem)), eager and compiled: the conv (the conv
              kernel, alone and with the model's transpose and concatenation / the Triton conv
              without and with boundaries / the masked sum / its indexing reference), the scan (without / with `seg` /
              with `seg` and the initial state of later segments taken by the scan itself), the
              initial state added outside the scan (add_segment_init, the older path), attention
              (today's masked SDPA over [cache | chunk] / masked by document with the prefix), whole
              Mamba layers without boundaries / with them and the initial state in the scan / with
              the older add_segment_init path, attention layers with and without boundaries, and
              the initial-memory prefix.

    python benchmarks/bench_packing.py [--cpu-smoke] [--only paths|breakdown] [--compile model]
                                       [--rounds 3] [--profile] [--config configs/fineweb-124m.toml]
writes benchmarks/results/packing_<device>.json after every section. --config: the paths at a
recipe's model, lanes and chunk length (the FineWeb recipe's: 12 layers of 768, 64 x 1,024).
"""
import argparse
import copy
import json
import sys
import time
import traceback
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from data_packing import RollingChunkBatcher, TokenizedCorpus  # noqa: E402
from elephant.config import ModelConfig, load_config  # noqa: E402
from benchmarks.common import (add_inductor_argument, bf16_autocast, environment,  # noqa: E402
                               inductor_options, profile, result_path, timer,
                               use_inductor_options)
from elephant.layers import ssd  # noqa: E402
from elephant.layers.attention import Attention, attend, attend_segments, segment_room  # noqa: E402
from elephant.layers import conv_triton  # noqa: E402
from elephant.layers.conv_triton import depthwise_conv  # noqa: E402
from elephant.layers.mamba import Mamba2, segment_conv, segment_conv_reference  # noqa: E402
from elephant.model import ElephantLM  # noqa: E402
from elephant.state import StaticCarry  # noqa: E402

# the state carried past CUDA-graph steps, in fixed buffers as the trainer keeps it (one set of
# lanes: every path's steps go through the same buffers, so no graph is re-recorded for new ones)
CARRY = StaticCarry()

MEDIAN, SIGMA = 600, 1.0
# profiled with --profile: today's path against the boundary path on the same tokens (forced on
# chunks without an inner start, and with real boundaries), and the padded against the packed
# log-normal batches; every kernel is kept, so that two paths' tables can be subtracted
PROFILED = ("fill1_today_path", "fill1_boundary_path_forced_no_inner_starts",
            "fill1_packing_with_boundaries", "lognormal_unpacked", "lognormal_packed")

# the summary's ratios: (path, path it is divided by, field)
SUMMARY = {
    "fill1_packing_vs_today_tokens_per_s": ("fill1_packing_with_boundaries", "fill1_today_path",
                                            "tokens_per_s"),
    "fill1_packing_no_inner_starts_vs_today": ("fill1_packing_no_inner_starts", "fill1_today_path",
                                               "tokens_per_s"),
    "fill1_boundary_path_forced_vs_today": ("fill1_boundary_path_forced_no_inner_starts",
                                            "fill1_today_path", "tokens_per_s"),
    "prefix_in_first_chunk_vs_per_chunk": ("fill1_packing_with_boundaries",
                                           "fill1_packing_with_boundaries_prefix_per_chunk", "tokens_per_s"),
    "prefix_in_first_chunk_vs_own_call": ("fill1_packing_with_boundaries",
                                          "fill1_packing_with_boundaries_prefix_per_step", "tokens_per_s"),
    "fill_gain": ("lognormal_packed", "lognormal_unpacked", "fill"),
    "real_tokens_per_s_gain": ("lognormal_packed", "lognormal_unpacked", "real_tokens_per_s"),
    # the same against the unpacked code on the packed batches' tokens (every slot real, no
    # boundaries): what packing's own work costs, apart from the padding the GPU runs faster on
    "real_tokens_per_s_gain_over_full_rows": ("lognormal_packed", "fill1_today_path",
                                              "real_tokens_per_s"),
    # slots per second of the padded rows over the same code on full rows: the padding's own speed
    "padded_over_full_rows_tokens_per_s": ("lognormal_unpacked", "fill1_today_path", "tokens_per_s"),
    "real_tokens_per_s_gain_masked_attention": ("lognormal_packed_masked_attention",
                                                "lognormal_unpacked", "real_tokens_per_s"),
    "real_tokens_per_s_gain_conv_tiles": ("lognormal_packed_conv_tiles", "lognormal_unpacked",
                                          "real_tokens_per_s"),
}


def make_config(smoke: bool) -> ModelConfig:
    if smoke:
        return ModelConfig(vocab_size=256, d_model=64, n_heads=4, layers="MAMA", d_mlp=128,
                           d_state=16, mamba_head_dim=32, ssd_chunk=16, n_mem=2, kv_window=32,
                           bptt_chunks=2)
    return ModelConfig(vocab_size=50304, d_model=512, n_heads=8, layers="MAMMAMMA", d_mlp=2048,
                       d_state=64, mamba_head_dim=64, ssd_chunk=64, n_mem=8, kv_window=512,
                       bptt_chunks=2, tied_embeddings=True)


def lognormal_corpus(n_docs: int, vocab: int, median: float, seed: int = 0) -> TokenizedCorpus:
    rng = np.random.default_rng(seed)
    lengths = np.maximum(2, rng.lognormal(np.log(median), SIGMA, n_docs)).astype(np.int64)
    tokens = rng.integers(0, vocab, int(lengths.sum()), dtype=np.uint32)
    offsets = np.zeros(n_docs + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    return TokenizedCorpus(tokens, offsets, manifest={"n_docs": n_docs, "n_tokens": int(offsets[-1])})


def batches_from(corpus, B, T, n, pack, device):
    """n batches as (tokens, reset, loss_mask, starts or None, inner_starts) on the device, the
    batcher fill and its ms per batch."""
    batcher = RollingChunkBatcher(corpus, lanes=B, chunk_len=T, seed=0, pack=pack)
    t0 = time.perf_counter()
    raw = [next(batcher) for _ in range(n)]
    build_s = time.perf_counter() - t0
    out = [(b.tokens.to(device), b.reset.to(device), b.loss_mask.to(device),
            b.starts.to(device) if pack else None, b.inner_starts) for b in raw]
    return out, batcher.fill, build_s / n


def measure(model, batches, device, autocast, warmup: int, host_skip: bool = True,
            prefix: str = "state", graphs: bool = False, count: bool = True,
            window: bool = False, conv_form: str | None = None) -> dict:
    """`steps` with the Mamba conv's form with segments set to `conv_form` while they run (None:
    conv_triton.SEGMENT_FORM as it is; a compiled graph is made again for the other form)."""
    saved = conv_triton.SEGMENT_FORM
    conv_triton.SEGMENT_FORM = conv_form or saved
    try:
        return steps(model, batches, device, autocast, warmup, host_skip, prefix, graphs, count,
                     window)
    finally:
        conv_triton.SEGMENT_FORM = saved


def steps(model, batches, device, autocast, warmup: int, host_skip: bool = True,
          prefix: str = "state", graphs: bool = False, count: bool = True,
          window: bool = False) -> dict:
    """Trainer steps of `bptt_chunks` chunks (summed loss, one backward) with carried state;
    median step. host_skip: a chunk without an inner start goes without `starts` (the trainer's
    choice); prefix: where the initial-memory prefix is computed, "state" (the trainer's way: in
    the step of the window's first chunk with an inner start, carried on by the state), "step"
    (once per step in a call and, compiled, a graph of its own) or "chunk" (in every chunk's step);
    graphs: the model replays CUDA graphs (compile_for("graphs")): each step is marked, and the
    state carried past it is copied into fixed buffers that the next step reads in place (the
    trainer's StaticCarry). The attention window is kept in bf16 on CUDA, as the trainer keeps it
    in its autocast dtype. count: the model is given the host's
    count of inner starts (the trainer's way; attention by document by the variable-length kernel
    when they fit), else not (the explicit mask). window: the step's chunks go to
    `forward_window` in one call (compile_for("window"): one graph for them; prefix "state" only)."""
    k = model.cfg.bptt_chunks
    B, T = batches[0][0].shape[0], batches[0][0].shape[1] - 1
    state = model.init_state(B, device=device,
                             kv_dtype=torch.bfloat16 if device.type == "cuda" else None)
    # the real tokens are counted on the device and read once at the end: reading them per chunk
    # would wait for the GPU in every chunk, which the trainer never does (its masks are on the
    # host), and time the host's launches as if they could not overlap the GPU's work
    times, boundary_chunks = [], 0
    real = torch.zeros((), dtype=torch.long, device=device)
    for i in range(len(batches) // k):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        if graphs:
            torch.compiler.cudagraph_mark_step_begin()
            state = CARRY.take(state)
        loss, given, chunks = 0.0, None, []
        with autocast():
            for tokens, reset, mask, starts, inner in batches[i * k:(i + 1) * k]:
                if starts is not None and host_skip and not inner:
                    starts = None
                if i >= warmup:
                    real += mask.sum()
                    boundary_chunks += starts is not None
                if window:
                    chunks.append(dict(tokens=tokens[:, :-1], reset=reset, targets=tokens[:, 1:],
                                       loss_mask=mask, starts=starts,
                                       inner_starts=inner if count else None))
                    continue
                if starts is not None and model.cfg.n_mem and prefix == "step" and given is None:
                    given = model.init_prefix()
                if prefix == "chunk":
                    state.prefix = None
                nll, state = model(tokens[:, :-1], state, reset, targets=tokens[:, 1:],
                                   loss_mask=mask, reduction="sum", starts=starts, prefix=given,
                                   inner_starts=inner if count else None)
                loss = loss + nll
            if window:
                loss, state = model.forward_window(chunks, state)
        loss.backward()
        state = state.detach()   # drops the state's prefix too
        if graphs:
            state = CARRY.take(state)
        if device.type == "cuda":
            torch.cuda.synchronize()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
        model.zero_grad(set_to_none=True)
    return {"times": times, "real": int(real), "tokens_per_step": k * B * T, "chunks_per_step": k,
            "boundary_path_chunks": boundary_chunks}


def summarize(runs: list[dict]) -> dict:
    """One path's timed rounds (`measure`'s results) as one row: the median step over every round,
    and each round's median, so that the spread between rounds (clock, order) is there to see."""
    times = [t for r in runs for t in r["times"]]
    med = sorted(times)[len(times) // 2]
    per_step, real = runs[0]["tokens_per_step"], sum(r["real"] for r in runs)
    return {"median_ms_per_step": med * 1e3, "tokens_per_s": per_step / med,
            "fill": real / (len(times) * per_step), "real_tokens_per_s": real / sum(times),
            "mean_ms_per_step": sum(times) / len(times) * 1e3, "steps": len(times),
            "round_median_ms": [sorted(r["times"])[len(r["times"]) // 2] * 1e3 for r in runs],
            "chunks_per_step": runs[0]["chunks_per_step"],
            "boundary_path_chunks": sum(r["boundary_path_chunks"] for r in runs)}


# ------------------------------------------------------------------------------- breakdown
def time_fwd_bwd(fn, inputs, device, reps: int, warmup: int = 3) -> float:
    """Median ms of fn(*inputs) forward + backward of the sum of its outputs (fixed random
    weights, so nothing is optimised away)."""
    start, stop = timer(device)
    out = fn(*inputs)
    outs = out if isinstance(out, (tuple, list)) else (out,)
    weights = [torch.randn_like(o, dtype=torch.float32) for o in outs]
    leaves = [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]
    times = []
    for i in range(warmup + reps):
        h = start()
        out = fn(*inputs)
        outs = out if isinstance(out, (tuple, list)) else (out,)
        loss = sum((o.float() * w).sum() for o, w in zip(outs, weights))
        torch.autograd.grad(loss, leaves)
        ms = stop(h)
        if i >= warmup:
            times.append(ms)
    return sorted(times)[len(times) // 2]


def breakdown(model, cfg, starts, device, autocast, smoke: bool, only: str = "") -> dict:
    """Each piece of the boundary path alone, eager and compiled (forward + backward ms)."""
    B, T = starts.shape
    M, S = cfg.n_mem, cfg.n_mem + T + cfg.n_mem
    reps = 3 if smoke else 20
    # the segment ids the model forms for [memory | chunk | write slots] (as in ElephantLM.forward)
    inner = starts.clone()
    inner[:, 0] = False
    tok_seg = inner.long().cumsum(1)
    seg = torch.cat([tok_seg.new_zeros(B, M), tok_seg, tok_seg[:, -1:].expand(B, M)], dim=1)
    zero_seg = torch.zeros_like(seg)
    dt16 = torch.float32 if smoke else torch.bfloat16
    gen = torch.Generator(device=device).manual_seed(0)

    def rand(*shape, dtype=torch.float32, grad=True, scale=1.0):
        t = torch.randn(*shape, generator=gen, device=device, dtype=dtype) * scale
        return t.requires_grad_(grad)

    room = segment_room(B, int(inner.sum()))
    out = {"lanes": B, "tokens_per_layer_call": S,
           "boundaries_per_row": float(inner.sum(1).float().mean()), "varlen_room": room}
    mamba = Mamba2(cfg).to(device)
    C, K = mamba.conv_dim, mamba.d_conv
    H, P, N = mamba.heads, mamba.head_dim, mamba.d_state
    w, bias = mamba.conv1d.weight, mamba.conv1d.bias
    window = rand(B, C, K - 1 + S, dtype=dt16)
    tail = rand(C, K - 1)
    x_conv, state_conv = rand(B, S, C, dtype=dt16), rand(B, C, K - 1, dtype=dt16)  # channels last
    attn = Attention(cfg).to(device)
    hd, W = cfg.head_dim, cfg.kv_window
    q, k, v = (rand(B, cfg.n_heads, S, hd, dtype=dt16) for _ in range(3))
    ck, cv = rand(B, cfg.n_heads, W, hd, dtype=dt16, grad=False), rand(B, cfg.n_heads, W, hd, dtype=dt16, grad=False)
    valid = torch.ones(B, W, dtype=torch.bool, device=device)
    pk, pv = rand(1, cfg.n_heads, M, hd, dtype=dt16), rand(1, cfg.n_heads, M, hd, dtype=dt16)
    x_scan = rand(B, S, H, P, dtype=dt16)
    dt_scan = torch.nn.functional.softplus(rand(B, S, H, grad=False) - 3).requires_grad_()
    A = -torch.linspace(1, 16, H, device=device)
    Bm, Cm = rand(B, S, 1, N, dtype=dt16), rand(B, S, 1, N, dtype=dt16)
    Dp = torch.ones(H, device=device, requires_grad=True)
    s0 = rand(B, H, P, N, scale=0.1)
    init_ssm = rand(H, P, N, scale=0.1)
    y_scan = rand(B, S, H, P, dtype=dt16)
    x_layer = rand(B, S, cfg.d_model, dtype=dt16)
    conv0, ssm0 = rand(B, C, K - 1, dtype=dt16), rand(B, H, P, N, scale=0.1)
    pos = torch.arange(S, device=device).expand(B, S).contiguous()

    def scan(seg_):
        return lambda x, dt, B_, C_, init: ssd.ssd_scan(x, dt, A, B_, C_, Dp, init, cfg.ssd_chunk, seg_)

    mamba_separate = copy.deepcopy(mamba)  # the older path: zero restarts + add_segment_init
    mamba_separate.fused_segment_init = False

    pieces = {
        "conv_kernel_no_boundaries": (lambda x: F.conv1d(x, w.to(x.dtype), bias.to(x.dtype), groups=C),
                                      (window,)),
        "conv_kernel_as_the_model_calls_it": (lambda x, s0: F.conv1d(
            torch.cat([s0, x.transpose(1, 2)], dim=2), w.to(x.dtype), bias.to(x.dtype),
            groups=C).transpose(1, 2), (x_conv, state_conv)),
        "conv_triton_no_boundaries": (lambda x, s0: depthwise_conv(x, s0, w, bias), (x_conv, state_conv)),
        "conv_triton_with_tail": (lambda x, s0, t: depthwise_conv(x, s0, w, bias, seg, t),
                                  (x_conv, state_conv, tail)),
        "conv_masked_sum_with_tail": (lambda x, t: segment_conv(x, seg, w, bias, t), (window, tail)),
        "conv_masked_sum_no_boundaries": (lambda x, t: segment_conv(x, zero_seg, w, bias, t), (window, tail)),
        "conv_indexing_reference_with_tail": (lambda x, t: segment_conv_reference(x, seg, w, bias, t),
                                              (window, tail)),
        "scan_no_seg": (scan(None), (x_scan, dt_scan, Bm, Cm, s0)),
        "scan_with_seg": (scan(seg), (x_scan, dt_scan, Bm, Cm, s0)),
        "scan_with_seg_and_init": (lambda x, dt, B_, C_, init, si: ssd.ssd_scan(
            x, dt, A, B_, C_, Dp, init, cfg.ssd_chunk, seg, si), (x_scan, dt_scan, Bm, Cm, s0, init_ssm)),
        "segment_init_alone": (lambda y, dt, C_, init: ssd.add_segment_init(
            y, s0.detach(), dt, A, C_, seg, init, cfg.ssd_chunk), (y_scan, dt_scan, Cm, init_ssm)),
        "attention_cache_masked_sdpa": (lambda q_, k_, v_: attend(q_, k_, v_, ck, cv, valid), (q, k, v)),
        "attention_cache_varlen": (lambda q_, k_, v_: attend(q_, k_, v_, ck, cv, valid, valid_suffix=True),
                                   (q, k, v)),
        "attention_by_document_with_prefix": (lambda q_, k_, v_, a, b: attend_segments(
            q_, k_, v_, seg, ck, cv, valid, a, b), (q, k, v, pk, pv)),
        # the variable-length kernel, a sequence per document (when the starts fit its room)
        "attention_by_document_varlen": (lambda q_, k_, v_, a, b: attend_segments(
            q_, k_, v_, seg, ck, cv, valid, a, b, room=room), (q, k, v, pk, pv)),
        "mamba_layer_no_seg": (lambda x, c, s_: mamba(x, c, s_), (x_layer, conv0, ssm0)),
        "mamba_layer_seg_and_init": (lambda x, c, s_, t, i: mamba(x, c, s_, seg=seg, init=(t, i)),
                                     (x_layer, conv0, ssm0, tail, init_ssm)),
        "mamba_layer_seg_and_init_separate": (
            lambda x, c, s_, t, i: mamba_separate(x, c, s_, seg=seg, init=(t, i)),
            (x_layer, conv0, ssm0, tail, init_ssm)),
        "attention_layer_cache": (lambda x: attn(x, pos, ck, cv, valid), (x_layer,)),
        "attention_layer_by_document": (lambda x, a, b: attn(x, pos, ck, cv, valid, seg=seg, prefix_k=a,
                                                             prefix_v=b), (x_layer, pk, pv)),
        "attention_layer_by_document_varlen": (lambda x, a, b: attn(
            x, pos, ck, cv, valid, seg=seg, prefix_k=a, prefix_v=b, room=room), (x_layer, pk, pv)),
    }
    if only:  # --pieces: the pieces whose names start with one of these
        pieces = {n: p for n, p in pieces.items() if n.startswith(tuple(only.split(",")))}
    for mode in ("eager",) if smoke else ("eager", "compiled"):
        res = out.setdefault(mode, {})
        for name, (fn, inputs) in pieces.items():
            if mode == "compiled" and name.startswith("scan_"):
                continue  # kernels already (Triton): compiling them changes nothing
            if smoke and name.startswith("conv_triton"):
                continue  # CUDA (the CPU smoke run has no interpreter)
            try:
                f = fn if mode == "eager" else torch.compile(fn, dynamic=False)
                with autocast():
                    res[name] = time_fwd_bwd(f, inputs, device, reps)
            except Exception as e:  # record and go on
                res[name] = f"{type(e).__name__}: {str(e)[:300]}"
            print(mode, name, res[name], flush=True)
    # the initial-memory prefix through the model's (compiled) blocks: what a step pays once, and
    # what it paid in every chunk before
    start, stop = timer(device)
    ts = []
    for i in range(3 + reps):
        h = start()
        with autocast():
            prefix = model.init_prefix()
        sum(t.float().sum() for pair in prefix for t in pair).backward()
        ts.append(stop(h))
    model.zero_grad(set_to_none=True)
    out["init_prefix_fwd_bwd"] = sorted(ts[3:])[len(ts[3:]) // 2]
    return out


def dynamo_counts() -> dict:
    from torch._dynamo.utils import counters
    return {"graph_breaks": sum(counters["graph_break"].values()),
            "unique_graphs": counters["stats"].get("unique_graphs", 0)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cpu-smoke", action="store_true")
    ap.add_argument("--only", choices=["paths", "breakdown"], default=None)
    ap.add_argument("--compile", choices=["blocks", "model", "graphs", "window"], default="blocks",
                    help="each block compiled (default), the whole chunk step (train.compile=model), "
                         "that step replayed as CUDA graphs (reduce-overhead), or a step's chunks "
                         "as one CUDA graph (train.compile=window)")
    ap.add_argument("--profile", action="store_true",
                    help="every kernel of a few steps of the PROFILED paths (JSON, _profile.txt)")
    ap.add_argument("--paths", default="",
                    help="comma-separated: time (and profile) only these paths (default: all)")
    ap.add_argument("--pieces", default="",
                    help="comma-separated name prefixes: time only these breakdown pieces")
    add_inductor_argument(ap, "the model's compile")
    ap.add_argument("--config", default=None,
                    help="a recipe (e.g. configs/fineweb-124m.toml): its model, lanes and chunk_len "
                         "instead of the wt103-70m shape at 32 x 512 (the result file is named after it)")
    ap.add_argument("--lanes", type=int, default=None,
                    help="lanes instead of the shape's (e.g. what fits one GPU at a recipe's shape)")
    ap.add_argument("--rounds", type=int, default=3,
                    help="timed rounds, the paths taking turns (each path's steps: all rounds')")
    args = ap.parse_args()
    use_inductor_options(inductor_options(args.inductor, ap.error))
    smoke = args.cpu_smoke or not torch.cuda.is_available()
    device = torch.device("cpu" if smoke else "cuda")
    B, T, steps, warmup = (2, 32, 3, 1) if smoke else (32, 512, 15, 4)
    median = 40 if smoke else MEDIAN  # the smoke run keeps several documents per 32-token chunk
    cfg = make_config(smoke)
    if args.config and not smoke:   # the recipe's shape
        recipe = load_config(args.config)
        cfg, B, T = recipe.model, recipe.train.lanes, recipe.train.chunk_len
    if args.lanes and not smoke:
        B = args.lanes
    torch.manual_seed(0)
    model = ElephantLM(cfg).to(device)
    model.set_fast_paths(True)
    if not smoke:
        model.compile_for(args.compile)   # (it leaves room for every graph variant)
        if args.compile == "graphs":  # say why a graph is not replayed, if one is not
            torch._logging.set_logs(perf_hints=True)
    autocast = bf16_autocast(device)
    graphs = args.compile in ("graphs", "window") and not smoke
    window = args.compile == "window"
    out_path = result_path(("packing" if args.compile == "blocks" else f"packing_compile_{args.compile}")
                           + (f"_{Path(args.config).stem}" if args.config else ""), smoke)
    results = {**environment(device),
               "command": "python benchmarks/bench_packing.py" + (" --cpu-smoke" if smoke else "")
               + (f" --only {args.only}" if args.only else "")
               + (f" --compile {args.compile}" if args.compile != "blocks" else "")
               + (f" --config {args.config}" if args.config else "")
               + (f" --lanes {args.lanes}" if args.lanes else "")
               + (f" --rounds {args.rounds}" if args.rounds != 3 else "")
               + (f" --paths {args.paths}" if args.paths else "")
               + (f" --pieces {args.pieces}" if args.pieces else "")
               + (" --profile" if args.profile else "")
               + "".join(f" --inductor {item}" for item in args.inductor),
               "config": cfg.to_dict(), "lanes": B, "chunk_len": T, "compiled": not smoke,
               "conv_segment_form": conv_triton.SEGMENT_FORM,
               "lengths": {"distribution": "log-normal", "median": median, "sigma": SIGMA},
               "paths": {}}

    corpus = lognormal_corpus(4000 if not smoke else 400, cfg.vocab_size, median)
    k = cfg.bptt_chunks
    n = (steps + warmup) * k
    packed, fill_packed, build_packed = batches_from(corpus, B, T, n, True, device)
    unpacked, fill_unpacked, build_unpacked = batches_from(corpus, B, T, n, False, device)
    results["batcher_ms_per_batch"] = {"packed": build_packed * 1e3, "unpacked": build_unpacked * 1e3}
    results["batcher_fill"] = {"packed": fill_packed, "unpacked": fill_unpacked}
    results["packed_chunks_with_inner_start"] = sum(b[4] for b in packed) / len(packed)
    if args.only != "breakdown":
        # fill 1.0: the packed batches' tokens (every slot real) without / with their boundaries
        full_mask = torch.ones(B, T, dtype=torch.bool, device=device)
        first = [torch.full((B,), i == 0, dtype=torch.bool, device=device) for i in range(n)]
        only_first = [torch.zeros(B, T, dtype=torch.bool, device=device) for _ in range(n)]
        only_first[0][:, 0] = True  # every lane starts a document with the first chunk, none after
        no_inner = [(t, first[i], full_mask, only_first[i], False) for i, (t, *_) in enumerate(packed)]
        variants = {
            "fill1_today_path": ([(t, first[i], full_mask, None, False)
                                  for i, (t, *_) in enumerate(packed)], {}),
            "fill1_packing_no_inner_starts": (no_inner, {}),
            "fill1_boundary_path_forced_no_inner_starts": (no_inner, {"host_skip": False}),
            "fill1_packing_with_boundaries": ([(t, r, full_mask, s, i) for t, r, _, s, i in packed], {}),
            "fill1_packing_with_boundaries_prefix_per_step": (
                [(t, r, full_mask, s, i) for t, r, _, s, i in packed], {"prefix": "step"}),
            "fill1_packing_with_boundaries_prefix_per_chunk": (
                [(t, r, full_mask, s, i) for t, r, _, s, i in packed], {"prefix": "chunk"}),
            "lognormal_unpacked": (unpacked, {}),
            "lognormal_packed": (packed, {}),
            # the same without the host's count of inner starts: attention by the explicit mask
            "lognormal_packed_masked_attention": (packed, {"count": False}),
            # the same with the conv's other form with segments (conv_triton.SEGMENT_FORM)
            "lognormal_packed_conv_tiles": (packed, {"conv_form": "tiles"}),
        }
        if args.paths:
            wanted = args.paths.split(",")
            unknown = sorted(set(wanted) - variants.keys())
            if unknown:
                ap.error(f"--paths: no path named {', '.join(unknown)} (paths: {', '.join(variants)})")
            variants = {name: v for name, v in variants.items() if name in wanted}
        # the paths take turns, round after round (the first round warms each up, and compiles):
        # a drift of the clock or an effect of order then falls on every path alike
        runs = {name: [] for name in variants}
        # when each path's round ran (Unix seconds): a log of the GPU's clock and power
        # (gpu.sh packing-shapes samples nvidia-smi) is matched to the paths by them
        results["spans"] = []
        for r in range(args.rounds):
            for name, (batches, opts) in variants.items():
                if name in results["paths"]:
                    continue   # failed in an earlier round
                try:
                    start = time.time()
                    runs[name].append(measure(model, batches, device, autocast,
                                              warmup if r == 0 else 1, graphs=graphs, window=window,
                                              **opts))
                    results["spans"].append({"path": name, "round": r, "start": start,
                                             "end": time.time()})
                except Exception as e:  # record and go on with the other paths
                    results["paths"][name] = {"error": f"{type(e).__name__}: {str(e)[:500]}",
                                              "trace": traceback.format_exc()[-1500:]}
        for name in variants:
            if name not in results["paths"]:
                results["paths"][name] = summarize(runs[name])
            print(name, json.dumps(results["paths"][name]), flush=True)
        if args.profile:
            # where the time of a step goes, by kernel: the paths whose gaps are not explained
            tables = []
            for name in PROFILED:
                if name not in variants or "error" in results["paths"][name]:
                    continue
                batches, opts = variants[name]
                step = (lambda b=batches[:k], o=opts:           # one trainer step
                        measure(model, b, device, autocast, 0, graphs=graphs, window=window, **o))
                top, table, summary = profile(step, 3, device, name, top=400)
                results["paths"][name]["top_kernels"] = top
                results["paths"][name]["by_kind"] = summary["by_kind"]
                results["paths"][name]["kernels_per_step"] = sum(   # those of >= 1 us a step
                    kern["calls_per_step"] for kern in summary["kernels"])
                results["paths"][name]["device_ms_per_step"] = summary["device_ms_per_step"]
                results["paths"][name]["gaps"] = summary.get("gaps")
                tables.append(table)
            out_path.with_name(out_path.stem + "_profile.txt").write_text("\n\n".join(tables))
        if not smoke:
            results["dynamo"] = dynamo_counts()
        # each ratio whose two paths ran (--paths may leave some out, a path may have failed)
        p, summary = results["paths"], {}
        for key, (num, den, field) in SUMMARY.items():
            try:
                summary[key] = p[num][field] / p[den][field]
            except (KeyError, ZeroDivisionError, TypeError):
                pass
        if summary:
            results["summary"] = summary
            print("summary", json.dumps(summary), flush=True)
        out_path.write_text(json.dumps(results, indent=1))
    if args.only != "paths":
        with_inner = [s for *_, s, inner in packed if inner] or [packed[-1][3]]
        try:
            results["breakdown"] = breakdown(model, cfg, with_inner[0], device, autocast, smoke,
                                             args.pieces)
        except Exception as e:
            results["breakdown"] = {"error": f"{type(e).__name__}: {str(e)[:500]}",
                                    "trace": traceback.format_exc()[-1500:]}
        out_path.write_text(json.dumps(results, indent=1))
    print("wrote", out_path, flush=True)


if __name__ == "__main__":
    main()
