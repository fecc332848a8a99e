"""Equal-compute language modelling study: the hybrid with memory against a plain transformer of
the same parameter count, each trained for the same GPU minutes on real long documents (Python
source: the standard library plus site-packages, bytes), then scored over whole documents.

    python benchmarks/lm_study.py --budget-s 210 --out benchmarks/results/lm_study \
        [--variants hybrid,transformer] [--eval-docs 400]

hybrid       configs/recall.toml's design at the LM-study size: MAMMAMMA, d_model 512, 8 memory
             tokens (gated), KV window 512, chunks of 512, BPTT 2 chunks, 32 lanes.
hybrid-path  the hybrid, each step 4 BPTT windows with memory-only backpropagation across them.
hybrid-keep  the hybrid with 128 kept tokens per attention layer past its window (model.kv_keep).
hybrid-free  hybrid-keep with position-free memory (model.mem_rotary=free): the recall recipe
             before 16 slots.
hybrid-recall  hybrid-free with 16 memory slots and kept tokens dropped in training
             (model.kv_keep_drop 0.1): the recall recipe now.
hybrid-bf16  the hybrid with its residual stream in bf16 (model.residual=autocast: ~4% more steps
             in the same minutes; 0.012 nats worse at an equal 600 steps, docs/RESULTS.md
             session 33): whether the trade pays at equal time.
transformer  AAAAAAAA, no memory, no window, chunks of 2048 (its context), 8 lanes x 2 micro-batches
             = the same tokens per step; its MLP is widened until its parameter count matches.
Both train one after the other on the same GPU for `--budget-s` seconds each (the schedule is fit
to the budget: benchmarks/common.train_for_budget; the first 10 steps, compilation, are not
counted), then stream the same test documents with
carried state (elephant.evaluate: no context limit for the hybrid; the transformer restarts its
context every 2048 tokens, as when it was trained). Written: `<out>/summary.json` (device,
versions, date, command, loss and bits per byte, loss by position, also over the documents of
over 32K tokens alone) and `<out>/positions.png`, `<out>/positions_long_documents.png`.
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
VARIANTS = {
    "hybrid": ["model.layers=MAMMAMMA", "model.n_mem=8", "model.kv_window=512",
               "model.bptt_chunks=2", "train.chunk_len=512", "train.lanes=32"],
    # the hybrid with memory-only backpropagation over 4 windows per step (train.memory_windows)
    "hybrid-path": ["model.layers=MAMMAMMA", "model.n_mem=8", "model.kv_window=512",
                    "model.bptt_chunks=2", "train.chunk_len=512", "train.lanes=32",
                    "train.memory_windows=4"],
    # the hybrid with 128 kept tokens per attention layer past its window (model.kv_keep)
    "hybrid-keep": ["model.layers=MAMMAMMA", "model.n_mem=8", "model.kv_window=512",
                    "model.kv_keep=128", "model.bptt_chunks=2", "train.chunk_len=512",
                    "train.lanes=32"],
    # hybrid-keep whose queries score the memory without rotary (model.mem_rotary=free)
    "hybrid-free": ["model.layers=MAMMAMMA", "model.n_mem=8", "model.kv_window=512",
                    "model.kv_keep=128", "model.mem_rotary=free", "model.bptt_chunks=2",
                    "train.chunk_len=512", "train.lanes=32"],
    # the recall recipe's memory as it is now: hybrid-free with 16 memory slots and the kept
    # tokens dropped after 1 chunk in 10 in training (model.kv_keep_drop)
    "hybrid-recall": ["model.layers=MAMMAMMA", "model.n_mem=16", "model.kv_window=512",
                      "model.kv_keep=128", "model.mem_rotary=free", "model.kv_keep_drop=0.1",
                      "model.bptt_chunks=2", "train.chunk_len=512", "train.lanes=32"],
    # the hybrid with its residual stream in autocast's dtype (bf16)
    "hybrid-bf16": ["model.layers=MAMMAMMA", "model.n_mem=8", "model.kv_window=512",
                    "model.bptt_chunks=2", "train.chunk_len=512", "train.lanes=32",
                    "model.residual=autocast"],
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


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variants", default="hybrid,transformer")
    p.add_argument("--budget-s", type=float, default=210)
    p.add_argument("--eval-docs", type=int, default=400)
    p.add_argument("--out", default="benchmarks/results/lm_study")
    p.add_argument("--cache", default="cache")
    p.add_argument("--cpu-smoke", action="store_true")
    p.add_argument("overrides", nargs="*")
    args = p.parse_args()
    import torch

    from benchmarks.common import environment, train_for_budget
    from elephant.config import load_config
    from elephant.evaluate import evaluate, open_corpus
    from elephant.metrics import BUCKET_LABELS, plot_position_loss
    from elephant.model import ElephantLM
    from elephant.trainer import Trainer

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    base = SHAPE + [f"data.cache_dir={args.cache}"] + (SMOKE if args.cpu_smoke else []) + args.overrides
    if args.cpu_smoke:
        args.budget_s, args.eval_docs = min(args.budget_s, 15), min(args.eval_docs, 4)
    names = args.variants.split(",")
    configs = {name: base + VARIANTS[name] for name in names}
    hybrids = [n for n in names if n.startswith("hybrid")]
    if hybrids and "transformer" in configs:   # the transformer matches the first hybrid's size
        target = ElephantLM(load_config(None, configs[hybrids[0]]).model).num_params()
        configs["transformer"].append(f"model.d_mlp={matched_mlp(configs['transformer'], target)}")
    summary = {"benchmark": "lm_study", **environment(), "budget_s": args.budget_s, "variants": {}}
    curves, long_curves = {}, {}
    for name in names:
        cfg = load_config(None, configs[name] + [f"train.run_dir={out / 'runs' / name}"])
        trainer = Trainer(cfg, progress=False)
        t0 = time.perf_counter()
        curve, warm_s = train_for_budget(trainer, args.budget_s, name=name)
        train_s = time.perf_counter() - t0
        test = open_corpus(cfg.data, "test", trainer.rt, progress=False)[1]
        t_eval = time.perf_counter()
        ev = evaluate(trainer.model, test, lanes=16, chunk_len=cfg.train.chunk_len,
                      device=trainer.rt.device, autocast=trainer.rt.autocast, max_docs=args.eval_docs)
        curves[name] = ev["position_buckets"]
        long_curves[name] = ev["position_buckets_long"]
        summary["variants"][name] = {
            "overrides": configs[name], "params": trainer.model.num_params(), "steps": trainer.step,
            "train_seconds": train_s, "warm_seconds": warm_s,
            "tokens_seen": trainer.tokens_seen, "curve": curve,
            "eval_loss": ev["loss"], "eval_bits_per_byte": ev["bits_per_byte"],
            "eval_documents": ev["documents"], "eval_tokens": ev["tokens"],
            "eval_seconds": time.perf_counter() - t_eval,
            "loss_by_position": {k: v["loss"] for k, v in ev["position_buckets"].items()},
            # the same curve over the test documents that reach the last band, alone: each band
            # then averages the same documents
            "long_documents": ev["long_documents"],
            "loss_by_position_long_documents": {k: v["loss"]
                                                for k, v in ev["position_buckets_long"].items()},
            "peak_mem_gb": (torch.cuda.max_memory_allocated() / 2 ** 30
                            if torch.cuda.is_available() else None)}
        print(f"[{name}] eval loss {ev['loss']:.4f} bpb {ev['bits_per_byte']:.4f}", flush=True)
        del trainer
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        # written after every variant: a run cut short keeps what it measured
        plot_position_loss(curves, out / "positions.png", "Test loss by position in the document")
        plot_position_loss(long_curves, out / "positions_long_documents.png",
                           f"The same, over the {ev['long_documents']} test documents that reach "
                           f"the {BUCKET_LABELS[-1]} band")
        (out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps({n: {k: v[k] for k in ("params", "steps", "eval_loss", "eval_bits_per_byte")}
                      for n, v in summary["variants"].items()}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
