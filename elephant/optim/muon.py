"""Muon for hidden 2-D weights: momentum, orthogonalization, NorMuon, cautious weight decay.

One step of `Muon`, per matrix W of shape (rows, cols):
    M <- lerp(M, G, 1 - mu);  U = lerp(G, M, mu) (Nesterov) or M
    O = orthogonalize(U)                               ~ the polar factor U V^T of U = U S V^T
    O <- NorMuon(O)                                    (optional, arXiv 2510.05491)
    W <- W - lr * max(1, rows/cols)^0.5 * O - decay * [O * W > 0] * W
Orientation: a weight is stored as nn.Linear stores it, (out_features, in_features), so
rows = fan-out and cols = fan-in. That decides the lr scale (an up-projection (1536, 512) moves
sqrt(3) times faster than a down-projection (512, 1536)) and NorMuon's axis (below).

Orthogonalizers, all batched over a stack (B, rows, cols) of matrices of one shape and run in
bf16 on the GPU (the iterations are self-correcting, so bf16 rounding does not accumulate):
- `newton_schulz`: Muon's quintic X <- aX + b(XX^T)X + c(XX^T)^2 X with the fixed
  (3.4445, -4.7750, 2.0315) after Frobenius normalization; singular values end in ~[0.68, 1.16].
- `polar_express` (arXiv 2505.16932): one minimax-optimal triple per iteration, computed by
  `polar_express_coefficients` (for 5 iterations these are the triples the NanoGPT speedrun uses);
  input divided by 1.02 x its Frobenius norm; singular values converge to 1.
- `aol_polar_express` (Turbo-Muon, arXiv 2512.04632, with the AOL rescaling of arXiv 2208.03160):
  instead of the Frobenius norm, X <- D X with D = diag(sum_j |A_ij|)^(-1/2), A = X X^T, which
  bounds the spectral norm by 1 far more tightly; D A D is the first iteration's Gram matrix, so
  the rescaling costs no extra product, and the first (the large-gain) Polar Express triple is
  dropped: four iterations instead of five. Measured (tests, bench_optim): its polar error beats
  four Polar Express iterations on Gaussian, ill-conditioned and row-scaled inputs and nearly
  matches five, but trails on low-rank-plus-small-noise inputs, whose small singular values sit
  far below the top and need the dropped high-gain step.
Tall matrices (rows > cols) use the small Gram matrix X^T X and multiply on the right
(X <- aX + X B), so no transposed copy is made and every product is as small as for the wide case.

NorMuon keeps a running mean of O*O along one axis: one value per row for tall and square
matrices, one per column for wide ones. (An orthogonal O has equal-norm rows when wide and
equal-norm columns when tall, so the other axis is the one whose norms vary.) O is divided by the
square root of that mean, then rescaled to its own Frobenius norm before the division.

Distributed: with a process group, the matrices of each shape are dealt out whole to the ranks
(`dist.ShardLayout.add_matrices`); each rank keeps momentum and NorMuon state only for the matrices
it owns. See `elephant/optim/dist.py`.
"""
from __future__ import annotations

import functools
import math

import numpy as np
import torch
from torch import Tensor

from .adam import check_state_dict, decay_and_update_, fp32_values
from .dist import ShardedPhases, ShardLayout, world
from .gram_triton import sym_gram

SAFETY = 2e-2           # Polar Express safety factor: spectral norm at most 1 / (1 + SAFETY)
NS_COEFFS = (3.4445, -4.7750, 2.0315)


# ------------------------------------------------------------------ Polar Express coefficients
def _minimax_odd_quintic(lo: float, hi: float) -> tuple[float, float, float]:
    """The odd quintic p(x) = ax + bx^3 + cx^5 closest to 1 in max-norm on [lo, hi] (Remez)."""
    if lo / hi > 1 - 5e-6:  # interval collapsed: the limit is the Taylor-like (15, -10, 3)/8
        return 15 / 8 / hi, -10 / 8 / hi ** 3, 3 / 8 / hi ** 5
    # p - 1 equioscillates at lo, two interior extrema x1 < x2, and hi
    x1, x2 = (3 * lo + hi) / 4, (lo + 3 * hi) / 4
    err = math.inf
    for _ in range(100):
        pts = np.array([lo, x1, x2, hi])
        system = np.stack([pts, pts ** 3, pts ** 5, np.array([1.0, -1.0, 1.0, -1.0])], axis=1)
        a, b, c, new_err = np.linalg.solve(system, np.ones(4))
        # extrema of p: p'(x) = a + 3b x^2 + 5c x^4 = 0, a quadratic in x^2
        disc = math.sqrt(9 * b * b - 20 * a * c)
        x1, x2 = (math.sqrt((-3 * b - disc) / (10 * c)), math.sqrt((-3 * b + disc) / (10 * c)))
        if abs(new_err - err) < 1e-15:
            break
        err = new_err
    return float(a), float(b), float(c)


