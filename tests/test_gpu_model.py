"""The chunk contract on CUDA with the fast paths (Triton SSD, SDPA, fused elephant MLP), and the
fast model held equal to the reference model (PyTorch SSD, explicit-mask attention, autograd MLP).

Run on a CUDA machine: `python -m pytest -m gpu tests/test_gpu_model.py`. Tolerances: fp32 with
3xTF32 Triton products, relative error of logits / gradients below 1e-3.
"""
import pytest
import torch

from elephant.config import ModelConfig
from elephant.layers import ssd
from elephant.model import ElephantLM
from numerics import rel

pytestmark = pytest.mark.gpu


def cfg(**kw) -> ModelConfig:
    base = dict(vocab_size=512, d_model=128, n_heads=4, layers="MAMA", d_mlp=256, d_state=32,
                mamba_head_dim=32, ssd_chunk=32, n_mem=0, kv_window=256)
    base.update(kw)
    return ModelConfig(**base)


@pytest.fixture(autouse=True)
def restore_backend():
    yield
    ssd.set_backend("auto")


def test_chunked_equals_whole_on_cuda_fast_path():
    torch.manual_seed(0)
    model = ElephantLM(cfg()).cuda()
    model.set_fast_paths(True)
    tokens = torch.randint(0, 512, (4, 200), device="cuda")
    whole, _ = model(tokens)
    state, outs, start = None, [], 0
    for n in (37, 64, 1, 98):
        out, state = model(tokens[:, start:start + n], state)
        outs.append(out)
        start += n
    assert rel(torch.cat(outs, 1), whole) < 1e-3


@pytest.mark.parametrize("n_mem", [0, 4])
def test_fast_model_equals_reference_model(n_mem):
    torch.manual_seed(0)
    model = ElephantLM(cfg(n_mem=n_mem, kv_window=64, bptt_chunks=2)).cuda()
    tokens = torch.randint(0, 512, (3, 2, 96), device="cuda")
    assert_fast_equals_reference(model, tokens[:2])


def test_fast_model_with_the_associative_memory_equals_reference_model():
    # model.kv_assoc on CUDA: the fused q/k/v kernel's queries before rotary (its read), the
    # write of what leaves a window shorter than the chunk, and their gradients
    torch.manual_seed(0)
    model = ElephantLM(cfg(kv_window=32, kv_keep=8, kv_keep_noise=0.0, kv_assoc=True,
                           bptt_chunks=3)).cuda()
    with torch.no_grad():   # gates open enough that the read moves the logits
        for block in model.blocks:
            if block.kind == "A":
                block.mixer.assoc_b.fill_(1.0)
                block.mixer.assoc_w.normal_(std=0.1)
    tokens = torch.randint(0, 512, (3, 2, 96), device="cuda")
    assert_fast_equals_reference(model, tokens)
    assert model.blocks[1].mixer.assoc_w.grad.abs().sum() > 0


def assert_fast_equals_reference(model, tokens, starts=None):
    """Fast paths == reference paths over the chunks of `tokens` (chunks, B, T) with carried state
    (and document `starts`, same shape): the last chunk's logits and every gradient."""
    results = {}
    for fast in (False, True):
        model.set_fast_paths(fast)
        model.zero_grad()
        state, loss = None, 0.0
        for c in range(len(tokens)):
            logits, state = model(tokens[c], state, starts=None if starts is None else starts[c])
            loss = loss + logits.float().pow(2).mean()
        loss.backward()
        results[fast] = (logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()})
    assert rel(results[True][0], results[False][0]) < 1e-3
    for name, g in results[False][1].items():
        assert rel(results[True][1][name], g) < 1e-2, name


def test_bf16_autocast_training_step_is_finite_and_close_to_fp32():
    torch.manual_seed(0)
    model = ElephantLM(cfg(n_mem=4, kv_window=64)).cuda()
    tokens = torch.randint(0, 512, (4, 129), device="cuda")
    loss32, _ = model(tokens[:, :-1], targets=tokens[:, 1:])
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss16, state = model(tokens[:, :-1], targets=tokens[:, 1:])
        loss16b, _ = model(tokens[:, :-1], state, targets=tokens[:, 1:])
    (loss16 + loss16b).backward()
    assert torch.isfinite(loss16) and abs(loss16.item() - loss32.item()) < 2e-2 * loss32.item()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


