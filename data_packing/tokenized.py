"""A tokenized corpus on disk: one flat token array, memory-mapped, plus per-document index arrays.

Folder layout (written once by prepare.py, then only read):
    tokens.bin      all documents' tokens back to back, uint16 when the vocabulary fits, else uint32
    offsets.npy     int64 [n_docs + 1]: document i is tokens[offsets[i]:offsets[i+1]]
    doc_bytes.npy   int64 [n_docs]: UTF-8 bytes of each document's raw text (for bits per byte)
    doc_words.npy   int64 [n_docs]: whitespace-separated words of the raw text (word perplexity)
    tokenizer/      the files that rebuild the tokenizer (tokenizer.json or a bytes marker)
    manifest.json   what was built from what (source, split, tokenizer fingerprint, counts); written
                    last, so a folder without it is an unfinished build and never opens.
Memory-mapping means a process touches only the pages of the documents it reads, and N ranks share
one copy in the page cache.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np

from data_packing.errors import DataError

FORMAT = 1
MANIFEST = "manifest.json"


class TokenizedCorpus:
    """Documents as token arrays: `len(c)` documents, `c.doc(i)`, `c.n_tokens`, `c.manifest`."""

    def __init__(self, tokens: np.ndarray, offsets: np.ndarray, doc_bytes: np.ndarray | None = None,
                 doc_words: np.ndarray | None = None, manifest: dict | None = None, path: Path | None = None):
        self.tokens = tokens  # flat, (n_tokens,)
        self.offsets = offsets  # (n_docs + 1,)
        n = len(offsets) - 1
        self.doc_bytes = doc_bytes if doc_bytes is not None else np.zeros(n, dtype=np.int64)
        self.doc_words = doc_words if doc_words is not None else np.zeros(n, dtype=np.int64)
        self.manifest = manifest or {}
        self.path = path

    @classmethod
    def open(cls, path: str | os.PathLike) -> "TokenizedCorpus":
        """Memory-map a corpus folder written by prepare.py, checking that its files agree."""
        path = Path(path)
        manifest = read_manifest(path)
        if manifest is None:
            raise DataError(f"{path}: not a tokenized corpus (no {MANIFEST}; "
                            "an interrupted prepare leaves none)")
        if manifest.get("format") != FORMAT:
            raise DataError(f"{path}: corpus format {manifest.get('format')!r}, this code reads {FORMAT}; "
                            "prepare it again")
        try:
            n_docs, n_tokens, dtype = manifest["n_docs"], manifest["n_tokens"], np.dtype(manifest["dtype"])
            offsets = np.load(path / "offsets.npy", mmap_mode="r")
            doc_bytes = np.load(path / "doc_bytes.npy", mmap_mode="r")
            doc_words = np.load(path / "doc_words.npy", mmap_mode="r")
            size = (path / "tokens.bin").stat().st_size
        except (KeyError, TypeError, OSError, ValueError) as e:
            raise DataError(f"{path}: corrupt corpus ({type(e).__name__}: {e}); "
                            "delete it and prepare again") from None
        if (offsets.shape != (n_docs + 1,) or doc_bytes.shape != (n_docs,) or doc_words.shape != (n_docs,)
                or size != n_tokens * dtype.itemsize or int(offsets[-1]) != n_tokens):
            raise DataError(f"{path}: corrupt corpus (file sizes disagree with {MANIFEST}); "
                            "delete it and prepare again")
        tokens = (np.memmap(path / "tokens.bin", dtype=dtype, mode="r", shape=(n_tokens,)) if n_tokens
                  else np.zeros(0, dtype=dtype))
        return cls(tokens, offsets, doc_bytes, doc_words, manifest, path)

    @classmethod
    def from_documents(cls, docs: Iterable[Sequence[int]], dtype=np.uint32) -> "TokenizedCorpus":
        """An in-memory corpus (tests, tools): documents are given as token sequences."""
        arrays = [np.asarray(d, dtype=dtype).reshape(-1) for d in docs]
        offsets = np.zeros(len(arrays) + 1, dtype=np.int64)
        np.cumsum([a.size for a in arrays], out=offsets[1:])
        tokens = np.concatenate(arrays) if arrays else np.zeros(0, dtype=dtype)
        return cls(tokens, offsets, manifest={"n_docs": len(arrays), "n_tokens": int(offsets[-1])})

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def doc(self, i: int) -> np.ndarray:
        """The tokens of document `i` (a read-only view into the flat array)."""
        return self.tokens[int(self.offsets[i]) : int(self.offsets[i + 1])]

    @property
    def doc_lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    @property
    def n_tokens(self) -> int:
        return int(self.offsets[-1])

    @property
    def eot_id(self) -> int | None:
        return self.manifest.get("tokenizer", {}).get("eot_id")

    @property
    def vocab_size(self) -> int | None:
        return self.manifest.get("tokenizer", {}).get("vocab_size")

    def tokenizer(self):
        """The tokenizer this corpus was built with, rebuilt from the copy saved beside it."""
        from data_packing.tokenizer import load_tokenizer

        if self.path is None:
            raise DataError("an in-memory corpus has no saved tokenizer")
        tokenizer = load_tokenizer(self.path / "tokenizer")
        tokenizer.name = self.manifest.get("tokenizer", {}).get("name", tokenizer.name)
        return tokenizer

    def __repr__(self) -> str:
        m = self.manifest
        return (f"TokenizedCorpus({m.get('source', '?')}/{m.get('split', '?')}: {len(self)} docs, "
                f"{self.n_tokens} tokens, path={self.path})")


class CorpusWriter:
    """Writes a corpus folder: `add()` batches of documents in order, then `finish(manifest)`."""

    def __init__(self, path: Path, dtype: np.dtype):
        self.path, self.dtype = Path(path), np.dtype(dtype)
        self.path.mkdir(parents=True, exist_ok=True)
        self._tokens = open(self.path / "tokens.bin", "wb")
        self._lengths: list[np.ndarray] = []
        self._bytes: list[np.ndarray] = []
        self._words: list[np.ndarray] = []

    def add(self, tokens: np.ndarray, lengths: np.ndarray, doc_bytes: np.ndarray, doc_words: np.ndarray):
        """Append documents given as their concatenated tokens and per-document counts."""
        self._tokens.write(np.ascontiguousarray(tokens, dtype=self.dtype.newbyteorder("<")).tobytes())
        self._lengths.append(np.asarray(lengths, dtype=np.int64))
        self._bytes.append(np.asarray(doc_bytes, dtype=np.int64))
        self._words.append(np.asarray(doc_words, dtype=np.int64))

    def finish(self, manifest: dict) -> dict:
        """Write the index arrays, then the manifest (with counts filled in) as the last file."""
        self._tokens.flush()
        os.fsync(self._tokens.fileno())
        self._tokens.close()
        lengths = np.concatenate(self._lengths) if self._lengths else np.zeros(0, dtype=np.int64)
        offsets = np.zeros(lengths.size + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        doc_bytes = np.concatenate(self._bytes) if self._bytes else np.zeros(0, dtype=np.int64)
        doc_words = np.concatenate(self._words) if self._words else np.zeros(0, dtype=np.int64)
        np.save(self.path / "offsets.npy", offsets)
        np.save(self.path / "doc_bytes.npy", doc_bytes)
        np.save(self.path / "doc_words.npy", doc_words)
        manifest = dict(manifest, format=FORMAT, dtype=self.dtype.name, n_docs=int(lengths.size),
                        n_tokens=int(offsets[-1]), n_bytes=int(doc_bytes.sum()), n_words=int(doc_words.sum()))
        tmp = self.path / (MANIFEST + ".tmp")
        tmp.write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
        os.replace(tmp, self.path / MANIFEST)
        return manifest

    def abort(self) -> None:
        self._tokens.close()


def read_manifest(path: str | os.PathLike) -> dict | None:
    """The manifest of a corpus folder, or None when there is none (or it is unreadable)."""
    try:
        return json.loads((Path(path) / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
