"""The loss and the evaluation head: the loss kernel's launch (`ce`), evaluation's head by row
blocks and fused (`eval-head`), and the 64-lane evaluation chunk step alone (`eval-step`)."""
from __future__ import annotations

import json
import time
from contextlib import nullcontext
from pathlib import Path

import torch

from benchmarks.common import (bf16_autocast, compiled_registers, cuda_or_exit, environment,
                               median_ms, profile, queued_ms, rel_close, result_path,
                               sweep_arguments)
from elephant.layers import ce_triton, head, linear_nll_triton

ROOT = Path(__file__).resolve().parents[2]


# ------------------------------------------------------------------------------------------ ce
def ce_arguments(ap) -> None:
    sweep_arguments(ap, 30, 5)
    ap.add_argument("--rows", type=int, default=16384)
    ap.add_argument("--vocab", type=int, default=50304)


def ce(args) -> None:
    """The loss's per-block math (one block of the recipe's window: 16,384 rows x 50,304 bf16
    logits): the Triton kernel (elephant/layers/ce_triton.py) over its launch (vocabulary elements
    per step, warps) against inductor's kernel of the plain functions (head._nll_and_dlogits,
    _nll_lse compiled), the form it replaces.

        python benchmarks/kernels.py ce     # CUDA: benchmarks/results/ce_<gpu>.json

    Two kinds: `grad` (training: NLL, log-sum-exp and the logits' gradient, two reads of the
    logits and one write) and `nll` (evaluation: one read). Each is timed as a CUDA graph (median
    of --iters after --warmup), given as GB/s of the bytes it must move at least (grad: the logits
    read once and the gradient written; nll: the logits read once), and checked against
    inductor's results. The gradient's second walk over a row is swept both ways (`reversed`:
    from the row's end), with and without the L2 eviction hints (`hints`: ce_triton.L2_HINTS).
    `registers`: the registers and spills of each launch compiled.

    (On 2026-11-26 the gradient from one read, a program holding its row whole in registers, was
    tried at 8, 16 and 32 warps: 429, 413 and 515 us against the walk's 402, spilling 40, 24 and
    36 registers, one program per SM; dropped, see LOG.md.)"""
    device = cuda_or_exit("kernels.py ce")
    n, V = args.rows, args.vocab
    gen = torch.Generator(device=device).manual_seed(0)
    z = (torch.randn(n, V, device=device, generator=gen) * 2).to(torch.bfloat16)
    t = torch.randint(0, V, (n,), device=device, generator=gen)
    t[::97] = head.IGNORE_INDEX
    scale = torch.rand(n, device=device, generator=gen)
    logits_bytes = z.numel() * z.element_size()
    least = {"grad": 2 * logits_bytes, "nll": logits_bytes}
    inductor = {"grad": torch.compile(head._nll_and_dlogits), "nll": torch.compile(head._nll_lse)}
    args_of = {"grad": (z, t, scale), "nll": (z, t)}

    def timed(fn):
        return median_ms(fn, device, args.iters, args.warmup, graph=True)

    rows, want = [], {}
    for kind in ("grad", "nll"):
        want[kind] = inductor[kind](*args_of[kind])
        ms = timed(lambda: inductor[kind](*args_of[kind]))
        rows.append({"kind": kind, "kernel": "inductor", "us": ms * 1e3,
                     "gb_s": least[kind] / ms / 1e6})
        print(json.dumps(rows[-1]), flush=True)
    chosen = {**ce_triton.LAUNCH, "grad_reversed": ce_triton.GRAD_REVERSED,
              "l2_hints": ce_triton.L2_HINTS}
    configs = [(kind, block, warps, rev, hints) for kind in ("grad", "nll")
               for rev in ((True, False) if kind == "grad" else (False,))
               for hints in ((True, False) if kind == "grad" else (False,))
               for block in (1024, 2048, 4096, 8192, 16384) for warps in (4, 8, 16)]
    try:
        for kind, block, warps, rev, hints in configs:
            ce_triton.LAUNCH[kind] = (block, warps)
            ce_triton.GRAD_REVERSED = rev
            ce_triton.L2_HINTS = hints
            row = {"kind": kind, "kernel": "triton", "block": block, "warps": warps,
                   **({"reversed": rev, "hints": hints} if kind == "grad" else {})}
            try:
                got = ce_triton.FNS[kind](*args_of[kind])
                row["equal"] = all(rel_close(a, b, 2e-3) for a, b in zip(got, want[kind]))
                ms = timed(lambda: ce_triton.FNS[kind](*args_of[kind]))
                row.update(us=ms * 1e3, gb_s=least[kind] / ms / 1e6)
            except Exception as e:  # record and go on (a launch may not fit)
                row["error"] = f"{type(e).__name__}: {str(e)[-400:]}"
            rows.append(row)
            print(json.dumps(row), flush=True)
    finally:
        ce_triton.LAUNCH.update({k: chosen[k] for k in ce_triton.LAUNCH})
        ce_triton.GRAD_REVERSED = chosen["grad_reversed"]
        ce_triton.L2_HINTS = chosen["l2_hints"]
    best = {k: min((r for r in rows if r["kind"] == k and r["kernel"] == "triton"
                    and r.get("equal")), key=lambda r: r["us"], default=None)
            for k in ("grad", "nll")}
    base = {k: next(r["us"] for r in rows if r["kind"] == k and r["kernel"] == "inductor")
            for k in ("grad", "nll")}
    out = {**environment(device),
           "shape": {"rows": n, "vocab": V, "dtype": "bfloat16"}, "inductor_us": base,
           "best": best, "chosen": chosen, "configs": rows,
           "registers": compiled_registers(ce_triton._ce_kernel)}
    path = result_path("ce", False)
    path.write_text(json.dumps(out, indent=1))
    print("inductor", json.dumps(base))
    print("best", json.dumps(best))
    print("chosen", json.dumps(chosen))
    print("wrote", path)


