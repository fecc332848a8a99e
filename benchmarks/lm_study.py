"""Equal-compute language modelling study: the hybrid with memory against a plain transformer of
the same parameter count, each trained for the same GPU minutes on real long documents (Python
source: the standard library plus site-packages, bytes), then scored over whole documents.

    python benchmarks/lm_study.py --budget-s 210 --out benchmarks/results/lm_study \
        [--variants hybrid,transformer] [--eval-docs 400] [--reset-every 2K] [--long-docs 64]
    python benchmarks/lm_study.py --score-only [--runs cache/lm_study_runs]        # no training

hybrid       configs/recall.toml's design at the LM-study size: MAMMAMMA, d_model 512, 8 memory
             tokens (gated), KV window 512, chunks of 512, BPTT 2 chunks, 32 lanes.
hybrid-path  the hybrid, each step 4 BPTT windows with memory-only backpropagation across them.
hybrid-keep  the hybrid with 128 kept tokens per attention layer past its window (model.kv_keep).
hybrid-free  hybrid-keep with position-free memory (model.mem_rotary=free): the recall recipe
             before 16 slots.
hybrid-recall  hybrid-free with 16 memory slots and kept tokens dropped in training
             (model.kv_keep_drop 0.1): the recall recipe now.
hybrid-x0    the hybrid whose attention layers also read the token embeddings (model.attn_x0);
             hybrid-x0-half, hybrid-x0-quarter: their gain starts at 0.5 or 0.25, not 1
             (model.attn_x0_init);
             hybrid-x0-norm: the sum normalized again (model.attn_x0_norm);
             hybrid-x0-fixed: from 0.25, held there (model.attn_x0_gain = "fixed"), as the
             recipes; hybrid-recall-x0: hybrid-recall with it; hybrid-keep-x0: hybrid-keep
             with it (kept tokens, no other part of the recall design).
hybrid-bf16  the hybrid with its residual stream in bf16 (model.residual=autocast: ~4% more steps
             in the same minutes; 0.012 nats worse at an equal 600 steps, docs/RESULTS.md):
             whether the trade pays at equal time.
transformer  AAAAAAAA, no memory, no window, chunks of 2048 (its context), 8 lanes x 2 micro-batches
             = the same tokens per step; its MLP is widened until its parameter count matches.
Both train one after the other on the same GPU for `--budget-s` seconds each (the schedule is fit
to the budget: benchmarks/common.train_for_budget; the first 10 steps, compilation, are not
counted) and are saved (`<runs>/<variant>/checkpoints/`; `--runs`, by default
`<cache>/lm_study_runs`, beside the data cache: not in the results; an earlier run there is moved
aside to `<variant>.old-<date>`, never deleted), then each is loaded back and
streams the same test documents with carried state as eval.py reads them (elephant.evaluate: no
context limit for the hybrid; the transformer restarts its context every 2048 tokens, as when it
was trained).

The context ablation (what carried context buys): the first `--long-docs` test documents longer
than 32K tokens are scored by each variant with its state carried through the document, and by
each variant that carries state (memory, a KV window or Mamba layers) again with the state reset
every `--reset-every` tokens (default 2048: the transformer's context) as if a new document
started there, the loss by position kept by the position in the whole document. The context gain
of a band is the reset loss minus the carried loss, in nats per byte (the token loss times the
documents' tokens per byte: exact for this study's byte tokenizer but for the end-of-text
token); `context_gain_8k_32k` is the mean of the 8K-16K and 16K-32K bands' gains (of the first
hybrid at the top of summary.json, of each variant under `context_ablation`): context the
transformer's 2048 tokens cannot hold. `--score-only` loads `<runs>/<variant>` (a training run
dir; its newest checkpoint that verifies) and scores it without training, into `<out>`'s summary
(keeping the training figures a summary already there holds).

`--cpu-smoke` runs every part on the CPU in about a minute: a 32-wide model, an eighth of the
lanes, 15 s of training, 4 documents, and the ablation over the shortest test document of over
16K tokens (its 16K-32K band partly filled).

Written: `<out>/summary.json` (device, versions, date, commit, command, loss and bits per byte,
loss by position, also over the documents of over 32K tokens alone, the context ablation) and
`<out>/positions.png`, `<out>/positions_long_documents.png`, `<out>/positions_context.png`.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

SHAPE = ["model.vocab_size=320", "model.d_model=512", "model.n_heads=8", "model.d_mlp=1536",
         "model.d_state=64", "model.mamba_head_dim=64", "model.tied_embeddings=true",
         "data.source=pycode", "data.tokenizer=bytes", "data.site_packages=true",
         "data.valid_split=", "train.eval_every=0", "train.ckpt_every=0", "optim.warmup_steps=50",
         "optim.schedule=linear", "optim.cooldown_frac=0.5"]
# the hybrid: MAMMAMMA, 8 memory tokens, KV window 512, BPTT 2, 32 lanes of 512 bytes
_HYBRID = ["model.layers=MAMMAMMA", "model.n_mem=8", "model.kv_window=512", "model.bptt_chunks=2",
           "train.chunk_len=512", "train.lanes=32"]
# the recall recipe's memory: 16 position-free slots, 128 kept tokens dropped after 1 chunk in 10
_RECALL_MEMORY = ["model.n_mem=16", "model.kv_keep=128", "model.mem_rotary=free",
                  "model.kv_keep_drop=0.1"]
# the recipes' attn_x0: the gain held at 0.25
_X0_HELD = ["model.attn_x0=true", "model.attn_x0_init=0.25", "model.attn_x0_gain=fixed"]
VARIANTS = {
    "hybrid": _HYBRID,
    # the hybrid with memory-only backpropagation over 4 windows per step (train.memory_windows)
    "hybrid-path": _HYBRID + ["train.memory_windows=4"],
    # the hybrid with 128 kept tokens per attention layer past its window (model.kv_keep)
    "hybrid-keep": _HYBRID + ["model.kv_keep=128"],
    # hybrid-keep whose queries score the memory without rotary (model.mem_rotary=free)
    "hybrid-free": _HYBRID + ["model.kv_keep=128", "model.mem_rotary=free"],
    # the recall recipe's memory as it is now: hybrid-free with 16 memory slots and the kept
    # tokens dropped after 1 chunk in 10 in training (model.kv_keep_drop)
    "hybrid-recall": _HYBRID + _RECALL_MEMORY,
    # the hybrid whose attention layers also read the stack's normalized input (model.attn_x0),
    # its gain started at 1, 0.5 or 0.25
    "hybrid-x0": _HYBRID + ["model.attn_x0=true"],
    "hybrid-x0-half": _HYBRID + ["model.attn_x0=true", "model.attn_x0_init=0.5"],
    "hybrid-x0-quarter": _HYBRID + ["model.attn_x0=true", "model.attn_x0_init=0.25"],
    # hybrid-x0-quarter with a fixed gain (model.attn_x0_gain): no gradient sum over positions
    "hybrid-x0-fixed": _HYBRID + _X0_HELD,
    # the recall recipe's memory design (hybrid-recall) with the recipes' attn_x0: what the
    # default recipes would train if they took that design (issue 57)
    "hybrid-recall-x0": _HYBRID + _RECALL_MEMORY + _X0_HELD,
    # hybrid-x0-fixed with 128 kept tokens per attention layer: the part that carried a fact past
    # the window when the recall recipe trained on every byte (its memory slots did not)
    "hybrid-keep-x0": _HYBRID + ["model.kv_keep=128"] + _X0_HELD,
    # hybrid-x0 with the sum normalized again (model.attn_x0_norm): the attention's input at RMS 1
    "hybrid-x0-norm": _HYBRID + ["model.attn_x0=true", "model.attn_x0_norm=true"],
    # the hybrid with its residual stream in autocast's dtype (bf16)
    "hybrid-bf16": _HYBRID + ["model.residual=autocast"],
    "transformer": ["model.layers=AAAAAAAA", "model.n_mem=0", "model.kv_window=0",
                    "model.bptt_chunks=1", "train.chunk_len=2048", "train.lanes=8",
                    "train.grad_accum=2"],
}
SMOKE = ["model.d_model=32", "model.n_heads=2", "model.d_mlp=64", "model.d_state=16",
         "model.mamba_head_dim=16", "train.device=cpu", "train.compile=off",
         "data.site_packages=false"]


def matched_mlp(overrides: list[str], target: int) -> int:
    """The d_mlp (a multiple of 64) that brings a config's parameter count closest to `target`."""
    from elephant.config import load_config
    from elephant.model import ElephantLM

    def params(d_mlp: int) -> int:
        cfg = load_config(None, overrides + [f"model.d_mlp={d_mlp}"])
        return ElephantLM(cfg.model).num_params()
    # the count is linear in d_mlp: two points give the line
    p64, p128 = params(64), params(128)
    per = (p128 - p64) / 64
    return max(64, 64 + 64 * round((target - p64) / per / 64))


