"""Two gloo processes perform the same optimizer step as one process on the same global gradient.

Each rank gets its own gradient g_r; the single-process reference gets (g_0 + g_1) / 2, which is
what reduce-scatter averages. Parameters are compared after three steps (Muon with NorMuon and
cautious weight decay, Adam, global-norm clipping): fp32, atol 1e-6 and rtol 1e-5. The sum of two
numbers is the same in either order, so the only differences come from the clip norm, summed over
shards in a different order. Run twice: with gloo's reduce-scatter and with the all-reduce fallback.
Also checked: each rank's state_dict holds only its slice, and a round trip through it on both
ranks continues bitwise; and the trainer's graphed step (collectives around a captured update)
gives bitwise the eager step's weights, norms and states.
"""
import os

import pytest
import torch
import torch.distributed as dist
from torch import nn

from elephant.config import OptimConfig
from elephant.optim import build_optimizers
from elephant.optim import dist as optim_dist

STEPS = 3
CFG = dict(orthogonalize="polar_express", muon_wd=0.05, adam_wd=0.05, warmup_steps=1,
           momentum_warmup_steps=2)


class Shapes(nn.Module):
    """Uneven on purpose: 3 matrices of one shape (rank 1 gets 1 and a padding slot), a shape with a
    single matrix (rank 1 owns none), odd row counts, a 0-d scalar, a 3-D conv weight."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(7, 6)
        self.a = nn.ModuleList(nn.Linear(6, 10, bias=False) for _ in range(3))
        self.b = nn.Linear(10, 6, bias=True)
        self.conv = nn.Conv1d(6, 6, 3, groups=6)
        self.scale = nn.Parameter(torch.tensor(1.5))
        self.norm_w = nn.Parameter(torch.ones(5))
        self.lm_head = nn.Linear(6, 7, bias=False)


def _grads(model: nn.Module, rank: int, step: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return [torch.randn(p.shape, generator=g) for p in model.parameters()]


def _clip_and_step(opt, clip: float = 2.0) -> torch.Tensor:
    """The eager phase: clip_grad_norm_ (when clip > 0) then step; the norm (0: not measured)."""
    norm = opt.clip_grad_norm_(clip) if clip else torch.zeros(())
    opt.step()
    return norm


def _run_steps(model, opt, grads_for_step, steps, update=_clip_and_step):
    """`steps` optimizer steps on the given gradients; `update(opt)` runs the phase and returns
    the gradient norm. Returns the norms."""
    norms = []
    for step in steps:
        opt.set_step(step, STEPS + 2)
        for p, g in zip(model.parameters(), grads_for_step(step)):
            p.grad = g.clone()
        norms.append(update(opt).item())
        opt.zero_grad()
    return norms


def _worker(rank: int, port: int, out: str):
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        for fallback in (False, True):
            optim_dist.force_allreduce_fallback(fallback)
            mode = f"{out}/{'allreduce_fallback' if fallback else 'reduce_scatter'}"
            _steps_and_resume(rank, mode)
            _graphed_steps(rank, mode)
    finally:
        optim_dist.force_allreduce_fallback(False)
        dist.destroy_process_group()


def _steps_and_resume(rank: int, out: str):
    torch.manual_seed(0)
    model = Shapes()
    opt = build_optimizers(model, OptimConfig(**CFG))
    norms = _run_steps(model, opt, lambda s: _grads(model, rank, s), range(STEPS))
    sd = opt.state_dict()
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    _run_steps(model, opt, lambda s: _grads(model, rank, s), [STEPS])
    # resume from the state_dict on a fresh model and optimizer: same next step, bitwise
    torch.manual_seed(0)
    model2 = Shapes()
    model2.load_state_dict(weights)
    opt2 = build_optimizers(model2, OptimConfig(**CFG))
    opt2.load_state_dict(sd)
    _run_steps(model2, opt2, lambda s: _grads(model2, rank, s), [STEPS])
    resumed_equal = all(torch.equal(a, b) for a, b in zip(model.state_dict().values(),
                                                            model2.state_dict().values()))
    torch.save({"weights": weights, "norms": norms, "state": sd, "resumed_equal": resumed_equal},
               f"{out}-rank{rank}.pt")


def _graphed_steps(rank: int, out: str):
    """The trainer's graphed step (`Optimizers.graphed_step`: collectives around the update, run
    directly on the CPU; uncompiled, and traced by torch.compile as the trainer does) beside
    clip_grad_norm_ + step on the same gradients, with and without clipping."""
    result = {}
    for clip in (2.0, 0.0):
        runs = {}
        for how in ("eager", "graphed", "compiled"):
            torch._dynamo.reset()        # each optimizer compiles its own update
            torch.manual_seed(0)
            model = Shapes()
            opt = build_optimizers(model, OptimConfig(**CFG))
            backend = "aot_eager" if how == "compiled" else None
            update = ((lambda o: _clip_and_step(o, clip)) if how == "eager"
                      else (lambda o: o.graphed_step(clip, backend)))
            norms = _run_steps(model, opt, lambda s: _grads(model, rank, s), range(STEPS), update)
            runs[how] = {"norms": norms, "weights": {k: v.clone() for k, v in model.state_dict().items()},
                         "state": opt.state_dict()}
        result[str(clip)] = runs
    torch.save(result, f"{out}-graphed-rank{rank}.pt")


def _reference():
    torch.manual_seed(0)
    model = Shapes()
    opt = build_optimizers(model, OptimConfig(**CFG))

    def mean_grads(step):
        return [(a + b) / 2 for a, b in zip(_grads(model, 0, step), _grads(model, 1, step))]

    norms = _run_steps(model, opt, mean_grads, range(STEPS))
    return model.state_dict(), norms


@pytest.fixture(scope="module")
def two_process_results(tmp_path_factory, free_port, run_ranks):
    out = tmp_path_factory.mktemp("dist")
    run_ranks(_worker, (free_port(), str(out)))
    return out


@pytest.mark.parametrize("mode", ["reduce_scatter", "allreduce_fallback"])
def test_two_process_step_equals_single_process_on_global_gradient(two_process_results, mode):
    ranks = [torch.load(two_process_results / f"{mode}-rank{r}.pt", weights_only=True)
             for r in range(2)]
    ref_weights, ref_norms = _reference()
    for r in ranks:
        assert r["norms"] == pytest.approx(ref_norms, rel=1e-5)
        for name, ref in ref_weights.items():
            torch.testing.assert_close(r["weights"][name], ref, atol=1e-6, rtol=1e-5, msg=name)
        assert r["resumed_equal"]
    # sharded state: Muon's 3 (6->10) matrices go 2 + 1, the single (10->6) one to rank 0;
    # Adam rows are split: the 7-row embedding 4 + 3, the 0-d scalar to rank 0
    s0, s1 = ranks[0]["state"], ranks[1]["state"]
    assert set(s0["muon"]["state"]) == {"a.0.weight", "a.1.weight", "b.weight"}
    assert set(s1["muon"]["state"]) == {"a.2.weight"}
    assert s0["adam"]["state"]["embed.weight"]["rows"] == [0, 4]
    assert s1["adam"]["state"]["embed.weight"]["rows"] == [4, 7]
    assert s0["adam"]["state"]["embed.weight"]["exp_avg"].shape == (4, 6)
    assert "scale" in s0["adam"]["state"] and "scale" not in s1["adam"]["state"]
    assert (s0["muon"]["rank"], s1["muon"]["rank"], s1["muon"]["world_size"]) == (0, 1, 2)


def _flat(sd) -> list:
    if isinstance(sd, dict):
        return [x for k in sorted(sd) for x in _flat(sd[k])]
    if isinstance(sd, list):
        return [x for v in sd for x in _flat(v)]
    return [sd]


@pytest.mark.parametrize("mode", ["reduce_scatter", "allreduce_fallback"])
@pytest.mark.parametrize("clip", ["2.0", "0.0"])
def test_two_process_graphed_step_equals_clip_and_step(two_process_results, mode, clip):
    """With a process group, graphed_step reduce-scatters into its buffers, all-reduces the
    clipping norm and all-gathers the updated pieces around the update: bitwise the eager
    clip_grad_norm_ + step (weights, norms and each rank's optimizer state); traced by torch.compile
    (the trainer's form) the same to float32 rounding."""
    for r in range(2):
        runs = torch.load(two_process_results / f"{mode}-graphed-rank{r}.pt", weights_only=True)[clip]
        eager, graphed, compiled = runs["eager"], runs["graphed"], runs["compiled"]
        assert graphed["norms"] == eager["norms"]
        assert (eager["norms"][0] > 0) == (clip != "0.0")
        for name, want in eager["weights"].items():
            assert torch.equal(graphed["weights"][name], want), name
            torch.testing.assert_close(compiled["weights"][name], want, atol=1e-6, rtol=1e-5, msg=name)
        got, want = _flat(graphed["state"]), _flat(eager["state"])
        assert len(got) == len(want)
        for a, b in zip(got, want):
            assert torch.equal(a, b) if isinstance(b, torch.Tensor) else a == b
        assert compiled["norms"] == pytest.approx(eager["norms"], rel=1e-6)
    # the ranks hold the same weights after the all-gathers
    ranks = [torch.load(two_process_results / f"{mode}-graphed-rank{r}.pt", weights_only=True)[clip]
             for r in range(2)]
    for name, w in ranks[0]["graphed"]["weights"].items():
        assert torch.equal(ranks[1]["graphed"]["weights"][name], w), name


def test_loading_a_sharded_state_into_another_world_size_is_refused(tmp_path):
    opt = build_optimizers(Shapes(), OptimConfig(**CFG))
    sd = opt.state_dict()
    sd["adam"]["world_size"] = 2
    with pytest.raises(ValueError, match="same number of processes"):
        opt.load_state_dict(sd)


def test_packing_into_a_fixed_buffer_by_views_equals_the_concatenation():
    # pack_gradients' multi-tensor copy into the buffer's views writes exactly the concatenation
    # of the pieces: every piece at its offset, a None gradient as zeros, every slot of the buffer
    # (whatever it held before) overwritten
    mats = [torch.randn(3, 4) for _ in range(3)]
    rows = torch.randn(5, 2)
    layout = optim_dist.ShardLayout(1)
    layout.add_matrices(mats)
    layout.add_rows(rows)
    grads = [torch.randn(3, 4), None, torch.randn(3, 4), torch.randn(5, 2)]
    out = torch.full((layout.region,), float("nan"))
    assert layout.pack_gradients(grads, out) is out
    want = torch.cat([grads[0].flatten(), torch.zeros(12), grads[2].flatten(), grads[3].flatten()])
    assert want.numel() == layout.region and torch.equal(out, want)
    with pytest.raises(ValueError, match="elements of pieces"):
        layout.pack_gradients(grads, torch.zeros(layout.region + 1))
