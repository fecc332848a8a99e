"""Streaming evaluation over whole documents: every document of a split read chunk by chunk with
carried state, so there is no context limit and memory does not grow with document length.

Used by the trainer's validation pass and by eval.py. Every token of a document but the first is
predicted once (the first has no context: the model has no beginning-of-document token), and the
end-of-document token when the corpus appends one. With `pack=True` the documents lie back to back in
the rows (the batcher's packing, exact per-token boundaries): the same documents are scored exactly
once into the same per-document sums, in fewer chunks on corpora of short documents. Bits per byte and word perplexity divide the same
summed NLL by the UTF-8 bytes and whitespace-separated words of the documents' raw text.

CUDA graph (`cuda_graph=True`, unpacked evaluation): after the first chunk, the chunk step runs on
static buffers (the batch's tokens, mask and resets, and the whole recurrent state, written back
in place after every chunk) and is captured once and replayed as one CUDA graph, so a chunk costs
one launch instead of the Python and the hundreds of launches of the forward: what bounds one lane
over a long document. On the CPU the same static-buffer step runs without capture (what the CPU
tests hold equal to the plain path). Measured on an H100 (benchmarks/results/
train_speed_compile_model_*.json): one lane over a 1M-token document 391k tokens/s against 35k
eager, the same loss to 4e-6; eval.py turns it on for GPUs (`--no-cuda-graph` turns it off).
A batch of at most GRAPH_MAX_ROWS token rows is always captured. A larger one keeps the GPU
busy with the plain compiled step as long as the host keeps up, and a capture (warm-up steps, the
capture itself) costs more than the launches it saves on a short pass; it is captured when its
pass has at least GRAPH_MIN_CHUNKS chunks ahead at its lane count. Such a pass is the one a
host's stall slows (64 lanes over 16M tokens on an H100: 1.52-2.01M tokens/s plain with the GPU
busy 81-100% of the time, 1.93-1.96M as a graph, busy 96-99%).

Speed: documents take the lanes longest first (dealt round-robin over ranks), so the longest ones
start at once; the per-document and per-position sums stay on the device until the end, and the
batches are copied with non-blocking copies from pinned memory, so a chunk costs no host
synchronization. A corpus whose longest document outlasts the others together still ends with
that document read in one lane while the rest of the batch is padding: with `compact=True`
(unpacked evaluation; eval.py's default) the batch shrinks once no document is left to start and
at most an eighth of its lanes still read one, to those lanes (rounded up to a power of two, so
a pass makes few new shapes): their state is carried over and the chunk step (and its CUDA graph)
is made again for the new lane count, so the long tail runs at the speed of a few lanes, not of
a full batch of padding. The sums are the same but for the rounding of kernels whose order of
summation depends on the batch size (float64 on the CPU: to 1e-12; bf16 on an H100, the
benchmark's 16M tokens: a mean loss of 1.9940903 against 1.9940905 for the full batch).

A document's chunks run one after another, so a document of more chunks than an even share of
the whole pass over the lanes outlasts the batch however the lanes are dealt, and its last chunks
run in a lane of their own at the pace of one lane's step. With `side=True` (unpacked, longest
first; eval.py --side) such documents (up to an eighth of the lanes) are read by a side batch
of their own, a lane each, while the other lanes read the rest: the two batches have their own
state, static step and sums, and the side batch runs on a high-priority CUDA stream (its CUDA
graph captured there), so that its small kernels run as the main batch's leave room, and the host
queues its chunks in step with the main batch's (its longest document's chunks over the main
batch's share). Its document is then read at about a single lane's pace beside the main batch,
not after it. With `compact`, the side batch shrinks each time the documents it still reads fit
fewer lanes (a power of two; SIDE_COMPACT_SHARE), as the main batch does once at its end. The
sums are the one batch's, but for the same rounding as compaction's. On an H100, 64 lanes over
16M tokens of source files whose longest document is 806K tokens: 1.84M tokens/s compacted,
1.99-2.02M with the side batch (2026-11-26, eval_graph_rows_*.json), 2.06-2.07M since 2026-11-27
(the window in bf16, the fused head, the side batch compacted;
train_speed_{fused_head,side_compaction}_2026-11-27T07*.json).

The state's attention window is kept in the dtype autocast computes in (`autocast_dtype`), where
its keys and values are made: a float32 window holds the same values in twice the bytes.

What each carried part is worth (`drop=("memory", "kept")`, eval.py --drop memory,kept): those
parts of every lane's state are cleared after every chunk, as a new document clears them (state.
drop_parts), while the rest is carried; the loss by position beside the carried run's is what
the dropped parts carry.

The context ablation (`reset_every=N`, eval.py --reset-every): each lane's state is reset at
positions N, 2N, ... of its document, as if a new document started there (the model's own reset:
window emptied, kept tokens dropped, SSM/conv state zeroed, the initial memory, rotary positions
from 0), so a document is scored as its pieces of N predicted tokens each would be alone (input
N opens a piece without context and predicts N + 1; target N is still predicted from the piece
before). N is a multiple of the chunk length, so unpacked a reset falls on a chunk's first token:
it is one more reset flag, computed on the device from the lane's position, which the static
step (CUDA graph) and the side batch take as they take a new document's. Packed, where documents
start inside chunks, the pieces are marked in the chunk's `starts` (counted on the host). The loss
by position stays by the position in the whole document, so the curve compares band by band with
the carried one: the difference is what carried context buys.
"""
from __future__ import annotations

