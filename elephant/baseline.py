"""Score the same raw text with a Hugging Face causal LM (Pythia by default) for a side-by-side figure.

The baseline reads each document with its own tokenizer and rolling windows of at most `max_len`
tokens; the caller compares bits per byte and word perplexity, which divide the summed NLL by
properties of the raw text and so do not depend on the tokenizer.

Convention (the same as lm-evaluation-harness's rolling loglikelihood):
- A document's tokens are `ids = tokenizer(text, add_special_tokens=False)`, n of them. The model
  reads `s = [prefix] + ids`, where prefix is the tokenizer's BOS id, or its EOS id when it has no
  BOS (Pythia: `<|endoftext|>`), so the first token of the document is scored too, conditioned on
  the prefix alone. All n tokens are scored, each exactly once; no end-of-document token is scored.
  A document that tokenizes to nothing contributes its bytes and words but no tokens.
- The first window is `s[0 : min(n, max_len)]` and scores tokens 1..min(n, max_len) of s (every
  token of the document up to max_len). Each later window ends `stride` tokens further (the last
  one at n), is exactly max_len long, and scores only the tokens the previous windows did not:
  a token at index i of s, scored by the window that ends at e, sees the context s[e - max_len : i],
  so at least max_len - stride tokens.
- stride=None means stride=max_len: disjoint windows, as lm-evaluation-harness does by default
  (the first token of a later window then sees a single token of context). A smaller stride buys
  longer contexts with max_len / stride times the compute.

Every document's position buckets use the 0-based position of the scored token in the document
(`ids` index), so the curve lines up with our own model's.
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
import torch.nn.functional as F

from elephant.metrics import NLLMeter, count_bytes, count_words

# Published figures for baselines, for when the model cannot be loaded (offline). Each entry must
# name its source and the exact setting, e.g.
#   {"EleutherAI/pythia-70m-deduped": {"wikitext-103 test word_perplexity": (value, "source URL, table")}}
# Empty: no figure for Pythia on Wikitext-103 with this protocol was found in a published source
# we could read (the Pythia repository's lm-eval result files cover LAMBADA, PIQA, ... but not
# Wikitext), so none is given rather than one from memory.
KNOWN_REFERENCE: dict[str, dict[str, tuple[float, str]]] = {}

DTYPES = {"auto": "auto", "bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


class BaselineUnavailable(RuntimeError):
    """The baseline model cannot be loaded (no transformers, offline, unknown id or path)."""


def load_baseline(name_or_path: str, device: str | torch.device = "cpu",
                  dtype: str | torch.dtype | None = None):
    """Load a causal LM and its tokenizer by Hub id (e.g. EleutherAI/pythia-70m-deduped) or local
    folder -> (model in eval mode on `device`, tokenizer). dtype: None (the checkpoint's own),
    "auto", "bf16", "fp16", "fp32" or a torch.dtype. Raises BaselineUnavailable with one line."""
    try:
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError:
        raise BaselineUnavailable("the baseline needs transformers: pip install transformers "
                                  "(or the [hf] extra)") from None
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ValueError(f"baseline dtype: expected one of {', '.join(DTYPES)}, got {dtype!r}")
        dtype = DTYPES[dtype]
    path = Path(name_or_path).expanduser()
    looks_local = str(name_or_path).startswith(("/", ".", "~")) or str(name_or_path).count("/") > 1
    if looks_local and not path.is_dir():
        raise BaselineUnavailable(f"cannot load baseline {name_or_path!r}: no such folder "
                                  f"(expected a local model folder or a Hub id like "
                                  f"EleutherAI/pythia-70m-deduped)")
    try:
        tokenizer = AutoTokenizer.from_pretrained(name_or_path)
        kwargs = {"dtype": dtype} if dtype is not None else {}
        model = AutoModelForCausalLM.from_pretrained(name_or_path, **kwargs)
    except Exception as e:  # OSError, HTTP errors, validation errors: all mean "not available here"
        raise BaselineUnavailable(f"cannot load baseline {name_or_path!r}: {_first_line(e)} "
                                  f"(offline? pass a local folder holding the model)") from None
    return model.to(device).eval(), tokenizer


def _first_line(e: BaseException) -> str:
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    return lines[0] if lines else type(e).__name__


def prefix_token_id(tokenizer) -> int:
    """BOS if the tokenizer has one, else EOS (lm-evaluation-harness's choice)."""
    for tid in (tokenizer.bos_token_id, tokenizer.eos_token_id):
        if tid is not None:
            return int(tid)
    raise ValueError("the baseline tokenizer has neither a BOS nor an EOS token to condition the "
                     "first token of a document on")


def rolling_windows(n: int, max_len: int, stride: int | None = None) -> Iterator[tuple[int, int, int]]:
    """Windows over s = [prefix] + ids (n document tokens) as (start, end, n_new): the model reads
    s[start:end] and the last n_new of its predictions (targets s[end - n_new + 1 : end + 1]) are
    scored. Together they score targets 1..n once each."""
    stride = max_len if stride is None else stride
    if not 1 <= stride <= max_len:
        raise ValueError(f"stride: expected 1..max_len={max_len}, got {stride}")
    if n <= 0:
        return
    end = min(n, max_len)
    yield 0, end, end
    while end < n:
        new_end = min(end + stride, n)
        yield new_end - max_len, new_end, new_end - end     # new_end >= max_len: a full window
        end = new_end


@torch.inference_mode()
def score_tokens(model, ids: list[int], prefix: int, max_len: int = 2048, stride: int | None = None,
                 batch_size: int = 4, device=None) -> torch.Tensor:
    """Per-token NLL (nats, float64, shape (n,)) of one document's token ids under the rolling-window
    convention of this module; entry j is the NLL of ids[j]."""
    device = device if device is not None else next(model.parameters()).device
    s = torch.tensor([prefix] + list(ids), dtype=torch.long)
    n = len(ids)
    out = torch.empty(n, dtype=torch.float64)
    windows = list(rolling_windows(n, max_len, stride))
    # windows after the first are all max_len long: batch them
    groups = [windows[:1]] + [windows[i:i + batch_size] for i in range(1, len(windows), batch_size)]
    for group in groups:
        if not group:
            continue
        inputs = torch.stack([s[a:e] for a, e, _ in group]).to(device)         # (B, L)
        logits = model(input_ids=inputs).logits                                  # (B, L, V)
        for row, (a, e, n_new) in enumerate(group):
            tail = logits[row, -n_new:].float()                                  # (n_new, V)
            targets = s[e - n_new + 1:e + 1].to(device)
            nll = F.cross_entropy(tail, targets, reduction="none")
            out[e - n_new:e] = nll.double().cpu()                                # ids index = s index - 1
    return out


def score_documents(model, tokenizer, docs: Iterable[str], max_len: int = 2048,
                    stride: int | None = None, device=None, batch_size: int = 4) -> dict:
    """Score every document; returns NLLMeter.result() (nll_sum, tokens, bytes, words, loss,
    perplexity, bits_per_byte, word_perplexity, per_doc_mean_loss, position_buckets) plus
    "per_document": [{"nll_sum", "tokens", "bytes", "words"}] and the "max_len" / "stride" used."""
    limit = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    if limit is not None and max_len > limit:
        raise ValueError(f"max_len={max_len} exceeds the baseline's max_position_embeddings={limit}")
    prefix = prefix_token_id(tokenizer)
    meter = NLLMeter()
    per_doc = []
    for text in docs:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        nll = score_tokens(model, ids, prefix, max_len, stride, batch_size, device)
        doc = {"nll_sum": float(nll.sum()), "tokens": len(ids),
               "bytes": count_bytes(text), "words": count_words(text)}
        meter.add(doc["nll_sum"], doc["tokens"], doc["bytes"], doc["words"])
        meter.add_positions(nll, torch.arange(len(ids)))
        per_doc.append(doc)
    result = meter.result()
    result.update(per_document=per_doc, max_len=max_len, stride=max_len if stride is None else stride)
    return result
