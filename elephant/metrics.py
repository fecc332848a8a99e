"""Evaluation metrics computed from summed quantities, so that any number of chunks, lanes or ranks add up.

Everything here starts from one number, the total negative log-likelihood in nats of the predicted
tokens, and divides it by a count:

    token loss         total_nll / tokens                  (nats per token)
    token perplexity   exp(total_nll / tokens)             (depends on the tokenizer)
    bits per byte      total_nll / ln 2 / bytes            (UTF-8 bytes of the raw text)
    word perplexity    exp(total_nll / words)              (Wikitext convention: whitespace-separated
                                                            words of the raw text)

Bits per byte and word perplexity divide by properties of the raw text, not of the tokenizer, so they
compare models with different tokenizers (our byte or BPE models against Pythia) as long as both sum
the NLL of the whole text. Token loss and perplexity only compare models that share a tokenizer.

The per-document mean loss (the mean over documents of each document's mean token loss) is the
figure the model this project descends from reported; it weighs a 100-token document like a
10,000-token one, so it is reported under its own name and never mixed with the token loss.

`PositionBuckets` sums per-token NLL by the token's position within its document (0-512, 512-1K,
1K-2K, ..., 512K-1M, 1M+): the curve shows whether carried state helps late tokens. MFU helpers at the end.
"""
from __future__ import annotations

import math
from pathlib import Path

import torch

LN2 = math.log(2.0)


def token_loss(total_nll: float, tokens: int) -> float:
    """Mean NLL per predicted token, in nats."""
    return total_nll / tokens if tokens else float("nan")


def token_perplexity(total_nll: float, tokens: int) -> float:
    return _exp(token_loss(total_nll, tokens))


def bits_per_byte(total_nll: float, n_bytes: int) -> float:
    """Bits needed per UTF-8 byte of the raw text: total_nll / ln 2 / bytes."""
    return total_nll / LN2 / n_bytes if n_bytes else float("nan")


def word_perplexity(total_nll: float, words: int) -> float:
    """exp(total_nll / words), words counted by `count_words` on the raw text."""
    return _exp(total_nll / words) if words else float("nan")


def count_bytes(text: str) -> int:
    return len(text.encode("utf-8"))


def count_words(text: str) -> int:
    """Whitespace-separated words of the raw text (str.split(): runs of whitespace separate, no empties)."""
    return len(text.split())


def _exp(x: float) -> float:
    try:
        return math.exp(x)
    except OverflowError:
        return float("inf")


# ---------------------------------------------------------------------------------------------
# Loss by position within the document
# Bucket k holds positions [EDGES[k], EDGES[k+1]); the last bucket is open (1M+). Bands that no
# document reaches hold no tokens and are left out of the curves.
BUCKET_EDGES = (0, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072, 262144, 524288,
                1048576)


def _k(n: int) -> str:
    for unit, size in (("M", 1 << 20), ("K", 1 << 10)):
        if n >= size:
            return f"{n // size}{unit}"
    return str(n)


BUCKET_LABELS = tuple(
    f"{_k(lo)}-{_k(hi)}" for lo, hi in zip(BUCKET_EDGES, BUCKET_EDGES[1:])
) + (f"{_k(BUCKET_EDGES[-1])}+",)


class PositionBuckets:
    """Sums of per-token NLL and token counts per position bucket (position = 0-based index of the
    predicted token within its document)."""

    def __init__(self):
        self.nll = [0.0] * len(BUCKET_LABELS)
        self.tokens = [0] * len(BUCKET_LABELS)

    def add(self, nll, positions) -> None:
        """nll: per-token NLL (tensor, array or list); positions: the same tokens' positions."""
        nll = torch.as_tensor(nll, dtype=torch.float64).reshape(-1).cpu()
        positions = torch.as_tensor(positions, dtype=torch.int64).reshape(-1).cpu()
        if nll.shape != positions.shape:
            raise ValueError(f"PositionBuckets.add: {nll.numel()} NLL values for "
                             f"{positions.numel()} positions")
        if positions.numel() and int(positions.min()) < 0:
            raise ValueError("PositionBuckets.add: positions must be >= 0")
        edges = torch.tensor(BUCKET_EDGES[1:], dtype=torch.int64)
        idx = torch.bucketize(positions, edges, right=True)         # (N,) bucket of each token
        n = len(BUCKET_LABELS)
        sums = torch.zeros(n, dtype=torch.float64).scatter_add_(0, idx, nll)
        counts = torch.bincount(idx, minlength=n)
        for k in range(n):
            self.nll[k] += float(sums[k])
            self.tokens[k] += int(counts[k])

    def add_sums(self, nll_sums, counts) -> None:
        """Add per-bucket sums made elsewhere (e.g. on the GPU): one NLL sum and one token count
        per bucket, in BUCKET_LABELS order."""
        if len(nll_sums) != len(BUCKET_LABELS) or len(counts) != len(BUCKET_LABELS):
            raise ValueError(f"PositionBuckets.add_sums: expected {len(BUCKET_LABELS)} sums and "
                             f"counts, got {len(nll_sums)} and {len(counts)}")
        for k in range(len(BUCKET_LABELS)):
            self.nll[k] += float(nll_sums[k])
            self.tokens[k] += int(counts[k])

    def merge(self, other: "PositionBuckets") -> None:
        for k in range(len(BUCKET_LABELS)):
            self.nll[k] += other.nll[k]
            self.tokens[k] += other.tokens[k]

    def to_dict(self) -> dict:
        """{label: {"tokens": n, "nll_sum": s, "loss": s / n}} for the buckets that hold tokens."""
        return {label: {"tokens": n, "nll_sum": s, "loss": s / n}
                for label, s, n in zip(BUCKET_LABELS, self.nll, self.tokens) if n}


