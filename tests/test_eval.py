"""Streaming evaluation (elephant.evaluate) and eval.py: whole documents, equal to one pass over
each document, and one-line errors for a missing checkpoint, a tokenizer mismatch, a bad split."""
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

import eval as eval_cli
import train as train_cli
from data_packing import TokenizedCorpus
from elephant.config import ModelConfig
from elephant.evaluate import evaluate
from elephant.model import ElephantLM

ROOT = Path(__file__).resolve().parents[1]


def corpus_of(lengths, vocab=61, seed=0) -> TokenizedCorpus:
    rng = np.random.default_rng(seed)
    docs = [rng.integers(0, vocab, n) for n in lengths]
    c = TokenizedCorpus.from_documents(docs)
    c.doc_bytes = np.array([3 * n for n in lengths])
    c.doc_words = np.array([n // 2 for n in lengths])
    return c


def mama_model(n_mem: int = 0, kv_window: int = 128, **extra) -> ElephantLM:
    """A tiny float64 MAMA model (seed 0), by default memory off and its window (128) covering
    every test document; `extra`: more ModelConfig fields."""
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=61, d_model=32, n_heads=4, layers="MAMA", d_mlp=48, d_state=16,
                      mamba_head_dim=16, ssd_chunk=8, n_mem=n_mem, kv_window=kv_window, **extra)
    return ElephantLM(cfg).double()


# two long documents (700 and 600 tokens) among short ones: they outlast a 16-lane batch
LONG_TAIL = [20, 30, 17, 5, 44, 700, 12, 3, 26, 61, 8, 19, 33, 7, 14, 22, 600, 40, 11]


def assert_same_sums(got: dict, want: dict, long: bool = False) -> None:
    """Two evaluations of the same documents: the same documents and tokens, and the same summed
    NLL overall, per document and by position (float64: to 1e-12), with `long` the long
    documents' curve too."""
    assert got["documents"] == want["documents"] and got["tokens"] == want["tokens"]
    for key in ("nll_sum", "per_doc_mean_loss"):
        assert math.isclose(got[key], want[key], rel_tol=1e-12), key
    for curve in ("position_buckets", "position_buckets_long") if long else ("position_buckets",):
        for label, bucket in want[curve].items():
            assert math.isclose(got[curve][label]["nll_sum"], bucket["nll_sum"], rel_tol=1e-12,
                                abs_tol=1e-12), (curve, label)


@torch.no_grad()
def one_pass_nll(model, corpus, i: int) -> float:
    """Document i's summed NLL (nats) in one forward pass: the reference streaming is held to."""
    doc = torch.as_tensor(corpus.doc(i).astype(np.int64))[None]
    logits, _ = model(doc[:, :-1])
    return torch.nn.functional.cross_entropy(logits[0], doc[0, 1:], reduction="sum").item()


@pytest.mark.parametrize("lanes, chunk_len", [(1, 7), (3, 16), (4, 64)])
def test_streaming_evaluation_equals_one_pass_per_document(lanes, chunk_len):
    model = mama_model()
    lengths = [50, 2, 113, 17, 64, 90]
    corpus = corpus_of(lengths)
    got = evaluate(model, corpus, lanes=lanes, chunk_len=chunk_len, device="cpu")
    per_doc_nll = [one_pass_nll(model, corpus, i) for i in range(len(corpus))]
    nll = sum(per_doc_nll)
    per_doc = [d / (n - 1) for d, n in zip(per_doc_nll, lengths)]
    tokens = sum(n - 1 for n in lengths)
    assert got["documents"] == len(lengths) and got["tokens"] == tokens
    assert math.isclose(got["nll_sum"], nll, rel_tol=1e-10)
    assert math.isclose(got["bits_per_byte"], nll / math.log(2) / sum(3 * n for n in lengths), rel_tol=1e-10)
    assert math.isclose(got["word_perplexity"], math.exp(nll / sum(n // 2 for n in lengths)), rel_tol=1e-10)
    assert math.isclose(got["per_doc_mean_loss"], sum(per_doc) / len(per_doc), rel_tol=1e-10)
    buckets = got["position_buckets"]
    assert sum(b["tokens"] for b in buckets.values()) == tokens


@pytest.mark.parametrize("pack", [False, True])
def test_the_long_document_curve_holds_those_documents_alone(pack):
    model = mama_model()
    lengths = [50, 2, 113, 17, 64, 90]
    corpus = corpus_of(lengths)
    got = evaluate(model, corpus, lanes=2, chunk_len=16, device="cpu", pack=pack, long_docs=60)
    long = [i for i, n in enumerate(lengths) if n > 60]
    nll = sum(one_pass_nll(model, corpus, i) for i in long)
    tokens = sum(lengths[i] - 1 for i in long)
    assert got["long_documents"] == 3
    (bucket,) = got["position_buckets_long"].values()          # every position is under 512
    assert bucket["tokens"] == tokens
    assert math.isclose(bucket["nll_sum"], nll, rel_tol=1e-10)
    assert got["position_buckets"]["0-512"]["tokens"] == sum(n - 1 for n in lengths)


@pytest.mark.parametrize("lanes, chunk_len", [(1, 7), (3, 16), (2, 64)])
def test_packed_evaluation_equals_unpacked_evaluation(lanes, chunk_len):
    # memory off, a window covering the documents: where a document sits in the rows does not matter
    model = mama_model()
    corpus = corpus_of([50, 2, 113, 17, 64, 90, 3, 9])
    unpacked = evaluate(model, corpus, lanes=lanes, chunk_len=chunk_len, device="cpu")
    packed = evaluate(model, corpus, lanes=lanes, chunk_len=chunk_len, device="cpu", pack=True)
    for key in ("documents", "tokens", "bytes", "words"):
        if key in unpacked:
            assert packed[key] == unpacked[key], key
    for key in ("nll_sum", "bits_per_byte", "word_perplexity", "per_doc_mean_loss"):
        assert math.isclose(packed[key], unpacked[key], rel_tol=1e-10), key
    for label, bucket in unpacked["position_buckets"].items():
        assert packed["position_buckets"][label]["tokens"] == bucket["tokens"]
        assert math.isclose(packed["position_buckets"][label]["nll_sum"], bucket["nll_sum"], rel_tol=1e-10)


def test_packed_evaluation_with_memory_scores_every_document_once():
    model = mama_model(n_mem=2, kv_window=16)
    corpus = corpus_of([50, 2, 113, 17, 64, 90, 3, 9])
    unpacked = evaluate(model, corpus, lanes=2, chunk_len=16, device="cpu")
    packed = evaluate(model, corpus, lanes=2, chunk_len=16, device="cpu", pack=True)
    assert packed["documents"] == unpacked["documents"] and packed["tokens"] == unpacked["tokens"]
    # chunk edges fall elsewhere in each document, so memory updates differ: close, not equal
    assert math.isclose(packed["nll_sum"], unpacked["nll_sum"], rel_tol=0.05)


def test_packed_evaluation_equals_the_boundary_path_on_every_chunk():
    # evaluate() computes the initial-memory prefix once and takes the plain path for chunks with
    # no document starting inside; the same stream with `starts` (and a fresh prefix) on every
    # chunk must give the same sums
    from data_packing import RollingChunkBatcher
    model = mama_model(n_mem=2, kv_window=16).eval()
    corpus = corpus_of([50, 2, 113, 17, 64, 90, 3, 9])
    packed = evaluate(model, corpus, lanes=2, chunk_len=16, device="cpu", pack=True, order="corpus")
    batcher = RollingChunkBatcher(corpus, lanes=2, chunk_len=16, seed=0, loop=False, shuffle=False,
                                  pack=True)
    state, total, plain = model.init_state(2), 0.0, 0
    with torch.no_grad():
        for b in batcher:
            plain += not b.inner_starts
            nll, state = model(b.tokens[:, :-1], state, b.starts[:, 0], targets=b.tokens[:, 1:],
                               loss_mask=b.loss_mask, reduction="none", starts=b.starts)
            total += float(nll.sum())
    assert plain > 0                                   # some chunks did take the plain path
    assert math.isclose(packed["nll_sum"], total, rel_tol=1e-12)


@pytest.mark.parametrize("n_mem, kv_window, lanes, chunk_len, extra",
                         [(2, 16, 2, 16, {}), (0, 8, 3, 7, {}), (4, 32, 1, 16, {}),
                          (2, 8, 2, 7, {"kv_keep": 5, "mem_rotary": "free"})])
def test_static_step_evaluation_equals_the_plain_path(n_mem, kv_window, lanes, chunk_len, extra):
    # cuda_graph=True (eval.py's default on GPUs) runs every chunk after the first on static
    # buffers (on the CPU without capture): the state written back in place after each chunk,
    # resets included, gives the plain path's sums exactly (float64): every document, every
    # position bucket; kept tokens and position-free memory included
    model = mama_model(n_mem=n_mem, kv_window=kv_window, **extra)
    corpus = corpus_of([50, 2, 113, 17, 64, 90, 3, 9])
    plain = evaluate(model, corpus, lanes=lanes, chunk_len=chunk_len, device="cpu")
    static = evaluate(model, corpus, lanes=lanes, chunk_len=chunk_len, device="cpu", cuda_graph=True)
    assert_same_sums(static, plain)


def spy_window_dtype(monkeypatch, model, force=None) -> list:
    """Patch model.init_state to record the kv_dtype each call asks for (the list returned) and,
    with `force`, to make the window in that dtype whatever was asked."""
    made, kept = [], type(model).init_state.__get__(model)

    def init_state(*args, **kwargs):
        made.append(kwargs.get("kv_dtype"))
        return kept(*args, **(kwargs | ({"kv_dtype": force} if force is not None else {})))
    monkeypatch.setattr(model, "init_state", init_state)
    return made


@pytest.mark.parametrize("cuda_graph", [False, True])
def test_evaluation_keeps_the_attention_window_in_the_autocast_dtype(monkeypatch, cuda_graph):
    # under bf16 autocast the keys and values are made in bf16, so the pass keeps its window in
    # bf16 (half a float32 window's bytes, read, written and carried every chunk): the same values,
    # so the same sums as a float32 window to the last bit
    model = mama_model(n_mem=2, kv_window=16).float()
    corpus = corpus_of([50, 2, 113, 17, 64])
    autocast = lambda: torch.autocast("cpu", dtype=torch.bfloat16)   # noqa: E731
    run = dict(lanes=2, chunk_len=16, device="cpu", cuda_graph=cuda_graph)
    made = spy_window_dtype(monkeypatch, model)
    got = evaluate(model, corpus, autocast=autocast, **run)
    plain = evaluate(model, corpus, **run)
    assert made == [torch.bfloat16, None] and abs(got["loss"] - plain["loss"]) < 0.05
    spy_window_dtype(monkeypatch, model, force=torch.float32)
    wide = evaluate(model, corpus, autocast=autocast, **run)
    assert got["nll_sum"] == wide["nll_sum"] and got["tokens"] == wide["tokens"]


def test_static_step_keeps_its_buffers():
    # the static step reads and writes the same state tensors chunk after chunk (what a captured
    # graph needs), and a step that would change a state dtype is refused by name
    from elephant.evaluate import StaticChunkStep
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=61, d_model=32, n_heads=4, layers="MA", d_mlp=48, d_state=16,
                      mamba_head_dim=16, ssd_chunk=8, n_mem=2, kv_window=16)
    model = ElephantLM(cfg).double().eval()
    tokens = torch.randint(0, 61, (2, 9))
    mask = torch.ones(2, 8, dtype=torch.bool)
    with torch.no_grad():
        _, state = model(tokens[:, :-1], None)
        step = StaticChunkStep(model, state, tokens, mask)
        before = {k: t.data_ptr() for k, t in step.state.tensors().items()}
        first = step(tokens, mask, torch.tensor([False, True])).clone()
        assert {k: t.data_ptr() for k, t in step.state.tensors().items()} == before
        assert torch.equal(step.state.pos, torch.tensor([16, 8]))
        _, want = model(tokens[:, :-1], state, torch.tensor([False, True]))
        for k, t in step.state.tensors().items():
            assert torch.equal(t, want.tensors()[k]), k
        assert first.shape == (2, 8)
        step.state.ssm[0] = step.state.ssm[0].float()       # the scan gives float64 state back
        with pytest.raises(RuntimeError, match="state ssm.0 changed from torch.float32"):
            step(tokens, mask, torch.tensor([False, False]))


def test_evaluation_memory_does_not_grow_with_document_length():
    # the state a lane carries has a fixed size: a 40x longer document leaves the same state shapes
    cfg = ModelConfig(vocab_size=61, d_model=32, n_heads=4, layers="MA", d_mlp=48, d_state=16,
                      mamba_head_dim=16, ssd_chunk=8, n_mem=2, kv_window=16)
    model = ElephantLM(cfg)
    shapes = []
    for n in (40, 1600):
        _, state = model(torch.randint(0, 61, (1, 8)))
        for start in range(8, n, 8):
            with torch.no_grad():
                _, state = model(torch.randint(0, 61, (1, 8)), state)
        shapes.append({k: tuple(v.shape) for k, v in state.tensors().items()})
    assert shapes[0] == shapes[1]



def test_longest_first_order_gives_the_same_metrics_in_fewer_chunks():
    # one long document behind six short ones: in corpus order it starts late and runs on alone;
    # longest first it starts at once while the other lane reads the short ones
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=61, d_model=32, n_heads=4, layers="MA", d_mlp=48, d_state=16,
                      mamba_head_dim=16, ssd_chunk=8, n_mem=2, kv_window=16)
    model = ElephantLM(cfg).double()
    corpus = corpus_of([11] * 6 + [1, 401])
    chunks = []
    model.register_forward_pre_hook(lambda module, args: chunks.append(1))
    results = {}
    for order in ("corpus", "longest"):
        chunks.clear()
        results[order] = (evaluate(model, corpus, lanes=2, chunk_len=10, device="cpu", order=order),
                          len(chunks))
    (by_corpus, n_corpus), (by_length, n_length) = results["corpus"], results["longest"]
    assert n_length == 40 < n_corpus
    for key in ("documents", "tokens", "nll_sum", "bits_per_byte", "per_doc_mean_loss"):
        assert math.isclose(by_length[key], by_corpus[key], rel_tol=1e-12), key
    assert by_length["position_buckets"].keys() == by_corpus["position_buckets"].keys()
    for label, bucket in by_corpus["position_buckets"].items():
        assert by_length["position_buckets"][label]["tokens"] == bucket["tokens"]
        assert math.isclose(by_length["position_buckets"][label]["nll_sum"], bucket["nll_sum"],
                            rel_tol=1e-12)
    with pytest.raises(ValueError, match="order"):
        evaluate(model, corpus, lanes=2, chunk_len=10, device="cpu", order="shortest")


def test_evaluation_runs_in_eval_mode_and_gives_a_training_model_its_mode_back():
    # scoring in the middle of training: no training-only randomness reaches the scores (the
    # model is in evaluation mode for every chunk), and training goes on in training mode after,
    # also when evaluation fails
    model = mama_model().train()
    modes = []
    model.register_forward_pre_hook(lambda m, args: modes.append(m.training))
    evaluate(model, corpus_of([20, 9]), lanes=2, chunk_len=8, device="cpu")
    assert modes and not any(modes) and model.training
    with pytest.raises(ValueError, match="order"):
        evaluate(model, corpus_of([20, 9]), lanes=2, chunk_len=8, device="cpu", order="random")
    assert model.training


def test_longest_first_deals_documents_over_ranks():
    from elephant.evaluate import longest_first
    corpus = corpus_of([5, 1, 30, 7, 30, 2])
    assert longest_first(corpus).tolist() == [2, 4, 3, 0, 5]      # ties in corpus order; 1-token doc out
    assert longest_first(corpus, rank=0, world=2).tolist() == [2, 3, 5]
    assert longest_first(corpus, rank=1, world=2).tolist() == [4, 0]


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("evalrun")
    corpus = d / "corpus"
    corpus.mkdir()
    for split, n in (("train", 12), ("valid", 3), ("test", 4)):
        with open(corpus / f"{split}.jsonl", "w") as f:
            for i in range(n):
                f.write(json.dumps({"text": f"document {i} of {split}: " + "abc def " * (20 + 7 * i)}) + "\n")
    run = d / "run"
    args = ["--config", str(ROOT / "configs/tiny.toml"), "--no-progress", "data.source=text",
            f"data.path={corpus}", f"data.cache_dir={d / 'cache'}", f"train.run_dir={run}",
            "train.max_steps=3", "train.compile=off", "train.tensorboard=false"]
    assert train_cli.main(args) == 0
    return run


@pytest.fixture
def run_with_a_corrupt_newest_checkpoint(tmp_path) -> Path:
    """A tiny run with checkpoints at steps 1 and 2, a byte of step 2's weights flipped."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for split, n in (("train", 6), ("valid", 1), ("test", 2)):
        with open(corpus / f"{split}.jsonl", "w") as f:
            for i in range(n):
                f.write(json.dumps({"text": f"document {i} of {split}: " + "abc def " * 20}) + "\n")
    run = tmp_path / "run"
    assert train_cli.main(["--config", str(ROOT / "configs/tiny.toml"), "--no-progress",
                           "data.source=text", f"data.path={corpus}", f"data.cache_dir={tmp_path / 'c'}",
                           f"train.run_dir={run}", "train.max_steps=2", "train.ckpt_every=1",
                           "train.keep_ckpts=2", "train.tensorboard=false"]) == 0
    weights = run / "checkpoints" / "step_0000002" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-5] ^= 0xFF
    weights.write_bytes(bytes(data))
    return run


def test_readers_of_a_run_fall_back_past_a_corrupt_newest_checkpoint(
        run_with_a_corrupt_newest_checkpoint, tmp_path, capsys, monkeypatch):
    # eval, generation, export and push (DESIGN: readers of a run take the newest checkpoint that
    # verifies and say which they skipped); the run dir is left as it was. The upload itself is
    # faked here (test_hub.py has the Hub's): a huggingface_hub client leaves threads behind, and
    # the next tokenization's forked pool in this process could then hang
    from elephant import hub
    pushed = []
    monkeypatch.setattr(hub, "push_to_hub", lambda folder, repo_id, **kw: pushed.append(
        sorted(p.name for p in Path(folder).iterdir())) or f"https://hub/{repo_id}")
    run = run_with_a_corrupt_newest_checkpoint
    skip = "skipped checkpoint step_0000002: "

    def said_skip(err):
        line = next(ln for ln in err.splitlines() if ln.startswith(skip))
        assert "corrupt (SHA-256 does not match meta.json)" in line, line
        assert line.endswith("reading step_0000001"), line

    out = tmp_path / "r.json"
    assert eval_cli.main(["--checkpoint", str(run), "--json", str(out), "--no-progress"]) == 0
    said_skip(capsys.readouterr().err)
    assert json.loads(out.read_text())["elephant"]["documents"] == 2
    assert eval_cli.main(["--checkpoint", str(run), "--prompt", "abc", "--max-new-tokens", "4",
                          "--device", "cpu"]) == 0
    captured = capsys.readouterr()
    said_skip(captured.err)
    assert captured.out.startswith("abc")
    assert hub.main(["export", str(run), str(tmp_path / "export")]) == 0
    said_skip(capsys.readouterr().err)
    assert (tmp_path / "export" / "model.safetensors").is_file()
    assert hub.main(["push", str(run), "alice/tiny"]) == 0
    said_skip(capsys.readouterr().err)
    assert len(pushed) == 1 and "model.safetensors" in pushed[0]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["latest", "step_0000001",
                                                                       "step_0000002"]


def test_a_corrupt_checkpoint_named_as_a_step_folder_is_a_one_line_error(
        run_with_a_corrupt_newest_checkpoint, tmp_path, capsys):
    from elephant import hub
    run = run_with_a_corrupt_newest_checkpoint
    step = run / "checkpoints" / "step_0000002"
    for cli, argv in ((eval_cli.main, ["--checkpoint", str(step), "--no-progress"]),
                      (eval_cli.main, ["--checkpoint", str(step), "--prompt", "abc", "--device", "cpu"]),
                      (hub.main, ["export", str(run), str(tmp_path / "x"), "--step", "2"])):
        code = cli(argv)
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and len(err) == 1, err
        assert err[0] == f"error: {step / 'model.safetensors'}: corrupt (SHA-256 does not match meta.json)"
    assert not (tmp_path / "x").exists()


def test_eval_cli_reports_whole_documents_and_writes_json(trained_run, tmp_path, capsys):
    out = tmp_path / "r.json"
    assert eval_cli.main(["--checkpoint", str(trained_run), "--split", "test", "--json", str(out),
                          "--plot", str(tmp_path / "p.png"), "--no-progress"]) == 0
    printed = capsys.readouterr().out
    assert "bits per byte" in printed and "word perplexity" in printed
    r = json.loads(out.read_text())["elephant"]
    assert r["documents"] == 4
    texts = [f"document {i} of test: " + "abc def " * (20 + 7 * i) for i in range(4)]
    assert r["bytes"] == sum(len(t.encode()) for t in texts)
    assert r["words"] == sum(len(t.split()) for t in texts)
    assert (tmp_path / "p.png").stat().st_size > 0


def test_eval_cli_compacts_its_lanes_and_reads_a_long_document_beside(trained_run, tmp_path):
    # 8 lanes over the 4 test documents. With --side (a GPU's default) the longest, more chunks
    # than an even share of the 8 lanes, is read by a side batch of one lane beside the other 7;
    # on the CPU by default (and with --no-side anywhere) it is read in the batch, which shrinks
    # to its lane once only it is left (fewer rows); --no-compact keeps all 8 lanes to the end;
    # the same sums every way
    results = []
    for extra in (["--side"], [], ["--no-side"], ["--no-compact"]):
        out = tmp_path / f"r{len(results)}.json"
        assert eval_cli.main(["--checkpoint", str(trained_run), "--split", "test", "--lanes", "8",
                              "--json", str(out), "--no-progress"] + extra) == 0
        results.append(json.loads(out.read_text())["elephant"])
    side, small, named, full = results
    assert full["lane_chunks"] == 8 * full["chunk_steps"] and small["lane_chunks"] < full["lane_chunks"]
    assert side["side_documents"] == 1
    assert small["side_documents"] == named["side_documents"] == full["side_documents"] == 0
    assert small["tokens"] == full["tokens"] == side["tokens"]
    assert math.isclose(small["nll_sum"], full["nll_sum"], rel_tol=1e-6)
    assert math.isclose(side["nll_sum"], full["nll_sum"], rel_tol=1e-6)
    assert named["nll_sum"] == small["nll_sum"]


def test_eval_cli_reads_data_overrides_among_its_flags(trained_run, tmp_path):
    # another copy of the text corpus with one test document, named by data.path between the
    # flags; data.cache_dir after them (a fresh cache, so the copy is tokenized, not the run's)
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "test.jsonl").write_text(json.dumps({"text": "one document: " + "abc def " * 30}) + "\n")
    out = tmp_path / "r.json"
    assert eval_cli.main(["--checkpoint", str(trained_run), f"data.path={corpus}", "--split", "test",
                          "--json", str(out), "--no-progress", f"data.cache_dir={tmp_path / 'c'}"]) == 0
    assert json.loads(out.read_text())["elephant"]["documents"] == 1


def test_eval_cli_refuses_overrides_of_anything_but_the_data(trained_run, capsys):
    assert eval_cli.main(["--checkpoint", str(trained_run), "model.d_model=8", "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "only data.* overrides apply here" in err[0], err


def test_eval_cli_errors_are_one_line(trained_run, tmp_path, capsys):
    cases = [
        (["--checkpoint", str(tmp_path / "missing")], "missing"),
        (["--checkpoint", str(trained_run), "--split", "tset"], "unknown split 'tset'"),
        (["--checkpoint", str(trained_run), "--kv-keep", "8"], "trained without kept tokens"),
        (["--checkpoint", str(trained_run), "--kv-keep", "8", "--push-to-hub", "a/b"],
         "--kv-keep or --kv-keep-read with --push-to-hub"),
    ]
    for args, needle in cases:
        assert eval_cli.main(args + ["--no-progress"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: ") and needle in err[0], err


def test_eval_cli_refuses_a_tokenizer_that_does_not_fit_the_checkpoint(trained_run, capsys, shared_data):
    # the tiny model has 320 token ids; GPT-2's tokenizer has 50257
    gpt2 = shared_data / "tokenizers" / "gpt2"
    args = ["--checkpoint", str(trained_run), "--tokenizer", str(gpt2), "--no-progress"]
    assert eval_cli.main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "checkpoint/tokenizer mismatch" in err[0], err


def test_eval_cli_scores_a_local_baseline_on_the_same_text(trained_run, tmp_path, capsys, monkeypatch,
                                                            shared_data):
    # a tiny randomly initialised GPT-NeoX with the real GPT-NeoX tokenizer, saved locally
    transformers = pytest.importorskip("transformers")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    tok = transformers.PreTrainedTokenizerFast(
        tokenizer_file=str(shared_data / "tokenizers/gpt-neox-20b/tokenizer.json"),
        bos_token="<|endoftext|>", eos_token="<|endoftext|>")
    cfg = transformers.GPTNeoXConfig(vocab_size=len(tok), hidden_size=32, num_hidden_layers=2,
                                     num_attention_heads=4, intermediate_size=64,
                                     max_position_embeddings=64)
    torch.manual_seed(0)
    baseline = tmp_path / "tiny-neox"
    transformers.GPTNeoXForCausalLM(cfg).save_pretrained(baseline)
    tok.save_pretrained(baseline)
    out = tmp_path / "r.json"
    assert eval_cli.main(["--checkpoint", str(trained_run), "--split", "test", "--baseline",
                          str(baseline), "--baseline-max-len", "32", "--json", str(out),
                          "--no-progress"]) == 0
    printed = capsys.readouterr().out
    r = json.loads(out.read_text())
    ours, theirs = r["elephant"], r["baseline"]
    # the same raw text: the same documents, bytes and words, other tokens
    for key in ("documents", "bytes", "words"):
        assert ours[key] == theirs[key], key
    assert theirs["tokens"] != ours["tokens"] and theirs["bits_per_byte"] > 0
    assert str(baseline) in printed and "bits per byte" in printed


def test_eval_cli_says_when_the_baseline_cannot_be_loaded(trained_run, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    out = tmp_path / "r.json"
    assert eval_cli.main(["--checkpoint", str(trained_run), "--baseline", str(tmp_path / "no-model"),
                          "--json", str(out), "--no-progress"]) == 0
    err = capsys.readouterr().err
    assert "baseline unavailable" in err and "none is printed" in err
    assert "unavailable" in json.loads(out.read_text())["baseline"]


def test_eval_cli_pushes_the_model_with_its_results(trained_run, tmp_path, monkeypatch, capsys,
                                                   fake_hub):
    monkeypatch.chdir(tmp_path)
    assert eval_cli.main(["--checkpoint", str(trained_run), "--push-to-hub", "alice/tiny",
                          "--no-progress"]) == 0
    files = fake_hub.repos["alice/tiny"]["files"]
    assert {"config.json", "model.safetensors", "README.md"} <= set(files)
    card = files["README.md"].decode()
    assert "bits_per_byte" in card or "bits per byte" in card.lower()
    out, err = capsys.readouterr()
    assert fake_hub.token not in out + err


def test_evaluation_counts_its_chunk_steps_longest_document_first():
    # lanes 2, chunks of 4: documents of 17, 9, 5 and 5 tokens predict 16, 8, 4, 4 tokens, i.e.
    # 4, 2, 1, 1 chunks. Longest first: lane 0 reads the 17 (4 chunks), lane 1 the 9 then both 5s
    # (2 + 1 + 1): 4 steps, the lanes full (32 tokens in 4 x 2 x 4). With a 33-token document
    # instead of the 17, lane 0 needs 8 chunks while lane 1 is done after 4: 8 steps, fill 48/64.
    model = mama_model()
    for lengths, steps, tokens in (([5, 17, 9, 5], 4, 32), ([5, 33, 9, 5], 8, 48)):
        got = evaluate(model, corpus_of(lengths), lanes=2, chunk_len=4, device="cpu")
        assert (got["chunk_steps"], got["tokens"]) == (steps, tokens)


@pytest.mark.parametrize("cuda_graph, order", [(False, "corpus"), (True, "corpus"), (True, "longest")])
def test_compacted_evaluation_gives_the_same_sums_in_fewer_rows(cuda_graph, order):
    # compact=True (eval.py's way): once no document is left to start and at most an eighth of
    # the batch still reads one, the batch shrinks to those lanes (a power of two), the state
    # carried over (memory and window on; with cuda_graph the static step made again for the new
    # lane count): every document's and position bucket's sum is the full batch's (float64), in
    # fewer rows. 16 lanes; the two longest documents outlast the rest: once only they are read,
    # on 2 lanes (one of two left is not an eighth of them: no third shape).
    from elephant.evaluate import compacted_lanes
    model = mama_model(n_mem=2, kv_window=16)
    corpus = corpus_of(LONG_TAIL)
    # in the corpus's order the long documents take lanes 5 (at once) and 3 (a chunk later, when
    # its 5 tokens are done): their positions cross the first bucket's edge (512) a chunk apart
    full = evaluate(model, corpus, lanes=16, chunk_len=8, device="cpu", cuda_graph=cuda_graph,
                    order=order)
    small = evaluate(model, corpus, lanes=16, chunk_len=8, device="cpu", cuda_graph=cuda_graph,
                     order=order, compact=True)
    assert small["chunk_steps"] == full["chunk_steps"] == 88             # the 700 tokens, 8 a chunk
    assert full["lane_chunks"] == 16 * 88 and small["lane_chunks"] == 16 * 8 + 2 * 80
    assert_same_sums(small, full)
    assert compacted_lanes([3, 9], 16) == [3, 9]                           # two live: two lanes
    assert compacted_lanes([5, 6, 7], 16) is None                          # more than an eighth
    assert compacted_lanes([4], 8) == [4] and compacted_lanes([2], 4) is None
    assert compacted_lanes([1, 5, 6], 32) == [0, 1, 5, 6]                  # padded to a power of 2
    assert compacted_lanes([0, 2], 3, share=1) == [0, 2]                   # the side batch's share
    assert compacted_lanes([0, 1, 2], 3, share=1) is None                  # nothing ended
    assert compacted_lanes([0, 1, 3], 4, share=1) is None                  # three live: four lanes


def test_only_a_batch_of_at_most_graph_max_rows_gets_the_static_step(monkeypatch):
    # cuda_graph=True captures the chunk step only for a batch of at most GRAPH_MAX_ROWS token
    # rows (on a GPU a larger one is busy with the plain step, and a capture costs more than the
    # launches it saves): with the cap at 8 lanes of 8 tokens, the 16-lane batch runs plain and
    # the static step is made once compaction leaves 2 lanes; under the default cap, for both;
    # the sums are the plain pass's either way (float64)
    from elephant import evaluate as ev
    made = []

    class Recorded(ev.StaticChunkStep):
        def __init__(self, model, state, tokens, *args, **kwargs):
            made.append(tokens.shape[0])
            super().__init__(model, state, tokens, *args, **kwargs)

    monkeypatch.setattr(ev, "StaticChunkStep", Recorded)
    model = mama_model(n_mem=2, kv_window=16)
    corpus = corpus_of(LONG_TAIL)
    plain = evaluate(model, corpus, lanes=16, chunk_len=8, device="cpu")
    assert made == []
    # ... and a batch over the cap is captured when its pass has GRAPH_MIN_CHUNKS chunks ahead
    # (this pass: its 215 chunks over 16 lanes, 14 at full lanes; 13 ahead after the first)
    for cap, least, shapes in ((8 * 8, ev.GRAPH_MIN_CHUNKS, [2]), (ev.GRAPH_MAX_ROWS, 10 ** 9, [16, 2]),
                               (8 * 8, 13, [16, 2]), (8 * 8, 14, [2])):
        monkeypatch.setattr(ev, "GRAPH_MAX_ROWS", cap)
        monkeypatch.setattr(ev, "GRAPH_MIN_CHUNKS", least)
        made.clear()
        got = evaluate(model, corpus, lanes=16, chunk_len=8, device="cpu", cuda_graph=True,
                       compact=True)
        assert made == shapes
        assert_same_sums(got, plain)


@pytest.mark.parametrize("cuda_graph, compact", [(False, False), (True, True)])
def test_side_batch_gives_the_same_sums_and_reads_the_long_documents_beside(cuda_graph, compact):
    # side=True: the documents that would outlast the batch (here the 700 and the 600, each more
    # chunks than an even share of all the chunks over 16 lanes) are read by a side batch of their
    # own (2 lanes) while 14 lanes read the rest; every document's and position bucket's sum is the
    # one batch's (float64; on the CPU the two batches take turns on one stream)
    from elephant.evaluate import longest_first, side_documents
    model = mama_model(n_mem=2, kv_window=16)
    corpus = corpus_of(LONG_TAIL)
    one = evaluate(model, corpus, lanes=16, chunk_len=8, device="cpu", cuda_graph=cuda_graph,
                   compact=compact)
    two = evaluate(model, corpus, lanes=16, chunk_len=8, device="cpu", cuda_graph=cuda_graph,
                   compact=compact, side=True)
    assert two["side_documents"] == 2 and two["side_chunk_steps"] == 88   # (700 - 1) / 8, rounded up
    # compact: the side batch shrinks to one lane once the 600 is read ((600 - 1) / 8 -> 75 chunks)
    assert two["side_lane_chunks"] == (2 * 75 + 13 if compact else 2 * 88)
    main_rows, main_steps = two["lane_chunks"] - two["side_lane_chunks"], two["chunk_steps"] - 88
    assert main_rows == 14 * main_steps if not compact else main_rows < 14 * main_steps
    assert main_steps < 88 and two["lane_chunks"] < one["lane_chunks"]
    assert_same_sums(two, one, long=True)
    # which documents go aside: more chunks than an even share, at most an eighth of the lanes
    docs = longest_first(corpus)
    assert sorted(corpus.doc_lengths[side_documents(corpus, docs, 16, 8)]) == [600, 700]
    assert side_documents(corpus, docs, 8, 8).size == 1                   # an eighth of 8 lanes
    assert side_documents(corpus, docs, 4, 8).size == 0                   # under 8 lanes: none
    assert side_documents(corpus, docs, 16, 700).size == 0                # one chunk each
    even = corpus_of([50] * 40)
    assert side_documents(even, longest_first(even), 16, 8).size == 0


def recorded_chunk_nll(model) -> tuple[list, object]:
    """A list that each forward of `model` appends its per-token NLL (B, T) to, and the hook's
    handle (remove it after)."""
    seen = []
    handle = model.register_forward_hook(lambda module, args, out: seen.append(out[0].clone()))
    return seen, handle


def pieces_of(corpus, n: int) -> TokenizedCorpus:
    """Every document cut into pieces of n predicted tokens: tokens [j n, (j + 1) n] (the last
    token of a piece is the next one's first), as documents of their own."""
    docs = []
    for i in range(len(corpus)):
        doc = corpus.doc(i)
        docs += [doc[j: j + n + 1] for j in range(0, len(doc) - 1, n)]
    return TokenizedCorpus.from_documents(docs)


@pytest.mark.parametrize("n_mem, extra", [(0, {}), (2, {}), (2, {"kv_keep": 5, "mem_rotary": "free"})])
def test_reset_every_scores_a_document_as_its_pieces_alone(n_mem, extra):
    # reset_every=N (the context ablation): the state is reset at positions N, 2N, ... of the
    # document, as if a new document started there (window, kept tokens, Mamba state, memory,
    # rotary positions), so every chunk's per-token NLL is bitwise that of the document's
    # N-token pieces read as documents of their own (float64; one lane, chunks of 32, N = 256);
    # the loss by position stays by the position in the whole document
    from elephant.metrics import PositionBuckets
    model = mama_model(n_mem=n_mem, kv_window=16, **extra)
    N, T, L = 256, 32, 1100
    corpus = corpus_of([L])
    seen, handle = recorded_chunk_nll(model)
    reset = evaluate(model, corpus, lanes=1, chunk_len=T, device="cpu", reset_every=N)
    by_reset, seen[:] = list(seen), []
    alone = evaluate(model, pieces_of(corpus, N), lanes=1, chunk_len=T, device="cpu", order="corpus")
    by_piece, seen[:] = list(seen), []
    carried = evaluate(model, corpus, lanes=1, chunk_len=T, device="cpu")
    handle.remove()
    assert len(by_reset) == len(by_piece) == 35                      # (1100 - 1) / 32, rounded up
    assert all(torch.equal(a, b) for a, b in zip(by_reset, by_piece))
    assert reset["tokens"] == alone["tokens"] == carried["tokens"] == L - 1
    assert math.isclose(reset["nll_sum"], alone["nll_sum"], rel_tol=1e-12)
    assert reset["documents"] == 1 and alone["documents"] == 5
    assert reset["nll_sum"] != carried["nll_sum"]                    # it did reset
    # by the position in the document: the carried pass's bands, the pieces' losses
    want = PositionBuckets()
    want.add(torch.cat(by_reset, 1)[0, :L - 1], torch.arange(1, L))
    assert [b["tokens"] for b in reset["position_buckets"].values()] == \
        [b["tokens"] for b in carried["position_buckets"].values()] == [511, 512, 76]
    for label, bucket in want.to_dict().items():
        assert math.isclose(reset["position_buckets"][label]["nll_sum"], bucket["nll_sum"],
                            rel_tol=1e-12), label


def test_reset_every_zero_or_past_every_document_changes_nothing():
    # reset_every=0 (off, the default) is today's evaluation bit for bit; an interval no document
    # reaches takes the reset path and resets nothing: the same bits
    model = mama_model(n_mem=2, kv_window=16)
    corpus = corpus_of(LONG_TAIL)
    for kwargs in ({}, {"cuda_graph": True, "compact": True}, {"pack": True}):
        default = evaluate(model, corpus, lanes=4, chunk_len=8, device="cpu", **kwargs)
        assert evaluate(model, corpus, lanes=4, chunk_len=8, device="cpu", reset_every=0,
                        **kwargs) == default
        assert evaluate(model, corpus, lanes=4, chunk_len=8, device="cpu", reset_every=704,
                        **kwargs) == default


@pytest.mark.parametrize("kwargs", [{"cuda_graph": True, "compact": True}, {"side": True},
                                    {"side": True, "cuda_graph": True, "compact": True}])
def test_reset_every_is_honoured_by_the_static_step_compaction_and_the_side_batch(kwargs):
    # the resets are inputs of each chunk step: the static step (a CUDA graph on a GPU), the
    # compacted batch and the side batch give the plain pass's sums (float64), and those are
    # the pieces' read alone, in total
    model = mama_model(n_mem=2, kv_window=16, kv_keep=5)
    corpus = corpus_of(LONG_TAIL)
    plain = evaluate(model, corpus, lanes=16, chunk_len=8, device="cpu", reset_every=64)
    got = evaluate(model, corpus, lanes=16, chunk_len=8, device="cpu", reset_every=64, **kwargs)
    assert_same_sums(got, plain, long=True)
    alone = evaluate(model, pieces_of(corpus, 64), lanes=16, chunk_len=8, device="cpu")
    assert alone["tokens"] == plain["tokens"]
    assert math.isclose(alone["nll_sum"], plain["nll_sum"], rel_tol=1e-12)


@pytest.mark.parametrize("lanes, chunk_len", [(1, 8), (3, 16)])
def test_packed_evaluation_resets_inside_its_chunks(lanes, chunk_len):
    # packed, documents start anywhere in a chunk, so the pieces do too (marked in `starts`):
    # memory off and a window covering the documents, the unpacked ablation's sums
    model = mama_model()
    corpus = corpus_of([50, 2, 113, 17, 64, 90, 3, 9])
    unpacked = evaluate(model, corpus, lanes=lanes, chunk_len=chunk_len, device="cpu", reset_every=32)
    packed = evaluate(model, corpus, lanes=lanes, chunk_len=chunk_len, device="cpu", reset_every=32,
                      pack=True)
    assert_same_sums(packed, unpacked)
    alone = evaluate(model, pieces_of(corpus, 32), lanes=lanes, chunk_len=chunk_len, device="cpu")
    assert math.isclose(alone["nll_sum"], packed["nll_sum"], rel_tol=1e-10)
    carried = evaluate(model, corpus, lanes=lanes, chunk_len=chunk_len, device="cpu", pack=True)
    assert carried["nll_sum"] != packed["nll_sum"]


def test_reset_every_must_be_a_multiple_of_the_chunk_length():
    from elephant.config import ConfigError
    from elephant.evaluate import parse_reset_every
    model, corpus = mama_model(), corpus_of([50, 20])
    for bad in (-8, 12):
        with pytest.raises(ValueError, match="reset_every must be 0"):
            evaluate(model, corpus, lanes=1, chunk_len=8, device="cpu", reset_every=bad)
    assert [parse_reset_every(t, 512) for t in ("0", "2048", "2K", "1M")] == [0, 2048, 2048, 1 << 20]
    with pytest.raises(ConfigError, match=r"--reset-every 1000: not 0 \(off\) or a positive multiple of the chunk length 512"):
        parse_reset_every("1000", 512)


def test_eval_cli_resets_every_n_tokens_and_says_so(trained_run, tmp_path, capsys):
    # the tiny recipe's chunks are 64 tokens; the test documents reach 350
    out = tmp_path / "r.json"
    assert eval_cli.main(["--checkpoint", str(trained_run), "--split", "test", "--json", str(out),
                          "--no-progress", "--reset-every", "128"]) == 0
    r = json.loads(out.read_text())["elephant"]
    assert r["reset_every"] == 128 and r["context"] == "reset every 128 tokens"
    assert eval_cli.main(["--checkpoint", str(trained_run), "--split", "test", "--json", str(out),
                          "--no-progress"]) == 0
    carried = json.loads(out.read_text())["elephant"]
    assert carried["reset_every"] == 0 and carried["tokens"] == r["tokens"]
    assert carried["nll_sum"] != r["nll_sum"]
    for bad, needle in (("100", "--reset-every 100: not 0 (off) or a positive multiple of the chunk length 64"),
                        ("-64", "--reset-every -64: not a token count"),
                        ("2X", "--reset-every 2X: not a token count")):
        capsys.readouterr()
        assert eval_cli.main(["--checkpoint", str(trained_run), "--reset-every", bad,
                              "--no-progress"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: ") and needle in err[0], err


def test_dropping_every_carried_part_scores_each_chunk_alone():
    # drop=every part (eval.py --drop window,kept,memory,ssm): after each chunk the state holds
    # nothing of it but the positions, so each chunk is read as if a document started there:
    # reset_every = chunk_len's sums (position-free memory; rotary is relative, so the kept
    # positions change nothing but rounding)
    model = mama_model(n_mem=2, kv_window=16, kv_keep=5, mem_rotary="free")
    corpus = corpus_of(LONG_TAIL)
    every = ("window", "kept", "memory", "ssm")
    dropped = evaluate(model, corpus, lanes=4, chunk_len=8, device="cpu", drop=every)
    reset = evaluate(model, corpus, lanes=4, chunk_len=8, device="cpu", reset_every=8)
    assert dropped["tokens"] == reset["tokens"]
    assert math.isclose(dropped["nll_sum"], reset["nll_sum"], rel_tol=1e-10)
    carried = evaluate(model, corpus, lanes=4, chunk_len=8, device="cpu")
    assert evaluate(model, corpus, lanes=4, chunk_len=8, device="cpu", drop=()) == carried


@pytest.mark.parametrize("part", ["window", "kept", "memory", "ssm"])
def test_each_dropped_part_changes_the_loss_and_the_static_step_drops_it_too(part):
    # one part dropped after every chunk (the rest carried) changes what the documents' later
    # chunks read; the static step (a CUDA graph on a GPU) and compaction drop it the same way
    # (the memory gates half open: shut, as they start by default, the memory never changes)
    model = mama_model(n_mem=2, kv_window=16, kv_keep=5, mem_gate_init=0.0)
    corpus = corpus_of(LONG_TAIL)
    carried = evaluate(model, corpus, lanes=16, chunk_len=8, device="cpu")
    plain = evaluate(model, corpus, lanes=16, chunk_len=8, device="cpu", drop=(part,))
    assert plain["tokens"] == carried["tokens"] and plain["nll_sum"] != carried["nll_sum"]
    graphed = evaluate(model, corpus, lanes=16, chunk_len=8, device="cpu", drop=(part,),
                       cuda_graph=True, compact=True)
    assert_same_sums(graphed, plain)


def test_dropping_a_part_the_model_does_not_carry_is_a_clear_error():
    # the LM recipes carry no memory (n_mem = 0): "--drop memory" would measure nothing, its
    # figures the carried run's, so it is refused, naming what the model does carry
    from elephant.config import ConfigError
    from elephant.recall import evaluate_recall
    from elephant.state import carried_parts
    from data_packing.tokenizer import ByteTokenizer
    model = mama_model(n_mem=0, kv_window=16)
    assert carried_parts(model.cfg) == ("window", "ssm")
    assert carried_parts(mama_model(n_mem=2, kv_window=16, kv_keep=5).cfg) == (
        "window", "kept", "memory", "ssm")
    corpus = corpus_of(LONG_TAIL)
    for parts, missing in ((("memory",), "no memory"), (("kept", "memory"), "no kept, no memory")):
        with pytest.raises(ConfigError, match=f"--drop {','.join(parts)}: this model carries "
                                               f"{missing} .*; it carries window, ssm"):
            evaluate(model, corpus, lanes=4, chunk_len=8, device="cpu", drop=parts)
    with pytest.raises(ConfigError, match="--ablate memory: this model carries no memory"):
        evaluate_recall(model, ByteTokenizer(), [64], 2, 32, torch.device("cpu"), digits=3,
                        ablation="memory")
    assert evaluate(model, corpus, lanes=4, chunk_len=8, device="cpu", drop=("window",))["tokens"]


def test_eval_cli_drops_parts_and_says_so(trained_run, tmp_path, capsys):
    out = tmp_path / "d.json"
    assert eval_cli.main(["--checkpoint", str(trained_run), "--split", "test", "--json", str(out),
                          "--no-progress", "--drop", "memory,kv"]) == 0
    r = json.loads(out.read_text())["elephant"]
    assert r["drop"] == ["window", "memory"] and "window, memory dropped after every chunk" in r["context"]
    capsys.readouterr()
    assert eval_cli.main(["--checkpoint", str(trained_run), "--drop", "state", "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--drop state: unknown part 'state'" in err[0], err


def test_eval_cli_runs_the_needle_test_on_the_runs_held_out_text(trained_run, tmp_path, capsys):
    out = tmp_path / "n.json"
    assert eval_cli.main(["--checkpoint", str(trained_run), "--needle", "64,200", "--needle-keys",
                          "1,2", "--needle-lanes", "2", "--json", str(out), "--no-progress"]) == 0
    r = json.loads(out.read_text())
    assert set(k for k in r if k.startswith("needle_")) == {"needle_64", "needle_200",
                                                             "needle_multi_64", "needle_multi_200"}
    assert all(0.0 <= r[k] <= 1.0 for k in r if k.startswith("needle_")) and r["form"] == "assign"
    assert "| 2 |" in capsys.readouterr().out
    for bad, message in ((["--needle", "0"], "must be positive"),
                         (["--needle", "64", "--needle-keys", "x"], "--needle-keys x"),
                         (["--needle", "64", "--needle-form", "ode"], "unknown fact template 'ode'"),
                         (["--needle", "64", "--drop", "memory"], "--needle scores recall alone")):
        capsys.readouterr()
        assert eval_cli.main(["--checkpoint", str(trained_run), "--no-progress", *bad]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and message in err[0], err
