"""Shared by the benchmark scripts (and the memory tests): timing with CUDA events on GPU,
perf_counter on CPU; the bytes autograd saves for a backward; the top kernels of a profiled step;
another copy of a kernel module for an A/B in one run."""
import re
import statistics
import time
import types
from pathlib import Path

import torch


def split_seed(name: str, known) -> tuple[str, str]:
    """A study's variant name "hybrid@2" -> ("hybrid", "2"): the variant hybrid trained with
    train.seed=2, so that seeds of one variant train side by side ("" without "@"). KeyError for a
    base not in `known` or a seed that is not a number."""
    base, at, seed = name.partition("@")
    if base not in known or (at and not seed.isdigit()):
        raise KeyError(name)
    return base, seed


def timer(device):
    """(start(), stop(handle) -> ms) with CUDA events on GPU, perf_counter on CPU."""
    if device.type == "cuda":
        def start():
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev

        def stop(ev):
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            torch.cuda.synchronize()
            return ev.elapsed_time(end)
    else:
        def start():
            return time.perf_counter()

        def stop(t0):
            return (time.perf_counter() - t0) * 1e3
    return start, stop


def median_ms(fn, device, iters: int, warmup: int, graph: bool = False) -> float:
    """Median ms of `fn()` over `iters` calls after `warmup` (CUDA events on GPU). graph: fn is
    captured once as a CUDA graph and the replays are timed, i.e. its kernels without the host's
    launches (eager calls of a few short kernels time the launches)."""
    start, stop = timer(device)
    call = fn
    if graph:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()
        torch.cuda.current_stream().wait_stream(side)
        captured = torch.cuda.CUDAGraph()
        with torch.cuda.graph(captured):
            fn()
        call = captured.replay
    times = []
    for i in range(warmup + iters):
        t = start()
        call()
        ms = stop(t)
        if i >= warmup:
            times.append(ms)
    return statistics.median(times)


def queued_ms(fn, calls: int, warmup: int = 0) -> float:
    """Mean ms a call of `fn()` over `calls` calls queued back to back after `warmup` (one CUDA
    event pair around them all: the GPU's pace when the host keeps ahead of it)."""
    for _ in range(warmup):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / calls


def sweep_arguments(ap, iters: int, warmup: int, segments_help: str | None = None):
    """The launch sweeps' shared arguments on `ap`: --iters, --warmup, and --segments when the
    sweep has a form with document boundaries (segments_help; add their own after)."""
    ap.add_argument("--iters", type=int, default=iters)
    ap.add_argument("--warmup", type=int, default=warmup)
    if segments_help is not None:
        ap.add_argument("--segments", action="store_true", help=segments_help)
    return ap


def cuda_or_exit(name: str) -> torch.device:
    """The CUDA device, or exit with an error naming the benchmark that needs it."""
    if not torch.cuda.is_available():
        import sys
        sys.exit(f"error: {name} needs CUDA")
    return torch.device("cuda")


def rel_error(a, b) -> float:
    """The relative (norm) error ||a - b|| / ||b|| in float32."""
    a, b = a.float(), b.float()
    return float((a - b).norm() / b.norm().clamp(min=1e-12))


def rel_close(a, b, tol: float) -> bool:
    """Whether a is b to a relative (norm) error under tol; two Nones agree."""
    if a is None or b is None:
        return a is None and b is None
    return rel_error(a, b) < tol


def fastest(rows: list, kinds=("fwd", "bwd")) -> dict:
    """Of a launch sweep's rows (each with `equal_<kind>` and `<kind>_us`, or `error` / `<kind>_error`), the
    fastest whose outputs were equal, per kind (None when there is none)."""
    ok = [r for r in rows if "error" not in r]
    return {k: min((r for r in ok if r.get(f"equal_{k}") and f"{k}_us" in r),
                   key=lambda r: r[f"{k}_us"], default=None)
            for k in kinds}


def saved_bytes(fn, *args, exclude=()) -> int:
    """Bytes of the distinct tensors autograd keeps for the backward of fn(*args); tensors sharing
    storage with `exclude` (the weights) are not counted."""
    skip = {p.untyped_storage().data_ptr() for p in exclude}
    seen = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in skip:
            seen[(t.data_ptr(), t.dtype, tuple(t.shape))] = t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(*args)
    return sum(seen.values())


