"""The needle test on real text: a key with a random value stated inside a held-out document, the
key stated again N tokens later; the score is the next-token accuracy of the value that follows it.

    python eval.py --checkpoint runs/wt103-70m --needle 1K,4K,64K,1M              # one key
    python eval.py --checkpoint runs/wt103-70m --needle 64K --needle-keys 8       # 8 keys, 1 asked

The haystack is the model's own kind of text, held out: stretches of its data's test split (the
`text_for` of the run's `data` settings: Python source, Wikitext, a text folder), cut at random
words, so that the needle stands where a user's long document would have it. Each document
states `keys` facts ("silver_fox_code = 482913" in the default form, "assign"), then states the
first key again at each distance from its previous mention and scores the value's tokens
teacher-forced (the model's most likely next token against each; chance is 0.10 a digit with the
byte tokenizer, near 0 with a BPE tokenizer, whose value tokens hold several digits each).
Documents are streamed chunk by chunk with carried state, exactly as eval.py streams text (no
context limit, constant memory): `elephant.recall.evaluate_recall` does the streaming.

The default form is one that `data.recall_mix`'s default forms ("sentence", "label") leave out, so
the test measures recall of what was stated, not of a form learned in training. Distances up to
LONG (128K) share one pass of `lanes` documents; each longer one takes a pass of its own with
`long_lanes` (a 1M-token document per lane). Results carry a key per measure for the results
files: needle_4k, needle_1m (one key), needle_multi_64k (several keys, one asked).
"""
from __future__ import annotations

import time

import torch

from .recall import evaluate_recall, label

LONG = 128 * 1024
DEFAULT_FORM = "assign"


def text_for(data, split: str = "test") -> str | None:
    """The haystack text of a run's data settings (a DataConfig): its source's `split`, joined
    (data_packing.sources.filler_text); for a recall corpus its data.recall_filler's text, None
    for the synthetic filler."""
    from data_packing.sources import filler_text, open_source
    from .recall import filler_for
    if data.source == "recall":
        return filler_for(data.recall_filler, split, data.site_packages)
    return filler_text(open_source(data.source, split, data.path or None,
                                   text_field=data.text_field, **data.source_options()))


def needle_key(n_keys: int, distance: int) -> str:
    """The results-file key of a measure: needle_64k, needle_multi_64k."""
    return f"needle{'_multi' if n_keys > 1 else ''}_{label(distance).lower()}"


def needle_test(model, tokenizer, haystack: str | None, distances: list[int], chunk_len: int,
                device, keys: tuple[int, ...] = (1,), lanes: int = 64, long_lanes: int = 16,
                form: str = DEFAULT_FORM, autocast=None, seed: int = 4321,
                progress: bool = False, log=None, ablation: str = "none") -> dict:
    """Accuracy by distance for each key count of `keys` (see the module docstring); `ablation`:
    a carried part dropped after every chunk (elephant.recall.ablate). Returns
    {"passes": [each pass's evaluate_recall result], "needle_...": accuracy, "seconds": ...}."""
    out = {"form": form, "passes": [], "lanes": lanes, "long_lanes": long_lanes}
    t0 = time.perf_counter()
    for n in keys:
        short = [d for d in distances if d <= LONG]
        plan = []
        if n == 1 and short:
            plan.append((short, lanes))          # one fact asked again at every distance
        elif short:
            plan += [([d], lanes) for d in short]   # the first of n facts asked once
        plan += [([d], long_lanes) for d in distances if d > LONG]
        for group, width in plan:
            r = evaluate_recall(model, tokenizer, group, width, chunk_len, device, n_pairs=n,
                                seed=seed + len(out["passes"]), autocast=autocast,
                                progress=progress, filler=haystack, template=form,
                                ablation=ablation)
            r["keys"] = n
            out["passes"].append(r)
            for d, row in zip(group, r["by_distance"].values()):
                out[needle_key(n, d)] = row["accuracy"]
                if log:
                    log(f"needle, {n} key{'s' if n > 1 else ''}, {label(d)} tokens: "
                        f"{row['accuracy']:.3f} (exact {row['exact']:.3f}, {width} documents, "
                        f"{r['tokens_per_s'] / 1e3:,.0f}k tokens/s)")
    out["seconds"] = time.perf_counter() - t0
    return out


def format_needles(result: dict) -> str:
    """A markdown table of a needle_test result: a row per key count, a column per distance."""
    rows: dict[int, dict[str, float]] = {}
    for r in result["passes"]:
        for lab, row in r["by_distance"].items():
            rows.setdefault(r["keys"], {})[lab] = row["accuracy"]
    labels = list(dict.fromkeys(lab for row in rows.values() for lab in row))
    lines = ["| keys | " + " | ".join(labels) + " |", "|---|" + "---|" * len(labels)]
    for n, row in rows.items():
        lines.append(f"| {n} | " + " | ".join(f"{row[lab]:.3f}" if lab in row else "-"
                                              for lab in labels) + " |")
    return "\n".join(lines + [f"needle form {result['form']!r}; value-token accuracy (chance 0.10 "
                              f"a byte digit, near 0 a BPE token); {result['seconds']:.0f} s"])


def autocast_for(device) -> object:
    """bf16 autocast on CUDA (as eval.py reads), None elsewhere."""
    return (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if device.type == "cuda" else None
