"""The attention layer's associative memory (model.kv_assoc): what leaves the window, kept as a
map from keys to values that the layer's own queries read.

Per lane and head a matrix S (hd, hd) in float32. A token that leaves the window (KVCache.append)
is written by the delta rule (DeltaNet, Schlag et al. 2021; Yang et al. 2024) with its key before
rotary, L2-normalized (k), its value v and a strength beta = sigmoid(keep score):

    S <- S + beta k (v - S^T k)^T          (what S held under k moves toward v by beta)

so a key written again replaces its old value instead of adding to it, and a token writes only as
strongly as the keep score rates it (without a keep cost that rating stayed near 0.6 for every
token in the CPU probe: docs/RESULTS.md). The write happens a window after the token
was read, outside any backpropagated window: it carries no gradient, like the window itself; the
keep score learns where it is read as a kept token (kv_keep, kv_keep_cost). A query reads
o = S^T q, q its query before rotary turned to position W + 1 + its offset into the chunk, then
L2-normalized: it scores a written key (position 0) as it scores a key just past the window, where
it meets the kept tokens. o is added to the attention's output at the strength of a gate per
head, sigmoid(<w_h, x> + b_h) of the layer's input x (`Attention.assoc_read`). A fact is found
however far back it was written. `model.kv_assoc_writes` N > 0: only the N leaving tokens of
highest keep score are written each chunk.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from .delta import delta_rule_chunked

GATE_BIAS = -2.0   # the read gate's starting logit: the memory adds 0.12 of its read at first


def state_dtype(dtype: torch.dtype) -> torch.dtype:
    """S's dtype for a model of `dtype`: float32, float64 for float64 models."""
    return torch.promote_types(dtype, torch.float32)


@torch.no_grad()
def assoc_write(S: Tensor, k: Tensor, v: Tensor, beta: Tensor) -> Tensor:
    """S (B, H, hd, hd) after writing n tokens in order: keys before rotary k (B, H, n, hd)
    (normalized here), values v (B, H, n, hd), strengths beta (B, n) in [0, 1] (0: no write).
    No gradient (the write is outside the backpropagated window)."""
    if k.shape[2] == 0:
        return S
    cdt = S.dtype
    kn = F.normalize(k.to(cdt), dim=-1).transpose(1, 2)                     # (B, n, H, hd)
    vv = v.to(cdt).transpose(1, 2)
    b = beta.to(cdt)[:, :, None].expand(-1, -1, k.shape[1])                 # (B, n, H)
    _, S = delta_rule_chunked(kn, kn, vv, b, torch.zeros_like(b), initial_state=S)
    return S


def assoc_read(S: Tensor, q: Tensor) -> Tensor:
    """What queries q (B, H, S, hd) read of S (B, H, hd, hd): S^T q_hat, q_hat the L2-normalized
    query, (B, H, S, hd) in S's dtype."""
    return torch.einsum("bhsk,bhkv->bhsv", F.normalize(q.to(S.dtype), dim=-1), S)
