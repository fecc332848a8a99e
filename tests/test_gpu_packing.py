"""The fast ways of the packed path on CUDA (issue 11): the masked conv held equal to its indexing
reference (eager and compiled, fp32 and bf16, values and gradients), and the trainer's flow (the
initial-memory prefix once per step, carried by the state from the first chunk that needs it, the
plain path for chunks without an inner start) with compiled blocks: no recompiles once warm, and the
gradients of the per-chunk prefix; as CUDA graphs, the same losses and gradients as eager.

Run on a CUDA machine: `python -m pytest -m gpu tests/test_gpu_packing.py`.
"""
import pytest
import torch
import torch.nn.functional as F

from elephant.config import ModelConfig
from elephant.layers.mamba import segment_conv, segment_conv_reference
from elephant.model import ElephantLM
from elephant.state import StaticCarry
from numerics import rel

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("compiled", [False, True])
def test_packed_conv_equals_indexing_reference_on_cuda(dtype, compiled):
    gen = torch.Generator(device="cuda").manual_seed(0)
    B, C, K, L = 4, 96, 4, 200
    window = torch.randn(B, C, K - 1 + L, device="cuda", generator=gen).to(dtype).requires_grad_()
    w = torch.randn(C, 1, K, device="cuda", generator=gen, requires_grad=True)
    b = torch.randn(C, device="cuda", generator=gen, requires_grad=True)
    tail = torch.randn(C, K - 1, device="cuda", generator=gen, requires_grad=True)
    starts = torch.rand(B, L, device="cuda", generator=gen) < 0.05
    starts[0, 1] = starts[1, 0] = starts[2, L - 1] = True     # 1-token segment, row from 0, at the end
    seg = starts.long().cumsum(1)
    fast = torch.compile(segment_conv, dynamic=False) if compiled else segment_conv
    w_out = torch.randn(B, C, L, device="cuda", generator=gen)
    res = []
    for fn in (fast, segment_conv_reference):
        # the reference in float32 (its sums round in the input dtype), the fast form as used
        x = window if fn is fast else window.detach().float().requires_grad_()
        out, state = fn(x, seg, w, b, tail)
        loss = (out.float() * w_out).sum() + state.float().pow(2).sum()
        res.append((out, state, torch.autograd.grad(loss, [x, w, b, tail])))
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    (o1, s1, g1), (o2, s2, g2) = res
    assert o1.dtype == dtype and rel(o1, o2) < tol and rel(s1, s2) < tol
    for name, a, r in zip(("window", "weight", "bias", "tail"), g1, g2):
        assert rel(a, r) < tol, name


CONV_CASES = [pytest.param(with_seg, form, dtype, compiled,
                           id=f"{name}-{str(dtype)[6:]}-{'compiled' if compiled else 'eager'}")
              for with_seg, form, name in ((False, "tiles", "plain"), (True, "starts", "starts"))
              for dtype, compiled in ((torch.float32, False), (torch.bfloat16, False),
                                      (torch.bfloat16, True))]
CONV_CASES.append(pytest.param(True, "tiles", torch.float32, False, id="tiles-float32-eager"))


