"""What the Triton kernel modules (layers' ssd, elephant, ce, conv and rotary kernels, optim's
gram kernel) share: Triton itself when it imports (None and HAS_TRITON False when it does not:
the plain paths run instead), whether its interpreter runs the kernels on CPU tensors
(TRITON_INTERPRET=1: the tests), and the float dtypes whose math the kernels do in float32."""
from __future__ import annotations

import os
import sys

import torch

try:
    import triton
    import triton.language as tl
    HAS_TRITON = True
except ImportError:
    triton = tl = None
    HAS_TRITON = False

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def is_pow2(n: int) -> bool:
    """Whether n is a power of two (a size the kernels' tiles take whole)."""
    return n > 0 and n & (n - 1) == 0


def unit_stride_rows(t: torch.Tensor) -> torch.Tensor:
    """t (..., D) as (N, D) rows with unit stride over D: a view where t's strides allow it (e.g. a
    column slice of a wider projection output), else a contiguous copy. Row kernels read it at
    its row stride."""
    r = t.reshape(-1, t.shape[-1])
    return r if r.stride(1) == 1 else r.contiguous()


# Registering a torch.library.triton_op makes torch read the function's source for the Triton
# kernels it launches, with inductor's helpers: the first registration imports torch._inductor
# and torch._dynamo; and the first call of a torch.library.custom_op imports torch._dynamo (its
# kernel runs inside dynamo's "disable"). 1.1-1.4 s of a CPU's start, each time eval.py starts,
# which compiles nothing. With lazy_ops() on, an op (`triton_op`, `custom_op` below) waits: a
# call that needs no autograd (no grad mode, or no input that requires grad: evaluation,
# generation, the backward's own ops) runs the op's function, which is what the registered op
# runs eagerly; the first call that needs autograd registers it; and register_ops() registers
# every one still waiting (what each torch.compile of the project's code calls first: an op
# registered while dynamo traces would be a graph break). Off by default: only a process that
# turns it on before importing the kernel modules (eval.py) waits.
_LAZY = False
_PENDING: list["_PendingOp"] = []


def lazy_ops(on: bool = True) -> None:
    """Let the ops of the kernel modules imported after this call wait (see above)."""
    global _LAZY
    _LAZY = on


def register_ops() -> None:
    """Register every op still waiting (before torch.compile traces any)."""
    for op in list(_PENDING):
        op.register()


class _PendingOp:
    """A triton or custom op not yet registered, callable as the op is (see above). Registered,
    it takes the op's place in its module, where dynamo will read it."""

    def __init__(self, name: str, fn, mutates_args, make):
        self.name, self.fn, self.mutates_args, self.make = name, fn, mutates_args, make
        self.op, self.after = None, []
        _PENDING.append(self)

    def register_fake(self, fake):
        """As CustomOpDef.register_fake (a decorator): with the op's registration."""
        self.after.append(lambda real: real.register_fake(fake))
        return fake

    def register(self):
        if self.op is None:
            self.op = self.make(self.name, self.fn, mutates_args=self.mutates_args)
            for then in self.after:
                then(self.op)
            module = sys.modules.get(self.fn.__module__)
            if getattr(module, self.fn.__name__, None) is self:
                setattr(module, self.fn.__name__, self.op)
            _PENDING.remove(self)
        return self.op

    def __call__(self, *args, **kwargs):
        if self.op is None:
            if torch.compiler.is_compiling():
                raise RuntimeError(f"{self.name} was not registered before torch.compile traced "
                                   f"it: call elephant.layers.triton_env.register_ops() first")
            if not (torch.is_grad_enabled() and any(
                    isinstance(a, torch.Tensor) and a.requires_grad
                    for a in (*args, *kwargs.values()))):
                return self.fn(*args, **kwargs)
            self.register()
        return self.op(*args, **kwargs)


def _maker(make):
    """`make` (torch.library.triton_op or custom_op) as a decorator factory, or with lazy_ops()
    on, one that leaves the op waiting (_PendingOp)."""
    def op(name: str, *, mutates_args):
        def wrap(fn):
            if not _LAZY:
                return make(name, fn, mutates_args=mutates_args)
            return _PendingOp(name, fn, mutates_args, make)
        return wrap
    return op


triton_op = _maker(torch.library.triton_op)
custom_op = _maker(torch.library.custom_op)


def register_autograd(op, backward, *, setup_context) -> None:
    """torch.library.register_autograd for an op made by `triton_op` or `custom_op`: at once, or
    with the op's registration where it waits."""
    if isinstance(op, _PendingOp):
        op.after.append(lambda real: torch.library.register_autograd(
            real, backward, setup_context=setup_context))
    else:
        torch.library.register_autograd(op, backward, setup_context=setup_context)


def check(cond, message) -> None:
    """torch._check(cond, message) (a RuntimeError with message() where cond fails) without its
    first call's import of torch's symbolic shapes (sympy, ~0.3 s) where cond is a plain bool,
    as it is outside tracing."""
    if isinstance(cond, bool):
        if not cond:
            raise RuntimeError(message())
    else:
        torch._check(cond, message)