# Whether a compiled block recompiles is decided by dynamo's guards, whatever backend compiles the
# graph it captured; the two tests below use the aot_eager backend (dynamo + AOT autograd, no
# inductor code generation), which takes seconds where inductor took a minute. Inductor's code for
# these blocks is exercised by the compiled mixer / MLP / attention / head tests and by
# benchmarks/train_speed.py, which fails on a recompile of the inductor-compiled training step.
def test_compiled_blocks_do_not_recompile_across_chunks():
    assert_compiled_blocks_never_recompile(
        5, lambda c: {"reset": torch.tensor([c == 2, False, False, c == 3], device="cuda")})


def assert_compiled_blocks_never_recompile(n_chunks, chunk_kwargs):
    """Blocks compiled (aot_eager) over `n_chunks` chunks with carried state, chunk c given the
    forward arguments `chunk_kwargs(c)`: once warmed up (a fresh state and a carried one seen, after
    two chunks) a recompile is an error."""
    import torch._dynamo
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = ElephantLM(cfg(n_mem=4, kv_window=64)).cuda()
    for block in model.blocks:
        block.compile(dynamic=False, backend="aot_eager")
    state = None
    try:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            for c in range(n_chunks):
                if c == 2:
                    torch._dynamo.config.error_on_recompile = True
                tokens = torch.randint(0, 512, (4, 64), device="cuda")
                loss, state = model(tokens, state, targets=tokens, **chunk_kwargs(c))
                loss.backward()
                state = state.detach()
    finally:
        torch._dynamo.config.error_on_recompile = False


# --- packed documents (starts) ---------------------------------------------------------------------

def random_starts(chunks, B, T, mean_len, seed=0):
    """(chunks, B, T) document starts with geometric gaps around mean_len, on CUDA."""
    gen = torch.Generator().manual_seed(seed)
    return (torch.rand(chunks, B, T, generator=gen) < 1.0 / mean_len).cuda()


@pytest.mark.parametrize("n_mem,conv_form", [(0, "starts"),
                                              pytest.param(4, "starts", marks=pytest.mark.heavy)])
def test_packed_fast_model_equals_reference_model(n_mem, conv_form, monkeypatch):
    # conv_form: the Mamba conv's form with segments (conv_triton.SEGMENT_FORM). Its other form,
    # "tiles", takes the same arguments from the model: its kernels are held to the reference in
    # test_gpu_packing.py and its documents kept apart below (here it cost 19 and 50 s of compile)
    from elephant.layers import conv_triton
    monkeypatch.setattr(conv_triton, "SEGMENT_FORM", conv_form)
    torch.manual_seed(0)
    model = ElephantLM(cfg(n_mem=n_mem, kv_window=64, bptt_chunks=2)).cuda()
    tokens = torch.randint(0, 512, (3, 2, 96), device="cuda")
    starts = random_starts(3, 2, 96, 30)
    assert_fast_equals_reference(model, tokens, starts)


