"""The kernel and layer micro-benchmarks, one subcommand each (their code in
benchmarks/kernel_benches/; `python benchmarks/kernels.py NAME --help` says what NAME measures).

    python benchmarks/kernels.py ssd            # CUDA; most write benchmarks/results/<name>_<gpu>.json
    python benchmarks/kernels.py layers --cpu-smoke

Most need CUDA; `ssd`, `kept-read`, `layers`, `model` and `optim-step` also run at tiny shapes on the CPU
(--cpu-smoke: they check that the code runs, not its speed); `field --cpu-smoke` checks its argument
mappings onto the field's kernels against references of them.
"""
from __future__ import annotations

import argparse
import importlib
import inspect
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# subcommand: (module of benchmarks.kernel_benches, function, what it measures); the function's
# docstring is its full help, `<function>_arguments(ap)` adds its arguments
COMMANDS = {
    "ce": ("loss", "ce", "the loss kernel's launch sweep against inductor's"),
    "eval-head": ("loss", "eval_head", "evaluation's head: row blocks, and the fused head's launch"),
    "eval-step": ("loss", "eval_step", "the 64-lane evaluation chunk step: plain, graphed, side batch"),
    "conv-launch": ("conv", "conv_launch", "the Mamba conv kernels' launch sweep (--segments, --before)"),
    "conv-walk": ("conv", "conv_walk", "the conv backward's tile kernel against its token walk"),
    "ssd": ("ssd", "ssd_bench", "the SSD scan and Mamba-2 mixer, every path (--cpu-smoke)"),
    "mamba-bwd": ("ssd", "mamba_bwd", "the Mamba block's scan and conv backward against older modules"),
    "scan-launch": ("scan", "scan_launch", "the chunk-scan kernels' launch sweep (--segments, --before)"),
    "state-pass": ("scan", "state_pass", "the scan's state kernels' launch sweep (--segments, --before)"),
    "group-sum": ("scan", "group_sum", "the scan backward's head sum over its launch"),
    "attention-paths": ("attention", "attention_paths", "attention over [window | chunk], every kernel"),
    "qkv-plain": ("attention", "qkv_plain", "the plain q/k norm and rotary path's variants"),
    "varlen-tile": ("attention", "varlen_tile", "FlashAttention-2's ragged last query tile"),
    "kept-read": ("kept", "kept_read", "best R of K kept tokens: mask vs two parts (--cpu-smoke)"),
    "layers": ("layers", "layers", "attention paths and the fused MLP (--cpu-smoke)"),
    "gated-norm": ("layers", "gated_norm", "the gated RMSNorm backward's launch sweep"),
    "model": ("model", "model_bench", "the ~70M model's step, reference and fast paths (--cpu-smoke)"),
    "optim-step": ("model", "optim_step", "the trainer's optimizer phase: host, GPU, graphed (--cpu-smoke)"),
    "field": ("field", "field", "scan, conv and attention beside mamba-ssm, fla, flash-attn (--cpu-smoke)"),
}


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True, metavar="NAME")
    for name, (module, function, what) in COMMANDS.items():
        mod = importlib.import_module(f"benchmarks.kernel_benches.{module}")
        run = getattr(mod, function)
        sp = sub.add_parser(name, help=what, description=inspect.cleandoc(run.__doc__ or ""),
                            formatter_class=argparse.RawDescriptionHelpFormatter)
        getattr(mod, f"{function}_arguments")(sp)
        sp.set_defaults(run=run)
    return ap


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["ssd"] and "--cpu-smoke" in argv:
        os.environ.setdefault("TRITON_INTERPRET", "1")   # before the first Triton import
    args = parser().parse_args(argv)
    rc = args.run(args)
    return rc if isinstance(rc, int) else 0


if __name__ == "__main__":
    sys.exit(main())
