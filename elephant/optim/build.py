"""build_optimizers: which parameter goes to which optimizer, and the one object the trainer drives.

Assignment rule (by module type, not by shape, so a 2-D parameter that is not a linear map, such
as the RMT memory `mem_init`, never lands in Muon by accident):
    Muon   the `.weight` of every nn.Linear except the one named `lm_head` (attention q/k/v/o,
           MLP up/gate/down, Mamba in_proj/out_proj); lr muon_lr, weight decay muon_wd.
    Adam   "embed": nn.Embedding weights, lr embed_lr, weight decay adam_wd;
           "head":  lm_head.weight (absent when tied to the embedding), lr head_lr, adam_wd;
           "other": everything else (norm gains, A_log, D, dt_bias, conv1d weights, mem_init,
                    biases), lr adam_lr, no weight decay.
Tied weights appear once (as "embed"). Weight decay is cautious when cfg.cautious_wd.

Trainer protocol, per optimizer step (no DDP wrapper, no other all-reduce):
    opt.set_step(step, total_steps)        # lr / wd / momentum schedules
    ... forward, backward (gradients accumulate in p.grad on every rank) ...
    norm = opt.clip_grad_norm_(cfg.grad_clip)   # optional; 0-d tensor, the global norm
    opt.step()
    opt.zero_grad(set_to_none=True)
The last two lines may be `norm = opt.graphed_step(cfg.grad_clip, backend)`: the same phase with
the update replayed as one CUDA graph (compiled first when a torch.compile backend is given), what
the trainer runs under train.compile=graphs; with a process group the collectives stay outside the
graph (reduce-scatter, the norm's all-reduce and all-gather, three launches each way).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from .adam import Adam
from .dist import world
from .muon import Muon, muon_lr_scale
from .schedule import lr_multiplier, muon_momentum, wd_multiplier


def assign_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter, str, str]]:
    """[(name, param, role, note)] with role muon | embed | head | other, each parameter once."""
    uses: dict[int, list] = {}
    order: list[tuple[str, nn.Parameter]] = []
    for mname, module in model.named_modules():
        for pname, p in module.named_parameters(recurse=False):
            if not p.requires_grad:
                continue
            name = f"{mname}.{pname}" if mname else pname
            if id(p) not in uses:
                uses[id(p)] = []
                order.append((name, p))
            is_weight = pname == "weight"
            if isinstance(module, nn.Embedding) and is_weight:
                kind = "embed"
            elif isinstance(module, nn.Linear) and is_weight:
                kind = "head" if mname.rsplit(".", 1)[-1] == "lm_head" else "muon"
            else:
                kind = "other"
            uses[id(p)].append((name, kind))
    out = []
    for name, p in order:
        kinds = {k for _, k in uses[id(p)]}
        role = next(r for r in ("embed", "head", "muon", "other") if r in kinds)
        tied = [n for n, _ in uses[id(p)] if n != name]
        out.append((name, p, role, f"tied: {', '.join(tied)}" if tied else ""))
    return out


class Optimizers:
    """Muon + Adam behind one interface (see the module doc for the trainer's protocol).

    state_dict(): {"muon": Muon.state_dict() (absent without Muon parameters), "adam": ...}: nested
    dicts of tensors, ints, floats, strings and lists. With a process group each rank's
    state_dict holds only the slice that rank owns (Muon: whole matrices, Adam: dim-0 rows) and
    must be saved per rank and loaded by the same rank of the same world size.
    """

    def __init__(self, muon: Muon | None, adam: Adam | None, cfg, rows: list[tuple],
                 process_group=None):
        self.muon, self.adam, self.cfg, self.rows = muon, adam, cfg, rows
        self.process_group = process_group
        self.optimizers = [o for o in (muon, adam) if o is not None]
        self._graph: dict | None = None  # graphed_step's capture

    def set_step(self, step: int, total_steps: int) -> dict:
        """Apply the lr, wd and momentum schedules for `step`; returns them (for logging)."""
        lr_mult = lr_multiplier(step, total_steps, self.cfg)
        wd_mult = wd_multiplier(step, total_steps, self.cfg)
        momentum = muon_momentum(step, self.cfg)
        for opt in self.optimizers:
            opt.set_schedule(lr_mult, wd_mult, momentum)
        return {"lr_mult": lr_mult, "wd_mult": wd_mult, "momentum": momentum}

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=set_to_none)

    def reduce_gradients(self) -> None:
        """Start the gradient reduce-scatters of both optimizers (step() does it if not done)."""
        for opt in self.optimizers:
            opt.reduce_gradients()

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Global L2 norm of the (rank-averaged) gradient, computed on the reduced shards and
        all-reduced; scales the shards so the norm is at most `max_norm` (max_norm <= 0: only
        measure). Returns the norm before clipping as a 0-d fp32 tensor."""
        self.reduce_gradients()
        return self._clip([opt.local_gradients() for opt in self.optimizers], max_norm)

    def _clip(self, local: list[torch.Tensor], max_norm: float) -> torch.Tensor:
        norm, coef = self._clip_coefficient(local, max_norm)
        if coef is not None:
            for g in local:
                g.mul_(coef.to(g.dtype))
        return norm

    def _clip_coefficient(self, local: list[torch.Tensor], max_norm: float):
        """(the global gradient norm, the factor that clips it to max_norm or None when max_norm
        <= 0), from this rank's gradients `local` (summed over ranks)."""
        sq = self._square_sum(local)
        if world(self.process_group)[1] > 1:
            dist.all_reduce(sq, group=self.process_group)
        return self._norm_and_coefficient(sq, max_norm)

    @staticmethod
    def _square_sum(local: list[torch.Tensor]) -> torch.Tensor:
        """The sum of squares of this rank's gradients (float32, 0-d)."""
        return torch.stack([g.float().square().sum() for g in local]).sum() if local else torch.zeros(())

    @staticmethod
    def _norm_and_coefficient(sq: torch.Tensor, max_norm: float):
        """(the norm, the clipping factor or None when max_norm <= 0) from the global sum of
        squares `sq`."""
        norm = sq.sqrt()
        if max_norm <= 0:
            return norm, None
        return norm, (max_norm / (norm + 1e-6)).clamp(max=1.0)

    @torch.no_grad()
    def step(self) -> None:
        """Reduce-scatter (unless done), update this rank's slices, all-gather."""
        self.reduce_gradients()
        handles = []
        for opt in self.optimizers:
            opt._update()
            handles.append(opt.all_gather())   # Adam's update overlaps Muon's gather
        for h in handles:
            h.wait()

    # -- clipping and both updates replayed as one CUDA graph (run directly on the CPU)
    def graphable(self) -> bool:
        """Whether `graphed_step` can run: parameters to update."""
        return bool(self.optimizers)

    @torch.no_grad()
    def graphed_step(self, max_norm: float, compile_backend: str | None = None) -> torch.Tensor:
        """`clip_grad_norm_(max_norm)` (when max_norm > 0) then `step()`, replayed as one CUDA
        graph: the same arithmetic, and the host queues three things instead of hundreds of
        kernels: the gradients packed into a buffer that stays put, this step's scheduled values
        (`hyper_values`, copied from pinned memory without a wait) and the replay. With a process
        group the collectives run around the graph: each optimizer's gradients are reduce-scattered
        into the buffer it reads, the sum of their squares is all-reduced (when clipping) into a
        tensor it reads, and the graph packs this rank's updated pieces into a buffer that is
        all-gathered, then copied into the parameters: the eager `clip_grad_norm_` + `step`, in
        the same order. On the CPU the same buffers and arithmetic run without a graph (what the
        CPU tests check). Captured on the first call, and again after `load_state_dict` (it replaces
        the state tensors the graph reads) or for another max_norm. Returns the gradient norm
        before clipping (0 when max_norm <= 0: not measured), a copy the next step leaves alone.
        compile_backend: compile the captured update with torch.compile first (inductor fuses
        its many elementwise passes over the parameters and states; the products stay cuBLAS's),
        so it runs the same steps to float32 rounding instead of bit for bit; None: as eager."""
        if not self.graphable():
            raise RuntimeError("Optimizers.graphed_step needs parameters to update")
        g = self._graph
        if g is None or (g["max_norm"], g["backend"]) != (max_norm, compile_backend):
            g = self._graph = self._capture(max_norm, compile_backend)
        group = self.process_group
        for opt, flat, send in zip(self.optimizers, g["flat"], g["send"]):
            grads = [p.grad for p in opt.layout.params]
            if send is None:
                opt.layout.pack_gradients(grads, flat)
            else:
                opt.layout.reduce_scatter_into(grads, send, flat, group)
            opt._pending = opt._local_grads = None
        if g["sq"] is not None:          # several processes, clipping: the global sum of squares
            g["sq"].copy_(self._square_sum(g["flat"]))
            dist.all_reduce(g["sq"], group=group)
        values = torch.tensor([v for opt in self.optimizers for v in opt.hyper_values()],
                              dtype=torch.float32)
        if g["graph"] is None:           # the CPU: the same buffers and arithmetic, run directly
            g["hyper"].copy_(values)
            g["update"]()
        else:
            g["turn"] ^= 1
            host, copied = g["host"][g["turn"]], g["copied"][g["turn"]]
            if not copied.query():       # this buffer's last copy (two steps ago) has not run yet
                copied.synchronize()
            host.copy_(values)
            g["hyper"].copy_(host, non_blocking=True)
            copied.record()
            g["graph"].replay()
        for opt, local, gathered in zip(self.optimizers, g["local"], g["gathered"]):
            if local is not None:
                opt.layout.all_gather_from(local, gathered, group)
        return g["norm"].clone()

    def _capture(self, max_norm: float, backend: str | None) -> dict:
        from ..cudagraph import capture
        like = self.optimizers[0].layout.params[0]
        rank, world_size = world(self.process_group)

        def buffer(n: int) -> torch.Tensor:
            return torch.zeros(n, device=like.device, dtype=like.dtype)
        flats = [buffer(opt.layout.region) for opt in self.optimizers]
        sizes = [opt.n_hyper() for opt in self.optimizers]
        # the warm-up and capture calls read these (sane values: no inf or NaN on the way) and
        # change the parameters and states, which `capture` puts back
        hyper = torch.ones(sum(sizes), device=like.device, dtype=torch.float32)
        norm = torch.zeros((), device=like.device, dtype=torch.float32)
        several = world_size > 1
        # several processes: what the collectives read and write around the graph
        send = [buffer(world_size * opt.layout.region) if several else None for opt in self.optimizers]
        local = [buffer(opt.layout.region) if several else None for opt in self.optimizers]
        gathered = [buffer(world_size * opt.layout.region) if several else None
                    for opt in self.optimizers]
        sq = torch.ones((), device=like.device, dtype=torch.float32) if several and max_norm > 0 else None
        for opt, flat in zip(self.optimizers, flats):
            opt.ensure_state(flat)

        def update():
            grads = flats
            if max_norm > 0:   # the clipped gradients as values, not written back into the buffers
                if sq is None:
                    total, coef = self._clip_coefficient(flats, max_norm)
                else:          # all-reduced before the replay
                    total, coef = self._norm_and_coefficient(sq, max_norm)
                norm.copy_(total)
                grads = [f * coef.to(f.dtype) for f in flats]
            start = 0
            for opt, flat, k in zip(self.optimizers, grads, sizes):
                opt._apply(flat, hyper[start:start + k])
                start += k
            for opt, out in zip(self.optimizers, local):
                if out is not None:   # this rank's updated pieces, for the all-gather
                    opt.layout.pack_local(rank, out)

        if backend is not None:
            update = torch.compile(update, fullgraph=True, dynamic=False, backend=backend)
        out = {"graph": None, "update": update, "flat": flats, "hyper": hyper, "norm": norm,
               "max_norm": max_norm, "backend": backend, "send": send, "local": local,
               "gathered": gathered, "sq": sq}
        if not like.is_cuda:
            return out
        state = [p.detach() for opt in self.optimizers for p in opt.layout.params]
        state += [t for opt in self.optimizers for t in opt.state_tensors()]
        out["graph"], _ = capture(update, state, error_mode="thread_local" if several else "global")
        out.update(host=[torch.empty(len(hyper), dtype=torch.float32, pin_memory=True)
                         for _ in range(2)],
                   copied=[torch.cuda.Event() for _ in range(2)], turn=0)
        return out

    def state_dict(self) -> dict:
        sd = {"format": "elephant.optim/1"}
        if self.muon is not None:
            sd["muon"] = self.muon.state_dict()
        if self.adam is not None:
            sd["adam"] = self.adam.state_dict()
        return sd

    def load_state_dict(self, sd: dict) -> None:
        for key, opt in (("muon", self.muon), ("adam", self.adam)):
            if (opt is None) != (key not in sd):
                raise ValueError(f"Optimizers.load_state_dict: the checkpoint "
                                 f"{'has' if key in sd else 'lacks'} a {key} state, this model "
                                 f"{'does not use' if opt is None else 'uses'} {key}")
            if opt is not None:
                opt.load_state_dict(sd[key])
        self._graph = None               # the captured step read the states just replaced

    def table(self) -> str:
        """One line per parameter: name, shape, optimizer, group, lr, weight decay, notes."""
        header = ("parameter", "shape", "optimizer", "lr", "wd", "notes")
        lines = [header]
        counts = {"Muon": 0, "Adam": 0}
        for name, p, role, note, lr, wd in self.rows:
            opt = "Muon" if role == "muon" else f"Adam/{role}"
            if role == "muon":
                scale = muon_lr_scale(*p.shape)
                note = (f"lr x {scale:.3g} (rows/cols {p.shape[0]}/{p.shape[1]})"
                        + (f"; {note}" if note else ""))
            counts["Muon" if role == "muon" else "Adam"] += p.numel()
            lines.append((name, "x".join(map(str, p.shape)) or "scalar", opt, f"{lr:g}", f"{wd:g}", note))
        widths = [max(len(r[i]) for r in lines) for i in range(len(header) - 1)]
        text = ["  ".join(c.ljust(w) for c, w in zip(r[:-1], widths)) + "  " + r[-1] for r in lines]
        c = self.cfg
        text.append(f"Muon {counts['Muon']:,} params ({c.orthogonalize}, normuon={c.normuon}), "
                    f"Adam {counts['Adam']:,} params; cautious wd={c.cautious_wd}; "
                    f"world size {world(self.process_group)[1]}")
        return "\n".join(text)


def build_optimizers(model: nn.Module, cfg, process_group=None,
                     ortho_dtype: torch.dtype | None = None) -> Optimizers:
    """Muon for hidden linear weights, Adam for the rest (rule in the module doc).

    cfg: an OptimConfig. process_group: None = the default group when torch.distributed is
    initialized, else local. ortho_dtype: Muon's iteration dtype (default bf16 on CUDA, fp32 on CPU).
    """
    cautious = bool(getattr(cfg, "cautious_wd", True))
    groups = {"muon": ([], []), "embed": ([], []), "head": ([], []), "other": ([], [])}
    hyper = {"muon": (cfg.muon_lr, cfg.muon_wd), "embed": (cfg.embed_lr, cfg.adam_wd),
             "head": (cfg.head_lr, cfg.adam_wd), "other": (cfg.adam_lr, 0.0)}
    rows = []
    for name, p, role, note in assign_parameters(model):
        groups[role][0].append(p)
        groups[role][1].append(name)
        rows.append((name, p, role, note, *hyper[role]))
    muon = None
    if groups["muon"][0]:
        params, names = groups["muon"]
        muon = Muon([{"params": params, "names": names}], lr=cfg.muon_lr,
                    momentum=muon_momentum(0, cfg), nesterov=cfg.nesterov,
                    weight_decay=cfg.muon_wd, cautious=cautious, normuon=cfg.normuon,
                    beta2=cfg.normuon_beta2, orthogonalize=cfg.orthogonalize,
                    ns_steps=cfg.ns_steps, ortho_dtype=ortho_dtype,
                    gram=getattr(cfg, "muon_gram", "matmul"), process_group=process_group)
    adam_groups = [{"params": groups[r][0], "names": groups[r][1], "lr": hyper[r][0],
                    "weight_decay": hyper[r][1], "role": r}
                   for r in ("embed", "head", "other") if groups[r][0]]
    adam = None
    if adam_groups:
        adam = Adam(adam_groups, betas=tuple(cfg.adam_betas), eps=cfg.adam_eps, cautious=cautious,
                    process_group=process_group)
    return Optimizers(muon, adam, cfg, rows, process_group)
