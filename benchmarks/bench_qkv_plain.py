"""Where the plain q/k path's time went (issue 12, session 17): Attention.project's math after the
qkv projection (q/k RMS norm and rotary), compiled, in variants, at the recipe's shape (32 x 528
tokens, 8 heads of 64, bf16):

    python benchmarks/bench_qkv_plain.py [VARIANT ...]   (CUDA; default: all four)

today      the plain path as it was: permuted to (B, H, S, hd), normalized, rotated (float64 angles)
rows       normalized and rotated in (B, S, H, hd) order, the permute left to views
tables     today's, with the rotary tables computed once outside (no trig in the kernel)
f32angles  today's, with the angles in float32

Prints the forward alone as a CUDA graph (fwd_us), forward + backward timed eagerly (fwd_bwd_us;
the backward does not capture), and the kernels of 5 forward + backward steps by device time.
The plain path is now the reference of layers/rotary_triton.py, the kernel that replaced it.
"""
import json
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import cuda_or_exit, median_ms  # noqa: E402
from elephant.layers.attention import apply_rotary, rotary_cos_sin  # noqa: E402

B, S, H, hd = 32, 528, 8, 64


def variants(wq, wk, tables_cos, tables_sin):
    """The four forms of the plain path, over y (B, S, 3 H hd) and positions (B, S)."""
    def qk(y):
        q, k, v = y.view(B, S, 3, H, hd).permute(2, 0, 3, 1, 4).unbind(0)    # (B, H, S, hd)
        return F.rms_norm(q.float(), (hd,), wq, 1e-6), F.rms_norm(k.float(), (hd,), wk, 1e-6), v

    def rotated(q, k, v, cos, sin):
        return apply_rotary(q, cos, sin).to(v.dtype), apply_rotary(k, cos, sin).to(v.dtype), v

    def today(y, pos):
        return rotated(*qk(y), *rotary_cos_sin(pos, hd, 10000.0, torch.float32))

    def rows(y, pos):
        q, k, v = y.view(B, S, 3, H, hd).unbind(2)                          # (B, S, H, hd)
        q = F.rms_norm(q.float(), (hd,), wq, 1e-6)
        k = F.rms_norm(k.float(), (hd,), wk, 1e-6)
        cos, sin = rotary_cos_sin(pos, hd, 10000.0, torch.float32)          # (B, 1, S, hd/2)
        cos, sin = cos.transpose(1, 2), sin.transpose(1, 2)                  # (B, S, 1, hd/2)
        qo, ko, v = rotated(q, k, v, cos, sin)
        return qo.transpose(1, 2), ko.transpose(1, 2), v.transpose(1, 2)

    def tables(y, pos):
        return rotated(*qk(y), tables_cos, tables_sin)

    def f32angles(y, pos):
        inv = 10000.0 ** (-torch.arange(0, hd, 2, device=y.device, dtype=torch.float32) / hd)
        angle = pos.float().unsqueeze(-1) * inv
        return rotated(*qk(y), angle.cos().unsqueeze(1), angle.sin().unsqueeze(1))

    return {"today": today, "rows": rows, "tables": tables, "f32angles": f32angles}


def main() -> None:
    from torch.profiler import ProfilerActivity, profile
    dev = cuda_or_exit("bench_qkv_plain")
    g = torch.Generator(device=dev).manual_seed(0)
    y = torch.randn(B, S, 3 * H * hd, device=dev, generator=g, dtype=torch.bfloat16).requires_grad_()
    pos = torch.arange(S, device=dev).expand(B, S) + 1000
    ones = torch.ones(hd, device=dev)
    forms = variants(ones, ones, *rotary_cos_sin(pos, hd, 10000.0, torch.float32))
    for name in sys.argv[1:] or forms:
        c = torch.compile(forms[name], dynamic=False)
        o = c(y, pos)
        grads = [torch.randn_like(t) for t in o]
        ref = forms["today"](y, pos)
        assert all(torch.allclose(a.float(), b.float(), atol=2e-2) for a, b in zip(o, ref)), name

        def step():
            torch.autograd.grad(c(y, pos), y, grads)
        for _ in range(3):
            step()
        fwd = [median_ms(lambda: c(y, pos), dev, 50, 10, graph=True) for _ in range(3)]
        both = [median_ms(step, dev, 50, 10, graph=False) for _ in range(3)]
        row = {"fwd_us": statistics.median(fwd) * 1e3, "fwd_bwd_us": statistics.median(both) * 1e3,
               "strides": [tuple(t.stride()) for t in o]}
        print(name, json.dumps(row), flush=True)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                step()
            torch.cuda.synchronize()
        ev = [e for e in prof.key_averages() if e.device_type.name == "CUDA"]
        for e in sorted(ev, key=lambda e: -e.self_device_time_total)[:8]:
            print(f"   {e.self_device_time_total / 5:8.1f} us/step  x{e.count // 5}  {e.key[:90]}")


if __name__ == "__main__":
    main()
