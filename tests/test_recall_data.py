"""The synthetic recall source (data_packing/recall.py): exact distances and answer positions,
disjoint splits, the corpus source and its config keys."""
import numpy as np
import pytest

from data_packing import DataError, open_source
from data_packing.recall import RecallTask, build_document, eval_document, keys
from data_packing.tokenizer import ByteTokenizer, load_tokenizer

SHARED = __import__("pathlib").Path(__file__).resolve().parents[2] / "shared" / "data"


@pytest.mark.parametrize("distances", [[64], [128, 512, 4096], [70, 70, 1000]])
def test_byte_distances_and_answers_are_exact(distances):
    tok = ByteTokenizer()
    doc = eval_document(np.random.default_rng(0), tok, distances, n_pairs=1)
    text = tok.decode(doc.tokens.tolist())
    assert [q.distance for q in doc.queries] == distances
    value = None
    for q in doc.queries:
        answer = text[q.answer_start:q.answer_start + q.answer_len]
        assert answer.isdigit() and len(answer) == 6
        assert text[:q.answer_start].endswith("? It is ")
        value = value or answer
        assert answer == value                      # one fact, asked again and again
    # the fact states the value, and the first query's distance is counted from its last digit
    fact_end = text.index(value) + len(value) - 1
    assert doc.queries[0].answer_start - fact_end == distances[0]


def test_several_pairs_are_asked_by_key():
    tok = ByteTokenizer()
    doc = build_document(np.random.default_rng(1), tok, 3, [(2, 200), (0, 300), (1, 50)])
    text = doc.text
    for q in doc.queries:
        asked = text[:q.answer_start].rsplit("What is the code of ", 1)[1].split("?")[0]
        stated = text.split(f"The code of {asked} is ", 1)[1][:6]
        assert text[q.answer_start:q.answer_start + 6] == stated


def test_other_tokenizers_keep_answer_positions():
    tok = load_tokenizer(SHARED / "tokenizers" / "gpt2")
    doc = eval_document(np.random.default_rng(2), tok, [100, 1000], n_pairs=2)
    for q in doc.queries:
        answer = tok.decode(doc.tokens[q.answer_start:q.answer_start + q.answer_len].tolist())
        assert answer.strip().isdigit() and len(answer.strip()) == 6
        assert 0.8 * 100 <= q.distance


def test_training_distribution_and_splits():
    task = RecallTask(min_gap=16, max_gap=256, max_pairs=2, max_queries=3)
    train = list(task.texts(1, 20))
    again = list(task.texts(1, 20))
    other = list(task.texts(2, 20))
    assert train == again and not set(train) & set(other)
    # a distance shorter than the query's own text cannot be met: it is as short as it can be
    short = eval_document(np.random.default_rng(0), ByteTokenizer(), [16])
    assert short.queries[0].distance == len("What is the code of ") + len(short.text.split(
        "What is the code of ")[1].split("It is ")[0]) + len("It is ") + 3
    assert all("What is the code of" in t for t in train)
    assert len(keys()) == len(set(keys())) >= 800
    src = open_source("recall", "valid", recall={"docs": 50, "min_gap": 16, "max_gap": 64})
    docs = list(src)
    assert len(docs) == 5 and src.identity["split"] == "valid"


def test_bad_recall_settings_are_refused():
    with pytest.raises(DataError, match="min_gap"):
        RecallTask(min_gap=100, max_gap=10)
    with pytest.raises(DataError, match="docs"):
        open_source("recall", "train", recall={"docs": 0})
    from elephant.config import ConfigError, load_config
    with pytest.raises(ConfigError, match="recall_min_gap"):
        load_config(None, ["data.source=recall", "data.recall_min_gap=500", "data.recall_max_gap=100"])
    cfg = load_config(None, ["data.source=recall", "data.recall_max_pairs=3"])
    assert cfg.data.source_options()["recall"]["max_pairs"] == 3
    assert load_config(None, ["data.site_packages=true"]).data.source_options() == {"site_packages": True}


