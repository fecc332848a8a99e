"""The lm-evaluation-harness adapter (elephant.lm_eval) on a tiny random model on the CPU, through
the harness's own API: each kind of request equals the project's own computation of it, and the
local Wikitext-103 task's bits per byte equals eval.py's on the same documents.

The harness is imported once for the file (its import is slow). Its CLI indexes its ~14k built-in
task files at start (12-26 s here), so the CLI test leaves them out of the index: the only tasks
it can find are the ones elephant.lm_eval adds to the include path.
"""
import ast
import glob
import json
import math
from pathlib import Path

import pytest
import torch

import eval as eval_cli
from data_packing import TokenizedCorpus
from data_packing.tokenizer import ByteTokenizer
from elephant.config import ModelConfig
from elephant.evaluate import evaluate
from elephant.generate import generate
from elephant.hub import save_pretrained
from elephant.model import ElephantLM
from test_imports import import_graph, module_files

# the GPU machines' image has no lm_eval (nothing can be installed there) and their suite runs only
# `gpu` tests, none of which are here; wherever `make test` runs, the [dev] extra installs it
pytest.importorskip("lm_eval")
import datasets  # noqa: E402  (the harness's own dependency)
from lm_eval import simple_evaluate  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402

from elephant import lm_eval as adapter  # noqa: E402

CHUNK = 32   # the export's training chunk length: every text below spans several chunks
EOT = ByteTokenizer.eot_id


@pytest.fixture(scope="module")
def export(tmp_path_factory):
    """A tiny random model with memory and a window (carried state matters), bytes tokenizer."""
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=257, d_model=32, n_heads=2, layers="MA", d_mlp=64, d_state=8,
                      mamba_head_dim=16, expand=2, ssd_chunk=8, n_mem=2, kv_window=16)
    return save_pretrained(ElephantLM(cfg), tmp_path_factory.mktemp("lm_eval") / "tiny",
                           tokenizer=ByteTokenizer(),
                           train_config={"train": {"chunk_len": CHUNK},
                                         "data": {"tokenizer": "bytes", "append_eot": True}})


def task(name: str, rows: list[dict], **config) -> dict:
    """An inline harness task over `rows` (its test split)."""
    return dict(task=name, custom_dataset=lambda **_: {"test": datasets.Dataset.from_list(rows)},
                test_split="test", **config)


TEXTS = ["The elephant remembers every chunk it has read, " * 4, "x", "   ",
         "A shorter document, still over one chunk long."]
PAIRS = [("The elephant " * 6 + "never", " forgets."), ("A", "bc"), ("", "xyz")]


@torch.no_grad()
def streamed_logprob(model, context: list[int], continuation: list[int]) -> tuple[float, bool]:
    """One request the direct way: context + continuation chunk by chunk with carried state; the
    continuation's summed log-probability and whether each of its tokens is the argmax."""
    seq = torch.tensor([context + continuation])
    logits, state = [], None
    for c in range(0, seq.shape[1] - 1, CHUNK):
        out, state = model(seq[:, c:c + CHUNK], state)
        logits.append(out)
    logp = torch.cat(logits, 1)[0, :seq.shape[1] - 1].log_softmax(-1)
    at = range(len(context) - 1, seq.shape[1] - 1)
    return (sum(logp[t, seq[0, t + 1]].item() for t in at),
            all(logp[t, :EOT + 1].argmax().item() == seq[0, t + 1].item() for t in at))


@pytest.fixture(scope="module")
def harness(export):
    """One simple_evaluate over three inline tasks (rolling, loglikelihood, generate_until) with
    the adapter in float64, batching two lanes: (the adapter, each task's responses in order,
    the generation requests)."""
    lm = adapter.ElephantHarnessLM(pretrained=str(export), device="cpu", lanes=2, dtype="float64")
    model = lm.model
    # a continuation the model takes greedily: the first short context whose two greedy next
    # bytes are printable ASCII (one text, one byte each)
    greedy = None
    for context in ("The", "An", "el", "Wiki", "a b", "xyz"):
        nxt = generate(model, list(context.encode()), 2, temperature=0, chunk_len=CHUNK)
        if all(32 <= t < 127 for t in nxt):
            greedy = (context, bytes(nxt).decode())
            break
    assert greedy is not None, "no context of the list has a greedy ASCII continuation"
    pairs = PAIRS + [greedy]
    # generation: a stop string that the first prompt's greedy text meets early, so its lane
    # stops before max_gen_toks; the second prompt may run to the end
    prompts = ["Once upon a time", "The elephant "]
    first = ByteTokenizer().decode(generate(model, list(prompts[0].encode()), 48, temperature=0,
                                            chunk_len=CHUNK))
    j = next(i for i in range(4, len(first) - 1) if first[i:i + 2].isprintable()
             and "\ufffd" not in first[i:i + 2])
    settings = {"until": [first[j:j + 2]], "max_gen_toks": 48}
    tasks = [task("rolling", [{"page": t} for t in TEXTS], output_type="loglikelihood_rolling",
                  doc_to_text="", doc_to_target="{{page}}", metric_list=[{"metric": "bits_per_byte"}]),
             task("pairs", [{"context": c, "continuation": x} for c, x in pairs],
                  output_type="loglikelihood", doc_to_text="{{context}}",
                  doc_to_target="{{continuation}}", target_delimiter="",
                  metric_list=[{"metric": "acc"}]),
             task("generation", [{"context": p} for p in prompts], output_type="generate_until",
                  doc_to_text="{{context}}", doc_to_target="", generation_kwargs=settings,
                  metric_list=[{"metric": "exact_match"}])]
    result = simple_evaluate(model=lm, tasks=tasks, task_manager=TaskManager(include_defaults=False),
                             log_samples=True)
    responses = {name: [s["resps"][0][0] for s in sorted(samples, key=lambda s: s["doc_id"])]
                 for name, samples in result["samples"].items()}
    return lm, responses, pairs, prompts, settings