# ------------------------------------------------------------------------------- eval-head
# the fused head's launches: (rows BM and columns BN a tile, BK of D a product step, warps,
# pipeline stages); on 2026-11-27 two forms since dropped were swept too (the tile loop
# unflattened: 4.59-4.73 ms; the row block's h kept on chip: 4.11-8.47 ms), results/eval_head_*
SWEEP = ((128, 128, 64, 8, 3), (128, 128, 64, 8, 2), (128, 256, 64, 8, 3), (256, 128, 64, 8, 3),
         (128, 128, 32, 8, 4), (128, 128, 32, 8, 6), (256, 64, 64, 8, 3), (128, 256, 32, 8, 4),
         (64, 256, 64, 4, 3), (128, 128, 64, 4, 4))
# programs in flight the vocabulary's split aims for (linear_nll_triton.TARGET_PROGRAMS), swept
# at the fastest launch of SWEEP
TARGETS = (132, 264, 396, 528, 1056)


def eval_head_arguments(ap) -> None:
    ap.add_argument("--quick", action="store_true",
                    help="the blocked pass at its default only (no block or NLL-launch sweep)")
    ap.add_argument("out", nargs="?", help="result file (none: not written)")


def eval_head(args) -> dict:
    """Evaluation's head by row blocks: the per-row NLL of h @ W^T (head._forward_nll, logits
    made block by block in bf16 and read once by the loss kernel) over one 64-lane chunk step of
    the wt103-70m shape (32,768 rows, D 512, V 50,304), at block sizes from the default (two
    blocks of 16,384) down to blocks whose bf16 logits would stay in L2 (64-384 rows: 6-39 MB), at
    three launches of the NLL kernel; `matmul_only_ms` the blocks' products alone.

        python benchmarks/kernels.py eval-head [--quick] [out.json]      # CUDA

    --quick: the blocked pass at its default only (no block or NLL-launch sweep), then the fused
    head.

    The question it answered (2026-11-27): would evaluation's head gain from blocks small enough
    that the logits never leave L2 (no trip through memory between the product and the loss
    kernel)? No: 3.7 ms a pass at the default, 4.3-4.7 ms at 512-1,024 rows and worse below, the
    products losing more than the loss kernel gains (docs/RESULTS.md, issue 12).

    Then the head that never writes its logits (elephant/layers/linear_nll_triton.py,
    head.EVAL_FUSED), over a sweep of its launch (rows and columns a tile, D a product step,
    warps, stages; `fused` rows): against the default blocked pass above, and its largest
    difference from it."""
    dev = cuda_or_exit("kernels.py eval-head")
    quick = args.quick
    gen = torch.Generator(device=dev).manual_seed(0)
    N, D, V = 32768, 512, 50304
    h = torch.randn(N, D, device=dev, generator=gen).to(torch.bfloat16)
    w = (torch.randn(V, D, device=dev, generator=gen) * 0.05).to(torch.bfloat16)
    t = torch.randint(0, V, (N,), device=dev, generator=gen)
    want = head._forward_nll(h, w, t, 16384)[0]
    exact = torch.cat([torch.logsumexp(z, 1) - z.gather(1, tb[:, None])[:, 0]   # float32 logits
                       for z, tb in ((h[r].float() @ w.float().t(), t[r])
                                     for r in head._blocks(N, 4096))])
    chosen = ce_triton.LAUNCH["nll"]
    rows_out = []
    try:
        for launch in ((chosen,) if quick else ((2048, 4), (4096, 4), (8192, 8))):
            ce_triton.LAUNCH["nll"] = launch
            for rows in ((16384,) if quick else (16384, 4096, 1024, 512, 384, 256, 192, 128, 64)):
                got = head._forward_nll(h, w, t, rows)[0]
                err = float((got - want).abs().max())
                ms = median_ms(lambda: head._forward_nll(h, w, t, rows), dev, 20, 3, graph=True)
                mm = median_ms(lambda: [h[s] @ w.t() for s in head._blocks(N, rows)], dev, 20, 3,
                               graph=True)
                rows_out.append(dict(launch=launch, block_rows=rows, ms=ms, matmul_only_ms=mm,
                                     maxerr=err,
                                     maxerr_vs_float32_logits=float((got - exact).abs().max())))
                print(json.dumps(rows_out[-1]), flush=True)
    finally:
        ce_triton.LAUNCH["nll"] = chosen
    fused = []
    kept = dict(linear_nll_triton.LAUNCH)
    try:
        for bm, bn, bk, warps, stages in SWEEP:
            linear_nll_triton.LAUNCH.update(BM=bm, BN=bn, BK=bk, warps=warps, stages=stages)
            row = dict(BM=bm, BN=bn, BK=bk, warps=warps, stages=stages)
            try:
                got = linear_nll_triton.linear_nll(h, w, t)[0]
                err = float((got - want).abs().max())
                ms = median_ms(lambda: linear_nll_triton.linear_nll(h, w, t), dev, 20, 3, graph=True)
                row.update(ms=ms, maxerr_vs_blocked=err,
                           maxerr_vs_float32_logits=float((got - exact).abs().max()))
            except Exception as e:   # record and go on (a tile may not fit)
                row["error"] = f"{type(e).__name__}: {str(e)[-300:]}"
            fused.append(row)
            print(json.dumps({"fused": row}), flush=True)
        best = min((r for r in fused if "ms" in r), key=lambda r: r["ms"])
        linear_nll_triton.LAUNCH.update({k: best[k] for k in kept})
        target = linear_nll_triton.TARGET_PROGRAMS
        for programs in TARGETS:
            linear_nll_triton.TARGET_PROGRAMS = programs
            row = {**{k: best[k] for k in kept}, "target_programs": programs,
                   "split": linear_nll_triton.split_for(N, V, best["BM"], best["BN"]),
                   "ms": median_ms(lambda: linear_nll_triton.linear_nll(h, w, t), dev, 20, 3,
                                   graph=True)}
            fused.append(row)
            print(json.dumps({"fused": row}), flush=True)
        linear_nll_triton.TARGET_PROGRAMS = target
    finally:
        linear_nll_triton.LAUNCH.update(kept)
    out = {**environment(dev), "shape": {"rows": N, "d_model": D, "vocab": V}, "rows": rows_out,
           "fused": fused, "fused_launch": kept}
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1))
    return out


