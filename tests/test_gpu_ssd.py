"""The Triton SSD kernels on CUDA against the chunked PyTorch reference, at realistic shapes.

Run on a CUDA machine: `python -m pytest -m gpu tests/test_gpu_ssd.py` (skipped without CUDA).
The reference is `ssd_chunked` in float64 on the same (already rounded) inputs; tolerances are on the
relative error ||got - want|| / ||want||: float32 inputs (3xTF32 products) 1e-4, bfloat16 inputs
(bf16 matmul operands, float32 accumulation and states) 2e-2.
"""
import pytest
import torch

from elephant.config import ModelConfig
from elephant.layers import ssd, ssd_triton
from elephant.layers.mamba import Mamba2
from elephant.layers.ssd import add_segment_init, ssd_chunked, ssd_scan
from numerics import rel as rel_err

pytestmark = pytest.mark.gpu
DEVICE = "cuda"
REL_TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2}
NAMES = ["x", "dt", "A", "B", "C", "D", "initial_state"]


def make_inputs(b, l, h, g, p, n, dtype, init=True, D=True, seed=0):
    """Mamba-2-like magnitudes: dt in [1e-3, 0.1], A in -[1, 16]; x, B, C, state ~ N(0, 1)."""
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    r = lambda *s: torch.rand(*s, device=DEVICE, generator=gen)
    rn = lambda *s: torch.randn(*s, device=DEVICE, generator=gen)
    x, B, C = rn(b, l, h, p).to(dtype), rn(b, l, g, n).to(dtype), rn(b, l, g, n).to(dtype)
    dt = torch.exp(r(b, l, h) * 4.6 - 6.9)          # log-uniform in [1e-3, 1e-1]
    A = -(1 + 15 * r(h))
    Dv = rn(h) if D else None
    s0 = rn(b, h, p, n) if init else None
    return [t.requires_grad_() if t is not None else None for t in (x, dt, A, B, C, Dv, s0)]


def run(fn, inputs, wy, wf, **kw):
    y, final = fn(*inputs, **kw)
    loss = (y.double() * wy).sum() + (final.double() * wf).sum()
    live = [t for t in inputs if t is not None]
    return y, final, torch.autograd.grad(loss, live)


def check_against_reference(inputs, chunk_size, dtype, seg=None):
    ref_inputs = [t.detach().double().requires_grad_() if t is not None else None for t in inputs]
    b, l, h, p = inputs[0].shape
    gen = torch.Generator(device=DEVICE).manual_seed(123)
    wy = torch.randn(b, l, h, p, device=DEVICE, generator=gen, dtype=torch.float64)
    wf = torch.randn(b, h, p, inputs[3].shape[-1], device=DEVICE, generator=gen, dtype=torch.float64)
    y, final, grads = run(ssd_triton.ssd_triton, inputs, wy, wf, chunk_size=chunk_size, seg=seg)
    y_ref, final_ref, grads_ref = run(ssd_chunked, ref_inputs, wy, wf, chunk_size=chunk_size, seg=seg)
    assert y.dtype == dtype and final.dtype == torch.float32
    tol = REL_TOL[dtype]
    errors = {"y": rel_err(y, y_ref), "final_state": rel_err(final, final_ref)}
    names = [k for k, t in zip(NAMES, inputs) if t is not None]
    for name, got, want, t in zip(names, grads, grads_ref, [t for t in inputs if t is not None]):
        assert got.shape == t.shape and got.dtype == t.dtype, name
        errors["d" + name] = rel_err(got, want)
    bad = {k: v for k, v in errors.items() if not v < tol}
    assert not bad, f"relative errors above {tol}: {bad} (all: {errors})"


