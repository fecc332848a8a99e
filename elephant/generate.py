"""Sampling from a trained model with carried state: memory stays flat however long the text grows.

    generate(model, prompt_ids, max_new_tokens, temperature, top_k, top_p, seed) -> new token ids

The model is run exactly as it was trained: every chunk of `chunk_len` tokens is framed as
[read memory (n_mem) | tokens | write slots (n_mem)] (DESIGN.md, the chunk contract). The prompt's
full chunks go through the chunked forward (`model(tokens, state, reset)`); then `Decoder` takes
the carried state and goes on one token at a time:
  * at a chunk's start the read-memory tokens run through every layer (their keys/values stay for
    the chunk; Mamba layers advance through them);
  * a token attends to [the frozen window of earlier chunks | this chunk's read memory | this
    chunk's tokens so far]; Mamba and delta rule layers advance their conv and recurrent state
    by one token (`Mamba2.step`, `GatedDeltaNet.step`);
  * after `chunk_len` tokens the write slots run (attending to all of the above), the next read
    memory is `model.update_memory(read, written)` and the window takes this chunk's token keys.
The step path equals the chunked forward (tests/test_generate.py: fp64, logits to 1e-9).

Shapes never change while decoding: each attention layer has one K/V buffer of
W + n_mem + chunk_len + n_mem slots ([window | read memory | tokens | write slots]) with a per-lane
fill index and one validity mask, so a token step is a fixed sequence of kernels that is captured
once as a CUDA graph (optionally compiled first with torch.compile), and batch-1 decoding is not
bound by Python overhead. Chunk boundaries (every chunk_len tokens) run eagerly.

Lanes are independent documents: prompts of different lengths are consumed in lock step, a lane
still inside its prompt is fed its next prompt token while the others sample; a lane's chunk
boundary runs for it alone (the other lanes' state is restored).
"""
from __future__ import annotations

import codecs
import math
import numbers
import sys
from typing import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from .layers.attention import free_scores, pad_sequence_keys
from .layers.kept_read import masked_attention_lse, merge_by_lse, top_kept_read
from .model import in_eval_mode
from .state import KVCache, RecurrentState


class GenerationError(ValueError):
    """Bad input to generate (empty prompt, unknown tokens, bad sampling settings); one line."""