# ------------------------------------------------------------------------------- eval-step
def eval_step_arguments(ap) -> None:
    ap.add_argument("--lanes", type=int, default=64)
    ap.add_argument("--chunks", type=int, default=40)
    ap.add_argument("--fused-launch", default="",
                    help="the fused head's launch: BM,BN,BK,warps,stages, or a JSON of "
                         "`kernels.py eval-head` whose fastest fused row to take")
    ap.add_argument("--side-lanes", type=int, default=0,
                    help="time instead a side batch of this many lanes beside the main one (as "
                         "evaluate(side=True) runs it): each alone, then both in step")
    ap.add_argument("--side-ratio", type=float, default=3.45,
                    help="side chunks queued a main chunk (the benchmark pass's longest document's "
                         "chunks over the main batch's: 1,575 / 457)")
    ap.add_argument("--profile", type=int, default=0, metavar="N",
                    help="profile instead N plain chunk steps at full lanes (the default head and "
                         "window): the kernels by device time, by kind (out.json's `profile`; "
                         "the table beside it as _profile.txt)")
    ap.add_argument("out", nargs="?")


def eval_step(args) -> dict:
    """The 64-lane evaluation chunk step alone (no corpus, no pass around it): the wt103-70m
    model compiled as the trainer compiles it (train.compile=auto on CUDA), random weights and
    tokens, bf16 autocast, `lanes` x 512 tokens a chunk. Times, with CUDA events over `--chunks`
    chunks after warm-up, what evaluate() runs a chunk:

      plain      the compiled step, a new state each chunk (the host queues ahead of the GPU;
                 where it does not, this is the host's pace)
      graph      evaluate.StaticChunkStep replayed as a CUDA graph (the state written back into
                 its static buffers: `copy_back` alone)
      each with the blocked head and with the fused head (head.EVAL_FUSED), the attention window
      in float32 (what evaluate() kept until 2026-11-27) or in autocast's dtype, and
      `capture_ms`: the static step's making (its warm-up steps and the capture), against a
      chunk's time

        python benchmarks/kernels.py eval-step [--lanes 64] [--chunks 40] [out.json]      # CUDA

    The GPU's time per chunk without the pass's batcher, bookkeeping and host stalls: what the
    64-lane evaluation pass's tokens/s is bounded by (train_speed.py --only eval times the pass
    itself)."""
    dev = cuda_or_exit("kernels.py eval-step")
    from elephant import evaluate
    from elephant.cudagraph import kept_stream
    if args.fused_launch.endswith(".json"):
        fused = [r for r in json.loads(Path(args.fused_launch).read_text())["fused"] if "ms" in r]
        best = min(fused, key=lambda r: r["ms"])
        linear_nll_triton.LAUNCH.update({k: best[k] for k in linear_nll_triton.LAUNCH})
    elif args.fused_launch:
        nums = map(int, args.fused_launch.split(","))
        linear_nll_triton.LAUNCH.update(zip(("BM", "BN", "BK", "warps", "stages"), nums))
    from elephant.config import load_config
    from elephant.model import ElephantLM, in_eval_mode
    cfg = load_config(ROOT / "configs/wt103-70m.toml", [])
    T, B = cfg.train.chunk_len, args.lanes
    torch.manual_seed(0)
    model = ElephantLM(cfg.model).to(dev)
    model.compile_for("window")   # train.compile=auto's choice on CUDA
    autocast = bf16_autocast(dev)
    gen = torch.Generator(device=dev).manual_seed(0)
    tokens = torch.randint(0, cfg.model.vocab_size, (B, T + 1), device=dev, generator=gen)
    mask = torch.ones(B, T, dtype=torch.bool, device=dev)
    reset = torch.zeros(B, dtype=torch.bool, device=dev)
    rows = {}

    def chunk(state, lanes: int = B):
        """One plain chunk step of the first `lanes` lanes: (per-token NLL, the new state)."""
        with autocast():
            return model(tokens[:lanes, :-1], state, reset[:lanes], targets=tokens[:lanes, 1:],
                         loss_mask=mask[:lanes], reduction="none")

    @in_eval_mode
    @torch.no_grad()
    def measure(model, fused: bool, kv: str) -> dict:
        head.EVAL_FUSED = fused
        kv_dtype = torch.float32 if kv == "float32" else evaluate.autocast_dtype(autocast, dev)
        state = model.init_state(B, device=dev, kv_dtype=kv_dtype)

        def plain():
            nonlocal state
            nll, state = chunk(state)
            return nll
        for _ in range(3):
            ref = plain()
        plain_ms = queued_ms(plain, args.chunks)
        torch.cuda.synchronize()     # the host's time to queue a chunk, the GPU drained first
        host = time.perf_counter()
        plain()
        host_ms = (time.perf_counter() - host) * 1e3
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        step = evaluate.StaticChunkStep(model, state, tokens, mask, autocast, graph=True)
        torch.cuda.synchronize()
        capture_ms = (time.perf_counter() - t0) * 1e3
        graph_ms = queued_ms(lambda: step(tokens, mask, reset), args.chunks)
        pairs = [(t, t.clone()) for t in step.state.tensors().values()]
        copy_ms = queued_ms(lambda: [a.copy_(b) for a, b in pairs], args.chunks)
        state_gb = sum(t.numel() * t.element_size() for t, _ in pairs) / 1e9
        nll = step(tokens, mask, reset).float()
        return {"plain_ms": plain_ms, "plain_host_ms": host_ms, "graph_ms": graph_ms,
                "capture_ms": capture_ms, "copy_back_ms": copy_ms, "state_gb": state_gb,
                "plain_tokens_per_s": B * T / plain_ms * 1e3,
                "graph_tokens_per_s": B * T / graph_ms * 1e3,
                "nll_mean": float(nll.mean()), "plain_nll_mean": float(ref.float().mean())}

    @in_eval_mode
    @torch.no_grad()
    def beside(model, side_lanes: int, ratio: float, priority: int) -> dict:
        """The main batch (lanes - side_lanes) and a side batch on a stream of `priority`, each a
        CUDA graph as evaluate() makes them: each alone, then both queued in step."""
        kv_dtype = evaluate.autocast_dtype(autocast, dev)

        def static(lanes: int, stream):
            tok, m, r = tokens[:lanes], mask[:lanes], reset[:lanes]
            with torch.cuda.stream(stream) if stream is not None else nullcontext():
                _, state = chunk(model.init_state(lanes, device=dev, kv_dtype=kv_dtype), lanes)
                step = evaluate.StaticChunkStep(model, state, tok, m, autocast, graph=True,
                                                stream=stream)

            def run():
                with torch.cuda.stream(stream) if stream is not None else nullcontext():
                    step(tok, m, r)
            return run
        here = torch.cuda.current_stream()
        side = kept_stream(dev, priority)
        main_step, side_step = static(B - side_lanes, None), static(side_lanes, side)
        n_side = round(args.chunks * ratio)
        main_ms = queued_ms(main_step, args.chunks) * args.chunks
        with torch.cuda.stream(side):   # the events on the side batch's stream
            side_ms = queued_ms(side_step, n_side) * n_side

        def both():
            queued = 0.0
            side.wait_stream(here)
            for _ in range(args.chunks):
                main_step()
                queued += ratio
                while queued >= 1:
                    side_step()
                    queued -= 1
            here.wait_stream(side)
        both_ms = queued_ms(both, 1)
        return {"main_lanes": B - side_lanes, "side_lanes": side_lanes, "priority": priority,
                "main_chunks": args.chunks, "side_chunks": n_side, "main_alone_ms": main_ms,
                "side_alone_ms": side_ms, "both_ms": both_ms,
                "side_chunk_alone_ms": side_ms / n_side,
                # the share of the side batch's own time that running beside the main one hid
                "hidden": (main_ms + side_ms - both_ms) / side_ms}

    @in_eval_mode
    @torch.no_grad()
    def profiled(model) -> dict:
        state = model.init_state(B, device=dev, kv_dtype=evaluate.autocast_dtype(autocast, dev))

        def plain():
            nonlocal state
            _, state = chunk(state)
        for _ in range(3):
            plain()
        kernels, table, summary = profile(plain, args.profile, dev,
                                          f"evaluation chunk step, {B} lanes x {T}", top=40)
        if args.out:
            Path(args.out).with_name(Path(args.out).stem + "_profile.txt").write_text(table)
        return {"top_kernels": kernels, "summary": summary}

    kept = head.EVAL_FUSED
    if args.profile:
        rows["profile"] = profiled(model)
        print(json.dumps(rows["profile"]["summary"]["by_kind"], indent=1), flush=True)
        print(json.dumps({"device_ms_per_step": rows["profile"]["summary"]["device_ms_per_step"],
                          "gaps": rows["profile"]["summary"].get("gaps")})[:1500], flush=True)
    if args.side_lanes:
        head.EVAL_FUSED = kept
        for priority in (-1, 0, -1, 0):
            rows.setdefault("beside", []).append(beside(model, args.side_lanes, args.side_ratio, priority))
            print("beside", json.dumps(rows["beside"][-1]), flush=True)
    try:
        # in turns: the GPU's clock drifts with its heat
        for fused, kv in () if args.side_lanes or args.profile else (
                (False, "float32"), (False, "autocast"), (True, "autocast")) * 2:
            name = ("fused" if fused else "blocked") + f" head, {kv} window"
            rows.setdefault(name, []).append(measure(model, fused, kv))
            print(name, json.dumps(rows[name][-1]), flush=True)
    finally:
        head.EVAL_FUSED = kept
    out = {**environment(dev), "lanes": B, "chunk_len": T, "chunks": args.chunks, "rows": rows,
           "fused_launch": dict(linear_nll_triton.LAUNCH)}
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1))
    return out
