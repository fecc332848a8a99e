"""The SSD scan: the chunked reference equals the token-by-token recurrence, the Triton kernels (in the
interpreter here; on CUDA in test_gpu_ssd.py) equal the chunked reference, and ssd_scan dispatches."""
import os

import pytest
import torch
import torch.nn.functional as F

from elephant.layers import ssd
from elephant.layers.ssd import add_segment_init, ssd_chunked, ssd_recurrent_ref, ssd_scan


def make_inputs(b=2, l=37, h=4, g=1, p=8, n=6, dtype=torch.float64, init=True, D=True, seed=0):
    """Random SSD inputs with requires_grad: x, dt, A, B, C, D, initial_state."""
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.rand(*shape, generator=gen, dtype=torch.float64)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    tensors = [
        randn(b, l, h, p),
        rand(b, l, h) * 0.5 + 0.01,        # dt > 0
        -(rand(h) * 3 + 0.1),              # A < 0
        randn(b, l, g, n),
        randn(b, l, g, n),
        randn(h) if D else None,
        randn(b, h, p, n) if init else None,
    ]
    return [t.to(dtype).requires_grad_() if t is not None else None for t in tensors]


def grads(fn, inputs, seed=1, **kw):
    """Outputs of fn and the gradients of a random linear function of (y, final) w.r.t. every input."""
    y, final = fn(*inputs, **kw)
    gen = torch.Generator().manual_seed(seed)
    wy = torch.randn(y.shape, generator=gen).to(y.dtype)
    wf = torch.randn(final.shape, generator=gen).to(final.dtype)
    loss = (y.float() * wy.float()).sum() + (final.float() * wf.float()).sum()
    live = [t for t in inputs if t is not None]
    return y, final, torch.autograd.grad(loss, live)


def rel_err(a, b):
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp(min=1e-12)).item()


# --- the chunked reference --------------------------------------------------------------------

@pytest.mark.parametrize("l", [1, 7, 16, 37, 64, 100])
@pytest.mark.parametrize("g", [1, 2])
def test_chunked_equals_recurrence(l, g):
    inputs = make_inputs(l=l, g=g)
    y_ref, s_ref = ssd_recurrent_ref(*inputs)
    y, s = ssd_chunked(*inputs, chunk_size=16)
    assert torch.allclose(y, y_ref, rtol=0, atol=1e-12)
    assert torch.allclose(s, s_ref, rtol=0, atol=1e-12)


@pytest.mark.parametrize("l,init,D", [(5, True, True), (37, True, False), (48, False, True)])
def test_chunked_gradients_equal_recurrence(l, init, D):
    inputs = make_inputs(l=l, g=2, init=init, D=D)
    _, _, g_ref = grads(ssd_recurrent_ref, inputs)
    _, _, g = grads(ssd_chunked, inputs, chunk_size=16)
    for a, b in zip(g, g_ref):
        assert torch.allclose(a, b, rtol=0, atol=1e-10)


def test_chunk_size_does_not_change_result():
    inputs = make_inputs(l=50)
    y8, s8 = ssd_chunked(*inputs, chunk_size=8)
    for q in (16, 64):
        y, s = ssd_chunked(*inputs, chunk_size=q)
        assert torch.allclose(y, y8, rtol=0, atol=1e-12) and torch.allclose(s, s8, rtol=0, atol=1e-12)


def test_carried_state_equals_one_pass():
    x, dt, A, B, C, D, s0 = make_inputs(l=45)
    y, s = ssd_chunked(x, dt, A, B, C, D, s0, chunk_size=16)
    y1, s1 = ssd_chunked(x[:, :19], dt[:, :19], A, B[:, :19], C[:, :19], D, s0, chunk_size=16)
    y2, s2 = ssd_chunked(x[:, 19:], dt[:, 19:], A, B[:, 19:], C[:, 19:], D, s1, chunk_size=16)
    assert torch.allclose(torch.cat([y1, y2], 1), y, rtol=0, atol=1e-12)
    assert torch.allclose(s2, s, rtol=0, atol=1e-12)


def test_no_initial_state_is_a_zero_state():
    x, dt, A, B, C, D, s0 = make_inputs(l=20)
    y0, f0 = ssd_chunked(x, dt, A, B, C, D, None, chunk_size=16)
    y1, f1 = ssd_chunked(x, dt, A, B, C, D, torch.zeros_like(s0), chunk_size=16)
    assert torch.equal(y0, y1) and torch.equal(f0, f1)


