"""Tokenizers behind one small interface, and `load_tokenizer(spec)` to get one from a name or path.

Two kinds cover everything we train on:
- `HFTokenizer` wraps a Hugging Face `tokenizers` JSON (GPT-NeoX-20B / Pythia, anything on the Hub) or
  GPT-2's original `vocab.json` + `merges.txt`, rebuilt here as the same byte-level BPE.
- `ByteTokenizer` needs no file: ids 0..255 are UTF-8 bytes and 256 is the end-of-text token.

Each has `encode`, `encode_batch`, `decode`, `vocab_size`, `eot_id`, `name`, `save(dir)` and a
`fingerprint`: the sha256 of its canonical content, so a cache built with one tokenizer is never read
with another. Special tokens are never added by `encode`; the corpus builder appends `eot_id` itself.

`save(dir)` also writes what transformers' `AutoTokenizer.from_pretrained(dir)` reads: a
`tokenizer.json` (for the byte tokenizer, `ByteTokenizer.hf_tokenizer()`: a byte-level BPE without
merges whose ids are the bytes, giving the same ids and text) and a `tokenizer_config.json` naming
`PreTrainedTokenizerFast` and the end-of-text token as its eos token.
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Protocol, Sequence

import numpy as np

from data_packing.errors import DataError

# Names a vocabulary may give its end-of-text token, most common first.
EOT_CANDIDATES = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>")
BYTES_MARKER = "bytes_tokenizer.json"


class Tokenizer(Protocol):
    name: str
    vocab_size: int
    eot_id: int | None
    fingerprint: str

    def encode(self, text: str) -> list[int]: ...
    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]: ...
    def decode(self, ids: Sequence[int]) -> str: ...
    def save(self, directory: str | os.PathLike) -> Path: ...


class ByteTokenizer:
    """UTF-8 bytes as tokens (0..255) plus an end-of-text token 256: vocab_size 257, no file needed."""

    name = "bytes"
    vocab_size = 257
    eot_id = 256
    fingerprint = "bytes-utf8-eot256-v1"

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [list(t.encode("utf-8")) for t in texts]

    def decode(self, ids: Sequence[int]) -> str:
        """The text of `ids`, the end-of-text id and any id past 255 dropped, invalid UTF-8
        replaced."""
        a = np.asarray(ids, dtype=np.int64).reshape(-1)
        if a.size and (a.min() < 0 or a.max() > 255):
            a = a[(a >= 0) & (a < 256)]
        return a.astype(np.uint8).tobytes().decode("utf-8", errors="replace")

    def save(self, directory: str | os.PathLike) -> Path:
        """The marker file load_tokenizer reads, and beside it the same tokenizer for transformers
        (hf_tokenizer). Returns the marker's path."""
        path = Path(directory) / BYTES_MARKER
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"type": "bytes", "fingerprint": self.fingerprint}) + "\n")
        self.hf_tokenizer().save(str(path.parent / "tokenizer.json"))
        # split_special_tokens: the text "<|endoftext|>" is its 13 bytes, as encode() gives it
        _write_transformers_config(path.parent, EOT_CANDIDATES[0], split_special_tokens=True)
        return path

    def hf_tokenizer(self):
        """This tokenizer as a Hugging Face `tokenizers.Tokenizer`: the same ids for any text
        and the same text for any ids (decode drops the end-of-text id and ids past it, and
        replaces invalid UTF-8 as bytes.decode(errors="replace") does).

        A byte-level BPE without merges: the ByteLevel pre-tokenizer maps every byte to one
        printable character (GPT-2's table) and the vocabulary maps that character to the byte's
        value; the end-of-text token is a special token at id 256 that decodes to nothing."""
        from tokenizers import AddedToken, Tokenizer as _Tok, decoders, models, pre_tokenizers

        vocab = {char: byte for byte, char in enumerate(_byte_chars())}
        tok = _Tok(models.BPE(vocab=vocab, merges=[]))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        eot = EOT_CANDIDATES[0]
        tok.decoder = decoders.Sequence([decoders.Replace(eot, ""), decoders.ByteLevel()])
        tok.add_special_tokens([AddedToken(eot, special=True)])
        assert tok.token_to_id(eot) == self.eot_id
        return tok

    def __repr__(self) -> str:
        return "ByteTokenizer()"


class HFTokenizer:
    """A Hugging Face `tokenizers.Tokenizer` with the common interface."""

    def __init__(self, tokenizer, name: str, eot_token: str | None = None):
        self.tokenizer = tokenizer
        self.name = name
        vocab = tokenizer.get_vocab(with_added_tokens=True)
        self.vocab_size = max(vocab.values()) + 1
        if eot_token is not None and eot_token not in vocab:
            raise DataError(f"tokenizer {name}: end-of-text token {eot_token!r} is not in its vocabulary")
        names = (eot_token,) if eot_token is not None else EOT_CANDIDATES
        self.eot_id = next((vocab[t] for t in names if t in vocab), None)
        # Canonical JSON (sorted keys) so the hash does not depend on how the file was formatted.
        canonical = json.dumps(json.loads(tokenizer.to_str()), sort_keys=True, ensure_ascii=False)
        self.fingerprint = hashlib.sha256(canonical.encode("utf-8")).hexdigest()

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [e.ids for e in self.tokenizer.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=False)

    def save(self, directory: str | os.PathLike) -> Path:
        """tokenizer.json (what load_tokenizer reads) and transformers' tokenizer_config.json."""
        path = Path(directory) / "tokenizer.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        self.tokenizer.save(str(path))
        eot = None if self.eot_id is None else self.tokenizer.id_to_token(self.eot_id)
        _write_transformers_config(path.parent, eot)
        return path

    def __repr__(self) -> str:
        return f"HFTokenizer({self.name!r}, vocab_size={self.vocab_size}, eot_id={self.eot_id})"