def commit() -> str:
    """The checkout's commit (git rev-parse HEAD), with "+dirty" when files differ from it;
    "unknown" outside a git checkout. $ELEPHANT_COMMIT, when set, is taken instead: the commit of
    a copied tree whose git metadata is not its own (the device machine's copy carried the
    session's first commit as HEAD, and named it "+dirty" in every result file)."""
    import os
    import subprocess
    if os.environ.get("ELEPHANT_COMMIT"):
        return os.environ["ELEPHANT_COMMIT"]

    def git(*a):
        try:
            return subprocess.run(["git", *a], cwd=Path(__file__).resolve().parent,
                                  capture_output=True, text=True, timeout=5).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""
    head = git("rev-parse", "HEAD")
    if not head:
        return "unknown"
    return head + ("+dirty" if git("status", "--porcelain", "--untracked-files=no") else "")


def environment(device=None) -> dict:
    """Device, versions, date, command line and git commit (`commit()`), for a result file
    (`device`: the one measured; default the GPU when there is one)."""
    import datetime
    import platform
    import sys
    cuda = torch.cuda.is_available() if device is None else torch.device(device).type == "cuda"
    env = {"device": torch.cuda.get_device_name() if cuda else platform.processor() or "cpu",
           "torch": torch.__version__, "python": sys.version.split()[0],
           "date": datetime.datetime.now().isoformat(timespec="seconds"),
           "command": " ".join(["python", *sys.argv])}
    if cuda:
        env["cuda"] = torch.version.cuda
    try:
        import triton
        env["triton"] = triton.__version__
    except ImportError:
        pass
    env["commit"] = commit()
    return env


