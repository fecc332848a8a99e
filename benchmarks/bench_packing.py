"""What packing documents back to back (issue 11) costs and gains, on the wt103-70m model shape
(configs/wt103-70m.toml: d_model 512, MAMMAMMA, 8 memory tokens, 512-token KV window; random
weights, bf16 autocast, fast paths, compiled blocks as the trainer does; 32 lanes x 512 tokens):

  fill 1.0    forward+backward tokens/s on rows without padding: today's path (no `starts`), the
              packing path with `starts` but no boundary inside a chunk, and the packing path with
              the boundaries of documents of a FineWeb-like length distribution (every slot real).
  real tok/s  batches from RollingChunkBatcher over a corpus of log-normal document lengths
              (median 600 tokens, sigma 1), unpacked (pack=False, padded rows, no `starts`) against
              packed (pack=True, `starts`): predicted (unmasked) tokens per second. Packing should
              raise it by the fill gained, less its own overhead.

    python benchmarks/bench_packing.py [--cpu-smoke]
writes benchmarks/results/packing_<device>.json (in about 2 minutes on an H100, most of it compiling).
"""
import argparse
import json
import sys
import time
import traceback
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from data_packing import RollingChunkBatcher, TokenizedCorpus  # noqa: E402
from elephant.config import ModelConfig  # noqa: E402
from benchmarks.common import bf16_autocast, environment, result_path  # noqa: E402
from elephant.model import ElephantLM  # noqa: E402

MEDIAN, SIGMA = 600, 1.0


def make_config(smoke: bool) -> ModelConfig:
    if smoke:
        return ModelConfig(vocab_size=256, d_model=64, n_heads=4, layers="MAMA", d_mlp=128,
                           d_state=16, mamba_head_dim=32, ssd_chunk=16, n_mem=2, kv_window=32,
                           bptt_chunks=2)
    return ModelConfig(vocab_size=50304, d_model=512, n_heads=8, layers="MAMMAMMA", d_mlp=2048,
                       d_state=64, mamba_head_dim=64, ssd_chunk=64, n_mem=8, kv_window=512,
                       bptt_chunks=2, tied_embeddings=True)