@pytest.mark.parametrize("with_seg, form, dtype, compiled", CONV_CASES)
def test_triton_conv_equals_the_reference_on_cuda(with_seg, form, dtype, compiled):
    # layers/conv_triton.py on CUDA, eager and inside a compiled graph (triton_op), against the
    # PyTorch forms in float32: values, the state after the chunk and every gradient. Compiled, it
    # runs as the Mamba block calls it (bfloat16, as trained), with the SiLU written by the same
    # kernel; the kernels' float32 numerics are the eager runs' (a compiled float32 run added
    # 6-33 s of compile each and no path). form: segments mended at each start (the default,
    # conv_triton.SEGMENT_FORM), or by the boundary tiles recomputed: that form, an alternative
    # since 2026-11-26, is held to the reference in float32 here and on the CPU (its backward
    # kernel with segments takes ~24 s to compile, each run of it 20-33 s of the GPU suite)
    from elephant.layers.conv_triton import depthwise_conv
    silu = compiled
    gen = torch.Generator(device="cuda").manual_seed(0)
    B, C, K, L = 4, 200, 4, 300
    xin = torch.randn(B, L, C + 8, device="cuda", generator=gen).to(dtype).requires_grad_()
    state = torch.randn(B, C, K - 1, device="cuda", generator=gen).requires_grad_()
    w = torch.randn(C, 1, K, device="cuda", generator=gen, requires_grad=True)
    b = torch.randn(C, device="cuda", generator=gen, requires_grad=True)
    tail = torch.randn(C, K - 1, device="cuda", generator=gen, requires_grad=True) if with_seg else None
    seg = None
    if with_seg:
        starts = torch.rand(B, L, device="cuda", generator=gen) < 0.05
        starts[:, 0] = False
        starts[0, 1] = starts[1, 5] = starts[1, 6] = starts[2, L - 1] = True
        seg = starts.long().cumsum(1)
    go = torch.randn(B, L, C, device="cuda", generator=gen)
    gs = torch.randn(B, C, K - 1, device="cuda", generator=gen)
    inputs = [xin, state, w, b] + ([tail] if with_seg else [])

    def fast(xin, state, w, b, tail):
        return depthwise_conv(xin[:, :, 8:], state, w, b, seg, tail, silu=silu, form=form)

    def reference(xin, state, w, b, tail):
        window = torch.cat([state, xin[:, :, 8:].float().transpose(1, 2)], dim=2)
        if seg is None:
            out, st = F.conv1d(window, w, b, groups=C), window[:, :, -(K - 1):]
        else:
            out, st = segment_conv_reference(window, seg, w, b, tail)
        return (F.silu(out) if silu else out).transpose(1, 2), st

    fn = torch.compile(fast, dynamic=False) if compiled else fast
    res = []
    for f in (fn, reference):
        out, st = f(xin, state, w, b, tail)
        loss = (out.float() * go).sum() + (st.float() * gs).sum()
        res.append((out, st, torch.autograd.grad(loss, inputs)))
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    (o1, s1, g1), (o2, s2, g2) = res
    assert o1.dtype == dtype and rel(o1, o2) < tol and rel(s1, s2) < tol
    for name, a, r in zip(("x", "state", "weight", "bias", "tail"), g1, g2):
        assert rel(a, r) < tol, name


@pytest.mark.heavy
def test_packed_trainer_flow_compiled_no_recompiles_and_prefix_gradients():
    import torch._dynamo
    torch._dynamo.reset()
    torch.manual_seed(0)
    # one layer of each kind (compiling is the cost; a deeper stack adds time, not paths)
    cfg = ModelConfig(vocab_size=512, d_model=128, n_heads=4, layers="MA", d_mlp=256, d_state=32,
                      mamba_head_dim=32, ssd_chunk=32, n_mem=4, kv_window=64, bptt_chunks=2)
    model = ElephantLM(cfg).cuda()
    for block in model.blocks:
        block.compile(dynamic=False)
    gen = torch.Generator().manual_seed(1)
    B, T = 4, 64

    def step(c, shared):
        """One trainer step of two chunks: the first with inner starts, the second (odd steps)
        without, which then goes without `starts` as the trainer sends it. shared: the prefix of
        the first chunk carried on by the state (the trainer's way), else computed in every chunk."""
        loss, state = 0.0, step.state
        for j in range(2):
            tokens = torch.randint(0, 512, (B, T + 1), generator=gen).cuda()
            starts = (torch.rand(B, T, generator=gen) < 0.05).cuda()
            starts[0, 17] = True
            if j == 1 and c % 2:
                starts = None
            if state is not None and not shared:
                state.prefix = None
            reset = torch.zeros(B, dtype=torch.bool, device="cuda")
            nll, state = model(tokens[:, :-1], state, reset, targets=tokens[:, 1:], starts=starts)
            loss = loss + nll
        loss.backward()
        step.state = state.detach()
        return loss.detach()

    step.state = None
    try:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            for c in range(5):
                if c == 3:  # warm: both kinds of step, a fresh and a carried state have been seen
                    torch._dynamo.config.error_on_recompile = True
                model.zero_grad()
                step(c, shared=True)
            # the same step with the prefix shared and computed per chunk: same loss and gradients
            results = []
            for shared in (True, False):
                gen.manual_seed(2)
                saved = step.state
                model.zero_grad()
                loss = step(5, shared)
                results.append((loss, {n: p.grad.clone() for n, p in model.named_parameters()
                                       if p.grad is not None}))
                step.state = saved
    finally:
        torch._dynamo.config.error_on_recompile = False
    (l1, g1), (l2, g2) = results
    assert rel(l1, l2) < 1e-5 and "mem_init" in g1 and g1.keys() == g2.keys()
    for name, g in g2.items():
        assert rel(g1[name], g) < 1e-3, name


