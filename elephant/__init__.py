"""elephant: long-context recurrent-memory language models trained chunk by chunk (DESIGN.md).

Nothing is imported here, so that importing a light module (elephant.config, for the CLIs'
--help) does not import torch. `from elephant import generate` gives the module
elephant/generate.py, which is callable as its function: generate(model, prompt_ids, ...).
"""
