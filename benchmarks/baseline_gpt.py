"""The outside yardstick for training speed: a plain GPT that owes nothing to elephant.

    python benchmarks/baseline_gpt.py                  # B16 x T2048 on the GPU, compiled, bf16
    python benchmarks/baseline_gpt.py --cpu-smoke      # tiny shapes on the CPU, no compile

Pre-norm decoder: token embedding tied to the head, rotary positions, causal SDPA (flash on the
GPU), a squared-ReLU MLP, RMSNorm, no biases; fused AdamW; the whole training step's model
compiled as one graph. It imports nothing from this project on purpose, so that what it measures
is what a small, ordinary PyTorch model reaches on the device, not what our code allows. Its size
is set by `GPTConfig`; `matched_config` widens the MLP until the parameter count matches a given
model (benchmarks/train_speed.py matches it to the hybrid recipe).

FLOPs per token are counted the way `ElephantLM.flops_per_token` counts them: 6 per weight of
every matrix product (the tied head included) plus 12 x d_model x (T + 1) / 2 per layer for the
causal attention scores and values; MFU divides by the dense bf16 peak of the device.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict, dataclass, replace

import torch
import torch.nn.functional as F
from torch import Tensor, nn

# dense bf16 peak FLOP/s (SXM parts; PCIe / NVL parts are lower and not listed: no MFU for them)
PEAK_FLOPS_BF16 = {"H100": 989e12, "H200": 989e12}


def peak_flops(device_name: str | None) -> float | None:
    name = (device_name or "").upper()
    if not name or "PCIE" in name or "NVL" in name:
        return None
    return next((f for key, f in PEAK_FLOPS_BF16.items() if key in name), None)


@dataclass
class GPTConfig:
    vocab_size: int = 50304
    d_model: int = 512
    n_layers: int = 8
    n_heads: int = 8
    d_mlp: int = 2048
    rope_base: float = 10000.0
    max_seq_len: int = 4096       # the rotary tables' length (computed once, outside the graph)

    def validate(self) -> None:
        if self.d_model % self.n_heads or (self.d_model // self.n_heads) % 2:
            raise ValueError(f"d_model {self.d_model} must split into {self.n_heads} heads of an "
                             f"even size")
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "d_mlp", "max_seq_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"GPTConfig.{name} must be >= 1, got {getattr(self, name)}")


def rotary_tables(T: int, head_dim: int, base: float, device) -> tuple[Tensor, Tensor]:
    """cos and sin (T, head_dim / 2) of the rotary angles of positions 0..T-1."""
    inv = base ** (-torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
    angles = torch.arange(T, device=device, dtype=torch.float32)[:, None] * inv
    return angles.cos(), angles.sin()


def rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate the two halves of x (B, H, T, hd) as pairs by the tables' angles."""
    x1, x2 = x.chunk(2, dim=-1)
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.norm1 = nn.RMSNorm(cfg.d_model)
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=False)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.norm2 = nn.RMSNorm(cfg.d_model)
        self.up = nn.Linear(cfg.d_model, cfg.d_mlp, bias=False)
        self.down = nn.Linear(cfg.d_mlp, cfg.d_model, bias=False)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        B, T, D = x.shape
        H = self.cfg.n_heads
        q, k, v = self.qkv(self.norm1(x)).view(B, T, 3, H, D // H).permute(2, 0, 3, 1, 4)  # (B, H, T, hd)
        y = F.scaled_dot_product_attention(rotary(q, cos, sin), rotary(k, cos, sin), v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(B, T, D))
        return x + self.down(F.relu(self.up(self.norm2(x))).square())


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        cfg.validate()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = nn.RMSNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.head.weight = self.embed.weight
        # the angles once, in float32, not recomputed by every forward (inside the compiled graph
        # the cos / sin of every position were formed again for every q and k, fused into the
        # rotation: ~10% of the step)
        cos, sin = rotary_tables(cfg.max_seq_len, cfg.d_model // cfg.n_heads, cfg.rope_base, None)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)
        std = 0.02
        for name, p in self.named_parameters():
            if p.dim() == 2:
                last = name.rsplit(".", 2)[-2]
                nn.init.normal_(p, std=std / math.sqrt(2 * cfg.n_layers) if last in ("proj", "down")
                                else std)

    def forward(self, tokens: Tensor, targets: Tensor) -> Tensor:
        """Mean cross-entropy of tokens (B, T) predicting targets (B, T)."""
        T = tokens.shape[1]
        if T > self.cfg.max_seq_len:
            raise ValueError(f"sequence of {T} tokens is longer than GPTConfig.max_seq_len "
                             f"{self.cfg.max_seq_len}")
        cos, sin = self.cos[:T], self.sin[:T]
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x, cos, sin)
        logits = self.head(self.norm(x))
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def flops_per_token(self, T: int) -> float:
        cfg = self.cfg
        matmul = sum(p.numel() for p in self.parameters() if p.dim() == 2)  # tied: counted once, as the head
        return 6 * matmul + cfg.n_layers * 6 * 2 * cfg.d_model * (T + 1) / 2


def matched_config(target_params: int, base: GPTConfig | None = None, multiple: int = 128) -> GPTConfig:
    """`base` with the MLP width (a multiple of `multiple`) whose parameter count is closest to
    `target_params`."""
    base = base or GPTConfig()
    d, L, V = base.d_model, base.n_layers, base.vocab_size
    fixed = V * d + d + L * (4 * d * d + 2 * d)          # embedding (tied), norms, attention
    per_width = 2 * d * L                                 # up + down, per hidden unit
    width = max(multiple, round((target_params - fixed) / per_width / multiple) * multiple)
    return replace(base, d_mlp=width)


class Stepper:
    """One training step of the GPT: forward + backward (bf16 autocast on CUDA) and fused AdamW."""

    def __init__(self, cfg: GPTConfig, device, compile: bool, lr: float = 1e-3):
        self.device = torch.device(device)
        self.model = GPT(cfg).to(self.device)
        cuda = self.device.type == "cuda"
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=lr, betas=(0.9, 0.95),
                                     weight_decay=0.0, fused=cuda)
        self.run = torch.compile(self.model) if compile else self.model
        self.autocast = (torch.autocast("cuda", dtype=torch.bfloat16) if cuda
                         else torch.autocast("cpu", enabled=False))

    def step(self, tokens: Tensor) -> Tensor:
        """tokens (B, T + 1) on the device; returns the loss as a device tensor (no sync)."""
        with self.autocast:
            loss = self.run(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return loss.detach()


def time_steps(step, batches: Tensor, warmup: int, steps: int, device) -> dict:
    """Run `warmup` steps, then time `steps` steps with CUDA events (perf_counter on the CPU).
    batches (n, B, T + 1): step i takes batches[i % n]. Returns ms per step and the last loss."""
    import time
    cuda = torch.device(device).type == "cuda"
    for i in range(warmup):
        step(batches[i % len(batches)])
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
    t0 = time.perf_counter()
    for i in range(steps):
        loss = step(batches[(warmup + i) % len(batches)])
    if cuda:
        end.record()
        torch.cuda.synchronize()
        ms = start.elapsed_time(end)
    else:
        ms = (time.perf_counter() - t0) * 1e3
    out = {"ms_per_step": ms / steps, "last_loss": float(loss)}
    if cuda:
        out["peak_mem_gb"] = torch.cuda.max_memory_allocated() / 2**30
    return out


def measure(cfg: GPTConfig, batch: int, seq_len: int, device, compile: bool, warmup: int,
            steps: int, seed: int = 0) -> dict:
    """Tokens/s, MFU and peak memory of the GPT's training step at batch x seq_len tokens."""
    torch.manual_seed(seed)
    stepper = Stepper(cfg, device, compile)
    gen = torch.Generator().manual_seed(seed)
    batches = torch.randint(0, cfg.vocab_size, (4, batch, seq_len + 1), generator=gen).to(device)
    timing = time_steps(stepper.step, batches, warmup, steps, device)
    tokens_per_s = batch * seq_len / (timing["ms_per_step"] / 1e3)
    flops = stepper.model.flops_per_token(seq_len)
    name = torch.cuda.get_device_name(device) if torch.device(device).type == "cuda" else None
    peak = peak_flops(name)
    return {"config": asdict(cfg), "batch": batch, "seq_len": seq_len,
            "tokens_per_step": batch * seq_len, "parameters": stepper.model.num_params(),
            "flops_per_token": flops, "compiled": compile, **timing, "tokens_per_s": tokens_per_s,
            "mfu": flops * tokens_per_s / peak if peak else None}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny shapes on the CPU, no compile")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--d-mlp", type=int, default=0, help="MLP width (default 4 x d_model)")
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--no-compile", action="store_true")
    args = ap.parse_args(argv)
    if args.cpu_smoke:
        cfg = GPTConfig(vocab_size=256, d_model=64, n_layers=2, n_heads=4, d_mlp=256)
        result = measure(cfg, 2, 64, "cpu", compile=False, warmup=1, steps=2)
    else:
        if not torch.cuda.is_available():
            print("error: no CUDA device (use --cpu-smoke for the CPU)", file=sys.stderr)
            return 2
        cfg = GPTConfig(d_mlp=args.d_mlp) if args.d_mlp else GPTConfig()
        result = measure(cfg, args.batch, args.seq_len, "cuda", compile=not args.no_compile,
                         warmup=args.warmup, steps=args.steps)
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
