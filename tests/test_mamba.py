"""The Mamba-2 mixer keeps the chunk contract: carried (conv, SSM) state makes chunks equal one pass,
lanes never mix, and gradients flow through the carried state."""
import os

import pytest
import torch
import torch.nn.functional as F

from elephant.config import ModelConfig
from elephant.layers import ssd
from elephant.layers.mamba import Mamba2


def small_cfg(**kw) -> ModelConfig:
    base = dict(d_model=32, d_state=16, mamba_head_dim=16, expand=2, d_conv=4, ssd_chunk=16)
    return ModelConfig(**{**base, **kw})


def make_mixer(dtype=torch.float64, seed=0, **kw) -> Mamba2:
    torch.manual_seed(seed)
    m = Mamba2(small_cfg(**kw)).to(dtype)
    with torch.no_grad():  # larger than the init so that every part of the mixer matters
        m.in_proj.weight.normal_(0, 0.3)
        m.out_proj.weight.normal_(0, 0.3)
        m.D.normal_()
        m.norm.weight.uniform_(0.5, 1.5)
    return m


def random_states(m: Mamba2, batch: int, dtype=torch.float64, seed=1):
    conv, ssm = m.init_state(batch, dtype=dtype)
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(conv.shape, generator=gen, dtype=dtype),
            torch.randn(ssm.shape, generator=gen, dtype=ssm.dtype))


def run_in_chunks(m, x, conv, ssm, lengths):
    ys, start = [], 0
    for n in lengths:
        y, conv, ssm = m(x[:, start:start + n], conv, ssm)
        ys.append(y)
        start += n
    assert start == x.shape[1]
    return torch.cat(ys, dim=1), conv, ssm


def test_parameter_layout():
    cfg = small_cfg()
    m = Mamba2(cfg)
    d_inner, n, heads = cfg.d_inner, cfg.d_state, cfg.mamba_heads
    conv_dim = d_inner + 2 * n
    assert m.in_proj.weight.shape == (2 * d_inner + 2 * n + heads, cfg.d_model)
    assert m.in_proj.bias is None and m.out_proj.bias is None
    assert m.conv1d.weight.shape == (conv_dim, 1, cfg.d_conv) and m.conv1d.bias.shape == (conv_dim,)
    assert m.dt_bias.shape == m.A_log.shape == m.D.shape == (heads,)
    assert m.norm.weight.shape == (d_inner,)
    assert m.out_proj.weight.shape == (cfg.d_model, d_inner)


def test_standard_mamba2_init():
    m = Mamba2(small_cfg(d_model=256))
    dt = F.softplus(m.dt_bias)
    assert dt.min() >= 1e-3 * 0.999 and dt.max() <= 1e-1 * 1.001
    A = torch.exp(m.A_log)
    assert A.min() >= 1 and A.max() <= 16
    assert torch.equal(m.D.data, torch.ones_like(m.D))


def test_init_state_shapes_and_dtypes():
    cfg = small_cfg()
    m = Mamba2(cfg)
    conv, ssm = m.init_state(3, device="cpu", dtype=torch.bfloat16)
    assert conv.shape == (3, cfg.d_inner + 2 * cfg.d_state, cfg.d_conv - 1) and conv.dtype == torch.bfloat16
    assert ssm.shape == (3, cfg.mamba_heads, cfg.mamba_head_dim, cfg.d_state)
    assert ssm.dtype == torch.float32
    assert not conv.any() and not ssm.any()


@pytest.mark.parametrize("lengths", [[1, 3, 17, 64, 35], [2, 1, 1, 116], [16, 16, 16, 72], [120]])
def test_chunked_equals_whole_sequence(lengths):
    m = make_mixer()
    x = torch.randn(2, 120, 32, dtype=torch.float64)
    conv0, ssm0 = random_states(m, 2)
    y, conv, ssm = m(x, conv0, ssm0)
    y_c, conv_c, ssm_c = run_in_chunks(m, x, conv0, ssm0, lengths)
    assert (y_c - y).abs().max() < 1e-10
    assert (conv_c - conv).abs().max() < 1e-12
    assert (ssm_c - ssm).abs().max() < 1e-10


