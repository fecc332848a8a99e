"""The small fp64 models that the model-level tests build (imported by the test files)."""
import torch

from elephant.config import ModelConfig
from elephant.model import ElephantLM

BASE = dict(vocab_size=97, d_model=32, n_heads=4, layers="MAMA", d_mlp=48, d_state=16,
            mamba_head_dim=16, expand=2, d_conv=4, ssd_chunk=8, n_mem=0, kv_window=0)


def tiny_lm(seed: int = 0, **kw) -> ElephantLM:
    """A fresh ElephantLM of BASE updated by `kw`, seeded, in float64 and eval mode."""
    torch.manual_seed(seed)
    return ElephantLM(ModelConfig(**(BASE | kw))).double().eval()


def chunks_with_grads(model: ElephantLM, chunks, starts) -> tuple:
    """The logits of each chunk of `chunks` (n, B, T) run in order with carried state (`starts`:
    a (B, T) bool or None per chunk), the state after them, and the parameters' gradients (by
    name) of the logits' summed squares."""
    model.zero_grad()
    state, outs = None, []
    for c, s in zip(chunks, starts):
        logits, state = model(c, state, starts=s)
        outs.append(logits)
    sum(o.square().sum() for o in outs).backward()
    return outs, state, {n: p.grad.clone() for n, p in model.named_parameters()
                         if p.grad is not None}


def assert_same_run(got: tuple, want: tuple, tol: float = 1e-10) -> None:
    """Two `chunks_with_grads` results agree: logits, every state tensor and every gradient."""
    for g, w in zip(got[0], want[0]):
        torch.testing.assert_close(g, w, rtol=tol, atol=tol)
    for name, t in got[1].tensors().items():
        torch.testing.assert_close(t, want[1].tensors()[name], rtol=tol, atol=tol, msg=name)
    assert got[2].keys() == want[2].keys()
    for name, g in got[2].items():
        torch.testing.assert_close(g, want[2][name], rtol=tol, atol=tol, msg=name)
