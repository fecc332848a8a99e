"""ElephantLM: a hybrid Mamba-2 / attention language model that reads documents chunk by chunk.

    model(tokens[B, T], state, reset[B]) -> (logits[B, T, V] or loss, new_state)

Each layer is a pre-norm residual block: a mixer (Mamba-2 or attention, by the letters of
`cfg.layers`) followed by an elephant-gated GLU MLP. With `n_mem > 0` every chunk is framed as
[read memory (n_mem) | tokens (T) | write slots (n_mem)] (recurrent memory transformer, Bulatov et
al. 2022). What the write slots produce becomes the next chunk's read memory through a gated update
(`update_memory`): each slot keeps its content unless its gate opens, and a gate under
`mem_gate_min` is exactly zero, so a slot whose gate stays shut carries its content through any
number of chunks bit for bit (the plain RMT rewrite, `mem_update="replace"`, re-encodes the whole
memory through the network at every chunk). How far trained gates do stay shut is measured in
docs/RESULTS.md. Attention layers see the previous
`kv_window` keys of the lane's document (no gradient through them), and with `kv_keep` > 0 the keys
and values of up to kv_keep earlier tokens kept past the window: at every chunk's end each attention
layer keeps the best-scored of its kept tokens and the chunk's tokens (a learned linear score of the
token's input, with exploration noise in training), so a token worth keeping is carried bit for bit
until better ones displace it; it is read as if it stood just before the window, whatever its age,
and its value is scaled by sigmoid(score), which is where the score learns. Mamba-2 layers start
from the lane's carried conv and SSM state. Gradients flow through memory and SSM state for
`bptt_chunks` chunks: a state that has been through that many chunks is detached before the next
one. With memory-only backpropagation (`RecurrentState.track_memory_path`) the chain of memory
updates is kept across those detaches: a gradient that reaches a chunk's read memory travels on
to every earlier gate (and through each shut gate unchanged), at the cost of a few (B, n_mem, D)
tensors per chunk, not of the chunks' activations.
"""
from __future__ import annotations

import functools
import math

import torch
from torch import Tensor, nn

from .config import ModelConfig
from .layers.attention import Attention, segment_room
from .layers.elephant import ElephantMLP
from .layers.head import cross_entropy_reference, linear_cross_entropy
from .layers.mamba import Mamba2
from .state import KVCache, RecurrentState


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, kind: str):
        super().__init__()
        self.kind = kind
        self.norm1 = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.mixer = Mamba2(cfg) if kind == "M" else Attention(cfg)
        self.norm2 = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps) if cfg.d_mlp else None
        self.mlp = ElephantMLP(cfg) if cfg.d_mlp else None

    def forward(self, x: Tensor, pos: Tensor, layer_state: tuple, seg: Tensor | None = None,
                init: tuple | None = None, start: Tensor | None = None,
                free: Tensor | None = None, room: int = 0,
                layouts: dict | None = None) -> tuple[Tensor, tuple]:
        """seg (B, S) segment ids of packed documents (None: one document per lane) and init the
        initial-memory prefix's state of this layer for segments > 0 (Mamba: (conv tail, SSM state);
        attention: (k, v)), see ElephantLM.forward. `start` (B,): the position of the chunk's first
        token in the lane's carried document (for kept tokens). `free` (S,) bool: the memory
        tokens, scored without rotary by attention (mem_rotary "free"). The new state of an
        attention layer is (k, v), with kept tokens (k, v, keys before rotary, the normalized
        input). `room`: how many documents may start inside the chunk for attention's
        variable-length kernel (0: none; see attention.SEGMENT_ROOM); `layouts`: that kernel's
        layout, shared by the chunk's attention layers (attention.attend_segments_varlen)."""
        h = self.norm1(x)
        if self.kind == "M":
            conv, ssm = layer_state
            if seg is None:
                h, conv, ssm = self.mixer(h, conv, ssm)
            else:
                h, conv, ssm = self.mixer(h, conv, ssm, seg=seg, init=init)
            new_state = (conv, ssm)
        else:
            cache: KVCache | None = layer_state
            extra = {} if seg is None else dict(seg=seg, prefix_k=init and init[0],
                                                 prefix_v=init and init[1], room=room,
                                                 layouts=layouts)
            if free is not None:
                extra["free"] = free
            if cache is None:
                h, k, v = self.mixer(h, pos, **extra)
                new_state = (k, v)
            elif cache.keep_k is None:
                h, k, v = self.mixer(h, pos, cache.k, cache.v, cache.valid, **extra)
                new_state = (k, v)
            else:
                inp = h
                h, k, v, k_raw = self.mixer(inp, pos, cache.k, cache.v, cache.valid, kept=cache,
                                            start=start, **extra)
                new_state = (k, v, k_raw, inp)
        x = x + h
        if self.mlp is not None:
            x = x + self.mlp(self.norm2(x))
        return x, new_state


