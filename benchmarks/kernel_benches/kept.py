"""The read of kept tokens at inference (`kept-read`): each query reading its best R of K kept
tokens, by today's per-query mask over [kept | window | chunk] against the two-part read merged
by log-sum-exp (elephant/layers/kept_read.py), forward only, at the shapes evaluation runs."""
from __future__ import annotations

import datetime
import json
import time

import torch

from benchmarks.common import environment, median_ms, rel_error, write_report
from elephant.layers.attention import (attend, attend_lse, attend_top_kept, free_scores,
                                       kept_top, pad_sequence_keys, with_kept_first)
from elephant.layers import kept_read as kept_read_module
from elephant.layers.kept_read import top_kept_read
from elephant.layers.kept_read_triton import fused_kept_read, supported

# name: (heads, whether memory is scored free of position: mem_rotary "free", doubled q/k dims)
SHAPES = {"wt103-70m": (8, False), "recall": (4, True)}


def kept_read_arguments(ap) -> None:
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny shapes on the CPU: checks that it runs")
    ap.add_argument("--lanes", type=int, default=64)
    ap.add_argument("--queries", type=int, default=512, help="S, the chunk's queries")
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--kept", type=int, default=4096, help="K, the kept tokens a layer holds")
    ap.add_argument("--read", type=int, default=128, help="R, the kept tokens a query reads")
    ap.add_argument("--shapes", default=",".join(SHAPES), help=f"of {', '.join(SHAPES)}")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--out", default=None, help="result file (default: benchmarks/results/"
                                                "kept_read_<date>_<gpu>.json)")


def inputs(B, H, S, W, K, hd, free, device, dtype, seed=0):
    """Queries, chunk keys and values (B, H, S, hd), a full window of W slots and K kept tokens,
    all valid (the steady state of a long evaluation); with `free`, 16 memory tokens at each end
    of the chunk (2 at tiny shapes), scored free of position (the scores' q and k on doubled head
    dims)."""
    g = torch.Generator(device=device).manual_seed(seed)

    def r(*shape):
        return torch.randn(*shape, generator=g, device=device).to(dtype)
    q, k, v, q_raw, k_raw = (r(B, H, S, hd) for _ in range(5))
    ck, cv, kk, kv = r(B, H, W, hd), r(B, H, W, hd), r(B, H, K, hd), r(B, H, K, hd)
    valid = torch.ones(B, W, dtype=torch.bool, device=device)
    kept_valid = torch.ones(B, K, dtype=torch.bool, device=device)
    qa, ka, window_k = q, k, ck
    if free:
        s = torch.arange(S, device=device)
        m = 16 if S >= 128 else 2
        qa, ka = free_scores(q, q_raw, k, k_raw, (s < m) | (s >= S - m))
        window_k = pad_sequence_keys(ck)
    return dict(q=q, qa=qa, ka=ka, v=v, ck=ck, window_k=window_k, cv=cv, valid=valid, kk=kk,
                kv=kv, kept_valid=kept_valid)


def paths(t: dict, R: int, free: bool) -> dict:
    """The reads to time, each a function of nothing returning (B, H, S, hd)."""
    B, H, S, _ = t["q"].shape
    W = t["valid"].shape[1]

    def masked():   # Attention.forward's `top` branch (training, and inference until now)
        keys = torch.cat([t["kk"], t["ck"]], dim=2)
        keys = pad_sequence_keys(keys) if free else keys
        seen = kept_top(t["qa"], keys[:, :, :t["kk"].shape[2]], t["kept_valid"], R)
        valid = torch.cat([seen, t["valid"][:, None, None, :].expand(B, H, S, W)], dim=-1)
        return attend(t["qa"], t["ka"], t["v"], keys, torch.cat([t["kv"], t["cv"]], dim=2), valid)

    def two_part():  # the inference path now
        return attend_top_kept(t["qa"], t["ka"], t["v"], t["window_k"], t["cv"], t["valid"], t["q"],
                               t["kk"], t["kv"], t["kept_valid"], R)

    def part1_window():   # two_part's [window | chunk] alone, with its log-sum-exp
        return attend_lse(t["qa"], t["ka"], t["v"], t["window_k"], t["cv"], t["valid"])[0]

    def part2_kept():     # two_part's best-R read alone
        return top_kept_read(t["q"], t["kk"], t["kv"], t["kept_valid"], R, t["q"].shape[-1] ** -0.5)[0]

    def part2_fused():    # part 2 by the fused kernel (layers/kept_read_triton.py)
        return fused_kept_read(t["q"], t["kk"], t["kv"], t["kept_valid"], R, t["q"].shape[-1] ** -0.5)[0]

    def two_part_fused():   # two_part with part 2 by the fused kernel
        kernel, kept_read_module.KERNEL = kept_read_module.KERNEL, "fused"
        try:
            return two_part()
        finally:
            kept_read_module.KERNEL = kernel

    def kept_as_trained():   # R kept tokens, all read: [kept | window] as one cache (the speed of
        kk, kv = t["kk"][:, :, :R], t["kv"][:, :, :R]   # the model as trained, for scale)
        kk = pad_sequence_keys(kk) if free else kk
        ck, cv, valid = with_kept_first(kk, kv, t["kept_valid"][:, :R], t["window_k"], t["cv"],
                                        t["valid"])
        return attend(t["qa"], t["ka"], t["v"], ck, cv, valid, valid_suffix=True)

    fns = {"masked": masked, "two_part": two_part, "part1_window": part1_window,
           "part2_kept": part2_kept, "kept_as_trained": kept_as_trained}
    if supported(t["q"], t["kv"]):   # a Triton device (or its interpreter)
        fns |= {"part2_fused": part2_fused, "two_part_fused": two_part_fused}
    return fns


