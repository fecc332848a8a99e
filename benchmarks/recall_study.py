"""The recall study: train variants of configs/recall.toml side by side for the same wall-clock
budget on one GPU (`elephant.recall.train_recall`: the loss on the answers, truncated BPTT over 8
chunks, memory-only backpropagation over 32), then evaluate each by distance, with the state
ablations.

    python benchmarks/recall_study.py --variants hybrid,attention,replace,nomem --budget-s 330 \
        --out benchmarks/results/recall_study [--distances 128,512,1K,4K,16K,64K] [--long 1M]

Every variant is the recipe plus a few overrides (VARIANTS below); they train concurrently, one
process each, so all see the same GPU for the same minutes. A variant trains until its budget is
spent: after a short warm-up its step time is measured and the step count set to what fits, so the
learning-rate schedule runs to its end. Each writes `<out>/<name>.json` (training curve, recall by
distance, recall with the memory / KV window / Mamba state dropped after every chunk); the parent
writes `<out>/summary.json` with device, versions, date and command. `--cpu-smoke` runs a tiny
version on the CPU.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path


ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

VARIANTS = {   # name: (overrides, memory-only backpropagation)
    "hybrid": ([], True),                                                  # the recipe
    "nopath": ([], False),                                                 # BPTT over 8 chunks only
    "attention": (["model.layers=AAAAAA"], True),                         # attention only, memory
    "attention-nopath": (["model.layers=AAAAAA"], False),
    "mmamma": (["model.layers=MMAMMA"], True),                            # one attention layer
    "replace": (["model.mem_update=replace"], True),                      # plain RMT rewrite
    "nomem": (["model.n_mem=0"], False),                                  # no memory tokens
    "nokv": (["model.kv_window=0"], True),                                # no KV window
    "soft": (["model.mem_gate_min=0"], True),                             # gates never exactly 0
    "open": (["model.mem_gate_init=0"], True),                            # gates half open at start
    # a plain transformer: attention only, no memory, no KV window (sees its own chunk only)
    "transformer": (["model.layers=AAAAAA", "model.n_mem=0", "model.kv_window=0"], False),
    # ... and one that sees the previous chunk too (KV window of one chunk), at the same compute
    "transformer-kv": (["model.layers=AAAAAA", "model.n_mem=0"], False),
}
SMOKE = ["model.d_model=32", "model.n_heads=2", "model.d_mlp=64", "model.d_state=16",
         "model.mamba_head_dim=16", "model.ssd_chunk=16", "model.n_mem=2", "model.kv_window=32",
         "model.bptt_chunks=2", "train.lanes=2", "train.chunk_len=32", "data.recall_docs=40",
         "data.recall_max_gap=256", "train.compile=off", "train.device=cpu"]


def train_and_eval(name: str, overrides: list[str], budget_s: float, out: Path, distances: str,
                   long: str, lanes: int, runs: Path) -> dict:
    from elephant.config import load_config
    from elephant.hub import from_pretrained
    from elephant.recall import evaluate_recall, format_table, parse_count, train_recall
    from elephant.trainer import setup_runtime

    overrides_v, memory_path = VARIANTS[name]
    cfg = load_config(ROOT / "configs/recall.toml",
                      [f"train.run_dir={runs / name}", *overrides_v, *overrides])
    info = train_recall(cfg, budget_s=budget_s, memory_path=memory_path,
                        log=lambda m: print(f"[{name}] {m}", file=sys.stderr, flush=True))
    rt = setup_runtime(cfg)
    device, autocast = rt.device, rt.autocast
    model, tokenizer, _ = from_pretrained(runs / name, device=device)
    result = {"name": name, "overrides": overrides_v + overrides, "memory_path": memory_path,
              "config": cfg.to_dict(), "params": model.num_params(), "steps": info["steps"],
              "train_seconds": info["train_seconds"], "curve": info["curve"], "recall": {}}
    dist = [parse_count(d) for d in distances.split(",")]
    parts = ["none", "memory", "kv", "ssm", "delta"]
    for part in parts:
        if part == "memory" and not cfg.model.n_mem:
            continue
        if part == "kv" and not cfg.model.kv_window:
            continue
        if part == "ssm" and not {"M", "D"} & set(cfg.model.layers):
            continue
        if part == "delta" and "D" not in cfg.model.layers:
            continue
        r = evaluate_recall(model, tokenizer, dist, lanes, cfg.train.chunk_len, device,
                            n_pairs=1, autocast=autocast, ablation=part)
        result["recall"][part] = r
        print(format_table(r, f"[{name}] ablation={part}"), file=sys.stderr, flush=True)
    r = evaluate_recall(model, tokenizer, dist[:4], lanes, cfg.train.chunk_len, device,
                        n_pairs=4, autocast=autocast)
    result["recall_4pairs"] = r
    print(format_table(r, f"[{name}] 4 pairs"), file=sys.stderr, flush=True)
    if long:
        r = evaluate_recall(model, tokenizer, [parse_count(d) for d in long.split(",")],
                            max(1, lanes // 2), cfg.train.chunk_len, device, autocast=autocast)
        result["recall_long"] = r
        print(format_table(r, f"[{name}] long"), file=sys.stderr, flush=True)
    (out / f"{name}.json").write_text(json.dumps(result, indent=1))
    return result


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variants", default="hybrid,nopath,attention,transformer")
    p.add_argument("--budget-s", type=float, default=330)
    p.add_argument("--out", default="benchmarks/results/recall_study")
    p.add_argument("--distances", default="128,512,1K,4K,16K,64K")
    p.add_argument("--long", default="", help="distances for a second, longer evaluation (e.g. 1M)")
    p.add_argument("--long-variants", default="hybrid,nopath,attention")
    p.add_argument("--lanes", type=int, default=32)
    p.add_argument("--runs", default="runs/recall_study", help="run dirs (checkpoints) of the variants")
    p.add_argument("--run", help="(internal) train and evaluate this one variant")
    p.add_argument("--cpu-smoke", action="store_true")
    p.add_argument("overrides", nargs="*")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    overrides = list(args.overrides) + (SMOKE if args.cpu_smoke else [])
    if args.cpu_smoke:
        args.budget_s, args.lanes = min(args.budget_s, 20), 4
        args.distances, args.long = "64,256", args.long and "1K"
    if args.run:
        long = args.long if args.run in args.long_variants.split(",") else ""
        train_and_eval(args.run, overrides, args.budget_s, out, args.distances, long, args.lanes,
                       Path(args.runs))
        return 0

    from benchmarks.common import environment
    names = args.variants.split(",")
    procs = {}
    for name in names:
        cmd = [sys.executable, __file__, "--run", name, "--budget-s", str(args.budget_s), "--out", str(out),
               "--distances", args.distances, "--long", args.long, "--long-variants", args.long_variants,
               "--lanes", str(args.lanes), "--runs", args.runs, *args.overrides] + (["--cpu-smoke"] if args.cpu_smoke else [])
        procs[name] = subprocess.Popen(cmd, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    codes = {name: proc.wait() for name, proc in procs.items()}
    summary = {"benchmark": "recall_study", "command": " ".join(sys.argv), **environment(),
               "budget_s": args.budget_s, "exit_codes": codes, "variants": {}}
    for name in names:
        f = out / f"{name}.json"
        if f.is_file():
            r = json.loads(f.read_text())
            summary["variants"][name] = {
                "overrides": r["overrides"], "params": r["params"], "steps": r["steps"],
                "train_seconds": r["train_seconds"],
                "final_answer_loss": r["curve"][-1]["answer_loss"] if r["curve"] else None,
                "recall": {part: {k: v["accuracy"] for k, v in rr["by_distance"].items()}
                           for part, rr in r["recall"].items()},
                "recall_4pairs": {k: v["accuracy"] for k, v in r["recall_4pairs"]["by_distance"].items()},
                **({"recall_long": {k: v["accuracy"] for k, v in r["recall_long"]["by_distance"].items()},
                    "long_peak_mem_gb_at": r["recall_long"].get("peak_mem_gb_at")}
                   if "recall_long" in r else {}),
                "mem_gate_closed_frac": r["recall"]["none"].get("mem_gate_closed_frac"),
            }
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary["variants"], indent=1))
    return 0 if all(c == 0 for c in codes.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
