"""Training and evaluation speed against an outside yardstick, through the real training step.

    python benchmarks/train_speed.py                 # the GPU: ~5 minutes, compile included
    python benchmarks/train_speed.py --cpu-smoke     # tiny shapes on the CPU, under a minute
    python benchmarks/train_speed.py --only hybrid,eval --eval-doc-tokens 200000

Three training steps at equal tokens per step (32 lanes x 512 tokens x 2 BPTT chunks = 16 x 2048 on
the GPU), each timed with CUDA events over `--steps` steps after `--warmup` steps (compilation):
  baseline   benchmarks/baseline_gpt.py: a plain compiled GPT of the same width, depth, vocabulary
             and parameter count (its MLP widened to match), fused AdamW, importing nothing of ours;
  attention  `Trainer.train_step` of the wt103-70m shape with layers AAAAAAAA, no memory, no cache;
  hybrid     `Trainer.train_step` of the wt103-70m recipe (MAMMAMMA, 8 memory tokens, KV window 512).
Both as train.py runs them by default (train.compile=auto: on the GPU each BPTT window as one CUDA
graph, `window`; --set train.compile=on|model|graphs for the others).
Data: pycode read as bytes (this interpreter's standard library; tokenized once into --cache).
`tokens_per_s` counts every token slot of the step (the work done, comparable with the baseline's
B x T); `real_tokens_per_s` only the predicted tokens (the rest is the padding after a document's
end, `fill`). MFU: the model's own FLOP count per token slot over the dense bf16 peak.
`ratio` = hybrid / baseline tokens/s, `ratio_attention` = attention / baseline.

The run FAILS (exit 1, `failures` in the JSON) when a compiled step has a graph break, or compiles
anything during the timed steps (a recompile). After timing it counts the host synchronizations of
one more step (CUDA sync debug mode and waits on CUDA events) and profiles a few steps: the top
kernels by device time go into the JSON, and `profile_summary` with the device ms per step by
kernel kind (`benchmarks.common.kernel_kind`), every kernel, and (our steps) the device time of
the host-queued phases (clipping, the optimizer, its graphed form), and on the GPU `gaps`: the
time the GPU idled between kernels, by gap length, and the longest gaps with the kernels around
them (`benchmarks.common.device_gaps`; a step's wall is its kernels plus these); the full tables into
..._profile.txt (with --shapes also the operators by input shape). --phases adds each phase's
host and wall time. --launchers [NAME=REGEX ...] prints, after each trainer step's profile, which
host op queued the kernels of each name (one more profiled step, CUDA; with --set
train.compile=on, as inside a CUDA graph every kernel is queued by the graph's launch).

Evaluation (the hybrid's model, compiled blocks, bf16): `elephant.evaluate` with 64 lanes over the
first documents of the corpus up to --eval-tokens tokens (longest first), and with one lane over
one document of --eval-doc-tokens tokens (the corpus's tokens run together); tokens/s of predicted
tokens and the peak memory, beside the peak of a short one-lane document (memory must stay flat).
--eval-modes plain,compact,side (say) times instead the 64-lane pass in each mode, in turns over
--eval-rounds rounds (eval_<mode>_tokens_per_s: each mode's median); side_nogc is side with
Python's cyclic garbage collector paused for the pass, side_fused with the head that never writes
its logits (head.EVAL_FUSED, the default since 2026-11-27), side_blocked with the blocked head
(logits made in blocks and read back by the loss kernel), side_fullside with the side batch
kept at its lane count to the end (evaluate.SIDE_COMPACT_SHARE 8: before 2026-11-27),
side_allgraph with every batch's step a CUDA graph whatever the pass's length, side_capped with a
batch over evaluate.GRAPH_MAX_ROWS plain however long the pass (evaluate.GRAPH_MIN_CHUNKS out of
play: the default before commit 6386d05), and the *_torchcapture modes capture
through torch.cuda.graph's context (evaluate.LEAN_CAPTURE off: a device synchronization and
emptied caches before each capture). Each pass records the collector's pauses inside it and its
wall-clock span (to match against the GPU's clock sampled beside it).
--eval-profile-tokens N then profiles one pass of the first mode over the first N tokens' documents.

Several GPUs: `torchrun --standalone --nproc_per_node=N benchmarks/train_speed.py --only hybrid`
times the same steps with N processes (each rank its own lanes, as train.py under torchrun: the
global batch is N times one GPU's); `tokens_per_s` counts every rank's tokens, `mfu` is per GPU,
and rank 0 profiles and writes train_speed_<gpu>_<N>gpu.json. Only the trainer's steps
(attention, hybrid) run this way; `--single <train_speed json of one GPU>` adds `speedup`, the
global tokens/s over that run's.

Writes benchmarks/results/train_speed_<gpu>.json (train_speed_cpu-smoke.json with --cpu-smoke;
train_speed_reference_head_<gpu>.json with --reference-head, the A/B of the blocked loss;
train_speed_in_place_head_<gpu>.json with --in-place-head, the blocked loss without its fused
block kernels, head.FUSED off).
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import gc
import json
import os
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks import baseline_gpt  # noqa: E402
from benchmarks.common import (LAUNCHER_PATTERNS, add_inductor_argument, environment,  # noqa: E402
                               inductor_options, print_launchers, profile, result_path,
                               use_inductor_options)

RECIPES = {"attention": ["model.layers=AAAAAAAA", "model.n_mem=0", "model.kv_window=0"],
           "hybrid": []}
SMOKE_RECIPES = {"attention": ["model.layers=AAAA", "model.n_mem=0", "model.kv_window=0"],
                 "hybrid": []}
PARTS = ("baseline", "attention", "hybrid", "eval")


# ------------------------------------------------------------------------------- torch.compile
def dynamo_counts() -> dict:
    """Graph breaks, compiled frames and graphs so far (torch._dynamo's counters)."""
    from torch._dynamo.utils import counters
    return {"graph_breaks": sum(counters["graph_break"].values()),
            "graph_break_reasons": sorted(counters["graph_break"])[:10],
            "frames_compiled": counters["frames"]["total"],
            "graphs": counters["stats"]["unique_graphs"]}


def reset_dynamo() -> None:
    import torch._dynamo
    from torch._dynamo.utils import counters
    torch._dynamo.reset()
    counters.clear()


def compile_failures(name: str, after_warmup: dict, after_timed: dict, compiled: bool) -> list[str]:
    if not compiled:
        return []
    out = []
    if after_timed["graph_breaks"]:
        out.append(f"{name}: {after_timed['graph_breaks']} graph break(s): "
                   f"{after_timed['graph_break_reasons']}")
    grew = after_timed["frames_compiled"] - after_warmup["frames_compiled"]
    if grew:
        out.append(f"{name}: {grew} compile(s) during the timed steps (recompiles)")
    return out


# ------------------------------------------------------------------------------- measuring
class GCPauses:
    """The cyclic garbage collector's collections inside a region: count and host pause (ms) by
    generation (a pause of the host between launches idles the GPU when it runs out of work)."""

    def __enter__(self):
        self.stats = {g: {"collections": 0, "pause_ms": 0.0, "max_ms": 0.0} for g in range(3)}
        gc.callbacks.append(self._on_gc)
        return self

    def _on_gc(self, phase, info):
        if phase == "start":
            self._t0 = time.perf_counter()
            return
        ms = (time.perf_counter() - self._t0) * 1e3
        s = self.stats[info["generation"]]
        s["collections"] += 1
        s["pause_ms"] += ms
        s["max_ms"] = max(s["max_ms"], ms)

    def __exit__(self, *exc):
        gc.callbacks.remove(self._on_gc)


class Clock:
    """Wall time of a region: CUDA events on the GPU, perf_counter on the CPU."""

    def __init__(self, device):
        self.cuda = torch.device(device).type == "cuda"

    def __enter__(self):
        if self.cuda:
            torch.cuda.synchronize()
            self.start = torch.cuda.Event(enable_timing=True)
            self.end = torch.cuda.Event(enable_timing=True)
            self.start.record()
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        if self.cuda:
            self.end.record()
            torch.cuda.synchronize()
            self.seconds = self.start.elapsed_time(self.end) / 1e3
        else:
            self.seconds = time.perf_counter() - self.t0


def peak_reset(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()


def peak_gb(device) -> float | None:
    if torch.device(device).type != "cuda":
        return None
    return torch.cuda.max_memory_allocated() / 2**30


def is_sync_warning(message: str) -> bool:
    """Whether a warning of CUDA's sync debug mode reports a synchronizing operation (and not the
    mode's own notice that it is a prototype, which torch emits once a process and which was
    counted as a sync before)."""
    return "called a synchronizing" in message


def count_syncs(step, device) -> dict | None:
    """Host synchronizations of one call of `step()`, with where they happen (Python file:line):
    those of ops (CUDA sync debug mode) and the host's waits on CUDA events, which that mode does
    not see (the trainer waits on an event for the loss it copied to the host)."""
    if torch.device(device).type != "cuda":
        return None
    torch.cuda.synchronize()
    event_waits = []
    real_wait = torch.cuda.Event.synchronize

    def wait(event):
        caller = sys._getframe(1)
        event_waits.append(f"{Path(caller.f_code.co_filename).name}:{caller.f_lineno}")
        return real_wait(event)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        torch.cuda.Event.synchronize = wait
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
            torch.cuda.Event.synchronize = real_wait
    syncs = [f"{Path(w.filename).name}:{w.lineno}" for w in caught if is_sync_warning(str(w.message))]
    where = collections.Counter(syncs + event_waits)
    return {"count": len(syncs) + len(event_waits), "where": dict(where.most_common(10))}


PHASES = {"windows": ("trainer", "_window"), "clip": ("opt", "clip_grad_norm_"),
          "optimizer": ("opt", "step"), "graphed optimizer": ("opt", "graphed_step")}


@contextlib.contextmanager
def wrapped_phases(trainer, wrap):
    """Within: each of the trainer's phases (PHASES) runs as wrap(name, the phase's method)."""
    targets = {name: (trainer if obj == "trainer" else trainer.opt, attr)
               for name, (obj, attr) in PHASES.items()}
    originals = {name: getattr(obj, attr) for name, (obj, attr) in targets.items()}
    try:
        for name, (obj, attr) in targets.items():
            setattr(obj, attr, wrap(name, originals[name]))
        yield
    finally:
        for name, (obj, attr) in targets.items():
            setattr(obj, attr, originals[name])


def phases(trainer, device, steps: int) -> dict:
    """Where the trainer's step goes, by phase (the windows' forward and backward, the gradient
    clipping, the optimizer step, the rest of train_step): `host_ms`, how long the host takes to
    queue each phase with nothing waited for (as in training), and `wall_ms`, how long each takes
    to finish when the device is waited for before and after it (a phase whose host time is near
    its wall time is bound by the host: the GPU idles while it is queued). Medians over `steps`."""
    cuda = torch.device(device).type == "cuda"
    spent: dict[str, float] = {}
    waits = {"on": False}

    def timed(name, fn):
        def call(*a, **k):
            if waits["on"] and cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            out = fn(*a, **k)
            if waits["on"] and cuda:
                torch.cuda.synchronize()
            spent[name] = spent.get(name, 0.0) + time.perf_counter() - t0
            return out
        return call

    result = {}
    with wrapped_phases(trainer, timed):
        for mode in ("host_ms", "wall_ms"):
            waits["on"] = mode == "wall_ms"
            rows = []
            for _ in range(steps):
                spent.clear()
                if cuda:
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                trainer.train_step()
                if cuda:
                    torch.cuda.synchronize()
                total = time.perf_counter() - t0
                rows.append({**spent, "rest": total - sum(spent.values()), "step": total})
            result[mode] = {k: float(np.median([r.get(k, 0.0) for r in rows])) * 1e3
                            for k in [*PHASES, "rest", "step"]}
    return result


def phase_marks(trainer):
    """Within: the trainer's phases (PHASES) run inside `torch.profiler.record_function`
    ranges named "phase:<name>", so a profile can attribute the kernels the host queues in each."""
    def marked(name, fn):
        def call(*a, **k):
            with torch.profiler.record_function(f"phase:{name}"):
                return fn(*a, **k)
        return call
    return wrapped_phases(trainer, marked)


def extras(out: dict, step, args, device, title: str, trainer=None) -> str:
    """Host syncs of a step and the profile into `out`; a failure of either is recorded there
    without losing the timing. With a trainer, the profile also attributes device time to the
    host-queued phases (`profile_summary.ranges`: clipping and the optimizer step; the windows'
    range misses the backward's kernels, queued by autograd's thread). Returns the profiler's table."""
    try:
        out["host_syncs_per_step"] = count_syncs(step, device)
    except Exception as e:
        out["host_syncs_per_step"] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
    try:
        ranges = tuple(f"phase:{name}" for name in PHASES) if trainer is not None else ()
        with phase_marks(trainer) if trainer is not None else contextlib.nullcontext():
            out["top_kernels"], table, out["profile_summary"] = profile(
                step, args.profile_steps, device, title, ranges=ranges, shapes=args.shapes)
            if args.launchers and trainer is not None and torch.device(device).type == "cuda":
                print_launchers(step, args.launchers, title)
    except Exception as e:
        out["top_kernels"], table = {"error": f"{type(e).__name__}: {str(e)[:300]}"}, f"== {title}: {e}"
    return table


# ------------------------------------------------------------------------------- the three steps
def run_baseline(args, tokens_per_step: int, target_params: int, device, compiled: bool) -> tuple[dict, str]:
    reset_dynamo()
    if args.cpu_smoke:
        base = baseline_gpt.GPTConfig(vocab_size=320, d_model=64, n_layers=4, n_heads=4)
        seq_len = 256
    else:
        base, seq_len = baseline_gpt.GPTConfig(), 2048
    cfg = baseline_gpt.matched_config(target_params, base, multiple=16 if args.cpu_smoke else 128)
    batch = max(1, tokens_per_step // seq_len)
    torch.manual_seed(0)
    stepper = baseline_gpt.Stepper(cfg, device, compile=compiled)
    gen = torch.Generator().manual_seed(0)
    batches = torch.randint(0, cfg.vocab_size, (4, batch, seq_len + 1), generator=gen).to(device)
    i = iter(range(10**9))

    def step():
        stepper.step(batches[next(i) % len(batches)])

    for _ in range(args.warmup):
        step()
    warm = dynamo_counts()
    peak_reset(device)
    with Clock(device) as clock:
        for _ in range(args.steps):
            step()
    timed = dynamo_counts()
    tokens_per_s = batch * seq_len * args.steps / clock.seconds
    flops = stepper.model.flops_per_token(seq_len)
    out = {"config": dataclasses.asdict(cfg), "batch": batch, "seq_len": seq_len, "tokens_per_step": batch * seq_len,
           "parameters": stepper.model.num_params(), "flops_per_token": flops, "compiled": compiled,
           "ms_per_step": clock.seconds / args.steps * 1e3, "tokens_per_s": tokens_per_s,
           "mfu": mfu(flops, tokens_per_s, device), "peak_mem_gb": peak_gb(device),
           "dynamo": timed,
           "failures": compile_failures("baseline", warm, timed, compiled)}
    table = extras(out, step, args, device, "baseline GPT")
    stepper = batches = None   # freed (step() above holds them)
    return out, table


def mfu(flops_per_token: float, tokens_per_s: float, device) -> float | None:
    from elephant.metrics import peak_flops
    if torch.device(device).type != "cuda":
        return None
    peak = peak_flops(torch.cuda.get_device_name(device))
    return flops_per_token * tokens_per_s / peak if peak else None


def trainer_config(args, kind: str, run_dir: Path):
    from elephant.config import load_config
    recipe = ROOT / ("configs/tiny.toml" if args.cpu_smoke else "configs/wt103-70m.toml")
    extra = (SMOKE_RECIPES if args.cpu_smoke else RECIPES)[kind]
    overrides = ["data.source=pycode", "data.tokenizer=bytes", f"data.cache_dir={args.cache}",
                 "data.valid_split=", f"train.run_dir={run_dir}", "train.max_steps=1000000",
                 "train.eval_every=0", "train.ckpt_every=0", "train.tensorboard=false",
                 f"train.compile={'off' if args.cpu_smoke else 'auto'}", *extra, *args.set]
    return load_config(recipe, overrides)


def run_trainer(args, kind: str, device, workdir: Path) -> tuple[dict, str, object]:
    from elephant.trainer import Trainer
    reset_dynamo()
    cfg = trainer_config(args, kind, workdir / kind)
    trainer = Trainer(cfg, progress=False)
    trainer.model.blocked_head = not args.reference_head
    from elephant.layers import head
    head.FUSED = not args.in_place_head
    t, m = cfg.train, cfg.model
    from elephant.trainer import compile_mode
    compiled = compile_mode(cfg.train.compile, device) != "off"
    slots = t.lanes * t.chunk_len * m.bptt_chunks * t.grad_accum
    for _ in range(args.warmup):
        trainer.train_step()
    warm = dynamo_counts()
    peak_reset(device)
    real = 0
    with GCPauses() as pauses, Clock(device) as clock:
        for _ in range(args.steps):
            real += trainer.train_step()["tokens"]   # every rank's (the trainer all-reduces it)
    timed = dynamo_counts()
    world = trainer.rt.world
    tokens_per_s = slots * world * args.steps / clock.seconds
    flops = trainer.model.flops_per_token(t.chunk_len)
    out = {"config": cfg.to_dict(), "head": ("reference" if args.reference_head else
                                             "blocked, in place" if args.in_place_head else "blocked"),
           "tokens_per_step": slots * world, "gpus": world,
           "parameters": trainer.model.num_params(), "flops_per_token": flops,
           "compiled": compiled, "ms_per_step": clock.seconds / args.steps * 1e3,
           "tokens_per_s": tokens_per_s, "real_tokens_per_s": real / clock.seconds,
           "fill": real / (slots * world * args.steps), "mfu": mfu(flops, tokens_per_s / world, device),
           "peak_mem_gb": peak_gb(device), "dynamo": timed, "gc": pauses.stats,
           "failures": compile_failures(kind, warm, timed, compiled)}
    if args.phases:
        try:
            out["phases"] = phases(trainer, device, args.steps)
        except Exception as e:
            out["phases"] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
    table = extras(out, trainer.train_step, args, device, f"{kind} Trainer.train_step", trainer)
    return out, table, trainer


# ------------------------------------------------------------------------------- evaluation
def leading_documents(corpus, max_tokens: int):
    """The corpus's first documents holding at most `max_tokens` tokens (at least one)."""
    from elephant.evaluate import subset
    n = int(np.searchsorted(np.asarray(corpus.offsets), max_tokens, side="right")) - 1
    return subset(corpus, max(1, n))


def one_document(corpus, n_tokens: int):
    """One document of the corpus's first `n_tokens` tokens run together."""
    from data_packing import TokenizedCorpus
    tokens = np.asarray(corpus.tokens[:n_tokens]).astype(np.int64)
    if tokens.size < n_tokens:
        raise ValueError(f"the corpus has {tokens.size} tokens, fewer than --eval-doc-tokens "
                         f"{n_tokens}")
    return TokenizedCorpus.from_documents([tokens])


@contextlib.contextmanager
def setting(owner, name: str, value):
    """owner.name = value inside the block, put back after it (None: left as it is)."""
    if value is None:
        yield
        return
    was = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, was)


def time_eval(model, corpus, lanes: int, chunk_len: int, device, autocast, cuda_graph: bool = False,
              compact: bool = False, side: bool = False, collect: bool = True,
              fused_head: bool | None = None, graph_max_rows: int | None = None,
              graph_min_chunks: int | None = None, lean_capture: bool | None = None,
              side_share: int | None = None) -> dict:
    """One pass of evaluate() timed, with its lane fill, the garbage collector's pauses inside it
    (`gc`) and its wall-clock span (`span`, Unix seconds: to match against samples of the GPU's
    clock). collect=False: the cyclic collector paused for the pass (gc.disable). fused_head:
    head.EVAL_FUSED for the pass; graph_max_rows, graph_min_chunks, lean_capture, side_share:
    evaluate's GRAPH_MAX_ROWS, GRAPH_MIN_CHUNKS, LEAN_CAPTURE and SIDE_COMPACT_SHARE for the pass
    (None: as it is)."""
    from elephant import evaluate as evaluate_module
    from elephant.evaluate import evaluate
    from elephant.layers import head
    peak_reset(device)
    resident = (torch.cuda.memory_allocated() / 2**30) if torch.device(device).type == "cuda" else None
    paused = not collect and gc.isenabled()
    if paused:
        gc.disable()
    began = time.time()
    try:
        with setting(head, "EVAL_FUSED", fused_head), \
                setting(evaluate_module, "GRAPH_MAX_ROWS", graph_max_rows), \
                setting(evaluate_module, "GRAPH_MIN_CHUNKS", graph_min_chunks), \
                setting(evaluate_module, "LEAN_CAPTURE", lean_capture), \
                setting(evaluate_module, "SIDE_COMPACT_SHARE", side_share), \
                GCPauses() as pauses, Clock(device) as clock:
            result = evaluate(model, corpus, lanes=lanes, chunk_len=chunk_len, device=device,
                              autocast=autocast, cuda_graph=cuda_graph, compact=compact, side=side)
    finally:
        if paused:
            gc.enable()
    span = [began, time.time()]
    # lane fill: how much of the rows the pass computed held tokens (a corpus whose longest
    # document is a large share of it ends with that document read in one lane while the others
    # idle, unless the batch is compacted)
    fill = result["tokens"] / (result["lane_chunks"] * chunk_len)
    # every row computed, padding included, a second: the rate at `lanes` lanes only when the
    # batch kept them all (a compacted pass ends on fewer)
    rows = result["lane_chunks"] * chunk_len / clock.seconds
    return {"documents": result["documents"], "tokens": result["tokens"], "lanes": lanes,
            "side_lane_chunks": result["side_lane_chunks"], "side_chunk_steps": result["side_chunk_steps"],
            "seconds": clock.seconds, "tokens_per_s": result["tokens"] / clock.seconds,
            "chunk_steps": result["chunk_steps"], "lane_chunks": result["lane_chunks"],
            "compact": compact, "side": side, "side_documents": result["side_documents"],
            "lane_fill": fill, "row_tokens_per_s": rows,
            "tokens_per_s_at_full_lanes": None if compact else rows,
            "loss": result["loss"], "peak_mem_gb": peak_gb(device), "resident_gb": resident,
            "collect": collect, "gc": pauses.stats, "span": span}


# --eval-modes: evaluate()'s settings of each 64-lane mode timed in turns
EVAL_MODES = {"plain": {}, "graph": dict(cuda_graph=True),
              "compact": dict(cuda_graph=True, compact=True),
              "side": dict(cuda_graph=True, compact=True, side=True),
              "side_nogc": dict(cuda_graph=True, compact=True, side=True, collect=False),
              "side_fused": dict(cuda_graph=True, compact=True, side=True, fused_head=True),
              "side_blocked": dict(cuda_graph=True, compact=True, side=True, fused_head=False),
              "side_fullside": dict(cuda_graph=True, compact=True, side=True, side_share=8),
              "side_allgraph": dict(cuda_graph=True, compact=True, side=True, graph_max_rows=1 << 30),
              "side_capped": dict(cuda_graph=True, compact=True, side=True, graph_min_chunks=1 << 30),
              "side_torchcapture": dict(cuda_graph=True, compact=True, side=True, lean_capture=False),
              "side_allgraph_torchcapture": dict(cuda_graph=True, compact=True, side=True,
                                                 graph_max_rows=1 << 30, lean_capture=False)}


def eval_in_turns(args, model, corpus, T, device, autocast, lanes) -> dict:
    """The 64-lane pass in each of --eval-modes: one untimed pass of each (compiles, captures),
    then --eval-rounds rounds of every mode in turns (so a drift of the GPU's clock falls on all
    modes alike); the median tokens/s of each mode as eval_<mode>_tokens_per_s."""
    docs = leading_documents(corpus, args.eval_tokens)
    for mode in args.eval_modes:
        time_eval(model, docs, lanes, T, device, autocast, **EVAL_MODES[mode])
    turns = {mode: [] for mode in args.eval_modes}
    for _ in range(args.eval_rounds):
        for mode in args.eval_modes:
            turns[mode].append(time_eval(model, docs, lanes, T, device, autocast, **EVAL_MODES[mode]))
    out = {"order": "longest first", "modes_in_turns": turns}
    for mode, runs in turns.items():
        out[f"eval_{mode}_tokens_per_s"] = float(np.median([r["tokens_per_s"] for r in runs]))
        out[f"eval_{mode}_loss_diff"] = abs(runs[0]["loss"] - turns[args.eval_modes[0]][0]["loss"])
    if args.eval_profile_tokens:   # where the device time of a pass goes, kernel by kernel
        mode = args.eval_modes[0]
        few = leading_documents(corpus, args.eval_profile_tokens)
        passes = []
        kernels, table, summary = profile(
            lambda: passes.append(time_eval(model, few, lanes, T, device, autocast, **EVAL_MODES[mode])),
            1, device, f"evaluation, mode {mode}, {lanes} lanes, one pass over "
                       f"{args.eval_profile_tokens:,} tokens", top=30)
        out["profile"] = {"mode": mode, "pass": passes[0], "top_kernels": kernels,
                          "profile_summary": summary, "table": table}
    return out


def run_eval(args, trainer, device) -> dict:
    from benchmarks.common import bf16_autocast
    # evaluation compiles the blocks again for its lane counts and no-grad mode: the trainer's
    # compile_for left room for them (ElephantLM.compile_for)
    model, corpus = trainer.model, trainer.train_corpus
    T = trainer.cfg.train.chunk_len
    autocast = bf16_autocast(device)
    lanes = 4 if args.cpu_smoke else 64
    if args.eval_modes:
        return eval_in_turns(args, model, corpus, T, device, autocast, lanes)
    warm_docs = leading_documents(corpus, 2 * lanes * T)
    docs = leading_documents(corpus, args.eval_tokens)                       # the 64-lane passes'
    time_eval(model, warm_docs, lanes, T, device, autocast)                  # compile, not timed
    many = time_eval(model, docs, lanes, T, device, autocast)
    time_eval(model, one_document(corpus, 2 * T), 1, T, device, autocast)    # compile, not timed
    short = time_eval(model, one_document(corpus, 16 * T), 1, T, device, autocast)
    one = time_eval(model, one_document(corpus, args.eval_doc_tokens), 1, T, device, autocast)
    out = {"order": "longest first", "many_docs": many, "one_doc": one, "one_short_doc": short,
           "eval_tokens_per_s": many["tokens_per_s"], "eval_1lane_tokens_per_s": one["tokens_per_s"],
           "eval_peak_mem_gb": many["peak_mem_gb"], "eval_1lane_peak_mem_gb": one["peak_mem_gb"]}
    if args.eval_cuda_graph:  # the same two passes with the chunk step replayed as a CUDA graph
        graph = dict(cuda_graph=True)
        time_eval(model, warm_docs, lanes, T, device, autocast, **graph)        # compile, not timed
        time_eval(model, one_document(corpus, 2 * T), 1, T, device, autocast, **graph)
        many_g = time_eval(model, docs, lanes, T, device, autocast, **graph)
        one_g = time_eval(model, one_document(corpus, args.eval_doc_tokens), 1, T, device, autocast,
                          **graph)
        out.update(many_docs_graph=many_g, one_doc_graph=one_g,
                   eval_graph_tokens_per_s=many_g["tokens_per_s"],
                   eval_1lane_graph_tokens_per_s=one_g["tokens_per_s"],
                   eval_graph_loss_diff=abs(many_g["loss"] - many["loss"]))
        if args.eval_compact:   # the same pass, the batch compacted at its end (eval.py's way)
            time_eval(model, docs, lanes, T, device, autocast, compact=True, **graph)  # compiles
            many_c = time_eval(model, docs, lanes, T, device, autocast, compact=True, **graph)
            out.update(many_docs_graph_compact=many_c,
                       eval_graph_compact_tokens_per_s=many_c["tokens_per_s"],
                       eval_graph_compact_loss_diff=abs(many_c["loss"] - many["loss"]))
        if args.eval_side:   # and the documents that outlast the batch read by a side batch
            side = dict(compact=True, side=True, **graph)
            time_eval(model, docs, lanes, T, device, autocast, **side)          # compiles
            many_s = time_eval(model, docs, lanes, T, device, autocast, **side)
            out.update(many_docs_graph_side=many_s,
                       eval_graph_side_tokens_per_s=many_s["tokens_per_s"],
                       eval_graph_side_loss_diff=abs(many_s["loss"] - many["loss"]))
    return out


# ------------------------------------------------------------------------------- main
def parse(argv):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny shapes on the CPU (configs/tiny.toml)")
    ap.add_argument("--only", default=",".join(PARTS), help=f"comma-separated subset of {','.join(PARTS)}")
    ap.add_argument("--warmup", type=int, default=None, help="untimed steps first (default 10; smoke 1)")
    ap.add_argument("--steps", type=int, default=None, help="timed steps (default 20; smoke 2)")
    ap.add_argument("--profile-steps", type=int, default=None, help="profiled steps (default 3; smoke 1)")
    ap.add_argument("--eval-tokens", type=int, default=None,
                    help="64-lane evaluation: documents up to this many tokens (default 2M; smoke 20K)")
    ap.add_argument("--eval-doc-tokens", type=int, default=None,
                    help="one-lane evaluation: one document of this many tokens (default 1M; smoke 4K)")
    ap.add_argument("--eval-cuda-graph", action="store_true",
                    help="also time both evaluation passes with the chunk step as a CUDA graph")
    ap.add_argument("--eval-compact", action="store_true",
                    help="with --eval-cuda-graph: also the 64-lane pass with its batch compacted at "
                         "the end (evaluate(compact=True), as eval.py runs it), after an untimed one")
    ap.add_argument("--eval-side", action="store_true",
                    help="with --eval-cuda-graph: also the 64-lane pass compacted, with the "
                         "documents that outlast the batch read by a side batch on a stream of "
                         "their own (evaluate(side=True), eval.py's default), after an untimed one")
    ap.add_argument("--eval-modes", default="",
                    help=f"comma-separated modes of the 64-lane pass, among {','.join(EVAL_MODES)}, "
                         "timed in turns (after an untimed pass of each) instead of the passes "
                         "above: plain; graph (CUDA graphs where the batch is small enough or the "
                         "pass long enough, evaluate.GRAPH_MAX_ROWS / GRAPH_MIN_CHUNKS); compact "
                         "(graph, the batch compacted at its end); "
                         "side (compact, and a side batch: eval.py's default)")
    ap.add_argument("--eval-rounds", type=int, default=2, help="rounds of --eval-modes (default 2)")
    ap.add_argument("--eval-profile-tokens", type=int, default=0,
                    help="with --eval-modes: after the rounds, one profiled pass of the first mode "
                         "over the documents up to this many tokens (its kernel table in the "
                         "_profile.txt; device ms by kernel under eval.profile)")
    ap.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                    help="a config override for the attention and hybrid steps (repeatable), "
                         "e.g. data.pack=true")
    add_inductor_argument(ap, "the attention and hybrid steps' compile")
    ap.add_argument("--in-place-head", action="store_true",
                    help="the blocked loss without its fused block kernels (head.FUSED off), to A/B them")
    ap.add_argument("--reference-head", action="store_true",
                    help="the loss through the whole logits (ElephantLM.blocked_head off), to A/B "
                         "the blocked linear + cross-entropy")
    ap.add_argument("--shapes", action="store_true",
                    help="profile with the operators' input shapes (a second table, by shape)")
    ap.add_argument("--launchers", nargs="*", default=None, metavar="NAME=REGEX",
                    help="after the trainer's profile, one more profiled step (CUDA): the kernels "
                         "whose name matches each REGEX counted by the op (and our frames of its "
                         "Python stack) that queued them; no pattern: small reductions, copies and "
                         "memsets. Give --set train.compile=on to see the ops (a CUDA graph's "
                         "kernels are all queued by its launch)")
    ap.add_argument("--phases", action="store_true",
                    help="also time the trainer's step by phase (windows, clipping, optimizer, "
                         "rest): host time to queue each, and wall time with waits around each")
    ap.add_argument("--single", help="under torchrun: the train_speed JSON of the same steps on one GPU "
                                     "(adds `speedup`, global tokens/s over its)")
    ap.add_argument("--cache", default="/tmp/elephant-cache", help="corpus cache folder")
    ap.add_argument("--out", help="result file (default benchmarks/results/train_speed_<gpu>.json)")
    args = ap.parse_args(argv)
    smoke = args.cpu_smoke
    for name, full, tiny in (("warmup", 10, 1), ("steps", 20, 2), ("profile_steps", 3, 1),
                             ("eval_tokens", 2_000_000, 20_000), ("eval_doc_tokens", 1_000_000, 4096)):
        if getattr(args, name) is None:
            setattr(args, name, tiny if smoke else full)
        if getattr(args, name) < (0 if name == "warmup" else 1):
            ap.error(f"--{name.replace('_', '-')} must be positive")
    args.parts = [p.strip() for p in args.only.split(",") if p.strip()]
    bad = [p for p in args.parts if p not in PARTS]
    if bad:
        ap.error(f"--only: unknown part(s) {', '.join(bad)}; choose from {', '.join(PARTS)}")
    args.eval_modes = [m.strip() for m in args.eval_modes.split(",") if m.strip()]
    bad = [m for m in args.eval_modes if m not in EVAL_MODES]
    if bad:
        ap.error(f"--eval-modes: unknown mode(s) {', '.join(bad)}; choose from {', '.join(EVAL_MODES)}")
    if args.eval_rounds < 1:
        ap.error("--eval-rounds must be positive")
    if args.eval_profile_tokens and not args.eval_modes:
        ap.error("--eval-profile-tokens profiles a pass of --eval-modes' first mode: give --eval-modes")
    if "eval" in args.parts and "hybrid" not in args.parts:
        ap.error("--only: eval times the hybrid's model, so it needs hybrid too")
    args.inductor_options = inductor_options(args.inductor, ap.error)
    if args.launchers is not None:
        patterns = [item.partition("=") for item in args.launchers]
        if any(not name or not regex for name, _, regex in patterns):
            ap.error("--launchers takes NAME=REGEX patterns")
        args.launchers = {name: regex for name, _, regex in patterns} or LAUNCHER_PATTERNS
    args.world = int(os.environ.get("WORLD_SIZE", "1"))
    if args.world > 1 and not set(args.parts) <= {"attention", "hybrid"}:
        ap.error(f"under torchrun (WORLD_SIZE={args.world}) only the trainer's steps run: "
                 f"--only attention,hybrid or a part of it (got {args.only})")
    return args


def main(argv=None) -> int:
    args = parse(argv)
    if not args.cpu_smoke and not torch.cuda.is_available():
        print("error: no CUDA device (use --cpu-smoke for the CPU)", file=sys.stderr)
        return 2
    device = torch.device("cpu" if args.cpu_smoke else "cuda")
    use_inductor_options(args.inductor_options)
    rank = int(os.environ.get("RANK", "0"))
    if args.world > 1 and device.type == "cuda":   # each rank on its own GPU
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    prefix = ("train_speed_reference_head" if args.reference_head else
              "train_speed_in_place_head" if args.in_place_head else "train_speed")
    out_path = Path(args.out) if args.out else result_path(prefix, args.cpu_smoke)
    if args.world > 1 and not args.out:
        out_path = out_path.with_name(f"{out_path.stem}_{args.world}gpu.json")
    results = {**environment(device), "command": " ".join(["python", "benchmarks/train_speed.py",
                                                            *(argv if argv is not None else sys.argv[1:])]),
               "warmup_steps": args.warmup, "timed_steps": args.steps, "runs": {}, "failures": [],
               "inductor_options": args.inductor_options}
    tables = []

    def save():
        if rank != 0:
            return
        out_path.parent.mkdir(parents=True, exist_ok=True)
        out_path.write_text(json.dumps(results, indent=1, default=str))
        out_path.with_name(out_path.stem + "_profile.txt").write_text("\n\n".join(tables))

    # under torchrun every rank in one run folder (the trainer's rank 0 writes it)
    shared = Path(tempfile.gettempdir()) / f"train-speed-{os.environ.get('TORCHELASTIC_RUN_ID', 'run')}"
    if args.world > 1:
        shared.mkdir(exist_ok=True)
    tmp_dir = (tempfile.TemporaryDirectory(prefix="train-speed-") if args.world == 1 else
               contextlib.nullcontext(str(shared)))
    with tmp_dir as tmp:
        probe = trainer_config(args, "hybrid", Path(tmp) / "probe")
        t, m = probe.train, probe.model
        tokens_per_step = t.lanes * t.chunk_len * m.bptt_chunks * t.grad_accum
        from elephant.model import ElephantLM
        hybrid_params = ElephantLM(probe.model).num_params()
        for part in [p for p in PARTS if p in args.parts]:
            t0 = time.perf_counter()
            try:
                if part == "baseline":
                    res, table = run_baseline(args, tokens_per_step, hybrid_params, device,
                                              compiled=not args.cpu_smoke)
                elif part in ("attention", "hybrid"):
                    res, table, trainer = run_trainer(args, part, device, Path(tmp))
                    if part == "hybrid" and "eval" in args.parts:
                        results["eval"] = run_eval(args, trainer, device)
                        if "profile" in results["eval"]:
                            tables.append(results["eval"]["profile"].pop("table"))
                        results.update({k: v for k, v in results["eval"].items() if k.startswith("eval_")})
                    trainer.close()
                    del trainer
                else:
                    continue  # eval ran with the hybrid
                tables.append(table)
                results["runs"][part] = res
                results["failures"] += res.pop("failures")
            except Exception as e:  # record and go on with the other parts
                results["runs"][part] = {"error": f"{type(e).__name__}: {str(e)[:500]}",
                                         "trace": traceback.format_exc()[-2000:]}
                results["failures"].append(f"{part}: {type(e).__name__}: {str(e)[:200]}")
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
            if rank != 0:
                continue
            r = results["runs"].get(part, {})
            gaps = (r.get("profile_summary") or {}).get("gaps")
            idle = f", GPU idle {gaps['idle_ms_per_step']:.2f} ms a step" if gaps else ""
            print(f"{part}: {r.get('tokens_per_s', float('nan')):,.0f} tokens/s, "
                  f"MFU {r.get('mfu') or 0:.1%}, peak {r.get('peak_mem_gb') or 0:.1f} GB{idle} "
                  f"({time.perf_counter() - t0:.0f} s)", flush=True)
            save()
    runs = results["runs"]
    base = runs.get("baseline", {}).get("tokens_per_s")
    for key, part in (("ratio", "hybrid"), ("ratio_attention", "attention")):
        if base and runs.get(part, {}).get("tokens_per_s"):
            results[key] = runs[part]["tokens_per_s"] / base
    if args.single:   # the speed-up over the same steps on one GPU, part by part
        single = json.loads(Path(args.single).read_text())["runs"]
        results["speedup"] = {part: r["tokens_per_s"] / single[part]["tokens_per_s"]
                              for part, r in runs.items()
                              if r.get("tokens_per_s") and single.get(part, {}).get("tokens_per_s")}
        results["single"] = args.single
    save()
    if rank != 0:
        return 1 if results["failures"] else 0
    summary = {k: results.get(k) for k in ("ratio", "ratio_attention", "speedup", "eval_tokens_per_s",
                                           "eval_1lane_tokens_per_s", "failures")}
    summary.update({f"eval_{m}_tokens_per_s": results.get(f"eval_{m}_tokens_per_s")
                    for m in args.eval_modes})
    print(json.dumps(summary, indent=1))
    print(f"wrote {out_path}", file=sys.stderr)
    return 1 if results["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