@functools.lru_cache(maxsize=None)
def polar_express_coefficients(steps: int, lower: float = 1e-3, safety: float = SAFETY,
                               cushion: float = 0.02) -> tuple[tuple[float, float, float], ...]:
    """Per-iteration (a, b, c) of Polar Express for singular values in [lower, 1].

    Each polynomial is minimax-optimal on the interval the previous ones leave; it is fitted on
    [max(lower, cushion * hi), hi] (a cushion keeps the gain bounded) and re-centred so that it
    still maps [lower, hi] around 1; all but the last are evaluated at x / (1 + safety) so that bf16
    rounding cannot push a singular value above the next interval. steps=5 gives the speedrun's
    triples (tested).
    """
    lo, hi, out = lower, 1.0, []
    for i in range(steps):
        a, b, c = _minimax_odd_quintic(max(lo, cushion * hi), hi)
        if cushion * hi > lo:
            p_lo, p_hi = (a * lo + b * lo ** 3 + c * lo ** 5), (a * hi + b * hi ** 3 + c * hi ** 5)
            r = 2 / (p_lo + p_hi)
            a, b, c = a * r, b * r, c * r
        if i < steps - 1:
            s = 1 + safety
            a, b, c = a / s, b / s ** 3, c / s ** 5
        out.append((a, b, c))
        lo = a * lo + b * lo ** 3 + c * lo ** 5
        hi = 2 - lo
    return tuple(out)


@torch.compiler.assume_constant_result
def _coefficients(steps: int) -> tuple:
    """polar_express_coefficients(steps), a constant to a compiler tracing the iterations."""
    return polar_express_coefficients(steps)


# ------------------------------------------------------------------ the iterations
GRAM_BACKENDS = ("matmul", "triton")


def _gram(X: Tensor, tall: bool, backend: str = "matmul") -> Tensor:
    """The small Gram matrix: X X^T (B, m, m) for wide X, X^T X (B, n, n) for tall X."""
    if backend == "triton":
        return sym_gram(X.mT if tall else X)
    return X.mT @ X if tall else X @ X.mT


def _quintic_step(X: Tensor, A: Tensor, abc: tuple[float, float, float], tall: bool,
                  backend: str = "matmul") -> Tensor:
    """X <- aX + bX(X^T X) + cX(X^T X)^2 (tall) or aX + (b A + c A^2) X (wide), A the Gram matrix."""
    a, b, c = abc
    if backend == "triton":
        B = sym_gram(A, alpha=c, beta=b)                  # b A + c A A^T, A symmetric
    else:
        B = torch.baddbmm(A, A, A, beta=b, alpha=c)       # b A + c A A   (B, k, k)
    return torch.baddbmm(X, X, B, beta=a) if tall else torch.baddbmm(X, B, X, beta=a)


def _as_batch(G: Tensor) -> tuple[Tensor, bool]:
    if G.ndim < 2:
        raise ValueError(f"orthogonalization needs a matrix or a stack of matrices, got shape "
                         f"{tuple(G.shape)}")
    X = G.reshape(-1, *G.shape[-2:])                         # (B, rows, cols)
    return X, G.size(-2) > G.size(-1)


def _frobenius_normalized(X: Tensor, dtype: torch.dtype, safety: float) -> Tensor:
    norm = torch.linalg.vector_norm(X, dim=(-2, -1), keepdim=True, dtype=torch.float32)
    return (X.float() / (norm * (1 + safety) + 1e-7)).to(dtype)


def newton_schulz(G: Tensor, steps: int = 5, dtype: torch.dtype = torch.bfloat16,
                  gram: str = "matmul") -> Tensor:
    """Muon's quintic Newton-Schulz: `steps` iterations of (3.4445, -4.7750, 2.0315).

    G: (..., rows, cols); returns the same shape in `dtype`, singular values in about [0.68, 1.16].
    """
    X, tall = _as_batch(G)
    X = _frobenius_normalized(X, dtype, 0.0)
    for _ in range(steps):
        X = _quintic_step(X, _gram(X, tall, gram), NS_COEFFS, tall, gram)
    return X.reshape(G.shape)


