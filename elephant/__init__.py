"""elephant: long-context recurrent-memory language models trained chunk by chunk (DESIGN.md)."""
from .generate import generate  # noqa: F401  elephant.generate(model, prompt_ids, ...)
