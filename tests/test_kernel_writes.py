"""What torch.compile believes each of our Triton kernels writes.

Inductor launches the kernels registered with torch.library.triton_op from its own code, after an
analysis of the kernel's Triton IR that finds the tensors it stores to; an input it believes
written is copied before every launch (the functional form of a mutation), and where the input is
not needed afterwards the copy stays as a load and store of the whole tensor in place. The q/k/v
kernels once looked as if they wrote y, cos and sin (their store addresses came from a helper
that was also given those pointers): six 52 MB copies a training step. Each kernel must be seen
writing exactly its outputs. The IR is generated for sm_90 without a GPU, in a process of its own
without the Triton interpreter (whose kernels have no IR)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[1]

# run in the child: `written(kernel, values)` prints the names the analysis finds written
_CHILD = r"""
import json, sys, torch, triton
from triton.backends.compiler import GPUTarget
from torch._higher_order_ops import triton_kernel_wrap as wrap

class Sm90:
    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)

if not hasattr(wrap, "identify_accessed_tensors"):
    print(json.dumps(None)); sys.exit(0)
triton.runtime.driver.set_active(Sm90())
from elephant.layers import (ce_triton, conv_triton, linear_nll_triton, mamba_inner, norm_triton,
                             rotary_triton)

def written(kernel, values):
    args = {name: values[name] for name in kernel.arg_names}
    rw = wrap.identify_accessed_tensors(kernel, args, {}).read_writes
    return sorted(d.name for d in rw.writes)

