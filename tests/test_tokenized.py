"""Tokenizers and the tokenized corpus cache: counts, round trips, and caches that are never misused."""
import json
import re
import unicodedata

import numpy as np
import pytest
import tokenizers

from data_packing import (ByteTokenizer, DataError, TokenizedCorpus, build_corpus, get_corpus, load_tokenizer,
                          open_source)
from data_packing.prepare import main as prepare_main, resolve_dtype
from data_packing.shards import write_bin_shard
from data_packing.sources import Source


@pytest.fixture(scope="session")
def neox_path(shared_data):
    return shared_data / "tokenizers" / "gpt-neox-20b" / "tokenizer.json"


@pytest.fixture(scope="session")
def wikitext(tmp_path_factory, shared_data, neox_path):
    """The local Wikitext-103 valid and test splits, tokenized once with GPT-NeoX for the session."""
    root = tmp_path_factory.mktemp("cache")
    folder = shared_data / "wikitext-103-raw"
    return {s: get_corpus("wikitext-103", s, neox_path, root, path=folder, progress=False)
            for s in ("valid", "test")}


def split_articles(raw: str) -> list[str]:
    """Cut before every ` = Title = ` line that has a blank line on both sides; drop the blank preamble."""
    pieces = re.split(r"(?m)(?<=^ \n)(?= = [^=\n][^\n]* = \n \n)", raw)
    return [p for p in pieces if p.strip()]


@pytest.mark.parametrize("split", ["valid", "test"])
def test_wikitext_counts_match_the_raw_files(wikitext, shared_data, neox_path, split):
    raw = (shared_data / "wikitext-103-raw" / f"wiki.{split}.raw").read_text(encoding="utf-8")
    corpus, m = wikitext[split], wikitext[split].manifest
    articles = split_articles(raw)
    neox = tokenizers.Tokenizer.from_file(str(neox_path))
    ids = [e.ids for e in neox.encode_batch(articles, add_special_tokens=False)]
    assert len(corpus) == m["n_docs"] == len(articles) == 60
    assert corpus.doc_lengths.tolist() == [len(x) + 1 for x in ids]  # + the end-of-text token
    assert corpus.n_tokens == m["n_tokens"] == sum(map(len, ids)) + 60
    assert m["n_words"] == len(raw.split())
    assert corpus.doc_words.tolist() == [len(a.split()) for a in articles]
    assert m["n_bytes"] == len(raw.encode("utf-8")) - len(" \n")  # the blank line before the first title
    assert corpus.doc_bytes.tolist() == [len(a.encode("utf-8")) for a in articles]
    assert (m["source"], m["split"], m["skipped_empty_docs"], m["invalid_utf8_docs"]) == \
        ("wikitext-103", split, 0, 0)
    assert corpus.tokens.dtype == np.uint16 and all(corpus.doc(i)[-1] == 0 for i in range(60))  # eot id 0


def test_wikitext_documents_decode_back_to_their_text(wikitext, shared_data):
    corpus = wikitext["valid"]
    tokenizer = corpus.tokenizer()
    articles = list(open_source("wikitext-103", "valid", shared_data / "wikitext-103-raw"))
    assert tokenizer.fingerprint == corpus.manifest["tokenizer"]["fingerprint"]
    for i in (0, 7, 31, 59):
        # GPT-NeoX normalizes to NFC; the articles are NFC already except where noted by the assert.
        assert tokenizer.decode(corpus.doc(i)[:-1]) == unicodedata.normalize("NFC", articles[i])


def test_pycode_round_trips_exactly_through_the_bytes_tokenizer(tmp_path):
    corpus = get_corpus("pycode", "test", "bytes", tmp_path, progress=False, workers=2)
    files = list(open_source("pycode", "test"))
    assert len(corpus) + corpus.manifest["skipped_empty_docs"] == len(files)
    texts = [t for t in files if t.strip()]
    for i in range(0, len(corpus), 7):
        assert bytes(corpus.doc(i)[:-1].astype(np.uint8)).decode("utf-8") == texts[i]
        assert corpus.tokenizer().decode(corpus.doc(i)) == texts[i]
    assert corpus.doc_bytes.sum() == corpus.n_tokens - len(corpus) == sum(len(t.encode()) for t in texts)


def test_worker_count_does_not_change_the_corpus(tmp_path):
    one = get_corpus("pycode", "valid", "bytes", tmp_path / "a", workers=1, progress=False)
    two = get_corpus("pycode", "valid", "bytes", tmp_path / "b", workers=2, progress=False)
    assert np.array_equal(one.tokens, two.tokens) and np.array_equal(one.offsets, two.offsets)
    assert one.manifest["fingerprint"] == two.manifest["fingerprint"]