import math
from contextlib import nullcontext

import numpy as np
import torch
import torch.distributed as dist

from .cudagraph import kept_stream
from .metrics import BUCKET_EDGES, NLLMeter, PositionBuckets
from .model import in_eval_mode
from .state import check_parts, drop_parts


def corpus_request(data_cfg, split: str) -> tuple[tuple, dict]:
    """The arguments data_packing.get_corpus builds a split's corpus from (progress aside): two
    settings with the same request read the same cached corpus."""
    return ((data_cfg.source, split, data_cfg.tokenizer, data_cfg.cache_dir),
            dict(path=data_cfg.path or None, append_eot=data_cfg.append_eot,
                 text_field=data_cfg.text_field, **data_cfg.source_options(split)))


def open_corpus(data_cfg, split: str, rt=None, progress: bool = True):
    """(tokenizer, tokenized corpus) of a split, built into the cache by rank 0 first."""
    from data_packing import get_corpus

    main = rt is None or rt.rank == 0
    distributed = rt is not None and rt.world > 1
    args, kwargs = corpus_request(data_cfg, split)

    def build(show):
        return get_corpus(*args, progress=show, **kwargs)
    if main:
        corpus = build(progress)
    if distributed:
        dist.barrier()
    if not main:
        corpus = build(False)
    return corpus.tokenizer(), corpus


def subset(corpus, max_docs: int):
    """The first `max_docs` documents of a corpus (all of them for 0), as a corpus."""
    if not max_docs or max_docs >= len(corpus):
        return corpus
    from data_packing import TokenizedCorpus
    return TokenizedCorpus(corpus.tokens, corpus.offsets[: max_docs + 1], corpus.doc_bytes[:max_docs],
                           corpus.doc_words[:max_docs], dict(corpus.manifest), corpus.path)


def to_device(t: torch.Tensor, device) -> torch.Tensor:
    """A host tensor on `device` without a host synchronization: on CUDA through pinned memory and
    a non-blocking copy (a blocking copy waits for every queued kernel)."""
    device = torch.device(device)
    if device.type != "cuda" or t.device.type == "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def longest_first(corpus, rank: int = 0, world: int = 1) -> np.ndarray:
    """This rank's documents of two or more tokens (the batcher skips shorter ones), longest first,
    dealt round-robin over ranks."""
    lengths = np.diff(np.asarray(corpus.offsets))
    docs = np.flatnonzero(lengths >= 2)
    docs = docs[np.argsort(-lengths[docs], kind="stable")]
    return docs[rank::world]