def test_rolling_loglikelihood_equals_streaming_evaluation(harness):
    lm, responses, *_ = harness
    assert len(responses["rolling"]) == len(TEXTS)
    for text, got in zip(TEXTS, responses["rolling"]):
        # the project's own streaming evaluation of the one document, as eval.py's corpus holds it:
        # its bytes and the end-of-text token (none for a blank text, which it skips)
        tokens = list(text.encode()) + [EOT] if text.strip() else []
        if len(tokens) < 2:
            assert got == 0.0
            continue
        want = evaluate(lm.model, TokenizedCorpus.from_documents([tokens]), lanes=1,
                        chunk_len=CHUNK, device="cpu")
        assert want["tokens"] == len(text.encode())   # every byte but the first, and the EOT
        assert math.isclose(-got, want["nll_sum"], rel_tol=1e-10)


def test_loglikelihood_equals_direct_computation(harness):
    lm, responses, pairs, *_ = harness
    for (context, continuation), (got, got_greedy) in zip(pairs, responses["pairs"]):
        ctx = list(context.encode()) or [EOT]   # an empty context: the end-of-text token
        want, want_greedy = streamed_logprob(lm.model, ctx, list(continuation.encode()))
        assert math.isclose(got, want, rel_tol=1e-10), (context, continuation)
        assert got_greedy == want_greedy
    assert responses["pairs"][-1][1] is True          # the model's own greedy continuation


def test_generate_until_equals_greedy_generate_cut_at_stop(harness):
    lm, responses, _, prompts, settings = harness
    stop = settings["until"][0]
    for prompt, got in zip(prompts, responses["generation"]):
        ids = generate(lm.model, list(prompt.encode()), settings["max_gen_toks"], temperature=0,
                       chunk_len=CHUNK, eos_id=EOT, vocab_size=EOT + 1)
        text = ByteTokenizer().decode([t for t in ids if t != EOT])
        assert got == text.split(stop)[0]
        if prompt == prompts[0]:   # the stop string was met: the text is cut before it
            assert stop in text and stop not in got


@pytest.fixture
def builtin_tasks_left_out(monkeypatch):
    """The harness's task index without its built-in tasks (speed; see the module docstring)."""
    from lm_eval.tasks.manager import TaskManager as Manager
    init = Manager.__init__

    def without_builtin(self, *args, **kwargs):
        init(self, *args, **{**kwargs, "include_defaults": False})
    monkeypatch.setattr(Manager, "__init__", without_builtin)


def test_wikitext103_local_bits_per_byte_equals_eval_py(export, tmp_path, shared_data,
                                                        builtin_tasks_left_out, monkeypatch):
    monkeypatch.setenv("ELEPHANT_WIKITEXT103", str(shared_data / "wikitext-103-raw"))
    docs, chunk = 2, 256   # 30K bytes; chunks longer than the export's, for speed
    assert eval_cli.main(["--checkpoint", str(export), "--data", "wikitext-103", "--split", "test",
                          f"data.path={shared_data / 'wikitext-103-raw'}",
                          f"data.cache_dir={tmp_path / 'cache'}", "--max-docs", str(docs),
                          "--lanes", "2", "--chunk-len", str(chunk), "--device", "cpu", "--no-progress",
                          "--json", str(tmp_path / "eval.json")]) == 0
    ours = json.loads((tmp_path / "eval.json").read_text())["elephant"]
    assert adapter.main(["--model", "elephant", "--model_args", f"pretrained={export},lanes=2,chunk_len={chunk}",
                         "--device", "cpu", "--tasks", "wikitext103_local", "--limit", str(docs),
                         "--output_path", str(tmp_path / "harness.json")]) == 0
    [written] = glob.glob(str(tmp_path / "harness_*.json"))
    harness = json.loads(Path(written).read_text())["results"]["wikitext103_local"]
    assert ours["documents"] == docs
    assert abs(harness["bits_per_byte,none"] - ours["bits_per_byte"]) < 1e-3   # the contract
    # ... and closer: the same tokens streamed by the same code (one token more or less would
    # move the bits per byte by ~3e-4 here, inside the contract's 1e-3)
    assert math.isclose(harness["bits_per_byte,none"], ours["bits_per_byte"], rel_tol=1e-9)
    assert math.isclose(harness["word_perplexity,none"], ours["word_perplexity"], rel_tol=1e-9)
    assert math.isclose(harness["byte_perplexity,none"], 2 ** ours["bits_per_byte"], rel_tol=1e-9)


def test_bad_model_argument_is_a_one_line_error(export, builtin_tasks_left_out, capsys):
    code = adapter.main(["--model", "elephant", "--model_args",
                         f"pretrained={export},chunk_length=64", "--tasks", "wikitext103_local"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert err[-1].startswith("error: model_args: unknown chunk_length; accepted: pretrained")


def test_only_the_adapter_imports_the_harness():
    """`import elephant` leaves lm_eval (an optional extra) unimported: elephant/lm_eval.py is the
    one module that imports it, and no module imports that one (read from the source, as
    test_imports reads the import graph: a fresh interpreter's `import elephant` takes 7 s)."""
    graph = import_graph()
    assert not sorted(m for m, deps in graph.items() if "elephant.lm_eval" in deps)
    users = set()
    for name, path in module_files().items():
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module] if isinstance(node, ast.ImportFrom) and not node.level else [])
            if any(n.split(".")[0] == "lm_eval" for n in names if n):
                users.add(name)
    assert users == {"elephant.lm_eval"}
