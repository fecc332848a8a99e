"""Corpora as iterators of whole documents, in a stable order: `open_source(name, split, path)`.

Sources (the `name`):
- `wikitext-103`, `wikitext-2`: raw Wikitext from the Hub (`Salesforce/wikitext`) or a local folder of
  `wiki.{train,valid,test}.raw`. The files are one line per paragraph; articles are rebuilt from the
  line structure. A top-level heading ` = Title = ` starts an article; section headings
  (` = = Section = = `) do not. A heading must stand between blank lines, because a few formula
  paragraphs also look like ` = ... = ` (test split, "Constant k filter"). Article text is the raw
  lines joined verbatim, so the articles' bytes and words add up to the file's (less the blank line
  before the first title).
- `fineweb`, `fineweb-edu`: the Hub's sample configs, streamed; the Hub has only a train split, so the
  first `holdout_docs` documents are `valid`, the next `holdout_docs` are `test`, the rest `train`.
  With `path`, or as source `bin`: the speedrun's `.bin` GPT-2 token shards, read without
  re-tokenizing (documents are token arrays; see shards.py).
- `pycode`: the Python files of the running interpreter's standard library, one document per file,
  a real offline corpus of long documents on every machine. Test-suite folders (`test`, `tests`,
  `idle_test`) and any `site-packages` inside the stdlib are skipped; `site_packages=True` adds the
  environment's own site-packages. Files go to train/valid/test (90/5/5) by a hash of their path
  relative to their root, so the split of a file never depends on which other files exist.
- `text`: a local .txt (one document per file), .jsonl (one per line) or .parquet (one per row)
  file, or a folder of them; `text_field` names the JSON key / column.

In a folder, the files of a split are those whose relative path has a part named after it
(`train`; `valid`, `validation`, `val`, `dev`; `test`), e.g. `valid.jsonl`, `fineweb_val_000000.bin`
or `test/part-0.parquet`; split `all` takes every file. A path that is a file is used for any split.
Bytes that are not valid UTF-8 are replaced (U+FFFD) and counted in `Source.stats`.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import sys
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Iterator

import numpy as np

from data_packing.errors import DataError
from data_packing.shards import GPT2_EOT, bin_documents

SOURCES = ("wikitext-103", "wikitext-2", "fineweb", "fineweb-edu", "bin", "pycode", "text", "recall")
SPLIT_ALIASES = {
    "train": ("train",),
    "valid": ("valid", "validation", "val", "dev"),
    "test": ("test",),
}
HF_WIKITEXT = {"wikitext-103": "wikitext-103-raw-v1", "wikitext-2": "wikitext-2-raw-v1"}
HF_FINEWEB = {"fineweb": "HuggingFaceFW/fineweb", "fineweb-edu": "HuggingFaceFW/fineweb-edu"}
TEXT_EXTS = (".txt", ".jsonl", ".parquet")
PYCODE_SKIP_DIRS = {"test", "tests", "idle_test", "__pycache__", "site-packages", "dist-packages"}


@dataclass
class Source:
    """A split of a corpus. Iterate it for documents: `str`, or token arrays when `pretokenized`."""

    name: str
    split: str
    identity: dict  # what names this corpus: goes into the cache fingerprint and the manifest
    documents: Callable[[], Iterator]
    pretokenized: str | None = None  # tokenizer family of pre-tokenized documents ("gpt2")
    stats: dict = field(default_factory=lambda: {"invalid_utf8_docs": 0})

    def __iter__(self) -> Iterator:
        return self.documents()


def canonical_split(split: str, allow_all: bool = False) -> str:
    s = split.strip().lower()
    for name, aliases in SPLIT_ALIASES.items():
        if s in aliases:
            return name
    if allow_all and s == "all":
        return "all"
    accepted = "train, valid (validation/val/dev), test" + (", all" if allow_all else "")
    raise DataError(f"unknown split {split!r}; accepted: {accepted}")


def open_source(name: str, split: str, path: str | os.PathLike | None = None, *, text_field: str = "text",
                config: str | None = None, site_packages: bool = False, holdout_docs: int = 10_000,
                recall: dict | None = None, recall_mix: dict | None = None) -> Source:
    """The documents of `split` of source `name`, from `path` when given, else from the Hub/stdlib.
    `recall_mix`: synthetic recall documents among them (`with_recall_mix`)."""
    if recall_mix:
        base = open_source(name, split, path, text_field=text_field, config=config,
                           site_packages=site_packages, holdout_docs=holdout_docs, recall=recall)
        return with_recall_mix(base, recall_mix)
    path = Path(path).expanduser().resolve() if path not in (None, "") else None
    if path is not None and not path.exists():
        raise DataError(f"{name}: path {path} does not exist")
    if name in HF_WIKITEXT:
        return _wikitext(name, canonical_split(split), path)
    if name == "bin" or (name in HF_FINEWEB and path is not None):
        if path is None:
            raise DataError("source 'bin' needs --path: a .bin shard or a folder of them")
        return _bin(name, canonical_split(split, allow_all=True), path)
    if name in HF_FINEWEB:
        return _fineweb_hub(name, canonical_split(split), config or "sample-10BT", holdout_docs)
    if name == "pycode":
        return _pycode(canonical_split(split, allow_all=True), site_packages)
    if name == "recall":
        return _recall(canonical_split(split), recall or {})
    if name == "text":
        if path is None:
            raise DataError("source 'text' needs --path: a .txt/.jsonl/.parquet file or a folder of them")
        return _text(canonical_split(split, allow_all=True), path, text_field)
    raise DataError(f"unknown source {name!r}; choose one of {', '.join(SOURCES)}")


# ---------------------------------------------------------------- Wikitext

def wikitext_articles(lines: Iterable[bytes]) -> Iterator[bytes]:
    """Articles of raw Wikitext given its lines (each with its b"\\n"); see the module docstring."""
    article: list[bytes] = []
    prev_blank = True  # the start of the file counts as a blank line
    it = iter(lines)
    line = next(it, None)
    while line is not None:
        nxt = next(it, None)
        if prev_blank and _is_title(line) and (nxt is None or not nxt.strip()):
            if any(x.strip() for x in article):  # the blank lines before the first title are no article
                yield b"".join(article)
            article = []
        article.append(line)
        prev_blank = not line.strip()
        line = nxt
    if any(x.strip() for x in article):
        yield b"".join(article)


def wikitext_hub_line(row_text: str) -> bytes:
    """A line of the raw file from a Hub row: rows keep their newline, but blank lines became ""."""
    return (row_text or " \n").encode("utf-8")


def _is_title(line: bytes) -> bool:
    s = line.rstrip(b"\r\n")
    return s.startswith(b" = ") and s.endswith(b" = ") and not s.startswith(b" = = ") and len(s) > 6


def _wikitext(name: str, split: str, path: Path | None) -> Source:
    if path is None:
        config = HF_WIKITEXT[name]
        hf_split = {"valid": "validation"}.get(split, split)

        def hub_lines():
            for row in _hub_rows("Salesforce/wikitext", config, hf_split):
                yield wikitext_hub_line(row["text"])

        identity = {"source": name, "hub": f"Salesforce/wikitext/{config}", "split": split}
        return _decoded(Source(name, split, identity, lambda: wikitext_articles(hub_lines())))
    file = path / f"wiki.{split}.raw" if path.is_dir() else path
    if not file.is_file():
        raise DataError(f"{name}: missing split file {file}")

    def file_lines():
        with open(file, "rb") as f:
            yield from f

    identity = {"source": name, "path": str(file), "split": split, "files": _stamp([file], file.parent)}
    return _decoded(Source(name, split, identity, lambda: wikitext_articles(file_lines())))


# ---------------------------------------------------------------- FineWeb

def _fineweb_hub(name: str, split: str, config: str, holdout_docs: int) -> Source:
    repo = HF_FINEWEB[name]
    lo, hi = {"valid": (0, holdout_docs), "test": (holdout_docs, 2 * holdout_docs),
              "train": (2 * holdout_docs, None)}[split]

    def docs():
        for i, row in enumerate(_hub_rows(repo, config, "train")):
            if hi is not None and i >= hi:
                return
            if i >= lo:
                yield row["text"]

    identity = {"source": name, "hub": f"{repo}/{config}", "split": split, "holdout_docs": holdout_docs}
    return Source(name, split, identity, docs)


def _bin(name: str, split: str, path: Path) -> Source:
    files = _files_for_split(path, split, (".bin",), name)
    identity = {"source": "bin", "path": str(path), "split": split, "files": _stamp(files, path)}
    return Source(name, split, identity, lambda: bin_documents(files, GPT2_EOT), pretokenized="gpt2")


def _hub_rows(repo: str, config: str, split: str) -> Iterator[dict]:
    try:
        import datasets
    except ImportError:
        raise DataError(f"reading {repo} from the Hub needs the `datasets` package (pip install datasets), "
                        "or give --path to a local copy") from None
    try:
        for row in datasets.load_dataset(repo, config, split=split, streaming=True):
            yield row
    except Exception as e:
        raise DataError(f"cannot stream {repo} ({config}, split {split}) from the Hugging Face Hub: "
                        f"{type(e).__name__}; give --path to a local copy instead") from None


# ---------------------------------------------------------------- Python standard library

def pycode_files(split: str, site_packages: bool = False) -> list[tuple[Path, str]]:
    """(file, relative path) of the stdlib's .py files in `split`, sorted by relative path."""
    roots = [("", Path(sysconfig.get_paths()["stdlib"]))]
    if site_packages:
        roots.append(("site-packages/", Path(sysconfig.get_paths()["purelib"])))
    out = []
    for prefix, root in roots:
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames[:] = [d for d in dirnames if d not in PYCODE_SKIP_DIRS]
            for fn in filenames:
                if fn.endswith(".py"):
                    file = Path(dirpath, fn)
                    rel = prefix + file.relative_to(root).as_posix()
                    if split == "all" or hash_split(rel) == split:
                        out.append((file, rel))
    return sorted(out, key=lambda fr: fr[1])