# ---------------------------------------------------------------------------------------------
# the step path
class Decoder:
    """The static-shape decoding state of `batch` lanes and the step that advances it.

        dec = Decoder(model, batch, chunk_len)              # fresh lanes (or state=... a state
        logits = dec.step(tokens)                           #  after whole chunks of forward)
        logits = dec.prefill(tokens)                        # several tokens of every lane at once

    `step` returns the logits (B, V) after one token per lane; after the chunk_len-th token of a
    lane's chunk its write slots, memory update and window roll run at once. `cuda_graph=True`
    (CUDA only) replays the token step as a captured CUDA graph; `compile=True` compiles it first.
    """

    def __init__(self, model, batch: int, chunk_len: int, state: RecurrentState | None = None,
                 cuda_graph: bool = False, compile: bool = False):
        model = getattr(model, "_orig_mod", model)
        self.model, self.cfg = model, model.cfg
        self.B, self.T = batch, int(chunk_len)
        if self.T < 1:
            raise GenerationError(f"chunk_len must be >= 1, got {chunk_len}")
        cfg = self.cfg
        self.M, self.W = cfg.n_mem, cfg.kv_window
        self.C = 2 * self.M + self.T                   # [read memory | tokens | write slots]
        weight = model.embed.weight
        self.device, self.dtype = weight.device, weight.dtype
        if state is None:
            state = model.init_state(batch, device=self.device)
        if state.lanes != batch:
            raise GenerationError(f"state has {state.lanes} lanes, expected {batch}")
        B, W, S = batch, self.W, self.W + self.C
        self.pos = state.pos.clone()                                        # (B,) next token's position
        self.fill = torch.zeros(B, dtype=torch.long, device=self.device)    # (B,) chunk slots used
        self.valid = torch.zeros(B, S, dtype=torch.bool, device=self.device)  # (B, W + C)
        self.kv: list[tuple[Tensor, Tensor] | None] = []
        self.kept: dict[int, dict[str, Tensor]] = {}   # attention layer -> its kept-token buffers
        self.conv: list[Tensor | None] = []
        self.ssm: list[Tensor | None] = []
        for i, block in enumerate(model.blocks):
            if block.recurrent:
                self.kv.append(None)
                self.conv.append(state.conv[i].clone())
                self.ssm.append(state.ssm[i].clone())
                continue
            H, hd = cfg.n_heads, cfg.head_dim
            k = torch.zeros(B, H, S, hd, device=self.device, dtype=self.dtype)  # (B, H, W + C, hd)
            v = torch.zeros_like(k)
            cache = state.kv[i]
            if cache is not None and W:
                k[:, :, :W] = cache.k
                v[:, :, :W] = cache.v
                self.valid[:, :W] = cache.valid
            self.kv.append((k, v))
            if cache is not None and cache.keep_k is not None:
                self.kept[i] = self._kept_buffers(cache)
            self.conv.append(None)
            self.ssm.append(None)
        self.memory = None if state.memory is None else state.memory.clone()  # this chunk's read memory
        self.free = None     # mem_rotary "free": the memory slots, keys kept before rotary (W + C,)
        if cfg.mem_rotary == "free" and self.M:
            self.free = torch.zeros(S, dtype=torch.bool, device=self.device)
            self.free[W:W + self.M] = True
            self.free[W + self.M + self.T:] = True
        self.phase = [0] * B        # host copy: tokens of the current chunk seen, per lane
        self.cuda_graph = bool(cuda_graph) and self.device.type == "cuda"
        self._token_fn = self._token_step
        if compile:
            from elephant.layers.triton_env import register_ops
            register_ops()   # every kernel op registered before dynamo traces a call to it
            self._token_fn = torch.compile(self._token_step, dynamic=False)
        self._graph = None
        self._start_chunk(None)

    # ---------------------------------------------------------------- public
    @torch.no_grad()
    def step(self, tokens: Tensor) -> Tensor:
        """One token per lane, tokens (B,) int64 -> logits (B, V)."""
        if self.cuda_graph:
            if self._graph is None:
                self._capture()
            self._tok.copy_(tokens)
            self._graph.replay()
            logits = self._logits
        else:
            logits = self._token_fn(tokens)
        self.phase = [p + 1 for p in self.phase]
        done = [p == self.T for p in self.phase]
        if any(done):
            self._boundary(done)
        return logits

    @torch.no_grad()
    def prefill(self, tokens: Tensor, last_only: bool = False) -> Tensor:
        """Several tokens of every lane at once, tokens (B, S), with every lane at the same point of
        its chunk and S no more than what is left of the chunk -> logits (B, S, V) (B, V with
        `last_only`). The same result as S steps."""
        S = tokens.shape[1]
        if len(set(self.phase)) != 1 or self.phase[0] + S > self.T:
            raise GenerationError(f"prefill: {S} tokens do not fit the rest of every lane's chunk "
                                  f"(at {sorted(set(self.phase))} of {self.T})")
        model = self.model
        x = self._blocks(model.embed(tokens), self.pos[:, None] + torch.arange(S, device=self.device))
        self.pos += S
        if last_only:
            x = x[:, -1]
        logits = model.lm_head(model.norm_f(x))
        self.phase = [p + S for p in self.phase]
        if self.phase[0] == self.T:
            self._boundary([True] * self.B)
        return logits

    @torch.no_grad()
    def reset(self, lanes: Sequence[bool] | Tensor) -> None:
        """Start a new document in the flagged lanes (B,) bool: they forget everything and begin a
        chunk with the learned initial memory, as `model(tokens, state, reset)` does."""
        lanes = [bool(x) for x in (lanes.tolist() if isinstance(lanes, Tensor) else lanes)]
        if not any(lanes):
            return
        keep = self._snapshot() if not all(lanes) else None
        self.pos.zero_()
        self.fill.zero_()
        self.valid.zero_()
        for t in self.conv + self.ssm:
            if t is not None:
                t.zero_()
        for buf in self.kept.values():
            buf["keep_valid"].zero_()
            if "assoc" in buf:
                buf["assoc"].zero_()
        if self.memory is not None:
            self.memory = self.model.mem_init.detach().to(self.memory.dtype).expand_as(self.memory).clone()
        self._start_chunk(None)
        if keep is not None:
            self._merge(lanes, keep)
        self.phase = [0 if r else p for r, p in zip(lanes, self.phase)]

    @torch.no_grad()
    def reorder(self, index: Tensor) -> None:
        """Lane b takes the state of lane index[b] (index (B,) int64; beam search's reordering), in
        place, so that buffer addresses (and a captured CUDA graph) stay valid."""
        index = torch.as_tensor(index, dtype=torch.long, device=self.device)
        if index.shape != (self.B,):
            raise GenerationError(f"reorder: expected {self.B} lane indices, got shape {tuple(index.shape)}")
        for t in self._tensors():
            t.copy_(t[index])
        if self.memory is not None:
            self.memory = self.memory[index]
        self.phase = [self.phase[i] for i in index.tolist()]

    # ---------------------------------------------------------------- the layers
    def _blocks(self, x: Tensor, pos: Tensor) -> Tensor:
        """Run x (B, S, D) at rotary positions pos (B, S) through every layer, appending its keys
        and values at each lane's fill index and advancing the Mamba state; returns the final
        hidden states (B, S, D). In place on the decoding state (CUDA-graph safe)."""
        B, S, _ = x.shape
        idx = self.W + self.fill[:, None] + torch.arange(S, device=self.device)   # (B, S)
        self.valid.scatter_(1, idx, True)
        keys = torch.arange(self.W + self.C, device=self.device)
        # a query sees the valid window slots and the chunk slots up to its own
        mask = self.valid[:, None, None, :] & (keys <= idx[:, :, None])[:, None]   # (B, 1, S, W + C)
        x0 = self.model.stack_input(x)
        for i, block in enumerate(self.model.blocks):
            h = block.mixer_input(x, x0)
            if block.recurrent:
                if S == 1:
                    h, conv, ssm = block.mixer.step(h[:, 0], self.conv[i], self.ssm[i])
                    h = h[:, None]
                else:
                    h, conv, ssm = block.mixer(h, self.conv[i], self.ssm[i])
                self.conv[i].copy_(conv)
                self.ssm[i].copy_(ssm)
            else:
                h = self._attention(block.mixer, h, pos, self.kv[i], idx, mask, self.kept.get(i))
            x = x + h
            if block.mlp is not None:
                x = x + block.mlp(block.norm2(x))
        self.fill += S
        return x

    def _attention(self, mixer, x: Tensor, pos: Tensor, kv: tuple[Tensor, Tensor], idx: Tensor,
                   mask: Tensor, kept: dict[str, Tensor] | None = None) -> Tensor:
        """Attention.forward's projections and rotary (`Attention.project`), with this step's
        keys/values written into the layer's buffer at idx (B, S) and the queries attending over
        the whole buffer (after the layer's kept tokens, if any: their keys, values and inputs
        of this chunk's slots are recorded too, for the choice at the chunk's end)."""
        B, S, D = x.shape
        H, hd = mixer.n_heads, mixer.head_dim
        free = self.free
        S_assoc = None if kept is None else kept.get("assoc")
        q, k, v, *raw = mixer.project(x, pos, raw=kept is not None or free is not None,
                                      raw_q=free is not None,
                                      read_q=S_assoc is not None)  # (B, H, S, hd)
        dtype = v.dtype
        K, V = kv                                                     # (B, H, W + C, hd)
        at = idx[:, None, :, None].expand(B, H, S, hd)
        if free is not None:   # the memory slots hold their keys before rotary
            k = torch.where(free[idx][:, None, :, None], raw[0], k)
        K.scatter_(2, at, k.to(K.dtype))
        V.scatter_(2, at, v.to(V.dtype))
        K, V = K.to(dtype), V.to(dtype)
        q_rot = q                # the rotated queries, which score kept tokens
        if free is not None:   # Attention.forward's scores over the buffer, whose memory slots
            q, K = free_scores(q, raw[1], K, K, free)   # already hold their keys before rotary
        if kept is not None:
            slot = idx - self.W                                       # (B, S) chunk slots
            kept["raw_k"].scatter_(2, slot[:, None, :, None].expand(B, H, S, hd),
                                   raw[0].to(kept["raw_k"].dtype))
            kept["raw_x"].scatter_(1, slot[:, :, None].expand(B, S, D), x.to(kept["raw_x"].dtype))
            if mixer.reads_some_kept(kept["read_k"].shape[2]):
                # as Attention.forward at inference: the buffer, then each query's best kept
                # tokens, merged by log-sum-exp (layers/kept_read.py); the buffer's part written
                # out, its few queries' scores being small
                y1, lse1 = masked_attention_lse(q, K, V, mask)
                y2, lse2 = top_kept_read(q_rot, kept["read_k"], kept["read_v"], kept["read_valid"],
                                         mixer.keep_read, 1.0 / math.sqrt(hd))
                y = merge_by_lse(y1, lse1, y2, lse2)
                return self._out(mixer, x, y, raw, S_assoc, idx - self.W)
            read_k = kept["read_k"].to(dtype)
            read_k = read_k if free is None else pad_sequence_keys(read_k)
            K = torch.cat([read_k, K], dim=2)
            V = torch.cat([kept["read_v"].to(dtype), V], dim=2)
            mask = torch.cat([kept["read_valid"][:, None, None, :].expand(B, 1, S, -1), mask], dim=-1)
        y = F.scaled_dot_product_attention(q, K, V, attn_mask=mask)
        return self._out(mixer, x, y, raw, S_assoc, idx - self.W)

    @staticmethod
    def _out(mixer, x: Tensor, y: Tensor, raw: list, S_assoc: Tensor | None,
             offset: Tensor) -> Tensor:
        """The layer's output of attention's y (B, H, S, hd), with the associative memory's read
        (model.kv_assoc) by the queries before rotary at their `offset` (B, S) into the chunk,
        as Attention.forward adds it."""
        B, S, D = x.shape
        if S_assoc is not None:
            y = (y + mixer.assoc_read(x, raw[1], S_assoc, None, offset)).to(y.dtype)
        return mixer.o(y.transpose(1, 2).reshape(B, S, D))

    # ---------------------------------------------------------------- kept tokens (model.kv_keep)
    def _kept_buffers(self, cache: KVCache) -> dict[str, Tensor]:
        """A layer's kept tokens (cloned from the state), what this chunk reads of them (`read_*`,
        see Attention.kept_tokens) and its chunk slots' keys before rotary and inputs (`raw_*`)."""
        buf = {n: getattr(cache, n).clone() for n in KVCache.NAMES if n.startswith("keep_")}
        B, H, K, hd = cache.keep_k.shape
        buf |= dict(read_k=torch.zeros_like(buf["keep_k"]), read_v=torch.zeros_like(buf["keep_v"]),
                    read_valid=torch.zeros_like(buf["keep_valid"]),
                    raw_k=torch.zeros(B, H, self.C, hd, device=self.device, dtype=cache.keep_k.dtype),
                    raw_x=torch.zeros(B, self.C, cache.keep_x.shape[-1], device=self.device,
                                      dtype=cache.keep_x.dtype))
        if cache.assoc is not None:   # model.kv_assoc: the memory, the window's raw keys and scores
            buf |= dict(assoc=cache.assoc.clone(), win_raw=cache.raw_k.clone(),
                        win_score=cache.score.clone())
        return buf

    @staticmethod
    def _kept_cache(buf: dict[str, Tensor]) -> KVCache:
        """The kept tokens of a layer's buffers as a KVCache (no window)."""
        return KVCache(k=None, v=None, valid=None,
                       **{n: buf[n] for n in KVCache.NAMES if n.startswith("keep_")})

    def _read_kept(self) -> None:
        """At a chunk's start: what its tokens read of every layer's kept tokens (in place)."""
        for i, buf in self.kept.items():
            k, v, valid = self.model.blocks[i].mixer.kept_tokens(self._kept_cache(buf), self.pos)
            buf["read_k"].copy_(k)
            buf["read_v"].copy_(v)
            buf["read_valid"].copy_(valid)

    def _choose_kept(self) -> None:
        """At a chunk's end, before the window rolls: every layer keeps the best of its kept
        tokens and the chunk's tokens, as the chunked forward does (ElephantLM._keep_tokens),
        never with exploration noise; one with an associative memory also writes the tokens
        leaving its window (`_write_assoc`), both from the chunk's keep scores."""
        M, T = self.M, self.T
        pos = self.pos[:, None] - T + torch.arange(T, device=self.device)      # the chunk's tokens
        for i, buf in self.kept.items():
            cache = self._kept_cache(buf)
            mixer = self.model.blocks[i].mixer
            v = self.kv[i][1][:, :, self.W + M:self.W + M + T]                # the chunk's values
            score = mixer.keep_score(buf["raw_x"][:, M:M + T])
            if "assoc" in buf:
                self._write_assoc(i, buf, score)
            chosen = self.model._keep_tokens(mixer, cache, cache, buf["raw_k"][:, :, M:M + T], v,
                                             buf["raw_x"][:, M:M + T], pos, None, None,
                                             explore=False, score=score)
            for n, t in chosen.fields().items():
                buf[n].copy_(t)

    def _write_assoc(self, i: int, buf: dict[str, Tensor], score: Tensor) -> None:
        """Layer i's associative memory takes the tokens leaving its window (KVCache.append, as
        the chunked forward does); `score` (B, T): the chunk's tokens' keep scores."""
        M, W, T = self.M, self.W, self.T
        K, V = self.kv[i]
        window = KVCache(k=K[:, :, :W], v=V[:, :, :W], valid=self.valid[:, :W],
                         raw_k=buf["win_raw"], score=buf["win_score"], assoc=buf["assoc"])
        new = window.append(K[:, :, W + M:W + M + T], V[:, :, W + M:W + M + T],
                            raw_k=buf["raw_k"][:, :, M:M + T], score=score,
                            writes=self.cfg.kv_assoc_writes)
        buf["assoc"].copy_(new.assoc)
        buf["win_raw"].copy_(new.raw_k)
        buf["win_score"].copy_(new.score)

    def _token_step(self, tokens: Tensor) -> Tensor:
        model = self.model
        x = self._blocks(model.embed(tokens)[:, None], self.pos[:, None])
        self.pos += 1
        return model.lm_head(model.norm_f(x[:, 0]))

    # ---------------------------------------------------------------- chunk boundaries
    def _start_chunk(self, lanes) -> None:
        """Read memory: run the read-memory tokens (model._memory_positions) at the chunk's start
        (after the kept tokens it reads are set)."""
        self._read_kept()
        if self.M:
            pos = self.model._memory_positions(self.pos, self.pos + self.T)[0]
            self._blocks(self.memory.to(self.dtype), pos)

    def _end_chunk(self) -> None:
        """Write slots -> next read memory; the window takes this chunk's token keys; new chunk."""
        M, W, T = self.M, self.W, self.T
        if M:
            write = self.model.mem_write.to(self.dtype).unsqueeze(0).expand(self.B, -1, -1)
            pos = self.model._memory_positions(self.pos - T, self.pos)[1]
            written = self._blocks(write, pos)
            self.memory = self.model.update_memory(self.memory, written)
        self._choose_kept()
        if W:
            for kv in self.kv:
                if kv is not None:
                    for t in kv:   # last W of [window | this chunk's tokens]
                        t[:, :, :W] = torch.cat([t[:, :, :W], t[:, :, W + M:W + M + T]], dim=2)[:, :, -W:]
            fresh = torch.ones(self.B, T, dtype=torch.bool, device=self.device)
            self.valid[:, :W] = torch.cat([self.valid[:, :W], fresh], dim=1)[:, -W:]
        self.valid[:, W:] = False
        self.fill.zero_()
        self._start_chunk(None)

    def _boundary(self, lanes: list[bool]) -> None:
        keep = None if all(lanes) else self._snapshot()
        self._end_chunk()
        if keep is not None:
            self._merge(lanes, keep)
        self.phase = [0 if d else p for d, p in zip(lanes, self.phase)]

    def _tensors(self) -> list[Tensor]:
        out = [self.pos, self.fill, self.valid]
        out += [t for kv in self.kv if kv is not None for t in kv]
        out += [t for buf in self.kept.values() for t in buf.values()]
        return out + [t for t in self.conv + self.ssm if t is not None]

    def _snapshot(self) -> tuple[list[Tensor], Tensor | None]:
        return [t.clone() for t in self._tensors()], self.memory

    def _merge(self, lanes: list[bool], keep) -> None:
        """Keep the snapshot's state in the lanes not flagged (in place: buffer addresses stay)."""
        mask = torch.tensor(lanes, dtype=torch.bool, device=self.device)
        old, memory = keep
        for t, o in zip(self._tensors(), old):
            t.copy_(torch.where(mask.view(-1, *([1] * (t.dim() - 1))), t, o))
        if memory is not None:
            self.memory = torch.where(mask.view(-1, 1, 1), self.memory, memory.to(self.memory.dtype))

    # ---------------------------------------------------------------- CUDA graph
    def _capture(self) -> None:
        """Capture the token step once (after warm-up runs, whose effect on the state is undone)."""
        from .cudagraph import capture
        self._tok = torch.zeros(self.B, dtype=torch.long, device=self.device)
        self._graph, self._logits = capture(lambda: self._token_fn(self._tok), self._tensors())