COMPILE_BACKEND = "inductor"
COMPILE_VARIANTS = 64   # graphs a compiled function may hold (see ElephantLM.compile_for)
# inductor's options for the chunk step. Comprehensive padding off: it pads the rows of a matrix
# product's output to 128 bytes (the Mamba in-projection's 2,192 columns become 2,240), but the
# Triton kernels that read slices of that output in place (the conv) are traced with the unpadded
# strides, so inductor copied the slice to the traced layout before each call, forward and
# backward (two 39 MB copies a Mamba layer and chunk)
INDUCTOR_OPTIONS = {"comprehensive_padding": False}


def _in_autocast_dtype(t: Tensor) -> Tensor:
    """t in autocast's dtype while autocast is on (float64 and tensors outside autocast as they
    are)."""
    if t.dtype != torch.float64 and torch.is_autocast_enabled(t.device.type):
        return t.to(torch.get_autocast_dtype(t.device.type))
    return t


def compile_kwargs(backend: str, graphs: bool = False) -> dict:
    """torch.compile's arguments for the chunk step: static shapes, INDUCTOR_OPTIONS when the
    backend is inductor, and with `graphs` CUDA graphs (the reduce-overhead mode's options)."""
    if backend != "inductor":
        return dict(dynamic=False, backend=backend, mode="reduce-overhead" if graphs else None)
    import torch._inductor
    options = dict(INDUCTOR_OPTIONS)
    if graphs:
        options.update(torch._inductor.list_mode_options("reduce-overhead"))
    return dict(dynamic=False, backend=backend, options=options)


def _limit_name(config) -> str:
    """dynamo's limit of graphs per function: recompile_limit (cache_size_limit, its older name, is
    an alias where both exist)."""
    return "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"


def in_eval_mode(fn):
    """Decorate `fn(model, ...)` to run with the model in evaluation mode and give its mode back
    after, also on an error: evaluation and generation are inference, so no training-only
    randomness (the kept tokens' exploration noise and drops) reaches them, even for a model
    scored or sampled in the middle of training. A compiled model's own module is switched."""
    @functools.wraps(fn)
    def run(model, *args, **kwargs):
        module = getattr(model, "_orig_mod", model)
        was_training = module.training
        module.eval()
        try:
            return fn(model, *args, **kwargs)
        finally:
            module.train(was_training)
    return run


class TrainingGraphs:
    """A compiled function in two forms: `graphs` (CUDA graphs, torch.compile's reduce-overhead)
    for training steps with gradients, `plain` (compiled without graphs) for everything else. An
    evaluation or generation pass feeds each chunk the state the last one returned, which a CUDA
    graph's next replay would overwrite, and it runs between training steps: kept out of the
    training graphs, it neither needs that bookkeeping nor adds graphs of its own to their pool."""

    def __init__(self, model: nn.Module, graphs, plain):
        self.model, self.graphs, self.plain = model, graphs, plain

    def __call__(self, *args, **kwargs):
        training = self.model.training and torch.is_grad_enabled()
        return (self.graphs if training else self.plain)(*args, **kwargs)


