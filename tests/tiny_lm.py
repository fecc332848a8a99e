"""The small fp64 models that the model-level tests build (imported by the test files)."""
import torch

from elephant.config import ModelConfig
from elephant.model import ElephantLM

BASE = dict(vocab_size=97, d_model=32, n_heads=4, layers="MAMA", d_mlp=48, d_state=16,
            mamba_head_dim=16, expand=2, d_conv=4, ssd_chunk=8, n_mem=0, kv_window=0)


def tiny_lm(seed: int = 0, **kw) -> ElephantLM:
    """A fresh ElephantLM of BASE updated by `kw`, seeded, in float64 and eval mode."""
    torch.manual_seed(seed)
    return ElephantLM(ModelConfig(**(BASE | kw))).double().eval()