def _batcher(corpus, lanes, chunk_len, rank, world, pack, order):
    from data_packing import RollingChunkBatcher

    class LongestFirstBatcher(RollingChunkBatcher):
        def epoch_order(self, epoch: int) -> np.ndarray:
            return order

    cls = RollingChunkBatcher if order is None else LongestFirstBatcher
    return cls(corpus, lanes=lanes, chunk_len=chunk_len, seed=0, rank=rank, world_size=world,
               loop=False, shuffle=False, pack=pack)


class StaticChunkStep:
    """The unpacked evaluation chunk step on static buffers: the batch's tokens (B, T + 1), loss
    mask and resets are copied into fixed tensors, the model reads the state from fixed tensors and
    its new state is copied back into them, so the same step can be captured as a CUDA graph
    (`graph=True`, CUDA only) and replayed chunk after chunk. `state`: the state after a first
    chunk run the plain way, so that the buffers have the dtypes the step keeps."""

    def __init__(self, model, state, tokens: torch.Tensor, mask: torch.Tensor, autocast=None,
                 graph: bool = False, stream=None, drop: tuple = ()):
        self.model, self.autocast, self.stream = model, autocast, stream
        self.drop = drop   # carried parts cleared after every chunk (`evaluate`'s drop)
        self.state = state.clone()                     # the static state: read and written in place
        self.tokens = torch.zeros_like(tokens)
        self.mask = torch.zeros_like(mask)
        self.reset = torch.zeros(tokens.shape[0], dtype=torch.bool, device=tokens.device)
        self.graph = None
        if graph:
            self._capture()

    def _step(self) -> torch.Tensor:
        with self.autocast() if self.autocast else nullcontext():
            nll, new = self.model(self.tokens[:, :-1], self.state, self.reset, targets=self.tokens[:, 1:],
                                  loss_mask=self.mask, reduction="none")
        new = dropped(self.model, new, self.drop)
        mine, theirs = self.state.tensors(), new.tensors()
        if mine.keys() != theirs.keys():
            raise RuntimeError(f"StaticChunkStep: the step changed the state's parts "
                               f"({sorted(set(mine) ^ set(theirs))[:3]})")
        for name, t in mine.items():
            if theirs[name].shape != t.shape or theirs[name].dtype != t.dtype:
                raise RuntimeError(f"StaticChunkStep: state {name} changed from {t.dtype} "
                                   f"{tuple(t.shape)} to {theirs[name].dtype} {tuple(theirs[name].shape)}")
            if theirs[name] is not t:
                t.copy_(theirs[name])
        return nll

    def _capture(self) -> None:
        from .cudagraph import capture
        self.graph, self.nll = capture(self._step, list(self.state.tensors().values()),
                                       warmup=CAPTURE_WARMUP, stream=self.stream, lean=LEAN_CAPTURE)

    def __call__(self, tokens: torch.Tensor, mask: torch.Tensor, reset: torch.Tensor) -> torch.Tensor:
        """One chunk: host or device batch tensors in, the per-token NLL (B, T) out (with a graph,
        a static buffer: read it before the next call)."""
        for dst, src in ((self.tokens, tokens), (self.mask, mask), (self.reset, reset)):
            dst.copy_(src.pin_memory() if dst.is_cuda and not src.is_cuda else src, non_blocking=True)
        if self.graph is not None:
            self.graph.replay()
            return self.nll
        return self._step()