def test_conv_state_is_last_inputs():
    m = make_mixer()
    conv0, ssm0 = random_states(m, 1)
    x = torch.randn(1, 2, 32, dtype=torch.float64)
    _, conv, _ = m(x, conv0, ssm0)
    xBC = m.in_proj(x)[..., m.d_inner:m.d_inner + m.conv_dim].transpose(1, 2)  # (1, conv_dim, 2)
    assert torch.equal(conv, torch.cat([conv0[:, :, 2:], xBC], dim=2))


def test_zero_state_is_a_fresh_start():
    m = make_mixer()
    x = torch.randn(2, 20, 32, dtype=torch.float64)
    y, *_ = m(x, *m.init_state(2, dtype=torch.float64))
    y_fresh, *_ = m(x, *m.init_state(2, dtype=torch.float64))
    assert torch.equal(y, y_fresh)
    y_other, *_ = m(x, *random_states(m, 2))
    assert not torch.allclose(y, y_other)


def test_lanes_are_independent():
    m = make_mixer(dtype=torch.float32)
    x = torch.randn(3, 40, 32)
    conv, ssm = random_states(m, 3, dtype=torch.float32)
    y, c, s = m(x, conv, ssm)
    x2, conv2, ssm2 = x.clone(), conv.clone(), ssm.clone()
    x2[1] = torch.randn(40, 32)
    conv2[1] += 1.0
    ssm2[1] -= 1.0
    y2, c2, s2 = m(x2, conv2, ssm2)
    for a, b in ((y, y2), (c, c2), (s, s2)):
        assert torch.equal(a[0], b[0]) and torch.equal(a[2], b[2])
        assert not torch.equal(a[1], b[1])


def test_gradients_flow_through_carried_state():
    """Backpropagating through chunks with carried state = backpropagating through one pass."""
    m = make_mixer()
    x = torch.randn(2, 50, 32, dtype=torch.float64)
    conv0, ssm0 = (t.requires_grad_() for t in random_states(m, 2))
    w = torch.randn(2, 50, 32, dtype=torch.float64)
    params = list(m.parameters())

    y, _, ssm = m(x, conv0, ssm0)
    whole = torch.autograd.grad((y * w).sum() + ssm.sum(), params + [conv0, ssm0])
    y, _, ssm = run_in_chunks(m, x, conv0, ssm0, [7, 2, 25, 16])
    chunked = torch.autograd.grad((y * w).sum() + ssm.sum(), params + [conv0, ssm0])
    for a, b in zip(chunked, whole):
        assert torch.allclose(a, b, rtol=1e-9, atol=1e-10)
    assert whole[-2].abs().sum() > 0 and whole[-1].abs().sum() > 0  # into conv and SSM state


def test_width_one_conv_has_empty_state():
    m = make_mixer(d_conv=1)
    conv, ssm = m.init_state(2, dtype=torch.float64)
    assert conv.shape[-1] == 0
    x = torch.randn(2, 21, 32, dtype=torch.float64)
    y, _, s = m(x, conv, ssm)
    y_c, _, s_c = run_in_chunks(m, x, conv, ssm, [1, 20])
    assert (y_c - y).abs().max() < 1e-10 and (s_c - s).abs().max() < 1e-10


def test_bfloat16_mixer_runs():
    m = make_mixer(dtype=torch.bfloat16)
    conv, ssm = m.init_state(2, dtype=torch.bfloat16)
    y, conv, ssm = m(torch.randn(2, 24, 32, dtype=torch.bfloat16), conv, ssm)
    assert y.dtype == conv.dtype == torch.bfloat16 and ssm.dtype == torch.float32
    assert torch.isfinite(y).all() and torch.isfinite(ssm).all()


