"""Adam for everything that is not a hidden matrix: embeddings, head, norms, gains, SSM A_log / D /
dt_bias, conv weights, memory parameters, biases.

Decoupled weight decay (AdamW): a step decays a weight by initial_lr * weight_decay * wd_mult, so
the decay follows its own schedule (`wd_mult`, see schedule.py) instead of being tied to the lr.
With `cautious` it decays only where the weight and its update have the same sign
(arXiv 2510.12402): there the decay and the update both pull the weight toward zero; where they
disagree the decay would fight the gradient, so the weight is left alone.

The update runs as torch._foreach_* kernels over the list of parameter pieces (a handful of
launches per group, whatever the number of parameters). Distributed: every parameter is split
along dim 0 over the ranks (`ShardLayout.add_rows`); each rank keeps Adam moments only for its
rows, so the optimizer state is sharded like ZeRO-1.
"""
from __future__ import annotations

import math

import numpy as np
import torch
from torch import Tensor

from .dist import ShardedPhases, ShardLayout, world


def fp32_values(values: list[float]) -> list[float]:
    """The values rounded to float32: a step's hyperparameters as floats (the eager step) and as a
    float32 device tensor (the captured one) are then the same numbers, and so are the updates
    (an operation rounds a Python scalar to float32 for float32 tensors, so 1 - x, -x and the
    like come out the same both ways)."""
    return np.asarray(values, dtype=np.float32).tolist()


def _is_zero(value) -> bool:
    """Whether a hyperparameter is a float equal to 0 (a device tensor is never read here)."""
    return not isinstance(value, Tensor) and value == 0


def cautious_decay_(params: list[Tensor], updates: list[Tensor], decay) -> None:
    """p <- p - decay * p where p and its update u (applied as p - lr * u) have the same sign;
    elsewhere p is left untouched. Call it before applying the update. decay: a float or a 0-d
    tensor on the parameters' device."""
    if _is_zero(decay) or not params:
        return
    masks = torch._foreach_mul(updates, params)
    masks = torch._foreach_sign(masks)
    torch._foreach_clamp_min_(masks, 0.0)                       # 1 where u * p > 0, else 0
    torch._foreach_mul_(masks, -decay)                          # -decay where the signs agree
    torch._foreach_addcmul_(params, params, masks)


def plain_decay_(params: list[Tensor], decay) -> None:
    if not _is_zero(decay) and params:
        torch._foreach_mul_(params, 1 - decay)


def decay_and_update_(group: dict, params: list[Tensor], updates: list[Tensor], decay, lr) -> None:
    """The group's weight decay (cautious or plain; no kernels when its weight_decay is 0), then
    p <- p - lr * u. decay, lr: floats or 0-d tensors. The updates are left as they are: scaled
    in place, when they are views of one stacked tensor (Muon's unbind), a compiled update had to
    write every scaled matrix and then the whole stack again (its functional form) before
    reading it back for the sum; out of place, the product goes straight into the sum."""
    if not params:
        return
    if group["weight_decay"] and group["cautious"]:
        cautious_decay_(params, updates, decay)
    elif group["weight_decay"]:
        plain_decay_(params, decay)
    torch._foreach_add_(params, torch._foreach_mul(updates, -lr))


def check_state_dict(sd: dict, kind: str, rank: int, world_size: int) -> None:
    if sd.get("kind") != kind:
        raise ValueError(f"{kind} optimizer: got a state_dict of kind {sd.get('kind')!r}")
    if sd.get("world_size") != world_size or sd.get("rank") != rank:
        raise ValueError(f"{kind} optimizer: state saved by rank {sd.get('rank')} of "
                         f"{sd.get('world_size')}, loading on rank {rank} of {world_size}; optimizer "
                         f"states are sharded, so resume with the same number of processes")


