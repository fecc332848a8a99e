"""Registers and spills of every Triton kernel of elephant.layers that a training step compiles:
two eager chunks (forward and backward, bf16 autocast, the fast paths) of the wt103-70m shape,
32 lanes x 512 tokens, without and with packed documents (a start every ~600 tokens), then each
kernel's compiled launches (benchmarks.common.compiled_registers).

    python benchmarks/kernel_registers.py     # CUDA: benchmarks/results/kernel_registers_<gpu>.json

A spill is a register the compiler moved to local memory, a round trip through the cache at every
use: session 30 found the chunk-scan backward spilling 88 (reordered: none, and 13% faster).
"""
from __future__ import annotations

import importlib
import json
import pkgutil
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.bench_packing import make_config  # noqa: E402
from benchmarks.common import (bf16_autocast, compiled_registers, cuda_or_exit,  # noqa: E402
                               environment, result_path)
import elephant.layers as layers  # noqa: E402
from elephant.model import ElephantLM  # noqa: E402


def main() -> None:
    device = cuda_or_exit("kernel_registers")
    from elephant.layers.triton_env import triton
    cfg = make_config(False)
    model = ElephantLM(cfg).to(device)
    model.set_fast_paths(True)
    B, T = 32, 512
    gen = torch.Generator().manual_seed(0)
    for packed in (False, True):
        tokens = torch.randint(0, cfg.vocab_size, (B, T + 1), generator=gen).to(device)
        starts = None
        if packed:
            starts = torch.rand(B, T, generator=gen) < 1 / 600
            starts[:, 0] = True
        state = model.init_state(B)
        with bf16_autocast(device)():
            for _ in range(2):
                nll, state = model(tokens[:, :-1], state, targets=tokens[:, 1:], starts=starts)
                nll.backward()
                state = state.detach()
    torch.cuda.synchronize()
    kernels = {}
    for info in pkgutil.iter_modules(layers.__path__):
        mod = importlib.import_module(f"elephant.layers.{info.name}")
        for name, obj in vars(mod).items():
            rows = (compiled_registers(obj)
                    if isinstance(obj, triton.runtime.jit.JITFunction) else [])
            if rows:
                kernels[f"{info.name}.{name}"] = rows
                print(f"{info.name}.{name}", json.dumps(rows), flush=True)
    out = {**environment(device), "command": "python benchmarks/kernel_registers.py",
           "spilling": sorted(k for k, rows in kernels.items() if any(r["spills"] for r in rows)),
           "kernels": kernels}
    path = result_path("kernel_registers", False)
    path.write_text(json.dumps(out, indent=1))
    print("spilling", json.dumps(out["spilling"]))
    print("wrote", path)


if __name__ == "__main__":
    main()