class ElephantLM(nn.Module):
    share_layouts = True   # the chunk's attention layers share the varlen layout (see compile_for)

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        cfg.validate()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg, kind) for kind in cfg.layers)
        self.norm_f = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tied_embeddings:
            self.lm_head.weight = self.embed.weight
        if cfg.n_mem:
            # learned read memory of a lane that starts a document, and the write slots' inputs
            self.mem_init = nn.Parameter(torch.empty(cfg.n_mem, cfg.d_model))
            self.mem_write = nn.Parameter(torch.empty(cfg.n_mem, cfg.d_model))
            if cfg.mem_update == "gated":
                # what a slot may write (normalized write-slot output) and its gate's logit
                self.mem_norm = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
                self.mem_gate = nn.Parameter(torch.zeros(cfg.n_mem, cfg.d_model))
                self.mem_gate_bias = nn.Parameter(torch.zeros(cfg.n_mem))
        self.last_mem_gate: Tensor | None = None  # (B, n_mem) gates of the last chunk, for analysis
        self.blocked_head = True  # the loss without whole logits (layers/head.py); False: reference
        self.reset_parameters()

    # ------------------------------------------------------------------ parameters
    @torch.no_grad()
    def reset_parameters(self) -> None:
        """GPT-2 style: normal(init_std), residual output projections scaled by 1/sqrt(2 L)."""
        std, cfg = self.cfg.init_std, self.cfg
        out_std = std / math.sqrt(2 * len(cfg.layers))
        for name, module in self.named_modules():
            if isinstance(module, nn.Linear):
                last = name.rsplit(".", 1)[-1]
                nn.init.normal_(module.weight, std=out_std if last in ("o", "out_proj", "down") else std)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
        nn.init.normal_(self.embed.weight, std=std)
        if cfg.n_mem:
            nn.init.normal_(self.mem_init, std=std)
            nn.init.normal_(self.mem_write, std=std)
            if cfg.mem_update == "gated":
                # a gated memory holds normalized vectors (RMS 1): so does the initial memory
                nn.init.normal_(self.mem_init, std=1.0)
                nn.init.zeros_(self.mem_gate)
                # every gate starts at the logit mem_gate_init: 0 is half open; -3 is closed, and
                # exactly so under mem_gate_min, until training opens it (docs/RESULTS.md)
                nn.init.constant_(self.mem_gate_bias, cfg.mem_gate_init)

    def num_params(self, non_embedding: bool = False) -> int:
        n = sum(p.numel() for p in self.parameters())
        if non_embedding:
            n -= self.embed.weight.numel()
        return n

    def flops_per_token(self, T: int) -> float:
        """Training FLOPs per chunk token (forward + backward = 3 x forward), for MFU.

        Matrix products: 6 per weight; attention scores and values over the average number of
        keys a query sees; the SSD scan's intra-chunk and state products. The blocks run over
        the memory slots too (S = T + 2 n_mem positions a chunk), counted as overhead on the T
        real tokens; the output head runs over the T tokens alone, so it counts once a token.
        """
        cfg = self.cfg
        S = T + 2 * cfg.n_mem
        blocks = sum(p.numel() for n, p in self.named_parameters()
                     if p.dim() == 2 and n.startswith("blocks."))
        head = self.lm_head.weight.numel()          # the embedding's, when tied
        per_position = 6 * blocks
        keys = (S + 1) / 2 + cfg.kv_window
        per_position += cfg.layers.count("A") * 6 * 2 * cfg.d_model * keys
        L = min(cfg.ssd_chunk, S)
        H, P, N = cfg.mamba_heads, cfg.mamba_head_dim, cfg.d_state
        per_position += cfg.layers.count("M") * 6 * H * (L * (N + P) + 3 * P * N)
        return per_position * S / T + 6 * head

    def compile_for(self, how: str, backend: str | None = None) -> None:
        """torch.compile the chunk step in place (parameter names unchanged): "blocks", each block
        on its own graph (the model's glue between them runs eagerly: state, memory update, KV
        append, loss); "model", the whole chunk (`_chunk`: reset, blocks, glue and loss) as one
        graph (fewer launches and less Python per chunk; a graph per distinct state structure,
        e.g. the first chunk after a detach and the next); "graphs", the same, replayed as CUDA
        graphs in training (torch.compile's reduce-overhead: no host launches at all, custom ops
        included; the caller marks each step with torch.compiler.cudagraph_mark_step_begin() and
        copies the state it carries past a step out of the graphs' memory, whose tensors the next
        replay may overwrite: `state.StaticCarry` (the trainer's way) or `RecurrentState.clone`),
        compiled without graphs in evaluation and without gradients (`TrainingGraphs`); "window",
        as "graphs", and a BPTT window's chunks given to `forward_window` as one graph (one
        backward graph for the window); "off" leaves it eager. Static shapes.
        `backend`: torch.compile's (default COMPILE_BACKEND; the CPU tests trace with aot_eager)."""
        backend = backend or COMPILE_BACKEND
        if how != "off":
            # static shapes: a graph per state structure, packed form (starts, the initial memory's
            # prefix, the varlen layout's room) and lane count (training, evaluation), more than
            # dynamo's default of 8 per function, past which it would run the rest uncompiled
            import torch._dynamo
            config = torch._dynamo.config
            name = _limit_name(config)
            setattr(config, name, max(COMPILE_VARIANTS, getattr(config, name)))
        # the varlen layout is shared between the chunk's attention layers by a dict they fill
        # (`_chunk`); a block compiled on its own would take it as an input and hold a graph for
        # it empty and one for it filled, so blocks each make their own
        self.share_layouts = how != "blocks"
        if how == "blocks":
            for block in self.blocks:
                block.compile(**compile_kwargs(backend))
        elif how in ("model", "graphs", "window"):
            # `_chunk`, not forward: forward keeps the detach and the memory-only path outside
            # the graph (see forward); the initial memory's prefix (packed documents) runs the
            # blocks outside forward
            names = ("_chunk", "init_prefix") + (("_window_chunks",) if how == "window" else ())
            for name in names:
                fn = getattr(self, name)
                plain = torch.compile(fn, **compile_kwargs(backend))
                if how in ("graphs", "window"):
                    plain = TrainingGraphs(self, torch.compile(fn, **compile_kwargs(backend, True)),
                                           plain)
                setattr(self, name, plain)
        elif how != "off":
            raise ValueError(f"compile_for: expected blocks, model, graphs, window or off, "
                             f"got {how!r}")

    def set_fast_paths(self, fast: bool = True) -> None:
        """Fast paths (Triton SSD and conv on CUDA, SDPA and the fused q/k/v kernel, fused elephant
        MLP) or the reference paths (PyTorch SSD and conv, explicit-mask attention, autograd MLP):
        the equivalence tests and the benchmarks switch between them. The SSD choice is
        process-wide (layers.ssd.set_backend). The loss takes the blocked linear + cross-entropy
        (layers/head.py) or the whole logits."""
        from .layers import ssd
        ssd.set_backend("auto" if fast else "ref")
        self.blocked_head = fast
        for block in self.blocks:
            if block.kind == "A":
                block.mixer.backend = "sdpa" if fast else "reference"
                block.mixer.fused_qkv = fast
            else:
                block.mixer.fast_conv = fast
            if block.mlp is not None:
                block.mlp.fused = fast

    # ------------------------------------------------------------------ state
    def init_state(self, batch: int, device=None, dtype=None, kv_dtype=None) -> RecurrentState:
        """A fresh state for `batch` lanes: every lane at the start of a document. `dtype`: the
        floating tensors' (default the parameters'; the SSM state is float32); `kv_dtype`: the
        attention window's keys and values (default `dtype`), best the dtype attention computes in
        (bf16 under autocast, where the keys are made in bf16: a float32 window would hold the same
        values in twice the bytes, written, read and carried every chunk)."""
        cfg = self.cfg
        device = device if device is not None else self.embed.weight.device
        dtype = dtype if dtype is not None else self.embed.weight.dtype
        kv_dtype = kv_dtype if kv_dtype is not None else dtype
        state = RecurrentState(pos=torch.zeros(batch, dtype=torch.long, device=device))
        for block in self.blocks:
            if block.kind == "M":
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
                    state.kv.append(KVCache(
                        k=torch.zeros(batch, H, cfg.kv_window, hd, device=device, dtype=kv_dtype),
                        v=torch.zeros(batch, H, cfg.kv_window, hd, device=device, dtype=kv_dtype),
                        valid=torch.zeros(batch, cfg.kv_window, dtype=torch.bool, device=device),
                        **kept))
                else:
                    state.kv.append(None)
        if cfg.n_mem:
            state.memory = self.mem_init.detach().to(device, dtype).unsqueeze(0).expand(
                batch, -1, -1).clone()
        return state

    # ------------------------------------------------------------------ forward
    def forward(self, tokens: Tensor, state: RecurrentState | None = None, reset: Tensor | None = None,
                targets: Tensor | None = None, loss_mask: Tensor | None = None,
                reduction: str = "mean", starts: Tensor | None = None,
                prefix: list[tuple] | None = None, inner_starts: int | None = None
                ) -> tuple[Tensor, RecurrentState]:
        """One chunk of every lane.

        tokens (B, T) int64; state from the previous chunk (None: a fresh state); reset (B,) bool
        lanes that start a new document with this chunk. Returns the logits (B, T, V), or with
        `targets` (B, T) the cross-entropy over `loss_mask` (reduction mean / sum / none), and the
        state to feed with the next chunk.

        Packed documents: `starts` (B, T) bool marks the first token of every document in the chunk
        (`starts[:, 0]` acts as `reset`). A document that starts at token t > 0 sees exactly what it
        would see starting a chunk after a reset: rotary positions from 0, no key of the document
        before it, zero Mamba state, and with memory the learned initial memory (see `init_prefix`).
        The returned state is each lane's last document's. `prefix`: `init_prefix()` computed once
        for several chunks (the parameters do not change between them; its graph is shared, so it is
        for chunks that are backpropagated together); None: the state's (`RecurrentState.prefix`),
        else computed inside this chunk's step (one graph with it when compiled) when `starts` needs
        it, and carried on in the returned state to the window's later chunks. `inner_starts`: how
        many documents start inside the chunk (t > 0) over all lanes, known on the host (the
        batcher's `Batch.inner_starts`; counted here when `starts` is a CPU tensor, and a count
        given with it checked; a count given with CUDA starts is trusted): attention runs the chunk
        by its variable-length kernel when they fit its layout (attention.SEGMENT_ROOM), else by
        the explicit mask.
        """
        state, reset, starts, room = self._prepare(tokens, state, reset, starts, inner_starts)
        state, core = self._carried(state)
        if prefix is None:
            prefix = state.prefix
        # the memory-only path (training with it tracked) is updated here, outside `_chunk`, so
        # that a compiled `_chunk` (compile_for("model")) is one autograd node that the window's
        # backward may free, while the path's graph reaches across windows
        path, links = state.memory_path, state.links
        if path is not None and reset is not None:
            path = torch.where(reset.to(path.device).view(-1, 1, 1), self.mem_init.to(path.dtype), path)
        h, new, written, started, gate, used = self._chunk(tokens, core, reset, starts, prefix,
                                                           path is not None, room)
        out = self._output(h, gate, targets, loss_mask, reduction)
        new.links = links
        new.prefix = used if used is not None else prefix   # a chunk without starts uses none
        if path is not None:  # the same update on the memory-only path (see RecurrentState)
            if started is not None:   # a document that began in this chunk read the initial memory
                path = torch.where(started[:, None, None], self.mem_init.to(path.dtype), path)
            new.memory_path = self._memory_update(path, written)[0]
        return out, new

    def _prepare(self, tokens: Tensor, state: RecurrentState | None, reset: Tensor | None,
                 starts: Tensor | None, inner_starts: int | None) -> tuple:
        """forward's checks of one chunk's inputs -> (the state, a fresh one when None; the
        reset flags on the tokens' device, with the documents that start at token 0 of `starts`;
        starts as bool on that device; the varlen layout's room, 0 for none)."""
        B, T = tokens.shape
        if state is None:  # a fresh state is every lane starting a document
            state = self.init_state(B, device=tokens.device)
            reset = torch.ones(B, dtype=torch.bool, device=tokens.device)
        elif state.lanes != B:
            raise ValueError(f"state has {state.lanes} lanes but tokens have {B} rows")
        if starts is not None:
            if starts.shape != (B, T):
                raise ValueError(f"starts must be (B, T) = {(B, T)} bool, got {tuple(starts.shape)}")
            if starts.device.type == "cpu":   # on the host: counted here (and a given count checked)
                counted = int(starts[:, 1:].sum())
                if inner_starts is not None and inner_starts != counted:
                    raise ValueError(f"inner_starts={inner_starts}, but starts marks {counted} "
                                     f"documents starting inside the chunk (t > 0)")
                inner_starts = counted
            starts = starts.to(device=tokens.device, dtype=torch.bool)
            reset = starts[:, 0] if reset is None else reset.to(tokens.device) | starts[:, 0]
        room = 0 if starts is None else segment_room(B, inner_starts)
        return state, reset, starts, room

    def _carried(self, state: RecurrentState) -> tuple[RecurrentState, RecurrentState]:
        """A chunk's start: (the state, detached once it has been through bptt_chunks chunks;
        what `_chunk` takes of it: no memory path, links or prefix)."""
        if state.chunks >= self.cfg.bptt_chunks:
            state = state.detach()
        return state, RecurrentState(pos=state.pos, kv=state.kv, conv=state.conv, ssm=state.ssm,
                                     memory=state.memory, chunks=state.chunks)

    def forward_window(self, chunks: list[dict], state: RecurrentState | None = None,
                       reduction: str = "sum") -> tuple[Tensor, RecurrentState]:
        """The chunks of one BPTT window in one call: for each in turn what `forward(**chunk,
        reduction=reduction)` does, with the state carried from one to the next; returns the sum
        of their losses and the state after the last. Each chunk is a dict of forward's
        arguments: tokens, targets (both required), reset, loss_mask, starts, inner_starts.

        compile_for("window") compiles the chunks' steps (`_window_chunks`) as one graph, so that
        the window's backward is one graph too: each weight's gradient is summed over the
        chunks inside it, not by an addition of its own after them. The losses run after it, as
        in `forward`: a summed loss as one pass of the head over the chunks stacked as lanes, a
        mean chunk by chunk. A state that tracks the memory-only path goes chunk by chunk
        through `forward`."""
        if not chunks:
            raise ValueError("forward_window: no chunk given")
        if reduction not in ("sum", "mean"):
            raise ValueError(f"forward_window: reduction must be sum or mean, got {reduction!r}")
        if state is not None and state.memory_path is not None:
            loss = 0.0
            for chunk in chunks:
                nll, state = self(state=state, reduction=reduction, **chunk)
                loss = loss + nll
            return loss, state
        tokens, resets, starts, rooms = [], [], [], []
        for chunk in chunks:
            if "tokens" in chunk and chunk["tokens"].shape != chunks[0]["tokens"].shape:
                raise ValueError(f"forward_window: every chunk of a window has the same (lanes, "
                                 f"length): {tuple(chunks[0]['tokens'].shape)} then "
                                 f"{tuple(chunk['tokens'].shape)}")
            extra = set(chunk) - {"tokens", "targets", "reset", "loss_mask", "starts", "inner_starts"}
            missing = {"tokens", "targets"} - set(chunk)
            if extra or missing:
                raise ValueError(f"forward_window: a chunk needs tokens and targets, and takes "
                                 f"reset, loss_mask, starts and inner_starts; got unknown keys "
                                 f"{sorted(extra)}, missing {sorted(missing)}")
            # (a fresh state for the first chunk when none is given, the same one after it)
            state, reset, start, room = self._prepare(chunk["tokens"], state, chunk.get("reset"),
                                                      chunk.get("starts"), chunk.get("inner_starts"))
            tokens.append(chunk["tokens"])
            resets.append(reset)
            starts.append(start)
            rooms.append(room)
        (h, gates), state = self._window_chunks(tokens, state, resets, starts, rooms)
        T = h.shape[1]
        if reduction == "mean":
            loss = 0.0
            for h_c, gate, chunk in zip(h.chunk(len(chunks)), gates, chunks):
                loss = loss + self._output(h_c, gate, chunk["targets"], chunk.get("loss_mask"),
                                           reduction)
            return loss, state
        # the summed loss as one head pass over the window's chunks stacked as lanes (the sum over
        # all their tokens is the sum of the chunks' sums): the head's work on its whole (V, D)
        # weight (the cast to the matmul dtype, the scaling of the float32 gradient, the sum of
        # the chunks' gradients) is done once a window, not once a chunk
        masks = [chunk.get("loss_mask") for chunk in chunks]
        mask = None
        if any(m is not None for m in masks):
            mask = torch.cat([torch.ones(chunk["targets"].shape, dtype=torch.bool, device=h.device)
                              if m is None else m for m, chunk in zip(masks, chunks)])
        loss = self.head_loss(h, torch.cat([chunk["targets"] for chunk in chunks]), mask, reduction)
        for gate in gates:
            cost = self._write_cost(gate, T, reduction)
            loss = loss if cost is None else loss + cost
        return loss, state

    def _window_chunks(self, tokens: list, state: RecurrentState, resets: list, starts: list,
                       rooms: list) -> tuple[tuple, RecurrentState]:
        """forward_window's chunks after its checks: for each, forward's detach and `_chunk`
        (the class's own, never a compiled one), the initial memory's prefix computed by the
        first chunk that needs it and handed to the later ones. Returns ((the chunks' final
        normalized hidden states stacked as lanes (k B, T, D), [the memory gates or None a chunk]),
        the state after the last). What compile_for("window") compiles (inside its graph the
        stacking is where the final norm writes)."""
        hs, gates = [], []
        # the window's tokens embedded by one lookup: its backward is one scatter of every
        # chunk's gradient into one (V, D) buffer, where a lookup a chunk made a buffer each and
        # then summed them (passes over the whole embedding's size)
        embedded = self.embed(torch.cat(tokens)).chunk(len(tokens))
        for tok, reset, start, room, emb in zip(tokens, resets, starts, rooms, embedded):
            state, core = self._carried(state)
            h, new, _, _, gate, used = ElephantLM._chunk(self, tok, core, reset, start,
                                                         state.prefix, False, room, emb)
            new.links = state.links
            new.prefix = used if used is not None else state.prefix
            hs.append(h)
            gates.append(gate)
            state = new
        return (hs[0] if len(hs) == 1 else torch.cat(hs), gates), state

    def _output(self, h: Tensor, gate: Tensor | None, targets: Tensor | None,
                loss_mask: Tensor | None, reduction: str) -> Tensor:
        """The logits of the final hidden states h (B, T, D), or with `targets` the loss (and the
        write cost). Outside `_chunk`, so that a compiled chunk leaves the blocked loss to its own
        kernels (one graph per block unrolled in the chunk's graph made it slow to compile)."""
        if targets is None:
            return self.lm_head(h)
        loss = self.head_loss(h, targets, loss_mask, reduction)
        cost = self._write_cost(gate, h.shape[1], reduction)
        return loss if cost is None else loss + cost

    def _write_cost(self, gate: Tensor | None, T: int, reduction: str) -> Tensor | None:
        """The price of writing memory (mem_write_cost, training only: evaluation reports the
        cross-entropy alone): the mean gate per lane, charged for each of the chunk's T tokens;
        None without it."""
        if gate is None or not self.cfg.mem_write_cost or not self.training or reduction == "none":
            return None
        per_lane = gate.mean(-1)                                          # (B,)
        return self.cfg.mem_write_cost * (per_lane.sum() * T if reduction == "sum"
                                          else per_lane.mean())

    def _chunk(self, tokens: Tensor, state: RecurrentState, reset: Tensor | None,
               starts: Tensor | None, prefix: list[tuple] | None, want_written: bool,
               room: int = 0, embedded: Tensor | None = None):
        """The chunk itself, after `forward`'s checks and detach: the reset, the blocks, the KV
        append and the memory update. Returns (the final normalized hidden states (B, T, D), new
        state without the memory path, the write slots' outputs detached (with `want_written`),
        the lanes whose last document began in this chunk (packed) or None, the memory gates or
        None, the initial memory's prefix it used or None). The hidden states are in autocast's
        dtype when autocast is on (what the head's matmul reads). `room`: see Block.forward.
        `embedded`: the tokens' embeddings when the caller made them (B, T, D). What
        compile_for("model") compiles."""
        B, T = tokens.shape
        cfg = self.cfg
        if reset is not None:
            state = state.reset(reset, self.mem_init if cfg.n_mem else None)

        x = self.embed(tokens) if embedded is None else embedded          # (B, T, D)
        if cfg.residual == "autocast":
            x = _in_autocast_dtype(x)                                     # the residual stream's dtype
        idx = torch.arange(T, device=tokens.device)
        tok_pos = state.pos.unsqueeze(1) + idx                           # (B, T)
        new_pos = state.pos + T
        M = cfg.n_mem
        seg = started = None
        if starts is None:
            prefix = None
        else:
            inner = starts.clone()
            inner[:, 0] = False                                           # a start at 0 is the reset
            tok_seg = inner.long().cumsum(1)                              # (B, T) 0: the carried document
            last = torch.where(inner, idx, -1).cummax(1).values          # (B, T) latest start, -1: none
            tok_pos = torch.where(last >= 0, idx - last, tok_pos)        # rotary restarts at a start
            started = last[:, -1] >= 0                                    # (B,) last document began here
            new_pos = torch.where(started, T - last[:, -1], new_pos)
            seg = tok_seg
            if M:
                last_seg = tok_seg[:, -1:]
                seg = torch.cat([tok_seg.new_zeros(B, M), tok_seg, last_seg.expand(B, M)], dim=1)
                if prefix is None:   # in this chunk's graph, not a graph of its own
                    prefix = self._prefix(x.dtype)
                elif len(prefix) != len(self.blocks):
                    raise ValueError(f"prefix must hold one entry per block ({len(self.blocks)}), "
                                     f"got {len(prefix)}: pass model.init_prefix()")
            else:
                prefix = None
        if M:
            mem = state.memory.to(x.dtype)
            write = self.mem_write.to(x.dtype).unsqueeze(0).expand(B, -1, -1)
            x = torch.cat([mem, x, write], dim=1)                         # (B, M + T + M, D)
            read_pos, write_pos = self._memory_positions(state.pos, new_pos)
            pos = torch.cat([read_pos, tok_pos, write_pos], dim=1)
        else:
            pos = tok_pos
        free = self._free_tokens(M, T, x.device)
        # the attention layers' variable-length layout, made by the first and read by the others
        # (their windows take the same tokens: see attention.attend_segments_varlen)
        layouts = {} if starts is not None and room and self.share_layouts else None
        # packed: the window and the kept tokens hold only each lane's last document (all layers)
        last_doc = None if starts is None else tok_seg == tok_seg[:, -1:]      # (B, T)
        keep = None if starts is None else ~started                            # (B,)
        # the kept tokens each lane carries on: not those of a document that ended, nor, while
        # training with kv_keep_drop, those of a lane whose set is dropped
        keep_kept = keep
        if cfg.kv_keep and cfg.kv_keep_drop and self.training:
            survive = torch.rand(B, device=tokens.device) >= cfg.kv_keep_drop
            keep_kept = survive if keep_kept is None else keep_kept & survive

        new = RecurrentState(pos=new_pos, chunks=state.chunks + 1)
        for i, block in enumerate(self.blocks):
            init = None if prefix is None else prefix[i]
            if block.kind == "M":
                x, (conv, ssm) = block(x, pos, (state.conv[i], state.ssm[i]), seg=seg, init=init)
                new.kv.append(None)
                new.conv.append(conv)
                new.ssm.append(ssm)
            else:
                cache = state.kv[i]
                x, (k, v, *kept) = block(x, pos, cache, seg=seg, init=init, start=state.pos,
                                         free=free, room=room, layouts=layouts)
                new.conv.append(None)
                new.ssm.append(None)
                if cache is None:
                    new.kv.append(None)
                    continue
                window = cache.append(k[:, :, M:M + T], v[:, :, M:M + T], new_valid=last_doc, keep=keep)
                if kept:
                    window = self._keep_tokens(block.mixer, cache, window, kept[0][:, :, M:M + T],
                                               v[:, :, M:M + T], kept[1][:, M:M + T], tok_pos,
                                               last_doc, keep_kept)
                new.kv.append(window)
        written = None
        if M:
            read = state.memory
            if starts is not None:  # a document that began in this chunk read the initial memory
                read = torch.where(started[:, None, None], self.mem_init.to(read.dtype), read)
            if want_written:
                written = x[:, M + T:].detach()
            new.memory, gate = self._memory_update(read, x[:, M + T:])
            x = x[:, M:M + T]
        else:
            gate = None
        # in the dtype the head's matmul reads it (autocast's): written so by the norm's kernel,
        # where the head would make a copy of it (and its gradient comes back in it, as
        # autocast's matmul would give it)
        h = _in_autocast_dtype(self.norm_f(x))
        return h, new, written, started, gate, prefix

    def _memory_positions(self, start: Tensor, end: Tensor) -> tuple[Tensor, Tensor]:
        """Rotary positions (B, n_mem) of the read memory and of the write slots of a chunk whose
        tokens run from `start` to `end` - 1 (B,): -1 (not rotated) with mem_rotary "none"; the
        first and the last position with "chunk" and "free" (at a document's start: 0, the same
        as not rotated, so the initial memory's prefix holds for documents that start inside a
        chunk; with "free" only the memory's queries use them, see `_free_tokens`)."""
        M = self.cfg.n_mem
        if self.cfg.mem_rotary == "none":
            none = torch.full((start.shape[0], M), -1, dtype=torch.long, device=start.device)
            return none, none
        return start[:, None].expand(-1, M), (end - 1)[:, None].expand(-1, M)

    def _free_tokens(self, M: int, T: int, device) -> Tensor | None:
        """With mem_rotary "free": which of [read memory (M) | tokens (T) | write slots (M)] are
        memory, the keys attention scores without rotary (Attention.forward's `free`); else None.
        The memory tokens keep the chunk's positions as queries (`_memory_positions`): the
        write slots read the chunk from its last position."""
        if self.cfg.mem_rotary != "free" or not M:
            return None
        free = torch.ones(2 * M + T, dtype=torch.bool, device=device)
        free[M:M + T] = False
        return free

    def _keep_tokens(self, mixer, cache: KVCache, window: KVCache, k_raw: Tensor, v: Tensor,
                     x: Tensor, pos: Tensor, last_doc: Tensor | None, keep: Tensor | None,
                     explore: bool | None = None) -> KVCache:
        """The layer's kept tokens after the chunk (`KVCache.with_kept`): the kv_keep best by keep
        score among those kept so far and the chunk's tokens (of the lane's last document), with
        Gumbel noise on the scores while training (kv_keep_noise; `explore` False: never, as the
        decoder wants) so that tokens the score does not favour yet are sometimes kept and can
        show what keeping them is worth."""
        with torch.no_grad():
            score = torch.cat([mixer.keep_score(cache.keep_x), mixer.keep_score(x)], dim=1)
            noise = self.cfg.kv_keep_noise
            if (self.training if explore is None else explore) and noise:
                u = torch.rand_like(score).clamp(1e-10, 1 - 1e-7)
                score = score - noise * torch.log(-torch.log(u))
        valid = torch.ones_like(pos, dtype=torch.bool) if last_doc is None else last_doc
        return window.with_kept(k_raw, v, x, pos, valid, score, keep=keep)

    def init_prefix(self, dtype=None) -> list[tuple]:
        """What a document sees of the initial memory, per layer: the blocks run over `mem_init`
        alone (one lane, fresh state, with gradient). A lane that starts a document at a chunk
        start reads `mem_init` as its memory prefix from an empty cache and a zero Mamba state, so
        these are exactly its prefix's keys/values (attention: (k, v), (1, H, M, hd)) and Mamba
        state after the prefix ((conv tail (conv_dim, d_conv - 1), SSM state (H, P, N))); a
        document that starts inside a chunk is given them instead of its lane's read memory."""
        return self._prefix(dtype)

    def _prefix(self, dtype=None) -> list[tuple]:
        """init_prefix itself: never compiled on its own, so that a compiled chunk step that needs
        the prefix traces it into its own graph."""
        cfg = self.cfg
        x = self.mem_init.to(dtype or self.mem_init.dtype).unsqueeze(0)  # (1, M, D)
        pos = torch.full((1, cfg.n_mem), -1, dtype=torch.long, device=x.device)
        fresh = self.init_state(1, device=x.device, dtype=x.dtype)
        free = (torch.ones(cfg.n_mem, dtype=torch.bool, device=x.device)
                if cfg.mem_rotary == "free" else None)     # all memory
        out = []
        for i, block in enumerate(self.blocks):
            if block.kind == "M":
                x, (conv, ssm) = block(x, pos, (fresh.conv[i], fresh.ssm[i]))
                out.append((conv[0], ssm[0]))
            else:   # k: at position -1, i.e. before rotary, what `free` memory keys are too
                x, (k, v) = block(x, pos, None, free=free)
                out.append((k, v))
        return out

    def update_memory(self, read: Tensor, written: Tensor) -> Tensor:
        """The next chunk's read memory from this chunk's `read` memory and the write slots'
        final hidden states `written`, (B, n_mem, D) each.

        gated: m' = m + g (rmsnorm(w) - m), g = sigmoid(<a_i, rmsnorm(w_i)> + b_i), one gate per
        slot. A gate under `mem_gate_min` is exactly 0 in the forward pass (m' = m bit for bit,
        whatever the chunk held), while its gradient is the sigmoid's: a closed gate still learns
        when writing would have lowered the loss. Memory is kept in float32 so that repeated
        small updates do not round away. replace: m' = w (the plain RMT).
        """
        return self._memory_update(read, written)[0]

    def _memory_update(self, read: Tensor, written: Tensor) -> tuple[Tensor, Tensor | None]:
        """update_memory, and the gates before the floor (B, n_mem) with their gradient (None
        for `replace`): mem_write_cost charges them."""
        if self.cfg.mem_update == "replace":   # in the carried memory's dtype (residual "autocast")
            return written.to(read.dtype), None
        dtype = torch.promote_types(read.dtype, torch.float32)
        u = self.mem_norm(written.to(dtype))                               # (B, M, D)
        logit = (u * self.mem_gate.to(dtype)).sum(-1) + self.mem_gate_bias.to(dtype)  # (B, M)
        soft = torch.sigmoid(logit)
        g = soft
        floor = self.cfg.mem_gate_min
        if floor > 0:  # exact zero forward, sigmoid gradient (straight-through)
            g = soft + (torch.where(soft < floor, torch.zeros_like(soft), soft) - soft).detach()
        self.last_mem_gate = g.detach()
        read = read.to(dtype)
        return read + g.unsqueeze(-1) * (u - read), soft

    def head_loss(self, h: Tensor, targets: Tensor, loss_mask: Tensor | None = None,
                  reduction: str = "mean") -> Tensor:
        """Cross-entropy of the head over the final hidden states h (B, T, D): blocked, never
        holding the whole float32 logits (`blocked_head`), or the reference (logits, then `loss`)."""
        if self.blocked_head:
            return linear_cross_entropy(h, self.lm_head.weight, targets, loss_mask, reduction)
        return self.loss(self.lm_head(h), targets, loss_mask, reduction)

    @staticmethod
    def loss(logits: Tensor, targets: Tensor, loss_mask: Tensor | None = None,
             reduction: str = "mean") -> Tensor:
        """Cross-entropy (in float32 at least) over the tokens where `loss_mask` is true."""
        if reduction not in ("mean", "sum", "none"):
            raise ValueError(f"reduction must be mean, sum or none, got {reduction!r}")
        return cross_entropy_reference(logits, targets, loss_mask, reduction)
