"""Sharding parameters over ranks: who owns which piece, and the two collectives that move them.

A `ShardLayout` lays a list of parameters out in one flat buffer per rank (its "region"; every
rank's region has the same length, padded with zeros). Two ways to deal a parameter out:
- `add_matrices(params)`: whole matrices of one shape, k = ceil(n / world) consecutive matrices per
  rank (Muon: orthogonalization needs the whole matrix, and a rank's k matrices form one batch);
- `add_rows(param)`: dim-0 shards, ceil(d0 / world) rows per rank (Adam: elementwise, any split works).

A step is then: `reduce_scatter(grads)` averages the gradients over ranks and hands each rank its
region (the pieces it owns); the optimizer updates those pieces of the parameters in place;
`all_gather()` sends every rank's pieces to all ranks. Gradients are averaged (sum / world), as
DDP does, so no DDP wrapper and no other all-reduce is needed. A parameter whose .grad is None
counts as a zero gradient (every rank must take part in the same collectives), so unlike
torch.optim its momentum still moves it.

Without a process group (torch.distributed not initialized) world = 1: the same code runs, the
"reduce-scatter" is the packing copy alone and the gather is a no-op.

Collectives: NCCL uses the true reduce-scatter / all-gather (reduce_scatter_single /
all_gather_single, named *_tensor before torch 2.12). CPU fallback: when the backend does not
implement reduce-scatter (gloo in some torch versions; gloo in 2.13 does) the reduction is an
all-reduce of the whole buffer followed by taking this rank's slice: the same numbers (a sum over
ranks), world times the traffic; the all-gather falls back to all_gather into views of one
buffer. `force_allreduce_fallback(True)` selects the fallback for testing.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import Tensor

_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_fallback_backends: set[str] = set()
_force_fallback = False


def world(group=None) -> tuple[int, int]:
    """(rank, world_size) of `group`; (0, 1) when torch.distributed is not initialized."""
    if not (dist.is_available() and dist.is_initialized()):
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def force_allreduce_fallback(on: bool) -> None:
    """Use all-reduce + slicing instead of reduce-scatter on every backend (tests)."""
    global _force_fallback
    _force_fallback = on


class Segment:
    """One stretch of every rank's region: either whole matrices or dim-0 rows of one parameter."""

    def __init__(self, kind: str, params: list[Tensor], offset: int, world_size: int):
        self.kind, self.params, self.offset, self.world_size = kind, params, offset, world_size
        if kind == "matrices":
            self.shape = tuple(params[0].shape)
            self.numel = math.prod(self.shape)
            self.per_rank = math.ceil(len(params) / world_size)       # k matrices per rank
            self.length = self.per_rank * self.numel
        else:
            p = params[0]
            self.d0 = p.shape[0] if p.ndim else 1
            self.rest = p.numel() // self.d0 if self.d0 else 0
            self.per_rank = math.ceil(self.d0 / world_size)           # rows per rank
            self.length = self.per_rank * self.rest

    def owned(self, rank: int):
        """matrices: the indices (into params) this rank owns; rows: the row range (start, stop)."""
        if self.kind == "matrices":
            return list(range(rank * self.per_rank, min(len(self.params), (rank + 1) * self.per_rank)))
        return (min(self.d0, rank * self.per_rank), min(self.d0, (rank + 1) * self.per_rank))

    def local_view(self, region: Tensor) -> Tensor:
        """This segment in one rank's region: (k, *shape) for matrices, (rows owned, rest) for rows."""
        flat = region[self.offset:self.offset + self.length]
        if self.kind == "matrices":
            return flat.view(self.per_rank, *self.shape)
        return flat.view(self.per_rank, self.rest)

    def rows_view(self, t: Tensor) -> Tensor:
        return t.detach().reshape(self.d0, self.rest)

    def pieces(self, rank: int, tensors: list[Tensor | None], like: Tensor) -> list[Tensor]:
        """Flat pieces of `tensors` (None = zeros) for `rank`'s part of the segment, zero-padded."""
        out = []
        if self.kind == "matrices":
            for j in range(rank * self.per_rank, (rank + 1) * self.per_rank):
                t = tensors[j] if j < len(tensors) else None
                out.append(_zeros(self.numel, like) if t is None else t.detach().reshape(-1))
            return out
        a, b = self.owned(rank)
        t = tensors[0]
        if b > a:
            out.append(_zeros((b - a) * self.rest, like) if t is None
                       else self.rows_view(t)[a:b].reshape(-1))
        if self.per_rank - (b - a) > 0:
            out.append(_zeros((self.per_rank - (b - a)) * self.rest, like))
        return out

    def copy_pairs(self, rank: int, region: Tensor) -> tuple[list[Tensor], list[Tensor]]:
        """(destinations in the parameters, sources in `region`) for `rank`'s pieces."""
        dst, src = [], []
        view = self.local_view(region)
        if self.kind == "matrices":
            for i, j in enumerate(self.owned(rank)):
                dst.append(self.params[j].detach())
                src.append(view[i])
        else:
            a, b = self.owned(rank)
            if b > a:
                dst.append(self.rows_view(self.params[0])[a:b])
                src.append(view[:b - a])
        return dst, src