# The largest batch (lanes x chunk_len token rows) whose chunk step is replayed as a CUDA graph.
# A graph pays where launches bound the step: on an H100 the plain compiled step of the
# wt103-70m model costs ~7.6 ms of host time a chunk, so one lane reads 67K tokens/s plain and
# 484K as a graph; at 64 lanes of 512 the GPU takes 14.9 ms a chunk, and the plain step was 3%
# faster than the graph over a 300-chunk pass (its capture: a device synchronization, three
# warm-up steps and the capture itself, ~140 ms; benchmarks/results/eval_graph_full_lanes_*.json;
# the 64-lane pass over 16M tokens with the cap, eval_graph_rows_*.json).
GRAPH_MAX_ROWS = 16 * 1024
# ... and a larger batch is captured too when its pass has at least this many chunks ahead: the
# plain step's ~7.6 ms of host time a chunk is half of its GPU time there, so any stall of the
# host idles the GPU (H100, 2026-11-27: passes over 16M tokens, ~530 chunks at 61 lanes, plain
# 1,517k-2,012k tokens/s, the GPU busy 81-100%; as a graph 1,929k-1,963k, busy 96-99%); the capture's
# warm-ups and host time, ~4-9 chunks' worth, are then under 4% of the pass
GRAPH_MIN_CHUNKS = 256
# Each capture of a pass's step (the side batch's, each compacted batch's) begins without the
# device synchronization and emptied caches of torch.cuda.graph's context (cudagraph.capture's
# `lean`): the other batch's work goes on meanwhile, and its memory stays cached.
LEAN_CAPTURE = True
# The side batch's compacted_lanes share: 1, it shrinks each time its live lanes fit a smaller
# power of two (its lanes hold the longest documents, so a lane whose document ended would carry
# padding for hundreds of chunks); each shrink is one capture more
SIDE_COMPACT_SHARE = 1
# ... after one warm-up step on the capture's side stream: the batch's first chunk has already
# run the same compiled step (every kernel compiled and loaded), so the warm-up is only there for
# what is made per stream (the matmul library's workspace); each one more is a chunk's work thrown
# away (torch's recipe, and the optimizer's and decoder's captures, take three)
CAPTURE_WARMUP = 1


# `evaluate`'s long documents: those over this many tokens, whose curve (position_buckets_long)
# averages the same documents in every band up to 32K
LONG_DOC_TOKENS = 32768


def dropped(model, state, parts):
    """`state` with the carried `parts` cleared (state.drop_parts; the model's initial memory)."""
    if not parts:
        return state
    return drop_parts(state, parts, model.mem_init if model.cfg.n_mem else None, model.cfg.layers)


def autocast_dtype(autocast, device) -> torch.dtype | None:
    """The dtype `autocast()` (a context-manager factory, or None) computes in on `device`'s type,
    None where it computes in none."""
    if autocast is None:
        return None
    kind = torch.device(device).type
    with autocast():
        return torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else None


def compacted_lanes(live: list[int], lanes_now: int, share: int = 8) -> list[int] | None:
    """The lanes a batch of `lanes_now` shrinks to once no document is left to start, given the
    lanes `live` still reading one (indices into the current batch): None while more than
    1/`share` of the batch is live (an eighth: the main batch, whose tail is short next to its
    pass, shrinks once, to few lanes; 1: the side batch, each of whose lanes holds a long
    document, shrinks each time its live lanes fit a smaller power of two), else the live lanes
    padded with idle ones to a power of two."""
    if not live or len(live) * share > lanes_now:
        return None
    n = 1 << (len(live) - 1).bit_length()
    if n >= lanes_now:
        return None
    taken = set(live)
    idle = [b for b in range(lanes_now) if b not in taken]
    return sorted(live + idle[:n - len(live)])


def parse_reset_every(text: str, chunk_len: int, flag: str = "--reset-every") -> int:
    """A user's reset interval ('2048', '2K', '1M'; 0: off) as tokens, checked against the chunk
    length: a ConfigError naming `flag` unless it is 0 or a positive multiple of `chunk_len`."""
    from .config import ConfigError, parse_count
    expected = (f"0 (off) or a positive multiple of the chunk length {chunk_len} (e.g. "
                f"{4 * chunk_len}{', 2K' if 2048 % chunk_len == 0 else ''})")
    try:
        n = parse_count(str(text))
    except ConfigError:
        raise ConfigError(f"{flag} {text}: not a token count; expected {expected}") from None
    if n % chunk_len:
        raise ConfigError(f"{flag} {text}: not {expected}")
    return n