# ---------------------------------------------------------------- filler cut from a real text
def _split_texts(folder):
    """A text source with train and test files of disjoint vocabularies (train: lowercase words,
    test: uppercase words), so that where a stretch of filler came from can be told."""
    rng = np.random.default_rng(0)
    for split, case in (("train", str.lower), ("test", str.upper)):
        words = [case("".join(rng.choice(list("qwrtypsdfghjklzxcvbnm"), 5))) for _ in range(3000)]
        (folder / f"{split}.txt").write_text(" ".join(words))
    return folder


@pytest.mark.parametrize("distances", [[64], [128, 900]])
def test_text_filler_keeps_distances_exact_and_is_cut_from_the_text(tmp_path, distances):
    from data_packing.recall import TextFiller
    corpus = (_split_texts(tmp_path) / "train.txt").read_text()
    tok = ByteTokenizer()
    doc = eval_document(np.random.default_rng(3), tok, distances, filler=corpus)
    assert [q.distance for q in doc.queries] == distances
    value = doc.text[doc.queries[0].answer_start:doc.queries[0].answer_start + 6]
    assert value.isdigit() and f"The code of " in doc.text and doc.text.count(value) == len(distances) + 1
    # outside the facts and queries there are only the corpus's words (or their cut ends), no
    # synthetic text
    rest = doc.text
    for piece in ("What is the code of", "The code of", "? It is", " is ", *keys(), value, "."):
        rest = rest.replace(piece, " ")
    assert rest.split() and all(w.isalpha() and w.islower() and len(w) <= 5 for w in rest.split())
    assert "grass" not in doc.text and "There were" not in doc.text
    stretch = TextFiller(np.random.default_rng(0), corpus).text(200)
    assert 150 <= len(stretch) <= 200 and stretch.strip() in corpus
    with pytest.raises(DataError, match="at least 64"):
        TextFiller(np.random.default_rng(0), "too short")


def test_recall_source_cuts_each_splits_filler_from_that_split(tmp_path):
    from elephant.config import load_config
    folder = _split_texts(tmp_path)
    cfg = load_config(None, ["data.source=recall", f"data.recall_filler={folder}",
                             "data.recall_docs=30", "data.recall_max_gap=200"])
    options = cfg.data.source_options()
    train, test = (open_source("recall", split, **options) for split in ("train", "test"))
    train_words = {w for d in train for w in d.split() if w.isalpha() and w.islower() and len(w) == 5}
    test_words = {w for d in test for w in d.split() if w.isalpha() and w.isupper() and len(w) == 5}
    assert train_words and test_words
    assert not any(w.isupper() and len(w) == 5 for d in train for w in d.split() if w.isalpha())
    # the filler is part of what names the corpus (its tokenized cache)
    synthetic = open_source("recall", "train", recall={"docs": 30, "max_gap": 200})
    assert train.identity["filler"]["source"] == "text" and "filler" not in synthetic.identity
    with pytest.raises(DataError, match="does not exist"):
        open_source("recall", "train", recall={"filler": str(tmp_path / "missing")})


# ---------------------------------------------------------------- forms of the facts
@pytest.mark.parametrize("template", ["sentence", "label", "assign", "varied"])
@pytest.mark.parametrize("tokenizer", ["bytes", "neox"])
def test_every_form_keeps_distances_exact_and_scores_the_digits_alone(template, tokenizer):
    # a value piece that opens with a space (label, assign) is read as running text by a BPE
    # tokenizer (" 482913"); its space alone is never an answer token (the byte tokenizer's)
    tok = ByteTokenizer() if tokenizer == "bytes" else load_tokenizer(SHARED / "tokenizers" / "gpt-neox-20b")
    distances = [150, 300, 2000]   # the second fact and the query stand within the first
    doc = eval_document(np.random.default_rng(5), tok, distances, n_pairs=2, template=template)
    assert [q.distance for q in doc.queries] == distances
    for q in doc.queries:
        answer = tok.decode(doc.tokens[q.answer_start:q.answer_start + q.answer_len].tolist())
        assert answer.strip().isdigit() and len(answer.strip()) == 6 and answer.lstrip() == answer.strip()
        if tokenizer == "bytes":
            assert answer.isdigit()
    marks = {"sentence": "What is the code of", "label": " code: ", "assign": "_code = "}
    assert all((marks[t] in doc.text) == (t == template) for t in marks)