def _zeros(n: int, like: Tensor) -> Tensor:
    return torch.zeros(n, device=like.device, dtype=like.dtype)


class _Done:
    def __init__(self, value=None):
        self.value = value

    def wait(self):
        return self.value


class _ReduceScatter:
    def __init__(self, work, out: Tensor, world_size: int, send: Tensor, into: Tensor | None = None):
        self.work, self.out, self.world_size = work, out, world_size
        self.send = send          # the input stays alive until the collective is done
        self.into = into          # where the region goes, when `out` is a view of `send`

    def wait(self) -> Tensor:
        self.work.wait()
        if self.into is not None:
            self.out = self.into.copy_(self.out)
        return self.out.div_(self.world_size)


class _AllGather:
    def __init__(self, work, layout: "ShardLayout", gathered: Tensor, rank: int, send: Tensor):
        self.work, self.layout, self.gathered, self.rank = work, layout, gathered, rank
        self.send = send

    @torch.no_grad()
    def wait(self) -> None:
        self.work.wait()
        regions = self.gathered.view(self.layout.world_size, self.layout.region)
        dst, src = [], []
        for r in range(self.layout.world_size):
            if r == self.rank:        # this rank's pieces were updated in place already
                continue
            for seg in self.layout.segments:
                d, s = seg.copy_pairs(r, regions[r])
                dst += d
                src += s
        if dst:
            torch._foreach_copy_(dst, src)


