"""Sources yield whole documents in a stable order; bad input gives a one-line DataError."""
import json
import re

import numpy as np
import pytest

from data_packing import DataError, open_source
from data_packing import sources
from data_packing.prepare import main as prepare_main
from data_packing.shards import HEADER_BYTES, bin_documents, read_bin_shard, write_bin_shard

# Merity et al. 2016, Table 1: whitespace tokens plus one <eos> per line.
MERITY_TOKENS = {"valid": 217_646, "test": 245_569}


def independent_articles(raw: str) -> list[str]:
    """Articles cut with one regex over the whole text: a ` = Title = ` line between blank lines."""
    text = "\n" + raw  # so the first title is preceded by "\n \n" like every other
    starts = [m.start() - 1 for m in re.finditer(r"(?<=\n \n) = [^=\n][^\n]* = \n(?= \n|$)", text)]
    return [raw[a:b] for a, b in zip(starts, starts[1:] + [len(raw)])]


@pytest.mark.parametrize("split", ["valid", "test"])
def test_wikitext_articles_match_an_independent_split_of_the_raw_file(shared_data, split):
    folder = shared_data / "wikitext-103-raw"
    raw = (folder / f"wiki.{split}.raw").read_text(encoding="utf-8")
    docs = list(open_source("wikitext-103", split, folder))
    expected = independent_articles(raw)
    assert len(docs) == len(expected) == 60  # WikiText-103 valid and test have 60 articles each
    assert docs == expected
    preamble = raw[: raw.index(" = ")]  # the blank line before the first title
    assert sum(len(d.encode("utf-8")) for d in docs) == len(raw.encode("utf-8")) - len(preamble.encode())
    assert sum(len(d.split()) for d in docs) + raw.count("\n") == MERITY_TOKENS[split]


def test_wikitext_section_headings_and_formula_lines_do_not_start_articles(shared_data):
    docs = list(open_source("wikitext-2", "test", shared_data / "wikitext-103-raw"))
    constant_k = next(d for d in docs if d.startswith(" = Constant k filter = \n"))
    assert " = = Cascading sections = = \n" in constant_k
    assert " = 1 rad / s and a nominal impedance k = \n" in constant_k  # a formula line, not a title


def test_wikitext_from_hub_rows_equals_the_local_file(shared_data, monkeypatch):
    file = shared_data / "wikitext-103-raw" / "wiki.valid.raw"
    # Hub rows as the `wikitext` loader makes them: each line with its "\n", blank lines as "".
    lines = file.read_text(encoding="utf-8").splitlines(keepends=True)
    rows = [{"text": "" if line == " \n" else line} for line in lines]
    monkeypatch.setattr(sources, "_hub_rows", lambda repo, config, split: iter(rows))
    local = list(open_source("wikitext-103", "valid", file.parent))
    assert list(open_source("wikitext-103", "validation")) == local


def test_fineweb_hub_holds_out_the_first_documents_for_valid_and_test(monkeypatch):
    rows = [{"text": f"document {i}"} for i in range(10)]
    monkeypatch.setattr(sources, "_hub_rows", lambda repo, config, split: iter(rows))
    got = {s: list(open_source("fineweb-edu", s, holdout_docs=3)) for s in ("valid", "test", "train")}
    assert got["valid"] == ["document 0", "document 1", "document 2"]
    assert got["test"] == ["document 3", "document 4", "document 5"]
    assert got["train"] == [f"document {i}" for i in range(6, 10)]


def test_pycode_splits_are_disjoint_stable_and_cover_the_stdlib():
    splits = {s: [rel for _, rel in sources.pycode_files(s)] for s in ("train", "valid", "test")}
    everything = [rel for _, rel in sources.pycode_files("all")]
    assert sorted(sum(splits.values(), [])) == everything
    assert len(set(everything)) == len(everything) > 300
    assert len(splits["valid"]) > 10 and len(splits["test"]) > 10
    skipped = {"test", "tests", "idle_test", "site-packages"}
    assert not any(skipped & set(rel.split("/")) for rel in everything)
    # The split of a file depends on its relative path only (fixed here so a change shows up).
    assert [sources.hash_split(k) for k in ("ast.py", "cProfile.py", "os.py")] == ["valid", "test", "train"]
    docs = list(open_source("pycode", "valid"))
    assert len(docs) == len(splits["valid"]) and all(isinstance(d, str) for d in docs)
    assert docs == list(open_source("pycode", "valid"))


