"""Decoding speed and memory of generation with carried state (elephant.generate), the wt103-70m shape
(configs/wt103-70m.toml: 62M parameters, MAMMAMMA, 8 memory tokens, 512-token KV window) with random
weights in bf16, chunk_len 512.

1. Decode tokens/s at batch 1 and 64: the steady token loop (Decoder.step + top-k sampling, chunk
   boundaries included, no host sync per token) for the token step run eagerly, replayed as a
   CUDA graph, and compiled with torch.compile then CUDA-graphed. At batch 1 also with a host sync
   per token (what streaming text to a terminal costs).
2. Memory while generating through `generate()` (streaming callback, so a host sync per step):
   `--tokens` tokens at batch 1 (default 64K: 128 chunks) and `--batch-tokens` tokens spread over 64
   lanes (default 1M: 16K per lane, 32 chunks), with the allocated and peak GPU memory recorded at
   doubling token counts. Flat means the peak after the first chunks equals the peak at the end.
   (1M tokens at batch 1 would take ~17 minutes at 1,000 tokens/s; the state is the same size
   after every chunk, so 128 chunks at batch 1 and 1M tokens at batch 64 show the same thing.)

    python benchmarks/bench_generate.py [--tokens 65536] [--batch-tokens 1048576] [--cpu-smoke]
writes benchmarks/results/generate_<gpu>.json (about 3 minutes on an H100, compile included).
"""
import argparse
import json
import sys
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from elephant.config import ModelConfig, load_config  # noqa: E402
from elephant.generate import Decoder, generate, sample  # noqa: E402
from benchmarks.common import environment, result_path  # noqa: E402
from elephant.model import ElephantLM  # noqa: E402

TOP_K, TEMPERATURE = 200, 0.8   # eval.py's defaults


def make_model(smoke: bool, device) -> tuple[ElephantLM, int]:
    if smoke:
        cfg = ModelConfig(vocab_size=256, d_model=64, n_heads=4, layers="MAMA", d_mlp=128,
                          d_state=16, mamba_head_dim=32, ssd_chunk=16, n_mem=2, kv_window=32)
        chunk_len = 32
    else:
        recipe = load_config(ROOT / "configs" / "wt103-70m.toml")
        cfg, chunk_len = recipe.model, recipe.train.chunk_len
    torch.manual_seed(0)
    model = ElephantLM(cfg).to(device).eval()
    if device.type == "cuda":
        model = model.to(torch.bfloat16)
    return model, chunk_len


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def decode_speed(model, chunk_len, batch, steps, device, graph, compiled) -> dict:
    """Tokens/s of the steady decode loop (the Decoder built, a 16-token prompt read, warmed up);
    at batch 1 also with a host sync per token."""
    gen = torch.Generator(device=device).manual_seed(0)
    prompt = torch.randint(0, model.cfg.vocab_size, (batch, 16), device=device)
    t0 = time.perf_counter()
    dec = Decoder(model, batch, chunk_len, cuda_graph=graph, compile=compiled)
    logits = dec.prefill(prompt, last_only=True)
    tok = sample(logits, TEMPERATURE, TOP_K, generator=gen)
    for _ in range(8):   # capture / compile
        tok = sample(dec.step(tok), TEMPERATURE, TOP_K, generator=gen)
    sync(device)
    setup_s = time.perf_counter() - t0
    res = {"batch": batch, "steps": steps, "chunk_len": chunk_len, "setup_s": round(setup_s, 2)}
    for per_token_sync in ((False, True) if batch == 1 else (False,)):
        t0 = time.perf_counter()
        for _ in range(steps):
            tok = sample(dec.step(tok), TEMPERATURE, TOP_K, generator=gen)
            if per_token_sync:
                tok.tolist()
        sync(device)
        seconds = time.perf_counter() - t0
        tag = "_sync_per_token" if per_token_sync else ""
        res[f"tokens_per_s{tag}"] = batch * steps / seconds
        res[f"ms_per_step{tag}"] = seconds / steps * 1e3
    return res