def test_get_corpus_reuses_its_cache_and_separates_requests(tmp_path):
    first = get_corpus("pycode", "valid", "bytes", tmp_path, progress=False)
    again = get_corpus("pycode", "valid", "bytes", tmp_path, progress=False)
    no_eot = get_corpus("pycode", "valid", "bytes", tmp_path, append_eot=False, progress=False)
    assert again.path == first.path and again.manifest["created"] == first.manifest["created"]
    assert no_eot.path != first.path and no_eot.n_tokens == first.n_tokens - len(first)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([first.path.name, no_eot.path.name])


def text_source(tmp_path, docs: list[bytes], name="train.txt"):
    folder = tmp_path / "src"
    folder.mkdir(exist_ok=True)
    for i, d in enumerate(docs):
        (folder / f"train-{i:03d}.txt").write_bytes(d)
    return open_source("text", "train", folder)


def test_empty_whitespace_one_token_and_invalid_documents(tmp_path):
    src = text_source(tmp_path, [b"", b"  \n\t ", b"a", b"hello world\n", b"bad \xff"])
    corpus = build_corpus(src, "bytes", tmp_path / "out", progress=False)
    m = corpus.manifest
    assert (m["n_docs"], m["skipped_empty_docs"], m["invalid_utf8_docs"]) == (3, 2, 1)
    assert corpus.doc(0).tolist() == [97, 256]
    assert corpus.doc_words.tolist() == [1, 2, 2]
    assert corpus.doc_bytes.tolist() == [1, 12, 7]  # U+FFFD is 3 bytes
    assert corpus.tokenizer().decode(corpus.doc(2)) == "bad \ufffd"


def test_a_cache_built_for_another_request_is_refused_then_rebuilt_with_force(tmp_path, neox_path):
    src = text_source(tmp_path, [b"some text", b"more text"])
    out = tmp_path / "out"
    build_corpus(src, "bytes", out, progress=False)
    with pytest.raises(DataError, match=r"out holds a corpus built for another request \(tokenizer: .*--force"):
        build_corpus(src, neox_path, out, progress=False)
    assert TokenizedCorpus.open(out).manifest["tokenizer"]["name"] == "bytes"  # untouched
    rebuilt = build_corpus(src, neox_path, out, progress=False, force=True)
    assert rebuilt.manifest["tokenizer"]["name"] == "gpt-neox-20b" and rebuilt.n_tokens == 6
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "src"]  # no temporary folders left
    (tmp_path / "src" / "other.bin").mkdir()
    with pytest.raises(DataError, match=r"src exists and is not a tokenized corpus"):
        build_corpus(src, "bytes", tmp_path / "src", progress=False, force=True)


def test_an_interrupted_build_leaves_nothing_that_opens(tmp_path):
    def failing():
        yield "a document"
        raise KeyboardInterrupt  # as if killed in the middle

    with pytest.raises(KeyboardInterrupt):
        build_corpus(Source("text", "train", {"x": 1}, failing), "bytes", tmp_path / "out", progress=False)
    assert list(tmp_path.iterdir()) == []
    # A hard kill (SIGKILL) leaves a hidden temporary folder without a manifest: it never opens.
    partial = tmp_path / ".out.tmp-123-abcd"
    partial.mkdir()
    (partial / "tokens.bin").write_bytes(b"\0\0")
    with pytest.raises(DataError, match=r"not a tokenized corpus \(no manifest\.json"):
        TokenizedCorpus.open(partial)


def test_a_damaged_cache_is_refused(tmp_path):
    corpus = build_corpus(text_source(tmp_path, [b"abc", b"defg"]), "bytes", tmp_path / "out", progress=False)
    with open(corpus.path / "tokens.bin", "r+b") as f:
        f.truncate(4)
    with pytest.raises(DataError, match=r"out: corrupt corpus \(file sizes disagree"):
        TokenizedCorpus.open(tmp_path / "out")
    # get_corpus rebuilds a damaged cache of its own rather than failing or reusing it.
    cached = get_corpus("text", "train", "bytes", tmp_path / "cache", path=tmp_path / "src", progress=False)
    with open(cached.path / "tokens.bin", "r+b") as f:
        f.truncate(4)
    again = get_corpus("text", "train", "bytes", tmp_path / "cache", path=tmp_path / "src", progress=False)
    assert again.n_tokens == 9 and again.path == cached.path


def test_a_vocabulary_too_large_for_the_dtype_is_refused(tmp_path):
    vocab = {f"w{i}": i for i in range(70_000)}
    vocab["<|endoftext|>"] = 70_000
    big = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="w0"))
    big.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    (tmp_path / "big").mkdir()
    big.save(str(tmp_path / "big" / "tokenizer.json"))
    tok = load_tokenizer(tmp_path / "big")
    assert tok.vocab_size == 70_001 and tok.eot_id == 70_000
    with pytest.raises(DataError, match=r"tokenizer big has 70001 ids, which do not fit uint16"):
        resolve_dtype(tok, "uint16")
    corpus = build_corpus(text_source(tmp_path, [b"w69999 w3"]), tok, tmp_path / "out", progress=False)
    assert corpus.tokens.dtype == np.uint32 and corpus.doc(0).tolist() == [69_999, 3, 70_000]


