"""The optimizer step captured as a CUDA graph (`Optimizers.graphed_step`) against clipping plus
the eager step, on the parameters of a small ElephantLM. Run on a CUDA machine:
`python -m pytest -m gpu tests/test_gpu_optim.py`."""
import copy

import pytest
import torch

from elephant.config import ModelConfig, OptimConfig
from elephant.model import ElephantLM
from elephant.optim import build_optimizers
from numerics import rel

pytestmark = pytest.mark.gpu


def model_and_twin(cfg: OptimConfig):
    """A small ElephantLM on CUDA, an identical copy, and the optimizers of each."""
    torch.manual_seed(0)
    model = ElephantLM(ModelConfig(vocab_size=512, d_model=128, n_heads=4, layers="MA", d_mlp=256,
                                   d_state=32, mamba_head_dim=32, ssd_chunk=32, n_mem=4,
                                   kv_window=64)).cuda()
    twin = copy.deepcopy(model)
    return model, twin, build_optimizers(model, cfg), build_optimizers(twin, cfg)


def test_graphed_step_equals_clip_and_step_and_captures_again_after_a_load():
    model, twin, eager, graphed = model_and_twin(
        OptimConfig(warmup_steps=3, muon_wd=0.02, adam_wd=0.02, momentum_warmup_steps=4))
    gen = torch.Generator().manual_seed(1)
    grads = [[torch.randn(p.shape, generator=gen).cuda() * 10 ** (i % 3 - 2)
              for p in model.parameters()] for i in range(6)]

    def step(i, m, opt, use_graph):
        opt.set_step(i, 6)
        for p, g in zip(m.parameters(), grads[i]):
            p.grad = g.clone()
        if use_graph:
            norm = opt.graphed_step(0.5)
        else:
            norm = opt.clip_grad_norm_(0.5)
            opt.step()
        opt.zero_grad(set_to_none=True)
        return norm

    saved = None
    for i in range(6):
        n_eager, n_graph = step(i, model, eager, False), step(i, twin, graphed, True)
        assert torch.equal(n_graph, n_eager), (i, n_graph.item(), n_eager.item())
        for (name, a), b in zip(model.named_parameters(), twin.parameters()):
            # the same kernels on the same float32 values
            assert torch.equal(b, a), (i, name, (b - a).abs().max().item(), a.abs().max().item())
        if i == 2:
            saved = graphed.state_dict(), {k: v.clone() for k, v in twin.state_dict().items()}
    after = {k: v.clone() for k, v in twin.state_dict().items()}
    # back to step 3 on the same optimizers: their graph read the states the load replaces, so
    # it must be captured again; the replayed steps then land exactly where they did
    graphed.load_state_dict(saved[0])
    twin.load_state_dict(saved[1])
    assert graphed._graph is None
    for i in range(3, 6):
        step(i, twin, graphed, True)
    for name, v in twin.state_dict().items():
        assert torch.equal(v, after[name]), (name, (v - after[name]).abs().max().item())


@pytest.mark.heavy
def test_compiled_graphed_step_follows_the_eager_step():
    # the trainer's form (train.compile=graphs): the update compiled by inductor, then captured;
    # fused passes round differently, so the steps agree to float32 rounding carried through the
    # bf16 iterations, not bit for bit
    model, twin, eager, compiled = model_and_twin(OptimConfig(warmup_steps=2, muon_wd=0.02,
                                                              adam_wd=0.02))
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    gen = torch.Generator().manual_seed(2)
    for i in range(4):
        grads = [torch.randn(p.shape, generator=gen).cuda() for p in model.parameters()]
        for m, opt in ((model, eager), (twin, compiled)):
            opt.set_step(i, 4)
            for p, g in zip(m.parameters(), grads):
                p.grad = g.clone()
        n_eager = eager.clip_grad_norm_(1.0)
        eager.step()
        n_comp = compiled.graphed_step(1.0, "inductor")
        torch.testing.assert_close(n_comp, n_eager, rtol=1e-5, atol=0)
    for name, p in twin.named_parameters():
        moved, want = p.detach() - start[name], dict(model.named_parameters())[name].detach() - start[name]
        assert rel(moved, want) < 2e-2, (name, rel(moved, want))


def _two_gpu_worker(rank: int, port: int, out: str):
    """One rank of test_two_gpu_graphed_step_equals_the_eager_step: the same gradients per rank,
    the eager step and the graphed one (captured with NCCL's process group live) side by side."""
    import os

    import torch.distributed as dist
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=2, device_id=torch.device("cuda", rank))
    try:
        model, twin, eager, graphed = model_and_twin(
            OptimConfig(warmup_steps=3, muon_wd=0.02, adam_wd=0.02, momentum_warmup_steps=4))
        gen = torch.Generator().manual_seed(1 + rank)
        result = []
        for i in range(5):
            grads = [torch.randn(p.shape, generator=gen).cuda() * 10 ** (i % 3 - 2)
                     for p in model.parameters()]
            norms = []
            for m, opt, use_graph in ((model, eager, False), (twin, graphed, True)):
                opt.set_step(i, 5)
                for p, g in zip(m.parameters(), grads):
                    p.grad = g.clone()
                if use_graph:
                    norms.append(opt.graphed_step(0.5))
                else:
                    norms.append(opt.clip_grad_norm_(0.5))
                    opt.step()
                opt.zero_grad(set_to_none=True)
            same = [torch.equal(a, b) for a, b in zip(model.parameters(), twin.parameters())]
            result.append((torch.equal(*norms), all(same), norms[0].item()))
        weights = [p.detach().cpu() for p in twin.parameters()]
        torch.save({"steps": result, "weights": weights}, f"{out}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs (NCCL takes one a rank)")
def test_two_gpu_graphed_step_equals_the_eager_step(tmp_path, free_port, run_ranks):
    # the trainer's graphed step with a process group: reduce-scatter into the graph's buffers,
    # the clipping norm all-reduced before the replay, the updated pieces all-gathered after it;
    # the same kernels on the same values as the eager step, so bitwise the same weights on both
    # ranks (the arithmetic is also tested on the CPU with gloo: tests/test_optim_dist.py)
    run_ranks(_two_gpu_worker, (free_port(), str(tmp_path)))
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(2)]
    for r in ranks:
        assert all(norm_equal and weights_equal for norm_equal, weights_equal, _ in r["steps"]), r["steps"]
    assert [s[2] for s in ranks[0]["steps"]] == [s[2] for s in ranks[1]["steps"]]
    assert all(torch.equal(a, b) for a, b in zip(ranks[0]["weights"], ranks[1]["weights"]))
