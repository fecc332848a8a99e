"""Summarize a GPU training run's log.jsonl into benchmarks/results/train_<gpu>_<n>gpu.json.

    python benchmarks/train_summary.py RUN_DIR N_GPUS [RUN_DIR_1GPU]
tokens/s, MFU and peak memory are the medians over the logged intervals after the first (compile
and warm-up); with a 1-GPU run dir given, the speed-up of this run over it.
"""
import datetime
import json
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from elephant.trainer import read_log  # noqa: E402


def summarize(run: Path) -> dict:
    records = [r for r in read_log(run / "log.jsonl") if r["kind"] == "train"][1:]
    evals = [r for r in read_log(run / "log.jsonl") if r["kind"] == "eval"]
    med = lambda key: statistics.median(r[key] for r in records if key in r) if records else None  # noqa: E731
    return {"steps": records[-1]["step"] if records else 0, "tokens_per_s": med("tokens_per_s"),
            "mfu": med("mfu"), "peak_mem_gb_per_gpu": max((r.get("peak_mem_gb", 0) for r in records), default=None),
            "final_train_loss": records[-1]["loss"] if records else None,
            "valid": {k: evals[-1][k] for k in ("loss", "bits_per_byte", "documents")} if evals else None}


def main() -> None:
    run, n = Path(sys.argv[1]), int(sys.argv[2])
    out = summarize(run)
    env = json.loads((run / "env.json").read_text())
    out.update(gpus=n, gpu=env.get("gpu"), torch=env.get("torch"), triton=env.get("triton"),
               date=datetime.datetime.now().isoformat(timespec="seconds"),
               command=(f"torchrun --standalone --nproc_per_node={n} " if n > 1 else "python ") +
               "train.py (benchmarks/gpu.sh TRAIN_ARGS) " + os.environ.get("TRAIN_EXTRA", ""),
               config=json.loads((run / "resolved_config.json").read_text()))
    if len(sys.argv) > 3:
        base = summarize(Path(sys.argv[3]))
        if base["tokens_per_s"] and out["tokens_per_s"]:
            out["speedup_vs_1gpu"] = out["tokens_per_s"] / base["tokens_per_s"]
            out["baseline_1gpu_tokens_per_s"] = base["tokens_per_s"]
    tag = (env.get("gpu") or "gpu").replace(" ", "_")
    if os.environ.get("SUMMARY_TAG"):   # another variant of the same run, beside it
        tag = f"{os.environ['SUMMARY_TAG']}_{tag}"
    path = Path(__file__).parent / "results" / f"train_{tag}_{n}gpu.json"
    path.write_text(json.dumps(out, indent=1))
    print(json.dumps({k: v for k, v in out.items() if k != "config"}))


if __name__ == "__main__":
    main()