def test_bin_shards_become_a_corpus_without_retokenizing(tmp_path, shared_data):
    gpt2 = load_tokenizer(shared_data / "tokenizers" / "gpt2")
    docs = ["Hello world", "A second document.", "third"]
    stream = [t for d in docs for t in [50256, *gpt2.encode(d)]] + [50256]  # and a trailing empty one
    write_bin_shard(tmp_path / "data_train_000000.bin", stream)
    corpus = build_corpus(open_source("bin", "train", tmp_path), gpt2, tmp_path / "out", progress=False)
    assert [gpt2.decode(corpus.doc(i)[:-1]) for i in range(len(corpus))] == docs
    assert corpus.doc_words.tolist() == [2, 3, 1] and corpus.doc_bytes.tolist() == [11, 18, 5]
    assert corpus.manifest["skipped_empty_docs"] == 1
    with pytest.raises(DataError, match=r"\.bin shards hold GPT-2 token ids"):
        build_corpus(open_source("bin", "train", tmp_path), "bytes", tmp_path / "out2", progress=False)


def test_cli_builds_a_corpus_and_refuses_to_overwrite_another(tmp_path, capsys):
    (tmp_path / "a.txt").write_text("hello there")
    args = ["--source", "text", "--path", str(tmp_path / "a.txt"), "--split", "train", "--quiet",
            "--out", str(tmp_path / "c")]
    assert prepare_main(args) == 0
    summary = json.loads(capsys.readouterr().out)
    assert (summary["n_docs"], summary["n_tokens"], summary["n_bytes"], summary["n_words"]) == (1, 12, 11, 2)
    assert prepare_main(args + ["--no-eot"]) == 2
    assert capsys.readouterr().err.startswith("error: ")
    assert prepare_main(args + ["--no-eot", "--force"]) == 0


# ---------------------------------------------------------------- tokenizers

def test_tokenizers_load_from_every_kind_of_spec(tmp_path, shared_data, neox_path):
    gpt2 = load_tokenizer(shared_data / "tokenizers" / "gpt2")
    assert (gpt2.encode("Hello world"), gpt2.vocab_size, gpt2.eot_id) == ([15496, 995], 50257, 50256)
    neox = load_tokenizer(neox_path)
    assert (neox.encode("Hello world"), neox.vocab_size, neox.eot_id) == ([12092, 1533], 50277, 0)
    assert neox.name == "gpt-neox-20b"
    assert load_tokenizer(neox_path.parent).fingerprint == neox.fingerprint != gpt2.fingerprint
    assert neox.encode_batch(["Hello world", " Hello world"]) == [[12092, 1533], [24387, 1533]]
    assert neox.decode(neox.encode("naïve café <|endoftext|>")) == "naïve café <|endoftext|>"
    for tok in (gpt2, neox, ByteTokenizer()):  # save() writes what load_tokenizer() rebuilds
        again = load_tokenizer(tok.save(tmp_path / tok.name))
        assert again.fingerprint == tok.fingerprint and again.encode("x = 1\n") == tok.encode("x = 1\n")


def test_byte_tokenizer_needs_no_file():
    tok = load_tokenizer("bytes")
    assert (tok.vocab_size, tok.eot_id) == (257, 256)
    assert tok.encode("é!") == [0xC3, 0xA9, 0x21]
    assert tok.decode([0xC3, 0xA9, 256, 0x21]) == "é!"


def test_unknown_tokenizers_give_one_line_errors(tmp_path, monkeypatch):
    import huggingface_hub

    def offline(*args, **kwargs):
        raise huggingface_hub.errors.LocalEntryNotFoundError("no connection\nsecond line")

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", offline)
    with pytest.raises(DataError, match=r"'nobody/nothing': not a local path, .*LocalEntryNotFoundError") as e:
        load_tokenizer("nobody/nothing")
    assert "\n" not in str(e.value)
    with pytest.raises(DataError, match=r"tokenizer './missing/tokenizer.json': no such file"):
        load_tokenizer("./missing/tokenizer.json")
    with pytest.raises(DataError, match=r"holds neither tokenizer.json"):
        load_tokenizer(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(DataError, match=r"tokenizer\.json is not readable JSON"):
        load_tokenizer(tmp_path)



def test_tokenizing_workers_do_not_inherit_a_graceful_sigterm_handler():
    # train.py and eval.py turn SIGTERM into a graceful stop. Forked tokenizing workers must die on
    # SIGTERM (Pool.terminate() sends it) and leave Ctrl-C to the parent, or the pool can wait for
    # them forever when it closes.
    import signal

    from data_packing.prepare import _worker_pool
    from data_packing.tokenizer import ByteTokenizer
    previous = signal.signal(signal.SIGTERM, lambda *a: None)
    try:
        with _worker_pool(1, (ByteTokenizer(), True, "uint16")) as pool:
            term, interrupt = pool.apply(_dispositions)
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert term == signal.SIG_DFL and interrupt == signal.SIG_IGN


def _dispositions():
    import signal
    return signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