# kept tokens: one attention layer, first, so that both runs' keep scores read the same inputs
# (a later layer's differ by the kernels' rounding, which may swap two kept tokens of near scores)
@pytest.mark.parametrize("n_mem, kv_keep, layers", [(0, 0, "AMA"), (4, 0, "AMA"), (0, 16, "AM")])
def test_packed_varlen_attention_equals_the_masked_path_in_the_model(n_mem, kv_keep, layers):
    """bf16, the trainer's way (the inner starts counted on the host): packed chunks whose attention
    runs by the variable-length kernel, a sequence per document, give the masked path's logits and
    gradients (the same model with the count unknown); the variable-length kernel ran for the
    chunks whose starts fit its room, the masked path for the other. With kept tokens, the
    kernel reads them with the window (attention.with_kept_first)."""
    from elephant.layers import attention
    torch.manual_seed(0)
    model = ElephantLM(cfg(n_mem=n_mem, kv_window=64, kv_keep=kv_keep, kv_keep_noise=0.0,
                           layers=layers, bptt_chunks=3)).cuda()   # no noise: both runs keep alike
    tokens = torch.randint(0, 512, (3, 4, 96), device="cuda")
    starts = random_starts(3, 4, 96, 60)          # 5, 6 and 11 inner starts: the last over the room
    calls = []
    plain = attention.attend_segments_varlen

    def counted(*args, **kw):
        calls.append(args[4])
        return plain(*args, **kw)
    results = []
    for count in (True, False):
        model.zero_grad()
        state, loss = None, 0.0
        attention.attend_segments_varlen = counted
        try:
            with torch.autocast("cuda", dtype=torch.bfloat16):
                for c in range(3):
                    inner = int(starts[c][:, 1:].sum()) if count else None
                    logits, state = model(tokens[c], state, starts=starts[c], inner_starts=inner)
                    loss = loss + logits.float().pow(2).mean()
        finally:
            attention.attend_segments_varlen = plain
        loss.backward()
        results.append((logits.float(), {n: p.grad.clone() for n, p in model.named_parameters()
                                         if p.grad is not None}))
    assert calls == [8] * 2 * layers.count("A")   # A layers x 2 chunks, counted and in the room
    assert rel(results[0][0], results[1][0]) < 2e-2
    assert results[0][1].keys() == results[1][1].keys()
    for name, g in results[1][1].items():
        assert rel(results[0][1][name], g) < 5e-2, name


def test_each_query_reads_its_best_kept_tokens_on_cuda_as_on_the_cpu():
    """model.kv_keep_read on CUDA: at inference the two-part read (attention.attend_top_kept,
    with position-free memory's doubled head dims; in float32 [window | chunk] written out,
    under bf16 autocast by the variable-length kernel) gives the CPU's logits in float32 (TF32
    off, so that no near tie of the choice flips); under bf16 autocast it runs."""
    import copy
    torch.manual_seed(0)
    model = ElephantLM(cfg(n_mem=4, mem_rotary="free", kv_window=32, kv_keep=24, kv_keep_read=4,
                           kv_keep_noise=0.0, layers="AM")).eval()
    tokens = torch.randint(0, 512, (4, 2, 32))

    def run(m, device):
        state, out = None, []
        for c in range(4):
            logits, state = m(tokens[c].to(device), state)
            out.append(logits.float().cpu())
        return torch.stack(out), state
    with torch.no_grad():
        want, _ = run(model, "cpu")
        tf32 = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = False
        try:
            got, state = run(copy.deepcopy(model).cuda(), "cuda")
        finally:
            torch.backends.cuda.matmul.allow_tf32 = tf32
        assert state.kv[0].keep_valid.sum(1).min() == 24       # more kept than a query reads
        assert rel(got, want) < 1e-4
        with torch.autocast("cuda", dtype=torch.bfloat16):
            fast, _ = run(copy.deepcopy(model).cuda(), "cuda")
        assert torch.isfinite(fast).all() and rel(fast, want) < 5e-2


