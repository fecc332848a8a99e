"""RollingChunkBatcher: B lanes, each reading a stream of whole documents chunk by chunk, for recurrent models.

A lane reads one document at a time; chunk i of the lane's stream feeds tokens [i*T, i*T+T] of it
(T inputs and, shifted by one, T targets), so consecutive chunks overlap by one token and every
token of a document but its first is predicted exactly once.

Two ways to go on when a document ends inside a chunk:
  * `pack=False` (today's contract): the rest of the row is padding (pad id 0, masked out of the
    loss) and the next document takes the lane at its next chunk with `reset=True`. The padding costs
    GPU time: `fill` (real targets / target slots) is 0.4-0.75 on short web-like documents.
  * `pack=True`: the next document begins at the next token of the same row, so every row is full.
    The document starts are exact per token (`starts`, (B, T)): the model restarts its state there
    (attention masked by document, Mamba state restarted, rotary positions from 0, the learned initial
    memory), so packing changes where documents sit, never what a document sees. The one target that
    would cross from a document's last token into the next document's first is masked out, so fill is
    1 - (documents per chunk) / T (0.99 for documents of ~150 tokens at T = 256).
In both modes a lane whose document's last token was a target at the row's end takes the next
document at its next chunk with `reset` (= `starts[:, 0]`), and a document's first token is never a
target (it has no context: the model has no beginning-of-document token).

Documents are drawn in a seeded shuffle per epoch (the same permutation on every rank, dealt out
round-robin, so ranks get disjoint documents whose union is the split). Documents of fewer than two
tokens have nothing to predict and are skipped (counted in `skipped_short_docs`). With `loop=True`
the stream runs on into the next epoch with a new shuffle; with `loop=False` it ends once every
document has been read, lanes that ran out emitting fully masked rows with doc id -1 meanwhile, so
evaluation sees every document exactly once.

A length curriculum (`curriculum=(start, batches)`, training only): over the batcher's first
`batches` batches a document may start a lane only if its length is at most a cap that grows
geometrically from `start` tokens to the corpus's longest document; a longer one is passed over in
this epoch's order (counted in `skipped_for_length`) and read in a later epoch. The cap is a
function of the batch count, so the stream stays deterministic and resumes exactly. Short
documents first put more document starts and ends (and more of what a document refers back to
within reach of truncated backpropagation) in the early steps.

The state is a few ints and two lists per lane, so `state_dict()` is plain JSON and resumes the
exact stream. A batch is built by one numpy slice copy per lane and document: no per-token Python work.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from data_packing.errors import DataError

STATE_VERSION = 2  # 2: `pack` joined the setup (a version-1 state resumes with pack=False)


@dataclass
class Batch:
    tokens: torch.Tensor  # (B, T+1) int64: inputs are tokens[:, :-1], targets tokens[:, 1:]
    reset: torch.Tensor  # (B,) bool: the lane starts a new document in this chunk
    loss_mask: torch.Tensor  # (B, T) bool: the target is a real token (not padding)
    doc_ids: torch.Tensor  # (B,) int64: corpus index of the lane's document at the chunk start, -1: idle
    starts: torch.Tensor | None = None  # (B, T) bool: input t is the first token of a document
    token_doc_ids: torch.Tensor | None = None  # (B, T) int64: document of input t, -1 for padding
    inner_starts: int = 0  # how many documents start inside the chunk (t > 0), over all lanes: counted
    # on the host, so a consumer can skip the boundary work (starts=None, reset) for chunks without
    # one, and size per-document kernels (ElephantLM.forward's inner_starts)

    def select(self, lanes: list[int]) -> "Batch":
        """The same chunk for a subset of the lanes, in the order given."""
        idx = torch.as_tensor(lanes, dtype=torch.long)
        starts = None if self.starts is None else self.starts[idx]
        return Batch(self.tokens[idx], self.reset[idx], self.loss_mask[idx], self.doc_ids[idx],
                     starts, None if self.token_doc_ids is None else self.token_doc_ids[idx],
                     inner_starts=0 if starts is None else int(starts[:, 1:].sum()))


class RollingChunkBatcher:
    """Iterate to get `Batch`es; see the module docstring for the contract."""

    def __init__(self, corpus, lanes: int, chunk_len: int, seed: int = 0, rank: int = 0, world_size: int = 1,
                 *, loop: bool = True, shuffle: bool = True, pad_id: int = 0, pack: bool = False,
                 curriculum: tuple[int, int] | None = None):
        if lanes < 1 or chunk_len < 1:
            raise DataError(f"lanes and chunk_len must be positive (got {lanes}, {chunk_len})")
        if not 0 <= rank < world_size:
            raise DataError(f"rank {rank} is not in [0, world_size={world_size})")
        self.corpus = corpus
        self.lanes, self.chunk_len = lanes, chunk_len
        self.seed, self.rank, self.world_size = seed, rank, world_size
        self.loop, self.shuffle, self.pad_id, self.pack = loop, shuffle, pad_id, bool(pack)
        self._flat = np.asarray(corpus.tokens)  # a plain ndarray view of the memmap: cheaper slicing
        self._offsets = np.asarray(corpus.offsets)
        lengths = np.diff(self._offsets)
        self._eligible = np.flatnonzero(lengths >= 2)
        self.skipped_short_docs = int(lengths.size - self._eligible.size)
        self.docs_per_epoch = len(range(rank, self._eligible.size, world_size))
        if loop and self.docs_per_epoch == 0:
            raise DataError(f"rank {rank} of {world_size} gets no documents: the corpus has only "
                            f"{self._eligible.size} documents of two or more tokens")
        self._lengths = lengths
        start, over = curriculum or (0, 0)
        if over and (start < 1 or over < 0 or not loop):
            raise DataError(f"a length curriculum needs a looping stream, a start of 1 token or "
                            f"more and a batch count >= 0 (got start {start}, {over} batches)")
        self.curriculum_start, self.curriculum_batches = (int(start), int(over)) if over else (0, 0)
        self._longest = int(lengths[self._eligible].max()) if self._eligible.size else 0
        self.skipped_for_length = 0
        self._order_epoch, self._order = -1, self._eligible[:0]
        # Position in the stream.
        self.epoch = 0  # epoch of the next document to be drawn
        self.next_pos = 0  # index of that document in this rank's order of the epoch
        self._lane_doc = [-1] * lanes  # document index per lane, -1 when idle
        self._lane_pos = [0] * lanes  # start of the lane's next chunk within its document
        self._lane_start = [0] * lanes  # cached offsets[doc] and len(doc) of the lane's document
        self._lane_len = [0] * lanes
        self._done = False
        # Counters.
        self.docs_completed = 0
        self.real_tokens = 0
        self.total_tokens = 0
        self.batches = 0
        self.last_fill = 0.0

    @property
    def fill(self) -> float:
        """Real (predicted) tokens / all target slots, over every batch so far."""
        return self.real_tokens / self.total_tokens if self.total_tokens else 0.0

    def epoch_order(self, epoch: int) -> np.ndarray:
        """This rank's documents for `epoch`, in the order they are read."""
        if epoch != self._order_epoch:
            docs = self._eligible
            if self.shuffle:
                docs = docs[np.random.default_rng([self.seed, epoch]).permutation(docs.size)]
            self._order_epoch, self._order = epoch, docs[self.rank :: self.world_size]
        return self._order

    def __iter__(self):
        return self

    def __next__(self) -> Batch:
        if self._done:
            raise StopIteration
        B, T = self.lanes, self.chunk_len
        # A new array per batch (calloc'd zeros are cheap): a consumer may keep a batch while the next
        # one is built, e.g. in a prefetch queue or an async host-to-device copy.
        tokens = np.zeros((B, T + 1), dtype=np.int64)
        if self.pad_id:
            tokens.fill(self.pad_id)
        loss_mask = np.zeros((B, T), dtype=bool)
        starts = np.zeros((B, T), dtype=bool)
        token_doc = np.full((B, T + 1), -1, dtype=np.int64)
        flat, lane_doc, lane_pos, lane_start, lane_len = (
            self._flat, self._lane_doc, self._lane_pos, self._lane_start, self._lane_len)
        real = 0
        for b in range(B):
            j = 0  # the next row position to fill; positions 0..T (T inputs, targets shifted by one)
            while j <= T:
                d = lane_doc[b]
                if d < 0:
                    # unpacked: a document only starts a row; packed: any position but the last,
                    # whose only use would be a target across the boundary (masked anyway)
                    if j > 0 and (not self.pack or j == T):
                        break
                    d = self._draw()
                    if d < 0:
                        break  # loop=False and no documents left: the rest of the row is padding
                    lane_doc[b], lane_pos[b] = d, 0
                    lane_start[b] = int(self._offsets[d])
                    lane_len[b] = int(self._offsets[d + 1]) - lane_start[b]
                    starts[b, j] = True
                p, n_doc = lane_pos[b], lane_len[b]
                k = min(T + 1 - j, n_doc - p)  # tokens of the document at positions j .. j+k-1
                a = lane_start[b] + p
                tokens[b, j : j + k] = flat[a : a + k]
                token_doc[b, j : j + k] = d
                loss_mask[b, j : j + k - 1] = True  # inputs whose target is the same document's
                real += k - 1
                if p + k >= n_doc:  # the document's last token is at position j+k-1 <= T
                    lane_doc[b] = -1
                    self.docs_completed += 1
                    j += k
                else:  # it runs past this row: the next chunk starts at position T
                    lane_pos[b] = p + T - j
                    break
        doc_ids = token_doc[:, 0].copy()
        if not self.loop and not (doc_ids >= 0).any():
            self._done = True
            raise StopIteration
        self.batches += 1
        self.real_tokens += real
        self.total_tokens += B * T
        self.last_fill = real / (B * T)
        starts_t = torch.from_numpy(starts)
        return Batch(torch.from_numpy(tokens), starts_t[:, 0].clone(), torch.from_numpy(loss_mask),
                     torch.from_numpy(doc_ids), starts_t, torch.from_numpy(token_doc[:, :T].copy()),
                     inner_starts=int(starts[:, 1:].sum()))

    def drained(self) -> bool:
        """No document is left to start: loop=False and this rank's order is spent (the lanes
        reading one go on to its end; the others stay padding)."""
        return not self.loop and self.next_pos >= self.epoch_order(self.epoch).size

    def reading_lanes(self) -> list[int]:
        """The lanes whose document goes on into the next batch."""
        return [b for b, d in enumerate(self._lane_doc) if d >= 0]

    def length_cap(self) -> int | None:
        """The longest document that may start a lane now (the length curriculum), None: any."""
        if not self.curriculum_batches or self.batches >= self.curriculum_batches:
            return None
        start = min(self.curriculum_start, self._longest)
        return int(start * (self._longest / start) ** (self.batches / self.curriculum_batches))

    def _draw(self) -> int:
        """The next document of this rank's stream, moving to the next epoch when `loop`; -1 at the end.
        Under the length curriculum, documents over the cap are passed over (a whole epoch's worth
        at most: then the next one is taken whatever its length)."""
        cap, passed = self.length_cap(), 0
        while True:
            order = self.epoch_order(self.epoch)
            if self.next_pos >= order.size:
                if not self.loop:
                    return -1
                self.epoch, self.next_pos = self.epoch + 1, 0
                order = self.epoch_order(self.epoch)
            self.next_pos += 1
            d = int(order[self.next_pos - 1])
            if cap is None or self._lengths[d] <= cap or passed >= self.docs_per_epoch:
                return d
            passed += 1
            self.skipped_for_length += 1

    # ------------------------------------------------------------ resume

    def state_dict(self) -> dict:
        """The exact stream position, as JSON-serializable plain ints and lists."""
        return {
            "version": STATE_VERSION, **self._config(),
            "epoch": self.epoch, "next_pos": self.next_pos,
            "lane_doc": list(self._lane_doc), "lane_pos": list(self._lane_pos), "done": self._done,
            "docs_completed": self.docs_completed, "real_tokens": self.real_tokens,
            "total_tokens": self.total_tokens, "batches": self.batches,
            "skipped_for_length": self.skipped_for_length,
        }

    def load_state_dict(self, state: dict) -> None:
        """Continue exactly where `state_dict()` was taken; the setup must be the same."""
        version = state.get("version")
        if version == 1 and not self.pack:  # version 1 is the unpacked stream, without the key
            state = {**state, "pack": False}
        elif version != STATE_VERSION:
            hint = " (a version-1 state resumes with data.pack=false)" if version == 1 else ""
            raise DataError(f"batcher state version {version!r}, this code reads {STATE_VERSION}{hint}")
        for key, value in self._config().items():
            saved = state.get(key, 0 if key.startswith("curriculum") else None)   # none: off
            if saved != value:
                raise DataError(f"batcher state was saved with {key}={saved!r}, this batcher has "
                                f"{key}={value!r}; resume with the same corpus and settings")
        lane_doc, lane_pos = [int(x) for x in state["lane_doc"]], [int(x) for x in state["lane_pos"]]
        if len(lane_doc) != self.lanes or len(lane_pos) != self.lanes:
            raise DataError(f"batcher state has {len(lane_doc)} lanes, this batcher {self.lanes}")
        self.epoch, self.next_pos = int(state["epoch"]), int(state["next_pos"])
        self._lane_doc, self._lane_pos = lane_doc, lane_pos
        self._lane_start = [int(self._offsets[d]) if d >= 0 else 0 for d in lane_doc]
        self._lane_len = [int(self._offsets[d + 1] - self._offsets[d]) if d >= 0 else 0 for d in lane_doc]
        self._done = bool(state["done"])
        self.docs_completed, self.batches = int(state["docs_completed"]), int(state["batches"])
        self.real_tokens, self.total_tokens = int(state["real_tokens"]), int(state["total_tokens"])
        self.skipped_for_length = int(state.get("skipped_for_length", 0))

    def _config(self) -> dict:
        return {"lanes": self.lanes, "chunk_len": self.chunk_len, "seed": self.seed, "rank": self.rank,
                "world_size": self.world_size, "shuffle": self.shuffle, "pack": self.pack, "n_docs": int(self._offsets.size - 1),
                "n_tokens": int(self._offsets[-1]),
                # the length curriculum (0, 0: off; a state saved before it existed reads as off)
                "curriculum_start": self.curriculum_start, "curriculum_batches": self.curriculum_batches}
