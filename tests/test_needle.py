"""The needle test (elephant/needle.py): its documents, passes and scores, held to a model whose
recall is known: an induction oracle that predicts, after any 12 tokens it has seen before, the
token that followed them then, as long as that was at most `reach` tokens back."""
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from data_packing.tokenizer import ByteTokenizer
from elephant import needle
from elephant.needle import format_needles, needle_key, needle_test, text_for


class InductionOracle(torch.nn.Module):
    """The chunk interface of ElephantLM (model(tokens, state, reset) -> logits, state) over a
    lane's history of n-grams: a perfect copier within `reach` tokens, blind beyond it."""

    def __init__(self, vocab: int, reach: int = 10 ** 9, n: int = 12):
        super().__init__()
        self.vocab, self.reach, self.n = vocab, reach, n
        self.cfg = SimpleNamespace(kv_keep=0, n_mem=0)
        self.blocks = []

    def init_state(self, lanes, device=None):
        return SimpleNamespace(pos=torch.zeros(lanes, dtype=torch.long), lanes=lanes,
                               seen=[[] for _ in range(lanes)], where=[{} for _ in range(lanes)])

    def forward(self, tokens, state, reset=None):
        B, T = tokens.shape
        logits = torch.zeros(B, T, self.vocab)
        for b in range(B):
            seen, where = state.seen[b], state.where[b]
            for t in range(T):
                seen.append(int(tokens[b, t]))
                gram = tuple(seen[-self.n:])
                at = where.get(gram)
                if len(gram) == self.n and at is not None and len(seen) - at <= self.reach:
                    logits[b, t, seen[at]] = 1.0      # what followed the gram last time
                if len(seen) > self.n:
                    where[tuple(seen[-self.n - 1:-1])] = len(seen) - 1
        state.pos += T
        return logits, state


def haystack(seed: int = 0) -> str:
    rng = np.random.default_rng(seed)
    return " ".join("".join(rng.choice(list("qwrtypsdfghjklzxcvbnm"), 5)) for _ in range(4000))


def test_a_copier_recalls_every_needle_and_a_forgetful_one_only_within_its_reach(monkeypatch):
    monkeypatch.setattr(needle, "LONG", 200)          # 600 tokens: a long distance, its own pass
    tok, text = ByteTokenizer(), haystack()
    common = dict(chunk_len=64, device=torch.device("cpu"), keys=(1, 3), lanes=3, long_lanes=2)
    perfect = needle_test(InductionOracle(320), tok, text, [80, 150, 600], **common)
    assert {k: v for k, v in perfect.items() if k.startswith("needle")} == {
        "needle_80": 1.0, "needle_150": 1.0, "needle_600": 1.0,
        "needle_multi_80": 1.0, "needle_multi_150": 1.0, "needle_multi_600": 1.0}
    # one key: the short distances in one pass (3 lanes), 600 in its own (2 lanes); three keys:
    # a pass per distance (the first key asked once)
    assert [(r["keys"], list(r["by_distance"]), r["lanes"]) for r in perfect["passes"]] == [
        (1, ["80", "150"], 3), (1, ["600"], 2), (3, ["80"], 3), (3, ["150"], 3), (3, ["600"], 2)]
    # the value's digits alone are scored: 6 a document
    assert all(r["by_distance"][k]["by_place"] and len(r["by_distance"][k]["by_place"]) == 6
               for r in perfect["passes"] for k in r["by_distance"])
    forgetful = needle_test(InductionOracle(320, reach=120), tok, text, [80, 150, 600], **common)
    assert forgetful["needle_80"] == forgetful["needle_multi_80"] == 1.0
    assert forgetful["needle_150"] == forgetful["needle_600"] == forgetful["needle_multi_600"] == 0.0
    table = format_needles(forgetful)
    assert "| 1 | 1.000 | 0.000 | 0.000 |" in table and "| 3 | 1.000 | 0.000 | 0.000 |" in table


def test_the_needle_is_stated_in_a_form_of_its_own_among_the_haystack():
    # the default form (assign) is not one the training mix draws by default; each document
    # states it inside the haystack's words and asks it at the distance
    from data_packing.recall import eval_document
    doc = eval_document(np.random.default_rng(0), ByteTokenizer(), [300], filler=haystack(),
                        template=needle.DEFAULT_FORM)
    assert doc.text.count("_code = ") == 2 and doc.queries[0].distance == 300
    from elephant.config import DataConfig
    assert needle.DEFAULT_FORM not in DataConfig().mix_templates()
    assert needle_key(1, 65536) == "needle_64k" and needle_key(8, 1 << 20) == "needle_multi_1m"


def test_the_haystack_is_the_data_held_out_split(tmp_path):
    for split, word in (("train", "trainword"), ("test", "testword")):
        (tmp_path / f"{split}.txt").write_text(" ".join([word] * 100))
    from elephant.config import DataConfig
    text = text_for(DataConfig(source="text", path=str(tmp_path)), "test")
    assert "testword" in text and "trainword" not in text
    assert text_for(DataConfig(source="recall", recall_filler=""), "test") is None   # synthetic
    with pytest.raises(Exception, match="does not exist"):
        text_for(DataConfig(source="text", path=str(tmp_path / "missing")), "test")
