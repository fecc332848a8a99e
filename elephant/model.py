"""ElephantLM: a hybrid Mamba-2 / attention language model that reads documents chunk by chunk.

    model(tokens[B, T], state, reset[B]) -> (logits[B, T, V] or loss, new_state)

Each layer is a pre-norm residual block: a mixer (Mamba-2, attention or the gated delta rule of
layers/delta.py, by the letters M, A, D of `cfg.layers`) followed by an elephant-gated GLU MLP. With `attn_x0` an attention layer also reads
the stack's RMS-normalized input (the token embeddings, the memory vectors) through a gain
(learned, or held: `attn_x0_gain`), so that the token's identity reaches it whatever the Mamba
layers before it wrote. With `n_mem > 0` every chunk is framed as
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
and its value is scaled by sigmoid(score), which is where the score learns. Mamba-2 and delta rule
layers start from the lane's carried conv and recurrent (SSM, delta rule) state. Gradients flow through memory and SSM state for
`bptt_chunks` chunks: a state that has been through that many chunks is detached before the next
one. With memory-only backpropagation (`RecurrentState.track_memory_path`) the chain of memory
updates is kept across those detaches: a gradient that reaches a chunk's read memory travels on
to every earlier gate (and through each shut gate unchanged), at the cost of a few (B, n_mem, D)
tensors per chunk, not of the chunks' activations.

Beside this file: memory.py (the memory's positions, gated update, write cost, initial prefix),
window.py (a BPTT window's chunks in one call), compile.py (what each compile mode compiles) and
state.py (`fresh_state`); the model's methods of those names hand over to them.
"""
from __future__ import annotations

import functools
import math

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from .compile import compile_chunk_steps
from .config import ModelConfig
from .layers.attention import Attention, segment_room
from .layers.delta import GatedDeltaNet
from .layers.elephant import ElephantMLP
from .layers.head import cross_entropy_reference, linear_cross_entropy
from .layers.mamba import Mamba2
from .memory import free_tokens, initial_prefix, memory_positions, memory_update, write_cost
from .state import KVCache, RecurrentState, fresh_state
from .window import forward_window, window_chunks


MIXERS = {"M": Mamba2, "A": Attention, "D": GatedDeltaNet}   # cfg.layers' letters


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, kind: str):
        super().__init__()
        self.kind = kind
        # Mamba-2 and the gated delta rule carry (conv state, recurrent state) from chunk to chunk,
        # in RecurrentState's conv / ssm lists; attention carries its KV cache
        self.recurrent = kind in ("M", "D")
        self.norm1 = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.mixer = MIXERS[kind](cfg)
        # attn_x0: the gain of the stack's normalized input added to the attention's input (set
        # by ElephantLM.reset_parameters): one per channel, one for the layer, or (attn_x0_gain
        # "fixed") a buffer that training leaves
        gain = (torch.empty(1 if cfg.attn_x0_gain == "layer" else cfg.d_model)
                if kind == "A" and cfg.attn_x0 else None)
        if cfg.attn_x0_gain == "fixed":
            self.register_buffer("x0_gain", gain)   # None: no buffer, as no parameter below
        else:
            self.x0_gain = None if gain is None else nn.Parameter(gain)
        self.x0_norm = cfg.attn_x0_norm
        self.norm2 = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps) if cfg.d_mlp else None
        self.mlp = ElephantMLP(cfg) if cfg.d_mlp else None

    def mixer_input(self, x: Tensor, x0: Tensor | None) -> Tensor:
        """What the mixer reads: norm1(x), and for an attention layer with `attn_x0` also
        x0_gain * x0, x0 the stack's RMS-normalized input (`stack_input`) at the same positions;
        with `attn_x0_norm`, norm1(rmsnorm(x) + x0_gain * x0)."""
        if self.x0_gain is None:
            return self.norm1(x)
        if x0 is None:
            raise ValueError("model.attn_x0: an attention block needs the stack's normalized input "
                             "x0 (ElephantLM.stack_input)")
        if self.x0_norm:
            h = nn.functional.rms_norm(x, (x.shape[-1],), eps=self.norm1.eps)
            return self.norm1(h + self.x0_gain.to(h.dtype) * x0.to(h.dtype))
        h = self.norm1(x)
        return h + self.x0_gain.to(h.dtype) * x0.to(h.dtype)

    def forward(self, x: Tensor, pos: Tensor, layer_state: tuple, seg: Tensor | None = None,
                init: tuple | None = None, start: Tensor | None = None,
                free: Tensor | None = None, room: int = 0,
                layouts: dict | None = None, x0: Tensor | None = None) -> tuple[Tensor, tuple]:
        """seg (B, S) segment ids of packed documents (None: one document per lane) and init the
        initial-memory prefix's state of this layer for segments > 0 (Mamba: (conv tail, SSM state);
        delta rule: (conv tail, S); attention: (k, v)), see ElephantLM.forward. `start` (B,): the position of the chunk's first
        token in the lane's carried document (for kept tokens). `free` (S,) bool: the memory
        tokens, scored without rotary by attention (mem_rotary "free"). The new state of an
        attention layer is (k, v), with kept tokens (k, v, keys before rotary, the normalized
        input). `room`: how many documents may start inside the chunk for attention's
        variable-length kernel (0: none; see attention.SEGMENT_ROOM); `layouts`: that kernel's
        layout, shared by the chunk's attention layers (attention.attend_segments_varlen). `x0`:
        the stack's normalized input (B, S, D), read by attention layers with `attn_x0`."""
        h = self.mixer_input(x, x0)
        if self.recurrent:
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