@pytest.mark.heavy
def test_compiled_prefix_takes_the_plain_paths_and_equals_the_custom_ops_on_cuda():
    # the initial memory's prefix (n_mem tokens, one lane) compiled: its Mamba scans and elephant
    # MLPs are inlined into the graph (no custom op call at run time, forward or backward), and
    # it equals the eager prefix through the custom ops (values and parameter gradients; float32,
    # so that the two paths' difference is not buried under bf16 rounding)
    from torch.profiler import ProfilerActivity, profile
    from elephant.layers import INLINE_MAX_TOKENS
    torch.manual_seed(0)
    # one layer of each kind: a deeper stack adds compile time (this test's cost), not paths
    cfg = ModelConfig(vocab_size=256, d_model=256, n_heads=4, layers="MA", d_mlp=512, d_state=32,
                      mamba_head_dim=64, ssd_chunk=64, n_mem=8, kv_window=64)
    assert cfg.n_mem <= INLINE_MAX_TOKENS
    model = ElephantLM(cfg).cuda()
    model.set_fast_paths(True)
    params = [p for p in model.parameters() if p.requires_grad]

    def prefix_and_grads(fn):
        out = fn()
        flat = [t for entry in out for t in entry]
        loss = sum((t.float() ** 2).sum() for t in flat)
        return flat, torch.autograd.grad(loss, params, allow_unused=True)

    want, want_g = prefix_and_grads(model.init_prefix)
    compiled = torch.compile(model.init_prefix, dynamic=False)
    prefix_and_grads(compiled)                                       # compile
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        got, got_g = prefix_and_grads(compiled)
    custom = sorted({e.key for e in prof.key_averages() if e.key.startswith("elephant::")})
    assert not custom, f"custom ops called by the compiled prefix: {custom}"
    for a, b in zip(got, want):
        assert rel(a, b) < 1e-3
    for (name, _), a, b in zip([(n, p) for n, p in model.named_parameters() if p.requires_grad],
                               got_g, want_g):
        if b is None:
            assert a is None or not a.any(), name
            continue
        assert rel(a, b) < 1e-3, name


@pytest.mark.heavy
@pytest.mark.parametrize("pattern, window", [("SS", False), ("NS", False), ("SN", False),
                                             ("SN", True)])
