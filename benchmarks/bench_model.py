"""Forward+backward throughput of the ~70M configuration (d_model 512, 8 layers MAMMAMMA, vocab
50304, 32 lanes x 512-token chunks, 8 memory tokens, 512-token KV window): the reference paths
(PyTorch SSD, explicit-mask attention, autograd MLP) against the fast paths (Triton SSD, SDPA,
fused elephant MLP), eager and with compiled blocks, bf16 autocast.

    python benchmarks/bench_model.py [--cpu-smoke]
writes benchmarks/results/model_<gpu>.json.
"""
import argparse
import json
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from elephant.config import ModelConfig  # noqa: E402
from benchmarks.common import bf16_autocast, environment, result_path  # noqa: E402
from elephant.model import ElephantLM  # noqa: E402


def make_config(smoke: bool) -> ModelConfig:
    if smoke:
        return ModelConfig(vocab_size=256, d_model=64, n_heads=4, layers="MAMA", d_mlp=128,
                           d_state=16, mamba_head_dim=32, ssd_chunk=16, n_mem=2, kv_window=32)
    return ModelConfig(vocab_size=50304, d_model=512, n_heads=8, layers="MAMMAMMA", d_mlp=2048,
                       d_state=64, mamba_head_dim=64, ssd_chunk=64, n_mem=8, kv_window=512,
                       tied_embeddings=True)


def measure(model, B, T, device, iters, autocast) -> dict:
    tokens = torch.randint(0, model.cfg.vocab_size, (iters + 3, B, T + 1), device=device)
    state = model.init_state(B, device=device)
    times = []
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    for i in range(iters + 3):
        t0 = time.perf_counter()
        with autocast():
            loss, state = model(tokens[i, :, :-1], state, targets=tokens[i, :, 1:])
        loss.backward()
        state = state.detach()
        if device.type == "cuda":
            torch.cuda.synchronize()
        if i >= 3:
            times.append(time.perf_counter() - t0)
        model.zero_grad(set_to_none=True)
    times.sort()
    med = times[len(times) // 2]
    out = {"median_ms": med * 1e3, "tokens_per_s": B * T / med}
    if device.type == "cuda":
        out["peak_mem_gb"] = torch.cuda.max_memory_allocated() / 2**30
        flops = model.flops_per_token(T) * B * T / med
        out["tflops"] = flops / 1e12
        out["mfu_vs_989"] = flops / 989e12
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cpu-smoke", action="store_true")
    args = ap.parse_args()
    smoke = args.cpu_smoke or not torch.cuda.is_available()
    device = torch.device("cpu" if smoke else "cuda")
    B, T, iters = (2, 32, 2) if smoke else (32, 512, 10)
    cfg = make_config(smoke)
    torch.manual_seed(0)
    model = ElephantLM(cfg).to(device)
    autocast = bf16_autocast(device)
    results = {**environment(device),
               "command": "python benchmarks/bench_model.py" + (" --cpu-smoke" if smoke else ""),
               "config": cfg.to_dict(), "lanes": B, "chunk_len": T,
               "parameters": model.num_params(), "flops_per_token": model.flops_per_token(T),
               "paths": {}}
    variants = [("reference", False, False), ("fast", True, False), ("fast+compile", True, True)]
    for name, fast, compiled in variants:
        if compiled and smoke:
            continue
        try:
            model.set_fast_paths(fast)
            if compiled:
                for block in model.blocks:
                    block.compile(dynamic=False)
            results["paths"][name] = measure(model, B, T, device, iters, autocast)
        except Exception as e:  # record and go on with the other paths
            results["paths"][name] = {"error": f"{type(e).__name__}: {str(e)[:500]}",
                                      "trace": traceback.format_exc()[-1500:]}
        print(name, json.dumps(results["paths"][name]), flush=True)
    result_path("model", smoke).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
