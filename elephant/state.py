"""RecurrentState: everything a lane carries from one chunk of its document to the next.

Per lane (batch row) it holds the rotary position reached in the current document, every
attention layer's window of cached keys/values (and its kept tokens, model.kv_keep), every Mamba-2
layer's conv and SSM state (and every gated delta rule layer's conv state and S, in the same two
lists), and the RMT read memory. Shapes are fixed at creation (the KV window
has `kv_window` slots whether they are filled or not, with a validity mask), so a compiled model
never sees a new shape.

The state is a plain container of tensors. `reset(lanes)` and `detach()` swap in new tensors rather
than writing into the old ones, so a state that is part of an autograd graph stays valid.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch
from torch import Tensor


@dataclass
class KVCache:
    k: Tensor       # (B, H, W, hd) rotated keys, oldest first
    v: Tensor       # (B, H, W, hd)
    # (B, W) bool: slots that hold a key of the lane's current document; always the window's last
    # slots (a suffix), which attention's varlen path relies on (tests/test_packing.py holds it)
    valid: Tensor
    # long-term kept tokens (model.kv_keep = K > 0, else None): keys before rotary (they are
    # rotated at a position relative to the chunk that reads them), values, the layer's normalized
    # input (the learned keep score is computed from it with gradient, see Attention.keep_score),
    # positions in the document, and which of the K slots hold a token of the lane's document
    keep_k: Tensor | None = None      # (B, H, K, hd)
    keep_v: Tensor | None = None      # (B, H, K, hd)
    keep_x: Tensor | None = None      # (B, K, D)
    keep_pos: Tensor | None = None    # (B, K) int64
    keep_valid: Tensor | None = None  # (B, K) bool
    # the associative memory (model.kv_assoc, else None; layers/assoc.py): the window's keys before
    # rotary and keep scores (written to S when they leave it), and S in float32
    raw_k: Tensor | None = None       # (B, H, W, hd)
    score: Tensor | None = None       # (B, W) float32
    assoc: Tensor | None = None       # (B, H, hd, hd)

    NAMES = ("k", "v", "valid", "keep_k", "keep_v", "keep_x", "keep_pos", "keep_valid", "raw_k",
             "score", "assoc")

    def fields(self) -> dict[str, Tensor]:
        """name -> tensor of every field in use."""
        return {n: getattr(self, n) for n in self.NAMES if getattr(self, n) is not None}

    def map(self, fn) -> "KVCache":
        return replace(self, **{n: fn(t) for n, t in self.fields().items()})

    def append(self, k: Tensor, v: Tensor, new_valid: Tensor | None = None,
               keep: Tensor | None = None, raw_k: Tensor | None = None,
               score: Tensor | None = None, writes: int = 0) -> "KVCache":
        """The window after this chunk: the last W of [cache | new keys]. No gradient is kept.
        The kept tokens are carried unchanged (see `with_kept`).

        Packed documents: `new_valid` (B, S_new) marks the new keys of the lane's current (last)
        document, `keep` (B,) whether the cached keys still belong to it (all valid / kept: None).
        With the associative memory (`assoc`): `raw_k` (B, H, S_new, hd) the new keys before
        rotary and `score` (B, S_new) their keep scores; the S_new oldest of [cache | new], the
        tokens leaving the window, are written to it in order (layers/assoc.py), those of the
        lane's document alone, after a memory whose document ended (`keep` false) is cleared;
        `writes` > 0: only that many of them a lane, those of highest keep score, in their order
        (model.kv_assoc_writes)."""
        W = self.k.shape[2]
        k = torch.cat([self.k, k.detach().to(self.k.dtype)], dim=2)
        v = torch.cat([self.v, v.detach().to(self.v.dtype)], dim=2)
        old = self.valid if keep is None else self.valid & keep[:, None]
        fresh = (torch.ones_like(self.valid[:, :1]).expand(-1, k.shape[2] - W) if new_valid is None
                 else new_valid)                                              # (B, S_new)
        both = torch.cat([old, fresh], dim=1)
        valid = both[:, -W:]
        out = replace(self, k=k[:, :, -W:].contiguous(), v=v[:, :, -W:].contiguous(),
                      valid=valid.contiguous())
        if self.assoc is None:
            return out
        if raw_k is None or score is None:
            raise ValueError("KVCache.append: a cache with an associative memory needs the new "
                             "keys before rotary (raw_k) and their keep scores (score)")
        from .layers.assoc import assoc_write
        n = k.shape[2] - W                                                    # tokens leaving
        raw = torch.cat([self.raw_k, raw_k.detach().to(self.raw_k.dtype)], dim=2)
        scores = torch.cat([self.score, score.detach().to(self.score.dtype)], dim=1)
        S = self.assoc if keep is None else torch.where(keep[:, None, None, None], self.assoc, 0.0)
        beta = torch.sigmoid(scores[:, :n]) * both[:, :n]
        ek, ev = raw[:, :, :n], v[:, :, :n]
        if 0 < writes < n:   # the best `writes` by keep score, written in their order
            rank = torch.where(both[:, :n], scores[:, :n], float("-inf"))
            pick = rank.topk(writes, dim=1).indices.sort(dim=1).values          # (B, writes)
            beta = beta.gather(1, pick)
            idx = pick[:, None, :, None].expand(-1, ek.shape[1], -1, ek.shape[3])
            ek, ev = ek.gather(2, idx), ev.gather(2, idx)
        return replace(out, raw_k=raw[:, :, -W:].contiguous(), score=scores[:, -W:].contiguous(),
                       assoc=assoc_write(S, ek, ev, beta))

    def with_kept(self, k: Tensor, v: Tensor, x: Tensor, pos: Tensor, valid: Tensor,
                  score: Tensor, keep: Tensor | None = None) -> "KVCache":
        """The kept tokens after this chunk: the K best by `score` among the kept ones and the
        chunk's candidates. k, v (B, H, T, hd) unrotated keys and values of the chunk's tokens,
        x (B, T, D) their inputs, pos (B, T) positions, valid (B, T) the candidates (tokens of the
        lane's current document), score (B, K + T) of [kept | candidates], e.g. with exploration
        noise, `keep` (B,) whether the kept tokens still belong to the lane's document (packed:
        false where a document began in the chunk; None: all do). No gradient is kept; a slot
        left without a valid token is invalid."""
        K = self.keep_k.shape[2]
        with torch.no_grad():
            old = self.keep_valid if keep is None else self.keep_valid & keep[:, None]
            ok = torch.cat([old, valid], dim=1)                                 # (B, K + T)
            best = torch.where(ok, score.float(), float("-inf")).topk(K, dim=1).indices  # (B, K)

            def pick(old: Tensor, new: Tensor) -> Tensor:
                """The chosen entries of [old | new] along the token axis (2 for (B, H, n, hd),
                else 1)."""
                axis = 2 if old.dim() == 4 else 1
                both = torch.cat([old, new.detach().to(old.dtype)], dim=axis)
                idx = best[:, None, :, None] if axis == 2 else best.view(*best.shape, *[1] * (old.dim() - 2))
                shape = list(both.shape)
                shape[axis] = K
                return both.gather(axis, idx.expand(shape))
            return replace(self, keep_k=pick(self.keep_k, k), keep_v=pick(self.keep_v, v),
                           keep_x=pick(self.keep_x, x), keep_pos=pick(self.keep_pos, pos),
                           keep_valid=ok.gather(1, best))


@dataclass
class RecurrentState:
    pos: Tensor                                       # (B,) int64 tokens of the document seen so far
    kv: list[KVCache | None] = field(default_factory=list)      # one per layer (None: M, D / no cache)
    # per Mamba-2 (M) and gated delta rule (D) layer: the conv state (B, conv_dim, d_conv - 1) and
    # the recurrent state in float32, (B, H, P, N) for M, S (B, H, dk, dv) for D
    conv: list[Tensor | None] = field(default_factory=list)
    ssm: list[Tensor | None] = field(default_factory=list)
    memory: Tensor | None = None                      # (B, n_mem, D) read memory of the next chunk
    chunks: int = 0                                   # chunks processed since the last detach
    # Memory-only backpropagation (training only; never saved): `memory_path` has the value of
    # `memory` but its graph runs through the memory updates alone (the write slots' outputs
    # detached), across every detach since `track_memory_path()`; `links` pairs each detach's
    # path tensor with the leaf the next chunks read, for `backward_memory_path()`.
    memory_path: Tensor | None = None
    links: list = field(default_factory=list)
    # Packed documents (training and evaluation; never saved): the initial memory's prefix
    # (`ElephantLM.init_prefix`) that the first chunk with an inner start computed, for the later
    # chunks of the same backpropagated window. A detach or a clone drops it (the parameters may
    # change before the next window), so it never outlives the graph it was computed in.
    prefix: list | None = None

    @property
    def lanes(self) -> int:
        return self.pos.shape[0]

    def tensors(self) -> dict[str, Tensor]:
        """Flat name -> tensor view of the state (for checkpoints and moves)."""
        out = {"pos": self.pos}
        for i, c in enumerate(self.kv):
            if c is not None:
                out |= {f"kv.{i}.{n}": t for n, t in c.fields().items()}
        for name in ("conv", "ssm"):
            for i, t in enumerate(getattr(self, name)):
                if t is not None:
                    out[f"{name}.{i}"] = t
        if self.memory is not None:
            out["memory"] = self.memory
        return out

    def _map(self, fn) -> "RecurrentState":
        return RecurrentState(
            pos=fn(self.pos),
            kv=[None if c is None else c.map(fn) for c in self.kv],
            conv=[None if t is None else fn(t) for t in self.conv],
            ssm=[None if t is None else fn(t) for t in self.ssm],
            memory=None if self.memory is None else fn(self.memory),
            chunks=self.chunks,
        )

    def with_tensors(self, tensors: list[Tensor]) -> "RecurrentState":
        """The same structure over `tensors`, in the order of `tensors()` (the same chunk count;
        no memory path or prefix, as `clone`)."""
        it = iter(tensors)
        state = self._map(lambda _: next(it))
        if next(it, None) is not None:
            raise ValueError("with_tensors: more tensors than the state has")
        return state

    def clone(self) -> "RecurrentState":
        """A copy of every tensor (the same chunk count; no memory path): for a state carried past
        a CUDA-graph step, whose outputs the next replay may overwrite."""
        return self._map(torch.clone)

    def detach(self) -> "RecurrentState":
        """Cut the gradient path into earlier chunks (truncated backpropagation through time).

        With a tracked memory path (`track_memory_path`), the path is kept: the next chunks read
        the memory as a fresh leaf, and the gradient that collects there is carried on through
        the earlier memory updates by `backward_memory_path`."""
        state = self._map(Tensor.detach)
        state.chunks = 0
        if self.memory_path is not None:
            state.memory = state.memory.requires_grad_()
            state.memory_path = self.memory_path
            state.links = self.links + [(self.memory_path, state.memory)]
        return state

    def track_memory_path(self) -> "RecurrentState":
        """Start memory-only backpropagation from here (see `memory_path`): from now on a detach
        cuts the activations but not the chain of memory updates. Returns self."""
        if self.memory is not None and self.memory_path is None:
            self.memory_path = self.memory
        return self

    def backward_memory_path(self) -> int:
        """Carry the gradient that reached each detach's memory leaf back along the memory path
        (to the gates that let earlier chunks write, and to the initial memory), after the
        backward passes of all the windows. Accumulates into the parameters' .grad like any
        backward; returns the number of links that carried a gradient. Clears the links."""
        roots, grads = [], []
        for path, leaf in self.links:
            if leaf.grad is not None and path.requires_grad:
                roots.append(path)
                grads.append(leaf.grad)
        if roots:
            torch.autograd.backward(roots, grads)
        self.links = []
        return len(roots)

    def to(self, device=None, dtype=None) -> "RecurrentState":
        """Move to a device; `dtype` applies to floating tensors except the float32 SSM state."""
        def move(t: Tensor) -> Tensor:
            if dtype is not None and t.is_floating_point():
                return t.to(device=device, dtype=dtype)
            return t.to(device=device)
        state = self._map(move)
        state.ssm = [None if t is None else t.to(device=device) for t in self.ssm]
        state.kv = [c if c is None or c.assoc is None else
                    replace(c, assoc=o.assoc.to(device=device), score=o.score.to(device=device))
                    for c, o in zip(state.kv, self.kv)]
        return state

    def select(self, lanes: Tensor | slice) -> "RecurrentState":
        """The state of a subset of lanes (a view for slices)."""
        return self._map(lambda t: t[lanes])

    @staticmethod
    def cat(states: list["RecurrentState"]) -> "RecurrentState":
        """Stack the lanes of several states (the inverse of `select` over a partition)."""
        def join(get):
            parts = [get(s) for s in states]
            return None if parts[0] is None else torch.cat(parts)
        first = states[0]
        return RecurrentState(
            pos=join(lambda s: s.pos),
            kv=[None if c is None else KVCache(**{n: join(lambda s: getattr(s.kv[i], n))
                                                  for n in c.fields()})
                for i, c in enumerate(first.kv)],
            conv=[join(lambda s: s.conv[i]) for i in range(len(first.conv))],
            ssm=[join(lambda s: s.ssm[i]) for i in range(len(first.ssm))],
            memory=join(lambda s: s.memory),
            chunks=first.chunks,
        )

    def reset(self, lanes: Tensor, init_memory: Tensor | None = None) -> "RecurrentState":
        """Clear the lanes where `lanes` (B,) is true: a new document starts there.

        Cache slots become invalid, conv/SSM state zero, the position 0 and the read memory the
        learned initial memory (`init_memory`, (n_mem, D)) with its gradient.
        """
        lanes = lanes.to(device=self.pos.device, dtype=torch.bool)
        keep = ~lanes

        def clear(t: Tensor) -> Tensor:
            mask = keep.view(-1, *([1] * (t.dim() - 1)))
            return torch.where(mask, t, torch.zeros((), dtype=t.dtype, device=t.device))

        state = self._map(clear)
        if self.memory is not None and init_memory is not None:
            mask = keep.view(-1, 1, 1)
            state.memory = torch.where(mask, self.memory, init_memory.to(self.memory.dtype).unsqueeze(0))
            if self.memory_path is not None:
                state.memory_path = torch.where(mask, self.memory_path,
                                                init_memory.to(self.memory_path.dtype).unsqueeze(0))
        state.links = self.links
        return state

    def state_dict(self) -> dict[str, Tensor]:
        return {k: t.detach().cpu().clone() for k, t in self.tensors().items()} | {
            "chunks": torch.tensor(self.chunks)}

    def load_state_dict(self, tensors: dict[str, Tensor]) -> None:
        mine = self.tensors()
        missing = sorted(set(mine) - set(tensors))
        extra = sorted(set(tensors) - set(mine) - {"chunks"})
        if missing or extra:
            raise ValueError(f"recurrent state does not match the model: missing {missing[:3]}, "
                             f"unexpected {extra[:3]}")
        for k, t in mine.items():
            if tensors[k].shape != t.shape:
                raise ValueError(f"recurrent state {k}: expected shape {tuple(t.shape)}, "
                                 f"got {tuple(tensors[k].shape)}")
        self.pos = tensors["pos"].to(self.pos.device)
        for i, c in enumerate(self.kv):
            if c is not None:
                self.kv[i] = KVCache(**{n: tensors[f"kv.{i}.{n}"].to(t.device, t.dtype)
                                        for n, t in c.fields().items()})
        for name in ("conv", "ssm"):
            seq = getattr(self, name)
            for i, t in enumerate(seq):
                if t is not None:
                    seq[i] = tensors[f"{name}.{i}"].to(t.device, t.dtype)
        if self.memory is not None:
            self.memory = tensors["memory"].to(self.memory.device, self.memory.dtype)
        if "chunks" in tensors:
            self.chunks = int(tensors["chunks"])


# The parts of a lane's state that carry context from chunk to chunk, as `drop_parts` names them
# (eval.py --drop, elephant.recall eval --ablate): the attention KV window, the kept tokens, the
# attention's associative memory (model.kv_assoc: it is written with what leaves the window, so a
# dropped window also leaves it nothing to write), the RMT memory, every Mamba-2 and gated delta
# rule (D) layer's conv and recurrent state (ssm), and the D layers' alone (delta)
CARRIED_PARTS = ("window", "kept", "assoc", "memory", "ssm", "delta")
PART_ALIASES = {"kv": "window", "keep": "kept", "mamba": "ssm"}


def parse_parts(text: str, flag: str = "--drop") -> tuple[str, ...]:
    """'memory,kept' -> ('memory', 'kept'): the carried parts a user names (CARRIED_PARTS or an
    alias of PART_ALIASES; '' or 'none': none), each once, in CARRIED_PARTS' order. A bad name is
    a ConfigError naming `flag` and the accepted names."""
    from .config import ConfigError
    names = [t.strip().lower() for t in str(text).split(",") if t.strip()]
    if names == ["none"]:
        return ()
    parts = set()
    for name in names:
        part = PART_ALIASES.get(name, name)
        if part not in CARRIED_PARTS:
            raise ConfigError(f"{flag} {text}: unknown part {name!r}; expected a comma-separated "
                              f"list of {', '.join(CARRIED_PARTS)} (or none)")
        parts.add(part)
    return tuple(p for p in CARRIED_PARTS if p in parts)


def carried_parts(cfg) -> tuple[str, ...]:
    """The parts of CARRIED_PARTS a model of config `cfg` (ModelConfig) carries from chunk to
    chunk: a window where an attention layer has kv_window > 0, kept tokens where kv_keep > 0, the
    memory where n_mem > 0, ssm where a Mamba-2 or delta rule layer is, delta where a D layer is."""
    has = {"window": "A" in cfg.layers and cfg.kv_window > 0,
           "kept": "A" in cfg.layers and cfg.kv_keep > 0,
           "assoc": "A" in cfg.layers and cfg.kv_keep > 0 and cfg.kv_assoc,
           "memory": cfg.n_mem > 0,
           "ssm": any(k in cfg.layers for k in "MD"),
           "delta": "D" in cfg.layers}
    return tuple(p for p in CARRIED_PARTS if has[p])


def check_parts(parts, cfg, flag: str = "--drop") -> None:
    """A ConfigError naming `flag` where a part of `parts` is one the model does not carry
    (dropping it would measure nothing: its figures equal the carried run's)."""
    from .config import ConfigError
    carried = carried_parts(cfg)
    missing = [p for p in parts if p not in carried]
    if missing:
        raise ConfigError(f"{flag} {','.join(parts)}: this model carries no {', no '.join(missing)} "
                          f"(model.layers={cfg.layers!r}, n_mem={cfg.n_mem}, kv_window="
                          f"{cfg.kv_window}, kv_keep={cfg.kv_keep}); it carries "
                          f"{', '.join(carried) or 'nothing'}")


def drop_parts(state: "RecurrentState", parts, init_memory: Tensor | None = None,
               layers: str | None = None) -> "RecurrentState":
    """`state` with the carried `parts` (CARRIED_PARTS) cleared in every lane as a new document
    clears them (`RecurrentState.reset`: an empty window, no kept tokens, an empty associative
    memory, the initial memory `init_memory`, zero Mamba and delta rule state), the rest and the
    positions kept: what one part carries from chunk to chunk is what its loss or recall loses
    when it is dropped after every chunk. `layers`: the model's layer letters (cfg.layers), which "delta" needs to find the D
    layers."""
    if not parts:
        return state
    cleared = state.reset(torch.ones(state.lanes, dtype=torch.bool, device=state.pos.device),
                          init_memory)
    out = RecurrentState(pos=state.pos, kv=list(state.kv), conv=list(state.conv),
                         ssm=list(state.ssm), memory=state.memory, chunks=state.chunks)
    if "memory" in parts and state.memory is not None and init_memory is not None:
        out.memory = cleared.memory
    fields = (("k", "v", "valid") if "window" in parts else ()) + (
        ("keep_valid",) if "kept" in parts else ()) + (("assoc",) if "assoc" in parts else ())
    if fields:
        out.kv = [None if c is None else
                  replace(c, **{n: getattr(e, n) for n in fields if getattr(c, n) is not None})
                  for c, e in zip(state.kv, cleared.kv)]
    if "ssm" in parts:
        out.conv, out.ssm = cleared.conv, cleared.ssm
    elif "delta" in parts:
        if layers is None or len(layers) != len(state.conv):
            raise ValueError(f"drop_parts: dropping 'delta' needs the model's layers (one letter "
                             f"per layer, {len(state.conv)}), got {layers!r}")
        out.conv = [c if kind == "D" else t for t, c, kind in zip(state.conv, cleared.conv, layers)]
        out.ssm = [c if kind == "D" else t for t, c, kind in zip(state.ssm, cleared.ssm, layers)]
    return out


def fresh_state(cfg, blocks, batch: int, device, dtype, kv_dtype,
                mem_init: Tensor | None = None) -> RecurrentState:
    """ElephantLM.init_state's work (the arguments are told there): every lane at a document's
    start, in the layout of `blocks` (each Mamba or delta rule block's mixer makes its zero conv
    and recurrent state, each attention layer an empty window of kv_window slots and kv_keep kept tokens) and
    the read memory `mem_init` (n_mem, D) in every lane."""
    state = RecurrentState(pos=torch.zeros(batch, dtype=torch.long, device=device))
    for block in blocks:
        if block.recurrent:
            conv, ssm = block.mixer.init_state(batch, device, dtype)
            state.kv.append(None)
            state.conv.append(conv)
            state.ssm.append(ssm)
        else:
            state.conv.append(None)
            state.ssm.append(None)
            if cfg.kv_window:
                H, hd, K = cfg.n_heads, cfg.head_dim, cfg.kv_keep
                kept = {} if not K else dict(
                    keep_k=torch.zeros(batch, H, K, hd, device=device, dtype=dtype),
                    keep_v=torch.zeros(batch, H, K, hd, device=device, dtype=dtype),
                    keep_x=torch.zeros(batch, K, cfg.d_model, device=device, dtype=dtype),
                    keep_pos=torch.zeros(batch, K, dtype=torch.long, device=device),
                    keep_valid=torch.zeros(batch, K, dtype=torch.bool, device=device))
                if K and cfg.kv_assoc:
                    from .layers.assoc import state_dtype
                    kept |= dict(
                        raw_k=torch.zeros(batch, H, cfg.kv_window, hd, device=device, dtype=kv_dtype),
                        score=torch.zeros(batch, cfg.kv_window, device=device, dtype=torch.float32),
                        assoc=torch.zeros(batch, H, hd, hd, device=device, dtype=state_dtype(dtype)))
                state.kv.append(KVCache(
                    k=torch.zeros(batch, H, cfg.kv_window, hd, device=device, dtype=kv_dtype),
                    v=torch.zeros(batch, H, cfg.kv_window, hd, device=device, dtype=kv_dtype),
                    valid=torch.zeros(batch, cfg.kv_window, dtype=torch.bool, device=device),
                    **kept))
            else:
                state.kv.append(None)
    if mem_init is not None:
        state.memory = mem_init.detach().to(device, dtype).unsqueeze(0).expand(batch, -1, -1).clone()
    return state


class StaticCarry:
    """The state that one CUDA-graph training step hands to the next, kept in buffers whose
    addresses never change.

    A graph replay copies every input it was not told is static into a placeholder of its own, and
    its outputs live in its memory pool, which the next step's replay overwrites. So a state carried
    by `clone()` is copied twice a step: out of the pool (a launch per tensor, 21 for the 70M
    recipe's state), then into the next replay's placeholders. Here the step's last state is copied
    once, into these buffers (one multi-tensor copy per dtype), and the next step's first chunk
    reads them where they are: they are marked as static inputs
    (torch._dynamo.mark_static_address, unguarded), so its graph is traced without placeholders
    for them and its replays copy nothing. The buffers are only read by the graphs, never written,
    and the trainer writes them after the step's backward is queued, which still reads the old values
    it saved (the stream orders the two).

    One carry serves one sequence of steps on one set of lanes (a second set fed through the same
    graphs would move their static inputs, and each move re-records the graph)."""

    def __init__(self):
        self.buffers: list[Tensor] | None = None

    def _fit(self, tensors: list[Tensor]) -> None:
        """(Re)allocate the buffers when they do not match `tensors` (first use, another model)."""
        if self.buffers is not None and len(self.buffers) == len(tensors) and all(
                b.shape == t.shape and b.dtype == t.dtype and b.device == t.device
                for b, t in zip(self.buffers, tensors)):
            return
        import torch._dynamo
        self.buffers = [torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in tensors]
        for b in self.buffers:
            torch._dynamo.mark_static_address(b, guard=False)

    def _copy_in(self, tensors: list[Tensor]) -> None:
        by_dtype: dict = {}
        for b, t in zip(self.buffers, tensors):
            if t.data_ptr() == b.data_ptr() and t.stride() == b.stride():
                continue   # the buffer itself (or a detached view of it): already in place
            t = t.detach()
            if t.untyped_storage().data_ptr() == b.untyped_storage().data_ptr():
                t = t.clone()   # another view of the buffer: read it before it is overwritten
            dst, src = by_dtype.setdefault(t.dtype, ([], []))
            dst.append(b)
            src.append(t)
        with torch.no_grad():
            for dst, src in by_dtype.values():
                torch._foreach_copy_(dst, src)

    def take(self, state: RecurrentState) -> RecurrentState:
        """`state` over the buffers: its values copied in unless they are there already. The
        trainer takes the state a step starts from (after the first step, the buffers themselves
        or a detached view of them: nothing to copy) and the state it ends with (in the graphs'
        memory). The state returned has no gradient path, memory path or prefix (as `clone`)."""
        tensors = list(state.tensors().values())
        self._fit(tensors)
        self._copy_in(tensors)
        return state.with_tensors(self.buffers)


def backprop_windows(state: RecurrentState, windows: list, run_window, memory_path: bool = False):
    """Truncated BPTT over consecutive windows: `run_window(window, state) -> (state, loss)` runs
    the forward and backward pass of one window; the state is detached between windows. With
    `memory_path` (and memory), the chain of memory updates is kept across the detaches and
    backpropagated once every window's backward is done (memory-only backpropagation, see
    `RecurrentState.track_memory_path`). Returns (the state after the last window, detached; the
    windows' losses)."""
    if memory_path:
        state.memory_path, state.links = None, []
        state = state.detach().track_memory_path()
    losses = []
    for i, window in enumerate(windows):
        if i:
            state = state.detach()
        state, loss = run_window(window, state)
        losses.append(loss)
    if memory_path:   # the later windows' gradient, back through the memory updates
        state.backward_memory_path()
    state.memory_path = None
    return state.detach(), losses

