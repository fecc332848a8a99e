"""CPU benchmark of the data path: prepare (tokenize into a cache) and RollingChunkBatcher throughput.

    python benchmarks/bench_data.py [--out benchmarks/results/data_cpu.json] [--batches 4000]

Prepare is timed cold (a fresh cache folder each run) with every core, on the stdlib `pycode` corpus
and, when ../shared/data is present, the local Wikitext-103 valid+test splits with the GPT-NeoX
tokenizer. The batcher is timed pinned to one core at 32 lanes x 512 tokens (the target is 20M
tokens/s) and at a few other shapes; tokens/s counts every slot of a batch (B x T), `real` only the
unmasked ones. Best of three repeats.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import tokenizers  # noqa: E402
import torch  # noqa: E402

from data_packing import RollingChunkBatcher, get_corpus  # noqa: E402

SHARED = ROOT.parent / "shared" / "data"


def bench_prepare(cache: Path, source: str, split: str, tokenizer, path=None) -> dict:
    start = time.perf_counter()
    corpus = get_corpus(source, split, tokenizer, cache, path=path, progress=False)
    seconds = time.perf_counter() - start
    m = corpus.manifest
    return {"source": source, "split": split, "tokenizer": m["tokenizer"]["name"], "workers": m["workers"],
            "docs": m["n_docs"], "tokens": m["n_tokens"], "bytes": m["n_bytes"], "seconds": round(seconds, 3),
            "tokens_per_s": round(m["n_tokens"] / seconds),
            "mb_per_s": round(m["n_bytes"] / seconds / 1e6, 2)}


def bench_batcher(corpus, lanes: int, chunk_len: int, batches: int) -> dict:
    best = None
    for repeat in range(3):
        batcher = RollingChunkBatcher(corpus, lanes, chunk_len, seed=repeat)
        for _ in range(50):  # warm the page cache and the allocator
            next(batcher)
        start = time.perf_counter()
        for _ in range(batches):
            next(batcher)
        seconds = time.perf_counter() - start
        best = seconds if best is None else min(best, seconds)
    slots = batches * lanes * chunk_len
    return {"lanes": lanes, "chunk_len": chunk_len, "batches": batches, "seconds": round(best, 4),
            "tokens_per_s": round(slots / best), "real_tokens_per_s": round(slots * batcher.fill / best),
            "fill": round(batcher.fill, 4), "us_per_batch": round(best / batches * 1e6, 1)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "data_cpu.json"))
    p.add_argument("--batches", type=int, default=4000)
    args = p.parse_args()
    neox = SHARED / "tokenizers" / "gpt-neox-20b" / "tokenizer.json"
    result = {
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "machine": {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
                    "cpu_count": os.cpu_count(), "python": platform.python_version(), "numpy": np.__version__,
                    "torch": torch.__version__, "tokenizers": tokenizers.__version__},
        "prepare": [], "batcher": [],
    }
    with tempfile.TemporaryDirectory() as tmp:
        cache = Path(tmp)
        result["prepare"].append(bench_prepare(cache, "pycode", "all", "bytes"))
        if neox.is_file():
            result["prepare"].append(bench_prepare(cache, "pycode", "all", neox))
            for split in ("valid", "test"):
                result["prepare"].append(bench_prepare(cache, "wikitext-103", split, neox,
                                                       path=SHARED / "wikitext-103-raw"))
        corpus = get_corpus("pycode", "all", neox if neox.is_file() else "bytes", cache, progress=False)
        result["batcher_corpus"] = {"source": "pycode/all", "docs": len(corpus), "tokens": corpus.n_tokens}
        if hasattr(os, "sched_setaffinity"):
            os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})  # one core
        torch.set_num_threads(1)
        for lanes, chunk_len in ((32, 512), (8, 256), (64, 1024), (256, 2048)):
            batches = max(200, args.batches * 32 * 512 // (lanes * chunk_len))  # about equal token counts
            result["batcher"].append(bench_batcher(corpus, lanes, chunk_len, batches))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    for row in result["prepare"]:
        print(f"prepare {row['source']}/{row['split']} {row['tokenizer']}: {row['tokens']} tokens in "
              f"{row['seconds']}s, {row['tokens_per_s'] / 1e6:.2f}M tokens/s, {row['mb_per_s']} MB/s "
              f"({row['workers']} workers)")
    for row in result["batcher"]:
        print(f"batcher {row['lanes']}x{row['chunk_len']}: {row['tokens_per_s'] / 1e6:.1f}M tokens/s "
              f"({row['us_per_batch']} us/batch, fill {row['fill']})")


if __name__ == "__main__":
    main()
