"""The task wikitext103_local: Wikitext-103's test split read from a local copy, scored as the
harness's `wikitext` task scores its documents (rolling log-likelihood of each whole article;
word perplexity, byte perplexity and bits per byte).

The design choice: the documents are eval.py's, not the harness's. The articles are rebuilt from
the raw file's lines by data_packing's Wikitext source (`open_source("wikitext-103", "test",
path)`, i.e. `sources.wikitext_articles`), in the file's order, with the raw text untouched (no
detokenization, unlike the harness's `wikitext` task over EleutherAI/wikitext_document_level), so
that `--limit N` scores the documents `eval.py --data wikitext-103 --split test --max-docs N`
scores and the two bits per byte agree. Words are counted as eval.py counts them (str.split():
whitespace-separated, no empty strings; the harness's `wikitext` splits on a regex and counts the
empty strings at a text's two ends as words too); bytes are the UTF-8 bytes of the text.

The local copy: the task option `wikitext103_path` (`--metadata wikitext103_path=DIR`, a folder
with wiki.test.raw or the file itself), else the environment variable ELEPHANT_WIKITEXT103, else
`shared/data/wikitext-103-raw` beside the repository holding this file.
"""
import os
from pathlib import Path

ENV = "ELEPHANT_WIKITEXT103"
OPTION = "wikitext103_path"
# <repo>/elephant/lm_eval_tasks/wikitext103_local/this file -> <repo>/../shared/data/...
DEFAULT = Path(__file__).resolve().parents[3].parent / "shared" / "data" / "wikitext-103-raw"


def local_path(options: dict | None = None) -> Path:
    """Where the raw Wikitext-103 copy is: the task option, the environment, the default."""
    given = (options or {}).get(OPTION) or os.environ.get(ENV)
    return Path(given).expanduser() if given else DEFAULT


def articles(path) -> list[str]:
    """The test split's articles, as eval.py's corpus holds them (blank ones skipped)."""
    from data_packing.sources import open_source

    return [doc for doc in open_source("wikitext-103", "test", path) if doc.strip()]


def load(**options):
    """The harness's `custom_dataset`: {"test": a Dataset of {"page": article}}. `options` are the
    task's metadata (the model arguments and --metadata among them)."""
    import datasets

    from data_packing import DataError

    path = local_path(options)
    if not path.exists():
        raise DataError(f"wikitext103_local: {path} does not exist; give the folder holding "
                        f"wiki.test.raw with --metadata {OPTION}=DIR or ${ENV}")
    return {"test": datasets.Dataset.from_dict({"page": articles(path)})}


def doc_to_target(doc: dict) -> str:
    return doc["page"]


def process_results(doc: dict, results) -> dict:
    (loglikelihood,) = results
    text = doc["page"]
    words, n_bytes = len(text.split()), len(text.encode("utf-8"))
    return {"word_perplexity": (loglikelihood, words), "byte_perplexity": (loglikelihood, n_bytes),
            "bits_per_byte": (loglikelihood, n_bytes)}
