"""Data for elephant: sources of whole documents, tokenizers, tokenized corpus caches, chunk batches.

    corpus = get_corpus("wikitext-103", "valid", "EleutherAI/pythia-70m-deduped", "cache", path=...)
    for batch in RollingChunkBatcher(corpus, lanes=32, chunk_len=512, seed=0):
        ...

Independent of `elephant` (never imports it). Names are imported on first use, so
`python -m data_packing.prepare` starts without torch (which only the batcher needs).
"""
from data_packing.errors import DataError

_LAZY = {
    "Source": "sources", "open_source": "sources",
    "load_tokenizer": "tokenizer", "ByteTokenizer": "tokenizer", "HFTokenizer": "tokenizer",
    "TokenizedCorpus": "tokenized", "build_corpus": "prepare", "get_corpus": "prepare",
    "RollingChunkBatcher": "batcher", "Batch": "batcher",
}
__all__ = ["DataError", *_LAZY]


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f"data_packing.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'data_packing' has no attribute {name!r}")