@pytest.mark.parametrize("conv_form", ["tiles", "starts"])
def test_packed_previous_document_never_leaks_on_cuda(conv_form, monkeypatch):
    """Fast paths, fp32: changing doc A leaves doc B (starting mid-chunk, running on) bitwise equal,
    in either form of the Mamba conv with segments."""
    from elephant.layers import conv_triton
    monkeypatch.setattr(conv_triton, "SEGMENT_FORM", conv_form)
    torch.manual_seed(0)
    model = ElephantLM(cfg(n_mem=4, kv_window=64)).cuda()
    model.set_fast_paths(True)
    T, b0 = 96, 37
    base = torch.randint(0, 512, (3, 3, T), device="cuda")         # (chunk, lane, T)
    other = base.clone()                                            # every token of doc A changed
    other[0] = torch.randint(0, 512, (3, T), device="cuda")
    other[1, :, :b0] = torch.randint(0, 512, (3, b0), device="cuda")
    tokens = torch.stack([base, other])
    starts = torch.zeros(3, 3, T, dtype=torch.bool, device="cuda")
    starts[0, :, 0] = True
    starts[1, :, b0] = True
    outs = []
    with torch.no_grad():
        for variant in range(2):
            state, out = None, []
            for c in range(3):
                logits, state = model(tokens[variant, c], state, starts=starts[c])
                out.append(logits)
            outs.append(out)
    assert torch.equal(outs[0][1][:, b0:], outs[1][1][:, b0:]) and torch.equal(outs[0][2], outs[1][2])


@pytest.mark.heavy
def test_packed_compiled_blocks_do_not_recompile_across_chunks():
    starts = random_starts(6, 4, 64, 20)
    assert_compiled_blocks_never_recompile(6, lambda c: {"starts": starts[c]})


# --- the blocked head (layers/head.py) -------------------------------------------------------------

@pytest.mark.parametrize("reduction,dtype,compiled", [
    ("sum", "fp32", False), ("none", "fp32", False), ("sum", "bf16", False), ("none", "bf16", False),
    ("sum", "bf16", True)])                               # compiled: the training path only
def test_blocked_head_equals_reference_on_cuda(reduction, dtype, compiled):
    """Values and gradients of the blocked linear + cross-entropy against the whole-logits reference
    on CUDA: float32 (1e-4) and under bf16 autocast (2e-2), eager and compiled in one graph."""
    from elephant.layers.head import linear_cross_entropy, linear_cross_entropy_reference
    gen = torch.Generator(device="cuda").manual_seed(0)
    h = torch.randn(3, 300, 256, device="cuda", generator=gen).requires_grad_()
    w = (torch.randn(5000, 256, device="cuda", generator=gen) * 0.05).requires_grad_()
    t = torch.randint(0, 5000, (3, 300), device="cuda", generator=gen)
    mask = torch.rand(3, 300, device="cuda", generator=gen) < 0.9
    blocked = lambda h, w: linear_cross_entropy(h, w, t, mask, reduction, block_rows=256)
    if compiled:
        blocked = torch.compile(blocked, fullgraph=True, dynamic=False)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=dtype == "bf16")
    results = []
    for fn in (blocked, lambda h, w: linear_cross_entropy_reference(h, w, t, mask, reduction)):
        with autocast:
            loss = fn(h, w)
        results.append([loss] + list(torch.autograd.grad(loss.sum(), (h, w))))
    tol = 2e-2 if dtype == "bf16" else 1e-4
    for name, got, want in zip(("loss", "dh", "dw"), *results):
        assert got.dtype == want.dtype, name
        assert rel(got, want) < tol, f"{name}: {rel(got, want):.2e}"


@pytest.mark.parametrize("reduction", ["sum", "none"])
def test_fused_head_blocks_equal_the_in_place_steps_on_cuda(reduction):
    """The fused block math (head.FUSED, logits kept in bf16), as the Triton kernel (ce_triton,
    the default) and as inductor's kernels of the plain functions, against the in-place float32
    steps, at a vocabulary of the 70M shape and blocks that do not divide the rows: loss and both
    gradients under bf16 autocast; the per-token path's backward (which remakes the logits) too."""
    from elephant.layers import head
    gen = torch.Generator(device="cuda").manual_seed(1)
    h = torch.randn(2, 700, 256, device="cuda", generator=gen).requires_grad_()
    w = (torch.randn(50304, 256, device="cuda", generator=gen) * 0.05).requires_grad_()
    t = torch.randint(0, 50304, (2, 700), device="cuda", generator=gen)
    t[0, :5] = head.IGNORE_INDEX
    mask = torch.rand(2, 700, device="cuda", generator=gen) < 0.9
    results = []
    for fused, kernel in ((False, "triton"), (True, "triton"), (True, "inductor")):
        head.FUSED, head.CE_KERNEL = fused, kernel
        try:
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = head.linear_cross_entropy(h, w, t, mask, reduction, block_rows=512)
            results.append([loss] + list(torch.autograd.grad(loss.sum(), (h, w))))
        finally:
            head.FUSED, head.CE_KERNEL = True, "triton"
    for fast in results[1:]:
        for name, got, want in zip(("loss", "dh", "dw"), fast, results[0]):
            assert got.dtype == want.dtype, name
            assert rel(got, want) < 1e-2, f"{name}: {rel(got, want):.2e}"