class ShardLayout:
    """Where each parameter's pieces live in the per-rank regions (see module doc)."""

    def __init__(self, world_size: int):
        self.world_size = world_size
        self.region = 0                          # elements per rank
        self.segments: list[Segment] = []
        self.params: list[Tensor] = []           # in layout order (the order grads are passed in)

    def _add(self, kind: str, params: list[Tensor]) -> Segment:
        if self.params and any(p.dtype != self.params[0].dtype for p in params):
            raise ValueError(f"ShardLayout: all parameters must share one dtype, got "
                             f"{params[0].dtype} and {self.params[0].dtype}")
        if any(not p.is_contiguous() for p in params):
            raise ValueError("ShardLayout: parameters must be contiguous")
        seg = Segment(kind, params, self.region, self.world_size)
        self.region += seg.length
        self.segments.append(seg)
        self.params += params
        return seg

    def add_matrices(self, params: list[Tensor]) -> Segment:
        if len({tuple(p.shape) for p in params}) != 1:
            raise ValueError("ShardLayout.add_matrices: the matrices must share one shape")
        return self._add("matrices", list(params))

    def add_rows(self, param: Tensor) -> Segment:
        return self._add("rows", [param])

    def _pack(self, ranks, tensors: list[Tensor | None], out: Tensor | None = None) -> Tensor:
        like = self.params[0]
        pieces, i = [], 0
        per_seg = []
        for seg in self.segments:
            per_seg.append(tensors[i:i + len(seg.params)])
            i += len(seg.params)
        for r in ranks:
            for seg, ts in zip(self.segments, per_seg):
                pieces += seg.pieces(r, ts, like)
        if not pieces:
            return _zeros(0, like) if out is None else out
        if out is None:
            return torch.cat(pieces)
        # into a buffer that stays put: one multi-tensor copy into its consecutive views (on an
        # H100 ~0.1 ms a step less device time than torch.cat(out=): docs/RESULTS.md, issue 12)
        views, at = [], 0
        for piece in pieces:
            views.append(out[at:at + piece.numel()])
            at += piece.numel()
        if at != out.numel():
            raise ValueError(f"pack: {at} elements of pieces for a buffer of {out.numel()}")
        torch._foreach_copy_(views, pieces)
        return out

    @torch.no_grad()
    def pack_gradients(self, grads: list[Tensor | None], out: Tensor) -> Tensor:
        """One process: copy `grads` (in `self.params` order; None = zeros) into `out`, a buffer of
        `self.region` elements that stays put from step to step (what a captured update reads)."""
        if self.world_size != 1:
            raise RuntimeError("ShardLayout.pack_gradients is for one process; use reduce_scatter")
        return self._pack([0], grads, out)

    @torch.no_grad()
    def reduce_scatter(self, grads: list[Tensor | None], group=None):
        """Average `grads` (in `self.params` order; None = zeros) over ranks. Returns a handle
        whose wait() gives this rank's region (flat, `self.region` elements)."""
        if len(grads) != len(self.params):
            raise ValueError(f"reduce_scatter: {len(grads)} gradients for {len(self.params)} params")
        world_size = world(group)[1]
        if world_size != self.world_size:
            raise RuntimeError(f"ShardLayout built for world size {self.world_size}, "
                               f"process group has {world_size}")
        if world_size == 1:
            return _Done(self._pack([0], grads))
        full = self._pack(range(world_size), grads)               # (world * region,)
        return self._scatter(full, group)

    @torch.no_grad()
    def reduce_scatter_into(self, grads: list[Tensor | None], send: Tensor, out: Tensor,
                            group=None) -> None:
        """`reduce_scatter` into buffers that stay put from step to step (what a captured update
        reads): `grads` packed into `send` (world * region elements), this rank's region of their
        average written into `out` (region elements). The current stream waits for the
        collective; the host does not."""
        world_size = world(group)[1]
        if world_size != self.world_size or world_size == 1:
            raise RuntimeError(f"reduce_scatter_into: a layout of world size {self.world_size} "
                               f"on a process group of {world_size}; one process packs instead")
        self._pack(range(world_size), grads, out=send)
        self._scatter(send, group, into=out).wait()

    def _scatter(self, full: Tensor, group, into: Tensor | None = None) -> _ReduceScatter:
        """Start averaging `full` (world * region elements) over ranks; the handle's wait() gives
        this rank's region, in `into` when it is given."""
        rank, world_size = world(group)
        backend = dist.get_backend(group)
        if not _force_fallback and backend not in _fallback_backends:
            out = into if into is not None else torch.empty(self.region, device=full.device,
                                                            dtype=full.dtype)
            try:
                return _ReduceScatter(_reduce_scatter(out, full, group=group, async_op=True),
                                      out, world_size, full)
            except (RuntimeError, NotImplementedError):
                _fallback_backends.add(backend)
        work = dist.all_reduce(full, group=group, async_op=True)
        mine = full.view(world_size, self.region)[rank]
        return _ReduceScatter(work, mine, world_size, full, into)

    def pack_local(self, rank: int, out: Tensor | None = None) -> Tensor:
        """This rank's pieces of the parameters, flat (what `all_gather` sends)."""
        return self._pack([rank], self.params, out)

    @torch.no_grad()
    def all_gather_from(self, local: Tensor, gathered: Tensor, group=None) -> None:
        """`all_gather` from a buffer the caller packed (`pack_local`) into one that stays put
        (world * region elements), then every other rank's pieces copied into the parameters."""
        self._gather(local, gathered, group).wait()

    @torch.no_grad()
    def all_gather(self, group=None):
        """Send this rank's (already updated) pieces of the parameters to every rank. Returns a
        handle; wait() copies the other ranks' pieces into the parameters."""
        rank, world_size = world(group)
        if world_size == 1:
            return _Done()
        local = self.pack_local(rank)
        gathered = torch.empty(world_size * self.region, device=local.device, dtype=local.dtype)
        return self._gather(local, gathered, group)

    def _gather(self, local: Tensor, gathered: Tensor, group) -> "_AllGather":
        """Start the all-gather of `local` into `gathered`; the handle's wait() unpacks it."""
        rank, world_size = world(group)
        backend = dist.get_backend(group)
        if not _force_fallback and backend not in _fallback_backends:
            try:
                work = _all_gather(gathered, local, group=group, async_op=True)
                return _AllGather(work, self, gathered, rank, local)
            except (RuntimeError, NotImplementedError):
                _fallback_backends.add(backend)
        work = dist.all_gather(list(gathered.view(world_size, self.region).unbind(0)), local,
                               group=group, async_op=True)
        return _AllGather(work, self, gathered, rank, local)


class ShardedPhases:
    """The three phases a sharded optimizer goes through each step, shared by Muon and Adam:
    reduce-scatter the gradients (each rank receives the part it owns), update that part
    (`_update`, the optimizer's own), all-gather. `Optimizers` interleaves them across both.
    Needs `self.layout`, `self.process_group`, `self._pending`, `self._local_grads`."""

    def reduce_gradients(self) -> None:
        """Start averaging the gradients over ranks; each rank receives the part it owns."""
        if self._pending is None and self._local_grads is None:
            self._pending = self.layout.reduce_scatter([p.grad for p in self.layout.params],
                                                       self.process_group)

    def local_gradients(self) -> Tensor:
        """This rank's slice of the averaged gradients, flat (what clipping scales)."""
        self.reduce_gradients()
        if self._pending is not None:
            self._local_grads, self._pending = self._pending.wait(), None
        return self._local_grads

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError(f"{type(self).__name__}.step: closures are not supported")
        self._update()
        self.all_gather().wait()