def polar_express(G: Tensor, steps: int = 5, dtype: torch.dtype = torch.bfloat16,
                  gram: str = "matmul") -> Tensor:
    """Polar Express: the coefficients computed for `steps` iterations, after dividing by
    1.02 x the Frobenius norm. G: (..., rows, cols); returns the same shape in `dtype`."""
    X, tall = _as_batch(G)
    X = _frobenius_normalized(X, dtype, SAFETY)
    for abc in _coefficients(steps):
        X = _quintic_step(X, _gram(X, tall, gram), abc, tall, gram)
    return X.reshape(G.shape)


def aol_polar_express(G: Tensor, steps: int = 4, dtype: torch.dtype = torch.bfloat16,
                      gram: str = "matmul") -> Tensor:
    """Turbo-Muon: AOL rescaling, then the last `steps` triples of the (steps+1)-step Polar Express.

    A = X X^T (X^T X when tall); D = diag((1 + 0.02) sum_j |A_ij|)^(-1/2) scales the rows (the
    columns when tall) so that ||D X||_2 <= 1 / sqrt(1.02); D A D is reused as the first
    iteration's Gram matrix. G: (..., rows, cols); returns the same shape in `dtype`.
    """
    X, tall = _as_batch(G)
    X = X.to(dtype)
    A = _gram(X, tall, gram)                                    # (B, k, k)
    row_sums = A.abs().sum(dim=-1, dtype=torch.float32)         # (B, k)
    # zero rows (a zero gradient, padding) stay zero instead of becoming 0 * inf
    d = torch.rsqrt(row_sums.clamp_min(torch.finfo(torch.float32).tiny) * (1 + SAFETY)).to(dtype)
    X = X * d.unsqueeze(-2) if tall else X * d.unsqueeze(-1)
    A = A * d.unsqueeze(-1) * d.unsqueeze(-2)
    coeffs = _coefficients(steps + 1)[1:]
    X = _quintic_step(X, A, coeffs[0], tall, gram)
    for abc in coeffs[1:]:
        X = _quintic_step(X, _gram(X, tall, gram), abc, tall, gram)
    return X.reshape(G.shape)


ORTHOGONALIZERS = {"newton_schulz": newton_schulz, "polar_express": polar_express,
                   "aol": aol_polar_express}


def orthogonalize(G: Tensor, method: str = "polar_express", ns_steps: int = 5,
                  dtype: torch.dtype = torch.bfloat16, gram: str = "matmul") -> Tensor:
    """Dispatch by name: newton_schulz (`ns_steps` iterations), polar_express (5), aol (4).
    gram: "matmul" (torch) or "triton" (gram_triton.sym_gram for the symmetric products)."""
    if gram not in GRAM_BACKENDS:
        raise ValueError(f"orthogonalize: gram must be one of {', '.join(GRAM_BACKENDS)}, got {gram!r}")
    if method == "newton_schulz":
        return newton_schulz(G, ns_steps, dtype, gram)
    if method in ORTHOGONALIZERS:
        return ORTHOGONALIZERS[method](G, dtype=dtype, gram=gram)
    raise ValueError(f"orthogonalize: expected one of {', '.join(ORTHOGONALIZERS)}, got {method!r}")


# ------------------------------------------------------------------ NorMuon, cautious decay
def normuon_axis(rows: int, cols: int) -> int:
    """The axis NorMuon averages over: -1 (one statistic per row) for tall and square matrices,
    -2 (one per column) for wide ones."""
    return -1 if rows >= cols else -2


def normuon_state_shape(rows: int, cols: int) -> tuple[int, int]:
    return (rows, 1) if normuon_axis(rows, cols) == -1 else (1, cols)


def normuon_(O: Tensor, second_moment: Tensor, beta2: float, eps: float = 1e-10) -> Tensor:
    """NorMuon: divide O (B, rows, cols) by the running RMS along `normuon_axis`, keep ||O||_F.

    second_moment: (B, rows, 1) or (B, 1, cols), fp32, updated in place. Returns a new tensor.
    """
    O = O.float()
    mean_sq = O.square().mean(dim=normuon_axis(*O.shape[-2:]), keepdim=True)
    second_moment.lerp_(mean_sq, 1 - beta2)
    scale = second_moment.clamp_min(eps).rsqrt()
    # ||O||_F^2 and ||scale * O||_F^2 from the same per-row (per-column) sums of squares
    before = mean_sq.sum(dim=(-2, -1), keepdim=True)
    after = (mean_sq * scale.square()).sum(dim=(-2, -1), keepdim=True)
    return O * (scale * (before / after.clamp_min(eps)).sqrt())


