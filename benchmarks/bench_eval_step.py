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
    ap.add_argument("out", nargs="?")
    args = ap.parse_args()
    dev = cuda_or_exit("bench_eval_step")
    from elephant import evaluate
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

    @in_eval_mode
    @torch.no_grad()
    def measure(model, fused: bool, kv: str) -> dict:
        head.EVAL_FUSED = fused
        kv_dtype = torch.float32 if kv == "float32" else evaluate.autocast_dtype(autocast, dev)
        state = model.init_state(B, device=dev, kv_dtype=kv_dtype)

        def plain():
            nonlocal state
            with autocast():
                nll, state = model(tokens[:, :-1], state, reset, targets=tokens[:, 1:],
                                   loss_mask=mask, reduction="none")
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

    kept = head.EVAL_FUSED
    try:
        # in turns: the GPU's clock drifts with its heat
        for fused, kv in ((False, "float32"), (False, "autocast"), (True, "autocast")) * 2:
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
