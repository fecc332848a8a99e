"""The Hugging Face baseline: rolling windows score every token once, with exactly the context the
convention allows; the model and tokenizer are loaded back from a local folder through transformers."""
import math
from pathlib import Path

import pytest
import torch

from elephant.baseline import (BaselineUnavailable, load_baseline, prefix_token_id, rolling_windows,
                               score_documents)

TOKENIZER_JSON = (Path(__file__).resolve().parents[1].parent
                  / "shared/data/tokenizers/gpt-neox-20b/tokenizer.json")

SHORT = "The cat sat on the mat."
LONG = ("Elephants are the largest living land animals. Three species are currently recognised: "
        "the African bush elephant, the African forest elephant, and the Asian elephant. They are "
        "the only surviving members of the family Elephantidae.")


@pytest.fixture(scope="module")
def transformers():
    """transformers, imported by the tests that use it: at the module's top it cost ~2 s of every
    test process's collection, a parallel GPU run's 16 workers included."""
    return pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory, transformers):
    """A randomly initialised 2-layer GPT-NeoX with the GPT-NeoX tokenizer, saved to a local folder."""
    if not TOKENIZER_JSON.is_file():
        pytest.fail(f"{TOKENIZER_JSON} is missing: the test needs the shared GPT-NeoX tokenizer")
    out = tmp_path_factory.mktemp("tiny-neox")
    tok = transformers.PreTrainedTokenizerFast(tokenizer_file=str(TOKENIZER_JSON),
                                               bos_token="<|endoftext|>", eos_token="<|endoftext|>",
                                               unk_token="<|endoftext|>")
    tok.save_pretrained(out)
    torch.manual_seed(0)
    cfg = transformers.GPTNeoXConfig(vocab_size=50304, hidden_size=32, num_hidden_layers=2,
                                     num_attention_heads=4, intermediate_size=64,
                                     max_position_embeddings=64, bos_token_id=0, eos_token_id=0)
    transformers.GPTNeoXForCausalLM(cfg).save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def tiny(tiny_dir):
    mp = pytest.MonkeyPatch()
    mp.setenv("HF_HUB_OFFLINE", "1")
    try:
        model, tok = load_baseline(str(tiny_dir), device="cpu", dtype="fp32")
    finally:
        mp.undo()
    return model, tok


def _ids(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


@torch.no_grad()
def _logprob(model, context: list[int], target: int) -> float:
    logits = model(input_ids=torch.tensor([context])).logits[0, -1].double()
    return float(torch.log_softmax(logits, -1)[target])


def _allowed_start(i: int, n: int, max_len: int, stride: int) -> int:
    """Start of the context of s[i] (s = [prefix] + ids) spelled out from the documented convention."""
    if i <= min(n, max_len):
        return 0                                   # first window: everything from the prefix
    end = max_len
    while end < i:                                 # the window that first covers i
        end = min(end + stride, n)
    return end - max_len


def test_windows_score_every_target_once():
    for n in (0, 1, 15, 16, 17, 40, 100):
        for max_len, stride in ((16, None), (16, 8), (16, 1), (16, 16), (8, 3)):
            targets = []
            for a, e, n_new in rolling_windows(n, max_len, stride):
                assert 0 <= a < e and e - a <= max_len and 1 <= n_new <= e - a
                targets += range(e - n_new + 1, e + 1)
            assert targets == list(range(1, n + 1)), (n, max_len, stride)


def test_stride_out_of_range_is_rejected():
    with pytest.raises(ValueError, match="stride"):
        list(rolling_windows(40, 16, 17))


def test_loads_from_local_folder(tiny, transformers):
    model, tok = tiny
    assert isinstance(model, transformers.GPTNeoXForCausalLM) and not model.training
    assert _ids(tok, "Hello world") == [12092, 1533]
    assert prefix_token_id(tok) == 0               # <|endoftext|>, as lm-eval prefixes Pythia


def test_short_document_equals_one_forward_pass(tiny):
    model, tok = tiny
    ids = _ids(tok, SHORT)
    assert len(ids) < 16
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([[0] + ids])).logits[0].double()
    expected = -torch.log_softmax(logits, -1)[:-1].gather(1, torch.tensor(ids)[:, None]).sum()
    r = score_documents(model, tok, [SHORT], max_len=16)
    assert r["tokens"] == len(ids)
    assert r["nll_sum"] == pytest.approx(float(expected), rel=1e-5)


@pytest.mark.parametrize("stride", [None, 8])
def test_long_document_equals_token_by_token_direct_computation(tiny, stride):
    model, tok = tiny
    max_len = 16
    ids = _ids(tok, LONG)
    n = len(ids)
    assert n > 2 * max_len
    s = [0] + ids
    expected = [-_logprob(model, s[_allowed_start(i, n, max_len, stride or max_len):i], s[i])
                for i in range(1, n + 1)]
    r = score_documents(model, tok, [LONG], max_len=max_len, stride=stride)
    assert r["tokens"] == n and r["per_document"][0]["tokens"] == n
    assert r["nll_sum"] == pytest.approx(math.fsum(expected), rel=1e-5)
    # position buckets: every token once, at its own position
    assert sum(b["tokens"] for b in r["position_buckets"].values()) == n
    assert r["position_buckets"]["0-512"]["nll_sum"] == pytest.approx(math.fsum(expected), rel=1e-5)


def test_with_stride_every_late_token_sees_at_least_max_len_minus_stride(tiny):
    n, max_len, stride = 50, 16, 6
    for i in range(max_len + 1, n + 1):
        assert i - _allowed_start(i, n, max_len, stride) >= max_len - stride


def test_documents_sum_and_text_counts(tiny):
    model, tok = tiny
    docs = [SHORT, LONG, ""]
    r = score_documents(model, tok, docs, max_len=16, stride=8)
    one = [score_documents(model, tok, [d], max_len=16, stride=8) for d in docs]
    assert r["documents"] == 3
    assert r["tokens"] == sum(o["tokens"] for o in one)
    assert r["nll_sum"] == pytest.approx(sum(o["nll_sum"] for o in one), rel=1e-6)
    assert r["bytes"] == sum(len(d.encode()) for d in docs)
    assert r["words"] == sum(len(d.split()) for d in docs)
    assert r["bits_per_byte"] == pytest.approx(r["nll_sum"] / math.log(2) / r["bytes"])
    assert r["word_perplexity"] == pytest.approx(math.exp(r["nll_sum"] / r["words"]))
    assert r["per_doc_mean_loss"] == pytest.approx(
        (one[0]["loss"] + one[1]["loss"]) / 2)     # the empty document has no tokens


def test_max_len_beyond_model_positions_is_rejected(tiny):
    model, tok = tiny
    with pytest.raises(ValueError, match="max_position_embeddings"):
        score_documents(model, tok, [SHORT], max_len=128)


def test_missing_model_raises_one_line_baseline_unavailable(tmp_path, monkeypatch, transformers):
    import huggingface_hub.constants
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    for name in (str(tmp_path / "no-such-model"), "no-such-user/no-such-model"):
        with pytest.raises(BaselineUnavailable) as e:
            load_baseline(name)
        assert "\n" not in str(e.value) and name in str(e.value)