def memory_run(model, chunk_len, batch, tokens, device, graph, compiled) -> dict:
    """generate() for `tokens` tokens over `batch` lanes; GPU memory at doubling token counts."""
    steps = max(1, tokens // batch)
    prompt = torch.randint(0, model.cfg.vocab_size, (batch, 16)).tolist()
    marks, points, count = {}, [], [0]
    m = 256
    while m < steps:
        marks[m] = True
        m *= 2
    marks[steps] = True

    def on_token(lane, token):
        if lane:
            return
        count[0] += 1
        if count[0] in marks:
            row = {"tokens_per_lane": count[0], "tokens": count[0] * batch,
                   "seconds": round(time.perf_counter() - t0, 2)}
            if device.type == "cuda":
                row["allocated_mib"] = round(torch.cuda.memory_allocated() / 2**20, 1)
                row["peak_mib"] = round(torch.cuda.max_memory_allocated() / 2**20, 1)
            points.append(row)
            print(f"  {json.dumps(row)}", flush=True)

    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated() / 2**20
    t0 = time.perf_counter()
    out = generate(model, prompt, steps, temperature=TEMPERATURE, top_k=TOP_K, seed=0,
                   chunk_len=chunk_len, stream=on_token, cuda_graph=graph, compile=compiled)
    seconds = time.perf_counter() - t0
    total = sum(len(o) for o in out)
    res = {"batch": batch, "tokens": total, "tokens_per_lane": steps, "chunks_per_lane":
           (16 + steps) // chunk_len, "seconds": round(seconds, 2),
           "tokens_per_s_streaming": total / seconds, "points": points}
    if device.type == "cuda":
        res["weights_mib"] = round(base, 1)
        first = next((p for p in points if p["tokens_per_lane"] >= 4 * chunk_len), points[0])
        res["peak_growth_mib_after_4_chunks"] = round(points[-1]["peak_mib"] - first["peak_mib"], 1)
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cpu-smoke", action="store_true")
    ap.add_argument("--tokens", type=int, default=65536, help="memory run at batch 1")
    ap.add_argument("--batch-tokens", type=int, default=1 << 20, help="memory run at batch 64")
    ap.add_argument("--steps", type=int, default=2048, help="timed decode steps at batch 1")
    args = ap.parse_args()
    smoke = args.cpu_smoke or not torch.cuda.is_available()
    device = torch.device("cpu" if smoke else "cuda")
    if smoke:
        torch.set_num_threads(1)   # tiny shapes: threads only contend (see tests/conftest.py)
    model, chunk_len = make_model(smoke, device)
    batches = (1, 4) if smoke else (1, 64)
    big = batches[1]
    if smoke:
        args.tokens, args.batch_tokens = min(args.tokens, 300), min(args.batch_tokens, 400)
        args.steps = min(args.steps, 80)
    command = "python benchmarks/bench_generate.py" + " ".join(
        [""] + [f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k != "cpu_smoke"]
        + (["--cpu-smoke"] if smoke else []))
    results = {**environment(device),
               "command": command, "config": model.cfg.to_dict(), "chunk_len": chunk_len,
               "dtype": str(model.embed.weight.dtype), "parameters": model.num_params(),
               "sampling": {"temperature": TEMPERATURE, "top_k": TOP_K}, "decode": {}, "memory": {}}
    path = result_path("generate", smoke)

    def save():  # after every measurement: a run cut short keeps what it measured
        path.write_text(json.dumps(results, indent=1))

    variants = [("eager", False, False), ("cuda_graph", True, False), ("compile+cuda_graph", True, True)]
    if smoke:
        variants = variants[:1]
    best = None
    for name, graph, compiled in variants:
        for batch in batches:
            steps = args.steps if batch == 1 else max(args.steps // 4, 64)
            if name == "eager" and not smoke:
                steps = min(steps, 512)
            key = f"{name}/batch{batch}"
            try:
                results["decode"][key] = decode_speed(model, chunk_len, batch, steps, device, graph,
                                                      compiled)
                if batch == 1:
                    best = (name, graph, compiled)
            except Exception as e:  # record and go on with the other variants
                results["decode"][key] = {"error": f"{type(e).__name__}: {str(e)[:500]}",
                                          "trace": traceback.format_exc()[-1500:]}
            print(key, json.dumps(results["decode"][key]), flush=True)
            save()
    name, graph, compiled = best or variants[0]
    results["memory"]["mode"] = name
    for batch, tokens in ((1, args.tokens), (big, args.batch_tokens)):
        print(f"memory: batch {batch}, {tokens} tokens ({name})", flush=True)
        try:
            results["memory"][f"batch{batch}"] = memory_run(model, chunk_len, batch, tokens, device,
                                                            graph, compiled)
        except Exception as e:
            results["memory"][f"batch{batch}"] = {"error": f"{type(e).__name__}: {str(e)[:500]}",
                                                  "trace": traceback.format_exc()[-1500:]}
        save()
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
