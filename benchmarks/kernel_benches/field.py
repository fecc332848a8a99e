"""The project's own kernels beside the field's libraries at the recipes' shapes, in one run (`field`,
issue 72): the SSD chunk scan against mamba-ssm's Triton scan and fla's scalar-decay linear
attention, the Mamba conv against causal-conv1d, attention over [window | chunk] against torch
SDPA's flash backend and FlashAttention-4.

A field kernel is timed only after its outputs and gradients, called through the argument mapping
written here, have matched the project's at the same inputs: a kernel that computes something else
is reported as not matching, never timed as equal work. The mappings are held right on the CPU by
`smoke_checks` (and tests/test_field_bench.py): there, plain token-by-token references of each field
kernel's documented semantics stand in for the kernels, and the project's own entry points, fed the
same inputs, must equal them through the mappings. A library that does not import is reported as
not installed, with its one-line reason.
"""
from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import math
import sys
import time
import types
from pathlib import Path
from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F

from benchmarks.common import environment, median_ms, write_report
from elephant.config import load_config
from elephant.layers import conv_triton, ssd
from elephant.layers.attention import attend, varlen_supported
from elephant.layers.mamba import short_conv

RECIPES = ("wt103-70m", "fineweb-124m")
OPS = ("scan", "conv", "attention")
# bf16 outputs and gradients of two kernels that round in different places: a field tensor
# matches the project's where |field - own| <= TOL * (|own| + max |own|) everywhere
TOL = 3e-2
# where each library's kernel is imported from, and its distribution's name (for its version)
LIBRARIES = {
    "mamba_ssm": ("mamba_ssm.ops.triton.ssd_combined", "mamba_chunk_scan_combined", "mamba-ssm"),
    "fla": ("fla.ops.simple_gla", "chunk_simple_gla", "fla-core"),
    "causal_conv1d": ("causal_conv1d", "causal_conv1d_fn", "causal-conv1d"),
    "flash_attn.cute": ("flash_attn.cute", "flash_attn_func", "flash-attn-4"),
}


