"""GPU paths of the layers against their references: the Triton elephant kernels, the attention
kernels (flash / memory-efficient SDPA, FlexAttention) and their compiled use.

Run on a CUDA machine: `python -m pytest -m gpu tests/test_gpu_layers.py` (skipped without CUDA).
Tolerances are on the relative error ||got - want|| / ||want|| against a float64 reference.
"""
import pytest
import torch

from elephant.config import ModelConfig
from elephant.layers import elephant as E
from elephant.layers.attention import (Attention, attend, attend_reference, attend_segments,
                                       varlen_supported)
from elephant.layers.elephant import ElephantMLP, elephant, elephant_glu, elephant_glu_ref
from numerics import rel as rel_err

pytestmark = pytest.mark.gpu
DEVICE = "cuda"
REL_TOL = {torch.float32: 1e-3, torch.bfloat16: 2e-2}
DTYPES = [torch.float32, torch.bfloat16]
# FlexAttention is an opt-in backend (3x slower than masked SDPA here, LOG.md) whose compile
# took 3 of the GPU suite's 5 minutes: its tests run with ELEPHANT_GPU_SLOW=1 (conftest.py)
FLEX = pytest.param("flex", marks=pytest.mark.gpu_slow)


def randn(*shape, dtype=torch.float32, scale=1.0, seed=0):
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    return (torch.randn(*shape, device=DEVICE, generator=gen) * scale).to(dtype)