out = {}
"""


def analyse(body: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = _CHILD + body + "\nprint(json.dumps(out))\n"
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    if result is None:
        pytest.skip("this torch has no identify_accessed_tensors")
    return {k: set(v) for k, v in result.items()}


_KERNELS = r"""
B, S, H, hd = 2, 4, 2, 8
y = torch.randn(B, S, 3 * H * hd).half()
half = dict(S=S, s_yb=y.stride(0), s_ys=y.stride(1), eps=1e-6, H=H, HD=hd, HALF=hd // 2,
            NORM=True, y_ptr=y, cos_ptr=torch.randn(B, S, hd // 2),
            sin_ptr=torch.randn(B, S, hd // 2), wq_ptr=torch.randn(hd), wk_ptr=torch.randn(hd))
q, k, v = (torch.empty(B, H, S, hd).half() for _ in range(3))
out["qkv fwd"] = written(rotary_triton._qkv_fwd_kernel, dict(half, q_ptr=q, k_ptr=k, v_ptr=v))
strides = {f"s_{n}{a}": st for n, t in zip("qkv", (q, k, v)) for a, st in zip("bhs", t.stride()[:3])}
out["qkv bwd"] = written(rotary_triton._qkv_bwd_kernel,
                         dict(half, **strides, dq_ptr=q, dk_ptr=k, dv_ptr=v, dy_ptr=torch.empty_like(y),
                              dwq_ptr=torch.empty(B * S, hd), dwk_ptr=torch.empty(B * S, hd)))
B, L, C, K = 2, 40, 24, 4
x = torch.randn(B, L, C).half()
for seg in (False, True):
    common = dict(L=L, C=C, K=K, HAS_SEG=seg, HAS_TAIL=seg, BL=16, BC=16, SUB=8, sxb=1, sxl=1, sxc=1,
                  ssb=1, ssc=1, ssk=1, x_ptr=x, st_ptr=torch.randn(B, K - 1, C),
                  w_ptr=torch.randn(C, 1, K), seg_ptr=torch.zeros(B, L, dtype=torch.int32),
                  since_ptr=torch.zeros(B, L, dtype=torch.int32), tail_ptr=torch.randn(C, K - 1))
    for act in (False, True):
        out[f"conv fwd {seg} {act}"] = written(
            conv_triton._conv_fwd_kernel,
            dict(common, bias_ptr=torch.randn(C), out_ptr=torch.empty_like(x),
                 act_ptr=torch.empty_like(x), sob=1, sol=1, soc=1, ACT=act))
    out[f"conv bwd {seg}"] = written(conv_triton._conv_bwd_kernel,
                                     dict(common, g_ptr=torch.randn_like(x), dx_ptr=torch.empty_like(x),
                                          a_ptr=torch.randn_like(x), SILU=True,
                                          dw_ptr=torch.empty(8, C, K), db_ptr=torch.empty(8, C),
                                          dtail_ptr=torch.zeros(8, C, K - 1), NL=3, sgb=1, sgl=1,
                                          sgc=1, sdb=1, sdl=1, sdc=1, dx_off=0, KP=4, KW=4))
walk = dict(L=L, C=C, BL=16, BC=16, sxb=1, sxl=1, sxc=1, ssb=1, ssc=1, ssk=1, x_ptr=x,
            st_ptr=torch.randn(B, 3, C), w_ptr=torch.randn(C, 1, 4))
out["conv bwd walk"] = written(conv_triton._conv_bwd_walk_kernel,
                               dict(walk, g_ptr=torch.randn_like(x), dx_ptr=torch.empty_like(x),
                                    a_ptr=torch.randn_like(x), SILU=True,
                                    dw_ptr=torch.empty(8, C, 4), db_ptr=torch.empty(8, C), NL=3,
                                    sgb=1, sgl=1, sgc=1, sdb=1, sdl=1, sdc=1, dx_off=0))
fix = dict(L=L, C=C, K=4, HAS_TAIL=True, BT=4, BC=16, BS=16, NB=3, sxb=1, sxl=1, sxc=1, ssb=1,
           ssc=1, ssk=1, x_ptr=x, st_ptr=torch.randn(B, 3, C), w_ptr=torch.randn(C, 1, 4),
           seg_ptr=torch.zeros(B, L, dtype=torch.int32), tail_ptr=torch.randn(C, 3))
for act in (False, True):
    out[f"conv fwd fix {act}"] = written(
        conv_triton._conv_fwd_fix_kernel,
        dict(fix, bias_ptr=torch.randn(C), since_ptr=torch.zeros(B, L, dtype=torch.int32),
             out_ptr=torch.empty_like(x), act_ptr=torch.empty_like(x), sob=1, sol=1, soc=1, ACT=act))
out["conv bwd fix"] = written(conv_triton._conv_bwd_fix_kernel,
                              dict(fix, g_ptr=torch.randn_like(x), dx_ptr=torch.empty_like(x),
                                   a_ptr=torch.randn_like(x), SILU=True,
                                   dw_ptr=torch.empty(B, C, 4), dtail_ptr=torch.empty(B, C, 3),
                                   KP=4, KW=4, sgb=1, sgl=1, sgc=1, sdb=1, sdl=1, sdc=1,
                                   dx_off=0))
z = torch.randn(4, 64).half()
for fw, gr in ((True, False), (True, True), (False, True)):
    out[f"ce {fw} {gr}"] = written(ce_triton._ce_kernel,
                                   dict(z_ptr=z, t_ptr=torch.randint(0, 64, (4,)), scale_ptr=torch.ones(4),
                                        lse_in_ptr=torch.zeros(4), nll_ptr=torch.empty(4),
                                        lse_ptr=torch.empty(4), dz_ptr=torch.empty_like(z), V=64,
                                        s_z=64, s_dz=64, BLOCK=64, FORWARD=fw, GRAD=gr, IGNORE=-100,
                                        REVERSED=True,
                                        # the L2 hints as _run passes them (a row read twice)
                                        KEEP="evict_last" if fw and gr else "",
                                        DROP="evict_first" if fw and gr else ""))
hl, wl = torch.randn(5, 32).half(), torch.randn(40, 32).half()
out["linear nll"] = written(linear_nll_triton._lse_kernel,
                            dict(h_ptr=hl, w_ptr=wl, m_ptr=torch.empty(2, 5), s_ptr=torch.empty(2, 5),
                                 N=5, V=40, s_h=32, s_w=32, TILES=2, D=32, BM=16, BN=16, BK=16,
                                 PREC="", STAGES=1))
out["picked"] = written(linear_nll_triton._picked_kernel,
                        dict(h_ptr=hl, w_ptr=wl, t_ptr=torch.randint(0, 40, (5,)),
                             p_ptr=torch.empty(5), N=5, V=40, s_h=32, s_w=32, D=32, BM=16, BK=16,
                             IGNORE=-100))
for seg in (False, True):
    out[f"conv dstate {seg}"] = written(conv_triton._conv_dstate_kernel,
                                        dict(g_ptr=torch.randn_like(x), w_ptr=torch.randn(C, 1, 4),
                                             a_ptr=torch.randn_like(x), SILU=True,
                                             seg_ptr=torch.zeros(B, L, dtype=torch.int32),
                                             ds_ptr=torch.empty(B, C, 3), L=L, C=C, sgb=1, sgl=1,
                                             sgc=1, K=4, HAS_SEG=seg, BC=16))
rows = torch.randn(6, 32).half()
out["gated norm bwd"] = written(norm_triton._gated_norm_bwd_kernel,
                                dict(dout_ptr=rows, y_ptr=torch.randn_like(rows),
                                     z_ptr=torch.randn_like(rows), w_ptr=torch.ones(32),
                                     dy_ptr=torch.empty_like(rows), dz_ptr=torch.empty_like(rows),
                                     dw_ptr=torch.empty(2, 32), N=6, D=32, s_do=32, s_y=32, s_z=32,
                                     s_dz=32,
                                     eps=1e-6, ITERS=1, ROWS=4, BD=32))
for add in (False, True):
    out[f"into columns {add}"] = written(mamba_inner._into_columns_kernel,
                                         dict(src_ptr=torch.randn(B, 3, 8), dst_ptr=x, R=3, W=8,
                                              s_sb=24, s_sr=8, s_db=L * C, s_dr=C, dst_off=4,
                                              ADD=add, BR=4, BW=8))
"""


@pytest.fixture(scope="module")
def writes() -> dict:
    return analyse(_KERNELS)


def test_qkv_kernels_write_only_their_outputs(writes):
    assert writes["qkv fwd"] == {"q_ptr", "k_ptr", "v_ptr"}
    assert writes["qkv bwd"] == {"dy_ptr", "dwq_ptr", "dwk_ptr"}


@pytest.mark.parametrize("segments", [False, True])
def test_conv_kernels_write_only_their_outputs(writes, segments):
    assert writes[f"conv fwd {segments} False"] == {"out_ptr"}
    assert writes[f"conv fwd {segments} True"] == {"out_ptr", "act_ptr"}   # with the SiLU
    assert writes[f"conv bwd {segments}"] == ({"dx_ptr", "dw_ptr", "db_ptr"}
                                              | ({"dtail_ptr"} if segments else set()))


def test_conv_walk_kernel_writes_only_its_outputs(writes):
    assert writes["conv bwd walk"] == {"dx_ptr", "dw_ptr", "db_ptr"}


@pytest.mark.parametrize("segments", [False, True])
def test_conv_dstate_kernel_writes_only_its_output(writes, segments):
    assert writes[f"conv dstate {segments}"] == {"ds_ptr"}


def test_conv_start_kernels_write_only_their_outputs(writes):
    # SEGMENT_FORM "starts": the mending over the plain launch's out, act and dx
    assert writes["conv fwd fix False"] == {"out_ptr"}
    assert writes["conv fwd fix True"] == {"out_ptr", "act_ptr"}
    assert writes["conv bwd fix"] == {"dx_ptr", "dw_ptr", "dtail_ptr"}


@pytest.mark.parametrize("forward, grad", [(True, False), (True, True), (False, True)])
def test_loss_kernel_writes_only_its_outputs(writes, forward, grad):
    assert writes[f"ce {forward} {grad}"] == (({"nll_ptr", "lse_ptr"} if forward else set())
                                             | ({"dz_ptr"} if grad else set()))


def test_linear_nll_kernels_write_only_their_partial_sums(writes):
    # evaluation's head without its logits (head.EVAL_FUSED), launched by inductor from a chunk
    assert writes["linear nll"] == {"m_ptr", "s_ptr"}
    assert writes["picked"] == {"p_ptr"}


@pytest.mark.parametrize("add", [False, True])
def test_into_columns_kernel_writes_only_its_destination(writes, add):
    # mamba_inner's writes into the in-projection's gradient (dt's columns, the conv state's rows)
    assert writes[f"into columns {add}"] == {"dst_ptr"}


def test_gated_norm_kernel_writes_only_its_outputs(writes):
    assert writes["gated norm bwd"] == {"dy_ptr", "dz_ptr", "dw_ptr"}


def test_gated_norm_kernel_compiles_with_eps_as_inductor_passes_it():
    # inductor launches a kernel with a Python float argument typed float64: the kernel's math
    # must stay float32 (a float64 eps once made its loop-carried weight gradient float64, which
    # Triton refuses to compile); the IR for sm_90, without a GPU
    body = r"""
from triton.compiler import ASTSource
from triton.compiler.compiler import make_backend
import triton._C.libtriton as lt
target = Sm90().get_current_target()
backend = make_backend(target)
ctx = lt.ir.context(); lt.ir.load_dialects(ctx); backend.load_dialects(ctx)
opts = backend.parse_options({})
sig = {n: "*bf16" for n in ("dout_ptr", "y_ptr", "z_ptr", "dy_ptr", "dz_ptr")}
sig.update(w_ptr="*fp32", dw_ptr="*fp32", N="i32", D="i32", s_do="i32", s_y="i32", s_z="i32",
           s_dz="i32", eps="fp64", ITERS="constexpr", ROWS="constexpr", BD="constexpr")
src = ASTSource(fn=norm_triton._gated_norm_bwd_kernel, signature=sig,
                constexprs={"ITERS": 8, "ROWS": 4, "BD": 1024})
src.make_ir(target, opts, backend.get_codegen_implementation(opts), backend.get_module_map(), ctx)
out["compiled"] = ["yes"]
"""
    assert analyse(body) == {"compiled": {"yes"}}   # the child fails where Triton refuses it
