"""The `.bin` token shards of the NanoGPT speedrun (modded-nanogpt's FineWeb files), read and written.

Layout: a header of 256 little-endian int32 (magic 20240520, version 1, token count, then zeros),
followed by that many uint16 GPT-2 token ids. Every document starts with <|endoftext|> (50256), and a
document that did not fit in one shard continues at the start of the next, so documents are rebuilt
across shard boundaries: the part of a shard before its first 50256 belongs to the previous shard's
last document.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np

from data_packing.errors import DataError

MAGIC = 20240520
VERSION = 1
HEADER_INTS = 256
HEADER_BYTES = HEADER_INTS * 4
GPT2_EOT = 50256


def write_bin_shard(path: str | os.PathLike, tokens) -> Path:
    """Write `tokens` (ids < 65536) as a .bin shard; used by tests and to export corpora."""
    tokens = np.asarray(tokens)
    if tokens.size and (tokens.min() < 0 or tokens.max() >= 2**16):
        raise DataError(f"{path}: token ids must lie in [0, 65536) to fit a uint16 .bin shard")
    header = np.zeros(HEADER_INTS, dtype="<i4")
    header[:3] = (MAGIC, VERSION, tokens.size)
    path = Path(path)
    with open(path, "wb") as f:
        f.write(header.tobytes())
        f.write(tokens.astype("<u2").tobytes())
    return path


def read_bin_shard(path: str | os.PathLike) -> np.ndarray:
    """The tokens of one shard as a read-only uint16 memmap, after checking header and file size."""
    path = Path(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            raw = f.read(HEADER_BYTES)
    except OSError as e:
        raise DataError(f"{path}: cannot read .bin shard ({e.strerror or e})") from None
    header = np.frombuffer(raw[: len(raw) // 4 * 4], dtype="<i4")
    if header.size < 3 or (header.size < HEADER_INTS and header[0] == MAGIC):
        raise DataError(f"{path}: truncated .bin shard, {size} bytes is shorter than the "
                        f"{HEADER_BYTES}-byte header")
    if header[0] != MAGIC:
        raise DataError(f"{path}: not a .bin token shard (magic {int(header[0])}, expected {MAGIC})")
    if header[1] != VERSION:
        raise DataError(f"{path}: unsupported .bin shard version {int(header[1])} (expected {VERSION})")
    n = int(header[2])
    expected = HEADER_BYTES + 2 * n
    if n < 0 or size != expected:
        raise DataError(f"{path}: truncated or padded .bin shard, header says {n} tokens "
                        f"({expected} bytes) but the file has {size} bytes")
    if n == 0:
        return np.zeros(0, dtype=np.uint16)
    return np.memmap(path, dtype="<u2", mode="r", offset=HEADER_BYTES, shape=(n,))


def bin_documents(paths: Iterable[str | os.PathLike], eot: int = GPT2_EOT) -> Iterator[np.ndarray]:
    """Documents (token arrays without their separator) of shards read in the given order.

    Empty documents (two separators in a row) are yielded as empty arrays, for the caller to count.
    """
    carry: list[np.ndarray] = []  # the unfinished last document of the previous shards
    started = False  # whether any separator has been seen: text before the first one is a document too
    for path in paths:
        tokens = read_bin_shard(path)
        cuts = np.flatnonzero(tokens == eot)
        if cuts.size == 0:
            carry.append(np.asarray(tokens))
            continue
        head = tokens[: cuts[0]]
        if carry or head.size or started:
            yield np.concatenate(carry + [np.asarray(head)]) if carry else np.array(head)
        carry = []
        started = True
        for a, b in zip(cuts[:-1], cuts[1:]):
            yield np.array(tokens[a + 1 : b])
        carry = [np.array(tokens[cuts[-1] + 1 :])]
    if carry and (started or sum(c.size for c in carry)):
        yield np.concatenate(carry)
