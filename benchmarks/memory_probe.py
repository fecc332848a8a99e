"""Does the LM loss teach the RMT memory at all? The CPU memory test's tiny model (attention only,
no KV window, 4 gated memory slots, BPTT over 8 chunks of 32 bytes: from the fact's chunk to the
answer's, two or more chunks later, the memory is the only path) trained on one-fact documents
(synthetic filler, facts asked 40-70 bytes later), with the loss on the answer digits alone (what
tests/test_recall.py trains) or on every token of the documents (the LM loss users train with),
then scored at 64 and 96 bytes, as trained and with the memory dropped after every chunk. No
kept tokens and no window compete with the memory here: what the loss gives it is all it gets.

    python benchmarks/memory_probe.py --loss answers,every --steps 600 --seeds 0,1 \
        [--out benchmarks/results/memory_probe_<date>_cpu.json]

Each (loss, steps, seed) trains in a process of its own, two at a time (one thread each).
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

DISTANCES = [64, 96]


def tiny_memory_model():
    """The CPU memory test's model and its optimizers (tests/test_recall.py trains it on the
    answers; seed torch first): attention only, no KV window, 4 memory slots whose gates start
    half open, BPTT over 8 chunks."""
    from elephant.config import ModelConfig, OptimConfig
    from elephant.model import ElephantLM
    from elephant.optim import build_optimizers
    cfg = ModelConfig(vocab_size=128, d_model=64, n_heads=4, layers="AA", d_mlp=128, n_mem=4,
                      kv_window=0, bptt_chunks=8, mem_gate_init=0.0)
    model = ElephantLM(cfg)
    return model, build_optimizers(model, OptimConfig(
        warmup_steps=20, momentum_warmup_steps=20, adam_lr=0.003, embed_lr=0.003, head_lr=0.003))


def run_one(loss: str, steps: int, seed: int) -> dict:
    """Train and score one model in this process."""
    import torch

    from data_packing.tokenizer import ByteTokenizer
    from elephant.recall import evaluate_recall, train_on_answers
    torch.set_num_threads(1)
    torch.manual_seed(seed)
    model, opt = tiny_memory_model()
    t0 = time.perf_counter()
    curve = train_on_answers(model, opt, steps=steps, lanes=32, chunk_len=32, gaps=(40, 70),
                             digits=3, seed=seed, every_token=loss == "every")
    seconds = time.perf_counter() - t0
    cpu = torch.device("cpu")
    out = {"loss": loss, "steps": steps, "seed": seed, "train_seconds": seconds, "curve": curve}
    for name, ablation in (("recall", "none"), ("memory_dropped", "memory")):
        r = evaluate_recall(model, ByteTokenizer(), DISTANCES, 32, 32, cpu, digits=3,
                            ablation=ablation)
        out[name] = {d: row["accuracy"] for d, row in r["by_distance"].items()}
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--loss", default="answers,every", help="answers and/or every (comma-separated)")
    p.add_argument("--steps", default="600", help="comma-separated step counts")
    p.add_argument("--seeds", default="0,1")
    p.add_argument("--parallel", type=int, default=2)
    p.add_argument("--out")
    p.add_argument("--one", nargs=3, metavar=("LOSS", "STEPS", "SEED"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.one:
        print(json.dumps(run_one(args.one[0], int(args.one[1]), int(args.one[2]))))
        return 0
    losses = [x for x in args.loss.split(",") if x]
    bad = [x for x in losses if x not in ("answers", "every")]
    if bad:
        raise SystemExit(f"--loss: unknown {bad[0]!r}; expected answers or every")
    runs = [(loss, int(n), int(s)) for loss in losses for n in args.steps.split(",")
            for s in args.seeds.split(",")]

    def spawn(spec):
        r = subprocess.run([sys.executable, __file__, "--one", *map(str, spec)],
                           capture_output=True, text=True, cwd=ROOT)
        if r.returncode:
            raise SystemExit(f"{spec}: failed\n{r.stderr[-2000:]}")
        row = json.loads(r.stdout.strip().splitlines()[-1])
        print(f"{row['loss']:8s} {row['steps']:5d} steps seed {row['seed']}: recall "
              f"{[round(v, 2) for v in row['recall'].values()]}, memory dropped "
              f"{[round(v, 2) for v in row['memory_dropped'].values()]} "
              f"({row['train_seconds']:.0f} s)", flush=True)
        return row
    with ThreadPoolExecutor(args.parallel) as pool:
        rows = list(pool.map(spawn, runs))
    from benchmarks.common import environment
    out = {"benchmark": "memory_probe", **environment("cpu"), "distances": DISTANCES,
           "chance": 0.1, "runs": rows}
    path = Path(args.out) if args.out else (
        ROOT / "benchmarks" / "results" / f"memory_probe_{time.strftime('%Y-%m-%d')}_cpu.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