def test_varied_facts_take_many_forms_each_asked_as_stated_and_never_the_needles():
    from data_packing.recall import KEY_STYLES, varied_form
    tok = ByteTokenizer()
    rng = np.random.default_rng(0)
    seen = set()
    for _ in range(60):
        doc = eval_document(rng, tok, [100, 400], n_pairs=1, template="varied")
        text = doc.text
        q0, q1 = doc.queries
        # the query states the key as the fact did: the text before each answer is the fact's
        before = [text[:q.answer_start].rsplit("\n", 1)[-1][-12:] for q in (q0, q1)]
        fact_value = text[q0.answer_start:q0.answer_start + q0.answer_len]
        assert fact_value.isdigit() and fact_value == text[q1.answer_start:q1.answer_start + q1.answer_len]
        assert before[0] == before[1]
        assert text.count(fact_value) == 3    # stated once, asked twice
        assert "_code =" not in text          # the needle's default form is left out
        seen.add(text[q0.answer_start - 1])   # the character before the value: the separator's
    assert len(seen) >= 4
    # every key style and separator is drawn; the snake_case key with " =" never
    says = [varied_form(np.random.default_rng(i))[0]("the silver fox", "1") for i in range(400)]
    befores = {b for b, _, _ in says}
    for style in KEY_STYLES:
        assert any(KEY_STYLES[style](["silver", "fox", s]) in b for b in befores
                   for s in ("code", "id", "key", "number", "pin", "port", "seed", "serial", "tag", "token"))
    assert not any(b.endswith("_code =") or "silver_fox_" in b and b.endswith(" =") for b in befores)


def test_a_task_of_one_form_makes_the_same_documents_and_of_several_mixes_them():
    one = list(RecallTask(max_gap=200).texts(7, 20))
    assert one == list(RecallTask(max_gap=200, templates=("sentence",)).texts(7, 20))
    mixed = list(RecallTask(max_gap=200, templates=("sentence", "label")).texts(7, 40))
    labelled = sum(" code: " in t for t in mixed)
    assert 5 < labelled < 35 and sum("What is the code" in t for t in mixed) == 40 - labelled
    with pytest.raises(DataError, match="unknown fact template 'poem'; accepted: sentence, label, assign, varied"):
        RecallTask(templates=("poem",))


# ---------------------------------------------------------------- mixed into a corpus
def _numbered(i: int) -> str:
    """A lowercase word unique to `i` (letters only: no digits to mistake for a value)."""
    out = ""
    for _ in range(5):
        out, i = "bcdfghjklm"[i % 10] + out, i // 10
    return "w" + out


