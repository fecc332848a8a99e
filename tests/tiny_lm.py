"""The small fp64 models that the model-level tests build, and a mixer run packed and per segment
(imported by the test files)."""
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


def packed_and_alone(mixer, x, conv0, state0, bounds, init=None) -> tuple:
    """A sequence mixer (Mamba-2 or the delta rule) over x (B, L, D) packed in the segments that
    start at `bounds` (0, ..., L), and over each segment alone: segment 0 from the carried
    (conv0, state0), later ones from a zero state or from `init` (conv tail, state) as a packed
    call starts them. Returns the packed call's (y, conv, state) and each lone call's."""
    seg = torch.zeros(x.shape[0], x.shape[1], dtype=torch.long)
    for k, a in enumerate(bounds[1:-1], start=1):
        seg[:, a:] = k
    packed = mixer(x, conv0, state0, seg=seg, init=init)
    alone = []
    for k, (a, b) in enumerate(zip(bounds[:-1], bounds[1:])):
        if k == 0:
            c_in, s_in = conv0, state0
        elif init is None:
            c_in, s_in = mixer.init_state(x.shape[0], dtype=x.dtype)
        else:
            c_in, s_in = init[0].expand(x.shape[0], -1, -1), init[1].expand(x.shape[0], -1, -1, -1)
        alone.append(mixer(x[:, a:b], c_in, s_in))
    return packed, alone
