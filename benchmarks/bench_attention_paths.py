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
  varlen      FlashAttention-2 varlen over 2B sequences: per lane a sequence of the invalid cache
              slots with no queries, then the queries over [valid slots | chunk], lower-right
              causal; q, k, v in (B, S, H, hd) rows as the varlen kernel reads them
  varlen_empty  the same with 64 more empty sequences per lane (what a layout with room for a
              document's segments per lane would launch)
(The model's path, attention.attend_varlen, is `varlen` on the layer's (B, H, S, hd) tensors.)
  flex        FlexAttention compiled with a block mask built in the same graph
  chunk_only  causal SDPA over the chunk alone (the work without the window, a floor)
Each path's forward is timed as a CUDA graph (flex: as compiled), its forward and backward eagerly
(fwd_bwd_ms: the host's launches included) and by the device time of its kernels in the profiler
(fwd_bwd_device_ms), the mask or the K / V concatenation inside, the sequence bounds outside (built
once per chunk for all its layers). Every path's output and gradients (q, the chunk's k and v)
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
from elephant.layers.attention import attend_reference, flash_varlen, varlen_bounds  # noqa: E402


def bounds_with_empty(n_valid, S, W, empty: int = 0):
    """attention.varlen_bounds, then `empty` sequences of nothing per lane (all at the end: the
    kernel's cost of a layout with room for more sequences than a chunk has)."""
    cu_q, cu_k = varlen_bounds(n_valid, S, W)
    if not empty:
        return cu_q, cu_k
    pad = lambda cu: torch.cat([cu, cu[-1:].expand(n_valid.shape[0] * empty)])  # noqa: E731
    return pad(cu_q), pad(cu_k)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--no-flex", action="store_true")
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
        cu_q, cu_k = bounds_with_empty(n_valid, S, W, empty)   # once a chunk, for all its layers

        def run():
            K = torch.cat([cache_k, k_rows], 1).flatten(0, 1)
            V = torch.cat([cache_v, v_rows], 1).flatten(0, 1)
            out = flash_varlen(q_rows.flatten(0, 1), K, V, cu_q, cu_k, S, W + S, scale)
            return out.view(B, S, H, hd)
        return run

    def chunk_only():
        return heads(F.scaled_dot_product_attention(heads(q_rows), heads(k_rows), heads(v_rows),
                                                    is_causal=True))

    paths = {"masked": masked, "fa2_causal": fa2_causal, "varlen": varlen(),
             "varlen_empty": varlen(64), "chunk_only": chunk_only}
    if not args.no_flex:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        def flex_fn(q, k, v, ck, cv, valid):
            K = torch.cat([ck, k], 2)
            V = torch.cat([cv, v], 2)
            kv_valid = torch.cat([valid, valid.new_ones(B, S)], 1)

            def mask_mod(b, h, qi, kj):
                return kv_valid[b, kj] & (kj - W <= qi)
            bm = create_block_mask(mask_mod, B, None, S, W + S, device=q.device)
            return flex_attention(q, K, V, block_mask=bm)
        flex_c = torch.compile(flex_fn, dynamic=False)

        def flex():
            return heads(flex_c(heads(q_rows), heads(k_rows), heads(v_rows), heads(cache_k),
                                heads(cache_v), valid))
        paths["flex"] = flex

    def fwd_bwd(fn):
        def run():
            out = fn()
            return (out,) + torch.autograd.grad(out, (q_rows, k_rows, v_rows), dout)
        return run

    ref = fwd_bwd(masked)()
    rows = []
    for name, fn in paths.items():
        got = fwd_bwd(fn)()
        err = None
        if name not in ("fa2_causal", "chunk_only"):
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