# ------------------------------------------------------------------------- the field's libraries
def _skip_package_init(package: str) -> None:
    """Put a stub of `package` in sys.modules, its __path__ the installed folder, so that its
    submodules import without its __init__ running. For this benchmark only: mamba-ssm's __init__
    imports its CUDA extension selective_scan_cuda (the wheel carried to the GPU machine is built
    with MAMBA_SKIP_CUDA_BUILD, so there is none) and every module of the package (transformers,
    huggingface_hub), none of which the Triton scan needs."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(f"No module named {package!r}")
    stub = types.ModuleType(package)
    stub.__path__ = list(spec.submodule_search_locations)
    stub.__file__ = spec.origin
    sys.modules[package] = stub


def import_kernel(name: str) -> tuple[Callable | None, dict]:
    """A field library's kernel (LIBRARIES[name]) and what to report of it: its version, or
    `not_installed` with the one-line reason. A package whose __init__ fails to import is tried
    again with its __init__ skipped (`_skip_package_init`), which the report notes."""
    module, attr, dist = LIBRARIES[name]
    info: dict = {"kernel": f"{module}.{attr}"}
    package = module.split(".")[0]
    try:
        kernel = getattr(importlib.import_module(module), attr)
    except Exception as first:  # noqa: BLE001 (any failure of a third party's import is reported)
        if package == module or importlib.util.find_spec(package) is None:
            return None, {**info, "not_installed": one_line(first)}
        try:
            _skip_package_init(package)
            kernel = getattr(importlib.import_module(module), attr)
            info["package_init_skipped"] = one_line(first)
        except Exception as second:  # noqa: BLE001
            return None, {**info, "not_installed": one_line(second)}
    try:
        info["version"] = importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        info["version"] = getattr(sys.modules.get(package), "__version__", "unknown")
    return kernel, info


def one_line(e: BaseException) -> str:
    text = f"{type(e).__name__}: {e}".strip().splitlines()
    return (text[0] if text else type(e).__name__)[:240]


# ------------------------------------------------ references of the field kernels' semantics
# Plain recurrences of what each library documents, for the CPU smoke check (float64); they stand
# in for the kernels there, so that the mappings below are held to the libraries' contracts.
def mamba_chunk_scan_reference(x, dt, A, B, C, chunk_size, D=None, dt_bias=None, initial_states=None,
                               dt_softplus=False, return_final_states=False):
    """mamba_ssm's mamba_chunk_scan_combined: x (b, l, h, p), dt (b, l, h), A (h,), B, C (b, l, g, n)
    (head i reads group i // (h / g)), D (h,) or (h, p), dt_bias (h,), initial_states (b, h, p, n).
    dt <- dt + dt_bias, then softplus(dt) with dt_softplus; per token s = exp(dt A) s + dt x B^T,
    y = s C + D x. chunk_size is the kernel's block length, no part of the result. Returns y, or
    (y, final state) with return_final_states."""
    b, l, h, p = x.shape
    rep = h // B.shape[2]
    Bh, Ch = B.repeat_interleave(rep, dim=2), C.repeat_interleave(rep, dim=2)   # (b, l, h, n)
    if dt_bias is not None:
        dt = dt + dt_bias
    if dt_softplus:
        dt = F.softplus(dt)
    s = x.new_zeros(b, h, p, B.shape[3]) if initial_states is None else initial_states.to(x.dtype)
    ys = []
    for t in range(l):
        decay = torch.exp(dt[:, t] * A)[:, :, None, None]                        # (b, h, 1, 1)
        s = decay * s + (dt[:, t, :, None] * x[:, t])[..., None] * Bh[:, t, :, None, :]
        ys.append(torch.einsum("bhpn,bhn->bhp", s, Ch[:, t]))
    y = torch.stack(ys, dim=1)
    if D is not None:
        y = y + (D[:, None] if D.dim() == 1 else D) * x
    return (y, s) if return_final_states else y


def simple_gla_reference(q, k, v, g, scale=None, initial_state=None, output_final_state=False,
                         chunk_size=64):
    """fla's chunk_simple_gla: q, k (b, t, h, K), v (b, t, h, V), g (b, t, h) the log decay of each
    head's state, initial_state (b, h, K, V). Per token S = exp(g) S + k^T v, o = scale q S, scale
    K^-0.5 unless given. Returns (o, final state (b, h, K, V) or None)."""
    b, t, h, K = q.shape
    scale = K ** -0.5 if scale is None else scale
    S = q.new_zeros(b, h, K, v.shape[-1]) if initial_state is None else initial_state.to(q.dtype)
    outs = []
    for i in range(t):
        S = torch.exp(g[:, i])[:, :, None, None] * S + k[:, i, :, :, None] * v[:, i, :, None, :]
        outs.append(scale * torch.einsum("bhk,bhkv->bhv", q[:, i], S))
    return torch.stack(outs, dim=1), (S if output_final_state else None)


def causal_conv1d_reference(x, weight, bias=None, initial_states=None, return_final_states=False,
                            activation=None):
    """causal_conv1d's causal_conv1d_fn: x (b, d, l), weight (d, w), bias (d,), initial_states
    (b, d, w - 1) the inputs before x (zeros if None). out_t = act(bias + sum_j weight[:, j]
    window[t + j]) over window = [initial_states | x], act SiLU for "silu" / "swish". Returns out
    (b, d, l), or (out, the last w - 1 inputs of the window) with return_final_states."""
    b, d, l = x.shape
    w = weight.shape[1]
    before = x.new_zeros(b, d, w - 1) if initial_states is None else initial_states.to(x.dtype)
    window = torch.cat([before, x], dim=-1)                                     # (b, d, w - 1 + l)
    out = sum(weight[:, j, None] * window[:, :, j:j + l] for j in range(w))
    out = out + (0 if bias is None else bias[:, None])
    if activation in ("silu", "swish"):
        out = F.silu(out)
    return (out, window[:, :, l:]) if return_final_states else out


def flash_attn_reference(q, k, v, softmax_scale=None, causal=False):
    """FlashAttention's flash_attn_func: q (b, sq, h, d), k, v (b, sk, h, d); causal masks are
    aligned to the bottom right (query i sees keys j <= i + sk - sq). Returns (out (b, sq, h, d),
    lse (b, h, sq))."""
    sq, sk = q.shape[1], k.shape[1]
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    scores = torch.einsum("bihd,bjhd->bhij", q, k) * scale
    if causal:
        i = torch.arange(sq)[:, None]
        j = torch.arange(sk)[None, :]
        scores = scores.masked_fill((j > i + sk - sq).to(scores.device), float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    return torch.einsum("bhij,bjhd->bihd", torch.exp(scores - lse[..., None]), v), lse


# --------------------------------- the mappings: the project's arguments in, the project's out
# Each takes the project's tensors (the mixer's and attention layer's, elephant/layers) and returns
# what the project's own call returns, so that the two are compared and timed on the same inputs;
# any reshaping or elementwise work the mapping needs is part of the mapped call.
def own_scan(x, dt, A, B, C, D, s0, chunk):
    """The project's scan as the Mamba-2 mixer calls it (ssd.ssd_scan: the Triton kernels on
    CUDA): x (b, l, h, p), dt (b, l, h) after softplus, A (h,), B, C (b, l, g, n), D (h,), s0
    (b, h, p, n) -> (y (b, l, h, p), final state (b, h, p, n) float32)."""
    return ssd.ssd_scan(x, dt, A, B, C, D, s0, chunk_size=chunk)


def mamba_mapped(kernel, x, dt, A, B, C, D, s0, chunk):
    """mamba_chunk_scan_combined on the project's arguments: the same names, shapes and meaning."""
    return kernel(x, dt, A, B, C, chunk, D=D, initial_states=s0, return_final_states=True)