# ---------------------------------------------------------------------------------------------
# sampling
def check_settings(max_new_tokens: int, temperature: float, top_k: int | None,
                   top_p: float | None) -> None:
    """GenerationError (one line) for a setting generate cannot use."""
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise GenerationError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
    if not (isinstance(temperature, (int, float)) and math.isfinite(temperature) and temperature >= 0):
        raise GenerationError(f"temperature must be a number >= 0 (0: greedy), got {temperature!r}")
    if top_k is not None and (not isinstance(top_k, int) or top_k < 0):
        raise GenerationError(f"top_k must be an integer >= 0 (0 or None: off), got {top_k!r}")
    if top_p is not None and not (isinstance(top_p, (int, float)) and 0 < top_p <= 1):
        raise GenerationError(f"top_p must be in (0, 1] (1 or None: off), got {top_p!r}")


def sample(logits: Tensor, temperature: float = 1.0, top_k: int | None = None,
           top_p: float | None = None, generator: torch.Generator | None = None) -> Tensor:
    """Next tokens (B,) from logits (B, V): greedy at temperature 0, else softmax(logits / T)
    restricted to the top_k most likely tokens and to the smallest set whose probability reaches
    top_p (the most likely token always stays)."""
    if temperature == 0:
        return logits.argmax(-1)
    logits = logits.float() / temperature
    if top_k and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, -math.inf)
    if top_p is not None and top_p < 1:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(-1)
        drop = probs.cumsum(-1) - probs >= top_p      # the mass before a token already reaches p
        sorted_logits = sorted_logits.masked_fill(drop, -math.inf)
        logits = torch.full_like(logits, -math.inf).scatter(-1, order, sorted_logits)
    return torch.multinomial(logits.softmax(-1), 1, generator=generator)[:, 0]