def test_low_precision_in_float32_out():
    x, dt, A, B, C, D, s0 = make_inputs(l=20, dtype=torch.bfloat16)
    y, final = ssd_chunked(x, dt, A, B, C, D, s0.float(), chunk_size=16)
    assert y.dtype == torch.bfloat16 and final.dtype == torch.float32
    y32, f32 = ssd_chunked(*(t.float() for t in (x, dt, A, B, C, D, s0)), chunk_size=16)
    assert torch.allclose(final, f32, atol=1e-5) and torch.allclose(y.float(), y32, atol=0.05)


def test_autocast_does_not_lower_the_reference():
    inputs = [t.float() if t is not None else None for t in make_inputs(l=30)]
    y, s = ssd_chunked(*inputs, chunk_size=16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y_ac, s_ac = ssd_chunked(*inputs, chunk_size=16)
    assert y_ac.dtype == s_ac.dtype == torch.float32
    assert torch.equal(y_ac, y) and torch.equal(s_ac, s)


def test_bad_shapes_are_named():
    x, dt, A, B, C, D, s0 = make_inputs(l=8)
    with pytest.raises(ValueError, match="initial_state"):
        ssd_chunked(x, dt, A, B, C, D, s0[:, :2])
    with pytest.raises(ValueError, match="groups"):
        ssd_chunked(x, dt, A, B.expand(2, 8, 3, 6), C.expand(2, 8, 3, 6))


# --- document boundaries (seg) ---------------------------------------------------------------

def make_seg(b, l, n_starts, seed=0, first=False):
    """(b, l) nondecreasing segment ids with `n_starts` boundaries per row at random positions
    (row 0 also at a chunk edge and the last token); `first`: row 1 starts a segment at token 0."""
    gen = torch.Generator().manual_seed(seed)
    starts = torch.zeros(b, l, dtype=torch.long)
    for r in range(b):
        pos = torch.randperm(l - 1, generator=gen)[:n_starts] + 1
        starts[r, pos] = 1
    if l > 17:
        starts[0, 16] = 1
    starts[0, l - 1] = 1
    if first and b > 1:
        starts[1, 0] = 1
    return starts.cumsum(1)


@pytest.mark.parametrize("l", [1, 7, 37, 64, 100])
@pytest.mark.parametrize("g", [1, 2])
def test_chunked_with_boundaries_equals_recurrence(l, g):
    inputs = make_inputs(l=l, g=g)
    seg = make_seg(2, l, n_starts=min(4, l - 1), first=True)
    y_ref, s_ref = ssd_recurrent_ref(*inputs, seg=seg)
    y, s = ssd_chunked(*inputs, chunk_size=16, seg=seg)
    assert torch.allclose(y, y_ref, rtol=0, atol=1e-12)
    assert torch.allclose(s, s_ref, rtol=0, atol=1e-12)


def test_chunked_gradients_with_boundaries_equal_recurrence():
    inputs = make_inputs(l=45, g=2)
    seg = make_seg(2, 45, n_starts=3, first=True)
    _, _, g_ref = grads(ssd_recurrent_ref, inputs, seg=seg)
    _, _, g = grads(ssd_chunked, inputs, chunk_size=16, seg=seg)
    for a, b in zip(g, g_ref):
        assert torch.allclose(a, b, rtol=0, atol=1e-10)


def test_a_segment_equals_the_same_tokens_scanned_alone():
    x, dt, A, B, C, D, s0 = make_inputs(b=1, l=40)
    seg = torch.zeros(1, 40, dtype=torch.long)
    seg[:, 13:] = 1
    y, s = ssd_chunked(x, dt, A, B, C, D, s0, chunk_size=16, seg=seg)
    cut = lambda t: t[:, 13:]
    y_alone, s_alone = ssd_chunked(cut(x), cut(dt), A, cut(B), cut(C), D, None, chunk_size=16)
    assert torch.equal(y[:, 13:], y_alone) or torch.allclose(y[:, 13:], y_alone, rtol=0, atol=1e-12)
    assert torch.allclose(s, s_alone, rtol=0, atol=1e-12)
    y_head, _ = ssd_chunked(x[:, :13], dt[:, :13], A, B[:, :13], C[:, :13], D, s0, chunk_size=16)
    assert torch.allclose(y[:, :13], y_head, rtol=0, atol=1e-12)


def test_no_gradient_crosses_a_boundary():
    x, dt, A, B, C, D, s0 = make_inputs(b=1, l=40)
    seg = torch.zeros(1, 40, dtype=torch.long)
    seg[:, 21:] = 1
    y, s = ssd_chunked(x, dt, A, B, C, D, s0, chunk_size=16, seg=seg)
    gx, gdt, gB, gs0 = torch.autograd.grad(y[:, 21:].sum() + s.sum(), [x, dt, B, s0])
    assert not gx[:, :21].any() and not gdt[:, :21].any() and not gB[:, :21].any() and not gs0.any()
    # and the values: changing everything before the boundary leaves the rest bitwise equal
    other = [t.detach().clone() for t in (x, dt, B, C)]
    for t in other:
        t[:, :21] = t[:, :21].flip(1) * 0.5
    y2, s2 = ssd_chunked(other[0], other[1], A, other[2], other[3], D, s0 * 3, chunk_size=16, seg=seg)
    assert torch.equal(y2[:, 21:], y[:, 21:]) and torch.equal(s2, s)


@pytest.mark.parametrize("l, n_starts, block", [(9, 3, 64), (40, 3, 64), (40, 3, 16), (100, 2, 16)])
def test_segment_init_equals_recurrence_restarting_from_it(l, n_starts, block):
    # block 16 over 100 tokens: segments run across several blocks (the carry from block to block)
    x, dt, A, B, C, D, s0 = make_inputs(l=l, g=2)
    seg = make_seg(2, l, n_starts=n_starts, first=True)
    init = torch.randn(4, 8, 6, dtype=torch.float64, requires_grad=True)
    y_ref, s_ref = ssd_recurrent_ref(x, dt, A, B, C, D, s0, seg=seg, segment_init=init)
    y, s = ssd_chunked(x, dt, A, B, C, D, s0, chunk_size=16, seg=seg)
    y, s = add_segment_init(y, s, dt, A, C, seg, init, chunk_size=block)
    assert torch.allclose(y, y_ref, rtol=0, atol=1e-12) and torch.allclose(s, s_ref, rtol=0, atol=1e-12)
    g = torch.autograd.grad((y * y_ref.detach()).sum() + s.sum(), [init, dt])
    g_ref = torch.autograd.grad((y_ref * y_ref.detach()).sum() + s_ref.sum(), [init, dt])
    for a, b in zip(g, g_ref):
        assert torch.allclose(a, b, rtol=0, atol=1e-10)


# --- segments starting from a given state (segment_init), fused into the scan ------------------

def seg_from_starts(l, rows):
    """(len(rows), l) segment ids from each row's list of segment starts."""
    starts = torch.zeros(len(rows), l, dtype=torch.long)
    for r, cols in enumerate(rows):
        for c in cols:
            if c < l:
                starts[r, c] = 1
    return starts.cumsum(1)


# chunk 16: boundaries at the chunk edges 16 and 32, at tokens 0 and 1, in consecutive tokens, on the
# last token; a segment spanning several chunks (row 1: 19 -> 57); a row without any boundary
SEG_LAYOUTS = [
    (60, [[1, 2, 3, 16, 32, 33, 59], [0, 15, 19, 57], []]),
    (37, [[0, 1, 2, 31, 32, 36], [5, 6, 17], [16]]),
    (9, [[1, 8], [0], []]),                        # shorter than a chunk
]


def _with_init(fn, seg, **kw):
    return lambda *a: fn(*a[:7], seg=seg, segment_init=a[7], **kw)


@pytest.mark.parametrize("l, rows", SEG_LAYOUTS)
@pytest.mark.parametrize("g, init, D", [(1, True, True), (2, False, False)])
def test_fused_segment_init_equals_recurrence(l, rows, g, init, D):
    # the chunked scan taking segment_init itself == the token-by-token recurrence restarting from
    # it: values, final state and the gradients of every input, segment_init included (fp64)
    inputs = make_inputs(b=3, l=l, g=g, init=init, D=D)
    s_init = torch.randn(4, 8, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    inputs = inputs + [s_init.requires_grad_()]
    seg = seg_from_starts(l, rows)
    y_ref, s_ref, g_ref = grads(_with_init(ssd_recurrent_ref, seg), inputs)
    y, s, g_fused = grads(_with_init(ssd_chunked, seg, chunk_size=16), inputs)
    assert (y - y_ref).abs().max() < 1e-12 and (s - s_ref).abs().max() < 1e-12
    names = [k for k, t in zip("x dt A B C D initial_state segment_init".split(), inputs) if t is not None]
    for name, a, r in zip(names, g_fused, g_ref):
        assert (a - r).abs().max() < 1e-10, name
    assert g_fused[-1].abs().max() > 0  # segment_init does get a gradient


@pytest.mark.parametrize("l, n_starts", [(45, 3), (100, 6)])
def test_fused_segment_init_equals_add_segment_init(l, n_starts):
    # the fused form == the zero-restarting scan plus add_segment_init (the reference kept beside it),
    # on random boundaries: values, final state, gradients of every input (fp64)
    inputs = make_inputs(b=2, l=l, g=2)
    s_init = torch.randn(4, 8, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(6))
    inputs = inputs + [s_init.requires_grad_()]
    seg = make_seg(2, l, n_starts=n_starts, first=True)

    def added(x, dt, A, B, C, D, s0, si):
        y, final = ssd_chunked(x, dt, A, B, C, D, s0, chunk_size=16, seg=seg)
        return add_segment_init(y, final, dt, A, C, seg, si, chunk_size=16)
    y_ref, s_ref, g_ref = grads(added, inputs)
    y, s, g_fused = grads(_with_init(ssd_chunked, seg, chunk_size=16), inputs)
    assert (y - y_ref).abs().max() < 1e-12 and (s - s_ref).abs().max() < 1e-12
    for a, r in zip(g_fused, g_ref):
        assert (a - r).abs().max() < 1e-10


def test_fused_segment_init_keeps_documents_apart():
    # with segment_init, changing everything before a boundary still leaves the rest bitwise equal
    x, dt, A, B, C, D, s0 = (t.detach() for t in make_inputs(b=1, l=40))
    s_init = torch.randn(4, 8, 6, dtype=torch.float64)
    seg = seg_from_starts(40, [[21]])
    y, s = ssd_chunked(x, dt, A, B, C, D, s0, chunk_size=16, seg=seg, segment_init=s_init)
    other = [t.clone() for t in (x, dt, B, C)]
    for t in other:
        t[:, :21] = t[:, :21].flip(1) * 0.5
    y2, s2 = ssd_chunked(other[0], other[1], A, other[2], other[3], D, s0 * 3, chunk_size=16, seg=seg,
                         segment_init=s_init)
    assert torch.equal(y2[:, 21:], y[:, 21:]) and torch.equal(s2, s)


def test_segment_init_needs_seg_and_its_shape():
    x, dt, A, B, C, D, s0 = make_inputs(l=8)
    with pytest.raises(ValueError, match="needs seg"):
        ssd_chunked(x, dt, A, B, C, D, s0, segment_init=torch.zeros(4, 8, 6, dtype=torch.float64))
    with pytest.raises(ValueError, match="segment_init must be"):
        ssd_chunked(x, dt, A, B, C, D, s0, seg=torch.zeros(2, 8, dtype=torch.long),
                    segment_init=torch.zeros(2, 4, 8, 6, dtype=torch.float64))


# --- dispatch ---------------------------------------------------------------------------------

@pytest.fixture
def backend():
    before = ssd.get_backend()
    yield ssd.set_backend
    ssd.set_backend(before)


def test_auto_uses_reference_on_cpu(backend, monkeypatch):
    from elephant.layers import ssd_triton

    def fail(*a, **k):
        raise AssertionError("the Triton path was taken on CPU")
    monkeypatch.setattr(ssd_triton, "ssd_triton", fail)
    backend("auto")
    inputs = make_inputs(l=20)
    y, s = ssd_scan(*inputs, chunk_size=16)
    y_ref, s_ref = ssd_chunked(*inputs, chunk_size=16)
    assert torch.equal(y, y_ref) and torch.equal(s, s_ref)


def test_unknown_backend_is_rejected(backend):
    with pytest.raises(ValueError, match="ref, triton"):
        backend("cuda")


# --- the Triton kernels, in the interpreter ---------------------------------------------------

triton_cases = [  # b, l, h, g, p, n, init, D
    (1, 40, 2, 1, 16, 16, True, True),
    (2, 70, 2, 1, 16, 16, True, True),     # length not a multiple of the chunk
    (1, 64, 4, 2, 16, 32, False, False),   # two groups, no initial state, no D
    (1, 5, 2, 1, 20, 16, True, True),      # shorter than a chunk; head_dim not a power of 2
    (1, 40, 2, 1, 48, 16, True, True),     # head_dim over two programs of the state kernels
]


def _needs_triton():
    pytest.importorskip("triton")
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("no CUDA and TRITON_INTERPRET is not set")


@pytest.mark.parametrize("b,l,h,g,p,n,init,D", triton_cases)
def test_triton_equals_chunked(b, l, h, g, p, n, init, D):
    _needs_triton()
    from elephant.layers.ssd_triton import ssd_triton
    inputs = make_inputs(b, l, h, g, p, n, dtype=torch.float32, init=init, D=D)
    y, s, g_tri = grads(ssd_triton, inputs, chunk_size=16)
    y_ref, s_ref, g_ref = grads(ssd_chunked, inputs, chunk_size=16)
    assert y.dtype == torch.float32 and s.dtype == torch.float32
    assert_close_outputs(inputs, (y, s, g_tri), (y_ref, s_ref, g_ref))


def assert_close_outputs(inputs, got, want, tol=1e-5):
    """Output, final state and the gradient of every given input agree to `tol` (relative)."""
    (y, s, g), (y_ref, s_ref, g_ref) = got, want
    assert rel_err(y, y_ref) < tol and rel_err(s, s_ref) < tol
    names = [k for k, t in zip("x dt A B C D initial_state segment_init".split(), inputs)
             if t is not None]
    for name, a, r in zip(names, g, g_ref):
        assert a.shape == r.shape and a.dtype == r.dtype, name
        assert rel_err(a, r) < tol, name


def test_triton_strided_inputs_and_unused_final_state():
    """Views as the Mamba-2 mixer makes them (x, B, C slices of one tensor), a stride-0 dy, no dfinal."""
    _needs_triton()
    from elephant.layers.ssd_triton import ssd_triton
    b, l, h, p, n = 2, 33, 2, 16, 16
    gen = torch.Generator().manual_seed(3)
    xBC = torch.randn(b, l, h * p + 2 * n, generator=gen).requires_grad_()
    dt = (torch.rand(b, l, h, generator=gen) * 0.3 + 0.01).requires_grad_()
    A = -(torch.rand(h, generator=gen) + 0.5).requires_grad_()
    D = torch.randn(h, generator=gen).requires_grad_()
    x, B, C = xBC.split([h * p, n, n], dim=-1)
    args = (x.reshape(b, l, h, p), dt, A, B.reshape(b, l, 1, n), C.reshape(b, l, 1, n), D)
    results = []
    for fn in (ssd_triton, ssd_chunked):
        y, _ = fn(*args, chunk_size=16)
        results.append((y, torch.autograd.grad(y.sum(), [xBC, dt, A, D])))
    (y, g), (y_ref, g_ref) = results
    assert rel_err(y, y_ref) < 1e-5
    for a, r in zip(g, g_ref):
        assert rel_err(a, r) < 1e-5


def test_triton_half_precision_path():
    """16-bit inputs take the other matmul path (operands cast to x's dtype). The interpreter has no
    bfloat16 matmul, so float16 stands in here; bfloat16 is tested on CUDA (test_gpu_ssd.py)."""
    _needs_triton()
    from elephant.layers.ssd_triton import ssd_triton
    inputs = make_inputs(1, 50, 2, 1, 16, 16, dtype=torch.float32)
    half = [t.detach().half().requires_grad_() if i in (0, 3, 4) else t
            for i, t in enumerate(inputs)]                   # x, B, C in float16
    y, s, g = grads(ssd_triton, half, chunk_size=16)
    up = [t.detach().float().requires_grad_() for t in half]
    y_ref, s_ref, g_ref = grads(ssd_chunked, up, chunk_size=16)
    assert y.dtype == torch.float16 and s.dtype == torch.float32
    assert rel_err(y, y_ref) < 5e-3 and rel_err(s, s_ref) < 5e-3
    for name, a, r, t in zip("x dt A B C D initial_state".split(), g, g_ref, half):
        assert a.dtype == t.dtype, name
        assert rel_err(a, r) < 5e-3, name


@pytest.mark.parametrize("b,l,h,g,p,n,init,D", [
    (2, 70, 2, 1, 16, 16, True, True),     # boundaries inside chunks, at a chunk edge, at the end
    (2, 40, 4, 2, 16, 32, False, True),    # two groups, no initial state
    (2, 5, 2, 1, 20, 16, True, False),     # shorter than a chunk
    (2, 40, 2, 1, 48, 16, True, True),     # head_dim over two programs of the state kernels
])
def test_triton_with_boundaries_equals_chunked(b, l, h, g, p, n, init, D):
    _needs_triton()
    from elephant.layers.ssd_triton import ssd_triton
    inputs = make_inputs(b, l, h, g, p, n, dtype=torch.float32, init=init, D=D)
    seg = make_seg(b, l, n_starts=min(3, l - 1), first=True)
    y, s, g_tri = grads(ssd_triton, inputs, chunk_size=16, seg=seg)
    y_ref, s_ref, g_ref = grads(ssd_chunked, inputs, chunk_size=16, seg=seg)
    assert rel_err(y, y_ref) < 1e-5 and rel_err(s, s_ref) < 1e-5
    names = [k for k, t in zip("x dt A B C D initial_state".split(), inputs) if t is not None]
    for name, a, r in zip(names, g_tri, g_ref):
        assert rel_err(a, r) < 1e-5, name


@pytest.mark.parametrize("l, rows, h, g, p, n, init, D", [
    (37, [[0, 1, 2, 16, 32, 36], [5, 6, 17], []], 2, 1, 16, 16, True, True),
    (70, [[1, 15, 16, 17, 69], [0, 20, 55]], 4, 2, 16, 32, False, True),   # a segment over 3 chunks
    (5, [[1, 4], [0]], 2, 1, 20, 16, True, False),                        # shorter than a chunk
    (40, [[3, 17, 33], [16]], 2, 1, 48, 16, True, True),   # head_dim over two state programs
])
def test_triton_segment_init_equals_chunked(l, rows, h, g, p, n, init, D):
    # the kernels starting each later segment from segment_init == the chunked reference taking it
    # (itself held to the recurrence and to add_segment_init above): values, state, every gradient
    _needs_triton()
    from elephant.layers.ssd_triton import ssd_triton
    seg = seg_from_starts(l, rows)
    inputs = make_inputs(len(rows), l, h, g, p, n, dtype=torch.float32, init=init, D=D)
    s_init = torch.randn(h, p, n, generator=torch.Generator().manual_seed(7)) * 0.5
    inputs = inputs + [s_init.requires_grad_()]
    y, s, g_tri = grads(_with_init(ssd_triton, seg, chunk_size=16), inputs)
    y_ref, s_ref, g_ref = grads(_with_init(ssd_chunked, seg, chunk_size=16), inputs)
    assert_close_outputs(inputs, (y, s, g_tri), (y_ref, s_ref, g_ref))


def test_triton_segment_cumsum_is_its_own_segments_sum():
    # the kernels' float32 restarting cumsum == the float64 masked sum (ssd.segment_cumsum) to float32
    # rounding, its gradient == that of the reference, and a document's sums are bitwise independent
    # of the decays before it (changing them leaves every later segment's sums unchanged)
    _needs_triton()
    from elephant.layers.ssd import segment_cumsum, segment_masks
    from elephant.layers.ssd_triton import _segment_cumsum_op
    b, l, h, Q = 2, 37, 3, 16
    gen = torch.Generator().manual_seed(8)
    dA = -(torch.rand(b, l, h, generator=gen) * 2).requires_grad_()
    seg = seg_from_starts(l, [[1, 2, 16, 20, 36], [0, 31]])
    nc = 3
    segp = torch.cat([seg, seg[:, -1:].expand(b, nc * Q - l)], dim=1).to(torch.int32)
    cs = _segment_cumsum_op(dA, segp, Q)                                     # (b, h, nc, Q)
    dA64 = dA.detach().double().requires_grad_()
    ref = segment_cumsum(F.pad(dA64, (0, 0, 0, nc * Q - l)).view(b, nc, Q, h),
                         segment_masks(seg, nc, Q)[0]).permute(0, 3, 1, 2)
    assert rel_err(cs, ref) < 1e-6
    w = torch.randn(cs.shape, generator=gen)
    (g,) = torch.autograd.grad((cs * w).sum(), dA)
    (g_ref,) = torch.autograd.grad((ref * w.double()).sum(), dA64)
    assert rel_err(g, g_ref) < 1e-6
    other = dA.detach().clone()
    other[0, :20] *= 3.0                                                       # row 0: before token 20
    cs2 = _segment_cumsum_op(other, segp, Q)
    assert torch.equal(cs2[0, :, 1, 4:], cs.detach()[0, :, 1, 4:])             # tokens 20.. of chunk 1
    assert torch.equal(cs2[0, :, 2], cs.detach()[0, :, 2]) and torch.equal(cs2[1], cs.detach()[1])


@pytest.mark.parametrize("with_seg", [False, True])
def test_triton_scan_compiles_into_one_graph(with_seg):
    # the kernels are custom ops: torch.compile(fullgraph=True) traces a function around the scan
    # without a graph break (the shape-only fake implementations), and the compiled function's
    # values and gradients are the eager ones bitwise (the same kernels run)
    _needs_triton()
    import torch._dynamo
    from elephant.layers.ssd_triton import ssd_triton
    l, rows = 37, [[0, 5, 20], [17]]
    inputs = make_inputs(2, l, 2, 1, 16, 16, dtype=torch.float32)
    kw = dict(chunk_size=16)
    if with_seg:
        inputs = inputs + [(torch.randn(2, 16, 16, generator=torch.Generator().manual_seed(5)) * 0.5)
                           .requires_grad_()]
        fn = _with_init(ssd_triton, seg_from_starts(l, rows), **kw)
    else:
        def fn(*args):
            return ssd_triton(*args, **kw)

    def around(*args):  # work on both sides of the scan, in the same graph
        y, final = fn(args[0] * 1.5, *args[1:])
        return torch.tanh(y) * 2, final + 1
    torch._dynamo.reset()
    compiled = torch.compile(around, fullgraph=True, backend="aot_eager")
    y, s, g = grads(compiled, inputs)
    y_ref, s_ref, g_ref = grads(around, inputs)
    assert torch.equal(y, y_ref) and torch.equal(s, s_ref)
    for a, r in zip(g, g_ref):
        assert torch.equal(a, r)


def test_triton_backward_op_fake_matches_its_outputs():
    # the backward op's fake implementation is what a compiled graph plans with: every output's
    # shape, dtype and strides as the kernels give them (segments, segment_init, two groups), and
    # the op's values those of the kernels' function
    _needs_triton()
    from elephant.layers import ssd_triton as T
    b, l, h, g, p, n, Q = 2, 37, 4, 2, 16, 16, 16
    x, dt, A, B, C, D, init = (t.detach().float() for t in make_inputs(b, l, h, g, p, n))
    seg = make_seg(b, l, n_starts=3, first=True)
    nc = -(-l // Q)
    segp = torch.cat([seg, seg[:, -1:].expand(b, nc * Q - l)], dim=1).to(torch.int32).contiguous()
    cs = T._segment_cumsum_op((dt * A).contiguous(), segp, Q)
    sinit = torch.randn(h, p, n, generator=torch.Generator().manual_seed(2))
    _, _, states = T._ssd_op(x, dt, cs, segp, B, C, D, init, sinit, Q)
    dy, dfinal = torch.randn_like(x), torch.randn(b, h, p, n)
    args = (x, dt, cs, segp, B, C, D, init, sinit, states, dy, dfinal, Q)
    torch.library.opcheck(T._ssd_bwd_op, args, test_utils=("test_schema", "test_faketensor"))
    for a, r in zip(T._ssd_bwd_op(*args), T._bwd(*args, summed=False)):
        assert torch.equal(a, r)


@pytest.mark.parametrize("groups", [1, 2, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_group_sum_is_the_sum_over_each_groups_heads(groups, dtype):
    # the scan backward's dB and dC per head, summed over each B/C group's heads in float32 by one
    # launch (ragged token count, a width that is not a power of two)
    _needs_triton()
    from elephant.layers.ssd_triton import group_sum
    src = torch.randn(3, 37, 8, 24, generator=torch.Generator().manual_seed(0)).to(dtype)
    got = group_sum(src, groups)
    want = src.float().view(3, 37, groups, 8 // groups, 24).sum(3)
    assert got.dtype == torch.float32 and got.shape == want.shape
    assert rel_err(got, want) < 1e-6


# --- x, B and C as blocks of one tensor (joint) -------------------------------------------------

def _joint_case(b, l, h, g, p, n, seed=0):
    """xbc (b, l, h p + 2 g n) = [x | B | C], with dt, A, D, initial_state (float32, with grad)."""
    _, dt, A, _, _, D, init = (t.detach().float() for t in make_inputs(b, l, h, g, p, n, seed=seed))
    xbc = torch.randn(b, l, h * p + 2 * g * n, generator=torch.Generator().manual_seed(seed + 5))
    return xbc.requires_grad_(), *(t.requires_grad_() for t in (dt, A, D, init))


def _scan_of_blocks(scan, xbc, dt, A, D, init, h, g, p, n, seg=None, sinit=None, joint=False):
    """scan over x, B, C, the column blocks of xbc (views), given it as `joint` or not."""
    b, l, _ = xbc.shape
    xs, Bs, Cs = xbc.split([h * p, g * n, g * n], dim=-1)
    kw = dict(chunk_size=16, seg=seg, segment_init=sinit)
    if joint:
        kw["joint"] = xbc
    return scan(xs.view(b, l, h, p), dt, A, Bs.view(b, l, g, n), Cs.view(b, l, g, n), D, init, **kw)


@pytest.mark.parametrize("b,l,h,g,p,n,boundaries", [
    (2, 40, 2, 1, 16, 16, False),
    (2, 37, 4, 2, 16, 32, True),     # two groups: B's and C's columns interleave by group
    (1, 70, 2, 1, 20, 16, True),     # head_dim not a power of 2; several chunks
])
def test_triton_joint_gradient_is_the_three_gradients_side_by_side(b, l, h, g, p, n, boundaries):
    # the kernels writing dx, dB and dC into one tensor's columns == autograd gathering the three
    # gradients of the views into it: bit for bit in float32 (the same sums, the same roundings),
    # and every other gradient unchanged
    _needs_triton()
    from elephant.layers.ssd_triton import ssd_triton
    xbc, dt, A, D, init = _joint_case(b, l, h, g, p, n)
    seg = sinit = None
    if boundaries:
        seg = make_seg(b, l, n_starts=3, first=True)
        sinit = (torch.randn(h, p, n, generator=torch.Generator().manual_seed(9)) * 0.5).requires_grad_()
    inputs = [xbc, dt, A, D, init] + ([sinit] if sinit is not None else [])
    got = grads(lambda *a: _scan_of_blocks(ssd_triton, *a[:5], h, g, p, n, seg, sinit, joint=True),
                inputs)
    want = grads(lambda *a: _scan_of_blocks(ssd_triton, *a[:5], h, g, p, n, seg, sinit), inputs)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    for name, a, r in zip(["xbc", "dt", "A", "D", "init", "sinit"], got[2], want[2]):
        assert a.shape == r.shape and a.dtype == r.dtype, name
        assert torch.equal(a, r), name


@pytest.mark.parametrize("backend", ["ref", "triton"])
def test_ssd_scan_joint_on_either_path(backend):
    # ssd_scan with joint: the PyTorch path takes x, B, C as given (autograd reaches xbc through
    # the views); both give xbc the gradient of the plain chunked scan (float64 on "ref")
    if backend == "triton":
        _needs_triton()
    b, l, h, g, p, n = 2, 37, 2, 1, 16, 16
    inputs = list(_joint_case(b, l, h, g, p, n, seed=3))
    if backend == "ref":
        inputs = [t.detach().double().requires_grad_() for t in inputs]
    before = ssd.get_backend()
    ssd.set_backend(backend)
    try:
        got = grads(lambda *a: _scan_of_blocks(ssd_scan, *a, h, g, p, n, joint=True), inputs)
    finally:
        ssd.set_backend(before)
    want = grads(lambda *a: _scan_of_blocks(ssd_chunked, *a, h, g, p, n), inputs)
    tol = 1e-12 if backend == "ref" else 1e-5
    assert rel_err(got[0], want[0]) < tol
    for a, r in zip(got[2], want[2]):
        assert rel_err(a, r) < tol


def test_joint_of_the_wrong_shape_is_named():
    b, l, h, g, p, n = 1, 8, 2, 1, 4, 4
    x, dt, A, B, C, D, init = make_inputs(b, l, h, g, p, n, dtype=torch.float32)
    with pytest.raises(ValueError, match="joint must be"):
        ssd_scan(x, dt, A, B, C, D, init, joint=torch.zeros(b, l, h * p + g * n))


def test_triton_backward_op_with_joint_fake_matches_its_outputs():
    # joint: the backward op's first output is [dx | dB | dC] (b, l, h p + 2 g n) and dBC is empty;
    # the fake implementation plans exactly that
    _needs_triton()
    from elephant.layers import ssd_triton as T
    b, l, h, g, p, n, Q = 2, 21, 4, 2, 16, 16, 16
    x, dt, A, B, C, D, init = (t.detach().float() for t in make_inputs(b, l, h, g, p, n))
    cs = F.pad(dt * A, (0, 0, 0, 32 - l)).view(b, 2, Q, h).cumsum(2).permute(0, 3, 1, 2).contiguous()
    _, _, states = T._ssd_op(x, dt, cs, None, B, C, D, init, None, Q)
    args = (x, dt, cs, None, B, C, D, init, None, states, torch.randn_like(x), torch.randn(b, h, p, n),
            Q, True)
    torch.library.opcheck(T._ssd_bwd_op, args, test_utils=("test_schema", "test_faketensor"))
    out = T._ssd_bwd_op(*args)
    assert out[0].shape == (b, l, h * p + 2 * g * n) and out[3].numel() == 0