def own_scan_softplus(x, dt_raw, dt_bias, A, B, C, D, s0, chunk):
    """The project's scan from the in-projection's raw dt, softplus(dt_raw + dt_bias) taken in
    PyTorch first (the mixer's unfused path)."""
    dt = F.softplus(dt_raw.to(torch.promote_types(dt_raw.dtype, torch.float32)) + dt_bias)
    return ssd.ssd_scan(x, dt, A, B, C, D, s0, chunk_size=chunk)


def mamba_softplus_mapped(kernel, x, dt_raw, dt_bias, A, B, C, D, s0, chunk):
    """mamba_chunk_scan_combined with the bias and softplus of dt taken inside the kernel (how
    mamba-ssm's own Mamba-2 layer calls it)."""
    return kernel(x, dt_raw, A, B, C, chunk, D=D, dt_bias=dt_bias, initial_states=s0,
                  dt_softplus=True, return_final_states=True)


def gla_mapped(kernel, x, dt, A, B, C, D, s0, chunk, scale=1.0):
    """chunk_simple_gla on the SSD scan's arguments: the same recurrence with a scalar log decay
    per head and token, g = dt A, values v = dt x, keys k = B and queries q = C (each head reading
    its group's, expanded to the heads), scale 1; its state is (K, V) = (n, p), the project's
    transposed; D x is added after (fla has no skip term), in float32 as the project's scan adds it."""
    h = x.shape[2]
    rep = h // B.shape[2]
    q = C.repeat_interleave(rep, dim=2) if rep > 1 else C                       # (b, l, h, n)
    k = B.repeat_interleave(rep, dim=2) if rep > 1 else B
    v = (x * dt[..., None]).to(x.dtype)                                         # (b, l, h, p)
    o, final = kernel(q, k, v, dt * A, scale=scale, initial_state=s0.transpose(-1, -2),
                      output_final_state=True, chunk_size=chunk)
    acc = torch.promote_types(x.dtype, torch.float32)
    y = (o.to(acc) + D[:, None] * x.to(acc)).to(x.dtype)
    return y, final.transpose(-1, -2)


def own_conv(x, conv_state, weight, bias):
    """The mixers' conv and its SiLU (mamba.short_conv: the Triton kernel on CUDA): x (B, L, C)
    channels last, conv_state (B, C, K - 1), weight (C, 1, K), bias (C,) -> (out (B, L, C), state)."""
    return short_conv(x, conv_state, weight, bias)


def causal_conv1d_mapped(kernel, x, conv_state, weight, bias):
    """causal_conv1d_fn on the conv's arguments: x as (B, C, L) channels last (a view), the carried
    inputs as its initial states (channels last, which returning final states needs), weight and
    bias in x's dtype (the CUDA kernel takes one dtype)."""
    init = conv_state.to(x.dtype).transpose(1, 2).contiguous().transpose(1, 2)
    out, final = kernel(x.transpose(1, 2), weight[:, 0].to(x.dtype), bias.to(x.dtype),
                        initial_states=init, return_final_states=True, activation="silu")
    return out.transpose(1, 2), final.to(conv_state.dtype)


def own_attention(q, k, v, ck, cv, valid):
    """The attention layer's kernel call (attention.attend) over [window | chunk]: q, k, v (B, S,
    H, hd), the cached window ck, cv (B, W, H, hd) whose valid slots (valid (B, W)) are a suffix
    of each lane's; taken as (B, H, ., hd) views, as the layer does -> (B, S, H, hd)."""
    t = lambda a: a.transpose(1, 2)   # noqa: E731
    return (t(attend(t(q), t(k), t(v), t(ck), t(cv), valid, valid_suffix=True)),)