# ---------------------------------------------------------------------------------------------
# generate
def training_chunk_len(config: dict | None, default: int | None = None) -> int:
    """The chunk length a run trained with (config["train"]["chunk_len"], as from_pretrained
    returns it), else `default`, else the training default."""
    chunk = ((config or {}).get("train") or {}).get("chunk_len")
    if chunk:
        return int(chunk)
    if default:
        return int(default)
    from .config import TrainConfig
    return TrainConfig().chunk_len


def _prompts(prompt_ids, vocab: int) -> tuple[list[list[int]], bool]:
    """Validated prompts as lists of ints, and whether one prompt (not a batch) was given."""
    if isinstance(prompt_ids, (str, bytes)):
        raise GenerationError("prompt_ids: expected token ids, got text; encode it with the "
                              "tokenizer first (tokenizer.encode(text))")
    if isinstance(prompt_ids, Tensor):
        if prompt_ids.is_floating_point() or prompt_ids.is_complex() or prompt_ids.dim() not in (1, 2):
            raise GenerationError(f"prompt_ids: expected integer token ids of shape (T,) or (B, T), "
                                  f"got {prompt_ids.dtype} of shape {tuple(prompt_ids.shape)}")
        single = prompt_ids.dim() == 1
        prompts = [prompt_ids.tolist()] if single else prompt_ids.tolist()
    else:
        seq = list(prompt_ids)
        single = not seq or not isinstance(seq[0], (list, tuple, Tensor))
        prompts = [seq] if single else [list(p.tolist() if isinstance(p, Tensor) else p) for p in seq]
    if not prompts:
        raise GenerationError("prompt_ids: no prompts given")
    for b, p in enumerate(prompts):
        where = "the prompt" if single else f"prompt {b}"
        if not p:
            raise GenerationError(f"{where} is empty: give at least one token (the model needs "
                                  f"something to continue)")
        for t in p:
            if isinstance(t, bool) or not isinstance(t, numbers.Integral) or not 0 <= t < vocab:
                raise GenerationError(f"{where} holds token {t!r}, outside the vocabulary "
                                      f"(ids 0..{vocab - 1})")
        prompts[b] = [int(t) for t in p]
    return prompts, single