def muon_lr_scale(rows: int, cols: int) -> float:
    """max(1, rows / cols)^0.5 with rows = fan-out (nn.Linear's out_features)."""
    return max(1.0, rows / cols) ** 0.5


# ------------------------------------------------------------------ the optimizer
class Muon(ShardedPhases, torch.optim.Optimizer):
    """Muon for 2-D weights, on one process or sharded over a process group (see module doc).

    Group keys: lr (this step's lr; `initial_lr` keeps the base), momentum, nesterov,
    weight_decay (decoupled: a step decays by initial_lr * weight_decay * wd_mult), wd_mult,
    cautious, normuon, beta2, orthogonalize (newton_schulz | polar_express | aol), ns_steps,
    names (parameter names for the state_dict; default "<group>.<index>").
    `ortho_dtype`: the dtype of the iterations; default bf16 on CUDA, fp32 on CPU.
    `gram`: "matmul" or "triton" for the symmetric products (see gram_triton.py).
    """

    def __init__(self, params, lr: float = 0.02, momentum: float = 0.95, nesterov: bool = True,
                 weight_decay: float = 0.0, cautious: bool = True, normuon: bool = True,
                 beta2: float = 0.95, orthogonalize: str = "polar_express", ns_steps: int = 5,
                 ortho_dtype: torch.dtype | None = None, gram: str = "matmul", process_group=None):
        if orthogonalize not in ORTHOGONALIZERS:
            raise ValueError(f"Muon: orthogonalize must be one of {', '.join(ORTHOGONALIZERS)}, "
                             f"got {orthogonalize!r}")
        # no initial_lr among the defaults: a group's own lr is its base (see Adam)
        defaults = dict(lr=lr, momentum=momentum, nesterov=nesterov,
                        weight_decay=weight_decay, wd_mult=1.0, cautious=cautious, normuon=normuon,
                        beta2=beta2, orthogonalize=orthogonalize, ns_steps=ns_steps)
        super().__init__(params, defaults)
        if gram not in GRAM_BACKENDS:
            raise ValueError(f"Muon: gram must be one of {', '.join(GRAM_BACKENDS)}, got {gram!r}")
        self.ortho_dtype, self.gram = ortho_dtype, gram
        self.process_group = process_group
        self.rank, self.world_size = world(process_group)
        self.layout = ShardLayout(self.world_size)
        self.buckets: list[dict] = []   # one per (group, shape): the matrices dealt out together
        for gi, group in enumerate(self.param_groups):
            group.setdefault("initial_lr", group["lr"])
            names = group.setdefault("names", [f"{gi}.{i}" for i in range(len(group["params"]))])
            if len(names) != len(group["params"]):
                raise ValueError(f"Muon: group {gi} has {len(group['params'])} params but "
                                 f"{len(names)} names")
            by_shape: dict[tuple, list[int]] = {}
            for i, p in enumerate(group["params"]):
                if p.ndim != 2:
                    raise ValueError(f"Muon: {names[i]} has shape {tuple(p.shape)}; Muon takes "
                                     f"2-D weights only (give the rest to Adam)")
                by_shape.setdefault(tuple(p.shape), []).append(i)
            for shape, idx in by_shape.items():
                seg = self.layout.add_matrices([group["params"][i] for i in idx])
                mine = seg.owned(self.rank)              # positions within idx
                self.buckets.append(dict(group=gi, shape=shape, segment=seg, index=idx,
                                         mine=mine, state=None))
        self._local_grads: Tensor | None = None
        self._pending = None

    # -- the update phase (reduce-scatter and all-gather: dist.ShardedPhases)
    @torch.no_grad()
    def _update(self) -> None:
        self._apply(self.local_gradients(), self.hyper_values())
        self._local_grads = None

    def hyper_values(self) -> list[float]:
        """This step's scheduled values, three per bucket: momentum, lr x the shape's scale, decay
        (the host's part of a step; `_apply` reads them as floats or from a device tensor: both
        hold the same float32 values, so the two give the same update)."""
        out = []
        for b in self.buckets:
            group = self.param_groups[b["group"]]
            out += [group["momentum"], group["lr"] * muon_lr_scale(*b["shape"]),
                    group["initial_lr"] * group["weight_decay"] * group["wd_mult"]]
        return fp32_values(out)

    def n_hyper(self) -> int:
        return 3 * len(self.buckets)

    def state_tensors(self) -> list[Tensor]:
        return [t for b in self.buckets if b["state"] is not None for t in b["state"].values()]

    def ensure_state(self, like: Tensor) -> None:
        """Create the momentum and NorMuon buffers of every bucket this rank updates (zeros)."""
        for b in self.buckets:
            n = len(b["mine"])
            if n and b["state"] is None:
                rows, cols = b["shape"]
                b["state"] = dict(
                    momentum=torch.zeros(n, rows, cols, device=like.device, dtype=torch.float32),
                    second_moment=torch.zeros(n, *normuon_state_shape(rows, cols),
                                              device=like.device, dtype=torch.float32))

    @torch.no_grad()
    def _apply(self, flat: Tensor, hyper) -> None:
        """The device part of a step: update this rank's matrices from its gradient region `flat`.
        hyper: `hyper_values()`, a list of floats or a device tensor (then nothing here reads a
        value on the host, so the whole update can be captured as a CUDA graph)."""
        self.ensure_state(flat)
        for i, b in enumerate(self.buckets):
            group = self.param_groups[b["group"]]
            n = len(b["mine"])
            if n == 0:
                continue
            mu, lr, decay = hyper[3 * i], hyper[3 * i + 1], hyper[3 * i + 2]
            G = b["segment"].local_view(flat)[:n]                      # (n, rows, cols)
            st = b["state"]
            st["momentum"].lerp_(G, 1 - mu)
            U = G.lerp(st["momentum"], mu) if group["nesterov"] else st["momentum"]
            dtype = self.ortho_dtype or (torch.bfloat16 if G.is_cuda else torch.float32)
            O = orthogonalize(U, group["orthogonalize"], group["ns_steps"], dtype, self.gram)
            O = normuon_(O, st["second_moment"], group["beta2"]) if group["normuon"] else O.float()
            params = [b["segment"].params[j] for j in b["mine"]]
            updates = list(O.to(params[0].dtype).unbind(0))
            decay_and_update_(group, params, updates, decay, lr)

    def all_gather(self):
        """Send every rank's updated matrices to all ranks; returns a handle to .wait() on."""
        return self.layout.all_gather(self.process_group)

    # -- schedules
    def set_schedule(self, lr_mult: float, wd_mult: float = 1.0, momentum: float | None = None):
        """lr = initial_lr * lr_mult; weight decay scaled by wd_mult; momentum if given."""
        for group in self.param_groups:
            group["lr"] = group["initial_lr"] * lr_mult
            group["wd_mult"] = wd_mult
            if momentum is not None:
                group["momentum"] = momentum

    # -- state (this rank's matrices only)
    _GROUP_KEYS = ("lr", "initial_lr", "momentum", "weight_decay", "wd_mult", "beta2")

    def state_dict(self) -> dict:
        """{"kind", "rank", "world_size", "groups": {gi: {hyper-parameters}},
        "state": {name: {"momentum": (rows, cols), "second_moment": (rows, 1) | (1, cols)}}}
        for the matrices this rank owns (all of them without a process group). Tensors are
        copies (no shared storage), everything else is plain JSON-able values."""
        state = {}
        for b in self.buckets:
            names = self.param_groups[b["group"]]["names"]
            for k, j in enumerate(b["mine"]):
                if b["state"] is not None:
                    state[names[b["index"][j]]] = {key: t[k].clone() for key, t in b["state"].items()}
        groups = {str(gi): {k: g[k] for k in self._GROUP_KEYS} for gi, g in enumerate(self.param_groups)}
        return {"kind": "muon", "rank": self.rank, "world_size": self.world_size,
                "groups": groups, "state": state}

    def load_state_dict(self, sd: dict) -> None:
        check_state_dict(sd, "muon", self.rank, self.world_size)
        for gi, g in enumerate(self.param_groups):
            g.update(sd["groups"][str(gi)])
        for b in self.buckets:
            names = [self.param_groups[b["group"]]["names"][b["index"][j]] for j in b["mine"]]
            have = [n in sd["state"] for n in names]
            if not any(have):
                b["state"] = None
                continue
            if not all(have):
                missing = [n for n, h in zip(names, have) if not h]
                raise ValueError(f"Muon.load_state_dict: no state for {missing}")
            b["state"] = {key: torch.stack([sd["state"][n][key] for n in names]).to(
                b["segment"].params[0].device, torch.float32) for key in ("momentum", "second_moment")}