def test_states_keep_their_dtype_under_autocast():
    m = make_mixer(dtype=torch.float32)
    conv, ssm = m.init_state(2, dtype=torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y, conv2, ssm2 = m(torch.randn(2, 24, 32), conv, ssm)
    assert conv2.dtype == conv.dtype and ssm2.dtype == ssm.dtype == torch.float32


def _triton_or_skip():
    pytest.importorskip("triton")
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("no CUDA and TRITON_INTERPRET is not set")


def test_triton_path_equals_reference_in_mixer():
    _triton_or_skip()
    m = make_mixer(dtype=torch.float32)
    x = torch.randn(2, 40, 32)
    conv0, ssm0 = (t.requires_grad_() for t in random_states(m, 2, dtype=torch.float32))
    before = ssd.get_backend()
    out = {}
    try:
        for name in ("ref", "triton"):
            ssd.set_backend(name)
            y, conv, ssm = m(x, conv0, ssm0)
            loss = (y ** 2).sum() + ssm.sum()
            out[name] = (y, ssm, torch.autograd.grad(loss, list(m.parameters()) + [conv0, ssm0]))
    finally:
        ssd.set_backend(before)
    (y_r, s_r, g_r), (y_t, s_t, g_t) = out["ref"], out["triton"]
    scale = lambda t: t.abs().max().clamp(min=1e-12)
    assert (y_t - y_r).abs().max() / scale(y_r) < 1e-5
    assert (s_t - s_r).abs().max() / scale(s_r) < 1e-5
    for a, b in zip(g_t, g_r):
        assert (a - b).abs().max() / scale(b) < 1e-4


def float32_case(length: int, starts: list | None, initial_memory: bool = True):
    """A float32 mixer (make_mixer), its input (2, length, 32) and carried states with gradients;
    with `starts` (each lane's document start positions) the segment ids and, with
    initial_memory, the (conv tail, SSM state) later documents start from. Returns (m, x, conv0,
    ssm0, seg, init, leaves: the tensors whose gradients the tests compare)."""
    m = make_mixer(dtype=torch.float32)
    x = torch.randn(2, length, 32, generator=torch.Generator().manual_seed(2))
    conv0, ssm0 = (t.requires_grad_() for t in random_states(m, 2, dtype=torch.float32))
    seg = init = None
    leaves = [conv0, ssm0]
    if starts is not None:
        first = torch.zeros(2, length, dtype=torch.long)
        for lane, at in enumerate(starts):
            first[lane, at] = 1
        seg = first.cumsum(1)
        if initial_memory:
            gen = torch.Generator().manual_seed(3)
            init = (torch.randn(m.conv_dim, 3, generator=gen).requires_grad_(),
                    torch.randn(m.heads, m.head_dim, m.d_state, generator=gen).requires_grad_())
            leaves += list(init)
    return m, x, conv0, ssm0, seg, init, leaves


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("backend", ["ref", "triton"])
def test_joint_gradient_and_silu_in_the_conv_kernels_equal_the_pytorch_mixer(packed, backend):
    # the Triton conv and scan as the GPU runs them (the scan's one joint gradient, SiLU' taken by
    # the conv's kernels as they read it), the older Triton form (three gradients, SiLU' in
    # PyTorch), on either scan path, == the mixer in PyTorch forms (fast_conv False): output,
    # states and every gradient, with packed documents and the initial memory's state too
    _triton_or_skip()
    from elephant.layers import conv_triton
    m, x, conv0, ssm0, seg, init, leaves = float32_case(40, [[5, 17, 18], [0, 33]] if packed else None)
    before, in_kernels = ssd.get_backend(), conv_triton.SILU_IN_KERNELS
    out = {}
    try:
        for name, fast, new in (("pytorch", False, False), ("older", True, False), ("new", True, True)):
            m.fast_conv, m.joint_grad, conv_triton.SILU_IN_KERNELS = fast, new, new
            ssd.set_backend("ref" if name == "pytorch" else backend)
            y, conv, ssm = m(x, conv0, ssm0, seg=seg, init=init)
            loss = (y ** 2).sum() + ssm.sum() + (conv * torch.linspace(-1, 1, 3)).sum()
            out[name] = (y, conv, ssm, torch.autograd.grad(loss, list(m.parameters()) + leaves))
    finally:
        ssd.set_backend(before)
        conv_triton.SILU_IN_KERNELS = in_kernels
        del m.fast_conv, m.joint_grad
    scale = lambda t: t.abs().max().clamp(min=1e-12)
    names = [n for n, _ in m.named_parameters()] + ["conv0", "ssm0", "tail", "ssm_init"]
    want = out["pytorch"]
    for name in ("older", "new"):
        got = out[name]
        for a, r in zip(got[:3], want[:3]):
            assert (a - r).abs().max() / scale(r) < 1e-5, name
        for n, a, r in zip(names, got[3], want[3]):
            assert (a - r).abs().max() / scale(r) < 1e-4, (name, n)


def _mixer_outputs(m, x, conv0, ssm0, seg, init, leaves):
    y, conv, ssm = m(x, conv0, ssm0, seg=seg, init=init)
    loss = (y ** 2).sum() + (ssm * torch.linspace(-1, 1, ssm.shape[-1])).sum() \
        + (conv * torch.linspace(-1, 1, conv.shape[-1])).sum()
    return y, conv, ssm, torch.autograd.grad(loss, list(m.parameters()) + leaves)


@pytest.mark.parametrize("packed", [False, True, "no tail"])
def test_the_block_as_one_op_equals_the_pytorch_mixer(packed):
    # mamba_inner (the conv, scan and gated norm as one op, whose backward writes the
    # in-projection's gradient whole: dz, dxBC, dt's gradient and the new conv state's in place)
    # == the mixer in PyTorch forms: output, both states and every gradient, the carried states'
    # and the initial memory's included; with packed documents (the conv's default form: the op
    # passes the form to the conv's own kernels), a document starting within the chunk's last
    # d_conv - 1 tokens (the new conv state reads the tail)
    _triton_or_skip()
    m, x, conv0, ssm0, seg, init, leaves = float32_case(
        24, [[5, 11, 12, 22], [0, 17]] if packed else None, initial_memory=packed != "no tail")
    before = ssd.get_backend()
    try:
        ssd.set_backend("ref")
        m.fast_conv, m.fused_inner = False, False
        want = _mixer_outputs(m, x, conv0, ssm0, seg, init, leaves)
        ssd.set_backend("triton")
        m.fast_conv, m.fused_inner = True, True
        assert m._takes_inner(m.in_proj(x), seg, init)
        got = _mixer_outputs(m, x, conv0, ssm0, seg, init, leaves)
    finally:
        ssd.set_backend(before)
        del m.fast_conv, m.fused_inner
    scale = lambda t: t.abs().max().clamp(min=1e-12)
    names = [n for n, _ in m.named_parameters()] + ["conv0", "ssm0", "tail", "ssm_init"]
    for a, r, n in zip(got[:3], want[:3], ("y", "conv", "ssm")):
        assert (a - r).abs().max() / scale(r) < 1e-5, n
    for n, a, r in zip(names, got[3], want[3]):
        assert (a - r).abs().max() / scale(r) < 1e-4, n


def test_the_block_as_one_op_in_chunks():
    # three chunks in a row, the middle one through the op (the carried states' gradients reach
    # it from the next chunk, and its own reach the previous one), == one pass of the PyTorch
    # mixer; a chunk shorter than d_conv - 1 tokens takes the separate path. (Compiled, the op is
    # a GPU test: wrap_triton does not trace the interpreter's kernels.)
    _triton_or_skip()
    m = make_mixer(dtype=torch.float32)
    x = torch.randn(2, 26, 32, generator=torch.Generator().manual_seed(4))
    conv0, ssm0 = (t.requires_grad_() for t in random_states(m, 2, dtype=torch.float32))
    leaves = list(m.parameters()) + [conv0, ssm0]
    before = ssd.get_backend()
    try:
        ssd.set_backend("ref")
        m.fast_conv, m.fused_inner = False, False
        y, conv, ssm = m(x, conv0, ssm0)
        want = (y, conv, ssm, torch.autograd.grad((y ** 2).sum() + ssm.sum(), leaves))
        ssd.set_backend("triton")
        m.fast_conv = True
        y1, c1, s1 = m(x[:, :9], conv0, ssm0)
        m.fused_inner = True
        assert not m._takes_inner(m.in_proj(x[:, :2]), None, None)
        y2, c2, s2 = m(x[:, 9:24], c1, s1)
        m.fused_inner = False
        y3, conv, ssm = m(x[:, 24:], c2, s2)
        y = torch.cat([y1, y2, y3], dim=1)
        got = (y, conv, ssm, torch.autograd.grad((y ** 2).sum() + ssm.sum(), leaves))
    finally:
        ssd.set_backend(before)
        del m.fast_conv, m.fused_inner
    scale = lambda t: t.abs().max().clamp(min=1e-12)
    for a, r in zip(got[:3], want[:3]):
        assert (a - r).abs().max() / scale(r) < 1e-5
    for a, r in zip(got[3], want[3]):
        assert (a - r).abs().max() / scale(r) < 1e-4