# the context ablation's documents: longer than this many tokens (they reach the last band; the
# CPU smoke takes one over SMOKE_LONG_TOKENS, the shortest: its 8K-32K gain over less than 32K)
LONG_DOC_TOKENS = 32768
SMOKE_LONG_TOKENS = 16384
# the bands whose mean gain is `context_gain_8k_32k`
GAIN_BANDS = ("8K-16K", "16K-32K")


def long_documents(corpus, min_tokens: int, limit: int, shortest: bool = False):
    """A corpus of the documents longer than `min_tokens` tokens: the first `limit` in the
    corpus's order (the `limit` shortest with `shortest`, as the CPU smoke takes them)."""
    import numpy as np

    from data_packing import TokenizedCorpus
    lengths = corpus.doc_lengths
    docs = np.flatnonzero(lengths > min_tokens)
    if shortest:
        docs = docs[np.argsort(lengths[docs], kind="stable")]
    docs = np.sort(docs[:limit])
    offsets = np.concatenate([[0], np.cumsum(lengths[docs])]).astype(np.int64)
    tokens = (np.concatenate([corpus.doc(int(i)) for i in docs]) if docs.size
              else corpus.tokens[:0])
    return TokenizedCorpus(tokens, offsets, np.asarray(corpus.doc_bytes)[docs],
                           np.asarray(corpus.doc_words)[docs], dict(corpus.manifest), corpus.path)