def _byte_chars() -> list[str]:
    """GPT-2's printable stand-in for every byte 0..255 (the ByteLevel pre-tokenizer's table):
    printable Latin-1 bytes stand for themselves, the others for chr(256 + n) in byte order."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, n = {}, 0
    for b in range(256):
        if b in kept:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + n)
            n += 1
    return [chars[b] for b in range(256)]


def _write_transformers_config(directory: Path, eos_token: str | None,
                               split_special_tokens: bool = False) -> None:
    """tokenizer_config.json, so that transformers' AutoTokenizer reads tokenizer.json as a
    PreTrainedTokenizerFast with the end-of-text token as eos (no model registration needed)."""
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False}
    if eos_token is not None:
        config["eos_token"] = eos_token
    if split_special_tokens:
        config["split_special_tokens"] = True
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


def gpt2_from_files(vocab_json: Path, merges_txt: Path, name: str = "gpt2") -> HFTokenizer:
    """GPT-2's byte-level BPE from OpenAI's encoder.json/vocab.bpe (alias vocab.json/merges.txt)."""
    from tokenizers import Tokenizer as _Tok, decoders, models, pre_tokenizers

    try:
        tok = _Tok(models.BPE.from_file(str(vocab_json), str(merges_txt)))
    except Exception as e:  # tokenizers raises plain Exception on malformed files
        raise DataError(f"cannot read GPT-2 BPE files {vocab_json} + {merges_txt}: "
                        f"{_first_line(e)}") from None
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|endoftext|>"])  # already id 50256 in the vocabulary; marks it special
    return HFTokenizer(tok, name)


def load_tokenizer(spec, eot_token: str | None = None) -> Tokenizer:
    """Build a tokenizer from `spec`:

    - "bytes": the byte-level tokenizer;
    - a path to a tokenizer.json, or to a folder holding tokenizer.json, bytes_tokenizer.json, or
      GPT-2's vocab.json + merges.txt;
    - a Hugging Face Hub id ("EleutherAI/pythia-70m-deduped"): its tokenizer.json is downloaded;
    - an object that already is a tokenizer (returned as is).
    """
    if not isinstance(spec, (str, os.PathLike)):
        return spec
    text = os.fspath(spec)
    if text == "bytes":
        return ByteTokenizer()
    path = Path(text).expanduser()
    if path.is_dir():
        return _load_dir(path, eot_token)
    if path.is_file():
        return _load_file(path, path.parent.name if path.name == "tokenizer.json" else path.stem, eot_token)
    if text.startswith(("/", ".", "~")) or text.endswith(".json") or text.count("/") > 1:
        raise DataError(f"tokenizer {text!r}: no such file or folder")
    return _load_hub(text, eot_token)


def _load_dir(path: Path, eot_token: str | None) -> Tokenizer:
    if (path / BYTES_MARKER).is_file():   # first: ByteTokenizer.save writes a tokenizer.json too
        return ByteTokenizer()
    if (path / "tokenizer.json").is_file():
        return _load_file(path / "tokenizer.json", path.name, eot_token)
    if (path / "vocab.json").is_file() and (path / "merges.txt").is_file():
        return gpt2_from_files(path / "vocab.json", path / "merges.txt", name=path.name)
    raise DataError(f"tokenizer folder {path} holds neither tokenizer.json, {BYTES_MARKER}, "
                    "nor vocab.json + merges.txt")


def _load_file(path: Path, name: str, eot_token: str | None) -> Tokenizer:
    from tokenizers import Tokenizer as _Tok

    try:
        head = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DataError(f"tokenizer file {path} is not readable JSON: {_first_line(e)}") from None
    if isinstance(head, dict) and head.get("type") == "bytes":
        return ByteTokenizer()
    try:
        tok = _Tok.from_file(str(path))
    except Exception as e:
        raise DataError(f"tokenizer file {path} is not a Hugging Face tokenizers JSON: "
                        f"{_first_line(e)}") from None
    return HFTokenizer(tok, name, eot_token)


def _load_hub(repo_id: str, eot_token: str | None) -> Tokenizer:
    from huggingface_hub import hf_hub_download

    try:  # the local Hub cache first: no network round trip when it is there
        path = hf_hub_download(repo_id, "tokenizer.json", local_files_only=True)
    except Exception:
        try:
            path = hf_hub_download(repo_id, "tokenizer.json")
        except Exception as e:
            raise DataError(f"tokenizer {repo_id!r}: not a local path, and tokenizer.json could not be "
                            f"fetched from the Hugging Face Hub ({type(e).__name__}); give a local "
                            "tokenizer.json or folder instead") from None
    return _load_file(Path(path), repo_id, eot_token)


def _first_line(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return lines[0] if lines else type(e).__name__
