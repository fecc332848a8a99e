"""Optimizers (CPU): orthogonalizers, NorMuon, cautious weight decay, Muon, Adam, schedules,
parameter assignment, clipping, state_dict round trip. The 2-process run is in test_optim_dist.py.

Singular-value band: the 5-step Polar Express coefficients (speedrun: lower bound 1e-3, safety
2e-2, cushion 0.02) map singular values of the normalized input in [1e-3, 1] into [0.859, 1.141];
we test the band [0.84, 1.16] (margin for bf16 rounding and for AOL, whose starting spectrum the
dropped-first-triple schedule was not designed for: it dips to 0.8498 at condition number 1e4).
Directions far below the top of the spectrum cannot be lifted in 5 (AOL: 4) iterations, so for
ill-conditioned inputs the band is asserted for
singular values >= 5e-3 (Polar Express) / 2e-2 (AOL, which drops the high-gain first step) of the
largest; every output singular value stays below 1.16 and no direction changes sign.
"""
import json
import math

import pytest
import torch
from torch import nn

from elephant.config import OptimConfig
from elephant.optim import (Adam, Muon, aol_polar_express, assign_parameters, build_optimizers,
                            lr_multiplier, muon_lr_scale, muon_momentum, newton_schulz, normuon_,
                            polar_express, polar_express_coefficients, wd_multiplier)
from elephant.optim.adam import cautious_decay_, decay_and_update_

