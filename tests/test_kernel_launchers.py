"""train_speed.py --launchers' counting (benchmarks.common.count_launches) on the CPU: each
kernel counted under the op the profiler links it to, by the op's name and the project's frames
of its stack (the GPU run profiles a real step; this holds the counting it feeds)."""
from types import SimpleNamespace as NS

from benchmarks.common import LAUNCHER_PATTERNS as PATTERNS
from benchmarks.common import count_launches


def op(name, stack, *kernels):
    return NS(name=name, stack=stack, kernels=[NS(name=k) for k in kernels])


def test_kernels_are_counted_by_the_op_that_queued_them():
    red = "void at::native::reduce_kernel<128, 4, at::native::ReduceOp<float, at::native::func_wrapper_t<"
    stack = ["/repo/elephant/layers/ssd.py(412): _bwd", "/usr/lib/python3/site-packages/torch/x.py(1): y",
             "/repo/train.py(80): main"]
    ops = [op("aten::sum", stack, red, "Memset (Device)"),
           op("aten::copy_", None, "Memcpy DtoD (Device -> Device)"),
           op("aten::sum", stack, red),
           op("aten::mm", stack, "nvjet_sm90_tst_256x128")]         # matches no pattern
    got = count_launches(ops, PATTERNS)
    where = "/repo/elephant/layers/ssd.py(412): _bwd <- /repo/train.py(80): main"
    assert got["reduction_f32"] == [(2, "aten::sum", where)]
    assert got["memset"] == [(1, "aten::sum", where)]
    assert got["copy"] == [(1, "aten::copy_", "")]
    assert got["reduction_bf16"] == []


def test_compiled_registers_reads_every_compiled_variant_and_nothing_else():
    # benchmarks.common.compiled_registers (`kernels.py scan-launch`'s `registers`): one row per compiled
    # variant in a Triton kernel's per-device caches, handles loaded first (where the counts come
    # from); a kernel never compiled (or an interpreted one) has none
    from benchmarks.common import compiled_registers
    loaded = []

    def variant(regs, spills, warps):
        v = NS(metadata=NS(num_warps=warps, num_stages=3, shared=4096))
        v._init_handles = lambda: (loaded.append(regs), setattr(v, "n_regs", regs),
                                   setattr(v, "n_spills", spills))
        return v
    kernel = NS(device_caches={0: ({"a": variant(255, 28, 4), "b": variant(128, 0, 8)}, "target")})
    assert compiled_registers(kernel) == [
        {"registers": 255, "spills": 28, "warps": 4, "stages": 3, "shared_bytes": 4096},
        {"registers": 128, "spills": 0, "warps": 8, "stages": 3, "shared_bytes": 4096}]
    assert loaded == [255, 128]
    assert compiled_registers(NS()) == [] and compiled_registers(NS(device_caches={})) == []