CASES = [  # b, l, h, g, p, n, chunk, init, D
    (2, 2048, 16, 1, 64, 64, 64, True, True),    # the benchmark's head shape
    (3, 1000, 8, 1, 64, 128, 64, True, True),    # length not a multiple of the chunk; d_state 128
    (2, 300, 4, 2, 32, 64, 32, False, True),     # two groups, no initial state, chunk 32
    (1, 45, 2, 1, 128, 64, 128, True, False),    # shorter than one chunk; chunk 128; no D
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("b,l,h,g,p,n,chunk,init,D", CASES)
def test_triton_equals_chunked_on_cuda(dtype, b, l, h, g, p, n, chunk, init, D):
    inputs = make_inputs(b, l, h, g, p, n, dtype, init=init, D=D)
    if not ssd_triton.supports(inputs[0], inputs[3], chunk):
        # beyond the kernels' limits the dispatcher must fall back to the reference, exactly
        with torch.no_grad():
            got = ssd_scan(*inputs, chunk_size=chunk)
            want = ssd_chunked(*inputs, chunk_size=chunk)
        assert all(torch.equal(a, b) for a, b in zip(got, want))
        return
    check_against_reference(inputs, chunk, dtype)


def test_triton_carried_state_equals_one_pass_on_cuda():
    x, dt, A, B, C, D, s0 = make_inputs(2, 1000, 8, 1, 64, 64, torch.float32)
    with torch.no_grad():
        y, s = ssd_triton.ssd_triton(x, dt, A, B, C, D, s0)
        y1, s1 = ssd_triton.ssd_triton(x[:, :333], dt[:, :333], A, B[:, :333], C[:, :333], D, s0)
        y2, s2 = ssd_triton.ssd_triton(x[:, 333:], dt[:, 333:], A, B[:, 333:], C[:, 333:], D, s1)
    tol = REL_TOL[torch.float32]
    assert rel_err(torch.cat([y1, y2], 1), y) < tol and rel_err(s2, s) < tol


def test_auto_dispatch_picks_triton_on_cuda(monkeypatch):
    calls = []
    real = ssd_triton.ssd_triton
    monkeypatch.setattr(ssd_triton, "ssd_triton", lambda *a, **k: calls.append(1) or real(*a, **k))
    before = ssd.get_backend()
    ssd.set_backend("auto")
    try:
        ssd_scan(*make_inputs(1, 64, 2, 1, 64, 64, torch.bfloat16))
    finally:
        ssd.set_backend(before)
    assert calls, "ssd_scan did not take the Triton path for CUDA bf16 inputs"


def _mixer_grads(m, x, conv0, ssm0, backend, compiled=False):
    before = ssd.get_backend()
    ssd.set_backend(backend)
    try:
        fn = torch.compile(m) if compiled else m
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y, conv, ssm = fn(x, conv0, ssm0)
        loss = (y.float() ** 2).mean() + ssm.square().mean()
        grads = torch.autograd.grad(loss, list(m.parameters()) + [conv0, ssm0])
    finally:
        ssd.set_backend(before)
    return y, ssm, grads


def mixer_inputs():
    """A 70M-shape Mamba-2 mixer, its input (4, 300, 512) and a random carried state (with grad)."""
    torch.manual_seed(0)
    cfg = ModelConfig(d_model=512, expand=2, mamba_head_dim=64, d_state=64, ssd_chunk=64)
    m = Mamba2(cfg).to(DEVICE)
    x = torch.randn(4, 300, 512, device=DEVICE)
    conv0, ssm0 = m.init_state(4, device=DEVICE, dtype=torch.bfloat16)
    return (cfg, m, x, torch.randn_like(conv0).requires_grad_(),
            torch.randn_like(ssm0).requires_grad_())


@pytest.mark.parametrize("compiled", [False, True])
def test_mamba2_triton_equals_reference_on_cuda(compiled):
    """The whole mixer under bf16 autocast, eager and under torch.compile, with carried state."""
    cfg, m, x, conv0, ssm0 = mixer_inputs()
    y_r, s_r, g_r = _mixer_grads(m, x, conv0, ssm0, "ref")
    y_t, s_t, g_t = _mixer_grads(m, x, conv0, ssm0, "triton", compiled=compiled)
    tol = REL_TOL[torch.bfloat16]
    assert rel_err(y_t, y_r) < tol and rel_err(s_t, s_r) < tol
    names = [n for n, _ in m.named_parameters()] + ["conv_state", "ssm_state"]
    errors = {n: rel_err(a, b) for n, a, b in zip(names, g_t, g_r)}
    bad = {k: v for k, v in errors.items() if not v < tol}
    assert not bad, f"relative errors above {tol}: {bad}"


# --- document boundaries (packed sequences) -------------------------------------------------------

def make_seg(b, l, mean_len, chunk, seed=0):
    """Segment ids like packed documents: log-normal lengths around `mean_len`, plus boundaries at a
    chunk edge, one token before and after it, and on the last token (row 0)."""
    gen = torch.Generator().manual_seed(seed)
    starts = torch.zeros(b, l, dtype=torch.long)
    for r in range(b):
        t = 0
        while True:
            t += max(1, int(torch.empty(1).log_normal_(float(torch.tensor(mean_len).log()), 1.0,
                                                       generator=gen)))
            if t >= l:
                break
            starts[r, t] = 1
    for t in (chunk - 1, chunk, chunk + 1, l - 1):
        if 0 < t < l:
            starts[0, t] = 1
    return starts.cumsum(1).to(DEVICE)


SEG_CASES = [  # b, l, h, g, p, n, chunk, init, D, mean document length
    (2, 2048, 16, 1, 64, 64, 64, True, True, 600),   # the benchmark's head shape, web-like lengths
    (2, 1000, 8, 1, 64, 128, 64, True, True, 40),    # many boundaries per chunk; d_state 128
    (2, 300, 4, 2, 32, 64, 32, False, True, 20),     # two groups, no initial state, chunk 32
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("b,l,h,g,p,n,chunk,init,D,mean_len", SEG_CASES)
def test_triton_with_boundaries_equals_chunked_on_cuda(dtype, b, l, h, g, p, n, chunk, init, D, mean_len):
    inputs = make_inputs(b, l, h, g, p, n, dtype, init=init, D=D)
    check_against_reference(inputs, chunk, dtype, seg=make_seg(b, l, mean_len, chunk))


def test_triton_boundaries_keep_documents_apart_on_cuda():
    """Changing everything before a boundary leaves the Triton scan's output after it unchanged."""
    x, dt, A, B, C, D, s0 = (t.detach() if t is not None else None
                             for t in make_inputs(1, 500, 8, 1, 64, 64, torch.float32))
    seg = torch.zeros(1, 500, dtype=torch.long, device=DEVICE)
    seg[:, 201:] = 1
    with torch.no_grad():
        y, s = ssd_triton.ssd_triton(x, dt, A, B, C, D, s0, seg=seg)
        x2, B2 = x.clone(), B.clone()
        x2[:, :201] = torch.randn_like(x2[:, :201])
        B2[:, :201] = torch.randn_like(B2[:, :201])
        y2, s2 = ssd_triton.ssd_triton(x2, dt, A, B2, C, D, s0 * 2, seg=seg)
    assert torch.equal(y[:, 201:], y2[:, 201:]) and torch.equal(s, s2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("b,l,h,g,p,n,chunk,init,D,mean_len", SEG_CASES[:2])
def test_triton_segment_init_equals_reference_on_cuda(dtype, b, l, h, g, p, n, chunk, init, D, mean_len):
    """The kernels starting each later segment from segment_init == the zero-restarting float64
    reference plus add_segment_init (the unfused reference): y, final state, every gradient."""
    inputs = make_inputs(b, l, h, g, p, n, dtype, init=init, D=D)
    gen = torch.Generator(device=DEVICE).manual_seed(7)
    inputs.append((torch.randn(h, p, n, device=DEVICE, generator=gen) * 0.5).requires_grad_())
    seg = make_seg(b, l, mean_len, chunk)
    ref_inputs = [t.detach().double().requires_grad_() if t is not None else None for t in inputs]
    gen = torch.Generator(device=DEVICE).manual_seed(123)
    wy = torch.randn(b, l, h, p, device=DEVICE, generator=gen, dtype=torch.float64)
    wf = torch.randn(b, h, p, n, device=DEVICE, generator=gen, dtype=torch.float64)

    def fused(x, dt, A, B, C, D, s0, si):
        return ssd_triton.ssd_triton(x, dt, A, B, C, D, s0, chunk, seg, si)

    def reference(x, dt, A, B, C, D, s0, si):
        y, final = ssd_chunked(x, dt, A, B, C, D, s0, chunk, seg)
        return add_segment_init(y, final, dt, A, C, seg, si, chunk)
    y, final, grads = run(fused, inputs, wy, wf)
    y_ref, final_ref, grads_ref = run(reference, ref_inputs, wy, wf)
    assert y.dtype == dtype and final.dtype == torch.float32
    tol = REL_TOL[dtype]
    errors = {"y": rel_err(y, y_ref), "final_state": rel_err(final, final_ref)}
    live = [(k, t) for k, t in zip(NAMES + ["segment_init"], inputs) if t is not None]
    for (name, t), got, want in zip(live, grads, grads_ref):
        assert got.shape == t.shape and got.dtype == t.dtype, name
        errors["d" + name] = rel_err(got, want)
    bad = {k: v for k, v in errors.items() if not v < tol}
    assert not bad, f"relative errors above {tol}: {bad} (all: {errors})"


@pytest.mark.parametrize("compiled", [False, True])
def test_mamba2_with_boundaries_triton_equals_reference_on_cuda(compiled):
    """The mixer with packed documents (segments, initial-memory conv tail and SSM state) under bf16
    autocast: Triton path (the scan taking the SSM state itself) == reference path (the scan
    restarting from zero plus add_segment_init), values and gradients, eager and compiled."""
    cfg, m, x, conv0, ssm0 = mixer_inputs()
    tail = torch.randn(m.conv_dim, cfg.d_conv - 1, device=DEVICE, requires_grad=True)
    s_init = torch.randn(m.heads, m.head_dim, m.d_state, device=DEVICE, requires_grad=True)
    seg = make_seg(4, 300, 50, 64)

    def grads(backend):
        before = ssd.get_backend()
        ssd.set_backend(backend)
        try:
            fn = torch.compile(m) if compiled and backend == "triton" else m
            m.fused_segment_init = backend == "triton"
            with torch.autocast("cuda", dtype=torch.bfloat16):
                y, conv, ssm = fn(x, conv0, ssm0, seg=seg, init=(tail, s_init))
            loss = (y.float() ** 2).mean() + ssm.square().mean() + conv.float().square().mean()
            return y, ssm, torch.autograd.grad(loss, list(m.parameters()) + [conv0, ssm0, tail, s_init])
        finally:
            ssd.set_backend(before)
            del m.fused_segment_init
    y_r, s_r, g_r = grads("ref")
    y_t, s_t, g_t = grads("triton")
    tol = REL_TOL[torch.bfloat16]
    assert rel_err(y_t, y_r) < tol and rel_err(s_t, s_r) < tol
    names = [n for n, _ in m.named_parameters()] + ["conv_state", "ssm_state", "tail", "ssm_init"]
    errors = {n: rel_err(a, b) for n, a, b in zip(names, g_t, g_r)}
    bad = {k: v for k, v in errors.items() if not v < tol}
    assert not bad, f"relative errors above {tol}: {bad}"


@pytest.mark.heavy   # a compile of the mixer's forward and backward (conftest)
def test_mamba2_block_as_one_op_equals_the_separate_ops_on_cuda():
    """The block between its projections as one op (mamba_inner, its backward writing the
    in-projection's gradient whole), compiled, == the separate Triton ops, eager, under bf16
    autocast, over two chunks with the state carried between them (the second chunk's loss
    reaches the first chunk's op through the new conv and SSM states), with packed documents and
    the initial memory's state. (Without documents the op is what
    test_mamba2_triton_equals_reference_on_cuda runs on CUDA.)"""
    cfg, m, x, conv0, ssm0 = mixer_inputs()
    seg = make_seg(4, 300, 60, 64, seed=1)
    gen = torch.Generator(device=DEVICE).manual_seed(5)
    init = (torch.randn(m.conv_dim, 3, device=DEVICE, generator=gen).requires_grad_(),
            torch.randn(m.heads, m.head_dim, m.d_state, device=DEVICE, generator=gen).requires_grad_())
    leaves = [conv0, ssm0, *init]
    results = {}
    try:
        for fused in (False, True):
            m.fused_inner = fused
            fn = torch.compile(m, dynamic=False) if fused else m
            with torch.autocast("cuda", dtype=torch.bfloat16):
                # a chunk's ids count from the document carried into it (0)
                part = lambda a, b: seg[:, a:b] - (seg[:, a - 1:a] if a else 0)
                y1, c1, s1 = fn(x[:, :150], conv0, ssm0, seg=part(0, 150), init=init)
                assert m._takes_inner(m.in_proj(x[:, :150]), part(0, 150), init) == fused
                y2, c2, s2 = fn(x[:, 150:], c1, s1, seg=part(150, 300), init=init)   # one compile
            y = torch.cat([y1, y2], dim=1)
            loss = (y.float() ** 2).mean() + s2.square().mean() + c2.float().square().mean()
            results[fused] = (y, c2, s2, torch.autograd.grad(loss, list(m.parameters()) + leaves))
    finally:
        del m.fused_inner
    names = [n for n, _ in m.named_parameters()] + ["conv_state", "ssm_state", "tail", "ssm_init"]
    (y_a, c_a, s_a, g_a), (y_b, c_b, s_b, g_b) = results[False], results[True]
    # the same kernels; compiled against eager, bf16 roundings may fall differently
    for a, b in ((y_a, y_b), (c_a, c_b), (s_a, s_b)):
        assert rel_err(b, a) < 5e-3
    tol = REL_TOL[torch.bfloat16]
    errors = {n: rel_err(b, a) for n, a, b in zip(names, g_a, g_b)}
    bad = {k: v for k, v in errors.items() if not v < tol}
    assert not bad, f"relative errors above {tol}: {bad}"
