"""The Mamba block's scan and conv backward at the recipe's chunk, before and after the scan's joint
gradient: the older modules (the scan's three gradients, the compiled concatenation and SiLU' pass,
the conv's backward) against this checkout's (the scan writing the three into one tensor, SiLU'
taken by the conv's kernels as they read it).

    git show 5fc47ff:elephant/layers/ssd_triton.py > /tmp/ssd_before.py
    git show 5fc47ff:elephant/layers/conv_triton.py > /tmp/conv_before.py
    python benchmarks/bench_mamba_bwd.py /tmp/ssd_before.py /tmp/conv_before.py [OUT.json]

Shape: 32 lanes x 528 tokens, 16 heads of 64, d_state 64, one B/C group, bf16; each form captured
as a CUDA graph and timed by CUDA events (median of 50 replays after 10), whole and by part; the
outputs compared (dx, dstate, dw, db, dtail, relative to the older form).
"""
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.common import compiled_registers, load_before, median_ms  # noqa: E402
from elephant.layers import conv_triton as CT  # noqa: E402
from elephant.layers import ssd_triton as T  # noqa: E402

dev = torch.device("cuda")
b, l, h, p, g, n, Q, K = 32, 528, 16, 64, 1, 64, 64, 4
hp, gn = h * p, g * n
cd = hp + 2 * gn
torch.manual_seed(0)
xin = torch.randn(b, l, cd, device=dev, dtype=torch.bfloat16)
state = torch.randn(b, cd, K - 1, device=dev, dtype=torch.bfloat16)
w = torch.randn(cd, 1, K, device=dev) * 0.3
bias = torch.randn(cd, device=dev) * 0.1
v = CT._conv_silu_op(xin, state, w, bias, None, None, None, False)[0]
act = F.silu(v)
x = act[..., :hp].view(b, l, h, p)
B = act[..., hp:hp + gn].view(b, l, g, n)
C = act[..., hp + gn:].view(b, l, g, n)
dt = F.softplus(torch.randn(b, l, h, device=dev) - 3)
A = -torch.rand(h, device=dev) * 4 - 0.5
D = torch.randn(h, device=dev)
init = torch.randn(b, h, p, n, device=dev)
nc = -(-l // Q)
cs = F.pad(dt * A, (0, 0, 0, nc * Q - l)).view(b, nc, Q, h).cumsum(2).permute(0, 3, 1, 2).contiguous()
_, _, states = T._fwd(x, dt, cs, None, B, C, D, init, None, Q)
dy = torch.randn(b, l, h, p, device=dev, dtype=torch.bfloat16)
dfinal = torch.randn(b, h, p, n, device=dev)
args = (x, dt, cs, None, B, C, D, init, None, states, dy, dfinal, Q)
TH = load_before(sys.argv[1], "ssd_triton_before")
CH = load_before(sys.argv[2], "conv_triton_before")


@torch.compile
def cat_silu(dx, dBC, v):
    gr = torch.cat([dx.view(b, l, hp), dBC[..., 0, :].reshape(b, l, gn).to(torch.bfloat16),
                    dBC[..., 1, :].reshape(b, l, gn).to(torch.bfloat16)], -1).float()
    vf = v.float()
    s = torch.sigmoid(vf)
    return (gr * s * (1 + vf * (1 - s))).to(torch.bfloat16)


def before():
    o = TH._bwd(*args, summed=False)
    gg = cat_silu(o[0], o[3], v)
    return CH._conv_bwd_op(gg, xin, state, w, None, None, None)


def after():
    o = T._bwd(*args, summed=False, joint=True)
    return CT._conv_bwd_op(o[0], xin, state, w, None, None, None, False, v)


def after_scan():
    return T._bwd(*args, summed=False, joint=True)


def before_scan():
    return TH._bwd(*args, summed=False)


def after_conv(gj=T._bwd(*args, summed=False, joint=True)[0]):
    return CT._conv_bwd_op(gj, xin, state, w, None, None, None, False, v)


def before_conv(gg=cat_silu(*(lambda o: (o[0], o[3]))(TH._bwd(*args, summed=False)), v)):
    return CH._conv_bwd_op(gg, xin, state, w, None, None, None)


res = {}
r0, r1 = before(), after()
res["rel_err"] = [((a.float() - c.float()).abs().max() / c.float().abs().max()).item() for a, c in zip(r1, r0)]
for name, fn in (("before", before), ("after", after), ("before_scan", before_scan), ("after_scan", after_scan),
                 ("before_conv", before_conv), ("after_conv", after_conv)):
    res[name + "_us"] = median_ms(fn, dev, 50, 10, graph=True) * 1e3
    print(name, round(res[name + "_us"], 1), flush=True)
res["walk_registers_after"] = compiled_registers(CT._conv_bwd_walk_kernel)
res["walk_registers_before"] = compiled_registers(CH._conv_bwd_walk_kernel)
print(res)
if len(sys.argv) > 3:
    Path(sys.argv[3]).write_text(json.dumps(res, indent=1))