def test_text_folder_selects_files_by_split_and_reads_each_format(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "train").mkdir()
    (tmp_path / "train" / "a.txt").write_text("first document\nwith two lines\n")
    (tmp_path / "train" / "b.jsonl").write_bytes(
        json.dumps({"body": "second"}).encode() + b"\n\n" + b'{"body": "bad \xff byte"}\n')
    pq.write_table(pa.table({"body": ["third", "fourth"]}), tmp_path / "valid-00000.parquet")
    (tmp_path / "wiki.test.txt").write_text("fifth")

    train = open_source("text", "train", tmp_path, text_field="body")
    assert list(train) == ["first document\nwith two lines\n", "second", "bad \ufffd byte"]
    assert train.stats["invalid_utf8_docs"] == 1
    assert list(open_source("text", "validation", tmp_path, text_field="body")) == ["third", "fourth"]
    assert list(open_source("text", "test", tmp_path)) == ["fifth"]
    assert len(list(open_source("text", "all", tmp_path, text_field="body"))) == 6
    with pytest.raises(DataError, match=r"b\.jsonl:1: no string field 'text'"):
        list(open_source("text", "train", tmp_path))
    with pytest.raises(DataError, match=r"valid-00000\.parquet: no column 'text'"):
        list(open_source("text", "valid", tmp_path))


def test_text_single_file_counts_invalid_utf8(tmp_path):
    file = tmp_path / "notes.txt"
    file.write_bytes(b"caf\xc3\xa9 \xc3\x28 end")
    src = open_source("text", "train", file)
    assert list(src) == ["caf\u00e9 \ufffd( end"]
    assert src.stats["invalid_utf8_docs"] == 1


@pytest.mark.parametrize("call, message", [
    (lambda p: open_source("wikitxt-103", "valid", p), r"unknown source 'wikitxt-103'; choose one of"),
    (lambda p: open_source("wikitext-103", "valdation", p), r"unknown split 'valdation'"),
    (lambda p: open_source("wikitext-103", "train", p), r"missing split file .*wiki\.train\.raw"),
    (lambda p: open_source("text", "valid", p / "nope"), r"path .*nope does not exist"),
    (lambda p: open_source("text", "valid", p), r"no \.txt/\.jsonl/\.parquet files for split 'valid'"),
    (lambda p: open_source("text", "valid"), r"source 'text' needs --path"),
])
def test_bad_names_and_missing_files_raise_one_line_data_errors(tmp_path, call, message):
    with pytest.raises(DataError, match=message) as e:
        call(tmp_path)
    assert "\n" not in str(e.value)


# ---------------------------------------------------------------- .bin shards

def test_bin_documents_are_rebuilt_across_shard_boundaries(tmp_path):
    eot = 50256
    write_bin_shard(tmp_path / "fineweb_train_000001.bin", [eot, 1, 2, eot, 3, 4, 5])
    write_bin_shard(tmp_path / "fineweb_train_000002.bin", [6, 7, eot, eot, 8, eot])
    write_bin_shard(tmp_path / "fineweb_train_000003.bin", [9])
    write_bin_shard(tmp_path / "fineweb_val_000000.bin", [eot, 42, 43])
    docs = [d.tolist() for d in open_source("fineweb", "train", tmp_path)]
    assert docs == [[1, 2], [3, 4, 5, 6, 7], [], [8], [9]]  # the empty one is counted by prepare
    assert [d.tolist() for d in open_source("bin", "valid", tmp_path)] == [[42, 43]]
    assert read_bin_shard(tmp_path / "fineweb_val_000000.bin").dtype == np.uint16


def test_bin_reader_refuses_truncated_and_foreign_files(tmp_path):
    good = write_bin_shard(tmp_path / "good.bin", np.arange(100))
    data = good.read_bytes()
    cases = {
        "cut.bin": (data[:-3], r"cut\.bin: truncated or padded .bin shard, header says 100 tokens"),
        "header.bin": (data[:600], r"header\.bin: truncated \.bin shard, 600 bytes is shorter than the 1024"),
        "magic.bin": (np.int32(7).tobytes() + data[4:], r"magic\.bin: not a \.bin token shard \(magic 7"),
        "tiny.bin": (b"abc", r"tiny\.bin: truncated \.bin shard"),
        "version.bin": (data[:4] + np.int32(3).tobytes() + data[8:], r"version\.bin: unsupported .* version 3"),
    }
    for name, (content, message) in cases.items():
        (tmp_path / name).write_bytes(content)
        with pytest.raises(DataError, match=message):
            list(bin_documents([tmp_path / name]))
    assert len(data) == HEADER_BYTES + 200


def test_bin_shard_writer_refuses_ids_beyond_uint16(tmp_path):
    with pytest.raises(DataError, match=r"big\.bin: token ids must lie in \[0, 65536\)"):
        write_bin_shard(tmp_path / "big.bin", [1, 70000])


def test_cli_prints_one_error_line_and_exits_2(tmp_path, capsys, shared_data):
    (tmp_path / "x.bin").write_bytes(b"\0" * 2000)
    gpt2 = str(shared_data / "tokenizers" / "gpt2")
    assert prepare_main(["--source", "bin", "--path", str(tmp_path / "x.bin"), "--split", "train", "--quiet",
                         "--tokenizer", gpt2, "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and "x.bin" in err
    assert prepare_main(["--source", "nope", "--split", "train", "--out", str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err.startswith("error: unknown source 'nope'")
    assert [p.name for p in tmp_path.iterdir()] == ["x.bin"]  # no output, no temporary folder left