@torch.no_grad()
def read_prompt(model, tokens: Tensor, chunk_len: int, last_only: bool = True,
                cuda_graph: bool = False, compile: bool = False) -> tuple[Decoder, Tensor]:
    """Read prompts, tokens (B, L) with L >= 1, into fresh lanes: a Decoder after them and the logits
    of their last token (B, V), or with `last_only=False` of every token (B, L, V).

    The whole chunks before the one that holds the last token go through the chunked forward, the
    rest (1..chunk_len tokens) through one prefill, so that the last logits come from the decoder.
    `generate` and the transformers adapter (elephant/hf.py) read a prompt this way, so that they
    agree token for token."""
    B, L = tokens.shape
    T = int(chunk_len)
    full = (L - 1) // T
    state, logits = None, []
    for c in range(full):
        out, state = model(tokens[:, c * T:(c + 1) * T], state)
        if not last_only:
            logits.append(out)
    dec = Decoder(model, B, T, state=state, cuda_graph=cuda_graph, compile=compile)
    last = dec.prefill(tokens[:, full * T:], last_only=last_only)
    return dec, (last if last_only else torch.cat(logits + [last], dim=1))


@in_eval_mode
@torch.no_grad()
def generate(model, prompt_ids, max_new_tokens: int = 256, temperature: float = 1.0,
             top_k: int | None = None, top_p: float | None = None, seed: int | None = None,
             eos_id: int | None = None, chunk_len: int | None = None, config: dict | None = None,
             vocab_size: int | None = None, stream: Callable[[int, int], None] | None = None,
             cuda_graph: bool | None = None, compile: bool = False):
    """Continue each prompt by up to `max_new_tokens` tokens with constant memory.

    prompt_ids: token ids of one prompt (a list or a (T,) tensor) or of a batch (a list of lists,
    any lengths, or a (B, T) tensor). Returns the new ids (the prompt excluded) as a list for one
    prompt, a list of lists for a batch; a lane stops after `eos_id` (which it includes).
    temperature 0 is greedy; top_k / top_p restrict the sampling (0 / 1 or None: off); `seed`
    seeds this call's own torch.Generator, so the same call gives the same tokens.
    chunk_len: the chunk framing (default: the training run's, from `config` as from_pretrained
    returns it). vocab_size: sample only ids below it (a tokenizer's vocabulary is often smaller
    than the model's padded one). stream(lane, token) is called for each new token as soon as it
    is sampled. cuda_graph (default: on CUDA) replays the token step as a CUDA graph, `compile`
    compiles it with torch.compile first.
    """
    model = getattr(model, "_orig_mod", model)
    V = model.cfg.vocab_size
    vocab = min(V, vocab_size) if vocab_size else V
    prompts, single = _prompts(prompt_ids, vocab)
    check_settings(max_new_tokens, temperature, top_k, top_p)
    T = int(chunk_len) if chunk_len else training_chunk_len(config)
    device = model.embed.weight.device
    gen = torch.Generator(device=device)
    if seed is None:
        gen.seed()
    else:
        gen.manual_seed(int(seed))
    if cuda_graph is None:
        cuda_graph = device.type == "cuda"

    B = len(prompts)
    lengths = [len(p) for p in prompts]
    L0 = min(lengths)
    padded = torch.zeros(B, max(lengths), dtype=torch.long)
    for b, p in enumerate(prompts):
        padded[b, :len(p)] = torch.tensor(p)
    padded = padded.to(device)

    # the prompt part common to every lane (read_prompt), then lanes with longer prompts are fed
    # theirs token by token
    dec, logits = read_prompt(model, padded[:, :L0], T, cuda_graph=cuda_graph, compile=compile)

    out: list[list[int]] = [[] for _ in range(B)]
    done = [False] * B
    forced_until = max(lengths) - L0      # steps during which some lane still reads its prompt
    total = forced_until + max_new_tokens
    flush_every = 1 if (stream is not None or eos_id is not None) else 256
    pending: list[Tensor] = []            # sampled tokens (B,) not yet copied to the host
    first_step = L0                       # prompt position of the token fed at step s: L0 + s

    def flush():
        if not pending:
            return
        rows = torch.stack(pending, 1).tolist()          # (B, n)
        s0 = flush.step
        for j in range(len(pending)):
            s = s0 + j
            for b in range(B):
                g = first_step + s - lengths[b]          # index of the lane's new token, if >= 0
                if g < 0 or done[b] or len(out[b]) >= max_new_tokens:
                    continue
                tok = rows[b][j]
                out[b].append(tok)
                if stream is not None:
                    stream(b, tok)
                if tok == eos_id or len(out[b]) >= max_new_tokens:
                    done[b] = True
        flush.step += len(pending)
        pending.clear()
    flush.step = 0

    for s in range(total):
        if vocab < V:
            logits = logits[:, :vocab]
        nxt = sample(logits, temperature, top_k, top_p, gen)           # (B,)
        pending.append(nxt)
        if s < forced_until:     # lanes still inside their prompt are fed their next prompt token
            col = min(L0 + s, padded.shape[1] - 1)
            forced = torch.tensor([L0 + s < n for n in lengths], device=device)
            nxt = torch.where(forced, padded[:, col], nxt)
        if len(pending) >= flush_every or s == total - 1:
            flush()
            if all(done):
                break
        if s < total - 1:
            logits = dec.step(nxt)
    flush()
    return out[0] if single else out


