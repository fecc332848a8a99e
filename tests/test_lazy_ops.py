"""eval.py registers the kernels' triton ops at their first calls (triton_env.lazy_ops): importing
the model then imports neither torch's compiler nor dynamo, and each op, called, is the op
registered at import would be, its autograd included. Each case runs in a fresh interpreter:
an op is registered once a process."""
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
triton = pytest.importorskip("triton")


def run(code: str) -> str:
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_lazy_ops_import_no_compiler_and_register_at_the_first_call():
    out = run("""
        import sys
        import torch
        from elephant.layers import triton_env
        triton_env.lazy_ops()
        import elephant.evaluate, elephant.model, elephant.generate, elephant.hub  # noqa: F401
        from elephant.layers import norm_triton
        print("compiler", "torch._inductor" in sys.modules, "torch._dynamo" in sys.modules)
        print("waiting", sorted(op.name for op in triton_env._PENDING)[:3], len(triton_env._PENDING))
        g = torch.Generator().manual_seed(0)
        y, z = (torch.randn(3, 5, 16, generator=g, requires_grad=True) for _ in range(2))
        w = torch.randn(16, generator=g).requires_grad_()
        out = norm_triton.gated_rmsnorm(y, z, w, 1e-5)
        # the forward registered; the backward kernel's op waits for the backward
        print("swapped", isinstance(norm_triton._fwd_op, triton_env._PendingOp),
              isinstance(norm_triton._bwd_op, triton_env._PendingOp))
        dout = torch.randn(out.shape, generator=g)
        got = torch.autograd.grad(out, (y, z, w), dout)
        want = torch.autograd.grad(norm_triton.reference(y, z, w, 1e-5), (y, z, w), dout)
        print("grads", max((a - b).abs().max().item() for a, b in zip(got, want)) < 1e-4)
        print("bwd", isinstance(norm_triton._bwd_op, triton_env._PendingOp))
        triton_env.register_ops()
        print("left", len(triton_env._PENDING))
        from elephant.layers import ce_triton, conv_triton, rotary_triton
        print("all", all(not isinstance(m._fwd_op if hasattr(m, "_fwd_op") else m._conv_op,
                                        triton_env._PendingOp)
                         for m in (rotary_triton, conv_triton, norm_triton)),
              not isinstance(ce_triton._nll_op, triton_env._PendingOp))
    """).split("\n")
    assert out[0] == "compiler False False"
    assert out[1].startswith("waiting ['elephant::ce_dlogits'") and int(out[1].split()[-1]) >= 10
    assert out[2] == "swapped False True"
    assert out[3] == "grads True" and out[4] == "bwd False"
    assert out[5] == "left 0" and out[6] == "all True True"


def test_ops_register_at_import_by_default():
    out = run("""
        import sys
        from elephant.layers import norm_triton, triton_env
        print(isinstance(norm_triton._fwd_op, triton_env._PendingOp), len(triton_env._PENDING),
              "torch._inductor" in sys.modules)
    """)
    assert out.split() == ["False", "0", "True"]
