"""Shared by the benchmark scripts (and the memory tests): timing with CUDA events on GPU,
perf_counter on CPU; the bytes autograd saves for a backward."""
import time

import torch


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


def environment() -> dict:
    """Device, versions, date and command line, for a result file."""
    import datetime
    import sys
    env = {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
           "torch": torch.__version__, "python": sys.version.split()[0],
           "date": datetime.datetime.now().isoformat(timespec="seconds"),
           "command": " ".join(sys.argv)}
    if torch.cuda.is_available():
        env["cuda"] = torch.version.cuda
    try:
        import triton
        env["triton"] = triton.__version__
    except ImportError:
        pass
    return env
