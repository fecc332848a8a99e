"""Tokenize a source once into a cached corpus folder: `build_corpus`, `get_corpus`, and the CLI.

    python -m data_packing.prepare --source wikitext-103 --path DIR --split valid \
        --tokenizer EleutherAI/pythia-70m-deduped --out cache/wt103-valid

Documents are read in order in this process and tokenized in batches by a pool of worker processes
(every core; results are collected in submission order, so the output does not depend on the number
of workers, and at most a few batches are in flight, so memory stays flat on any corpus size).
Everything is written into a hidden temporary folder beside the target, which is renamed into
place only once complete: a killed prepare leaves nothing that opens as a corpus. A target whose
manifest was built for another request is refused (or, with force, rebuilt), never reused.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import multiprocessing as mp
import os
import re
import secrets
import shutil
import signal
import sys
import time
from collections import deque
from pathlib import Path

import numpy as np

from data_packing.errors import DataError
from data_packing.sources import SOURCES, Source, open_source
from data_packing.tokenized import CorpusWriter, TokenizedCorpus, read_manifest
from data_packing.tokenizer import ByteTokenizer, load_tokenizer

PYTHIA = "EleutherAI/pythia-70m-deduped"
DEFAULT_TOKENIZER = {"wikitext-103": PYTHIA, "wikitext-2": PYTHIA, "fineweb": "gpt2", "fineweb-edu": "gpt2",
                     "bin": "gpt2", "pycode": "bytes", "text": "bytes"}
BATCH_CHARS = 1 << 20  # text per worker task: large enough to amortize the pipe, small enough to balance


def corpus_request(source: Source, tokenizer, append_eot: bool = True, dtype: str = "auto") -> dict:
    """What a cached corpus is built from. Two corpora with equal requests are interchangeable."""
    return {"source": source.identity, "tokenizer": tokenizer.fingerprint, "append_eot": bool(append_eot),
            "dtype": resolve_dtype(tokenizer, dtype).name}


def request_fingerprint(request: dict) -> str:
    return hashlib.sha256(json.dumps(request, sort_keys=True).encode("utf-8")).hexdigest()[:16]


def resolve_dtype(tokenizer, dtype: str = "auto") -> np.dtype:
    """uint16 when every id fits (vocab_size <= 65536), else uint32; an explicit dtype is checked."""
    if dtype == "auto":
        return np.dtype(np.uint16 if tokenizer.vocab_size <= 2**16 else np.uint32)
    if dtype not in ("uint16", "uint32"):
        raise DataError(f"unknown token dtype {dtype!r}; accepted: auto, uint16, uint32")
    if tokenizer.vocab_size > np.iinfo(dtype).max + 1:
        raise DataError(f"tokenizer {tokenizer.name} has {tokenizer.vocab_size} ids, which do not fit "
                        f"{dtype} (at most {np.iinfo(dtype).max + 1}); use dtype auto or uint32")
    return np.dtype(dtype)


def build_corpus(source: Source, tokenizer, out_dir: str | os.PathLike, *, append_eot: bool = True,
                 dtype: str = "auto", workers: int | None = None, progress: bool = True,
                 force: bool = False) -> TokenizedCorpus:
    """Tokenize `source` into `out_dir` (or reuse it when it holds exactly this request)."""
    tokenizer = load_tokenizer(tokenizer)
    out_dir = Path(out_dir)
    request = corpus_request(source, tokenizer, append_eot, dtype)
    if append_eot and tokenizer.eot_id is None:
        raise DataError(f"tokenizer {tokenizer.name} has no end-of-text token; build without one "
                        "(--no-eot) or choose another tokenizer")
    if source.pretokenized == "gpt2" and (tokenizer.eot_id != 50256 or tokenizer.vocab_size < 50257):
        raise DataError(f"{source.name}: .bin shards hold GPT-2 token ids, so the tokenizer must be GPT-2's "
                        f"(got {tokenizer.name}, eot id {tokenizer.eot_id})")
    replace = out_dir.exists()
    if replace:
        existing = read_manifest(out_dir)
        if existing is not None and existing.get("request") == request:
            try:
                return TokenizedCorpus.open(out_dir)
            except DataError as e:
                if not force:
                    raise
                print(f"rebuilding: {e}", file=sys.stderr)
        elif existing is None and any(out_dir.iterdir()):
            raise DataError(f"{out_dir} exists and is not a tokenized corpus; choose another output folder")
        elif existing is not None and not force:
            differs = _diff(existing.get("request"), request)
            if differs.startswith("tokenizer:"):  # name them: fingerprints alone say little
                had = existing.get("tokenizer", {}).get("name")
                differs = f"tokenizer: {had} there, {tokenizer.name} asked"
            raise DataError(f"{out_dir} holds a corpus built for another request ({differs}); "
                            "pass --force to rebuild it or choose another output folder")

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_dir.parent / f".{out_dir.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
    start = time.time()
    try:
        dtype_ = np.dtype(request["dtype"])
        writer = CorpusWriter(tmp, dtype_)
        n_workers = max(1, workers or _cpu_count())
        stats = _tokenize_into(writer, source, tokenizer, append_eot, dtype_, n_workers, progress)
        tokenizer.save(tmp / "tokenizer")
        manifest = writer.finish({
            "request": request, "fingerprint": request_fingerprint(request),
            "source": source.name, "split": source.split, "path": source.identity.get("path"),
            "tokenizer": {"name": tokenizer.name, "fingerprint": tokenizer.fingerprint,
                          "vocab_size": tokenizer.vocab_size, "eot_id": tokenizer.eot_id},
            "append_eot": bool(append_eot), **stats, **source.stats,
            "workers": n_workers, "seconds": round(time.time() - start, 3),
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        })
        _publish(tmp, out_dir, request, replace)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if progress:
        rate = manifest["n_tokens"] / max(manifest["seconds"], 1e-9)
        m = manifest
        bad = m.get("invalid_utf8_docs", 0)
        replaced = (f"; {bad} document{'s' * (bad != 1)} had bytes that are not UTF-8, replaced by "
                    f"U+FFFD" if bad else "")
        print(f"{out_dir}: {m['n_docs']} docs, {m['n_tokens']} tokens, {m['n_bytes']} bytes, "
              f"{m['n_words']} words in {m['seconds']:.1f}s ({rate / 1e6:.2f}M tokens/s){replaced}",
              file=sys.stderr)
    return TokenizedCorpus.open(out_dir)


def get_corpus(source: str, split: str, tokenizer_spec, cache_root: str | os.PathLike,
               path: str | os.PathLike | None = None, *, append_eot: bool = True, dtype: str = "auto",
               workers: int | None = None, progress: bool = True, **source_options) -> TokenizedCorpus:
    """The cached corpus of (source, path, split, tokenizer, eot), built under `cache_root` if missing.

    The subfolder is named by the fingerprint of that request, so a changed request gets its own
    folder; a folder of that name that does not match (corrupt, older format) is rebuilt.
    """
    src = open_source(source, split, path, **source_options)
    tokenizer = load_tokenizer(tokenizer_spec)
    request = corpus_request(src, tokenizer, append_eot, dtype)
    name = re.sub(r"[^A-Za-z0-9_.-]+", "_", f"{src.name}-{src.split}-{tokenizer.name}")
    out_dir = Path(cache_root) / f"{name}-{request_fingerprint(request)}"
    return build_corpus(src, tokenizer, out_dir, append_eot=append_eot, dtype=dtype, workers=workers,
                        progress=progress, force=True)


# ---------------------------------------------------------------- the tokenizing pipeline

def _tokenize_into(writer: CorpusWriter, source: Source, tokenizer, append_eot: bool, dtype: np.dtype,
                   n_workers: int, progress: bool) -> dict:
    from tqdm import tqdm

    stats = {"skipped_empty_docs": 0}
    config = (tokenizer, append_eot, dtype)
    bar = tqdm(desc=f"tokenizing {source.name}/{source.split}", unit=" docs", disable=not progress,
               dynamic_ncols=True, mininterval=0.5)

    def collect(result):
        tokens, lengths, doc_bytes, doc_words, n_empty = result
        writer.add(tokens, lengths, doc_bytes, doc_words)
        stats["skipped_empty_docs"] += n_empty
        bar.update(lengths.size + n_empty)

    try:
        if n_workers == 1:
            _init_worker(*config)
            for batch in _batches(source):
                collect(_encode_batch(batch))
        else:
            with _worker_pool(n_workers, config) as pool:
                pending: deque = deque()
                for batch in _batches(source):
                    pending.append(pool.apply_async(_encode_batch, (batch,)))
                    if len(pending) >= 2 * n_workers:  # bounded: the reader never runs far ahead
                        collect(pending.popleft().get())
                while pending:
                    collect(pending.popleft().get())
    except BaseException:
        writer.abort()
        raise
    finally:
        bar.close()
    return stats


def _batches(source: Source):
    batch, size = [], 0
    for doc in source:
        batch.append(doc)
        size += len(doc)
        if size >= BATCH_CHARS or len(batch) >= 4096:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def _worker_pool(n_workers: int, config: tuple):
    # Not "fork": the caller (a trainer, eval.py, a test runner) has threads, torch's among them,
    # and a child forked while one of them holds a lock can wait on it forever, and the pool with
    # it. A forkserver forks the workers from a fresh single-threaded process; they are given the
    # tokenizer pickled. Setting TOKENIZERS_PARALLELISM stops the Rust library from starting its
    # own threads in each worker: the workers are the parallelism.
    methods = mp.get_all_start_methods()
    method = "forkserver" if "forkserver" in methods else "spawn"
    old = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    try:
        return mp.get_context(method).Pool(n_workers, initializer=_init_pool_worker, initargs=config)
    finally:
        if old is None:
            del os.environ["TOKENIZERS_PARALLELISM"]
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = old


_WORKER: dict = {}


def _init_worker(tokenizer, append_eot: bool, dtype: np.dtype) -> None:
    _WORKER.update(tokenizer=tokenizer, append_eot=append_eot, dtype=np.dtype(dtype))


def _init_pool_worker(*config) -> None:
    # A worker must not keep a graceful SIGTERM handler (a trainer or eval.py turns SIGTERM into a
    # graceful stop, and a worker started by fork inherits it): then Pool.terminate()'s SIGTERM
    # would no longer end it and the pool would wait forever. Workers die on SIGTERM and leave
    # Ctrl-C to the parent.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _init_worker(*config)


def _encode_batch(docs: list) -> tuple:
    """Tokens (concatenated), lengths, bytes and words of the non-empty documents, and the empty count."""
    tok, append_eot, dtype = _WORKER["tokenizer"], _WORKER["append_eot"], _WORKER["dtype"]
    if docs and not isinstance(docs[0], str):  # pre-tokenized: count bytes and words on the decoded text
        arrays = [np.asarray(d) for d in docs if len(d)]
        texts = [tok.decode(a) for a in arrays]
    else:
        texts = [d for d in docs if d.strip()]
        if isinstance(tok, ByteTokenizer):
            arrays = [np.frombuffer(t.encode("utf-8"), dtype=np.uint8) for t in texts]
        else:
            arrays = [np.asarray(ids, dtype=np.int64) for ids in tok.encode_batch(texts)]
        keep = [i for i, a in enumerate(arrays) if a.size]  # text that tokenizes to nothing is empty too
        if len(keep) < len(arrays):
            arrays, texts = [arrays[i] for i in keep], [texts[i] for i in keep]
    n_empty = len(docs) - len(arrays)
    lengths = np.array([a.size + append_eot for a in arrays], dtype=np.int64)
    out = np.empty(int(lengths.sum()), dtype=dtype)
    pos = 0
    for a in arrays:
        out[pos : pos + a.size] = a
        pos += a.size
        if append_eot:
            out[pos] = tok.eot_id
            pos += 1
    doc_bytes = np.array([len(t.encode("utf-8", errors="replace")) for t in texts], dtype=np.int64)
    doc_words = np.array([len(t.split()) for t in texts], dtype=np.int64)
    return out, lengths, doc_bytes, doc_words, n_empty


def _publish(tmp: Path, out_dir: Path, request: dict, replace: bool) -> None:
    """Move the finished folder into place atomically, replacing the old corpus there if `replace`."""
    if not replace and (read_manifest(out_dir) or {}).get("request") == request:
        shutil.rmtree(tmp, ignore_errors=True)  # another process (rank) published the same corpus first
        return
    trash = None
    if out_dir.exists():
        trash = out_dir.parent / f".{out_dir.name}.old-{os.getpid()}-{secrets.token_hex(4)}"
        os.rename(out_dir, trash)
    try:
        os.rename(tmp, out_dir)
    except OSError:
        if (read_manifest(out_dir) or {}).get("request") != request:
            raise DataError(f"{out_dir} appeared while building and holds another corpus; "
                            "try again") from None
        shutil.rmtree(tmp, ignore_errors=True)
    if trash is not None:
        shutil.rmtree(trash, ignore_errors=True)


def _diff(old, new, prefix: str = "") -> str:
    """A short description of where two requests differ, for the refusal message."""
    if isinstance(old, dict) and isinstance(new, dict):
        for key in sorted(set(old) | set(new)):
            if old.get(key) != new.get(key):
                return _diff(old.get(key), new.get(key), f"{prefix}{key}.")
    return f"{prefix.rstrip('.') or 'request'}: {old!r} there, {new!r} asked"


def _cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


# ---------------------------------------------------------------- CLI

def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m data_packing.prepare", description=__doc__.split("\n\n")[0])
    p.add_argument("--source", required=True, help=" | ".join(SOURCES))
    p.add_argument("--path", default=None, help="local file or folder (default: Hub; stdlib for pycode)")
    p.add_argument("--split", default="train", help="train | valid | test (| all for pycode/text/bin)")
    p.add_argument("--tokenizer", default=None,
                   help="bytes | tokenizer.json or its folder | GPT-2 folder | Hub id (default: per source, "
                        "e.g. Pythia's for Wikitext)")
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument("--no-eot", action="store_true", help="no end-of-text token after each document")
    p.add_argument("--dtype", default="auto", help="auto | uint16 | uint32")
    p.add_argument("--text-field", default="text", help="JSON key / parquet column of the text (source text)")
    p.add_argument("--config", default=None, help="Hub config for fineweb (default sample-10BT)")
    p.add_argument("--workers", type=int, default=None, help="worker processes (default: every core)")
    p.add_argument("--force", action="store_true", help="rebuild a corpus built for another request")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    args = p.parse_args(argv)
    try:
        options = {"text_field": args.text_field}
        if args.config:
            options["config"] = args.config
        source = open_source(args.source, args.split, args.path, **options)
        tokenizer = load_tokenizer(args.tokenizer or DEFAULT_TOKENIZER.get(args.source, "bytes"))
        corpus = build_corpus(source, tokenizer, args.out, append_eot=not args.no_eot, dtype=args.dtype,
                              workers=args.workers, progress=not args.quiet, force=args.force)
    except DataError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("error: interrupted; nothing was written", file=sys.stderr)
        return 130
    m = corpus.manifest
    print(json.dumps({k: m[k] for k in ("source", "split", "n_docs", "n_tokens", "n_bytes", "n_words",
                                        "skipped_empty_docs", "invalid_utf8_docs", "fingerprint")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