def test_loss_kernel_l2_hints_change_no_value_on_cuda(monkeypatch):
    """ce_triton's eviction hints (L2_HINTS) only steer the cache: the loss kernel gives the same
    NLL, log-sum-exp and gradient bit for bit with and without them, at the 70M vocabulary in
    bf16, on rows more than L2 holds (so the second walk reads some rows back from memory)."""
    from elephant.layers import ce_triton, head
    gen = torch.Generator(device="cuda").manual_seed(2)
    z = (torch.randn(1536, 50304, device="cuda", generator=gen) * 3).to(torch.bfloat16)
    t = torch.randint(0, 50304, (1536,), device="cuda", generator=gen)
    t[::7] = head.IGNORE_INDEX
    scale = torch.rand(1536, device="cuda", generator=gen)
    got = {}
    for hints in (True, False):
        monkeypatch.setattr(ce_triton, "L2_HINTS", hints)
        got[hints] = ce_triton.nll_lse_dlogits(z, t, scale)
    for a, b in zip(got[True], got[False]):
        assert torch.equal(a, b)
    want_dz = head._nll_and_dlogits(z, t, scale)[2]
    assert rel(got[True][2], want_dz) < 1e-2


def test_fused_evaluation_head_equals_the_blocked_path_on_cuda():
    """linear_nll_triton (evaluation's head without its logits, head.EVAL_FUSED) at the 70M
    vocabulary and width in bf16: against the float32 logits of the same bf16 operands (the
    kernel's float32 sums; 1e-4) and against the blocked path, whose logits are rounded to bf16
    (2e-3), with rows that no tile divides; compiled as inductor launches it, the same values to
    float32 rounding."""
    from elephant.layers import head, linear_nll_triton
    gen = torch.Generator(device="cuda").manual_seed(3)
    h = torch.randn(1000, 512, device="cuda", generator=gen).to(torch.bfloat16)
    w = (torch.randn(50304, 512, device="cuda", generator=gen) * 0.05).to(torch.bfloat16)
    t = torch.randint(0, 50304, (1000,), device="cuda", generator=gen)
    t[::9] = head.IGNORE_INDEX
    nll, lse = linear_nll_triton.linear_nll(h, w, t)
    z = h.float() @ w.float().t()
    want_lse = torch.logsumexp(z, 1)
    valid = t != head.IGNORE_INDEX
    want_nll = torch.where(valid, want_lse - z.gather(1, torch.where(valid, t, 0)[:, None])[:, 0], 0.0)
    assert rel(lse, want_lse) < 1e-4 and rel(nll, want_nll) < 1e-4
    blocked = head._forward_nll(h, w, t, 384)[0]
    assert rel(nll, blocked) < 2e-3
    compiled = torch.compile(lambda a, b, c: linear_nll_triton.linear_nll(a, b, c), fullgraph=True)
    assert rel(compiled(h, w, t)[0], nll) < 1e-6   # (the parts' combination compiled: rounding)