def train_for_budget(trainer, budget_s: float, warm: int = 10, log_every: int = 25,
                     name: str = "") -> tuple[list[dict], float]:
    """Run `trainer.train_step()` for `budget_s` seconds of wall clock after the first `warm`
    steps (compilation, which a warm Inductor cache shortens: it would make budgets unequal).
    `max_steps` is fit to the budget from the measured step time, and fit again every `log_every`
    steps until half the schedule has run, so the learning-rate schedule still ends on the budget
    when steps slow down later. Returns the loss every `log_every` steps (seconds counted from
    the end of the warm steps) and the seconds the warm steps took."""
    import sys
    cfg = trainer.cfg
    cuda = trainer.rt.device.type == "cuda"
    curve, t_start, t_warm, warm_s = [], time.perf_counter(), None, 0.0
    total = cfg.train.max_steps

    def now():
        if cuda:
            torch.cuda.synchronize()
        return time.perf_counter()

    while trainer.step < total:
        rec = trainer.train_step()
        if trainer.step == warm:
            t_warm = now()
            warm_s = t_warm - t_start
        elif t_warm is not None and (trainer.step == 2 * warm or (
                trainer.step % log_every == 0 and trainer.step < total // 2)):
            spent = now() - t_warm
            per_step = spent / (trainer.step - warm)
            total = trainer.step + max(1, int((budget_s - spent) / per_step))
            cfg.train.max_steps = total
        if trainer.step % log_every == 0 or trainer.step == total:
            seconds = time.perf_counter() - (t_warm or t_start)
            curve.append({"step": trainer.step, "loss": rec["loss"], "seconds": seconds})
            print(f"[{name}] step {trainer.step}/{total} loss {rec['loss']:.4f} {seconds:.0f}s",
                  file=sys.stderr, flush=True)
    return curve, warm_s


def result_path(prefix: str, smoke: bool):
    """benchmarks/results/<prefix>_<gpu name>.json (or _cpu-smoke), its folder created."""
    from pathlib import Path
    out = Path(__file__).parent / "results"
    out.mkdir(exist_ok=True)
    tag = "cpu-smoke" if smoke else torch.cuda.get_device_name().replace(" ", "_")
    return out / f"{prefix}_{tag}.json"


def write_report(report: dict, prefix: str, out: str | None, smoke: bool, gpu: str):
    """Write `report` as JSON to `out`, or to benchmarks/results/<prefix>_<gpu>.json (a CPU smoke
    run to the temporary folder, never among the results); returns the path."""
    import json
    import re
    import tempfile
    from pathlib import Path
    if out:
        path = Path(out)
    elif smoke:
        path = Path(tempfile.gettempdir()) / f"{prefix}_cpu-smoke.json"
    else:
        path = Path(__file__).parent / "results" / f"{prefix}_{re.sub(r'[^A-Za-z0-9._-]+', '_', gpu)}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n")
    return path


def add_inductor_argument(ap, what: str) -> None:
    """The `--inductor OPTION=VALUE` argument (repeatable) of a benchmark whose `what` is compiled
    (parse it with `inductor_options`)."""
    ap.add_argument("--inductor", action="append", default=[], metavar="OPTION=VALUE",
                    help=f"an inductor option for {what} (repeatable; a Python literal, e.g. "
                         f"combo_kernels=True), to A/B it")


def inductor_options(items: list[str], error) -> dict:
    """`--inductor OPTION=VALUE` arguments (VALUE a Python literal) as a dict; `error(message)`
    reports a malformed one (argparse's ap.error)."""
    import ast
    options = {}
    for item in items:
        key, sep, value = item.partition("=")
        try:
            options[key.strip()] = ast.literal_eval(value.strip())
        except (ValueError, SyntaxError):
            sep = ""
        if not sep or not key.strip():
            error(f"--inductor: expected OPTION=VALUE with a Python literal, got {item!r}")
    return options


def use_inductor_options(options: dict) -> None:
    """Add inductor options to those the model's compiles use (elephant.model.INDUCTOR_OPTIONS,
    read by ElephantLM.compile_for), to A/B one in a benchmark."""
    if options:
        import elephant.model
        elephant.model.INDUCTOR_OPTIONS.update(options)


def bf16_autocast(device):
    """A context-manager factory: bf16 autocast on CUDA, nothing on the CPU."""
    if torch.device(device).type == "cuda":
        return lambda: torch.autocast("cuda", dtype=torch.bfloat16)
    from contextlib import nullcontext
    return nullcontext


KERNEL_KINDS = (  # (kind, pattern on the kernel's name), first match wins
    # attention first: FlashAttention-2's kernels name their cutlass types
    ("attention", r"sdpa|flash|fmha|attention"),
    ("matmul", r"nvjet|gemm|cutlass|xmma|cublas"),
    # (_chunk_state and _state_pass: the state kernels of profiles before 2026-11-25)
    ("ssd scan", r"_chunk_scan|_states_|_segment_cumsum|_chunk_state|_state_pass"),
    ("conv", r"_conv_(fwd|bwd)_kernel"),
    ("elephant activation", r"^_(fwd|bwd)_kernel|^_glu_cat_(fwd|bwd)_kernel"),
    ("loss", r"logsumexp|log_softmax|nll_loss|cross_entropy|^_ce_kernel|^_lse_kernel|^_picked_kernel"),
    ("norm", r"rms_norm|layer_norm|_norm_|^_qkv_(fwd|bwd)_kernel"),   # _qkv_: q/k norm + rotary
    ("optimizer (foreach)", r"multi_tensor|foreach"),
    ("reduction", r"reduce_kernel|triton_red|triton_per"),
    ("copy", r"copy|memcpy|Memcpy|cat_|CatArray"),
    ("fused elementwise (inductor)", r"^triton_poi"),
    ("elementwise (eager)", r"elementwise|vectorized|unrolled"),
)


def kernel_kind(name: str) -> str:
    return next((kind for kind, pat in KERNEL_KINDS if re.search(pat, name)), "other")


def device_gaps(kernels: list[tuple[float, float, str]], steps: int, top: int = 12) -> dict:
    """Where the GPU idled between kernels, from (start, end, name) of every kernel in a profile
    (microseconds; any streams: a kernel overlapping another is busy time once). `idle_ms_per_step`:
    the time between the first kernel's start and the last one's end with no kernel running, per
    step; `by_size`: that idle time (ms per step) and count per step of the gaps by length (under
    5 us: launch to launch inside a CUDA graph; 5-50; 50-500; over 500 us: the host late);
    `largest`: the `top` longest gaps with the kernels before and after each. Kernel time alone
    misses this: a step's wall is its kernels plus its gaps."""
    spans = sorted(kernels)
    buckets = {"<5us": [0.0, 0], "5-50us": [0.0, 0], "50-500us": [0.0, 0], ">500us": [0.0, 0]}
    gaps = []
    if spans:
        end, last = spans[0][1], spans[0][2]
        for start, stop, name in spans[1:]:
            if start > end:
                gap = start - end
                gaps.append((gap, last, name))
                size = ("<5us" if gap < 5 else "5-50us" if gap < 50 else "50-500us" if gap < 500
                        else ">500us")
                buckets[size][0] += gap
                buckets[size][1] += 1
            if stop > end:
                end, last = stop, name
    gaps.sort(key=lambda g: -g[0])
    per = max(steps, 1)
    return {"idle_ms_per_step": sum(g[0] for g in gaps) / 1e3 / per,
            "by_size": {k: {"ms_per_step": v[0] / 1e3 / per, "per_step": v[1] / per}
                        for k, v in buckets.items()},
            "largest": [{"us": round(g, 1), "after": a[:80], "before": b[:80]}
                        for g, a, b in gaps[:top]]}


def profile(step, steps: int, device, title: str, top: int = 20,
            ranges: tuple = (), shapes: bool = False) -> tuple[list[dict], str, dict]:
    """The `top` kernels by device time over `steps` calls of `step()`, the profiler's table, and
    a summary: `by_kind` (device ms per step by `kernel_kind`), `kernels` (every kernel, ms and
    calls per step), `ranges` (device ms per step of the kernels queued by the host thread inside
    each `torch.profiler.record_function` name in `ranges`; kernels queued by autograd's own
    thread in a backward are not counted in any range). shapes: operators are recorded with their
    input shapes and the table adds them, grouped by shape (which product or reduction a kernel is)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile
    cuda = torch.device(device).type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with torch_profile(activities=activities, record_shapes=shapes) as prof:
        for _ in range(steps):
            step()
        if cuda:
            torch.cuda.synchronize()
    return profile_summary(prof, steps, cuda, title, top, ranges, shapes)


def profile_summary(prof, steps: int, cuda: bool, title: str, top: int = 20, ranges: tuple = (),
                    shapes: bool = False, events=None) -> tuple[list[dict], str, dict]:
    """`profile`'s kernels, table and summary of a stopped torch profiler that saw `steps` steps.
    `events`: its key_averages() where the caller has them already (they take a pass over the
    trace)."""
    events = prof.key_averages() if events is None else events
    key = "self_device_time_total" if cuda else "self_cpu_time_total"
    table = f"== {title} ({steps} steps, sorted by {key})\n" + events.table(sort_by=key, row_limit=30)
    if shapes:
        by_shape = prof.key_averages(group_by_input_shape=True)
        table += (f"\n\n== {title}, operators by input shape\n"
                  + by_shape.table(sort_by=key, row_limit=60, max_name_column_width=40,
                                   max_shapes_column_width=120))
    # the kernels themselves on the GPU (an operator's row would count its kernels twice)
    rows = [e for e in events if getattr(e, key) > 0 and e.key not in ranges
            and (not cuda or e.device_type == torch.autograd.DeviceType.CUDA)]
    total = sum(getattr(e, key) for e in rows) or 1.0
    rows.sort(key=lambda e: -getattr(e, key))
    kernels = [{"name": e.key[:120], "ms_per_step": getattr(e, key) / 1e3 / steps,
                "calls_per_step": e.count / steps, "share": getattr(e, key) / total} for e in rows]
    by_kind: dict[str, float] = {}
    for k in kernels:
        kind = kernel_kind(k["name"])
        by_kind[kind] = by_kind.get(kind, 0.0) + k["ms_per_step"]
    total_key = "device_time_total" if cuda else "cpu_time_total"
    spans = {e.key: getattr(e, total_key) / 1e3 / steps for e in events if e.key in ranges}
    summary = {"device_ms_per_step": total / 1e3 / steps,
               "by_kind": dict(sorted(by_kind.items(), key=lambda kv: -kv[1])),
               "ranges": spans, "kernels": [k for k in kernels if k["ms_per_step"] >= 1e-3]}
    if cuda:   # the GPU's idle time between the kernels, and where
        summary["gaps"] = device_gaps(
            [(e.time_range.start, e.time_range.end, e.name) for e in prof.events()
             if e.device_type == torch.autograd.DeviceType.CUDA and e.name not in ranges
             # not the annotations that span kernels (record_function ranges, compiled graphs)
             and not getattr(e, "is_user_annotation", False) and not e.name.startswith("phase:")
             and not e.name.startswith("## ")], steps)
    return kernels[:top], table, summary


def load_before(path: str, name: str):
    """Another copy of a module of elephant.layers (e.g. `git show <rev>:elephant/layers/
    conv_triton.py > /tmp/before.py`), loaded as elephant.layers.<name> so that its imports
    resolve, with its torch.library ops renamed (elephant:: -> elephant_before::) so that they
    do not clash with (or replace) this copy's: the --before A/B of the launch benchmarks."""
    source = Path(path).read_text().replace('"elephant::', '"elephant_before::')
    mod = types.ModuleType(f"elephant.layers.{name}")
    mod.__package__ = "elephant.layers"
    exec(compile(source, path, "exec"), mod.__dict__)
    return mod


def compiled_registers(kernel) -> list[dict]:
    """Registers, spills (registers the compiler moved to local memory: each is a round trip
    through the cache on every use) and launch of every compiled variant of a Triton kernel
    (a @triton.jit function) run so far in this process; [] when it has none (never launched,
    or run by the interpreter)."""
    out = []
    for entry in getattr(kernel, "device_caches", {}).values():
        cache = entry[0] if isinstance(entry, tuple) else entry
        for compiled in (cache.values() if isinstance(cache, dict) else ()):
            init = getattr(compiled, "_init_handles", None)
            if init is not None:
                init()
            meta = getattr(compiled, "metadata", None)
            out.append({"registers": getattr(compiled, "n_regs", None),
                        "spills": getattr(compiled, "n_spills", None),
                        "warps": getattr(meta, "num_warps", None),
                        "stages": getattr(meta, "num_stages", None),
                        "shared_bytes": getattr(meta, "shared", None)})
    return out


# Which host op queued a step's kernels of a given name (train_speed.py --launchers): the small
# float32 and bf16 reductions, device-to-device copies (a memcpy node or the driver's copy kernel)
# and memsets by default
LAUNCHER_PATTERNS = {
    "reduction_f32": r"reduce_kernel<.*ReduceOp<float",
    "reduction_bf16": r"reduce_kernel<.*ReduceOp<c10::BFloat16",
    "copy": r"Memcpy DtoD|memcpy\d+",
    "memset": r"Memset",
}


def project_frames(stack) -> str:
    """The frames of a Python stack in this project's files, innermost first."""
    keep = [f for f in (stack or []) if "elephant/" in f or "benchmarks/" in f or "train.py" in f]
    return " <- ".join(keep)[:400]


def count_launches(ops, patterns: dict[str, str]) -> dict[str, list[tuple[int, str, str]]]:
    """Each op's kernels (`.kernels`, the device events the profiler links to it by correlation
    id: the innermost op around the launch, an aten op, a custom op or a compiled graph's
    record_function) matched by name, counted by the op and its project frames, most first:
    for each pattern, [(kernels, the op that queued them, its project frames)]."""
    import collections
    out = {}
    for kind, pattern in patterns.items():
        counts = collections.Counter()
        for o in ops:
            n = sum(1 for k in o.kernels if re.search(pattern, k.name))
            if n:
                counts[(o.name, project_frames(o.stack))] += n
        out[kind] = [(n, who, where) for (who, where), n in counts.most_common()]
    return out


def print_launchers(step, patterns: dict[str, str], title: str, top: int = 15) -> None:
    """Run `step()` once under the profiler with stacks (CUDA) and print, for each pattern, the
    ops that queued its kernels (`count_launches`). Inside a CUDA graph every kernel is queued by
    the graph's launch: profile a step without graphs (train.compile=on) to see the ops."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile
    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA],
                       with_stack=True) as prof:
        step()
        torch.cuda.synchronize()
    cpu = torch.autograd.DeviceType.CPU
    found = count_launches([e for e in prof.events() if e.device_type == cpu], patterns)
    for kind, rows in found.items():
        print(f"==== {title}: {kind} ({sum(n for n, _, _ in rows)} kernels, one step)")
        for n, who, where in rows[:top]:
            print(f"  {n:4d}  {who}  ::  {where}")
