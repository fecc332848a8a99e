"""The Mamba-2 mixer against the SSD paper's minimal algorithm (Dao & Gu 2024, section 6: the
quadratic form inside each block, a state passed from block to block between them), written
here independently of layers/ssd.py: the scan equals it, and a Mamba-only model trained on an
associative-recall task shaped like Zoology's MQAR (key-value pairs, then the keys again) follows
the same loss curve with either scan inside its mixers."""
import random

import pytest
import torch

import elephant.layers.mamba as mamba_module
from elephant.config import ModelConfig
from elephant.layers.ssd import ssd_scan
from elephant.model import ElephantLM
from test_ssd import make_inputs


def ssd_minimal(x, dt, A, B, C, D=None, initial_state=None, block: int = 8):
    """y (b, l, h, p) and the final state (b, h, p, n) of the SSD recurrence
    s_t = exp(dt_t A) s_{t-1} + dt_t x_t B_t^T, y_t = s_t C_t + D x_t, by the paper's blocked
    form. x (b, l, h, p), dt (b, l, h), A (h,), B and C (b, l, g, n) shared by h / g heads each;
    l a multiple of `block`."""
    b, l, h, p = x.shape
    g, n = B.shape[2], B.shape[3]
    c, q = l // block, block
    Bh = B.repeat_interleave(h // g, dim=2).reshape(b, c, q, h, n)
    Ch = C.repeat_interleave(h // g, dim=2).reshape(b, c, q, h, n)
    X = (x * dt[..., None]).reshape(b, c, q, h, p)                    # the input scaled by dt
    log_a = (dt * A).reshape(b, c, q, h).permute(0, 3, 1, 2)           # (b, h, c, q)
    cum = log_a.cumsum(-1)
    # inside a block: token s reaches token t >= s decayed by exp(cum[t] - cum[s])
    gap = cum[..., :, None] - cum[..., None, :]                        # (b, h, c, t, s)
    causal = torch.ones(q, q, dtype=torch.bool).tril()
    decay = torch.exp(gap.masked_fill(~causal, float("-inf")))
    y_inside = torch.einsum("bcthn,bcshn,bhcts,bcshp->bcthp", Ch, Bh, decay, X)
    # each block's contribution to the state at its end, then the state passed block to block
    to_end = torch.exp(cum[..., -1:] - cum)                            # (b, h, c, q)
    block_state = torch.einsum("bcshn,bhcs,bcshp->bchpn", Bh, to_end, X)
    state = x.new_zeros(b, h, p, n) if initial_state is None else initial_state
    entering = []
    for k in range(c):
        entering.append(state)
        state = torch.exp(cum[:, :, k, -1])[..., None, None] * state + block_state[:, k]
    entering = torch.stack(entering, 1)                                # (b, c, h, p, n)
    y_across = torch.einsum("bcthn,bchpn,bhct->bcthp", Ch, entering, torch.exp(cum))
    y = (y_inside + y_across).reshape(b, l, h, p)
    if D is not None:
        y = y + D[:, None] * x
    return y, state


@pytest.mark.parametrize("chunk", [8, 16, 64])
def test_ssd_scan_equals_the_papers_minimal_ssd(chunk):
    x, dt, A, B, C, D, init = make_inputs(l=48)
    y, final = ssd_scan(x, dt, A, B, C, D, init, chunk_size=chunk)
    want_y, want_final = ssd_minimal(x, dt, A, B, C, D, init, block=8)
    torch.testing.assert_close(y, want_y, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(final, want_final, rtol=1e-10, atol=1e-10)


def mqar_batch(rng: random.Random, rows: int, pairs: int = 8, keys: int = 32) -> torch.Tensor:
    """(rows, 4 pairs + 1) tokens: k1 v1 ... kP vP, then the same keys in another order, each
    followed by its value; keys are 1..keys, values keys+1..2 keys. The second half's values can
    only be predicted by recalling the first half's pairs."""
    out = []
    for _ in range(rows):
        ks = rng.sample(range(1, keys + 1), pairs)
        vs = [keys + 1 + rng.randrange(keys) for _ in ks]
        first = [t for kv in zip(ks, vs) for t in kv]
        order = rng.sample(range(pairs), pairs)
        out.append(first + [t for i in order for t in (ks[i], vs[i])] + [0])
    return torch.tensor(out)


def train_mamba_only(scan, steps: int = 25) -> list[float]:
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=80, d_model=32, n_heads=2, layers="MM", d_mlp=0, d_state=16,
                      mamba_head_dim=16, ssd_chunk=8)
    model = ElephantLM(cfg).double()
    model.set_fast_paths(False)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    rng = random.Random(0)
    losses = []
    original = mamba_module.ssd_scan
    mamba_module.ssd_scan = scan
    try:
        for _ in range(steps):
            x = mqar_batch(rng, 16)
            loss, _ = model(x[:, :-1], targets=x[:, 1:])
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
    finally:
        mamba_module.ssd_scan = original
    return losses


def test_mamba_only_model_trains_the_same_on_mqar_with_the_minimal_ssd():
    def minimal(x, dt, A, B, C, D=None, initial_state=None, chunk_size=64, seg=None,
                segment_init=None, joint=None):
        assert seg is None and segment_init is None and x.shape[1] % 8 == 0   # 32 tokens a row
        return ssd_minimal(x, dt, A, B, C, D, initial_state, block=8)

    ours = train_mamba_only(mamba_module.ssd_scan)
    theirs = train_mamba_only(minimal)
    assert ours[-1] < ours[0] - 0.3, ours                      # it learns
    torch.testing.assert_close(torch.tensor(ours), torch.tensor(theirs), rtol=1e-9, atol=1e-9)
