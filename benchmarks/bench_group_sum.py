"""The scan backward's head sum (ssd_triton.group_sum: dB and dC per head summed over each B/C
group's heads, one launch for both) at the recipe's shape, timed over its launch choices beside the
two torch sums it replaced.

    python benchmarks/bench_group_sum.py [--tokens 16896] [--heads 16] [--width 128]

The recipe (wt103-70m: 32 lanes x (512 + 16 memory slots), 16 heads, dB and dC of 64 each) gives
16,896 tokens of 16 x 128 bf16. Writes benchmarks/results/group_sum_<gpu>.json: microseconds a call
and the read bandwidth for each (tokens a program, warps), and the torch sums'.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import cuda_or_exit, environment, median_ms, result_path, sweep_parser  # noqa: E402


def main() -> None:
    ap = sweep_parser(100, 10)
    ap.add_argument("--tokens", type=int, default=16896)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--width", type=int, default=128, help="dB and dC side by side: 2 x d_state")
    args = ap.parse_args()
    device = cuda_or_exit("bench_group_sum")
    import triton
    from elephant.layers import ssd_triton as T
    src = torch.randn(args.tokens, args.heads, args.width, device=device).bfloat16()
    want = src.float().sum(1, keepdim=True)
    half = args.width // 2
    res = {**environment(device), "shape": [args.tokens, args.heads, args.width], "launches": []}

    def timed(fn):
        return median_ms(fn, device, args.iters, args.warmup, graph=True) * 1e3
    res["torch_two_sums_us"] = timed(lambda: (src[..., :half].sum(1, dtype=torch.float32),
                                              src[..., half:].sum(1, dtype=torch.float32)))
    res["group_sum_us"] = timed(lambda: T.group_sum(src, 1))
    out = torch.empty(args.tokens, 1, args.width, device=device)
    BW = triton.next_power_of_2(args.width)
    for bt in (4, 8, 16, 32):
        for warps in (2, 4, 8):
            def fn():
                T._group_sum_kernel[(triton.cdiv(args.tokens, bt), 1)](
                    src, out, args.tokens, args.heads, args.width, 0, args.heads, BT=bt, BW=BW,
                    JOINT=False, num_warps=warps)
            us = timed(fn)
            assert torch.allclose(out, want, rtol=1e-4, atol=1e-3)
            res["launches"].append({"tokens": bt, "warps": warps, "us": us,
                                    "read_tb_s": src.numel() * 2 / us / 1e6})
            print(f"{bt:3d} tokens, {warps} warps: {us:6.1f} us", flush=True)
    print(f"group_sum (its launch): {res['group_sum_us']:.1f} us; torch, two sums: "
          f"{res['torch_two_sums_us']:.1f} us")
    path = result_path("group_sum", False)
    path.write_text(json.dumps(res, indent=1))
    print("wrote", path)


if __name__ == "__main__":
    main()