BAND = (0.84, 1.16)
SPEEDRUN_POLAR_EXPRESS = [  # KellerJordan/modded-nanogpt, "num_iters=5, safety_factor=2e-2"
    (8.156554524902461, -22.48329292557795, 15.878769915207462),
    (4.042929935166739, -2.808917465908714, 0.5000178451051316),
    (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
    (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
    (2.3465413258596377, -1.7097828382687081, 0.42323551169305323),
]
ORTHO = {"polar_express": polar_express, "aol": aol_polar_express}
LIFTED = {"polar_express": 5e-3, "aol": 2e-2}   # smallest relative singular value brought into BAND
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _with_spectrum(m: int, n: int, s: torch.Tensor, seed: int = 0):
    """U diag(s) V^T with random orthonormal U (m, k), V (n, k); returns (G, U, V) in fp64."""
    g = torch.Generator().manual_seed(seed)
    k = len(s)
    U, _ = torch.linalg.qr(torch.randn(m, k, generator=g, dtype=torch.float64))
    V, _ = torch.linalg.qr(torch.randn(n, k, generator=g, dtype=torch.float64))
    return (U * s) @ V.T, U, V


def _gains(X: torch.Tensor, U: torch.Tensor, V: torch.Tensor) -> torch.Tensor:
    """u_i^T X v_i: the output singular value along each input singular direction (the
    iterations are odd polynomials of G, so they keep its singular vectors)."""
    return ((U.T @ X.double()) @ V).diagonal()


def _polar_error(X: torch.Tensor, G: torch.Tensor) -> float:
    U, _, Vh = torch.linalg.svd(G.double(), full_matrices=False)
    P = U @ Vh
    return ((X.double() - P).norm() / P.norm()).item()


# ------------------------------------------------------------------ orthogonalization
def test_polar_express_coefficients_match_the_speedrun():
    for ours, theirs in zip(polar_express_coefficients(5), SPEEDRUN_POLAR_EXPRESS, strict=True):
        assert ours == pytest.approx(theirs, rel=1e-9)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("method", ORTHO)
@pytest.mark.parametrize("shape", [(48, 96), (96, 48), (3, 32, 80), (2, 80, 32)],
                         ids=["wide", "tall", "batched-wide", "batched-tall"])
def test_gaussian_singular_values_in_band(method, dtype, shape):
    G = torch.randn(shape, generator=torch.Generator().manual_seed(1))
    s = torch.linalg.svdvals(ORTHO[method](G, dtype=DTYPES[dtype]).float())
    assert s.min() >= BAND[0] and s.max() <= BAND[1], (s.min(), s.max())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("method", ORTHO)
@pytest.mark.parametrize("cond", [1e3, 1e4])
@pytest.mark.parametrize("mn", [(64, 64), (48, 112), (112, 48)], ids=["square", "wide", "tall"])
def test_ill_conditioned_singular_values_in_band(method, dtype, cond, mn):
    k = min(mn)
    s = torch.logspace(0, -math.log10(cond), k, dtype=torch.float64)
    G, U, V = _with_spectrum(*mn, s)
    X = ORTHO[method](G.float(), dtype=DTYPES[dtype])
    gains = _gains(X, U, V)
    top = gains[s >= LIFTED[method]]
    assert top.min() >= BAND[0] and top.max() <= BAND[1], (top.min(), top.max())
    assert torch.linalg.svdvals(X.double()).max() <= BAND[1]
    assert (gains > 0).all()      # small directions are lifted, never flipped


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("method", ORTHO)
def test_low_rank_singular_values_in_band_and_null_space_stays_small(method, dtype):
    g = torch.Generator().manual_seed(2)
    G = torch.randn(96, 6, generator=g) @ torch.randn(6, 64, generator=g)
    s = torch.linalg.svdvals(ORTHO[method](G, dtype=DTYPES[dtype]).float())
    assert s[:6].min() >= BAND[0] and s[:6].max() <= BAND[1]
    # bf16 rounding noise in the null space is amplified by the iterations, but stays below 0.5
    assert s[6:].max() <= (1e-3 if dtype == "fp32" else 0.5)


def test_square_gaussian_bulk_in_band():
    G = torch.randn(64, 64, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    U, s, Vh = torch.linalg.svd(G)
    for method, f in ORTHO.items():
        gains = _gains(f(G.float(), dtype=torch.float32), U, Vh.T)
        top = gains[s >= LIFTED[method] * s[0]]
        assert top.min() >= BAND[0] and top.max() <= BAND[1]


def test_newton_schulz_lands_in_its_known_band():
    G = torch.randn(48, 96, generator=torch.Generator().manual_seed(4))
    s = torch.linalg.svdvals(newton_schulz(G, 5, dtype=torch.float32))
    assert s.min() >= 0.65 and s.max() <= 1.2


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", ["gauss-wide", "gauss-tall", "gauss-square", "cond1e2", "cond1e3",
                                  "cond1e4", "row-scaled"])
def test_aol_four_iterations_no_worse_than_polar_express_four(name, dtype):
    """Polar error ||X - U V^T||_F / ||U V^T||_F. Known exception, not asserted here: a low-rank
    matrix plus small noise (the noise directions sit far below the top), where AOL-4 trails."""
    g = torch.Generator().manual_seed(5)
    if name.startswith("gauss"):
        shape = {"gauss-wide": (48, 112), "gauss-tall": (112, 48), "gauss-square": (64, 64)}[name]
        G = torch.randn(shape, generator=g)
    elif name.startswith("cond"):
        s = torch.logspace(0, -float(name[-1]), 64, dtype=torch.float64)
        G = _with_spectrum(64, 96, s)[0].float()
    else:
        G = torch.randn(64, 96, generator=g) * torch.rand(64, 1, generator=g) ** 3
    dt = DTYPES[dtype]
    aol = _polar_error(aol_polar_express(G, 4, dtype=dt), G)
    pe4 = _polar_error(polar_express(G, 4, dtype=dt), G)
    assert aol <= pe4 + 1e-3, (aol, pe4)


@pytest.mark.parametrize("method", ["newton_schulz", "polar_express", "aol"])
def test_tall_input_equals_transpose_of_wide_result(method):
    f = {"newton_schulz": newton_schulz, **ORTHO}[method]
    G = torch.randn(2, 40, 96, generator=torch.Generator().manual_seed(6))
    wide = f(G, dtype=torch.float32)
    tall = f(G.mT.contiguous(), dtype=torch.float32)
    torch.testing.assert_close(tall, wide.mT, atol=2e-5, rtol=0)
    wide16, tall16 = f(G, dtype=torch.bfloat16), f(G.mT.contiguous(), dtype=torch.bfloat16)
    torch.testing.assert_close(tall16.float(), wide16.mT.float(), atol=3e-2, rtol=0)


def test_zero_matrix_stays_zero():
    for f in (newton_schulz, polar_express, aol_polar_express):
        out = f(torch.zeros(2, 8, 16), dtype=torch.float32)
        assert torch.equal(out, torch.zeros_like(out))


# ------------------------------------------------------------------ NorMuon
@pytest.mark.parametrize("shape,axis", [((48, 16), -1), ((32, 32), -1), ((16, 48), -2)],
                         ids=["tall-per-row", "square-per-row", "wide-per-column"])
def test_normuon_normalizes_along_documented_axis_and_keeps_frobenius_norm(shape, axis):
    g = torch.Generator().manual_seed(7)
    O = torch.randn(2, *shape, generator=g) * torch.rand(2, *shape[:-1], 1, generator=g)
    O = O * torch.rand(2, 1, shape[-1], generator=g)           # uneven rows and columns
    state_shape = (2, shape[0], 1) if axis == -1 else (2, 1, shape[1])
    v = torch.zeros(state_shape)
    out = normuon_(O, v, beta2=0.0)                             # beta2 0: v = this step's mean
    rms = out.square().mean(dim=axis)
    torch.testing.assert_close(rms, rms[:, :1].expand_as(rms), rtol=1e-5, atol=0)
    torch.testing.assert_close(out.norm(dim=(-2, -1)), O.norm(dim=(-2, -1)), rtol=1e-5, atol=0)
    v2 = v.clone()
    out2 = normuon_(O.flip(-1), v2, beta2=0.95)                 # a running mean: norm still kept
    torch.testing.assert_close(out2.norm(dim=(-2, -1)), O.norm(dim=(-2, -1)), rtol=1e-5, atol=0)


def test_muon_normuon_state_orientation():
    wide, tall = nn.Parameter(torch.randn(8, 24)), nn.Parameter(torch.randn(24, 8))
    opt = Muon([wide, tall], lr=0.01)
    wide.grad, tall.grad = torch.randn(8, 24), torch.randn(24, 8)
    opt.step()
    shapes = {k: tuple(v["second_moment"].shape) for k, v in opt.state_dict()["state"].items()}
    assert shapes == {"0.0": (1, 24), "0.1": (24, 1)}


# ------------------------------------------------------------------ Muon
def test_lr_scale_orientation_rows_are_fan_out():
    assert muon_lr_scale(1536, 512) == pytest.approx(math.sqrt(3))   # up-projection (out, in)
    assert muon_lr_scale(512, 1536) == 1.0                           # down-projection
    assert muon_lr_scale(512, 512) == 1.0


@pytest.mark.parametrize("shape", [(48, 16), (16, 48)])
def test_muon_first_step_is_scaled_orthogonalized_gradient(shape):
    torch.manual_seed(8)
    W = nn.Parameter(torch.randn(shape))
    W0 = W.detach().clone()
    W.grad = torch.randn(shape)
    opt = Muon([W], lr=0.1, normuon=False, weight_decay=0.0, orthogonalize="polar_express")
    opt.step()
    expected = W0 - 0.1 * muon_lr_scale(*shape) * polar_express(W.grad, dtype=torch.float32)
    torch.testing.assert_close(W.detach(), expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("method", ["newton_schulz", "polar_express", "aol"])
def test_muon_converges_on_convex_quadratic(method):
    """f(W) = 1/2 tr((W - W*)^T H (W - W*)), H SPD with condition number 10; lr decays to 0."""
    g = torch.Generator().manual_seed(9)
    Q, _ = torch.linalg.qr(torch.randn(24, 24, generator=g))
    H = Q @ torch.diag(torch.linspace(1, 10, 24)) @ Q.T
    target = torch.randn(24, 16, generator=g)
    W = nn.Parameter(torch.zeros(24, 16))
    opt = Muon([W], lr=0.1, orthogonalize=method, normuon=True)

    def loss():
        D = W - target
        return 0.5 * (D * (H @ D)).sum()

    start = loss().item()
    steps = 300
    for t in range(steps):
        opt.set_schedule(lr_mult=0.5 * (1 + math.cos(math.pi * t / steps)))
        opt.zero_grad()
        loss().backward()
        opt.step()
    assert loss().item() < 1e-3 * start


# ------------------------------------------------------------------ cautious weight decay
def test_cautious_decay_leaves_weight_untouched_where_signs_disagree():
    p = torch.tensor([1.0, -1.0, 2.0, -2.0, 3.0])
    u = torch.tensor([0.5, 0.5, -0.5, -0.5, 0.0])
    cautious_decay_([p], [u], 0.1)
    assert torch.equal(p, torch.tensor([0.9, -1.0, 2.0, -1.8, 3.0]))


@pytest.mark.parametrize("cautious", [True, False])
def test_decay_and_update_leaves_the_updates_alone(cautious):
    # p <- p - decay-term - lr * u with u unchanged: Muon's updates are views of one stacked tensor,
    # and scaling them in place made the compiled update write the whole stack twice more
    gen = torch.Generator().manual_seed(5)
    stack = torch.randn(3, 4, 5, generator=gen)
    updates, before = list(stack.unbind(0)), stack.clone()
    params = [torch.randn(4, 5, generator=gen) for _ in range(3)]
    expected = []
    for p, u in zip(params, updates):
        keep = (p * u > 0).float() if cautious else torch.ones_like(p)
        expected.append(p - 0.1 * keep * p - 0.5 * u)
    decay_and_update_({"weight_decay": 0.1, "cautious": cautious}, params, updates, 0.1, 0.5)
    assert torch.equal(stack, before)
    for p, e in zip(params, expected):
        torch.testing.assert_close(p, e, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("kind", ["adam", "muon"])
def test_optimizer_cautious_decay_only_where_update_agrees(kind):
    torch.manual_seed(10)
    W = nn.Parameter(torch.randn(16, 32))
    W0 = W.detach().clone()
    W.grad = torch.randn(16, 32)
    if kind == "adam":
        opt = Adam([W], lr=0.01, weight_decay=0.5, cautious=True)
        update = W.grad.sign()                 # Adam's first step is sign(g) (up to eps)
    else:
        opt = Muon([W], lr=0.01, weight_decay=0.5, cautious=True, normuon=False)
        update = polar_express(W.grad, dtype=torch.float32)
    opt.set_schedule(lr_mult=0.0, wd_mult=1.0)  # lr 0: only the decay (initial_lr * wd) acts
    opt.step()
    agree = update * W0 > 0
    assert torch.equal(W.detach()[~agree], W0[~agree])
    torch.testing.assert_close(W.detach()[agree], W0[agree] * (1 - 0.01 * 0.5))
    assert 0 < agree.sum() < agree.numel()


# ------------------------------------------------------------------ build_optimizers
class TinyLM(nn.Module):
    """The parameter kinds of ElephantLM, small."""

    def __init__(self, tied: bool = False, vocab: int = 40, d: int = 16):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.in_proj = nn.Linear(d, 2 * d + 5, bias=False)       # Mamba-like, tall
        self.conv1d = nn.Conv1d(d, d, 4, groups=d, padding=3)     # 3-D weight + bias
        self.A_log = nn.Parameter(torch.zeros(3))
        self.D = nn.Parameter(torch.ones(3))
        self.dt_bias = nn.Parameter(torch.zeros(3))
        self.out_proj = nn.Linear(2 * d + 5, d, bias=False)       # wide
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.o = nn.Linear(d, d, bias=False)
        self.up = nn.Linear(d, 3 * d, bias=True)
        self.down = nn.Linear(3 * d, d, bias=False)
        self.norm = nn.RMSNorm(d)
        self.mem_init = nn.Parameter(torch.randn(2, d) * 0.02)
        self.gain = nn.Parameter(torch.ones(()))                  # a 0-d scalar
        self.lm_head = nn.Linear(d, vocab, bias=False)
        if tied:
            self.lm_head.weight = self.embed.weight

    def forward(self, x):
        h = self.embed(x) + self.mem_init.mean(0)
        c = self.conv1d(h.transpose(1, 2))[..., :h.size(1)].transpose(1, 2)
        z = self.in_proj(h + c)
        h = h + self.out_proj(z * torch.sigmoid(self.dt_bias.sum() + self.A_log.sum() + self.D.sum()))
        h = h + self.o(self.qkv(h)[..., :h.size(-1)])
        h = h + self.down(torch.relu(self.up(h))) * self.gain
        return self.lm_head(self.norm(h))


def _lm_loss(model, x):
    return nn.functional.cross_entropy(model(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten())


def test_build_optimizers_assigns_by_rule():
    model = TinyLM()
    cfg = OptimConfig(muon_wd=0.1, adam_wd=0.05, embed_lr=0.3, head_lr=0.2, adam_lr=0.1)
    roles = {name: role for name, _, role, _ in assign_parameters(model)}
    assert {n for n, r in roles.items() if r == "muon"} == {
        "in_proj.weight", "out_proj.weight", "qkv.weight", "o.weight", "up.weight", "down.weight"}
    assert roles["embed.weight"] == "embed" and roles["lm_head.weight"] == "head"
    for n in ("conv1d.weight", "conv1d.bias", "A_log", "D", "dt_bias", "norm.weight", "mem_init",
              "gain", "up.bias"):
        assert roles[n] == "other", n
    opt = build_optimizers(model, cfg)
    groups = {g["role"]: g for g in opt.adam.param_groups}
    assert (groups["embed"]["lr"], groups["embed"]["weight_decay"]) == (0.3, 0.05)
    assert (groups["head"]["lr"], groups["head"]["weight_decay"]) == (0.2, 0.05)
    assert (groups["other"]["lr"], groups["other"]["weight_decay"]) == (0.1, 0.0)
    assert opt.muon.param_groups[0]["weight_decay"] == 0.1
    table = opt.table()
    assert "in_proj.weight" in table and "Muon" in table and "lr x 1.73 (rows/cols 48/16)" in table


def test_tied_embedding_appears_once():
    model = TinyLM(tied=True)
    entries = [(n, r, note) for n, _, r, note in assign_parameters(model) if "embed" in n or "lm_head" in n]
    assert entries == [("embed.weight", "embed", "tied: lm_head.weight")]
    opt = build_optimizers(model, OptimConfig())
    assert [g["role"] for g in opt.adam.param_groups] == ["embed", "other"]


def test_training_steps_reduce_loss_and_clip_matches_torch():
    torch.manual_seed(11)
    model = TinyLM()
    ref = TinyLM()
    ref.load_state_dict(model.state_dict())
    opt = build_optimizers(model, OptimConfig(warmup_steps=2, muon_wd=0.01, adam_wd=0.01))
    x = torch.randint(0, 40, (4, 12))
    _lm_loss(ref, x).backward()
    expected = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
    losses = []
    for step in range(25):
        opt.set_step(step, 25)
        loss = _lm_loss(model, x)
        loss.backward()
        norm = opt.clip_grad_norm_(0.5)
        if step == 0:
            torch.testing.assert_close(norm, expected, rtol=1e-5, atol=0)
            local = (opt.muon.local_gradients(), opt.adam.local_gradients())
            clipped = torch.cat([g.flatten() for g in local])
            assert clipped.norm().item() == pytest.approx(0.5, rel=1e-4)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.5


@pytest.mark.parametrize("wd,cautious,clip", [(0.02, True, 0.5), (0.02, False, 0.5), (0.0, True, 0.0)])
def test_graphed_step_follows_clip_and_step(tmp_path, wd, cautious, clip):
    """The captured step's flow (gradients packed into a buffer that stays put, the scheduled
    values read from a tensor; here on the CPU without the graph itself) against clip_grad_norm_
    + step, over steps whose lr, momentum and weight decay change; then both go on from a
    state_dict (the graphed one captures again, reading the states just loaded)."""
    torch.manual_seed(21)
    cfg = OptimConfig(warmup_steps=3, muon_wd=wd, adam_wd=wd, cautious_wd=cautious,
                      momentum_warmup_steps=4)
    eager, graphed = TinyLM(), TinyLM()
    graphed.load_state_dict(eager.state_dict())
    opts = [build_optimizers(m, cfg) for m in (eager, graphed)]
    batches = [torch.randint(0, 40, (3, 10)) for _ in range(8)]

    def step(i, model, opt, use_graph):
        hyper = opt.set_step(i, 8)
        _lm_loss(model, batches[i]).backward()
        if use_graph:
            norm = opt.graphed_step(clip)
        else:
            norm = opt.clip_grad_norm_(clip) if clip else torch.zeros(())
            opt.step()
        opt.zero_grad(set_to_none=True)
        return norm, hyper

    norms = []
    for i in range(5):
        (n_eager, h_eager), (n_graph, h_graph) = [step(i, m, o, g) for m, o, g in
                                                  ((eager, opts[0], False), (graphed, opts[1], True))]
        assert h_eager == h_graph
        assert torch.equal(n_graph, n_eager if clip else torch.zeros(()))
        norms.append(n_graph)
        for (name, a), b in zip(eager.state_dict().items(), graphed.state_dict().values()):
            assert torch.equal(b, a), name
    assert len({n.item() for n in norms}) == (5 if clip else 1)   # each step's own copy
    assert opts[1]._graph is not None and opts[1].adam.param_groups[0]["step"] == 5

    sd = [o.state_dict() for o in opts]
    weights = {k: v.clone() for k, v in graphed.state_dict().items()}
    for i in range(5, 8):
        step(i, graphed, opts[1], True)
    resumed = TinyLM()
    resumed.load_state_dict(weights)
    opt = build_optimizers(resumed, cfg)
    opt.load_state_dict(sd[1])
    step(5, resumed, opt, True)
    opt.load_state_dict(sd[1])                    # again, mid-run: the capture must not be reused
    resumed.load_state_dict(weights)
    for i in range(5, 8):
        step(i, resumed, opt, True)
    for (name, a), b in zip(graphed.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(a, b), name


def test_graphed_step_refuses_a_model_without_parameters():
    opt = build_optimizers(nn.Module(), OptimConfig())
    assert not opt.graphable()
    with pytest.raises(RuntimeError, match="parameters to update"):
        opt.graphed_step(1.0)


def _serialize(obj, tensors, prefix=""):
    """What the checkpoint writer does: tensors aside, the rest through JSON."""
    if isinstance(obj, torch.Tensor):
        tensors[prefix] = obj
        return {"__tensor__": prefix}
    if isinstance(obj, dict):
        assert all(isinstance(k, str) for k in obj), obj.keys()
        return {k: _serialize(v, tensors, f"{prefix}.{k}") for k, v in obj.items()}
    if isinstance(obj, list):
        return [_serialize(v, tensors, f"{prefix}.{i}") for i, v in enumerate(obj)]
    assert obj is None or isinstance(obj, (bool, int, float, str)), type(obj)
    return obj


def _deserialize(obj, tensors):
    if isinstance(obj, dict):
        if "__tensor__" in obj:
            return tensors[obj["__tensor__"]].clone()
        return {k: _deserialize(v, tensors) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_deserialize(v, tensors) for v in obj]
    return obj


def test_state_dict_round_trip_continues_bitwise(tmp_path):
    from safetensors.torch import load_file, save_file
    torch.manual_seed(12)
    cfg = OptimConfig(orthogonalize="aol", muon_wd=0.02, adam_wd=0.02, warmup_steps=2)
    model = TinyLM()
    opt = build_optimizers(model, cfg)
    batches = [torch.randint(0, 40, (3, 10)) for _ in range(6)]

    def train(model, opt, steps):
        for step in steps:
            opt.set_step(step, 6)
            _lm_loss(model, batches[step]).backward()
            opt.clip_grad_norm_(1.0)
            opt.step()
            opt.zero_grad()

    train(model, opt, range(3))
    tensors = {}
    text = json.dumps(_serialize(opt.state_dict(), tensors))
    save_file(tensors, tmp_path / "optim.safetensors")    # refuses shared storage: none there
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    train(model, opt, range(3, 6))

    model2 = TinyLM()
    model2.load_state_dict(weights)
    opt2 = build_optimizers(model2, cfg)
    opt2.load_state_dict(_deserialize(json.loads(text), load_file(tmp_path / "optim.safetensors")))
    train(model2, opt2, range(3, 6))
    for (name, a), b in zip(model.state_dict().items(), model2.state_dict().values()):
        assert torch.equal(a, b), name


# ------------------------------------------------------------------ schedules
def test_lr_multiplier_warmup_then_cosine_to_floor():
    cfg = OptimConfig(warmup_steps=10, schedule="cosine", cooldown_frac=1.0, min_lr_frac=0.1)
    assert lr_multiplier(0, 110, cfg) == pytest.approx(0.1)
    assert lr_multiplier(9, 110, cfg) == pytest.approx(1.0)
    assert lr_multiplier(10, 110, cfg) == pytest.approx(1.0)
    assert lr_multiplier(60, 110, cfg) == pytest.approx(0.55)
    assert lr_multiplier(110, 110, cfg) == pytest.approx(0.1)
    values = [lr_multiplier(s, 110, cfg) for s in range(10, 111)]
    assert all(a >= b for a, b in zip(values, values[1:]))


def test_lr_multiplier_warmup_stable_decay_and_constant():
    wsd = OptimConfig(warmup_steps=0, schedule="linear", cooldown_frac=0.2, min_lr_frac=0.0)
    assert lr_multiplier(0, 100, wsd) == 1.0 and lr_multiplier(80, 100, wsd) == 1.0
    assert lr_multiplier(90, 100, wsd) == pytest.approx(0.5)
    const = OptimConfig(warmup_steps=4, schedule="constant")
    assert [lr_multiplier(s, 100, const) for s in (0, 3, 50, 99)] == [0.25, 1.0, 1.0, 1.0]


def test_wd_multiplier_follows_lr_or_its_own_schedule():
    base = dict(warmup_steps=10, schedule="cosine", min_lr_frac=0.0)
    follow = OptimConfig(wd_schedule="lr", **base)
    assert all(wd_multiplier(s, 100, follow) == lr_multiplier(s, 100, follow) for s in range(100))
    assert wd_multiplier(0, 100, OptimConfig(wd_schedule="constant", **base)) == 1.0
    assert wd_multiplier(99, 100, OptimConfig(wd_schedule="constant", **base)) == 1.0
    assert wd_multiplier(50, 100, OptimConfig(wd_schedule="linear", **base)) == pytest.approx(0.5)
    assert wd_multiplier(50, 100, OptimConfig(wd_schedule="cosine", **base)) == pytest.approx(0.5)
    assert wd_multiplier(0, 100, OptimConfig(wd_schedule="linear", **base)) == 1.0   # no warm-up


def test_muon_momentum_warmup():
    cfg = OptimConfig(momentum=0.95, momentum_warmup_from=0.85, momentum_warmup_steps=100)
    assert muon_momentum(0, cfg) == pytest.approx(0.85)
    assert muon_momentum(50, cfg) == pytest.approx(0.90)
    assert muon_momentum(100, cfg) == pytest.approx(0.95)
    assert muon_momentum(1000, cfg) == pytest.approx(0.95)
    assert muon_momentum(0, OptimConfig(momentum_warmup_steps=0)) == 0.95


def test_set_step_applies_all_schedules():
    model = TinyLM()
    cfg = OptimConfig(warmup_steps=10, wd_schedule="constant", momentum_warmup_steps=10)
    opt = build_optimizers(model, cfg)
    got = opt.set_step(4, 100)
    assert got == {"lr_mult": 0.5, "wd_mult": 1.0, "momentum": pytest.approx(0.89)}
    assert opt.muon.param_groups[0]["lr"] == pytest.approx(cfg.muon_lr * 0.5)
    assert opt.muon.param_groups[0]["momentum"] == pytest.approx(0.89)
    assert all(g["lr"] == pytest.approx(g["initial_lr"] * 0.5) for g in opt.adam.param_groups)


def test_each_adam_group_steps_at_its_own_configured_lr():
    # embed_lr, head_lr and adam_lr are each group's base: the schedule scales them, and a step
    # moves each group's weights by its own lr (Adam's first step: lr x sign(g) per entry)
    torch.manual_seed(0)
    model = TinyLM()
    cfg = OptimConfig(warmup_steps=0, adam_lr=0.004, embed_lr=0.001, head_lr=0.0005,
                      schedule="constant")
    opt = build_optimizers(model, cfg)
    opt.set_step(3, 100)
    want = {"embed": 0.001, "head": 0.0005, "other": 0.004}
    assert {g["role"]: g["lr"] for g in opt.adam.param_groups} == pytest.approx(want)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    _lm_loss(model, torch.randint(0, 40, (4, 17))).backward()
    opt.step()
    for name, lr in (("embed.weight", 0.001), ("lm_head.weight", 0.0005), ("gain", 0.004)):
        moved = (dict(model.named_parameters())[name] - before[name]).abs()
        assert moved.max().item() == pytest.approx(lr, rel=1e-3), name


# ------------------------------------------------------------------ Triton Gram kernel
@pytest.fixture
def gram_device():
    from elephant.optim import gram_triton
    if not gram_triton.HAVE_TRITON:
        pytest.skip("triton is not installed")
    if not torch.cuda.is_available() and not gram_triton._INTERPRET:
        pytest.skip("needs CUDA or TRITON_INTERPRET=1")
    return "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(2, 20, 37), (1, 33, 16)])
def test_sym_gram_matches_reference(gram_device, shape, dtype):
    """fp32: 1e-5 (the same fp32 sums in another order); bf16 output: one bf16 rounding (1e-2 rel)."""
    from elephant.optim.gram_triton import gram_reference, sym_gram
    X = torch.randn(shape, generator=torch.Generator().manual_seed(13)).to(gram_device, DTYPES[dtype])
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == "fp32" else dict(atol=1e-2, rtol=1e-2)
    ref = gram_reference(X.float())
    torch.testing.assert_close(sym_gram(X).float(), ref, **tol)
    torch.testing.assert_close(sym_gram(X.mT).float(), X.float().mT @ X.float(), **tol)   # tall, no copy
    A = ref[:, :16, :16].to(DTYPES[dtype])                     # symmetric: B = b A + c A A
    torch.testing.assert_close(sym_gram(A, alpha=0.4, beta=-1.3).float(),
                               gram_reference(A.float(), 0.4, -1.3), **tol)


@pytest.mark.parametrize("method", ["newton_schulz", "polar_express", "aol"])
def test_orthogonalizers_with_triton_gram_equal_matmul(gram_device, method):
    from elephant.optim import orthogonalize
    G = torch.randn(2, 24, 40, generator=torch.Generator().manual_seed(14)).to(gram_device)
    for X in (G, G.mT.contiguous()):
        torch.testing.assert_close(orthogonalize(X, method, dtype=torch.float32, gram="triton"),
                                   orthogonalize(X, method, dtype=torch.float32), atol=1e-5, rtol=0)