def test_blocked_head_makes_no_host_sync_on_cuda():
    """The training loss (sum, with gradients) and the evaluation loss (none, without) run without
    a host synchronization (CUDA sync debug mode raises on one)."""
    from elephant.layers.head import linear_cross_entropy
    h = torch.randn(2, 128, 64, device="cuda", requires_grad=True)
    w = torch.randn(1000, 64, device="cuda", requires_grad=True)
    t = torch.randint(0, 1000, (2, 128), device="cuda")
    mask = torch.ones(2, 128, dtype=torch.bool, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = linear_cross_entropy(h, w, t, mask, "mean", block_rows=100)
            loss.backward()
            with torch.no_grad():
                nll = linear_cross_entropy(h, w, t, mask, "none", block_rows=100)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.isfinite(loss) and nll.shape == (2, 128) and h.grad is not None


def test_blocked_head_peak_memory_is_a_fraction_of_the_logits(monkeypatch):
    """At the 70M shape's head (16k tokens, V = 50304), forward + backward of the blocked loss peaks
    far below the float32 logits of the chunk (3.3 GB) that the reference holds. With blocks of up
    to 1 GiB of float32 logits (4 x 4,096 rows here; the default head.BLOCK_BYTES, 4 GiB, makes
    the chunk one block), their bf16 logits and logit gradients peak at 1.41 GB (H100,
    2026-11-25), under half the float32 logits: the cap, not the row count, bounds the memory."""
    from elephant.layers import head
    from elephant.layers.head import linear_cross_entropy, linear_cross_entropy_reference
    monkeypatch.setattr(head, "BLOCK_BYTES", 1 << 30)
    h = torch.randn(32, 512, 512, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(50304, 512, device="cuda", requires_grad=True)
    t = torch.randint(0, 50304, (32, 512), device="cuda")
    logits_fp32 = 32 * 512 * 50304 * 4
    peak = {}
    for name, fn in (("blocked", linear_cross_entropy), ("reference", linear_cross_entropy_reference)):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            fn(h, w, t, reduction="sum").backward()
        torch.cuda.synchronize()
        peak[name] = torch.cuda.max_memory_allocated() - base
        h.grad = w.grad = None
    assert peak["blocked"] < 0.5 * logits_fp32 < peak["reference"], peak


@pytest.mark.parametrize("compiled", [False, True])
def test_cuda_graph_evaluation_equals_the_plain_path(compiled):
    """evaluate(cuda_graph=True) captures the chunk step once and replays it: the same sums as the
    plain path, bf16 autocast, memory and KV window on, lanes that change documents."""
    import numpy as np
    from data_packing import TokenizedCorpus
    from elephant.evaluate import evaluate
    torch.manual_seed(0)
    model = ElephantLM(cfg(n_mem=4, kv_window=64, bptt_chunks=2)).cuda()
    model.set_fast_paths(True)
    if compiled:
        for block in model.blocks:
            block.compile(dynamic=False)
    rng = np.random.default_rng(0)
    corpus = TokenizedCorpus.from_documents([rng.integers(0, 512, n) for n in (900, 40, 333, 64, 2000, 7)])
    autocast = lambda: torch.autocast("cuda", dtype=torch.bfloat16)
    plain = evaluate(model, corpus, lanes=3, chunk_len=64, device="cuda", autocast=autocast)
    graph = evaluate(model, corpus, lanes=3, chunk_len=64, device="cuda", autocast=autocast,
                     cuda_graph=True)
    assert graph["tokens"] == plain["tokens"] and graph["documents"] == plain["documents"]
    assert abs(graph["nll_sum"] - plain["nll_sum"]) <= 1e-6 * abs(plain["nll_sum"])


@pytest.mark.parametrize("cuda_graph", [False, True])
def test_evaluation_window_in_bf16_equals_a_float32_window_on_cuda(monkeypatch, cuda_graph):
    """Under bf16 autocast evaluate() keeps the attention window in bf16 (its keys are made in
    bf16): the same sums as a float32 window (the old way), plain and as a CUDA graph."""
    import numpy as np
    from data_packing import TokenizedCorpus
    from elephant.evaluate import evaluate
    from test_eval import spy_window_dtype
    torch.manual_seed(0)
    model = ElephantLM(cfg(n_mem=4, kv_window=64, bptt_chunks=2)).cuda()
    model.set_fast_paths(True)
    rng = np.random.default_rng(2)
    corpus = TokenizedCorpus.from_documents([rng.integers(0, 512, n) for n in (700, 40, 333, 64, 900)])
    autocast = lambda: torch.autocast("cuda", dtype=torch.bfloat16)
    run = dict(lanes=3, chunk_len=64, device="cuda", autocast=autocast, cuda_graph=cuda_graph)
    made = spy_window_dtype(monkeypatch, model)
    got = evaluate(model, corpus, **run)
    assert made == [torch.bfloat16]
    spy_window_dtype(monkeypatch, model, force=torch.float32)
    wide = evaluate(model, corpus, **run)
    assert got["tokens"] == wide["tokens"]
    assert abs(got["nll_sum"] - wide["nll_sum"]) <= 1e-6 * abs(wide["nll_sum"])


def side_batch_case(seed: int, longest: list[int]):
    """A small hybrid on CUDA (memory and window on, the fast paths) and a corpus of the `longest`
    documents among 40 short ones (20-300 tokens): at 16 lanes of 64, the long ones go aside."""
    import numpy as np
    from data_packing import TokenizedCorpus
    torch.manual_seed(0)
    model = ElephantLM(cfg(n_mem=4, kv_window=64, bptt_chunks=2)).cuda()
    model.set_fast_paths(True)
    rng = np.random.default_rng(seed)
    lengths = longest + [int(n) for n in rng.integers(20, 300, 40)]
    return model, TokenizedCorpus.from_documents([rng.integers(0, 512, n) for n in lengths])


def test_evaluation_passes_leave_no_memory_behind_on_cuda():
    """Pass after pass (side batch on its stream, compaction, CUDA graphs captured each pass) the
    device memory in use between passes stays where the first pass left it: the streams are made
    once a process (cudagraph.kept_stream). A stream made anew per capture or pass kept its matmul
    workspace (32 MiB on an H100) to the process's end: 4-6 of them a pass."""
    import gc
    from elephant.evaluate import evaluate
    model, corpus = side_batch_case(4, [3000, 2000])
    autocast = lambda: torch.autocast("cuda", dtype=torch.bfloat16)
    held = []
    for _ in range(3):
        got = evaluate(model, corpus, lanes=16, chunk_len=64, device="cuda", autocast=autocast,
                       cuda_graph=True, compact=True, side=True)
        torch.cuda.synchronize()
        gc.collect()
        held.append(torch.cuda.memory_allocated())
    assert got["side_documents"] == 2 and got["side_lane_chunks"] < 2 * got["side_chunk_steps"]
    assert held[1] == held[0] and held[2] == held[0], held


def test_side_batch_evaluation_on_its_stream_equals_one_batch():
    """evaluate(side=True) on CUDA: the two longest documents read by a side batch on a
    high-priority stream (its CUDA graph captured there) while 14 lanes read the rest, queued in
    step from one host thread: every document's sum is the one batch's (float32 model; the
    kernels' batch-size rounding alone), the streams joined before the sums are read."""
    from elephant.evaluate import evaluate
    model, corpus = side_batch_case(0, [3000, 2500])
    one = evaluate(model, corpus, lanes=16, chunk_len=64, device="cuda", cuda_graph=True,
                   compact=True)
    two = evaluate(model, corpus, lanes=16, chunk_len=64, device="cuda", cuda_graph=True,
                   compact=True, side=True)
    assert two["side_documents"] == 2 and two["side_chunk_steps"] == -(-2999 // 64)
    assert two["tokens"] == one["tokens"] and two["documents"] == one["documents"]
    assert abs(two["nll_sum"] - one["nll_sum"]) <= 1e-5 * abs(one["nll_sum"])
    for label, bucket in one["position_buckets"].items():
        got = two["position_buckets"][label]
        assert got["tokens"] == bucket["tokens"]
        assert abs(got["nll_sum"] - bucket["nll_sum"]) <= 1e-5 * abs(bucket["nll_sum"]) + 1e-6


def test_weight_gradient_accumulates_inside_the_matmul_on_cuda():
    """head._acc_mm: bf16 products summed into a float32 total by the matmul itself, in place,
    at least as close to the float64 sum as the product rounded to bf16 and added (the old way)."""
    from elephant.layers import head
    gen = torch.Generator(device="cuda").manual_seed(2)
    pairs = [(torch.randn(512, 300, device="cuda", generator=gen).bfloat16(),
              torch.randn(300, 64, device="cuda", generator=gen).bfloat16()) for _ in range(3)]
    want = sum(a.double() @ b.double() for a, b in pairs)
    total = None
    for a, b in pairs:
        before = total
        total = head._acc_mm(total, a, b, torch.float32)
        assert before is None or total.data_ptr() == before.data_ptr()   # summed in place
    assert head.ACC_IN_MATMUL and total.dtype == torch.float32
    old = None
    for a, b in pairs:
        old = head._acc(old, a @ b, torch.float32)
    assert rel(total, want) <= rel(old, want) and rel(total, want) < 1e-5


def test_input_gradient_is_written_by_the_matmul_in_float32_on_cuda():
    """head._mm_into: a bf16 product written as the matmul's float32 accumulator into a slice of a
    larger buffer (the summed loss's input gradient, block by block): only that slice changes, and
    it is at least as close to the float64 product as the bf16 product converted; the summed
    loss's input gradient under bf16 autocast comes back in h's dtype."""
    from elephant.layers import head
    gen = torch.Generator(device="cuda").manual_seed(3)
    a = torch.randn(300, 700, device="cuda", generator=gen).bfloat16()
    b = torch.randn(700, 64, device="cuda", generator=gen).bfloat16()
    out = torch.full((1000, 64), 7.0, device="cuda")
    head._mm_into(out[200:500], a, b)
    assert head.ACC_IN_MATMUL
    assert torch.all(out[:200] == 7) and torch.all(out[500:] == 7)
    want = a.double() @ b.double()
    assert rel(out[200:500], want) <= rel((a @ b).float(), want) and rel(out[200:500], want) < 1e-5
    h = torch.randn(2, 100, 64, device="cuda", generator=gen).requires_grad_()
    w = torch.randn(1000, 64, device="cuda", generator=gen).requires_grad_()
    t = torch.randint(0, 1000, (2, 100), device="cuda", generator=gen)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        head.linear_cross_entropy(h, w, t, reduction="sum", block_rows=64).backward()
    assert h.grad.dtype == torch.float32 and torch.isfinite(h.grad).all()


def test_compacted_cuda_graph_evaluation_equals_the_full_batch():
    """evaluate(compact=True, cuda_graph=True), eval.py's way on a GPU: the batch shrinks to the
    lanes still reading once no document is left to start, the CUDA graph captured again for the
    new lane count; bf16 autocast, memory and window on: the same documents and tokens, the
    summed loss within bf16's reach of the full batch's, in fewer rows."""
    import numpy as np
    from data_packing import TokenizedCorpus
    from elephant.evaluate import evaluate
    torch.manual_seed(0)
    model = ElephantLM(cfg(n_mem=4, kv_window=64, bptt_chunks=2)).cuda()
    model.set_fast_paths(True)
    rng = np.random.default_rng(1)
    lengths = [3000, 40, 333, 64, 200, 7, 90, 150, 120, 500, 80, 60]    # one outlasts the rest
    corpus = TokenizedCorpus.from_documents([rng.integers(0, 512, n) for n in lengths])
    autocast = lambda: torch.autocast("cuda", dtype=torch.bfloat16)
    full = evaluate(model, corpus, lanes=8, chunk_len=64, device="cuda", autocast=autocast,
                    cuda_graph=True)
    small = evaluate(model, corpus, lanes=8, chunk_len=64, device="cuda", autocast=autocast,
                     cuda_graph=True, compact=True)
    assert small["tokens"] == full["tokens"] and small["documents"] == full["documents"]
    assert small["lane_chunks"] < full["lane_chunks"] // 2
    assert abs(small["nll_sum"] - full["nll_sum"]) <= 1e-4 * abs(full["nll_sum"])