def test_recall_mix_makes_a_share_of_the_corpus_own_text_into_recall_documents(tmp_path):
    folder = _split_texts(tmp_path)
    (folder / "train.txt").unlink()
    n = 0
    for i in range(40):   # 40 training documents; every word of them is numbered, in order
        words = [_numbered(n + j) for j in range(300 + 37 * (i % 5))]
        n += len(words)
        (folder / f"doc{i:02d}.train.txt").write_text(" ".join(words))
    mix = {"share": 0.3, "templates": ("sentence", "label"), "min_gap": 16, "max_gap": 900,
           "max_pairs": 2, "max_queries": 2}
    base = open_source("text", "train", folder)
    mixed = open_source("text", "train", folder, recall_mix=mix)
    docs, own = list(mixed), list(base)
    recall = [d for d in docs if "code" in d]
    assert recall and "code" in docs[1] and "code" not in docs[0]   # spread: after every document
    chars = sum(map(len, recall)) / sum(map(len, docs))
    assert 0.3 <= chars < 0.3 + max(map(len, recall)) / sum(map(len, docs))   # the share of the text
    # the documents passed on as they are are base's own, whole
    assert all(d in own for d in docs if "code" not in d)
    # the recall documents' filler is base's text as it comes, in its order (a document passed on
    # whole may go ahead of the rest of one the filler is reading); every numbered word once, none
    # lost but where a stretch was cut
    whole = __import__("re").compile(r"w[bcdfghjklm]{5}")

    def numbers(texts):
        return [int("".join(str("bcdfghjklm".index(c)) for c in w[1:]))
                for d in texts for w in d.replace("\n", " ").split() if whole.fullmatch(w)]
    assert numbers(recall) == sorted(numbers(recall))
    every = numbers(docs)
    assert len(set(every)) == len(every) >= 0.97 * n
    for d in recall:   # a fact is asked with the value it was stated with
        values = [t for t in d.replace(".", " ").replace("?", " ").split() if t.isdigit()]
        assert any(values.count(v) >= 2 for v in values)
    assert mixed.identity["recall_mix"]["share"] == 0.3 and "recall_mix" not in base.identity
    assert list(open_source("text", "train", folder, recall_mix=mix)) == docs   # deterministic
    # a stream that runs out inside a recall document: what it had not used is passed on
    from data_packing.recall import StreamEnd, StreamFiller
    filler = StreamFiller(iter(["alpha beta gamma", "delta epsilon"]))
    # cut at the word before, or after a word longer than the stretch; documents joined
    assert filler.text(8) == "alpha " and filler.text(2) == "beta "
    with pytest.raises(StreamEnd):
        filler.text(100)
    assert filler.rest() == "gamma\n\ndelta epsilon" and filler.rest() == ""
    # a word running past what was read: the next document read, the stretch ended at the
    # first space after the word, counted in the buffer as it is once read
    filler = StreamFiller(iter(["abcdefgh ijk", "l m n"]))
    assert filler.text(8) == "abcdefgh" and filler.text(2) == " ijk\n\nl "
    # continuing a stretch: the stream reads on; a drawn filler repeats the stretch's start
    from data_packing.recall import Filler
    assert StreamFiller(iter(["one two three"])).extend("x ", 3) == "x one"
    assert Filler(np.random.default_rng(0)).extend("abc", 2) == "abc ab"
    with pytest.raises(DataError, match="must be in \\(0, 1\\)"):
        open_source("text", "train", folder, recall_mix=mix | {"share": 1.0})


def test_recall_mix_reads_the_training_split_alone_and_refuses_what_it_cannot_mix(tmp_path):
    from elephant.config import ConfigError, load_config
    folder = _split_texts(tmp_path)
    cfg = load_config(None, ["data.source=text", f"data.path={folder}", "data.recall_mix=0.1",
                             "data.recall_max_gap=300"])
    train = cfg.data.source_options("train")["recall_mix"]
    assert train["share"] == 0.1 and train["templates"] == ("sentence", "label") and train["max_gap"] == 300
    assert "recall_mix" not in cfg.data.source_options("test")
    assert "recall_mix" not in cfg.data.source_options()
    for bad, message in ((["data.recall_mix=1.5"], "data.recall_mix: expected a share in"),
                         (["data.recall_mix=0.1", "data.source=bin"], "source 'bin' is pre-tokenized"),
                         (["data.recall_mix=0.1", "data.source=recall"], "source 'recall' is made of them"),
                         (["data.recall_mix_templates=sentence,sonnet"], "unknown form 'sonnet'")):
        with pytest.raises(ConfigError, match=message):
            load_config(None, bad)
