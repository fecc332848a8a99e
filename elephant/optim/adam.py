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

import torch
from torch import Tensor

from .dist import ShardedPhases, ShardLayout, world


def cautious_decay_(params: list[Tensor], updates: list[Tensor], decay: float) -> None:
    """p <- p - decay * p where p and its update u (applied as p - lr * u) have the same sign;
    elsewhere p is left untouched. Call it before applying the update."""
    if decay == 0 or not params:
        return
    masks = torch._foreach_mul(updates, params)
    masks = torch._foreach_sign(masks)
    torch._foreach_clamp_min_(masks, 0.0)                       # 1 where u * p > 0, else 0
    torch._foreach_addcmul_(params, params, masks, value=-decay)


def plain_decay_(params: list[Tensor], decay: float) -> None:
    if decay != 0 and params:
        torch._foreach_mul_(params, 1 - decay)


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
        defaults = dict(lr=lr, initial_lr=lr, betas=tuple(betas), eps=eps,
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
        flat = self.local_gradients()
        for group, mine in zip(self.param_groups, self.pieces):
            group["step"] += 1
            P, G, M, V = [], [], [], []
            for name, seg, (a, b) in mine:
                if b <= a:
                    continue
                st = self.state[name]
                if not st:
                    st["exp_avg"] = torch.zeros(b - a, seg.rest, device=flat.device, dtype=torch.float32)
                    st["exp_avg_sq"] = torch.zeros_like(st["exp_avg"])
                P.append(seg.rows_view(seg.params[0])[a:b])
                G.append(seg.local_view(flat)[:b - a].float())
                M.append(st["exp_avg"])
                V.append(st["exp_avg_sq"])
            if not P:
                continue
            b1, b2 = group["betas"]
            t = group["step"]
            torch._foreach_lerp_(M, G, 1 - b1)
            torch._foreach_mul_(V, b2)
            torch._foreach_addcmul_(V, G, G, value=1 - b2)
            denom = torch._foreach_sqrt(V)
            torch._foreach_div_(denom, math.sqrt(1 - b2 ** t))
            torch._foreach_add_(denom, group["eps"])
            U = torch._foreach_div(M, denom)                  # m / (sqrt(v_hat) + eps)
            if P[0].dtype != torch.float32:
                U = [u.to(P[0].dtype) for u in U]
            decay = group["initial_lr"] * group["weight_decay"] * group["wd_mult"]
            if group["cautious"]:
                cautious_decay_(P, U, decay)
            else:
                plain_decay_(P, decay)
            torch._foreach_add_(P, U, alpha=-group["lr"] / (1 - b1 ** t))
        self._local_grads = None

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
