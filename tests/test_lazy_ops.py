"""eval.py lets the kernels' ops wait (triton_env.lazy_ops): importing the model, and reading it
without autograd, then imports neither torch's compiler nor dynamo; an op called with autograd
registers, and each gives what the op registered at import gives, its autograd included. Each case runs in a fresh interpreter:
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
        names = {op.name for op in triton_env._PENDING}
        print("waiting", "elephant::ce_dlogits" in names, "elephant::ssd" in names, len(names))
        g = torch.Generator().manual_seed(0)
        y, z = (torch.randn(3, 5, 16, generator=g, requires_grad=True) for _ in range(2))
        w = torch.randn(16, generator=g).requires_grad_()
        out = norm_triton.gated_rmsnorm(y, z, w, 1e-5)
        # the forward registered (its inputs require grad); the backward kernel's op waits
        print("swapped", isinstance(norm_triton._fwd_op, triton_env._PendingOp),
              isinstance(norm_triton._bwd_op, triton_env._PendingOp))
        dout = torch.randn(out.shape, generator=g)
        got = torch.autograd.grad(out, (y, z, w), dout)
        want = torch.autograd.grad(norm_triton.reference(y, z, w, 1e-5), (y, z, w), dout)
        print("grads", max((a - b).abs().max().item() for a, b in zip(got, want)) < 1e-4)
        # ... and is run unregistered by the backward, where grad mode is off
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
    assert out[1].startswith("waiting True True") and int(out[1].split()[-1]) >= 20
    assert out[2] == "swapped False True"
    assert out[3] == "grads True" and out[4] == "bwd True"
    assert out[5] == "left 0" and out[6] == "all True True"


def test_ops_register_at_import_by_default():
    out = run("""
        import sys
        from elephant.layers import norm_triton, triton_env
        print(isinstance(norm_triton._fwd_op, triton_env._PendingOp), len(triton_env._PENDING),
              "torch._inductor" in sys.modules)
    """)
    assert out.split() == ["False", "0", "True"]


def test_a_model_read_without_autograd_runs_the_waiting_ops_as_the_registered_ones(tmp_path):
    # eval.py's case: the model's chunks under no_grad through the kernels (the Triton
    # interpreter on the CPU) register nothing and import no compiler, and give the logits the
    # ops registered at import give
    import torch
    printed = {}
    for lazy in (True, False):
        printed[lazy] = run(f"""
            import sys
            import torch
            from elephant.layers import triton_env
            if {lazy}:
                triton_env.lazy_ops()
            from elephant.config import ModelConfig
            from elephant.model import ElephantLM
            cfg = ModelConfig(vocab_size=64, d_model=32, n_heads=2, layers="MA", d_mlp=64,
                              d_state=8, mamba_head_dim=16, ssd_chunk=8, n_mem=0, kv_window=16,
                              kv_keep=4)
            torch.manual_seed(0)
            model = ElephantLM(cfg).eval()
            tokens = torch.randint(0, 64, (2, 32))
            with torch.no_grad():
                a, state = model(tokens[:, :16])
                b, _ = model(tokens[:, 16:], state)
            torch.save(torch.cat([a, b], 1), "{tmp_path / f'logits_{lazy}.pt'}")
            print("torch._inductor" in sys.modules, "torch._dynamo" in sys.modules,
                  len(triton_env._PENDING))
        """).split()
    assert printed[True][:2] == ["False", "False"] and int(printed[True][2]) >= 20
    assert printed[False] == ["True", "True", "0"]
    assert torch.equal(torch.load(tmp_path / "logits_True.pt"), torch.load(tmp_path / "logits_False.pt"))


def test_eval_py_loads_and_reads_a_model_without_torchs_compiler(tmp_path):
    # the whole of eval.py's path: from_pretrained (the model built without its random fills;
    # built on the meta device, those fills had imported dynamo) and a read under no_grad
    import torch

    from elephant.config import Config, ModelConfig
    from elephant.hub import save_pretrained
    from elephant.model import ElephantLM
    cfg = ModelConfig(vocab_size=64, d_model=32, n_heads=2, layers="MA", d_mlp=64, d_state=8,
                      mamba_head_dim=16, ssd_chunk=8, n_mem=0, kv_window=16, kv_keep=4)
    torch.manual_seed(0)
    model = ElephantLM(cfg).eval()
    recipe = Config(model=cfg)
    recipe.data.tokenizer = "bytes"
    out = save_pretrained(model, tmp_path / "export", train_config=recipe.to_dict())
    tokens = torch.randint(0, 64, (2, 16))
    torch.save(tokens, tmp_path / "tokens.pt")
    with torch.no_grad():
        torch.save(model(tokens)[0], tmp_path / "want.pt")
    printed = run(f"""
        import sys
        import torch
        from elephant.layers import triton_env
        triton_env.lazy_ops()
        from elephant.hub import from_pretrained
        model, _, _ = from_pretrained("{out}")
        with torch.no_grad():
            got = model(torch.load("{tmp_path / 'tokens.pt'}"))[0]
        print(torch.equal(got, torch.load("{tmp_path / 'want.pt'}")),
              "torch._dynamo" in sys.modules, "torch._inductor" in sys.modules)
    """)
    assert printed.split() == ["True", "False", "False"]