def hash_split(key: str, valid_pct: int = 5, test_pct: int = 5) -> str:
    """A deterministic train/valid/test assignment of `key` by its sha256 (stable across machines)."""
    bucket = int(hashlib.sha256(key.encode("utf-8")).hexdigest()[:8], 16) % 100
    return "valid" if bucket < valid_pct else "test" if bucket < valid_pct + test_pct else "train"


def _pycode(split: str, site_packages: bool) -> Source:
    files = pycode_files(split, site_packages)
    if not files:
        raise DataError(f"pycode: no .py files for split {split!r} under {sysconfig.get_paths()['stdlib']}")
    identity = {"source": "pycode", "split": split, "python": sys.version.split()[0],
                "stdlib": sysconfig.get_paths()["stdlib"], "site_packages": site_packages,
                "files": _stamp([f for f, _ in files], None)}

    def docs():
        for file, _ in files:
            yield _read_bytes(file)

    return _decoded(Source("pycode", split, identity, docs))


# ---------------------------------------------------------------- synthetic recall documents

def _recall(split: str, options: dict) -> Source:
    """`recall.py`'s training distribution; options: docs, min_gap, max_gap, max_pairs,
    max_queries, and filler (see `recall_filler`; with site_packages for pycode)."""
    from data_packing.recall import SPLIT_SEEDS, RecallTask
    options = {"docs": 20000, "min_gap": 16, "max_gap": 16384, "max_pairs": 4, "max_queries": 4,
               **options}
    n_docs = int(options.pop("docs"))
    if n_docs < 1:
        raise DataError(f"recall: docs must be >= 1, got {n_docs}")
    spec, site = options.pop("filler", ""), bool(options.pop("site_packages", False))
    filler = recall_filler(spec, split, site) if spec else None
    task = RecallTask(**options)
    if split != "train":   # held-out splits: a tenth of the documents, from their own seed
        n_docs = max(1, n_docs // 10)
    # version 2: filler refined until a query stands at its distance exactly (1 fell a few short);
    # 3: a stretch still short after that is continued by its own start (a cache built by 2
    # before that change holds other documents)
    identity = {"source": "recall", "split": split, "docs": n_docs, **options, "version": 3}
    if filler is not None:
        identity["filler"] = filler.identity

    def docs():
        if filler is not None:
            task.filler = filler_text(filler)
        return task.texts(SPLIT_SEEDS[split], n_docs)
    return Source("recall", split, identity, docs)


def with_recall_mix(base: Source, mix: dict) -> Source:
    """`base`'s documents with a `share` of their text (in characters) made into recall documents
    (data_packing/recall.py): after each document of base's passed on as it is, `share / (1 -
    share)` of its length is owed to recall documents, and while any is owed the next ones are
    made, so they are spread evenly through the stream. A recall document's filler is the text of
    base's next documents as they come (recall.StreamFiller: joined by blank lines, each character
    once), so the facts stand in the corpus's own text, the mix repeats none of it, and the model
    reads the same text it would without the mix, with facts and queries set in a share of it.
    The facts take the forms `templates`. `mix`: share, templates, and RecallTask's min_gap, max_gap,
    max_pairs, max_queries (gaps in characters: the documents are made as text, then tokenized
    with the corpus). What a language model trained on it learns from them: to keep a stated
    value and copy it when its key recurs, over gaps its own documents rarely show
    (data.recall_mix, docs/RESULTS.md)."""
    from data_packing.recall import SPLIT_SEEDS, RecallTask, StreamEnd, StreamFiller
    from data_packing.tokenizer import ByteTokenizer
    if base.pretokenized:
        raise DataError(f"{base.name}: recall documents are text; they cannot be mixed into "
                        f"pre-tokenized shards (data.recall_mix needs a text source)")
    if base.name == "recall":
        raise DataError("recall: data.recall_mix mixes recall documents into another corpus; "
                        "the recall source is made of them already")
    options = dict(mix)
    share = float(options.pop("share"))
    if not 0.0 < share < 1.0:
        raise DataError(f"recall mix: the share of recall documents must be in (0, 1), got {share}")
    options["templates"] = tuple(options.get("templates", ("sentence",)))
    task = RecallTask(**options)   # checks the gaps, counts and templates
    # version 3: the filler read from the stream (2 cut it from the first 32 MiB of the text,
    # drawn again and again; 2 as the recall source's 3: a mix cached by 1 held older documents)
    identity = {**base.identity, "recall_mix": {"share": share, **options,
                                                "templates": list(task.templates), "version": 3}}

    def docs():
        rng = np.random.default_rng([SPLIT_SEEDS.get(base.split, 0), 17])
        tok = ByteTokenizer()
        stream = iter(base)
        task.filler = filler = StreamFiller(stream)   # takes documents from the same stream
        owed, per_char = 0.0, share / (1.0 - share)
        for doc in stream:
            yield doc
            owed += per_char * len(doc)
            while owed > 0:
                try:
                    text = task.document(rng, tok).text
                except StreamEnd:   # the stream ran out inside a recall document: its unused text
                    rest = filler.rest()
                    if rest:
                        yield rest
                    return
                owed -= len(text)
                yield text

    return Source(base.name, base.split, identity, docs, stats=base.stats)


FILLER_CHARS = 32 * 2 ** 20


def recall_filler(spec: str, split: str, site_packages: bool = False) -> Source:
    """The source a recall corpus cuts its filler from (`data.recall_filler`): "pycode" (with
    `site_packages`) or the path of a `text` source; its split `split`, so that held-out recall
    documents stand in held-out text."""
    if spec == "pycode":
        return open_source("pycode", split, site_packages=site_packages)
    return open_source("text", split, spec)


def filler_text(source: Source, limit: int = FILLER_CHARS) -> str:
    """The documents of `source` joined by blank lines, up to `limit` characters: the text
    recall.TextFiller cuts stretches from."""
    parts, n = [], 0
    for doc in source:
        parts.append(doc)
        n += len(doc) + 2
        if n >= limit:
            break
    text = "\n\n".join(parts)[:limit]
    if len(text.strip()) < 64:
        raise DataError(f"recall filler: {source.name} ({source.split}) has "
                        f"{len(text.strip())} characters of text; it needs at least 64")
    return text


# ---------------------------------------------------------------- local text files

def _text(split: str, path: Path, text_field: str) -> Source:
    files = _files_for_split(path, split, TEXT_EXTS, "text")
    identity = {"source": "text", "path": str(path), "split": split, "text_field": text_field,
                "files": _stamp(files, path)}

    def docs():
        for file in files:
            if file.suffix == ".txt":
                yield _read_bytes(file)
            elif file.suffix == ".jsonl":
                yield from _jsonl_texts(file, text_field)
            else:
                yield from _parquet_texts(file, text_field)

    return _decoded(Source("text", split, identity, docs))


def _jsonl_texts(file: Path, text_field: str) -> Iterator[bytes]:
    with open(file, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            try:
                # surrogateescape keeps invalid bytes as lone surrogates, which the encode below turns
                # back into invalid UTF-8 for _decoded() to replace and count.
                row = json.loads(raw.decode("utf-8", errors="surrogateescape"))
            except json.JSONDecodeError as e:
                raise DataError(f"{file}:{lineno}: not valid JSON ({e.msg})") from None
            if not isinstance(row, dict) or not isinstance(row.get(text_field), str):
                raise DataError(f"{file}:{lineno}: no string field {text_field!r} (set --text-field)")
            try:
                yield row[text_field].encode("utf-8", errors="surrogateescape")
            except UnicodeEncodeError:  # a lone surrogate from a JSON \u escape
                yield row[text_field].encode("utf-8", errors="surrogatepass")


def _parquet_texts(file: Path, text_field: str) -> Iterator[str]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(f"{file}: reading .parquet needs the `pyarrow` package "
                        "(pip install pyarrow)") from None
    try:
        pf = pq.ParquetFile(file)
    except Exception as e:
        raise DataError(f"{file}: not a readable parquet file ({type(e).__name__})") from None
    if text_field not in pf.schema_arrow.names:
        raise DataError(f"{file}: no column {text_field!r} (columns: {', '.join(pf.schema_arrow.names)}); "
                        "set --text-field")
    for batch in pf.iter_batches(columns=[text_field], batch_size=1024):
        for text in batch.column(0).to_pylist():
            yield text or ""


def _files_for_split(path: Path, split: str, exts: tuple[str, ...], name: str) -> list[Path]:
    if path.is_file():
        if path.suffix not in exts:
            raise DataError(f"{name}: {path} is not a {'/'.join(exts)} file")
        return [path]
    aliases = SPLIT_ALIASES.get(split, ())
    files = []
    for file in sorted(path.rglob("*")):
        if file.suffix in exts and file.is_file():
            parts = re.split(r"[._\-/]", file.relative_to(path).with_suffix("").as_posix().lower())
            if split == "all" or any(p in aliases for p in parts):
                files.append(file)
    if not files:
        raise DataError(f"{name}: no {'/'.join(exts)} files for split {split!r} under {path} (file or "
                        f"folder names must contain one of: {', '.join(aliases) or 'anything'})")
    return files


# ---------------------------------------------------------------- helpers

def _decoded(source: Source) -> Source:
    """Wrap a source of UTF-8 bytes (or str) so it yields str, replacing and counting invalid bytes."""
    raw_docs = source.documents

    def docs():
        source.stats["invalid_utf8_docs"] = 0
        for doc in raw_docs():
            if isinstance(doc, bytes):
                try:
                    doc = doc.decode("utf-8")
                except UnicodeDecodeError:
                    source.stats["invalid_utf8_docs"] += 1
                    doc = doc.decode("utf-8", errors="replace")
            yield doc

    source.documents = docs
    return source


def _read_bytes(file: Path) -> bytes:
    try:
        return file.read_bytes()
    except OSError as e:
        raise DataError(f"cannot read {file}: {e.strerror or e}") from None


def _stamp(files: list[Path], root: Path | None) -> str:
    """A hash of the names, sizes and modification times of `files`: a changed file changes it."""
    h = hashlib.sha256()
    for f in files:
        st = f.stat()
        rel = f.relative_to(root).as_posix() if root is not None else str(f)
        h.update(f"{rel}\t{st.st_size}\t{st.st_mtime_ns}\n".encode("utf-8"))
    return h.hexdigest()[:16]