def kept_read(args) -> None:
    """The kept tokens' read at inference, forward only, bf16 (float32 on the CPU): every query
    reads its best R of K kept tokens (model.kv_keep_read) besides the window and the chunk.

        python benchmarks/kernels.py kept-read               # CUDA: benchmarks/results/
                                                             #   kept_read_<date>_<gpu>.json
        python benchmarks/kernels.py kept-read --cpu-smoke   # tiny shapes on the CPU: it runs

    Shapes (--shapes): wt103-70m (8 heads of 64) and recall (4 heads of 64, the recall recipe's,
    whose memory is scored free of position: q and k on doubled head dims, 16 memory tokens at
    each end of the chunk); B = 64 lanes, S = 512 queries, a full window of W = 512, K = 4,096
    kept tokens all valid, R = 128 read. Paths:
      masked           the per-query mask: kept_top's choice as a (B, H, S, K + W) mask, then
                       SDPA over [kept | window | chunk] (training's path; inference's until now)
      two_part         attention.attend_top_kept: [window | chunk] with its log-sum-exp (the
                       variable-length kernel), each query's best R kept tokens read apart (one
                       score product, top-k, the weights scattered into the score matrix, one
                       product with the values), merged
      part1_window     two_part's first part alone (the floor: a layer without kept tokens)
      part2_kept       two_part's second part alone
      part2_fused      part 2 by the fused kernel (layers/kept_read_triton.py: no score matrix,
                       the R-th score searched over tiles scored again), where Triton runs
      two_part_fused   two_part with that kernel for part 2
      kept_as_trained  R kept tokens all read, with the window as one cache (the model as trained)
    Each path's forward is timed as a CUDA graph (median of --iters replays; eagerly if it does
    not capture), its peak memory above what was allocated before it, and its output's relative
    error against `masked` (bf16: near ties of the choice may differ)."""
    smoke = args.cpu_smoke
    if not smoke and not torch.cuda.is_available():
        raise SystemExit("kernels.py kept-read: no CUDA device; use --cpu-smoke to check it on the CPU")
    device = torch.device("cpu" if smoke else "cuda")
    dtype = torch.float32 if smoke else torch.bfloat16
    B, S, W, K, R, hd = ((2, 16, 16, 64, 8, 16) if smoke else
                         (args.lanes, args.queries, args.window, args.kept, args.read, 64))
    rows = []
    for name in args.shapes.split(","):
        H, free = SHAPES[name]
        H = 2 if smoke else H
        t = inputs(B, H, S, W, K, hd, free, device, dtype)
        with torch.no_grad():
            fns = paths(t, R, free)
            want = fns["masked"]()
            for path, fn in fns.items():
                row = {"shape": name, "path": path}
                try:
                    got = fn()
                    if path in ("masked", "two_part", "two_part_fused"):
                        row["rel_err_vs_masked"] = rel_error(got, want)
                    if path == "part2_fused":
                        row["rel_err_vs_part2_kept"] = rel_error(got, fns["part2_kept"]())
                    if device.type == "cuda":
                        torch.cuda.synchronize()
                        base = torch.cuda.memory_allocated()
                        torch.cuda.reset_peak_memory_stats()
                        fn()
                        torch.cuda.synchronize()
                        row["peak_mib"] = round((torch.cuda.max_memory_allocated() - base) / 2 ** 20, 1)
                    try:
                        row["fwd_ms"] = round(median_ms(fn, device, args.iters, args.warmup,
                                                        graph=device.type == "cuda"), 4)
                        row["timed"] = "cuda graph" if device.type == "cuda" else "eager"
                    except RuntimeError as e:   # a path that does not capture: its eager time
                        row["graph_error"] = f"{type(e).__name__}: {e}"[:300]
                        row["fwd_ms"] = round(median_ms(fn, device, args.iters, args.warmup), 4)
                        row["timed"] = "eager"
                except Exception as e:   # recorded, the other paths go on
                    row["error"] = f"{type(e).__name__}: {e}"[:800]
                rows.append(row)
                print(json.dumps(row), flush=True)
        del t
    env = environment(device)
    report = {**env, "shape": {"lanes": B, "queries": S, "window": W, "kept": K, "read": R,
                               "head_dim": hd, "dtype": str(dtype).replace("torch.", ""),
                               "valid": "every window slot and kept token"},
              "shapes": {n: {"heads": 2 if smoke else SHAPES[n][0], "free_memory": SHAPES[n][1]}
                         for n in args.shapes.split(",")},
              "rows": rows}
    stamp = datetime.datetime.now().strftime("%Y-%m-%dT%H%M")
    path = write_report(report, f"kept_read_{stamp}", args.out, smoke, env["device"])
    print("wrote", path, f"({time.process_time():.0f} s of CPU)")