def lognormal_corpus(n_docs: int, vocab: int, median: float, seed: int = 0) -> TokenizedCorpus:
    rng = np.random.default_rng(seed)
    lengths = np.maximum(2, rng.lognormal(np.log(median), SIGMA, n_docs)).astype(np.int64)
    tokens = rng.integers(0, vocab, int(lengths.sum()), dtype=np.uint32)
    offsets = np.zeros(n_docs + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    return TokenizedCorpus(tokens, offsets, manifest={"n_docs": n_docs, "n_tokens": int(offsets[-1])})


def batches_from(corpus, B, T, n, pack, device):
    """n batches as (tokens, reset, loss_mask, starts or None) on the device, and the batcher fill."""
    batcher = RollingChunkBatcher(corpus, lanes=B, chunk_len=T, seed=0, pack=pack)
    t0 = time.perf_counter()
    raw = [next(batcher) for _ in range(n)]
    build_s = time.perf_counter() - t0
    out = [(b.tokens.to(device), b.reset.to(device), b.loss_mask.to(device),
            b.starts.to(device) if pack else None) for b in raw]
    return out, batcher.fill, build_s / n


def measure(model, batches, device, autocast, warmup: int) -> dict:
    """Forward+backward per chunk with carried state (detached as in bench_model); median step."""
    B = batches[0][0].shape[0]
    state = model.init_state(B, device=device)
    times, real = [], 0
    for i, (tokens, reset, mask, starts) in enumerate(batches):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        with autocast():
            loss, state = model(tokens[:, :-1], state, reset, targets=tokens[:, 1:], loss_mask=mask,
                                reduction="sum", starts=starts)
        loss.backward()
        state = state.detach()
        if device.type == "cuda":
            torch.cuda.synchronize()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
            real += int(mask.sum())
        model.zero_grad(set_to_none=True)
    T = batches[0][0].shape[1] - 1
    med = sorted(times)[len(times) // 2]
    mean = sum(times) / len(times)
    return {"median_ms": med * 1e3, "tokens_per_s": B * T / med,
            "fill": real / (len(times) * B * T), "real_tokens_per_s": real / sum(times),
            "mean_ms": mean * 1e3, "steps": len(times)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cpu-smoke", action="store_true")
    args = ap.parse_args()
    smoke = args.cpu_smoke or not torch.cuda.is_available()
    device = torch.device("cpu" if smoke else "cuda")
    B, T, steps, warmup = (2, 32, 4, 1) if smoke else (32, 512, 30, 6)
    median = 40 if smoke else MEDIAN  # the smoke run keeps several documents per 32-token chunk
    cfg = make_config(smoke)
    torch.manual_seed(0)
    model = ElephantLM(cfg).to(device)
    model.set_fast_paths(True)
    if not smoke:
        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 16)
        for block in model.blocks:
            block.compile(dynamic=False)
    autocast = bf16_autocast(device)
    results = {**environment(device),
               "command": "python benchmarks/bench_packing.py" + (" --cpu-smoke" if smoke else ""),
               "config": cfg.to_dict(), "lanes": B, "chunk_len": T, "compiled": not smoke,
               "lengths": {"distribution": "log-normal", "median": median, "sigma": SIGMA},
               "paths": {}}

    corpus = lognormal_corpus(4000 if not smoke else 400, cfg.vocab_size, median)
    n = steps + warmup
    packed, fill_packed, build_packed = batches_from(corpus, B, T, n, True, device)
    unpacked, fill_unpacked, build_unpacked = batches_from(corpus, B, T, n, False, device)
    results["batcher_ms_per_batch"] = {"packed": build_packed * 1e3, "unpacked": build_unpacked * 1e3}
    results["batcher_fill"] = {"packed": fill_packed, "unpacked": fill_unpacked}
    # fill 1.0: the packed batches' tokens (every slot real) without / with their boundaries
    full_mask = torch.ones(B, T, dtype=torch.bool, device=device)
    reset = [torch.full((B,), i == 0, dtype=torch.bool, device=device) for i in range(n)]
    only_first = [torch.zeros(B, T, dtype=torch.bool, device=device) for _ in range(n)]
    only_first[0][:, 0] = True  # every lane starts a document with the first chunk, none after
    variants = {
        "fill1_today_path": [(t, reset[i], full_mask, None) for i, (t, _, _, _) in enumerate(packed)],
        "fill1_packing_path_no_boundaries": [(t, reset[i], full_mask, only_first[i])
                                             for i, (t, _, _, _) in enumerate(packed)],
        "fill1_packing_path_with_boundaries": [(t, r, full_mask, s) for t, r, _, s in packed],
        "lognormal_unpacked": unpacked,
        "lognormal_packed": packed,
    }
    for name, batches in variants.items():
        try:
            results["paths"][name] = measure(model, batches, device, autocast, warmup)
        except Exception as e:  # record and go on with the other paths
            results["paths"][name] = {"error": f"{type(e).__name__}: {str(e)[:500]}",
                                      "trace": traceback.format_exc()[-1500:]}
        print(name, json.dumps(results["paths"][name]), flush=True)
    p = results["paths"]
    try:
        results["summary"] = {
            "fill1_packing_vs_today_tokens_per_s": p["fill1_packing_path_with_boundaries"]["tokens_per_s"]
            / p["fill1_today_path"]["tokens_per_s"],
            "fill1_packing_no_boundaries_vs_today": p["fill1_packing_path_no_boundaries"]["tokens_per_s"]
            / p["fill1_today_path"]["tokens_per_s"],
            "fill_gain": p["lognormal_packed"]["fill"] / p["lognormal_unpacked"]["fill"],
            "real_tokens_per_s_gain": p["lognormal_packed"]["real_tokens_per_s"]
            / p["lognormal_unpacked"]["real_tokens_per_s"],
        }
        print("summary", json.dumps(results["summary"]), flush=True)
    except (KeyError, ZeroDivisionError):
        pass
    result_path("packing", smoke).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
