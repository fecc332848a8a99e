"""Metrics from summed NLL: hand-computable cases."""
import math

import pytest
import torch

from elephant import metrics
from elephant.metrics import (BUCKET_LABELS, NLLMeter, PositionBuckets, bits_per_byte, count_bytes,
                              count_words, mfu, peak_flops, token_loss, token_perplexity,
                              word_perplexity)


def test_uniform_model_has_perplexity_vocab_and_log2_vocab_bits_per_token():
    V, tokens, n_bytes = 256, 1000, 2500
    total_nll = tokens * math.log(V)          # every token gets probability 1/V
    assert token_loss(total_nll, tokens) == pytest.approx(math.log(V))
    assert token_perplexity(total_nll, tokens) == pytest.approx(V)
    assert bits_per_byte(total_nll, n_bytes) == pytest.approx(math.log2(V) * tokens / n_bytes)


def test_uniform_byte_model_is_eight_bits_per_byte():
    text = "héllo wörld"                      # 13 UTF-8 bytes, one token per byte
    n = count_bytes(text)
    assert n == 13
    assert bits_per_byte(n * math.log(256), n) == pytest.approx(8.0)


def test_word_perplexity_by_hand():
    text = "  the cat\tsat\n\non the  mat "
    assert count_words(text) == 6
    total_nll = 12.0                          # nats over the whole text, however it was tokenized
    assert word_perplexity(total_nll, count_words(text)) == pytest.approx(math.exp(2.0))


def test_empty_counts_give_nan_not_an_error():
    assert math.isnan(token_loss(0.0, 0))
    assert math.isnan(bits_per_byte(1.0, 0))
    assert math.isnan(word_perplexity(1.0, 0))
    assert token_perplexity(1e6, 1) == math.inf


def test_meter_sums_documents_and_reports_per_document_mean_separately():
    m = NLLMeter()
    m.add(nll_sum=10.0, tokens=10, n_bytes=40, words=8)    # mean loss 1.0
    m.add(nll_sum=30.0, tokens=10, n_bytes=40, words=8)    # mean loss 3.0
    m.add(nll_sum=2.0, tokens=1, n_bytes=4, words=1)       # mean loss 2.0
    r = m.result()
    assert (r["documents"], r["tokens"], r["bytes"], r["words"]) == (3, 21, 84, 17)
    assert r["loss"] == pytest.approx(42.0 / 21)
    assert r["perplexity"] == pytest.approx(math.exp(2.0))
    assert r["bits_per_byte"] == pytest.approx(42.0 / math.log(2) / 84)
    assert r["word_perplexity"] == pytest.approx(math.exp(42.0 / 17))
    assert r["per_doc_mean_loss"] == pytest.approx((1.0 + 3.0 + 2.0) / 3)


def test_meter_merge_equals_one_meter():
    a, b, whole = NLLMeter(), NLLMeter(), NLLMeter()
    for i, m in enumerate([a, a, b]):
        m.add(i + 1.0, 2, 5, 1)
        m.add_positions([0.5, 1.5], [i, 600 + i])
        whole.add(i + 1.0, 2, 5, 1)
        whole.add_positions([0.5, 1.5], [i, 600 + i])
    a.merge(b)
    assert a.result() == whole.result()


def test_bucket_labels():
    assert BUCKET_LABELS == ("0-512", "512-1K", "1K-2K", "2K-4K", "4K-8K", "8K-16K", "16K-32K",
                             "32K-64K", "64K-128K", "128K-256K", "256K-512K", "512K-1M", "1M+")


def test_buckets_by_position_edges():
    b = PositionBuckets()
    positions = torch.tensor([0, 511, 512, 1023, 1024, 2047, 2048, 32767, 32768, 10 ** 6])
    nll = torch.arange(1.0, 11.0)
    b.add(nll, positions)
    d = b.to_dict()
    assert d["0-512"] == {"tokens": 2, "nll_sum": 3.0, "loss": 1.5}
    assert d["512-1K"] == {"tokens": 2, "nll_sum": 7.0, "loss": 3.5}
    assert d["1K-2K"] == {"tokens": 2, "nll_sum": 11.0, "loss": 5.5}
    assert d["2K-4K"] == {"tokens": 1, "nll_sum": 7.0, "loss": 7.0}
    assert d["16K-32K"] == {"tokens": 1, "nll_sum": 8.0, "loss": 8.0}
    assert d["32K-64K"] == {"tokens": 1, "nll_sum": 9.0, "loss": 9.0}
    assert d["512K-1M"] == {"tokens": 1, "nll_sum": 10.0, "loss": 10.0}     # 10 ** 6 < 2 ** 20
    assert "4K-8K" not in d                       # empty buckets are left out
    assert sum(v["tokens"] for v in d.values()) == len(positions)


def test_buckets_reject_mismatched_lengths():
    with pytest.raises(ValueError, match="positions"):
        PositionBuckets().add([1.0, 2.0], [0])


def test_plot_position_loss_writes_png(tmp_path):
    pytest.importorskip("matplotlib")
    a, b = PositionBuckets(), PositionBuckets()
    a.add([3.0, 2.0, 1.0], [0, 600, 1500])
    b.add([3.0, 2.5], [0, 600])
    out = metrics.plot_position_loss({"ours": a.to_dict(), "baseline": b.to_dict()}, tmp_path / "p.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_peak_flops_and_mfu():
    assert peak_flops("NVIDIA H100 80GB HBM3") == 989e12
    assert peak_flops("NVIDIA H200") == 989e12
    assert peak_flops("cpu") is None
    assert peak_flops(None) is None
    assert peak_flops("NVIDIA H100 PCIe") is None          # lower peak than the SXM part
    # 6 * N FLOPs per token, N = 100M, 500k tokens/s -> 3e14 FLOP/s of 989e12
    assert mfu(6 * 100e6, 500e3, 989e12) == pytest.approx(3e14 / 989e12)
    assert mfu(1.0, 1.0, None) is None


def test_position_bucket_sums_made_elsewhere_add_like_tokens():
    from elephant.metrics import BUCKET_LABELS, PositionBuckets
    nll, positions = [0.5, 1.0, 2.0, 4.0], [1, 511, 512, 40000]
    direct, summed = PositionBuckets(), PositionBuckets()
    direct.add(nll, positions)
    sums, counts = [0.0] * len(BUCKET_LABELS), [0] * len(BUCKET_LABELS)
    sums[0], counts[0], sums[1], counts[1], sums[7], counts[7] = 1.5, 2, 2.0, 1, 4.0, 1   # 32K-64K
    summed.add_sums(sums, counts)
    assert summed.to_dict() == direct.to_dict()
    with pytest.raises(ValueError, match="add_sums"):
        summed.add_sums([1.0], [1])
