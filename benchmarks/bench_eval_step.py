"""The 64-lane evaluation chunk step alone (no corpus, no pass around it): the wt103-70m model
compiled as the trainer compiles it (train.compile=auto on CUDA), random weights and tokens, bf16
autocast, `lanes` x 512 tokens a chunk. Times, with CUDA events over `--chunks` chunks after
warm-up, what evaluate() runs a chunk:

  plain      the compiled step, a new state each chunk (the host queues ahead of the GPU; where it
             does not, this is the host's pace)
  graph      evaluate.StaticChunkStep replayed as a CUDA graph (the state written back into its
             static buffers: `copy_back` alone)
  each with the blocked head and with the fused head (head.EVAL_FUSED), the attention window in
  float32 (what evaluate() kept until session 40) or in autocast's dtype, and `capture_ms`: the
  static step's making (its warm-up steps and the capture), against a chunk's time

    python benchmarks/bench_eval_step.py [--lanes 64] [--chunks 40] [out.json]      # CUDA

The GPU's time per chunk without the pass's batcher, bookkeeping and host stalls: what the 64-lane
evaluation pass's tokens/s is bounded by (train_speed.py --only eval times the pass itself).
"""
import argparse
import json
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.common import bf16_autocast, cuda_or_exit, environment  # noqa: E402


def events_ms(fn, chunks: int) -> float:
    """Mean ms a call over `chunks` calls queued back to back (one event pair around them all)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(chunks):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / chunks


def main() -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lanes", type=int, default=64)
    ap.add_argument("--chunks", type=int, default=40)
    ap.add_argument("--fused-launch", default="",
                    help="the fused head's launch: BM,BN,BK,warps,stages, or a JSON of "
                         "bench_eval_head.py whose fastest fused row to take")
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
    args = ap.parse_args()
    dev = cuda_or_exit("bench_eval_step")
    from elephant import evaluate
    from elephant.cudagraph import kept_stream
    from elephant.layers import linear_nll_triton
    if args.fused_launch.endswith(".json"):
        fused = [r for r in json.loads(Path(args.fused_launch).read_text())["fused"] if "ms" in r]
        best = min(fused, key=lambda r: r["ms"])
        linear_nll_triton.LAUNCH.update({k: best[k] for k in linear_nll_triton.LAUNCH})
    elif args.fused_launch:
        nums = map(int, args.fused_launch.split(","))
        linear_nll_triton.LAUNCH.update(zip(("BM", "BN", "BK", "warps", "stages"), nums))
    from elephant.config import load_config
    from elephant.layers import head
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
        plain_ms = events_ms(plain, args.chunks)
        torch.cuda.synchronize()     # the host's time to queue a chunk, the GPU drained first
        host = time.perf_counter()
        plain()
        host_ms = (time.perf_counter() - host) * 1e3
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        step = evaluate.StaticChunkStep(model, state, tokens, mask, autocast, graph=True)
        torch.cuda.synchronize()
        capture_ms = (time.perf_counter() - t0) * 1e3
        graph_ms = events_ms(lambda: step(tokens, mask, reset), args.chunks)
        pairs = [(t, t.clone()) for t in step.state.tensors().values()]
        copy_ms = events_ms(lambda: [a.copy_(b) for a, b in pairs], args.chunks)
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
        main_ms = events_ms(main_step, args.chunks) * args.chunks
        with torch.cuda.stream(side):   # the events on the side batch's stream
            side_ms = events_ms(side_step, n_side) * n_side

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
        both_ms = events_ms(both, 1)
        return {"main_lanes": B - side_lanes, "side_lanes": side_lanes, "priority": priority,
                "main_chunks": args.chunks, "side_chunks": n_side, "main_alone_ms": main_ms,
                "side_alone_ms": side_ms, "both_ms": both_ms,
                "side_chunk_alone_ms": side_ms / n_side,
                # the share of the side batch's own time that running beside the main one hid
                "hidden": (main_ms + side_ms - both_ms) / side_ms}

    @in_eval_mode
    @torch.no_grad()
    def profiled(model) -> dict:
        from benchmarks.common import profile
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
    out = {**environment(dev), "command": " ".join(["python benchmarks/bench_eval_step.py"] + sys.argv[1:]),
           "lanes": B, "chunk_len": T, "chunks": args.chunks, "rows": rows,
           "fused_launch": dict(linear_nll_triton.LAUNCH)}
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