def carries_state(model_cfg) -> bool:
    """Whether the model carries anything from chunk to chunk: memory, a KV window, Mamba or
    delta rule state."""
    return bool(model_cfg.n_mem or model_cfg.kv_window or {"M", "D"} & set(model_cfg.layers))


def context_gain(carried: dict, reset: dict, bytes_per_token: float) -> dict:
    """{band: reset loss - carried loss} in nats per byte, over the bands both hold."""
    return {band: (reset[band] - loss) / bytes_per_token for band, loss in carried.items()
            if band in reset}


def score(name: str, run_dir: Path, args, test, long_test) -> dict:
    """A saved run's figures: its loss over the first `--eval-docs` test documents with carried
    state, and the context ablation over the long documents (carried; reset every
    `--reset-every` tokens where the model carries state), read as eval.py reads them."""
    import torch

    from elephant.evaluate import evaluate
    from elephant.hub import from_pretrained
    cuda = torch.cuda.is_available() and not args.cpu_smoke
    device = torch.device("cuda" if cuda else "cpu")
    model, _, config = from_pretrained(run_dir, device=device)
    chunk_len = config["train"]["chunk_len"]
    autocast = (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if cuda else None
    common = dict(chunk_len=chunk_len, device=device, autocast=autocast, cuda_graph=cuda,
                  compact=True, side=cuda)
    t0 = time.perf_counter()
    ev = evaluate(model, test, lanes=16, max_docs=args.eval_docs, **common)
    result = {
        "checkpoint": str(run_dir), "params": model.num_params(),
        "eval_loss": ev["loss"], "eval_bits_per_byte": ev["bits_per_byte"],
        "eval_documents": ev["documents"], "eval_tokens": ev["tokens"],
        "eval_seconds": time.perf_counter() - t0,
        "loss_by_position": {k: v["loss"] for k, v in ev["position_buckets"].items()},
        # the same curve over the test documents that reach the last band, alone: each band
        # then averages the same documents
        "long_documents": ev["long_documents"],
        "loss_by_position_long_documents": {k: v["loss"]
                                            for k, v in ev["position_buckets_long"].items()}}
    print(f"[{name}] eval loss {ev['loss']:.4f} bpb {ev['bits_per_byte']:.4f}", flush=True)
    if not len(long_test):
        return result
    ablation = {"documents": len(long_test), "chunk_len": chunk_len}
    runs = {"carried": 0}
    if carries_state(model.cfg):
        runs["reset"] = args.reset_every
    for kind, every in runs.items():
        t0 = time.perf_counter()
        ev = evaluate(model, long_test, lanes=min(16, len(long_test)), reset_every=every, **common)
        ablation[kind] = {"reset_every": every, "loss": ev["loss"],
                          "bits_per_byte": ev["bits_per_byte"], "tokens": ev["tokens"],
                          "bytes": ev["bytes"], "seconds": time.perf_counter() - t0,
                          "loss_by_position": {k: v["loss"] for k, v in ev["position_buckets"].items()},
                          "tokens_by_position": {k: v["tokens"]
                                                 for k, v in ev["position_buckets"].items()}}
        print(f"[{name}] {len(long_test)} document(s) over {args.long_tokens // 1024}K tokens, "
              f"{kind}{f' every {every}' if every else ''}: loss {ev['loss']:.4f}", flush=True)
    if "reset" in ablation:
        carried, reset = ablation["carried"], ablation["reset"]
        gain = context_gain(carried["loss_by_position"], reset["loss_by_position"],
                            carried["bytes"] / carried["tokens"])
        ablation["context_gain"] = gain
        ablation["context_gain_8k_32k"] = (sum(gain[b] for b in GAIN_BANDS) / len(GAIN_BANDS)
                                           if all(b in gain for b in GAIN_BANDS) else None)
    result["context_ablation"] = ablation
    del model
    return result


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variants", default="hybrid,transformer")
    p.add_argument("--budget-s", type=float, default=210)
    p.add_argument("--eval-docs", type=int, default=400)
    p.add_argument("--reset-every", default="2048",
                   help="the context ablation's reset interval in tokens (2048, 2K; a multiple "
                        "of every variant's chunk length)")
    p.add_argument("--long-docs", type=int, default=64,
                   help="the context ablation's test documents: the first N longer than 32K tokens")
    p.add_argument("--runs", help="where the trained runs and their checkpoints go (default "
                                  "<cache>/lm_study_runs)")
    p.add_argument("--score-only", action="store_true",
                   help="no training: score the runs <runs>/<variant> an earlier study saved")
    p.add_argument("--out", default="benchmarks/results/lm_study")
    p.add_argument("--cache", default="cache")
    p.add_argument("--cpu-smoke", action="store_true")
    p.add_argument("overrides", nargs="*")
    args = p.parse_args()
    import torch

    from benchmarks.common import environment, train_for_budget
    from elephant.config import ConfigError, load_config
    from elephant.evaluate import open_corpus, parse_reset_every
    from elephant.metrics import BUCKET_LABELS, plot_position_loss
    from elephant.model import ElephantLM
    from elephant.trainer import Trainer

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    base = SHAPE + [f"data.cache_dir={args.cache}"] + (SMOKE if args.cpu_smoke else []) + args.overrides
    if args.cpu_smoke:
        args.budget_s, args.eval_docs = min(args.budget_s, 15), min(args.eval_docs, 4)
        args.long_docs = 1
    names = args.variants.split(",")
    configs = {name: base + VARIANTS[name] for name in names}
    if args.cpu_smoke:   # an eighth of the lanes: the same code in an eighth of the time a step
        for name, overrides in configs.items():
            lanes = int([o for o in overrides if o.startswith("train.lanes=")][-1].split("=")[1])
            overrides.append(f"train.lanes={max(1, lanes // 8)}")
    hybrids = [n for n in names if n.startswith("hybrid")]
    if hybrids and "transformer" in configs:   # the transformer matches the first hybrid's size
        target = ElephantLM(load_config(None, configs[hybrids[0]]).model).num_params()
        configs["transformer"].append(f"model.d_mlp={matched_mlp(configs['transformer'], target)}")
    chunk_lens = {name: load_config(None, configs[name]).train.chunk_len for name in names}
    try:   # a multiple of every variant's chunk length
        for chunk_len in sorted(set(chunk_lens.values())):
            reset_every = parse_reset_every(args.reset_every, chunk_len)
        if not reset_every:
            raise ConfigError("--reset-every 0: the context ablation needs a positive interval")
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    args.reset_every = reset_every
    args.long_tokens = SMOKE_LONG_TOKENS if args.cpu_smoke else LONG_DOC_TOKENS
    runs = Path(args.runs) if args.runs else Path(args.cache) / "lm_study_runs"
    summary = {"benchmark": "lm_study", **environment("cpu" if args.cpu_smoke else None),
               "budget_s": args.budget_s, "reset_every": args.reset_every,
               "long_document_tokens": args.long_tokens, "runs": str(runs),
               "score_only": args.score_only, "variants": {}}
    if args.score_only:
        if (out / "summary.json").is_file():   # the training figures of the study that made them
            before = json.loads((out / "summary.json").read_text())
            summary["budget_s"] = before.get("budget_s")
            summary["variants"] = before.get("variants", {})
    curves, long_curves, context_curves = {}, {}, {}
    for name in names:
        cfg = load_config(None, configs[name] + [f"train.run_dir={runs / name}"])
        entry = summary["variants"].setdefault(name, {})
        entry["overrides"] = configs[name]
        if not args.score_only:
            trainer = Trainer(cfg, progress=False, restart=True)   # an earlier run moved aside
            t0 = time.perf_counter()
            curve, warm_s = train_for_budget(trainer, args.budget_s, name=name)
            entry.update(steps=trainer.step, train_seconds=time.perf_counter() - t0,
                         warm_seconds=warm_s, tokens_seen=trainer.tokens_seen, curve=curve,
                         peak_mem_gb=(torch.cuda.max_memory_allocated() / 2 ** 30
                                      if torch.cuda.is_available() else None))
            trainer.save()
            trainer.close()
            del trainer
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
        if not curves:   # the same test documents for every variant (their data config is shared)
            test = open_corpus(cfg.data, "test", progress=False)[1]
            long_test = long_documents(test, args.long_tokens, args.long_docs, shortest=args.cpu_smoke)
        entry.update(score(name, runs / name, args, test, long_test))
        curves[name] = entry["loss_by_position"]
        long_curves[name] = entry["loss_by_position_long_documents"]
        ablation = entry.get("context_ablation", {})
        for kind in ("carried", "reset"):
            if kind in ablation:
                label = name if kind == "carried" else f"{name}, reset every {args.reset_every}"
                context_curves[label] = ablation[kind]["loss_by_position"]
        # the first hybrid's gain, at the top: what its carried state buys past the 2K a reset keeps
        ablations = [v["context_ablation"] for n, v in summary["variants"].items()
                     if n in hybrids and "context_gain" in v.get("context_ablation", {})]
        summary["context_gain"] = ablations[0]["context_gain"] if ablations else None
        summary["context_gain_8k_32k"] = ablations[0]["context_gain_8k_32k"] if ablations else None
        # written after every variant: a run cut short keeps what it measured
        as_buckets = lambda c: {k: {"loss": v} for k, v in c.items()}   # noqa: E731
        plot_position_loss({n: as_buckets(c) for n, c in curves.items()}, out / "positions.png",
                           "Test loss by position in the document")
        plot_position_loss({n: as_buckets(c) for n, c in long_curves.items()},
                           out / "positions_long_documents.png",
                           f"The same, over the {entry['long_documents']} test documents that reach "
                           f"the {BUCKET_LABELS[-1]} band")
        plot_position_loss({n: as_buckets(c) for n, c in context_curves.items()},
                           out / "positions_context.png",
                           f"Carried state against a reset every {args.reset_every} tokens "
                           f"({len(long_test)} documents over {args.long_tokens // 1024}K tokens)")
        (out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps({n: {k: v.get(k) for k in ("params", "steps", "eval_loss", "eval_bits_per_byte")}
                      | {"context_gain_8k_32k": v.get("context_ablation", {}).get("context_gain_8k_32k")}
                      for n, v in summary["variants"].items()}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