def document_chunks(n_tokens, chunk_len: int):
    """The chunks a document of n_tokens takes unpacked (an int, or an array of counts: each
    document's): its n_tokens - 1 predicted tokens over chunk_len, rounded up."""
    return -(-(n_tokens - 1) // chunk_len)


def side_documents(corpus, docs: np.ndarray, lanes: int, chunk_len: int) -> np.ndarray:
    """The documents (of `docs`, longest first) that a side batch reads: those whose chunks
    outnumber an even share of all the documents' chunks over `lanes` lanes (each would outlast
    the batch, and be read at the end in a lane of its own), at most lanes // 8 of them (and
    none for fewer than 8 lanes: the batch is the side batch)."""
    if lanes < 8 or not docs.size:
        return docs[:0]
    chunks = document_chunks(corpus.doc_lengths, chunk_len)[docs]
    return docs[:lanes // 8][chunks[:lanes // 8] * lanes > chunks.sum()]


class _Pass:
    """One batch streaming its documents: the batcher, the recurrent state, the static step (CUDA
    graph) and the device sums (per document and by position). `step()` runs one chunk and says
    whether there was one."""

    def __init__(self, model, corpus, lanes, chunk_len, device, autocast, rank, world, pack,
                 order, cuda_graph, compact, is_long, prefix, stream=None, compact_share=8,
                 reset_every=0, drop=()):
        self.model, self.device, self.autocast = model, device, autocast
        self.drop = drop   # carried parts cleared after every chunk (`evaluate`'s drop)
        self.reset_every = reset_every   # the context ablation's interval (tokens), 0: off
        self.compact_share = compact_share   # compacted_lanes' share
        self.n_docs, self.chunk_len, self.pack = len(corpus), chunk_len, pack
        self.cuda_graph, self.compact, self.is_long, self.prefix = cuda_graph, compact, is_long, prefix
        self.stream = stream
        self.batcher = _batcher(corpus, lanes, chunk_len, rank, world, pack, order)
        self.lanes = lanes
        f64 = dict(dtype=torch.float64, device=device)
        self.doc_nll = torch.zeros(self.n_docs + 1, **f64)  # last slot: idle lanes
        self.doc_tok = torch.zeros(self.n_docs + 1, **f64)
        self.edges = torch.tensor(BUCKET_EDGES[1:], dtype=torch.long, device=device)
        self.pos_nll = torch.zeros(len(BUCKET_EDGES), **f64)
        self.pos_tok = torch.zeros(len(BUCKET_EDGES), **f64)
        self.long_nll, self.long_tok = torch.zeros_like(self.pos_nll), torch.zeros_like(self.pos_tok)
        # the attention window in the dtype its keys are made in (autocast's): a float32 window
        # holds the same values in twice the bytes, read, written and carried every chunk
        self.state = model.init_state(lanes, device=device, kv_dtype=autocast_dtype(autocast, device))
        self.lane_pos = torch.zeros(lanes, dtype=torch.long, device=device)
        self.idx = torch.arange(chunk_len, device=device)
        self.host_pos = torch.zeros(lanes, dtype=torch.long)   # packed resets: lane_pos on the host
        self.static = None
        # the chunks this batch will run, at full lanes (its documents' chunks over its lanes)
        chunks = document_chunks(corpus.doc_lengths, chunk_len)
        total = int(chunks.sum()) // world if order is None else int(chunks[order].sum())
        self.expected_chunks = -(-total // lanes)
        self.rows = None   # the batcher's lanes this batch computes (compacted), None: all of them
        self.chunk_steps = self.lane_chunks = 0
        self.done = False

    def step(self) -> bool:
        if self.done:
            return False
        with torch.cuda.stream(self.stream) if self.stream is not None else nullcontext():
            try:
                batch = next(self.batcher)
            except StopIteration:
                self.done = True
                return False
            self._chunk(batch)
        return True

    def _chunk(self, batch) -> None:
        model, device, autocast, pack = self.model, self.device, self.autocast, self.pack
        self.chunk_steps += 1
        if self.rows is not None:
            batch = batch.select(self.rows)
        self.lane_chunks += batch.tokens.shape[0]
        tokens = to_device(batch.tokens, device)
        mask = to_device(batch.loss_mask, device)
        starts = to_device(batch.starts, device)
        ids = to_device(batch.token_doc_ids, device)                   # (B, T) document of each input
        # what the model is told starts a document: the batch's starts, with reset_every the
        # pieces' too (`starts` itself keeps the true documents, for the positions below)
        reset, cuts, n_inner = starts[:, 0], starts, batch.inner_starts
        if self.reset_every and not pack:   # a piece starts at the chunk's first token
            due = (self.lane_pos > 0) & (self.lane_pos % self.reset_every == 0)
            reset = reset | due
        elif self.reset_every:
            cuts, n_inner = self._piece_starts(batch)
            cuts = to_device(cuts, device)
            reset = cuts[:, 0]
        if self.static is not None:
            nll = self.static(tokens, mask, reset)
        else:
            with autocast() if autocast else nullcontext():
                # the boundary path only for chunks where a document starts inside (a host count)
                inner = cuts if pack and n_inner else None
                nll, self.state = model(tokens[:, :-1], self.state, reset, targets=tokens[:, 1:],
                                        loss_mask=mask, reduction="none", starts=inner,
                                        prefix=self.prefix, inner_starts=n_inner)
            self.state = dropped(model, self.state, self.drop)
            rows = batch.tokens.shape[0] * self.chunk_len
            ahead = self.expected_chunks - self.chunk_steps
            if self.cuda_graph and not pack and (rows <= GRAPH_MAX_ROWS or ahead >= GRAPH_MIN_CHUNKS):
                # from the next chunk on: the static step (a batch of more rows on a short pass
                # runs plain)
                self.static = StaticChunkStep(model, self.state, tokens, mask, autocast,
                                              graph=device.type == "cuda", stream=self.stream,
                                              drop=self.drop)
        nll = nll.double()                                             # (B, T) zero where masked
        weight = mask.double()
        ids = torch.where(ids < 0, self.n_docs, ids).flatten()
        self.doc_nll.index_add_(0, ids, nll.flatten())
        self.doc_tok.index_add_(0, ids, weight.flatten())
        # position of each input within its document (restarting at each start); its target is +1
        idx = self.idx
        last = torch.where(starts, idx, -1).cummax(1).values           # (B, T) latest start
        inputs_pos = torch.where(last >= 0, idx - last, self.lane_pos[:, None] + idx)
        bucket = torch.bucketize(inputs_pos + 1, self.edges, right=True).flatten()
        self.pos_nll.index_add_(0, bucket, nll.flatten())
        self.pos_tok.index_add_(0, bucket, weight.flatten())
        long = self.is_long[ids]
        self.long_nll.index_add_(0, bucket, nll.flatten() * long)
        self.long_tok.index_add_(0, bucket, weight.flatten() * long)
        self.lane_pos = torch.where(last[:, -1] >= 0, self.chunk_len - last[:, -1],
                                    self.lane_pos + self.chunk_len)
        if self.compact and not pack and self.batcher.drained():
            # no document left to start: the lanes still reading one
            current = list(range(self.lanes)) if self.rows is None else self.rows
            reading = set(self.batcher.reading_lanes())
            keep = compacted_lanes([i for i, b in enumerate(current) if b in reading], len(current),
                                   self.compact_share)
            if keep is not None:
                index = torch.tensor(keep, device=device)
                self.state = (self.static.state if self.static is not None else self.state).select(index)
                self.lane_pos = self.lane_pos[index]
                self.rows = [current[i] for i in keep]
                self.static = None   # made again, for the new lane count, after its first chunk

    def _piece_starts(self, batch) -> tuple[torch.Tensor, int]:
        """Packed, with reset_every: the batch's starts (B, T) on the host with the pieces' first
        tokens added (a real token at a positive multiple of reset_every in its document), and
        how many of those starts lie inside the chunk (t > 0)."""
        T = self.chunk_len
        idx = torch.arange(T)
        last = torch.where(batch.starts, idx, -1).cummax(1).values          # (B, T) latest start
        pos = torch.where(last >= 0, idx - last, self.host_pos[:, None] + idx)
        self.host_pos = torch.where(last[:, -1] >= 0, T - last[:, -1], self.host_pos + T)
        cuts = batch.starts | ((pos > 0) & (pos % self.reset_every == 0) & (batch.token_doc_ids >= 0))
        return cuts, int(cuts[:, 1:].sum())

    def sums(self) -> list[torch.Tensor]:
        return [self.doc_nll, self.doc_tok, self.pos_nll, self.pos_tok, self.long_nll, self.long_tok]


@in_eval_mode
@torch.no_grad()
def evaluate(model, corpus, lanes: int, chunk_len: int, device, autocast=None, max_docs: int = 0,
             rank: int = 0, world: int = 1, progress: bool = False, pack: bool = False,
             order: str = "longest", cuda_graph: bool = False,
             long_docs: int = LONG_DOC_TOKENS, compact: bool = False, side: bool = False,
             reset_every: int = 0, drop: tuple = (), per_document: bool = False) -> dict:
    """Stream documents (the first `max_docs`, or all) and return NLLMeter metrics, with
    `chunk_steps`: the chunks this rank ran (both batches' with a side batch; a pass's lane fill
    is the tokens over lane_chunks x chunk_len), and `position_buckets_long`: the loss by position over
    the `long_documents` longer than `long_docs` tokens alone (default LONG_DOC_TOKENS, 32K).
    Every band of that curve up to there averages the same documents: a fall with position is then
    what the context gives, not a change in which documents a band holds.

    `order`: "longest" (longest documents first, the default) or "corpus" (the corpus's order).
    With several ranks, each streams a disjoint share and the per-document sums are all-reduced.
    `cuda_graph`: the unpacked chunk step replayed as a CUDA graph after the first chunk (see the
    module doc; on the CPU the same static-buffer step, without capture). `compact`: the batch
    shrinks to the lanes still reading a document at the pass's end (unpacked; see the module
    doc); `lane_chunks` counts the rows the pass ran (chunk_steps x lanes without it).
    `side`: the documents that would outlast the batch (`side_documents`; longest first,
    unpacked) are read by a side batch of their own, on a high-priority CUDA stream beside the
    main batch of the other lanes, the two advanced in step (see the module doc);
    `side_documents` counts them, `side_chunk_steps` the side batch's chunks, `side_lane_chunks`
    its rows (with `compact`, the side batch shrinks as its documents end).
    `reset_every`: the context ablation (see the module doc): every lane's state reset at
    positions reset_every, 2 x reset_every, ... of its document (0: off; else a positive multiple
    of chunk_len); the loss by position stays by the position in the whole document.
    `drop`: carried parts of the state (state.CARRIED_PARTS: window, kept, assoc, memory, ssm,
    delta) cleared in every lane after every chunk, the rest carried: what each part is worth
    (eval.py --drop).
    `per_document`: the result also holds `document_nll`, each document's summed NLL (nats) in
    the corpus's order (0 for a document of fewer than two tokens, which predicts nothing): what
    an adapter that scores documents one by one reports (elephant.lm_eval).
    """
    if order not in ("longest", "corpus"):
        raise ValueError(f"evaluate: order must be 'longest' or 'corpus', got {order!r}")
    if reset_every < 0 or reset_every % chunk_len:
        raise ValueError(f"evaluate: reset_every must be 0 (off) or a positive multiple of "
                         f"chunk_len={chunk_len}, got {reset_every}")
    check_parts(tuple(drop), model.cfg)   # a part the model does not carry measures nothing
    corpus = subset(corpus, max_docs)
    n_docs = len(corpus)
    device = torch.device(device)
    is_long = torch.zeros(n_docs + 1, dtype=torch.float64, device=device)
    is_long[:n_docs] = torch.as_tensor(corpus.doc_lengths > long_docs, dtype=torch.float64)
    meter = NLLMeter()
    prefix = None
    if pack and model.cfg.n_mem:   # the weights do not change while evaluating: one prefix for all
        with autocast() if autocast else nullcontext():
            prefix = model.init_prefix(model.embed.weight.dtype)   # the dtype forward gives it
    docs = longest_first(corpus, rank, world) if order == "longest" else None
    aside = (side_documents(corpus, docs, lanes, chunk_len) if side and docs is not None and not pack
             else np.zeros(0, dtype=np.int64))
    common = dict(model=model, corpus=corpus, chunk_len=chunk_len, device=device,
                  autocast=autocast, rank=rank, world=world, pack=pack, cuda_graph=cuda_graph,
                  compact=compact, is_long=is_long, prefix=prefix, reset_every=reset_every,
                  drop=tuple(drop))
    if aside.size:
        stream = None
        if device.type == "cuda":   # high priority: its short kernels go first as the main batch's end
            stream = kept_stream(device, priority=-1)
            stream.wait_stream(torch.cuda.current_stream(device))   # is_long, prefix
        main = _Pass(lanes=lanes - aside.size, order=docs[aside.size:], **common)
        # its tensors made on its stream: their first use waits for their filling there, and the
        # allocator gives their memory back to that stream alone (the main batch's stream would
        # take a freed state while the side stream still reads it)
        with torch.cuda.stream(stream) if stream is not None else nullcontext():
            beside = _Pass(lanes=int(aside.size), order=aside, stream=stream,
                           compact_share=SIDE_COMPACT_SHARE, **common)
    else:
        main, beside = _Pass(lanes=lanes, order=docs, **common), None
    steps = math.ceil(corpus.n_tokens / (lanes * chunk_len * world)) if n_docs else 0
    bar = None
    if progress:
        from tqdm import tqdm
        bar = tqdm(total=int(steps), desc="evaluating", unit=" chunks", dynamic_ncols=True)
    if beside is not None:
        # advanced in step: the side batch by its share of chunks for each chunk of the main one
        # (its longest document's chunks over the main batch's chunks at full lanes), so that
        # both streams have work queued until the main batch ends
        chunks = document_chunks(corpus.doc_lengths, chunk_len)
        main_steps = max(1, int(chunks[docs[aside.size:]].sum()) // main.lanes)
        ratio = int(chunks[aside].max()) / main_steps
    queued = 0.0
    while True:
        ran = main.step()
        if beside is not None:
            queued += ratio if ran else float("inf")
            while queued >= 1 and beside.step():
                queued -= 1
            if not ran and beside.done:
                break
        elif not ran:
            break
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    passes = [main] if beside is None else [main, beside]
    sums = main.sums()
    if beside is not None:
        if beside.stream is not None:
            torch.cuda.current_stream(device).wait_stream(beside.stream)
        sums = [a + b for a, b in zip(sums, beside.sums())]
    doc_nll, doc_tok, pos_nll, pos_tok, long_nll, long_tok = sums
    if world > 1:
        for t in (doc_nll, doc_tok, pos_nll, pos_tok, long_nll, long_tok):
            dist.all_reduce(t)
    meter.buckets.add_sums(pos_nll.tolist(), [round(n) for n in pos_tok.tolist()])
    nll_docs, tok_docs = doc_nll[:n_docs].cpu().numpy(), doc_tok[:n_docs].cpu().numpy()
    for i in range(n_docs):
        meter.add(nll_docs[i], int(tok_docs[i]), int(corpus.doc_bytes[i]), int(corpus.doc_words[i]))
    long_buckets = PositionBuckets()
    long_buckets.add_sums(long_nll.tolist(), [round(n) for n in long_tok.tolist()])
    documents = {"document_nll": nll_docs.tolist()} if per_document else {}
    return meter.result() | documents | {
        "chunk_steps": sum(p.chunk_steps for p in passes),
        "lane_chunks": sum(p.lane_chunks for p in passes),
        "position_buckets_long": long_buckets.to_dict(), "long_documents": int(is_long.sum()),
        "side_documents": int(aside.size),
        "side_chunk_steps": 0 if beside is None else beside.chunk_steps,
        "side_lane_chunks": 0 if beside is None else beside.lane_chunks}