# ---------------------------------------------------------------------------------------------
# streaming text
class TextStream:
    """Token ids in, printable text out, as soon as it is final: a multi-byte UTF-8 character split
    over several tokens is held back until it is complete (bytes tokenizer: an incremental UTF-8
    decoder; other tokenizers: decode the ids since the last whitespace and hold a trailing
    replacement character)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.bytes = getattr(tokenizer, "name", "") == "bytes"
        self.utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.ids: list[int] = []
        self.shown = 0

    def push(self, token: int) -> str:
        if self.bytes:
            return self.utf8.decode(bytes([token])) if 0 <= token < 256 else ""
        self.ids.append(token)
        text = self.tokenizer.decode(self.ids)
        if text.endswith("\ufffd"):
            return ""
        new = text[self.shown:]
        if text[-1:].isspace():
            self.ids, self.shown = [], 0
        else:
            self.shown = len(text)
        return new

    def flush(self) -> str:
        if self.bytes:
            return self.utf8.decode(b"", final=True)
        text = self.tokenizer.decode(self.ids) if self.ids else ""
        self.ids, self.shown, new = [], 0, text[self.shown:]
        return new


class _CallableModule(type(sys.modules[__name__])):
    """This module, callable as its `generate`: `from elephant import generate` gives the function
    while the package has not imported this module yet (elephant/__init__.py imports it lazily,
    so that the CLIs' --help does not import torch) and this module once it has; both then run
    `generate(model, prompt_ids, ...)`."""

    def __call__(self, *args, **kwargs):
        return generate(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
