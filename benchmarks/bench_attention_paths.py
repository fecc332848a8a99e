"""Attention over [the lane's cached window | this chunk] at the recipe's shape, forward and
backward, by several kernels: which one the chunk step should take.

    python benchmarks/bench_attention_paths.py [--no-flex]
        # CUDA: benchmarks/results/attention_paths_<gpu>.json

Shape: one chunk step of the wt103-70m recipe, 32 lanes x (8 + 512 + 8) queries, a window of 512
cached keys, 8 heads of 64, bfloat16. The cache's valid slots are a suffix of the window per lane
(the KVCache invariant): a quarter of the lanes all valid, a quarter none (a document began with
the chunk), the rest a random suffix. Paths:
  masked      today's: SDPA with the explicit boolean mask (B, 1, S, W + S), keys padded to 16
  fa2_causal  FlashAttention-2's causal form with more keys than queries, which is lower-right
              aligned: the mask as if every cache slot were valid (a bound, not a candidate)
  varlen      the model's path, attention.attend_varlen: FlashAttention-2 varlen over 2B sequences,
              per lane a sequence of the invalid cache slots with no queries, then the queries over
              [valid slots | chunk], lower-right causal; q, k, v here in (B, S, H, hd) rows, as the
              varlen kernel reads them
  varlen_empty  the same with 64 more empty sequences per lane (what a layout with room for a
              document's segments per lane would launch)
  flex        attention.attend_flex compiled, its block mask built in the same graph
  chunk_only  causal SDPA over the chunk alone (the work without the window, a floor)
  cudnn_split[_full|_nobias]  cuDNN's attention twice, merged by their log-sum-exps: the queries
              over the window (no causal form; the invalid slots by an additive bias of -30000, a
              (B, 1, 1, W) row broadcast over the queries, or _full: written out (B, 1, S, W);
              _nobias: every slot valid, a bound), and causally over the chunk; the backward is
              cuDNN's backward of each part with the merged output and log-sum-exp (the blockwise
              form of exact attention), so the window's part gives only dq
Each path's forward is timed as a CUDA graph (flex: as compiled), its forward and backward eagerly
(fwd_bwd_ms: the host's launches included) and by the device time of its kernels in the profiler
(fwd_bwd_device_ms), the mask, the K / V concatenation and the sequence bounds inside (the
results of 2026-11-25 10:59 were taken with the bounds outside and the layout written out here;
the same kernels). Every path's output and gradients (q, the chunk's k and v)
are checked against `masked`.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.common import (cuda_or_exit, environment, median_ms, profile,  # noqa: E402
                               result_path)
from elephant.layers.attention import (attend_flex, attend_reference, attend_varlen,  # noqa: E402
                                       flash_varlen)


def with_empty(empty: int):
    """The varlen kernel with `empty` sequences of nothing per lane appended to its bounds (all at
    the end): the cost of a layout with room for more sequences than a chunk has."""
    def kernel(q, k, v, cu_q, cu_k, max_q, max_k, scale):
        pad = lambda cu: torch.cat([cu, cu[-1:].expand((len(cu) - 1) // 2 * empty)])  # noqa: E731
        return flash_varlen(q, k, v, pad(cu_q), pad(cu_k), max_q, max_k, scale)
    return kernel


CUDNN = torch.ops.aten._scaled_dot_product_cudnn_attention
CUDNN_BWD = torch.ops.aten._scaled_dot_product_cudnn_attention_backward


class SplitCudnn(torch.autograd.Function):
    """Attention over [window | chunk] as two cuDNN calls merged by log-sum-exp (see `cudnn_split`).
    q, k, v (B, H, S, hd), ck, cv (B, H, W, hd) carrying no gradient, bias (B, 1, S, W) or None."""

    @staticmethod
    def forward(ctx, q, k, v, ck, cv, bias, scale):
        o1, l1, *_, seed1, off1, _ = CUDNN(q, ck, cv, bias, True, 0.0, False, False, scale=scale)
        o2, l2, *_, seed2, off2, _ = CUDNN(q, k, v, None, True, 0.0, True, False, scale=scale)
        shape = q.shape[:3] + (1,)
        a, b = l1.float().reshape(shape), l2.float().reshape(shape)
        lse = torch.logaddexp(a, b)
        out = (o1.float() * torch.exp(a - lse) + o2.float() * torch.exp(b - lse)).to(q.dtype)
        lse = lse.reshape(l1.shape).to(l1.dtype)
        ctx.save_for_backward(q, k, v, ck, cv, bias, out, lse, seed1, off1, seed2, off2)
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, ck, cv, bias, out, lse, seed1, off1, seed2, off2 = ctx.saved_tensors
        S, W = q.shape[2], ck.shape[2]
        dout = dout.contiguous()
        dq1, _, _ = CUDNN_BWD(dout, q, ck, cv, out, lse, seed1, off1, bias, None, None, S, W, 0.0,
                              False, scale=ctx.scale)
        dq2, dk, dv = CUDNN_BWD(dout, q, k, v, out, lse, seed2, off2, None, None, None, S, S, 0.0,
                                True, scale=ctx.scale)
        return dq1 + dq2, dk, dv, None, None, None, None


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--no-flex", action="store_true")
    ap.add_argument("--paths", default="", help="comma-separated subset of the paths to time")
    args = ap.parse_args()
    device = cuda_or_exit("bench_attention_paths")
    B, H, S, W, hd = 32, 8, 8 + 512 + 8, 512, 64
    dt = torch.bfloat16
    gen = torch.Generator(device=device).manual_seed(0)
    # (B, S, H, hd) rows, the layout the varlen kernel reads; the other paths take (B, H, S, hd) views
    q_rows = torch.randn(B, S, H, hd, generator=gen, device=device, dtype=dt).requires_grad_()
    k_rows = torch.randn(B, S, H, hd, generator=gen, device=device, dtype=dt).requires_grad_()
    v_rows = torch.randn(B, S, H, hd, generator=gen, device=device, dtype=dt).requires_grad_()
    cache_k = torch.randn(B, W, H, hd, generator=gen, device=device, dtype=dt)
    cache_v = torch.randn(B, W, H, hd, generator=gen, device=device, dtype=dt)
    n_valid = torch.randint(0, W + 1, (B,), generator=gen, device=device)
    n_valid[: B // 4] = W
    n_valid[B // 4: B // 2] = 0
    slot = torch.arange(W, device=device)
    valid = slot[None, :] >= (W - n_valid)[:, None]                       # a suffix per lane
    dout = torch.randn(B, S, H, hd, generator=gen, device=device, dtype=dt)
    scale = hd ** -0.5

    def heads(t):
        return t.transpose(1, 2)

    def masked():
        return heads(attend_reference(heads(q_rows), heads(k_rows), heads(v_rows), heads(cache_k),
                                      heads(cache_v), valid))

    def fa2_causal():
        K = torch.cat([cache_k, k_rows], 1)
        V = torch.cat([cache_v, v_rows], 1)
        out = torch.ops.aten._scaled_dot_product_flash_attention(
            heads(q_rows), heads(K), heads(V), 0.0, True, False, scale=scale)[0]
        return heads(out)

    def varlen(empty=0):
        kernel = with_empty(empty) if empty else flash_varlen

        def run():   # the model's path (the bounds built inside, as each layer does)
            return heads(attend_varlen(heads(q_rows), heads(k_rows), heads(v_rows), heads(cache_k),
                                       heads(cache_v), valid, kernel=kernel))
        return run

    def chunk_only():
        return heads(F.scaled_dot_product_attention(heads(q_rows), heads(k_rows), heads(v_rows),
                                                    is_causal=True))

    def cudnn_split(form):
        row = torch.where(valid, 0.0, -30000.0).to(dt)[:, None, None, :]          # (B, 1, 1, W)
        bias = {"bcast": row.expand(B, 1, S, W), "full": row.expand(B, 1, S, W).contiguous(),
                "none": None}[form]

        def run():
            return heads(SplitCudnn.apply(heads(q_rows), heads(k_rows), heads(v_rows),
                                          heads(cache_k), heads(cache_v), bias, scale))
        return run

    paths = {"masked": masked, "fa2_causal": fa2_causal, "varlen": varlen(),
             "varlen_empty": varlen(64), "chunk_only": chunk_only,
             "cudnn_split": cudnn_split("bcast"), "cudnn_split_full": cudnn_split("full"),
             "cudnn_split_nobias": cudnn_split("none")}
    if not args.no_flex:
        flex_c = torch.compile(attend_flex, dynamic=False)   # its block mask built in the graph

        def flex():
            return heads(flex_c(heads(q_rows), heads(k_rows), heads(v_rows), heads(cache_k),
                                heads(cache_v), valid))
        paths["flex"] = flex

    if args.paths:
        paths = {name: fn for name, fn in paths.items() if name in args.paths.split(",")}

    def fwd_bwd(fn):
        def run():
            out = fn()
            return (out,) + torch.autograd.grad(out, (q_rows, k_rows, v_rows), dout)
        return run

    ref = fwd_bwd(masked)()
    rows = []
    for name, fn in paths.items():
        try:
            got = fwd_bwd(fn)()
        except Exception as e:   # a kernel that refuses this form: recorded, the others go on
            rows.append({"path": name, "error": f"{type(e).__name__}: {e}"[:800]})
            print(json.dumps(rows[-1]), flush=True)
            continue
        err = None
        if name not in ("fa2_causal", "chunk_only", "cudnn_split_nobias"):
            err = [float((a.float() - b.float()).norm() / b.float().norm()) for a, b in zip(got, ref)]
        graph = name != "flex"   # as a CUDA graph: the kernels' time, not the host's launches
        fwd = median_ms(fn, device, args.iters, args.warmup, graph=graph)
        both = median_ms(fwd_bwd(fn), device, args.iters, args.warmup)
        # the backward does not capture (autograd's thread), so its device time from the profiler
        top, _, summary = profile(fwd_bwd(fn), args.iters, device, name, top=6)
        row = {"path": name, "fwd_ms": round(fwd, 4), "fwd_bwd_ms": round(both, 4),
               "fwd_bwd_device_ms": round(summary["device_ms_per_step"], 4),
               "rel_err_out_dq_dk_dv": err,
               "top_kernels": [(k["name"][:60], round(k["ms_per_step"], 4)) for k in top]}
        rows.append(row)
        print(json.dumps(row), flush=True)
    out = environment(device)
    out.update(shape={"lanes": B, "heads": H, "queries": S, "window": W, "head_dim": hd,
                      "dtype": "bfloat16", "valid": "suffix per lane: 1/4 all, 1/4 none, 1/2 random"},
               rows=rows)
    path = result_path("attention_paths", False)
    path.write_text(json.dumps(out, indent=1))
    print("wrote", path)


if __name__ == "__main__":
    main()
