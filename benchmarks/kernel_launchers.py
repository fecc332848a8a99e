"""Which host op launches a step's kernels of a given name: `benchmarks/train_speed.py` with one
more profiled step of each trainer part, its kernels matched by name and counted by the op (and
the project's frames of its Python stack) that queued them.

    python benchmarks/kernel_launchers.py [--pattern NAME=REGEX ...] <train_speed.py arguments>
    python benchmarks/kernel_launchers.py --only hybrid --set train.compile=on

Default patterns: the small float32 and bf16 reductions, device-to-device copies (a memcpy node or
the driver's copy kernel) and memsets. Inside a CUDA graph every kernel is queued by the graph's
launch, so give `--set train.compile=on` (each block compiled, no graphs) to see the ops; the
kernels are the same but for inductor's fusions across blocks. Prints one table per pattern (and
needs CUDA for the extra step: on the CPU it only runs train_speed.py).
"""
from __future__ import annotations

import collections
import re
import runpy
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import benchmarks.common as common  # noqa: E402

PATTERNS = {
    "reduction_f32": r"reduce_kernel<.*ReduceOp<float",
    "reduction_bf16": r"reduce_kernel<.*ReduceOp<c10::BFloat16",
    "copy": r"Memcpy DtoD|memcpy\d+",
    "memset": r"Memset",
}


def project_frames(stack) -> str:
    """The frames of a Python stack in this project's files, innermost first."""
    keep = [f for f in (stack or []) if "elephant/" in f or "benchmarks/" in f or "train.py" in f]
    return " <- ".join(keep)[:400]


def launchers(step, patterns: dict[str, str]) -> dict[str, list[tuple[int, str, str]]]:
    """Run `step()` once under the profiler with stacks; for each pattern, [(kernels, the op that
    queued them, its project frames)] by count."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=True) as prof:
        step()
        torch.cuda.synchronize()
    cpu = torch.autograd.DeviceType.CPU
    return count_launches([e for e in prof.events() if e.device_type == cpu], patterns)


def count_launches(ops, patterns: dict[str, str]) -> dict[str, list[tuple[int, str, str]]]:
    """`launchers`' counting: each op's kernels (`.kernels`, the device events the profiler links
    to it by correlation id: the innermost op around the launch, an aten op, a custom op or a
    compiled graph's record_function) matched by name, counted by the op and its project frames,
    most first."""
    out = {}
    for kind, pattern in patterns.items():
        counts = collections.Counter()
        for o in ops:
            n = sum(1 for k in o.kernels if re.search(pattern, k.name))
            if n:
                counts[(o.name, project_frames(o.stack))] += n
        out[kind] = [(n, who, where) for (who, where), n in counts.most_common()]
    return out


def main() -> int:
    argv, patterns = [], {}
    args = iter(sys.argv[1:])
    for a in args:
        if a == "--pattern":
            name, _, regex = next(args, "").partition("=")
            if not name or not regex:
                sys.exit("error: --pattern takes NAME=REGEX")
            patterns[name] = regex
        else:
            argv.append(a)
    patterns = patterns or PATTERNS
    profile = common.profile

    def profile_and_trace(step, steps, device, title, *a, **k):
        result = profile(step, steps, device, title, *a, **k)
        if "Trainer.train_step" in title and torch.device(device).type == "cuda":
            for kind, rows in launchers(step, patterns).items():
                print(f"==== {title}: {kind} ({sum(n for n, _, _ in rows)} kernels, one step)")
                for n, who, where in rows[:15]:
                    print(f"  {n:4d}  {who}  ::  {where}")
        return result
    common.profile = profile_and_trace   # train_speed.py imports it by name after this
    sys.argv = [str(ROOT / "benchmarks/train_speed.py")] + argv
    runpy.run_path(str(ROOT / "benchmarks/train_speed.py"), run_name="__main__")
    return 0


if __name__ == "__main__":
    sys.exit(main())