class Adam(ShardedPhases, torch.optim.Optimizer):
    """AdamW with optional cautious weight decay, on one process or sharded by dim 0.

    Group keys: lr (this step's; `initial_lr` keeps the base), betas, eps, weight_decay, wd_mult,
    cautious, step (the bias-correction count), names (for the state_dict; default "<g>.<i>").
    """

    def __init__(self, params, lr: float = 3e-3, betas: tuple[float, float] = (0.9, 0.95),
                 eps: float = 1e-8, weight_decay: float = 0.0, cautious: bool = True,
                 process_group=None):
        # no initial_lr among the defaults: a group's own lr is its base (set below); a default
        # would fill every group that names its lr with the constructor's lr instead
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps,
                        weight_decay=weight_decay, wd_mult=1.0, cautious=cautious, step=0)
        super().__init__(params, defaults)
        self.process_group = process_group
        self.rank, self.world_size = world(process_group)
        self.layout = ShardLayout(self.world_size)
        self.pieces: list[list[tuple]] = []      # per group: (name, segment, (start, stop))
        for gi, group in enumerate(self.param_groups):
            group.setdefault("initial_lr", group["lr"])
            group["betas"] = tuple(group["betas"])
            names = group.setdefault("names", [f"{gi}.{i}" for i in range(len(group["params"]))])
            if len(names) != len(group["params"]):
                raise ValueError(f"Adam: group {gi} has {len(group['params'])} params but "
                                 f"{len(names)} names")
            mine = []
            for name, p in zip(names, group["params"]):
                seg = self.layout.add_rows(p)
                mine.append((name, seg, seg.owned(self.rank)))
            self.pieces.append(mine)
        self._local_grads: Tensor | None = None
        self._pending = None

    # -- the phases (dist.ShardedPhases): reduce-scatter, update own rows (here), all-gather
    def all_gather(self):
        return self.layout.all_gather(self.process_group)

    @torch.no_grad()
    def _update(self) -> None:
        self._apply(self.local_gradients(), self.hyper_values())
        self._local_grads = None

    def hyper_values(self) -> list[float]:
        """Count this step (the bias corrections' t) and return its scheduled values, three per
        group: lr / (1 - b1^t), 1 / sqrt(1 - b2^t), decay (see Muon.hyper_values; a
        multiplication, as a division by a Python scalar and by a tensor may round apart)."""
        out = []
        for group in self.param_groups:
            group["step"] += 1
            b1, b2 = group["betas"]
            t = group["step"]
            out += [group["lr"] / (1 - b1 ** t), 1 / math.sqrt(1 - b2 ** t),
                    group["initial_lr"] * group["weight_decay"] * group["wd_mult"]]
        return fp32_values(out)

    def n_hyper(self) -> int:
        return 3 * len(self.param_groups)

    def state_tensors(self) -> list[Tensor]:
        return [t for st in self.state.values() for t in st.values()]

    def ensure_state(self, like: Tensor) -> None:
        """Create the moment buffers of every piece this rank owns (zeros)."""
        for mine in self.pieces:
            for name, seg, (a, b) in mine:
                if b > a and not self.state[name]:
                    self.state[name]["exp_avg"] = torch.zeros(b - a, seg.rest, device=like.device,
                                                              dtype=torch.float32)
                    self.state[name]["exp_avg_sq"] = torch.zeros_like(self.state[name]["exp_avg"])

    @torch.no_grad()
    def _apply(self, flat: Tensor, hyper) -> None:
        """The device part of a step from this rank's gradient region `flat`; hyper: the
        `hyper_values()` of this step, floats or a device tensor (see Muon._apply)."""
        self.ensure_state(flat)
        for gi, (group, mine) in enumerate(zip(self.param_groups, self.pieces)):
            P, G, M, V = [], [], [], []
            for name, seg, (a, b) in mine:
                if b <= a:
                    continue
                st = self.state[name]
                P.append(seg.rows_view(seg.params[0])[a:b])
                G.append(seg.local_view(flat)[:b - a].float())
                M.append(st["exp_avg"])
                V.append(st["exp_avg_sq"])
            if not P:
                continue
            lr, inv_bias2, decay = hyper[3 * gi], hyper[3 * gi + 1], hyper[3 * gi + 2]
            b1, b2 = group["betas"]
            torch._foreach_lerp_(M, G, 1 - b1)
            torch._foreach_mul_(V, b2)
            torch._foreach_addcmul_(V, G, G, value=1 - b2)
            denom = torch._foreach_sqrt(V)
            torch._foreach_mul_(denom, inv_bias2)
            torch._foreach_add_(denom, group["eps"])
            U = torch._foreach_div(M, denom)                  # m / (sqrt(v_hat) + eps)
            if P[0].dtype != torch.float32:
                U = [u.to(P[0].dtype) for u in U]
            decay_and_update_(group, P, U, decay, lr)

    def set_schedule(self, lr_mult: float, wd_mult: float = 1.0, momentum: float | None = None):
        """lr = initial_lr * lr_mult, weight decay scaled by wd_mult (momentum: ignored)."""
        for group in self.param_groups:
            group["lr"] = group["initial_lr"] * lr_mult
            group["wd_mult"] = wd_mult

    # -- state: this rank's rows only
    _GROUP_KEYS = ("lr", "initial_lr", "eps", "weight_decay", "wd_mult", "step")

    def state_dict(self) -> dict:
        """{"kind", "rank", "world_size", "groups": {gi: {hyper-parameters, "betas": [b1, b2]}},
        "state": {name: {"rows": [start, stop], "exp_avg", "exp_avg_sq"}}} for this rank's rows
        (the whole parameter without a process group); tensors are copies."""
        state = {}
        for mine in self.pieces:
            for name, seg, (a, b) in mine:
                if name in self.state:
                    st = self.state[name]
                    state[name] = {"rows": [a, b], "exp_avg": st["exp_avg"].clone(),
                                   "exp_avg_sq": st["exp_avg_sq"].clone()}
        groups = {str(gi): {**{k: g[k] for k in self._GROUP_KEYS}, "betas": list(g["betas"])}
                  for gi, g in enumerate(self.param_groups)}
        return {"kind": "adam", "rank": self.rank, "world_size": self.world_size,
                "groups": groups, "state": state}

    def load_state_dict(self, sd: dict) -> None:
        check_state_dict(sd, "adam", self.rank, self.world_size)
        for gi, g in enumerate(self.param_groups):
            saved = dict(sd["groups"][str(gi)])
            saved["betas"] = tuple(saved["betas"])
            g.update(saved)
        self.state.clear()
        for mine in self.pieces:
            for name, seg, (a, b) in mine:
                if name not in sd["state"]:
                    continue
                st = sd["state"][name]
                if list(st["rows"]) != [a, b]:
                    raise ValueError(f"Adam.load_state_dict: {name} holds rows {st['rows']}, "
                                     f"this rank owns rows {[a, b]}")
                dev = seg.params[0].device
                self.state[name] = {"exp_avg": st["exp_avg"].to(dev, torch.float32).clone(),
                                    "exp_avg_sq": st["exp_avg_sq"].to(dev, torch.float32).clone()}
