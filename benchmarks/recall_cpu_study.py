"""The recall study at CPU scale: which memory design carries a fact how far, and does it hold far
past the distances it was trained on?

    python benchmarks/recall_cpu_study.py --variants gated,soft,replace --steps 400 \
        --distances 128,512,2K,8K,32K --out benchmarks/results/recall_cpu.json

Tiny models (d_model 64) on 3-digit facts, trained with the loss on the answer digits only (the
signal a 2-core CPU can afford), on documents whose one query stands `--train-gaps` tokens after
the fact, chunk 32, no KV window: what crosses a chunk boundary goes through the memory (and the
Mamba state in hybrids). Gradients reach the whole document (bptt 8 chunks). Then every variant
streams held-out documents with carried state (elephant.recall.evaluate_recall) and is scored by
distance, also with the memory dropped after every chunk.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.common import environment  # noqa: E402
from data_packing.tokenizer import ByteTokenizer  # noqa: E402
from elephant.config import ModelConfig, OptimConfig  # noqa: E402
from elephant.model import ElephantLM  # noqa: E402
from elephant.optim import build_optimizers  # noqa: E402
from elephant.recall import evaluate_recall, format_table, parse_count, train_on_answers  # noqa: E402

BASE = dict(vocab_size=128, d_model=64, n_heads=4, layers="AA", d_mlp=128, d_state=16,
            mamba_head_dim=32, ssd_chunk=16, n_mem=4, kv_window=0, bptt_chunks=8)
VARIANTS = {
    "closed": {},                                  # the defaults: gated, every gate shut at start
    "gated": {"mem_gate_init": 0.0},               # gated, gates half open at start
    "soft": {"mem_gate_init": 0.0, "mem_gate_min": 0.0},   # ... and never exactly 0
    "replace": {"mem_update": "replace"},          # the plain RMT rewrite
    "closed-floor": {"mem_gate_min": 0.3},         # a gate under 0.3 writes nothing
    "cost": {"mem_gate_init": 0.0, "mem_write_cost": 0.01},   # writing costs from the start
    "closed-cost": {"mem_write_cost": 0.01},
    "closed-cost-late": {"mem_write_cost": 0.01, "cost_from": 0.5},   # ... from halfway
    # copying through attention (window of one chunk), no memory: attention alone vs hybrids
    "copy-attn": {"n_mem": 0, "kv_window": 32},
    "copy-MA": {"layers": "MA", "n_mem": 0, "kv_window": 32},
    "copy-AM": {"layers": "AM", "n_mem": 0, "kv_window": 32},
    "hybrid": {"layers": "MA"},                    # Mamba + attention, gated memory
    "hybrid-nomem": {"layers": "MA", "n_mem": 0},  # only the Mamba state carries across chunks
    # truncated BPTT over `window` chunks (train gaps beyond it), with and without memory-only
    # backpropagation past the window
    "window": {"window": 2},
    "path": {"window": 2, "memory_path": True},
    "path-open": {"window": 2, "memory_path": True, "mem_gate_init": 0.0},
    "window4": {"window": 4},
    "path4": {"window": 4, "memory_path": True},
    # the memory tokens at the chunk's rotary positions (read: first, write: last) instead of
    # unrotated (model.mem_rotary)
    "closed-chunkpos": {"mem_rotary": "chunk"},
    # the memory's keys scored without rotary by every query, the write slots at the chunk's last
    # position (model.mem_rotary "free")
    "closed-free": {"mem_rotary": "free"},
    # partial rotary: pairs of a period over 256 tokens (longer than the training documents)
    # not rotated (model.rope_max_period)
    "closed-prope": {"rope_max_period": 256.0},
    # a KV window of one chunk, and long-term kept tokens past it (model.kv_keep)
    "kvw": {"kv_window": 32},
    "keep": {"kv_window": 32, "kv_keep": 16},
    "keep-free": {"kv_window": 32, "kv_keep": 16, "mem_rotary": "free"},
    "keep-nomem": {"kv_window": 32, "kv_keep": 16, "n_mem": 0},
    "keep-nonoise": {"kv_window": 32, "kv_keep": 16, "kv_keep_noise": 0.0},
}


def run(name: str, args) -> dict:
    torch.manual_seed(args.seed)
    settings = {**BASE, **VARIANTS[name]}
    cost_from = settings.pop("cost_from", 0.0)     # the write cost starts at this fraction of training
    window = settings.pop("window", 0)
    memory_path = settings.pop("memory_path", False)
    cfg = ModelConfig(**settings)
    model = ElephantLM(cfg)
    opt = build_optimizers(model, OptimConfig(warmup_steps=20, momentum_warmup_steps=20,
                                              adam_lr=0.01, embed_lr=0.01, head_lr=0.01))
    gaps = tuple(parse_count(g) for g in args.train_gaps.split(","))
    cost = cfg.mem_write_cost

    def schedule(step: int) -> None:
        model.cfg.mem_write_cost = cost if step >= cost_from * args.steps else 0.0
    t0 = time.perf_counter()
    curve = train_on_answers(model, opt, args.steps, args.lanes, args.chunk, gaps, args.digits,
                             args.seed, log=lambda m: print(f"[{name}] {m}", file=sys.stderr, flush=True),
                             start_max_gap=args.curriculum_from, before_step=schedule,
                             window=window, memory_path=memory_path, log_gaps=args.log_gaps)
    tok, T = ByteTokenizer(), args.chunk
    distances = [parse_count(d) for d in args.distances.split(",")]
    out = {"variant": name, "config": cfg.to_dict(), "params": model.num_params(), "curve": curve,
           "train_seconds": time.perf_counter() - t0, "recall": {}}
    parts = ["none"] + ["memory"] * bool(cfg.n_mem) + ["keep"] * bool(cfg.kv_keep)
    for part in parts:
        r = evaluate_recall(model, tok, distances, args.eval_lanes, T, torch.device("cpu"),
                            seed=1234 + args.seed, ablation=part, digits=args.digits)
        out["recall"][part] = r
        print(format_table(r, f"[{name}] ablation={part}"), file=sys.stderr, flush=True)
    for offset in [parse_count(o) for o in args.offsets.split(",") if o.strip() not in ("", "0")]:
        r = evaluate_recall(model, tok, distances, args.eval_lanes, T, torch.device("cpu"),
                            seed=1234 + args.seed, digits=args.digits, offset=offset)
        out["recall"][f"offset{offset}"] = r
        print(format_table(r, f"[{name}] read from position {offset}"), file=sys.stderr, flush=True)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variants", default="closed,gated,replace")
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--lanes", type=int, default=32)
    p.add_argument("--chunk", type=int, default=32)
    p.add_argument("--digits", type=int, default=3)
    p.add_argument("--train-gaps", default="40,160", help="min,max distance of the training queries")
    p.add_argument("--log-gaps", action="store_true",
                   help="training distances log-uniform in --train-gaps (default: uniform)")
    p.add_argument("--curriculum-from", type=int, default=0,
                   help="grow the largest training distance from this one (0: no curriculum)")
    p.add_argument("--distances", default="128,512,2K,8K,32K")
    p.add_argument("--eval-lanes", type=int, default=32)
    p.add_argument("--offsets", default="",
                   help="also score every document read from these rotary positions (e.g. 1M)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="benchmarks/results/recall_cpu.json")
    args = p.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    results = {"benchmark": "recall_cpu_study", **environment(), "args": vars(args), "variants": {}}
    out = Path(args.out)
    if out.is_file():      # add to an earlier run of the same study (other variants or seeds)
        results["variants"] = json.loads(out.read_text()).get("variants", {})
    for name in args.variants.split(","):
        key = f"{name}/seed{args.seed}"
        results["variants"][key] = run(name, args)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(results, indent=1))
    for key, r in results["variants"].items():
        accs = " ".join(f"{d}:{v['accuracy']:.2f}" for d, v in r["recall"]["none"]["by_distance"].items())
        print(f"{key:24s} {accs}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
