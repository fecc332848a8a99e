"""GPU benchmark of the optimizers on the ~70M model's parameters: one step, the orthogonalizers,
their orthogonality error, and the Triton Gram kernel against torch.matmul.

    python benchmarks/bench_optim.py               # CUDA: writes benchmarks/results/optim_<gpu>.json
    python benchmarks/bench_optim.py --cpu-smoke   # tiny shapes on CPU (Triton in the interpreter)

Parameters (built here, so the benchmark does not depend on the model code; --from-model takes them
from elephant.model.ElephantLM instead): d_model 512, 8 layers MAMMAMMA, every layer with a GLU MLP
up/gate (1536, 512) and down (512, 1536); Mamba layers in_proj (2*1024 + 2*64 + 16 = 2192, 512),
out_proj (512, 1024), conv1d (1152, 1, 4), A_log / D / dt_bias (16), norms; attention layers qkv
(1536, 512) and o (512, 512); embedding and untied head 50304 x 512.

Measured, in ms, median over --iters after --warmup, by CUDA events:
- `step`: Optimizers.step() (Muon + Adam, fp32 parameters, bf16 iterations) for newton_schulz (5),
  polar_express (5) and aol (4), each with gram=matmul and gram=triton;
- `orthogonalize`: the iterations alone over all Muon matrices (one batch per shape);
- `gram`: per shape, X X^T and b A + c A A by torch (bmm / baddbmm) and by gram_triton.sym_gram.
`errors`: per method and shape, the mean over the batch of ||O^T O - I||_F / sqrt(k) (k the
short side) and the polar error ||O - U V^T||_F / ||U V^T||_F against an fp64 SVD, on Gaussian
inputs and on "gradient-like" ones (rank 16 plus 5% noise).
A path that fails records its error and the script goes on.
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

if "--cpu-smoke" in sys.argv:  # must precede the first Triton import
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
from torch import nn  # noqa: E402

from elephant.config import OptimConfig  # noqa: E402
from elephant.optim import build_optimizers, orthogonalize  # noqa: E402
from elephant.optim import gram_triton  # noqa: E402
from elephant.optim.gram_triton import gram_reference  # noqa: E402
from benchmarks.common import timer, write_report  # noqa: E402

METHODS = ("newton_schulz", "polar_express", "aol")


class ParamsOf70M(nn.Module):
    """The parameter shapes of the 70M config (no forward)."""

    def __init__(self, d: int = 512, layers: str = "MAMMAMMA", vocab: int = 50304, mlp: int = 1536,
                 d_state: int = 64, head_dim: int = 64, expand: int = 2, d_conv: int = 4):
        super().__init__()
        d_in = expand * d
        heads = d_in // head_dim
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList()
        for kind in layers:
            b = nn.Module()
            b.norm1, b.norm2 = nn.RMSNorm(d), nn.RMSNorm(d)
            if kind == "M":
                b.in_proj = nn.Linear(d, 2 * d_in + 2 * d_state + heads, bias=False)
                b.conv1d = nn.Conv1d(d_in + 2 * d_state, d_in + 2 * d_state, d_conv,
                                     groups=d_in + 2 * d_state)
                b.A_log = nn.Parameter(torch.zeros(heads))
                b.D = nn.Parameter(torch.ones(heads))
                b.dt_bias = nn.Parameter(torch.zeros(heads))
                b.norm = nn.RMSNorm(d_in)
                b.out_proj = nn.Linear(d_in, d, bias=False)
            else:
                b.qkv = nn.Linear(d, 3 * d, bias=False)
                b.o = nn.Linear(d, d, bias=False)
            b.up = nn.Linear(d, mlp, bias=False)
            b.gate = nn.Linear(d, mlp, bias=False)
            b.down = nn.Linear(mlp, d, bias=False)
            self.blocks.append(b)
        self.norm_f = nn.RMSNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)


def measure(fn, device, warmup: int, iters: int) -> dict:
    start, stop = timer(device)
    for _ in range(warmup):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        t = start()
        fn()
        times.append(stop(t))
    return {"median_ms": round(statistics.median(times), 4), "min_ms": round(min(times), 4)}


def guarded(results: dict, name: str, fn) -> None:
    try:
        results[name] = fn()
    except Exception as e:  # record and go on: one failing path must not lose the others
        results[name] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
    print(f"{name}: {results[name]}", flush=True)


def ortho_errors(O: torch.Tensor, G: torch.Tensor) -> dict:
    O64, G64 = O.double(), G.double()
    k = min(O.shape[-2:])
    gram = O64.mT @ O64 if O.shape[-2] > O.shape[-1] else O64 @ O64.mT
    eye = torch.eye(k, dtype=torch.float64, device=O.device)
    orth = ((gram - eye).norm(dim=(-2, -1)) / k ** 0.5).mean().item()
    U, _, Vh = torch.linalg.svd(G64, full_matrices=False)
    P = U @ Vh
    polar = ((O64 - P).norm(dim=(-2, -1)) / P.norm(dim=(-2, -1))).mean().item()
    return {"orthogonality": round(orth, 5), "polar": round(polar, 5)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny shapes on CPU")
    ap.add_argument("--from-model", action="store_true", help="shapes from elephant.model.ElephantLM")
    ap.add_argument("--warmup", type=int, default=None)
    ap.add_argument("--iters", type=int, default=None)
    ap.add_argument("--out", default=None, help="JSON path (default benchmarks/results/optim_<gpu>.json)")
    args = ap.parse_args()
    smoke = args.cpu_smoke
    if not smoke and not torch.cuda.is_available():
        sys.exit("bench_optim.py needs CUDA (or --cpu-smoke)")
    device = torch.device("cpu" if smoke else "cuda")
    warmup = args.warmup if args.warmup is not None else (0 if smoke else 5)
    iters = args.iters if args.iters is not None else (1 if smoke else 20)
    ortho_dtype = torch.float32 if smoke else torch.bfloat16
    t_begin = time.time()

    torch.manual_seed(0)
    if args.from_model:
        from elephant.config import ModelConfig
        from elephant.model import ElephantLM
        mcfg = (ModelConfig(d_model=32, vocab_size=128, d_mlp=64, layers="MA", n_heads=2,
                            d_state=8, mamba_head_dim=16) if smoke else ModelConfig())
        model = ElephantLM(mcfg)
    else:
        model = (ParamsOf70M(d=32, layers="MA", vocab=128, mlp=64, d_state=8, head_dim=16) if smoke
                 else ParamsOf70M())
    model = model.to(device)
    grads = {p: torch.randn_like(p) * 1e-3 for p in model.parameters()}
    triton_ok = gram_triton.HAVE_TRITON and (device.type == "cuda" or gram_triton._INTERPRET)
    grams = ("matmul", "triton") if triton_ok else ("matmul",)

    # Muon matrices, batched by shape
    shapes: dict[tuple, int] = {}
    for name, mod in model.named_modules():
        if isinstance(mod, nn.Linear) and not name.endswith("lm_head"):
            shapes[tuple(mod.weight.shape)] = shapes.get(tuple(mod.weight.shape), 0) + 1
    n_params = sum(p.numel() for p in model.parameters())
    print(f"{n_params / 1e6:.1f}M parameters; Muon shapes {shapes}", flush=True)

    results: dict = {"step": {}, "orthogonalize": {}, "gram": {}, "errors": {}}

    # 1. a whole optimizer step
    for method in METHODS:
        for gram in grams:
            def run_step(method=method, gram=gram):
                opt = build_optimizers(model, OptimConfig(orthogonalize=method, muon_wd=0.01,
                                                          adam_wd=0.01), ortho_dtype=ortho_dtype)
                opt.muon.gram = gram

                def step():
                    for p, g in grads.items():
                        p.grad = g
                    opt.step()
                return measure(step, device, warmup, iters)
            guarded(results["step"], f"{method}/{gram}", run_step)

    # 2. the orthogonalizers alone, over all Muon matrices
    batches = {s: torch.randn(n, *s, device=device) for s, n in shapes.items()}
    for method in METHODS:
        for gram in grams:
            def run_ortho(method=method, gram=gram):
                def all_shapes():
                    for G in batches.values():
                        orthogonalize(G, method, dtype=ortho_dtype, gram=gram)
                return measure(all_shapes, device, warmup, iters)
            guarded(results["orthogonalize"], f"{method}/{gram}", run_ortho)

    # 3. the Gram products: torch vs the symmetric Triton kernel
    for s, n in shapes.items():
        X = torch.randn(n, *s, device=device, dtype=ortho_dtype)
        X = X.mT if s[0] > s[1] else X                        # the short side, as the iterations use it
        k = min(s)
        A = gram_reference(X.float()).to(ortho_dtype) / k
        entry = {}
        guarded(entry, "XXt/matmul", lambda: measure(lambda: X @ X.mT, device, warmup, iters))
        guarded(entry, "bA+cAA/baddbmm", lambda: measure(
            lambda: torch.baddbmm(A, A, A, beta=-2.0, alpha=0.5), device, warmup, iters))
        if triton_ok:
            guarded(entry, "XXt/triton", lambda: measure(lambda: gram_triton.sym_gram(X), device,
                                                         warmup, iters))
            guarded(entry, "bA+cAA/triton", lambda: measure(
                lambda: gram_triton.sym_gram(A, alpha=0.5, beta=-2.0), device, warmup, iters))
            for key, torch_path in (("XXt", "matmul"), ("bA+cAA", "baddbmm")):
                ours, theirs = entry[f"{key}/triton"], entry[f"{key}/{torch_path}"]
                if "median_ms" in ours and "median_ms" in theirs:
                    entry[f"{key}/triton_faster"] = ours["median_ms"] < theirs["median_ms"]
        results["gram"][f"{n}x{s[0]}x{s[1]}"] = entry

    # 4. orthogonality errors (Gaussian and gradient-like inputs), with matmul
    for s, n in shapes.items():
        g = torch.Generator(device=device).manual_seed(1)
        gauss = torch.randn(min(n, 4), *s, device=device, generator=g)
        low = (torch.randn(min(n, 4), s[0], 16, device=device, generator=g)
               @ torch.randn(min(n, 4), 16, s[1], device=device, generator=g))
        low = low + 0.05 * low.std() * torch.randn(low.shape, device=device, generator=g)
        for method in METHODS:
            def run_err(method=method):
                return {kind: ortho_errors(orthogonalize(G, method, dtype=ortho_dtype), G)
                        for kind, G in (("gaussian", gauss), ("rank16+noise", low))}
            guarded(results["errors"], f"{method}/{s[0]}x{s[1]}", run_err)

    faster = [v for e in results["gram"].values() for k, v in e.items() if k.endswith("triton_faster")]
    gpu = torch.cuda.get_device_name() if device.type == "cuda" else "cpu-smoke"
    report = {
        "benchmark": "optim",
        "device": gpu,
        "torch": torch.__version__,
        "triton": getattr(__import__("triton"), "__version__", None) if gram_triton.HAVE_TRITON else None,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join([Path(sys.executable).name] + sys.argv),
        "params": n_params,
        "muon_shapes": {f"{a}x{b}": n for (a, b), n in shapes.items()},
        "ortho_dtype": str(ortho_dtype).removeprefix("torch."),
        "warmup": warmup, "iters": iters,
        "results": results,
        "triton_gram_faster_everywhere": bool(faster) and all(faster),
        "triton_gram_faster_anywhere": any(faster),
        "note": ("Muon uses gram='matmul' by default; switch to 'triton' only where "
                 "triton_gram_faster shows it wins and the step time agrees."),
        "wall_s": round(time.time() - t_begin, 1),
    }
    out = write_report(report, "optim", args.out, smoke, gpu)
    print(f"wrote {out} in {report['wall_s']} s")


if __name__ == "__main__":
    main()