def sdpa_mapped(q, k, v, ck, cv, lower_right=True):
    """torch SDPA over the keys [window | chunk] with a causal mask aligned to the bottom right
    (query i sees the window and chunk keys j <= i), by its flash backend on CUDA. lower_right
    False: is_causal, which torch aligns to the top left (not the chunk's mask: the tests' wrong
    mapping)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right
    t = lambda a: a.transpose(1, 2)   # noqa: E731
    K, V = torch.cat([ck, k], dim=1), torch.cat([cv, v], dim=1)                 # (B, W + S, H, hd)
    backend = SDPBackend.FLASH_ATTENTION if q.is_cuda else SDPBackend.MATH
    with sdpa_kernel([backend]):
        if lower_right:
            out = F.scaled_dot_product_attention(
                t(q), t(K), t(V), attn_mask=causal_lower_right(q.shape[1], K.shape[1]))
        else:
            out = F.scaled_dot_product_attention(t(q), t(K), t(V), is_causal=True)
    return (t(out),)


def fa4_mapped(kernel, q, k, v, ck, cv):
    """flash_attn_func over the keys [window | chunk], causal (FlashAttention aligns it to the
    bottom right), in its own (B, S, H, hd) layout."""
    out = kernel(q, torch.cat([ck, k], dim=1), torch.cat([cv, v], dim=1), causal=True)
    return (out[0] if isinstance(out, tuple) else out,)


# ----------------------------------------------------------------------------------- cases
class Case(NamedTuple):
    """One op at one shape: its inputs (those that require grad get gradients), a gradient for each
    output, the project's call and the field's: (path, library, fn or None, what to report)."""
    op: str
    names: tuple
    inputs: list
    grads: list
    own: tuple          # (path, fn)
    field: list         # [(path, library, fn or None, info)]


def recipe_dims(recipe: str, lanes: int | None = None) -> dict:
    """The shapes of one chunk step of configs/<recipe>.toml: the Mamba-2 mixer's scan and conv
    (d_inner = expand x d_model, heads = d_inner / mamba_head_dim, one B/C group, conv over
    [x | B | C]) and attention over [window | chunk] (n_heads of d_model / n_heads)."""
    cfg = load_config(Path(__file__).resolve().parents[2] / "configs" / f"{recipe}.toml")
    m, t = cfg.model, cfg.train
    return {"lanes": lanes or t.lanes, "tokens": t.chunk_len, "d_model": m.d_model,
            "heads": m.mamba_heads, "head_dim": m.mamba_head_dim, "d_state": m.d_state,
            "groups": 1, "ssd_chunk": m.ssd_chunk, "conv_dim": m.d_inner + 2 * m.d_state,
            "d_conv": m.d_conv, "attn_heads": m.n_heads, "attn_head_dim": m.head_dim,
            "window": m.kv_window or t.chunk_len}


def bound(mapping, kernel, *extra):
    """mapping(kernel, *inputs, *extra) as a function of the inputs, or None without a kernel."""
    if kernel is None:
        return None
    return lambda *inputs: mapping(kernel, *inputs, *extra)


def _randn(gen, *shape, device, dtype=torch.float32, grad=True):
    t = torch.randn(*shape, generator=gen, device=device).to(dtype)
    return t.requires_grad_() if grad else t


def _decay(gen, b, l, h, device):
    """dt log-uniform in [1e-3, 0.1] (the mixer's initial range) and A in -[1, 16]."""
    dt = torch.exp(torch.rand(b, l, h, generator=gen, device=device) * math.log(100) + math.log(1e-3))
    A = -(1 + 15 * torch.rand(h, generator=gen, device=device))
    return dt, A


def scan_cases(d: dict, device, dtype, kernels: dict, seed: int = 0) -> list[Case]:
    """The SSD scan at the mixer's call: x, B, C in `dtype`, dt, A, D and the initial state in
    float32 (float64 when dtype is). Two cases: dt given after softplus (against mamba-ssm and fla),
    and raw dt with its bias (against mamba-ssm's in-kernel softplus)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    b, l, h, p = d["lanes"], d["tokens"], d["heads"], d["head_dim"]
    g, n, Q = d["groups"], d["d_state"], d["ssd_chunk"]
    fdt = torch.float64 if dtype == torch.float64 else torch.float32
    x = _randn(gen, b, l, h, p, device=device, dtype=dtype)
    B, C = (_randn(gen, b, l, g, n, device=device, dtype=dtype) for _ in range(2))
    dt, A = _decay(gen, b, l, h, device)
    dt, A = dt.to(fdt).requires_grad_(), A.to(fdt).requires_grad_()
    D = _randn(gen, h, device=device, dtype=fdt)
    s0 = _randn(gen, b, h, p, n, device=device, dtype=fdt)
    grads = [_randn(gen, b, l, h, p, device=device, dtype=dtype, grad=False),
             _randn(gen, b, h, p, n, device=device, dtype=fdt, grad=False)]
    mamba, mamba_info = kernels["mamba_ssm"]
    gla, gla_info = kernels["fla"]
    path = "elephant ssd_scan (" + ("Triton" if ssd.takes_triton(x, B, Q) else "PyTorch") + ")"
    plain = Case("ssd scan", ("x", "dt", "A", "B", "C", "D", "s0"), [x, dt, A, B, C, D, s0], grads,
                 (path, lambda *a: own_scan(*a, Q)),
                 [("mamba_chunk_scan_combined", "mamba_ssm", bound(mamba_mapped, mamba, Q), mamba_info),
                  ("chunk_simple_gla", "fla", bound(gla_mapped, gla, Q), gla_info)])
    # a raw dt and a bias per head whose softplus spreads around the same range
    mean_dt = dt.detach().mean((0, 1))                                          # (h,)
    dt_bias = (mean_dt + torch.log(-torch.expm1(-mean_dt))).requires_grad_()    # softplus^-1
    dt_raw = (0.5 * torch.randn(b, l, h, generator=gen, device=device)).to(fdt).requires_grad_()
    soft = Case("ssd scan, dt softplus", ("x", "dt_raw", "dt_bias", "A", "B", "C", "D", "s0"),
                [x, dt_raw, dt_bias, A, B, C, D, s0], grads,
                (path + " after softplus", lambda *a: own_scan_softplus(*a, Q)),
                [("mamba_chunk_scan_combined dt_softplus", "mamba_ssm",
                  bound(mamba_softplus_mapped, mamba, Q), mamba_info)])
    return [plain, soft]


def conv_case(d: dict, device, dtype, kernels: dict, seed: int = 1) -> Case:
    """The Mamba conv over [x | B | C] with its SiLU: inputs and carried state in `dtype`, the conv's
    weight and bias in float32 (float64 when dtype is), as the mixer holds them."""
    gen = torch.Generator(device=device).manual_seed(seed)
    b, l, c, k = d["lanes"], d["tokens"], d["conv_dim"], d["d_conv"]
    wdt = torch.float64 if dtype == torch.float64 else torch.float32
    x = _randn(gen, b, l, c, device=device, dtype=dtype)
    state = _randn(gen, b, c, k - 1, device=device, dtype=dtype)
    weight = (_randn(gen, c, 1, k, device=device, dtype=wdt, grad=False) / k).requires_grad_()
    bias = _randn(gen, c, device=device, dtype=wdt)
    grads = [_randn(gen, b, l, c, device=device, dtype=dtype, grad=False),
             _randn(gen, b, c, k - 1, device=device, dtype=dtype, grad=False)]
    fn, info = kernels["causal_conv1d"]
    path = "elephant short_conv (" + ("Triton" if conv_triton.supported(x) else "PyTorch") + ")"
    return Case("causal depthwise conv", ("x", "conv_state", "weight", "bias"), [x, state, weight, bias],
                grads, (path, own_conv),
                [("causal_conv1d_fn", "causal_conv1d", bound(causal_conv1d_mapped, fn), info)])


def attention_case(d: dict, device, dtype, kernels: dict, seed: int = 2) -> Case:
    """Attention over [window | chunk], causal aligned to the bottom right, every window slot valid
    (a lane in the middle of a document): q, k, v (B, S, H, hd) with gradients, the window's keys and
    values (B, W, H, hd) without (the layer detaches them). No memory or kept tokens."""
    gen = torch.Generator(device=device).manual_seed(seed)
    b, s, w, h, hd = d["lanes"], d["tokens"], d["window"], d["attn_heads"], d["attn_head_dim"]
    q, k, v = (_randn(gen, b, s, h, hd, device=device, dtype=dtype) for _ in range(3))
    ck, cv = (_randn(gen, b, w, h, hd, device=device, dtype=dtype, grad=False) for _ in range(2))
    valid = torch.ones(b, w, dtype=torch.bool, device=device)
    grads = [_randn(gen, b, s, h, hd, device=device, dtype=dtype, grad=False)]
    fa4, fa4_info = kernels["flash_attn.cute"]
    kernel = "FlashAttention-2 varlen" if varlen_supported(q, v) else "masked SDPA"
    path = f"elephant attend ({kernel})"
    return Case("attention [window | chunk]", ("q", "k", "v", "ck", "cv"), [q, k, v, ck, cv], grads,
                (path, lambda *a: own_attention(*a, valid)),
                [("torch sdpa, flash backend", "torch", sdpa_mapped, {"version": torch.__version__}),
                 ("flash_attn_func", "flash_attn.cute", bound(fa4_mapped, fa4), fa4_info)])


def cases_for(ops, d: dict, device, dtype, kernels: dict) -> list[Case]:
    out = []
    if "scan" in ops:
        out += scan_cases(d, device, dtype, kernels)
    if "conv" in ops:
        out.append(conv_case(d, device, dtype, kernels))
    if "attention" in ops:
        out.append(attention_case(d, device, dtype, kernels))
    return out


# ------------------------------------------------------------------------- checks and times
def _stats(got, want, tol: float) -> dict:
    if got is None or want is None:
        return {"close": got is None and want is None, "missing": "field" if got is None else "own"}
    if got.shape != want.shape:
        return {"close": False, "shape": f"{tuple(got.shape)} against {tuple(want.shape)}"}
    a, b = got.detach().double(), want.detach().double()
    err = (a - b).abs()
    scale = float(b.abs().max()) if b.numel() else 0.0
    return {"max_abs_err": float(f"{float(err.max()):.3g}") if b.numel() else 0.0,
            "max_abs_own": float(f"{scale:.3g}"),
            "rel_err": float(f"{float((a - b).norm() / b.norm().clamp_min(1e-30)):.3g}"),
            "close": bool((err <= tol * (b.abs() + scale)).all())}


def input_grads(outs: tuple, case: Case) -> tuple:
    """The gradients of every input of `case` that takes one, from its output gradients (None for
    an input the outputs do not depend on)."""
    pairs = [(o, g) for o, g in zip(outs, case.grads) if o.requires_grad]
    tensors = [t for t in case.inputs if t.requires_grad]
    return torch.autograd.grad([o for o, _ in pairs], tensors, [g for _, g in pairs], allow_unused=True)


def compare(fn, own, case: Case, tol: float) -> dict:
    """The field call's outputs and input gradients against the project's, tensor by tensor (outputs
    "out0", "out1", ..., gradients "d<input>"): max and relative error, and whether within tol."""
    wanted = [(n, t) for n, t in zip(case.names, case.inputs) if t.requires_grad]

    def run(f):
        outs = tuple(f(*case.inputs))
        return outs, input_grads(outs, case)
    want_out, want_grad = run(own)
    got_out, got_grad = run(fn)
    forward = {f"out{i}": _stats(g, w, tol) for i, (g, w) in enumerate(zip(got_out, want_out))}
    if len(got_out) != len(want_out):
        forward["outputs"] = {"close": False, "count": f"{len(got_out)} against {len(want_out)}"}
    backward = {f"d{n}": _stats(g, w, tol) for (n, _), g, w in zip(wanted, got_grad, want_grad)}
    return {"forward_matches": all(s["close"] for s in forward.values()),
            "backward_matches": all(s["close"] for s in backward.values()),
            "forward": forward, "backward": backward}


def timings(fn, case: Case, device, iters: int, warmup: int, graph: bool, backward: bool) -> dict:
    """Median ms of the forward (no autograd graph) and of forward + backward (the gradients of
    every input that takes one), by CUDA events on GPU; with `graph`, of CUDA-graph replays where
    the call captures (else eagerly, the capture's error noted)."""
    def fwd():
        with torch.no_grad():
            fn(*case.inputs)

    def fwd_bwd():
        input_grads(tuple(fn(*case.inputs)), case)

    out = {}
    for kind, step in (("fwd", fwd), ("fwd_bwd", fwd_bwd)):
        if kind == "fwd_bwd" and not backward:
            out["fwd_bwd_ms"] = "not timed: the gradients differ from the project's"
            continue
        try:
            out[f"{kind}_ms"] = round(median_ms(step, device, iters, warmup, graph=graph), 4)
            out[f"{kind}_timed"] = "cuda graph" if graph else "eager"
        except Exception as e:  # noqa: BLE001 (a call that does not capture: its eager time)
            if not graph:
                raise
            out[f"{kind}_graph_error"] = one_line(e)
            out[f"{kind}_ms"] = round(median_ms(step, device, iters, warmup), 4)
            out[f"{kind}_timed"] = "eager"
    return out


def run_case(case: Case, recipe: str, device, tol: float, iters: int, warmup: int,
             graph: bool) -> list[dict]:
    """Rows for one case: the project's call timed, then each field call checked against it and
    timed where it matched (forward alone where only the forward matched)."""
    rows = []
    own_path, own = case.own
    row = {"recipe": recipe, "op": case.op, "path": own_path, "library": "elephant"}
    try:
        row.update(timings(own, case, device, iters, warmup, graph, backward=True))
    except Exception as e:  # noqa: BLE001 (recorded; the field's rows still come)
        row["error"] = one_line(e)
    rows.append(row)
    for path, library, fn, info in case.field:
        frow = {"recipe": recipe, "op": case.op, "path": path, "library": library}
        if fn is None:
            frow["not_installed"] = info.get("not_installed", "not importable")
            rows.append(frow)
            continue
        try:
            check = compare(fn, own, case, tol)
            frow["matches"] = check["forward_matches"] and check["backward_matches"]
            frow["check"] = check
            if not check["forward_matches"]:
                frow["not_timed"] = "its outputs differ from the project's beyond the tolerance"
            else:
                frow.update(timings(fn, case, device, iters, warmup, graph, check["backward_matches"]))
                for kind in ("fwd_ms", "fwd_bwd_ms"):
                    if isinstance(frow.get(kind), float) and isinstance(row.get(kind), float):
                        frow[kind.replace("_ms", "_vs_own")] = round(frow[kind] / row[kind], 3)
        except Exception as e:  # noqa: BLE001
            frow["error"] = one_line(e)
        rows.append(frow)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rows


def summary_line(row: dict) -> str:
    def ms(kind):
        v = row.get(f"{kind}_ms")
        return f"{v:8.3f}" if isinstance(v, float) else "       -"
    if "not_installed" in row:
        status = "not installed: " + row["not_installed"]
    elif "error" in row:
        status = "error: " + row["error"]
    elif "not_timed" in row:
        status = "does not match: " + row["not_timed"]
    else:
        status = "" if row.get("matches", True) else "forward only: its gradients differ"
    ratio = f" ({row['fwd_vs_own']}x / {row.get('fwd_bwd_vs_own', '-')}x own)" if "fwd_vs_own" in row else ""
    return (f"{row['recipe']:13s} {row['op']:26s} {row['path']:44s} fwd {ms('fwd')} "
            f"fwd+bwd {ms('fwd_bwd')} ms{ratio} {status}")


# ------------------------------------------------------------------------------- the smoke
SMOKE_DIMS = {"lanes": 2, "tokens": 20, "d_model": 24, "heads": 4, "head_dim": 6, "d_state": 4,
              "groups": 2, "ssd_chunk": 8, "conv_dim": 10, "d_conv": 4, "attn_heads": 2,
              "attn_head_dim": 4, "window": 8}


def reference_kernels() -> dict:
    """The references above in the field kernels' places (each with the library's call signature)."""
    info = {"version": "reference (CPU smoke)"}
    return {"mamba_ssm": (mamba_chunk_scan_reference, info), "fla": (simple_gla_reference, info),
            "causal_conv1d": (causal_conv1d_reference, info),
            "flash_attn.cute": (flash_attn_reference, info)}


def smoke_checks(ops=OPS, tol: float = 1e-9) -> list[dict]:
    """Every mapping on the CPU in float64 at tiny shapes (SMOKE_DIMS: 2 B/C groups of 2 heads,
    head_dim != d_state, a length not a multiple of the chunk), the references standing in for the
    field kernels: one row per field call with its check against the project's entry point."""
    rows = []
    device = torch.device("cpu")
    for case in cases_for(ops, SMOKE_DIMS, device, torch.float64, reference_kernels()):
        for path, library, fn, _ in case.field:
            rows.append({"op": case.op, "path": path, "library": library,
                         **compare(fn, case.own[1], case, tol)})
    return rows


# ------------------------------------------------------------------------------- the command
def field_arguments(ap) -> None:
    ap.add_argument("--cpu-smoke", action="store_true",
                    help="the argument mappings checked on the CPU against references (no timing)")
    ap.add_argument("--recipes", default=",".join(RECIPES), help=f"of {', '.join(RECIPES)}")
    ap.add_argument("--ops", default=",".join(OPS), help=f"of {', '.join(OPS)}")
    ap.add_argument("--lanes", type=int, default=None, help="the lanes of every recipe (default its own)")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--graph", action="store_true", help="time CUDA-graph replays (no host launches)")
    ap.add_argument("--tol", type=float, default=TOL, help="the bf16 match tolerance (see TOL)")
    ap.add_argument("--out", default=None, help="result file (default benchmarks/results/"
                                                "field_kernels_<gpu>.json)")


def field(args) -> int:
    """The project's kernels beside the field's at the recipes' shapes, bf16, forward and forward +
    backward (medians of --iters calls after --warmup, CUDA events), each field kernel checked first.

        python benchmarks/kernels.py field              # CUDA: benchmarks/results/field_kernels_<gpu>.json
        python benchmarks/kernels.py field --cpu-smoke  # the argument mappings, on the CPU

    Shapes: one chunk step of configs/wt103-70m.toml (32 lanes x 512 tokens; Mamba-2: d_inner
    1024, 16 heads of 64, d_state 64, one B/C group, chunk 64, conv over 1,152 channels of width 4;
    attention: 8 heads of 64 over [window 512 | chunk 512]) and of configs/fineweb-124m.toml (64
    lanes x 1,024: 24 heads, 1,664 conv channels, 12 attention heads over [1,024 | 1,024]).
    --lanes changes the lanes of both. Ops (--ops):
      scan       the SSD scan as the mixer calls it (ssd.ssd_scan, with D and the carried state in,
                 the final state out) against mamba-ssm's mamba_chunk_scan_combined (the same
                 arguments) and fla's chunk_simple_gla (g = dt A, v = dt x, k = B, q = C, scale 1,
                 D x added after); and from the raw dt, softplus(dt + dt_bias) in PyTorch before the
                 project's scan against mamba-ssm's softplus inside its kernel
      conv       the conv and SiLU (mamba.short_conv) against causal-conv1d's causal_conv1d_fn
      attention  the layer's call (attention.attend, every window slot valid: FlashAttention-2's
                 varlen kernel) against torch SDPA's flash backend (a bottom-right causal mask) and
                 FlashAttention-4 (flash_attn.cute)
    A field call's time includes its mapping's reshapes and elementwise work (fla's v = dt x, its
    keys and queries expanded to the heads, D x). Before it is timed, its outputs and every input's
    gradient are compared with the project's (max and relative error; a tensor matches where
    |field - own| <= --tol * (|own| + max |own|)): one that does not match is reported, not timed
    (forward only if only its gradients differ). A library that does not import is reported as not
    installed with its one-line reason. --cpu-smoke runs `smoke_checks` (float64, the references in
    the kernels' places) and exits non-zero if a mapping is wrong."""
    ops = [o for o in args.ops.split(",") if o]
    bad = [o for o in ops if o not in OPS]
    if bad:
        raise SystemExit(f"kernels.py field: --ops: expected some of {', '.join(OPS)}, got {', '.join(bad)}")
    if args.cpu_smoke:
        rows = smoke_checks(ops)
        libraries = {name: import_kernel(name)[1] for name in LIBRARIES}
        for row in rows:
            ok = row["forward_matches"] and row["backward_matches"]
            print(f"{row['op']:26s} {row['path']:40s} {'matches' if ok else 'DIFFERS'}", flush=True)
        report = {**environment("cpu"), "smoke": "float64 references in the field kernels' places",
                  "libraries": libraries, "dims": SMOKE_DIMS, "rows": rows}
        path = write_report(report, "field_kernels", args.out, True, "cpu")
        print("wrote", path)
        wrong = [r["path"] for r in rows if not (r["forward_matches"] and r["backward_matches"])]
        if wrong:
            print("mappings that do not hold:", ", ".join(wrong), file=sys.stderr)
            return 1
        return 0
    if not torch.cuda.is_available():
        raise SystemExit("kernels.py field: no CUDA device; use --cpu-smoke to check the mappings on the CPU")
    device = torch.device("cuda")
    kernels = {name: import_kernel(name) for name in LIBRARIES}
    for name, (_, info) in kernels.items():
        print(f"{name:16s} {info.get('version') or 'not installed: ' + info['not_installed']}", flush=True)
    rows, dims, t0 = [], {}, time.perf_counter()
    for recipe in [r for r in args.recipes.split(",") if r]:
        d = recipe_dims(recipe, args.lanes)
        dims[recipe] = d
        for case in cases_for(ops, d, device, torch.bfloat16, kernels):
            # where the time goes when a call is cut short (the first case's compiles and the field
            # kernels' autotuning took over 100 s on an H100 and printed nothing: 2026-12-07)
            print(f"{recipe} {case.op}: checking and timing ({time.perf_counter() - t0:.0f} s in)",
                  flush=True)
            for row in run_case(case, recipe, device, args.tol, args.iters, args.warmup, args.graph):
                rows.append(row)
                print(summary_line(row), flush=True)
    env = environment(device)
    report = {**env, "libraries": {name: info for name, (_, info) in kernels.items()},
              "dtype": "bfloat16 (dt, A, D, states, conv weights in float32)", "tolerance": args.tol,
              "iters": args.iters, "warmup": args.warmup, "dims": dims, "rows": rows}
    path = write_report(report, "field_kernels", args.out, False, env["device"])
    print("wrote", path, flush=True)
    return 0