def test_cuda_graph_steps_equal_the_eager_steps(pattern, window):
    # compile_for("graphs"): the chunk step and the prefix replayed as CUDA graphs (reduce-overhead)
    # over trainer-like steps (two chunks, one backward, the state carried past each step in the
    # trainer's StaticCarry): the same losses and gradients as the eager model (float32), no graph
    # left to run outside its CUDA graph, and the carry's buffers read in place by the replays
    # (static inputs of a recorded graph, not copied into placeholders). `pattern`: which chunk of each step has inner starts (S) and which has none
    # (N). Each pattern makes two graphs (a chunk after the step's detach, and one carrying the
    # gradient path) and runs each three times (warm-up, recording, replay); the three patterns are
    # three tests so that their compiles, the cost of this test, run side by side under xdist.
    # `window`: compile_for("window"), the step's two chunks as one graph (forward_window).
    import copy
    import torch._dynamo
    from torch._dynamo.utils import counters
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    # one layer of each kind: a deeper stack adds compile time, not paths
    cfg = ModelConfig(vocab_size=512, d_model=128, n_heads=4, layers="MA", d_mlp=256, d_state=32,
                      mamba_head_dim=32, ssd_chunk=32, n_mem=4, kv_window=64, bptt_chunks=2)
    eager = ElephantLM(cfg).cuda()
    eager.set_fast_paths(True)
    graphs = copy.deepcopy(eager)
    graphs.compile_for("window" if window else "graphs")
    gen = torch.Generator().manual_seed(3)
    B, T, steps = 4, 64, 3
    data = []
    for s in range(steps):
        for j, kind in enumerate(pattern):
            tokens = torch.randint(0, 512, (B, T + 1), generator=gen).cuda()
            starts = (torch.rand(B, T, generator=gen) < 0.05).cuda()
            starts[0, 17] = True
            # the trainer's reset flags: some lanes begin a document with the step's first chunk
            reset = (torch.rand(B, generator=gen) < (0.5 if s == j == 0 else 0.0)).cuda()
            data.append((tokens, reset, starts if kind == "S" else None))

    carry = StaticCarry()

    def run(model, cuda_graphs):
        """Eager: the prefix computed by a call of its own and passed in; as CUDA graphs: the
        trainer's way, in the step of the first chunk that needs it, carried on by the state."""
        state, out = model.init_state(B), []
        for s in range(steps):
            if cuda_graphs:
                torch.compiler.cudagraph_mark_step_begin()
                state = carry.take(state)
            loss, prefix, step = 0.0, None, data[2 * s:2 * s + 2]
            if cuda_graphs and window:
                loss, state = model.forward_window(
                    [dict(tokens=tokens[:, :-1], targets=tokens[:, 1:], reset=reset, starts=starts)
                     for tokens, reset, starts in step], state, reduction="mean")
            else:
                for tokens, reset, starts in step:
                    if starts is not None and prefix is None and not cuda_graphs:
                        prefix = model.init_prefix()
                    nll, state = model(tokens[:, :-1], state, reset, targets=tokens[:, 1:],
                                       starts=starts, prefix=prefix)
                    loss = loss + nll
            model.zero_grad(set_to_none=True)
            loss.backward()
            state = state.detach()
            if cuda_graphs:
                state = carry.take(state)
            out.append((loss.detach().clone(), {n: p.grad.clone() for n, p in model.named_parameters()
                                                if p.grad is not None}))
        return out

    want, got = run(eager, False), run(graphs, True)
    for (l1, g1), (l2, g2) in zip(got, want):
        assert rel(l1, l2) < 1e-4 and g1.keys() == g2.keys() and "mem_init" in g1
        for name, g in g2.items():
            assert rel(g1[name], g) < 1e-3, name
    # per chunk: a graph for the chunk after the step's detach and one for the chunk carrying
    # the gradient path; a window: one for both
    assert counters["stats"]["unique_graphs"] == (1 if window else 2), dict(counters["stats"])
    assert not counters["inductor"].get("cudagraph_skips", 0), dict(counters["inductor"])
    from torch._inductor import cudagraph_trees
    manager = cudagraph_trees.get_container(torch.cuda.current_device()).tree_manager
    static, nodes = set(), [n for roots in manager.roots.values() for n in roots]
    while nodes:
        node = nodes.pop()
        static.update(p for p in node.static_input_data_ptrs if p is not None)
        nodes.extend(n for kids in node.children.values() for n in kids)
    names = list(eager.init_state(B).tensors())
    missing = [name for name, t in zip(names, carry.buffers) if t.data_ptr() not in static]
    assert not missing, missing