def plot_position_loss(curves: dict[str, dict], path: str | Path, title: str = "Loss by position") -> Path:
    """Plot one line per model of mean token loss by position bucket into a PNG.

    curves: {name: PositionBuckets.to_dict()} (e.g. {"elephant": ..., "pythia-70m": ...}). Losses
    of models with different tokenizers are per *their* tokens: compare shapes, not levels.
    """
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ImportError("plotting the loss by position needs matplotlib: "
                          "pip install matplotlib (or the [plot] extra)") from None
    path = Path(path)
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, buckets in curves.items():
        xs = [i for i, label in enumerate(BUCKET_LABELS) if label in buckets]
        ys = [buckets[BUCKET_LABELS[i]]["loss"] for i in xs]
        ax.plot(xs, ys, marker="o", label=name)
    ax.set_xticks(range(len(BUCKET_LABELS)), BUCKET_LABELS, rotation=30)
    ax.set_xlabel("position of the predicted token in its document (tokens)")
    ax.set_ylabel("mean loss (nats / token)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    if curves:
        ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


# ---------------------------------------------------------------------------------------------
class NLLMeter:
    """Accumulates whole documents' summed NLL and counts; `result()` turns them into the metrics.

        meter = NLLMeter()
        for doc in docs:                  # nll_sum over the doc's predicted tokens, in nats
            meter.add(nll_sum, tokens, count_bytes(text), count_words(text))
            meter.add_positions(token_nll, positions)   # optional: the loss-by-position curve
        meter.result()
    """

    def __init__(self):
        self.nll_sum = 0.0
        self.tokens = 0
        self.bytes = 0
        self.words = 0
        self.documents = 0
        self._doc_loss_sum = 0.0      # sum over documents of the document's mean token loss
        self._doc_loss_count = 0      # documents with at least one predicted token
        self.buckets = PositionBuckets()

    def add(self, nll_sum: float, tokens: int, n_bytes: int = 0, words: int = 0) -> None:
        """One whole document: its summed NLL (nats), predicted tokens, UTF-8 bytes and words."""
        self.nll_sum += float(nll_sum)
        self.tokens += int(tokens)
        self.bytes += int(n_bytes)
        self.words += int(words)
        self.documents += 1
        if tokens:
            self._doc_loss_sum += float(nll_sum) / int(tokens)
            self._doc_loss_count += 1

    def add_positions(self, nll, positions) -> None:
        self.buckets.add(nll, positions)

    def merge(self, other: "NLLMeter") -> None:
        self.nll_sum += other.nll_sum
        self.tokens += other.tokens
        self.bytes += other.bytes
        self.words += other.words
        self.documents += other.documents
        self._doc_loss_sum += other._doc_loss_sum
        self._doc_loss_count += other._doc_loss_count
        self.buckets.merge(other.buckets)

    def result(self) -> dict:
        """Totals and metrics; bits_per_byte / word_perplexity are NaN when bytes / words were not given."""
        return {
            "documents": self.documents,
            "tokens": self.tokens,
            "bytes": self.bytes,
            "words": self.words,
            "nll_sum": self.nll_sum,
            "loss": token_loss(self.nll_sum, self.tokens),
            "perplexity": token_perplexity(self.nll_sum, self.tokens),
            "bits_per_byte": bits_per_byte(self.nll_sum, self.bytes),
            "word_perplexity": word_perplexity(self.nll_sum, self.words),
            # mean over documents of each document's mean token loss (the figure the model this
            # project descends from reported); not token-weighted, not comparable to "loss"
            "per_doc_mean_loss": (self._doc_loss_sum / self._doc_loss_count
                                  if self._doc_loss_count else float("nan")),
            "position_buckets": self.buckets.to_dict(),
        }


# ---------------------------------------------------------------------------------------------
# Model FLOPs utilization
# Dense bf16 tensor-core peaks (no 2:4 sparsity) from NVIDIA's H100 SXM / H200 datasheets.
PEAK_FLOPS_BF16 = {
    "H100": 989e12,
    "H200": 989e12,
}


def peak_flops(device_name: str | None) -> float | None:
    """Dense bf16 peak FLOP/s for a device name such as torch.cuda.get_device_name() returns
    ("NVIDIA H100 80GB HBM3"); None for CPUs and devices not in the table (MFU is then not reported).

    H100 PCIe and NVL parts have lower peaks than the SXM figure here; they are matched as
    unknown so that no MFU is overstated.
    """
    if not device_name:
        return None
    name = device_name.upper()
    if "PCIE" in name or "NVL" in name:
        return None
    for key, flops in PEAK_FLOPS_BF16.items():
        if key in name:
            return flops
    return None


def mfu(flops_per_token: float, tokens_per_s: float, device_peak_flops: float | None) -> float | None:
    """Achieved model FLOP/s over the device's peak (per device: pass per-device tokens/s)."""
    if not device_peak_flops:
        return None
    return flops_per_token * tokens_per_s / device_peak_flops
