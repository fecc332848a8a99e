"""RollingChunkBatcher: B lanes, each reading one whole document chunk by chunk, for recurrent models.

A lane holds one document until it ends; chunk i of a document of length L feeds tokens
[i*T, i*T+T] (T inputs and, shifted by one, T targets), so consecutive chunks overlap by one token
and every token but the first is predicted exactly once. The last chunk is padded (pad id 0) and the
padding masked out of the loss. A finished lane takes the next document at its next chunk with
`reset=True`: no packing of two documents into one row, which costs padding (reported as `fill`)
but keeps the contract simple: a lane's state always belongs to exactly one document.

Documents are drawn in a seeded shuffle per epoch (the same permutation on every rank, dealt out
round-robin, so ranks get disjoint documents whose union is the split). Documents of fewer than two
tokens have nothing to predict and are skipped (counted in `skipped_short_docs`). With `loop=True`
the stream runs on into the next epoch with a new shuffle; with `loop=False` it ends once every
document has been read, lanes that ran out emitting fully masked rows with doc id -1 meanwhile, so
evaluation sees every document exactly once.

The state is a few ints and two lists per lane, so `state_dict()` is plain JSON and resumes the
exact stream. A batch is built by one numpy slice copy per lane: no per-token Python work.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from data_packing.errors import DataError

STATE_VERSION = 1
_CONFIG_KEYS = ("lanes", "chunk_len", "seed", "rank", "world_size", "shuffle", "n_docs", "n_tokens")


@dataclass
class Batch:
    tokens: torch.Tensor  # (B, T+1) int64: inputs are tokens[:, :-1], targets tokens[:, 1:]
    reset: torch.Tensor  # (B,) bool: the lane starts a new document in this chunk
    loss_mask: torch.Tensor  # (B, T) bool: the target is a real token (not padding)
    doc_ids: torch.Tensor  # (B,) int64: corpus index of the lane's document, -1 for an idle lane


class RollingChunkBatcher:
    """Iterate to get `Batch`es; see the module docstring for the contract."""

    def __init__(self, corpus, lanes: int, chunk_len: int, seed: int = 0, rank: int = 0, world_size: int = 1,
                 *, loop: bool = True, shuffle: bool = True, pad_id: int = 0):
        if lanes < 1 or chunk_len < 1:
            raise DataError(f"lanes and chunk_len must be positive (got {lanes}, {chunk_len})")
        if not 0 <= rank < world_size:
            raise DataError(f"rank {rank} is not in [0, world_size={world_size})")
        self.corpus = corpus
        self.lanes, self.chunk_len = lanes, chunk_len
        self.seed, self.rank, self.world_size = seed, rank, world_size
        self.loop, self.shuffle, self.pad_id = loop, shuffle, pad_id
        self._flat = np.asarray(corpus.tokens)  # a plain ndarray view of the memmap: cheaper slicing
        self._offsets = np.asarray(corpus.offsets)
        lengths = np.diff(self._offsets)
        self._eligible = np.flatnonzero(lengths >= 2)
        self.skipped_short_docs = int(lengths.size - self._eligible.size)
        self.docs_per_epoch = len(range(rank, self._eligible.size, world_size))
        if loop and self.docs_per_epoch == 0:
            raise DataError(f"rank {rank} of {world_size} gets no documents: the corpus has only "
                            f"{self._eligible.size} documents of two or more tokens")
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
        reset = np.zeros(B, dtype=bool)
        doc_ids = np.full(B, -1, dtype=np.int64)
        flat, lane_doc, lane_pos, lane_start, lane_len = (
            self._flat, self._lane_doc, self._lane_pos, self._lane_start, self._lane_len)
        real = 0
        for b in range(B):
            d = lane_doc[b]
            if d < 0:
                d = self._draw()
                if d < 0:
                    continue  # loop=False and no documents left: an idle, fully masked row
                lane_doc[b], lane_pos[b] = d, 0
                lane_start[b] = int(self._offsets[d])
                lane_len[b] = int(self._offsets[d + 1]) - lane_start[b]
            p, n_doc = lane_pos[b], lane_len[b]
            n = min(T, n_doc - 1 - p)  # targets in this chunk
            a = lane_start[b] + p
            tokens[b, : n + 1] = flat[a : a + n + 1]
            loss_mask[b, :n] = True
            reset[b] = p == 0
            doc_ids[b] = d
            real += n
            if p + T >= n_doc - 1:  # the last target of the document was in this chunk
                lane_doc[b] = -1
                self.docs_completed += 1
            else:
                lane_pos[b] = p + T
        if not self.loop and not (doc_ids >= 0).any():
            self._done = True
            raise StopIteration
        self.batches += 1
        self.real_tokens += real
        self.total_tokens += B * T
        self.last_fill = real / (B * T)
        return Batch(torch.from_numpy(tokens), torch.from_numpy(reset), torch.from_numpy(loss_mask),
                     torch.from_numpy(doc_ids))

    def _draw(self) -> int:
        """The next document of this rank's stream, moving to the next epoch when `loop`; -1 at the end."""
        order = self.epoch_order(self.epoch)
        if self.next_pos >= order.size:
            if not self.loop:
                return -1
            self.epoch, self.next_pos = self.epoch + 1, 0
            order = self.epoch_order(self.epoch)
        self.next_pos += 1
        return int(order[self.next_pos - 1])

    # ------------------------------------------------------------ resume

    def state_dict(self) -> dict:
        """The exact stream position, as JSON-serializable plain ints and lists."""
        return {
            "version": STATE_VERSION, **self._config(),
            "epoch": self.epoch, "next_pos": self.next_pos,
            "lane_doc": list(self._lane_doc), "lane_pos": list(self._lane_pos), "done": self._done,
            "docs_completed": self.docs_completed, "real_tokens": self.real_tokens,
            "total_tokens": self.total_tokens, "batches": self.batches,
        }

    def load_state_dict(self, state: dict) -> None:
        """Continue exactly where `state_dict()` was taken; the setup must be the same."""
        if state.get("version") != STATE_VERSION:
            raise DataError(f"batcher state version {state.get('version')!r}, "
                            f"this code reads {STATE_VERSION}")
        for key, value in self._config().items():
            if state.get(key) != value:
                raise DataError(f"batcher state was saved with {key}={state.get(key)!r}, this batcher has "
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

    def _config(self) -> dict:
        return {"lanes": self.lanes, "chunk_len": self.chunk_len, "seed": self.seed, "rank": self.rank,
                "world_size": self.world_size, "shuffle": self.shuffle, "n_docs": int(self._offsets.size - 1),
                "n_tokens": int(self._offsets[-1])}