# ------------------------------------------------------------------------------- elephant
@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_elephant_on_cuda_matches_reference(dtype):
    u = randn(4096, 1536 // 4, dtype=dtype, scale=2, seed=1).requires_grad_()
    g = randn(4096, 1536 // 4, dtype=dtype, scale=2, seed=2).requires_grad_()
    dy = randn(4096, 1536 // 4, dtype=dtype, seed=3)
    assert E._use_triton(g) == (DEVICE == "cuda")
    u64, g64 = (t.detach().double().requires_grad_() for t in (u, g))
    want = elephant_glu_ref(u64, g64, 0.9, 8.0)
    want.backward(dy.double())
    got = elephant_glu(u, g, 0.9, 8.0)
    got.backward(dy)
    assert got.dtype == u.grad.dtype == g.grad.dtype == dtype
    tol = REL_TOL[dtype]
    assert rel_err(got, want) < tol
    assert rel_err(u.grad, u64.grad) < tol
    assert rel_err(g.grad, g64.grad) < tol
    x = g.detach().clone().requires_grad_()
    elephant(x).backward(dy)
    g64.grad = None
    E.elephant_ref(g64).backward(dy.double())
    assert rel_err(x.grad, g64.grad) < tol


def test_fused_elephant_on_cuda_special_values():
    x = torch.tensor([0.0, -0.0, 1e-30, 1.0, -1.0, 3e5, -1e30, 3e38], device=DEVICE,
                     requires_grad=True)
    y = elephant(x)
    y.sum().backward()
    want = torch.tensor([1, 1, 1, 0.5, 0.5, 0, 0, 0], device=DEVICE, dtype=torch.float32)
    torch.testing.assert_close(y, want)
    assert x.grad.isfinite().all()
    torch.testing.assert_close(x.grad[[0, 1, 2, 5, 6, 7]].abs(), torch.zeros(6, device=DEVICE))
    torch.testing.assert_close(x.grad[[3, 4]], torch.tensor([-2.0, 2.0], device=DEVICE))


@pytest.mark.parametrize("compiled", [False, True])
def test_fused_mlp_on_cuda_matches_reference_mlp(compiled):
    torch.manual_seed(0)
    cfg = ModelConfig(d_model=256, d_mlp=768)
    mlp = ElephantMLP(cfg).to(DEVICE)
    h = randn(4, 128, 256, seed=4).requires_grad_()
    results = []
    for fused in (True, False):
        mlp.fused = fused
        mlp.zero_grad()
        h.grad = None
        run = torch.compile(mlp) if compiled and fused else mlp
        with torch.autocast(DEVICE, dtype=torch.bfloat16):
            y = run(h)
        y.float().square().sum().backward()
        results.append([y, h.grad] + [p.grad for p in mlp.parameters()])
    for got, want in zip(*results):
        assert rel_err(got, want) < 2e-2


def test_fused_mlp_uses_less_peak_memory():
    cfg = ModelConfig(d_model=512, d_mlp=1536)
    mlp = ElephantMLP(cfg).to(DEVICE, torch.bfloat16)
    h = randn(8 * 512, 512, dtype=torch.bfloat16, seed=5).requires_grad_()
    peak = {}
    for fused in (True, False):   # once untimed: one-time allocations (the matmuls' workspace,
        mlp.fused = fused         # when this test is the first of its process) are not a peak
        mlp(h).sum().backward()
    h.grad = None
    mlp.zero_grad(set_to_none=True)
    for fused in (True, False):
        mlp.fused = fused
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        mlp(h).sum().backward()
        torch.cuda.synchronize()
        peak[fused] = torch.cuda.max_memory_allocated() - base
        h.grad = None
        mlp.zero_grad(set_to_none=True)
    assert peak[True] < peak[False]


# ------------------------------------------------------------------------------- attention kernels
def attention_inputs(dtype, cache: bool, B=2, H=4, S=200, W=96, hd=64):
    q, k, v = (randn(B, H, S, hd, dtype=dtype, seed=s).requires_grad_() for s in (10, 11, 12))
    if not cache:
        return q, k, v, None, None, None
    ck, cv = randn(B, H, W, hd, dtype=dtype, seed=13), randn(B, H, W, hd, dtype=dtype, seed=14)
    gen = torch.Generator(device=DEVICE).manual_seed(15)
    valid = torch.rand(B, W, device=DEVICE, generator=gen) < 0.7
    valid[0] = torch.arange(W, device=DEVICE) >= W // 3          # right-aligned, as the model keeps it
    return q, k, v, ck, cv, valid


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("backend,cache", [("sdpa", False), ("sdpa", True),
                                           pytest.param("flex", True, marks=pytest.mark.gpu_slow)])
def test_attention_kernel_matches_reference(backend, cache, dtype):
    q, k, v, ck, cv, valid = attention_inputs(dtype, cache)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    c64 = (ck.double(), cv.double()) if cache else (None, None)
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
        want = attend_reference(q64, k64, v64, *c64, valid)
    do = randn(*want.shape, seed=16)
    want.backward(do.double())
    got = attend(q, k, v, ck, cv, valid, backend=backend)
    got.backward(do.to(dtype))
    tol = REL_TOL[dtype]
    assert got.dtype == dtype
    for a, b, name in ((got, want, "out"), (q.grad, q64.grad, "dq"), (k.grad, k64.grad, "dk"),
                       (v.grad, v64.grad, "dv")):
        assert rel_err(a, b) < tol, f"{backend} {dtype} {name}: {rel_err(a, b):.2e}"


@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_varlen_attention_equals_reference_on_cuda(dtype, compiled):
    # the window's valid slots a suffix of it (KVCache's invariant): full, empty, one, a third, all
    # but one; FlashAttention's variable-length kernel against the float64 masked reference,
    # eager and compiled whole (the kernel and its backward as custom ops: no graph break)
    B, H, S, W, hd = 5, 4, 200, 96, 64
    q, k, v = (randn(B, H, S, hd, dtype=dtype, seed=s).requires_grad_() for s in (30, 31, 32))
    ck, cv = randn(B, H, W, hd, dtype=dtype, seed=33), randn(B, H, W, hd, dtype=dtype, seed=34)
    n_valid = torch.tensor([W, 0, 1, W // 3, W - 1], device=DEVICE)
    valid = torch.arange(W, device=DEVICE)[None, :] >= (W - n_valid)[:, None]
    assert varlen_supported(q, v)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
        want = attend_reference(q64, k64, v64, ck.double(), cv.double(), valid)
    do = randn(*want.shape, seed=35)
    want.backward(do.double())
    fn = lambda *a: attend(*a, valid_suffix=True)  # noqa: E731
    if compiled:
        torch._dynamo.reset()
        fn = torch.compile(fn, fullgraph=True, dynamic=False)
    got = fn(q, k, v, ck, cv, valid)
    got.backward(do.to(dtype))
    assert got.dtype == dtype
    for a, b, name in ((got, want, "out"), (q.grad, q64.grad, "dq"), (k.grad, k64.grad, "dk"),
                       (v.grad, v64.grad, "dv")):
        assert rel_err(a, b) < 1e-2, f"{dtype} {name}: {rel_err(a, b):.2e}"
    # what an invalid slot holds reaches nothing: bitwise the same output
    junk = randn(B, H, W, hd, dtype=dtype, seed=36) * 100
    ck2 = torch.where(valid[:, None, :, None], ck, junk)
    cv2 = torch.where(valid[:, None, :, None], cv, junk)
    assert torch.equal(fn(q, k, v, ck2, cv2, valid), got)


@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_segment_varlen_attention_equals_reference_on_cuda(dtype, compiled):
    # packed chunks: a sequence per document by FlashAttention's variable-length kernel (the window
    # for each lane's first, the initial memory's prefix for the later ones) against the float64
    # masked reference, eager and compiled whole, with the layout full and with room to spare
    B, H, S, W, M, hd = 4, 4, 200, 96, 8, 64
    seg = torch.zeros(B, S, dtype=torch.long, device=DEVICE)
    for lane, cols in enumerate(([], [7, 150], [1, 2, 3, 120, 199], [100])):
        for c in cols:
            seg[lane, c:] += 1
    inner = int(seg[:, -1].sum())
    q, k, v = (randn(B, H, S, hd, dtype=dtype, seed=s).requires_grad_() for s in (40, 41, 42))
    pk, pv = (randn(1, H, M, hd, dtype=dtype, seed=s).requires_grad_() for s in (43, 44))
    ck, cv = randn(B, H, W, hd, dtype=dtype, seed=45), randn(B, H, W, hd, dtype=dtype, seed=46)
    n_valid = torch.tensor([W, 0, 5, W // 3], device=DEVICE)
    valid = torch.arange(W, device=DEVICE)[None, :] >= (W - n_valid)[:, None]
    assert varlen_supported(q, v)
    ins64 = [t.detach().double().requires_grad_() for t in (q, k, v, pk, pv)]
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
        want = attend_segments(*ins64[:3], seg, ck.double(), cv.double(), valid, *ins64[3:])
    do = randn(*want.shape, seed=47)
    want.backward(do.double())
    for room in (inner, inner + 6):
        fn = lambda *a: attend_segments(*a, room=room)  # noqa: E731
        if compiled:
            torch._dynamo.reset()
            fn = torch.compile(fn, fullgraph=True, dynamic=False)
        ins = (q, k, v, pk, pv)
        for t in ins:
            t.grad = None
        got = fn(q, k, v, seg, ck, cv, valid, pk, pv)
        got.backward(do.to(dtype))
        assert got.dtype == dtype
        for a, b, name in zip((got, *(t.grad for t in ins)), (want, *(t.grad for t in ins64)),
                              ("out", "dq", "dk", "dv", "dprefix_k", "dprefix_v")):
            assert rel_err(a, b) < 1e-2, f"{dtype} room {room} {name}: {rel_err(a, b):.2e}"
        junk = randn(B, H, W, hd, dtype=dtype, seed=48) * 100
        ck2 = torch.where(valid[:, None, :, None], ck, junk)
        cv2 = torch.where(valid[:, None, :, None], cv, junk)
        assert torch.equal(fn(q, k, v, seg, ck2, cv2, valid, pk, pv), got)


def run_chunks(attn, x, pos, sizes, W):
    B, H, hd = x.shape[0], attn.n_heads, attn.head_dim
    cache_k = torch.zeros(B, H, W, hd, device=x.device, dtype=x.dtype)
    cache_v = torch.zeros_like(cache_k)
    valid = torch.zeros(B, W, dtype=torch.bool, device=x.device)
    ys, start = [], 0
    for size in sizes:
        chunk = slice(start, start + size)
        y, k, v = attn(x[:, chunk].contiguous(), pos[:, chunk].contiguous(), cache_k, cache_v, valid)
        ys.append(y)
        # contiguous: a compiled caller that gets a strided view of [cache | k] recompiles once
        cache_k = torch.cat([cache_k, k.detach()], 2)[:, :, -W:].contiguous()
        cache_v = torch.cat([cache_v, v.detach()], 2)[:, :, -W:].contiguous()
        valid = torch.cat([valid, torch.ones_like(valid[:, :size])], 1)[:, -W:].contiguous()
        start += size
    return torch.cat(ys, 1)


@pytest.mark.parametrize("backend", ["sdpa", FLEX])
def test_attention_layer_chunked_equals_whole_on_cuda(backend):
    torch.manual_seed(0)
    cfg = ModelConfig(d_model=256, n_heads=4)
    attn = Attention(cfg, backend=backend).to(DEVICE)
    x = randn(2, 384, 256, seed=20)
    pos = torch.arange(384, device=DEVICE).expand(2, 384) + torch.tensor([[0], [777]], device=DEVICE)
    whole = attn(x, pos)[0]
    chunked = run_chunks(attn, x, pos, [128, 128, 128], W=256)
    assert rel_err(chunked, whole) < 1e-3


@pytest.mark.parametrize("backend", ["sdpa", FLEX])
def test_compiled_attention_does_not_recompile_across_chunks(backend):
    torch.manual_seed(0)
    torch._dynamo.reset()
    cfg = ModelConfig(d_model=256, n_heads=4)
    attn = Attention(cfg, backend=backend).to(DEVICE)
    compiled = torch.compile(attn)
    x = randn(2, 4 * 96, 256, seed=21)
    pos = torch.arange(4 * 96, device=DEVICE).expand(2, -1)
    eager = run_chunks(attn, x, pos, [96] * 4, W=128)
    with torch._dynamo.config.patch(error_on_recompile=True):
        got = run_chunks(compiled, x, pos, [96] * 4, W=128)   # valid masks differ per chunk
    got.sum().backward()
    assert rel_err(got, eager) < 1e-3


# ------------------------------------------------------------------------------- kept tokens
@pytest.mark.parametrize("kernel", ["dense", "fused"])
@pytest.mark.parametrize("free", [False, True])
def test_two_part_kept_read_on_cuda_equals_the_cpu_masked_path(monkeypatch, free, kernel):
    """attend_top_kept in bf16 on CUDA ([window | chunk] by FlashAttention's variable-length
    kernel with its log-sum-exp, position-free memory's values padded to the doubled head dims;
    each query's best 32 of 512 kept tokens apart) against the masked path (`kept_top`'s choice
    as a mask per head and query over [kept | window | chunk]) in float64 on the CPU, given the
    GPU's choice (bf16 scores: a near tie may fall either way, and the choice is not the point).
    Lanes: full window, every kept token valid; empty window, half valid; a third of the window,
    fewer valid than a query reads; most of the window, none. Captured as a CUDA graph (the
    evaluation's static step) it replays the same output. Part 2 by either kernel
    (kept_read.KERNEL: the score matrix and top-k, or layers/kept_read_triton.py)."""
    from elephant.layers import attention, kept_read
    monkeypatch.setattr(kept_read, "KERNEL", kernel)
    from elephant.layers.attention import (attend_top_kept, free_scores, kept_top,
                                           pad_sequence_keys)
    B, H, S, W, K, R, hd = 4, 4, 96, 64, 512, 32, 64
    dt = torch.bfloat16
    q, k, v, q_raw, k_raw = (randn(B, H, S, hd, dtype=dt, seed=s) for s in (50, 51, 52, 53, 54))
    ck, cv = randn(B, H, W, hd, dtype=dt, seed=55), randn(B, H, W, hd, dtype=dt, seed=56)
    kk, kv = randn(B, H, K, hd, dtype=dt, seed=57), randn(B, H, K, hd, dtype=dt, seed=58)
    n_valid = torch.tensor([W, 0, W // 3, W - 5], device=DEVICE)
    valid = torch.arange(W, device=DEVICE)[None, :] >= (W - n_valid)[:, None]
    gen = torch.Generator(device=DEVICE).manual_seed(59)
    kept_valid = torch.rand(B, K, device=DEVICE, generator=gen) < 0.5
    kept_valid[0] = True
    kept_valid[2] = torch.arange(K, device=DEVICE) % 40 == 0         # 13 valid, fewer than R
    kept_valid[3] = False
    qa, ka, window_k = q, k, ck
    if free:   # memory tokens at the chunk's both ends, scored without rotary
        s = torch.arange(S, device=DEVICE)
        qa, ka = free_scores(q, q_raw, k, k_raw, (s < 8) | (s >= S - 8))
        window_k = pad_sequence_keys(ck)
    kernels = []
    plain = attention.flash_varlen_lse

    def counted(*args):
        kernels.append(args[0].shape[-1])
        return plain(*args)
    monkeypatch.setattr(attention, "flash_varlen_lse", counted)
    with torch.no_grad():
        got = attend_top_kept(qa, ka, v, window_k, cv, valid, q, kk, kv, kept_valid, R)
        seen = kept_top(q, kk, kept_valid, R)                  # the choice, as the read makes it
    assert kernels == [qa.shape[-1]] and got.dtype == dt
    keys = torch.cat([kk, ck], dim=2)
    keys = pad_sequence_keys(keys) if free else keys
    mask = torch.cat([seen, valid[:, None, None, :].expand(B, H, S, W)], dim=-1)
    cpu = [t.cpu().double() for t in (qa, ka, v, keys, torch.cat([kv, cv], dim=2))]
    want = attend_reference(*cpu, mask.cpu())
    assert rel_err(got.cpu(), want) < 2e-2, rel_err(got.cpu(), want)
    # a CUDA graph: no host synchronization inside, the same kernels replayed
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.no_grad(), torch.cuda.stream(side):
        attend_top_kept(qa, ka, v, window_k, cv, valid, q, kk, kv, kept_valid, R)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.no_grad(), torch.cuda.graph(graph):
        out = attend_top_kept(qa, ka, v, window_k, cv, valid, q, kk, kv, kept_valid, R)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, got)


def test_fused_kept_read_compiles_into_one_graph_and_equals_the_dense_read():
    """The fused kept read (a triton op) inside torch.compile(fullgraph=True) gives what it gives
    eagerly, and in bf16 what the dense read gives at the recall setting's ratio (4,096 kept, 128
    read) up to the rounding of the scores (a near tie may fall either way)."""
    from elephant.layers.kept_read import top_kept_read
    from elephant.layers.kept_read_triton import fused_kept_read
    B, H, S, K, R, hd = 2, 4, 200, 4096, 128, 64
    q, kk, kv = (randn(B, H, n, hd, dtype=torch.bfloat16, seed=60 + i)
                 for i, n in enumerate((S, K, K)))
    valid = torch.ones(B, K, dtype=torch.bool, device=DEVICE)
    valid[1, 3000:] = False
    with torch.no_grad():
        out, lse = fused_kept_read(q, kk, kv, valid, R, hd ** -0.5)
        c_out, c_lse = torch.compile(fused_kept_read, fullgraph=True)(q, kk, kv, valid, R, hd ** -0.5)
        d_out, d_lse = top_kept_read(q, kk, kv, valid, R, hd ** -0.5)
    assert torch.equal(out, c_out) and torch.equal(lse, c_lse)
    assert rel_err(out.float(), d_out.float()) < 2e-2, rel_err(out.float(), d_out.float())
    assert (lse - d_lse).abs().max() < 2e-2


# ------------------------------------------------------------------------------- q/k/v kernel
@pytest.mark.parametrize("compiled, read_q", [(False, False), (True, False), (True, True)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_qkv_kernel_equals_the_plain_project_on_cuda(dtype, compiled, read_q):
    # layers/rotary_triton.py at the recipe's attention shape (8 heads of 64, 16 + 512 + 16 tokens,
    # positions in the millions and a lane starting negative): q, k, v and the gradients of the
    # input, the projection and the q/k norm weights equal the plain path's; `read_q`: also the
    # queries before rotary (model.kv_assoc's read) and their gradients (the keys before rotary
    # carry none on the fused path: they are left out of the loss)
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=64, d_model=512, n_heads=8, layers="A", d_mlp=64, qk_norm=True)
    attn = Attention(cfg).to(DEVICE, dtype)
    with torch.no_grad():
        attn.q_norm.weight.uniform_(0.5, 1.5)
        attn.k_norm.weight.uniform_(0.5, 1.5)
    B, S = 4, 544
    x = randn(B, S, cfg.d_model, dtype=dtype, seed=1).requires_grad_()
    pos = torch.arange(S, device=DEVICE).expand(B, S) + torch.tensor(
        [[-5], [0], [4096], [3_000_000]], device=DEVICE)
    grads = [randn(B, 8, S, 64, dtype=dtype, seed=2 + i) for i in range(5)]
    grads[3] = torch.zeros_like(grads[3])
    project = torch.compile(attn.project, dynamic=False) if compiled else attn.project

    def run(fused):
        attn.fused_qkv = fused
        for p in [x, *attn.parameters()]:
            p.grad = None
        out = project(x, pos, raw=read_q, read_q=read_q)
        assert len(out) == (5 if read_q else 3)
        sum((o.float() * g.float()).sum() for o, g in zip(out, grads)).backward()
        named = {"x": x.grad, **{n: p.grad for n, p in attn.named_parameters() if p.grad is not None}}
        return [o.detach().clone() for o in out], {n: g.clone() for n, g in named.items()}

    (want, want_g), (got, got_g) = run(False), run(True)
    tol = REL_TOL[dtype] / (10 if dtype == torch.float32 else 2)
    for a, b in zip(got, want):
        assert a.dtype == b.dtype and rel_err(a, b) < tol
    assert got_g.keys() == want_g.keys() and "q_norm.weight" in got_g
    for name, g in want_g.items():
        assert rel_err(got_g[name], g) < tol, name


# ------------------------------------------------------------------------------- gated norm
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("compiled", [False, True])
def test_gated_norm_kernel_equals_reference_on_cuda(dtype, compiled):
    # the Mamba block's gated RMSNorm with the Triton backward against autograd of the same ops
    # in float64, at the recipe's row width, z a strided slice of a wider projection output
    from elephant.layers import norm_triton
    B, L, D = 4, 264, 1024
    wide = randn(B, L, 2 * D + 80, dtype=dtype, seed=1)
    z = wide[..., :D].detach().requires_grad_()
    y = randn(B, L, D, dtype=dtype, seed=2).requires_grad_()
    w = (randn(D, seed=3) * 0.2 + 1).requires_grad_()
    dout = randn(B, L, D, dtype=dtype, seed=4)
    fn = (torch.compile(norm_triton.gated_rmsnorm, dynamic=False) if compiled
          else norm_triton.gated_rmsnorm)
    out = fn(y, z, w, 1e-5)
    out.backward(dout)
    refs = [t.detach().double().requires_grad_() for t in (y, z, w)]
    want = norm_triton.reference(*refs, 1e-5)
    want.backward(dout.double())
    assert out.dtype == dtype and y.grad.dtype == dtype and z.grad.dtype == dtype
    tol = REL_TOL[dtype] / 2
    for got, ref in zip((out, y.grad, z.grad, w.grad), (want, *(t.grad for t in refs))):
        assert rel_err(got, ref) < tol