COMPILE_BACKEND = "inductor"   # (elephant/compile.py: which functions each mode compiles)
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
        """GPT-2 style: normal(init_std), residual output projections scaled by 1/sqrt(2 L) (the
        Mamba mixers' also by mamba_out_scale); the token embedding normal(embed_std) when set."""
        std, cfg = self.cfg.init_std, self.cfg
        out_std = std / math.sqrt(2 * len(cfg.layers))
        for name, module in self.named_modules():
            if isinstance(module, nn.Linear):
                last = name.rsplit(".", 1)[-1]
                scale = cfg.mamba_out_scale if last == "out_proj" else 1.0   # (Mamba's)
                nn.init.normal_(module.weight,
                                std=out_std * scale if last in ("o", "out_proj", "down") else std)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
        nn.init.normal_(self.embed.weight, std=cfg.embed_std or std)
        for block in self.blocks:
            if block.x0_gain is not None:
                with torch.no_grad():
                    block.x0_gain.fill_(cfg.attn_x0_init)
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

    def stack_input(self, x: Tensor) -> Tensor | None:
        """x0 of the attention layers with `attn_x0` (Block.mixer_input): the stack's input x
        (B, S, D) (token embeddings, memory vectors) RMS-normalized without a gain, made once for
        every layer; None without attn_x0."""
        if not self.cfg.attn_x0:
            return None
        return torch.nn.functional.rms_norm(x, (x.shape[-1],), eps=self.cfg.norm_eps)

    def num_params(self, non_embedding: bool = False) -> int:
        n = sum(p.numel() for p in self.parameters())
        if non_embedding:
            n -= self.embed.weight.numel()
        return n

    def flops_per_token(self, T: int) -> float:
        """Training FLOPs per chunk token (forward + backward = 3 x forward), for MFU.

        Matrix products: 6 per weight; attention scores and values over the average number of
        keys a query sees; the SSD scan's intra-chunk and state products; the chunked delta rule's
        (per head and token of a block of L: k.k and q.k over the block (2 L dk), the scores
        times the writes (L dv), the triangular solve (L (dk + dv) / 2) and three state
        products (3 dk dv)). The blocks run over
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
        K, V = cfg.head_dim, cfg.delta_value_dim
        per_position += cfg.layers.count("D") * 6 * cfg.n_heads * (L * (2 * K + V + (K + V) / 2)
                                                                   + 3 * K * V)
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
        compiled without graphs in evaluation and without gradients (`compile.TrainingGraphs`);
        "window", as "graphs", and a BPTT window's chunks given to `forward_window` as one graph
        (one backward graph for the window); "off" leaves it eager. Static shapes.
        `backend`: torch.compile's (default COMPILE_BACKEND; the CPU tests trace with aot_eager).
        The work is compile.compile_chunk_steps'."""
        backend = backend or COMPILE_BACKEND
        compile_chunk_steps(self, how, functools.partial(compile_kwargs, backend))

    def set_fast_paths(self, fast: bool = True) -> None:
        """Fast paths (Triton SSD and conv on CUDA, SDPA and the fused q/k/v kernel, fused elephant
        MLP; the D layers' Triton conv) or the reference paths (PyTorch SSD and conv, explicit-mask
        attention, autograd MLP):
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
        device = device if device is not None else self.embed.weight.device
        dtype = dtype if dtype is not None else self.embed.weight.dtype
        kv_dtype = kv_dtype if kv_dtype is not None else dtype
        return fresh_state(self.cfg, self.blocks, batch, device, dtype, kv_dtype,
                           self.mem_init if self.cfg.n_mem else None)

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
        """The chunks of one BPTT window in one call, each a dict of forward's arguments (tokens,
        targets, reset, loss_mask, starts, inner_starts): the sum of their losses and the state
        after the last (window.forward_window; compile_for("window") makes their steps one graph)."""
        return forward_window(self, chunks, state, reduction)

    def _window_chunks(self, tokens: list, state: RecurrentState, resets: list, starts: list,
                       rooms: list) -> tuple[tuple, RecurrentState]:
        """window.window_chunks: what compile_for("window") compiles."""
        return window_chunks(self, tokens, state, resets, starts, rooms)

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
        """The price of writing memory (memory.write_cost), or None."""
        return write_cost(self, gate, T, reduction)

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
        x0 = self.stack_input(x)
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
            if block.recurrent:
                x, (conv, ssm) = block(x, pos, (state.conv[i], state.ssm[i]), seg=seg, init=init)
                new.kv.append(None)
                new.conv.append(conv)
                new.ssm.append(ssm)
            else:
                cache = state.kv[i]
                x, (k, v, *kept) = block(x, pos, cache, seg=seg, init=init, start=state.pos,
                                         free=free, room=room, layouts=layouts, x0=x0)
                new.conv.append(None)
                new.ssm.append(None)
                if cache is None:
                    new.kv.append(None)
                    continue
                assoc_in, score = {}, None
                if cache.assoc is not None:   # model.kv_assoc: what leaves the window is written
                    with torch.no_grad():     # (the chunk's keep scores, read again below)
                        score = block.mixer.keep_score(kept[1][:, M:M + T])
                    assoc_in = dict(raw_k=kept[0][:, :, M:M + T], score=score,
                                    writes=cfg.kv_assoc_writes)
                window = cache.append(k[:, :, M:M + T], v[:, :, M:M + T], new_valid=last_doc,
                                      keep=keep, **assoc_in)
                if kept:
                    window = self._keep_tokens(block.mixer, cache, window, kept[0][:, :, M:M + T],
                                               v[:, :, M:M + T], kept[1][:, M:M + T], tok_pos,
                                               last_doc, keep_kept, score=score)
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
        """Rotary positions (B, n_mem) of the read memory and the write slots (memory.memory_positions)."""
        return memory_positions(self.cfg, start, end)

    def _free_tokens(self, M: int, T: int, device) -> Tensor | None:
        """Which positions of the framed chunk attention scores position-free (memory.free_tokens)."""
        return free_tokens(self.cfg, M, T, device)

    def _keep_tokens(self, mixer, cache: KVCache, window: KVCache, k_raw: Tensor, v: Tensor,
                     x: Tensor, pos: Tensor, last_doc: Tensor | None, keep: Tensor | None,
                     explore: bool | None = None, score: Tensor | None = None) -> KVCache:
        """The layer's kept tokens after the chunk (`KVCache.with_kept`): the kv_keep best by keep
        score among those kept so far and the chunk's tokens (of the lane's last document), with
        Gumbel noise on the scores while training (kv_keep_noise; `explore` False: never, as the
        decoder wants) so that tokens the score does not favour yet are sometimes kept and can
        show what keeping them is worth. `score`: the chunk's tokens' keep scores where the
        caller has them (mixer.keep_score(x), no gradient)."""
        with torch.no_grad():
            score = torch.cat([mixer.keep_score(cache.keep_x),
                               mixer.keep_score(x) if score is None else score], dim=1)
            noise = self.cfg.kv_keep_noise
            if (self.training if explore is None else explore) and noise:
                u = torch.rand_like(score).clamp(1e-10, 1 - 1e-7)
                score = score - noise * torch.log(-torch.log(u))
        valid = torch.ones_like(pos, dtype=torch.bool) if last_doc is None else last_doc
        return window.with_kept(k_raw, v, x, pos, valid, score, keep=keep)

    def keep_cost(self, state: RecurrentState, tokens: int) -> Tensor | None:
        """The price of keeping tokens (model.kv_keep_cost, training only; None without it):
        per lane, the mean over every attention layer's kept slots of what each slot is charged
        (model.kv_keep_cost_form: its gate sigmoid(keep score), or softplus(keep score) =
        -log(1 - gate); an empty slot counts 0), charged for each of the `tokens` tokens a lane
        read since the last charge, summed over lanes (the trainer's summed loss). Its gradient
        reaches the keep score alone (the kept inputs carry none): it lowers every kept token's
        score, and the loss's own gradient through the gate raises those that queries read."""
        cost = self.cfg.kv_keep_cost
        if not (cost and self.cfg.kv_keep and self.training):
            return None
        charge = F.softplus if self.cfg.kv_keep_cost_form == "softplus" else torch.sigmoid
        charges = [charge(block.mixer.keep_score(c.keep_x)) * c.keep_valid
                   for block, c in zip(self.blocks, state.kv)
                   if block.kind == "A" and c is not None and c.keep_x is not None]
        if not charges:
            return None
        per_lane = torch.cat(charges, dim=1).mean(1)                     # (B,)
        return cost * tokens * per_lane.sum()

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
        return initial_prefix(self, dtype)

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
        return memory_update(self, read, written)

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
