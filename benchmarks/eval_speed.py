"""`eval.py` as a whole command, timed as a user runs it: the process started, the model loaded,
the data read and tokenized, the streamed pass, the report written, the process gone. Issue 72's
goals: >= 2.5M tokens/s at 64 lanes over ~16M tokens, >= 500K tokens/s on one 1M-token document,
GPU memory flat in the length. benchmarks/train_speed.py times evaluate()'s pass alone.

    python benchmarks/eval_speed.py                     # wt103-70m, and its kv_keep=0 shape beside
    python benchmarks/eval_speed.py --recipes wt103-70m,fineweb-124m --kv-keep recipe
    python benchmarks/eval_speed.py --recipes recall --kv-keep recipe   # kept4096_bytes_s
    python benchmarks/eval_speed.py --cpu-smoke         # tiny shapes on the CPU, the whole flow

The model: a recipe's [model] at random (speed does not depend on the weights), saved as an export
folder (hub.save_pretrained, what eval.py --checkpoint reads) with the recipe's tokenizer from
shared/data/tokenizers (GPT-NeoX-20B's for wt103-70m, GPT-2's for fineweb-124m); beside it the same
recipe with model.kv_keep=0, the shape before kept tokens, so that a regression shows in one run.

The data: folders of .txt files (source `text`) written once from the Python source of this
machine's stdlib and site-packages (sources.pycode_files, train split, in its order), sized by the
tokenizer's bytes per token on their first megabyte:
  64_lanes   one file a document, up to ~16M tokens, read by 64 lanes
  1m_doc     those files run together into one document of >= 1M (2^20) tokens, read by one lane
  short_doc  its first sixteenth, one lane: a command's fixed cost, and memory against length
Each run is `python eval.py --checkpoint EXPORT --data text --data-path FOLDER --lanes N --json J
--no-progress data.cache_dir=CACHE`, timed from launch to exit: tokens/s = the tokens eval.py
reports / that wall time. Cold: CACHE empty, the text tokenized (data_packing.prepare; its
manifest's seconds kept); warm: CACHE filled. peak_mem_gb: eval.py's own (the pass's
torch.cuda.max_memory_allocated). The first model runs each case cold (--cold), short_doc's first
of all (the command's first process, where Triton's kernels compile), then each warm; the others
64_lanes and 1m_doc warm. Each run counts the files it added to Triton's cache (the kernels it
compiled).

The breakdown (--breakdown): one more warm run of a case, in a process of this script (--child)
that calls eval.py's own main with timers around the functions it calls and the device
synchronized at the edges of the phases (and around each static step made): (a) start-up,
imports, CUDA init, model load (hub.from_pretrained); (b) the data read and tokenized
(data_packing.get_corpus); (c) the pass's set-up and its first FIRST_CHUNKS chunks of the main
batch (the first plain chunk, the static step made and captured as a CUDA graph, its first
replay); (d) the steady chunks (the static steps made for compacted batches listed apart); (e)
the pass's sums, the report (table, JSON) and the process's exit. Its `goal_wall_s` is the wall
the goal allows for the same tokens: what the phases must shrink to together.
--profile N: one more warm run of each breakdown case, N steady chunks under torch's profiler
(device and host time a chunk, kernels by kind, operators by host time).
Results: benchmarks/results/eval_speed_<gpu>.json (a smoke run: the temporary folder).
"""
import time

_STARTED = time.time()   # the --child's first moment (its breakdown's start-up: launch to here)

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import shutil  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

TOKENIZERS = ROOT / "shared" / "data" / "tokenizers"
if not TOKENIZERS.is_dir():
    TOKENIZERS = ROOT.parent / "shared" / "data" / "tokenizers"
# recall: the recall recipe as loaded (bytes; 4,096 kept tokens a layer, each query reading 128):
# issue 72's kept-token inference, its 64-lane bytes/s `kept4096_bytes_s`
RECIPE_TOKENIZER = {"wt103-70m": "gpt-neox-20b", "fineweb-124m": "gpt2", "recall": "bytes"}
HEADLINE_RECIPE = "wt103-70m"
GOALS = {"eval_tok_s_64_lanes": 2.5e6, "eval_tok_s_1m_doc": 5e5}
KEPT_GOAL = {"kept4096_bytes_s": 1e6}   # --recipes recall
# what a reviewer measured of the whole command (issue 72): the wt103-70m recipe's model on an
# H200, with kept tokens (model.kv_keep=128) and a week earlier without them
REFERENCE = {"device": "H200", "source": "issue 72",
             "64_lanes_16M": {"kv_keep_128": {"tok_s": 1.16e6, "peak_gb": 3.7},
                              "before_kept_tokens": {"tok_s": 1.39e6, "peak_gb": 2.8}},
             "1m_doc": {"kv_keep_128": {"tok_s": 1.70e5}, "before_kept_tokens": {"tok_s": 2.02e5}}}
CASES = ("64_lanes", "1m_doc", "short_doc")
SHORT_SHARE = 16            # short_doc: 1m_doc's first 1/16
FIRST_CHUNKS = 2            # the breakdown's first chunks: the plain one (and the capture), a replay
PROFILE_AFTER = 4           # --profile: main chunks past the first ones before the profiled ones
# max_file_bytes: 64_lanes' documents cut to this many bytes (None: whole files); the smoke's
# corpus is a few short documents, more than its lanes
SIZES = {"gpu": {"lanes": 64, "corpus_tokens": 16_000_000, "doc_tokens": 2 ** 20,
                 "max_file_bytes": None},
         "smoke": {"lanes": 4, "corpus_tokens": 2_400, "doc_tokens": 1_000, "max_file_bytes": 400}}
SMOKE_MODEL = ["model.d_model=32", "model.n_heads=2", "model.d_mlp=64", "model.d_state=16",
               "model.mamba_head_dim=16", "model.ssd_chunk=16", "model.vocab_size=320",
               "model.kv_window=64", "model.kv_keep=8", "train.chunk_len=64"]


# ------------------------------------------------------------------------------- the inputs
def source_texts(site_packages: bool):
    """The Python source files of this machine, as text, in pycode's order (train split): the
    stdlib's, then site-packages' (site_packages)."""
    from data_packing.sources import pycode_files
    for file, _ in pycode_files("train", site_packages):
        try:
            text = file.read_bytes().decode("utf-8", "replace")
        except OSError:
            continue
        if text.strip():
            yield text


def bytes_per_token(tokenizer, texts: list[str], sample_bytes: int) -> float:
    """UTF-8 bytes per token of `tokenizer` over the first `sample_bytes` of `texts`."""
    sample, n = [], 0
    for t in texts:
        sample.append(t)
        n += len(t.encode())
        if n >= sample_bytes:
            break
    tokens = sum(len(ids) for ids in tokenizer.encode_batch(sample))
    return n / max(tokens, 1)


def write_corpora(folder: Path, tokenizer, sizes: dict, site_packages: bool) -> dict:
    """The three cases' text folders under `folder` (each FOLDER/test/*.txt, split `test`), from
    the source files in order: 64_lanes a file each (cut to sizes' max_file_bytes) up to
    corpus_tokens, 1m_doc the files joined by blank lines into one document of >= doc_tokens
    (10% over: the bytes per token are a sample's), short_doc that document's first
    1/SHORT_SHARE. Sized by the tokenizer's bytes per token on the first megabyte."""
    import itertools
    stream = source_texts(site_packages)
    sample, n = [], 0
    for text in stream:
        sample.append(text)
        n += len(text.encode())
        if n >= min(2 ** 20, 4 * sizes["doc_tokens"]):
            break
    ratio = bytes_per_token(tokenizer, sample, 2 ** 20)
    want_a, want_b = sizes["corpus_tokens"] * ratio, 1.1 * sizes["doc_tokens"] * ratio
    a = folder / "64_lanes" / "test"
    a.mkdir(parents=True)
    files = a_bytes = b_bytes = 0
    parts = []
    for text in itertools.chain(sample, stream):
        if a_bytes < want_a:
            data = text[: sizes["max_file_bytes"]].encode()
            (a / f"{files:06d}.txt").write_bytes(data)
            files, a_bytes = files + 1, a_bytes + len(data)
        if b_bytes < want_b:
            parts.append(text)
            b_bytes += len(text.encode()) + 2
        if a_bytes >= want_a and b_bytes >= want_b:
            break
    doc = "\n\n".join(parts)
    doc = doc[: int(len(doc) * want_b / max(len(doc.encode()), 1)) + 1]   # the last file cut
    if len(doc.encode()) < sizes["doc_tokens"] * ratio or a_bytes < want_a:
        raise SystemExit(f"error: this machine's Python source ({'with' if site_packages else 'without'} "
                         f"site-packages) holds too little text for {sizes['corpus_tokens']:,} and "
                         f"{sizes['doc_tokens']:,} tokens")
    out = {"bytes_per_token": ratio, "site_packages": site_packages,
           "64_lanes": {"files": files, "bytes": a_bytes}}
    for case, text in (("1m_doc", doc), ("short_doc", doc[: len(doc) // SHORT_SHARE])):
        (folder / case / "test").mkdir(parents=True)
        (folder / case / "test" / "doc.txt").write_text(text, encoding="utf-8")
        out[case] = {"files": 1, "bytes": len(text.encode())}
    return out


def build_export(recipe: str, kv_keep, tokenizer_spec: str, out: Path, smoke: bool) -> dict:
    """A recipe's model at random (seed 0) as an export folder with its tokenizer;
    kv_keep: model.kv_keep ("recipe": the recipe's own)."""
    import torch

    from data_packing import load_tokenizer
    from elephant.config import load_config
    from elephant.hub import save_pretrained
    from elephant.model import ElephantLM
    overrides = [f"data.tokenizer={tokenizer_spec}"] + (SMOKE_MODEL if smoke else [])
    if kv_keep != "recipe":
        overrides.append(f"model.kv_keep={kv_keep}")
    cfg = load_config(ROOT / "configs" / f"{recipe}.toml", overrides)
    torch.manual_seed(0)
    t0 = time.perf_counter()
    model = ElephantLM(cfg.model)
    save_pretrained(model, out, tokenizer=load_tokenizer(tokenizer_spec), train_config=cfg,
                    name=f"{recipe} (random weights)")
    return {"recipe": recipe, "kv_keep": cfg.model.kv_keep, "kv_keep_infer": cfg.model.kv_keep_infer,
            "parameters": model.num_params(),
            "chunk_len": cfg.train.chunk_len, "build_s": time.perf_counter() - t0}


# ------------------------------------------------------------------------------- the runs
def triton_files() -> int:
    """Files in Triton's kernel cache (TRITON_CACHE_DIR, else ~/.triton/cache): a run that adds
    some compiled kernels."""
    root = Path(os.environ.get("TRITON_CACHE_DIR") or Path.home() / ".triton" / "cache")
    return sum(len(files) for _, _, files in os.walk(root)) if root.is_dir() else 0


def child_env() -> dict:
    """The environment of the runs: this one without TRITON_INTERPRET (the CPU tests' setting,
    under which eval.py would run the Triton kernels in the interpreter: no user's)."""
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    return env


def eval_argv(export: Path, text: Path, lanes: int, json_path: Path, cache: Path, smoke: bool):
    return (["--checkpoint", str(export), "--data", "text", "--data-path", str(text), "--split",
             "test", "--lanes", str(lanes), "--json", str(json_path), "--no-progress",
             f"data.cache_dir={cache}"] + (["--device", "cpu"] if smoke else []))


def corpus_stats(cache: Path) -> dict:
    """The tokenized corpus in a cache folder (its one subfolder): documents, tokens, the longest
    and median document, and the seconds data_packing.prepare took to build it."""
    import numpy as np

    from data_packing import TokenizedCorpus
    built = [d for d in cache.iterdir() if (d / "manifest.json").is_file()] if cache.is_dir() else []
    if len(built) != 1:
        return {"error": f"{cache}: {len(built)} corpora"}
    corpus = TokenizedCorpus.open(built[0])
    lengths = np.asarray(corpus.doc_lengths)
    m = corpus.manifest
    return {"documents": int(lengths.size), "tokens": int(lengths.sum()),
            "longest_doc_tokens": int(lengths.max()), "median_doc_tokens": float(np.median(lengths)),
            "tokenize_s": m.get("seconds"), "tokenize_workers": m.get("workers")}


def run_command(argv: list[str], timeout: float, env: dict | None = None) -> tuple[float, int, str]:
    """(wall seconds from launch to exit, exit status (124: past `timeout`), stderr's tail) of a
    process started in the repository's root."""
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(argv, cwd=ROOT, env=env or child_env(), capture_output=True,
                              timeout=timeout)
        rc, err = proc.returncode, proc.stderr
    except subprocess.TimeoutExpired as e:
        rc, err = 124, e.stderr or b""
    return time.perf_counter() - t0, rc, err.decode("utf-8", "replace")[-2000:]


EVAL_FIELDS = ("documents", "tokens", "loss", "chunk_len", "chunk_steps", "lane_chunks",
               "side_documents", "side_chunk_steps", "side_lane_chunks", "kv_keep", "peak_mem_gb",
               "bytes")


def eval_run(export: Path, text: Path, lanes: int, cache: Path, json_path: Path, smoke: bool,
             timeout: float, cold: bool) -> dict:
    """One eval.py process timed from launch to exit (cold: its data cache emptied first)."""
    if cold:
        shutil.rmtree(cache, ignore_errors=True)
    before = triton_files()
    argv = [sys.executable, str(ROOT / "eval.py"),
            *eval_argv(export, text, lanes, json_path, cache, smoke)]
    wall, rc, err = run_command(argv, timeout)
    out = {"wall_s": wall, "rc": rc, "cold": cold, "lanes": lanes,
           "triton_cache_new_files": triton_files() - before, "json": str(json_path)}
    if rc != 0 or not json_path.is_file():
        return out | {"error": err}
    ours = json.loads(json_path.read_text())["elephant"]
    out.update({k: ours.get(k) for k in EVAL_FIELDS})
    out["tok_s"] = ours["tokens"] / wall
    out["bytes_s"] = ours["bytes"] / wall if ours.get("bytes") else None
    # eval.py reports no pass speed of its own (tokens/s): kept here should it come to
    out["reported_pass_tok_s"] = ours.get("tokens_per_s")
    if ours.get("lane_chunks"):
        out["lane_fill"] = ours["tokens"] / (ours["lane_chunks"] * ours["chunk_len"])
    if cold:
        out["corpus"] = corpus_stats(cache)
    return out


def breakdown_run(case: str, export: Path, text: Path, lanes: int, cache: Path, work: Path,
                  name: str, smoke: bool, timeout: float, profile: int = 0) -> dict:
    """A warm run of eval.py's main in a --child process of this script, phase by phase; with
    `profile`, instead `profile` steady main chunks under torch's profiler (what the host and the
    device spend a chunk on)."""
    spec = {"argv": eval_argv(export, text, lanes, work / f"{name}.eval.json", cache, smoke),
            "out": str(work / f"{name}.breakdown.json"), "profile": profile}
    spec_path = work / f"{name}.spec.json"
    spec_path.write_text(json.dumps(spec))
    Path(spec["out"]).unlink(missing_ok=True)
    env = child_env()
    env["ELEPHANT_LAUNCHED_AT"] = repr(time.time())
    wall, rc, err = run_command([sys.executable, str(Path(__file__).resolve()), "--child",
                                 str(spec_path)], timeout, env)
    if rc != 0 or not Path(spec["out"]).is_file():
        return {"rc": rc, "wall_s": wall, "error": err}
    marks = json.loads(Path(spec["out"]).read_text())
    if profile:
        if marks["pass"].get("profile") is None:
            return {"rc": rc, "wall_s": wall, "error": f"the pass ended before {profile} steady "
                                                       f"chunks were profiled"}
        return {"wall_s": wall, "profile": marks["pass"]["profile"]}
    ours = json.loads(Path(spec["argv"][spec["argv"].index("--json") + 1]).read_text())["elephant"]
    goal = GOALS["eval_tok_s_64_lanes" if case == "64_lanes" else "eval_tok_s_1m_doc"]
    return summarize_phases(marks, wall, ours, goal)


def summarize_phases(p: dict, wall: float, ours: dict, goal: float) -> dict:
    """The child's marks (seconds since launch, and the durations of what it timed) as the
    phases (a)-(e), each in seconds and as a share of the wall; `unaccounted_s`, what is left."""
    pass_ = p["pass"]
    first_end = pass_["first_done"]
    made = pass_["static_steps"]
    recapture = sum(s["seconds"] for s in made if s["started"] >= first_end)
    steady = pass_["loop_end"] - first_end
    phases = {
        "a_start_s": p["started"],                        # launch to the script's first line
        "a_import_torch_s": p["import_torch"],
        "a_import_project_s": p["import_project"],
        "a_cuda_init_s": p["cuda_init"],
        "a_model_load_s": p["model_load"],                # hub.from_pretrained, to the device
        "b_data_s": p["data"],                            # data_packing.get_corpus
        # eval.py's main before the pass otherwise: parsing, the data settings, the checks
        "b_other_s": pass_["called"] - p["main_start"] - p["model_load"] - p["data"],
        "c_pass_setup_s": pass_["first_chunk"] - pass_["called"],
        "c_first_chunks_s": first_end - pass_["first_chunk"],
        "d_steady_s": steady,
        "e_pass_sums_s": pass_["returned"] - pass_["loop_end"],
        "e_report_s": p["main_end"] - pass_["returned"],   # the table, the JSON
        "e_exit_s": wall - p["main_end"],                  # the process's end, as launched
    }
    phases["unaccounted_s"] = wall - sum(phases.values())
    tokens = ours["tokens"]
    return {"wall_s": wall, "tokens": tokens, "tok_s": tokens / wall,
            "counted_tokens": pass_["tokens_first"] + pass_["tokens_steady"],
            "phases": phases, "shares": {k: v / wall for k, v in phases.items()},
            "first_chunks": FIRST_CHUNKS, "tokens_first": pass_["tokens_first"],
            "tokens_steady": pass_["tokens_steady"],
            "steady_tok_s": pass_["tokens_steady"] / steady if steady > 0 else None,
            "steady_tok_s_without_recaptures": (pass_["tokens_steady"] / (steady - recapture)
                                                if steady > recapture else None),
            "pass_tok_s": tokens / (pass_["returned"] - pass_["called"]),
            "static_steps": made, "recapture_s": recapture,
            "goal_tok_s": goal, "goal_wall_s": tokens / goal, "over_goal_s": wall - tokens / goal,
            "peak_mem_gb": ours.get("peak_mem_gb"), "chunk_steps": ours.get("chunk_steps"),
            "loss": ours.get("loss"),
            "side_documents": ours.get("side_documents"),
            "note": "the device synchronized at each phase's edge and around each static step "
                    "made: this run alone"}


# ------------------------------------------------------------------------------- --child
def child(spec_path: str) -> int:
    """Run eval.py's main on the spec's arguments with timers around what it calls; write the
    marks (seconds since launch, or durations) to the spec's out."""
    launched = float(os.environ["ELEPHANT_LAUNCHED_AT"])
    spec = json.loads(Path(spec_path).read_text())
    marks = {"started": _STARTED - launched}
    t = time.perf_counter()
    import torch
    marks["import_torch"] = time.perf_counter() - t
    t = time.perf_counter()
    from elephant.layers.triton_env import lazy_ops
    lazy_ops()   # as eval.py's main does first
    import data_packing
    import data_packing.prepare  # noqa: F401  (what eval.py's run imports, and get_corpus)
    import elephant.checkpoint  # noqa: F401
    import elephant.evaluate as evaluate_module
    import elephant.fsutil
    import elephant.generate  # noqa: F401
    import elephant.hub
    import elephant.metrics  # noqa: F401
    import elephant.model  # noqa: F401
    import elephant.preemption  # noqa: F401
    import elephant.state  # noqa: F401
    import eval as eval_cli
    marks["import_project"] = time.perf_counter() - t
    cuda = torch.cuda.is_available() and "--device" not in spec["argv"]
    t = time.perf_counter()
    if cuda:   # eval.py makes its context in from_pretrained's .to(device): timed apart here
        torch.empty(1, device="cuda")
        torch.cuda.synchronize()
    marks["cuda_init"] = time.perf_counter() - t
    marks["main_start"] = time.time() - launched

    def sync():
        if cuda:
            torch.cuda.synchronize()

    def timed(owner, name, key):
        inner = getattr(owner, name)

        def call(*a, **k):
            t0 = time.perf_counter()
            try:
                return inner(*a, **k)
            finally:
                sync()
                marks[key] = time.perf_counter() - t0
        setattr(owner, name, call)

    timed(elephant.hub, "from_pretrained", "model_load")
    timed(data_packing, "get_corpus", "data")
    probe = PassProbe(evaluate_module, sync, launched, spec.get("profile", 0), cuda)
    evaluate = evaluate_module.evaluate

    def evaluate_timed(*a, **k):
        probe.begin()
        result = evaluate(*a, **k)
        probe.end()
        return result
    evaluate_module.evaluate = evaluate_timed
    stdout, sys.stdout = sys.stdout, open(os.devnull, "w")   # the table eval.py prints
    try:
        rc = eval_cli.main(spec["argv"])
    finally:
        sys.stdout = stdout
    sync()
    marks["main_end"] = time.time() - launched
    marks["pass"] = probe.marks
    Path(spec["out"]).write_text(json.dumps(marks, indent=1))
    return rc


class PassProbe:
    """Timers inside evaluate(): its call, the main batch's first chunk, the end of its first
    FIRST_CHUNKS chunks, the end of the loop (the first sums()), its return; the tokens of each
    part; every static step made (its seconds, lanes, stream). Times in seconds since launch.
    profile: that many main chunks, from the PROFILE_AFTER-th past the first ones, under torch's
    profiler (`marks["profile"]`: device and host time a chunk, the kernels by kind, the
    operators by host time)."""

    def __init__(self, module, sync, launched: float, profile: int = 0, cuda: bool = False):
        self.sync, self.launched = sync, launched
        self.profile, self.cuda, self.profiler = profile, cuda, None
        self.marks = {"first_chunk": None, "first_done": None, "loop_end": None,
                      "tokens_first": 0, "tokens_steady": 0, "static_steps": []}
        self.passes, self.main_chunks = [], 0
        probe, Pass, Static = self, module._Pass, module.StaticChunkStep
        init, chunk, sums, static_init = Pass.__init__, Pass._chunk, Pass.sums, Static.__init__

        def pass_init(self_, *a, **k):
            init(self_, *a, **k)
            probe.passes.append(self_)

        def pass_chunk(self_, batch):
            main = self_ is probe.passes[0]
            if main and probe.main_chunks == 0:
                probe.sync()
                probe.marks["first_chunk"] = probe.now()
            part = "tokens_first" if probe.main_chunks < FIRST_CHUNKS else "tokens_steady"
            probe.marks[part] += int(batch.loss_mask.sum())
            chunk(self_, batch)
            if main:
                probe.main_chunks += 1
                if probe.main_chunks == FIRST_CHUNKS:
                    probe.sync()
                    probe.marks["first_done"] = probe.now()
                if probe.profile:
                    probe.profile_edge()

        def pass_sums(self_):
            if probe.marks["loop_end"] is None:
                probe.sync()
                probe.marks["loop_end"] = probe.now()
            return sums(self_)

        def static_made(self_, *a, **k):
            probe.sync()
            t0 = probe.now()
            static_init(self_, *a, **k)
            probe.sync()
            probe.marks["static_steps"].append({
                "started": t0, "seconds": probe.now() - t0, "lanes": int(self_.tokens.shape[0]),
                "graph": self_.graph is not None, "side": self_.stream is not None,
                "main_chunk": probe.main_chunks})

        Pass.__init__, Pass._chunk, Pass.sums = pass_init, pass_chunk, pass_sums
        Static.__init__ = static_made

    def now(self) -> float:
        return time.time() - self.launched

    def profile_edge(self) -> None:
        """Start the profiler after the PROFILE_AFTER-th steady main chunk, stop it `profile`
        main chunks later and summarize (the side batch's chunks queued between are in it)."""
        from torch.profiler import ProfilerActivity, profile
        first = FIRST_CHUNKS + PROFILE_AFTER
        if self.main_chunks == first:
            self.sync()
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
            self.profiler = profile(activities=activities)
            self.profiler.start()
            self.profiled_from = time.perf_counter()
        elif self.main_chunks == first + self.profile and self.profiler is not None:
            self.sync()
            wall = time.perf_counter() - self.profiled_from
            self.profiler.stop()
            from benchmarks.common import profile_summary
            n = self.profile
            events = self.profiler.key_averages()
            kernels, table, summary = profile_summary(self.profiler, n, self.cuda, "steady chunks",
                                                      events=events)
            host = events.table(sort_by="self_cpu_time_total", row_limit=25)
            self.marks["profile"] = {"chunks": n, "wall_ms_per_chunk": wall * 1e3 / n,
                                     "note": "under the profiler: its overhead is in the wall",
                                     "summary": summary, "kernels": kernels,
                                     "table_device": table, "table_host": host}
            self.profiler = None

    def begin(self) -> None:
        self.marks["called"] = self.now()

    def end(self) -> None:
        self.sync()
        self.marks["returned"] = self.now()
        if self.marks["first_done"] is None:
            self.marks["first_done"] = self.marks["loop_end"]


# ------------------------------------------------------------------------------- the study
def variants(recipes: list[str], kv_keep: list[str]) -> list[tuple[str, str, object]]:
    """(name, recipe, kv_keep) of each model: a recipe's own shape ("recipe") named by the recipe,
    another kv_keep as "<recipe> kv_keep=K"."""
    out = []
    for recipe in recipes:
        for k in kv_keep:
            out.append((recipe if k == "recipe" else f"{recipe} kv_keep={k}", recipe, k))
    return out


def run_plan(cases: list[str], first: bool, cold: list[str] | None = None) -> list[tuple[str, str]]:
    """(case, "cold" or "warm") of a model's runs, in order. The first model of a tokenizer: the
    `cold` cases (default all) cold, short_doc's first of all (the command's first process,
    where the kernels compile), then each case warm, short_doc's last; another model: 64_lanes
    and 1m_doc warm."""
    cold = cases if cold is None else cold
    long = [c for c in ("64_lanes", "1m_doc") if c in cases]
    short = ["short_doc"] if "short_doc" in cases else []
    if not first:
        return [(c, "warm") for c in long]
    return [(c, "cold") for c in short + long if c in cold] + [(c, "warm") for c in long + short]


def headline(cases: dict, recipe: str, zero: str) -> dict:
    """The goals' keys of the headline recipe (warm runs), and its kv_keep=0 shape's beside."""
    def warm(case, name, key):
        run = cases.get(case, {}).get(name, {}).get("warm", {})
        return run.get(key)
    out = {"headline_recipe": recipe,
           "eval_tok_s_64_lanes": warm("64_lanes", recipe, "tok_s"),
           "eval_tok_s_1m_doc": warm("1m_doc", recipe, "tok_s"),
           "eval_tok_s_64_lanes_kv_keep_0": warm("64_lanes", zero, "tok_s"),
           "eval_tok_s_1m_doc_kv_keep_0": warm("1m_doc", zero, "tok_s"),
           "peak_mem_gb_64_lanes": warm("64_lanes", recipe, "peak_mem_gb"),
           "peak_mem_gb_1m_doc": warm("1m_doc", recipe, "peak_mem_gb"),
           "peak_mem_gb_short_doc": warm("short_doc", recipe, "peak_mem_gb"),
           # a 1/16 document's whole command: mostly what any run costs before and after its pass
           "short_doc_wall_s": warm("short_doc", recipe, "wall_s"),
           # the recall recipe as loaded, whole command, where --recipes has it
           "kept4096_bytes_s": warm("64_lanes", "recall", "bytes_s")}
    goals = GOALS | (KEPT_GOAL if "recall" in cases.get("64_lanes", {}) else {})
    out["meets_goals"] = {k: (out[k] is not None and out[k] >= goal) for k, goal in goals.items()}
    return out


def slug(name: str) -> str:
    """A model's or run's name as a file name: "wt103-70m kv_keep=0" -> "wt103-70m_kv_keep0"."""
    return name.replace(" ", "_").replace("=", "")


def describe(case: str, name: str, kind: str, r: dict) -> str:
    """A run's line (a breakdown's: its phases too)."""
    if "error" in r:
        return f"{case:10s} {name:24s} {kind}: FAILED (rc {r.get('rc')}): {r['error'].strip()[-300:]}"
    if kind == "breakdown":
        return format_breakdown(case, name, r)
    if kind == "profile":
        p = r["profile"]
        device = p["summary"]["device_ms_per_step"]
        kinds = ", ".join(f"{k} {v:.2f}" for k, v in list(p["summary"]["by_kind"].items())[:8])
        return (f"{case} {name} profile: {p['chunks']} steady chunks, {p['wall_ms_per_chunk']:.2f} "
                f"ms wall a chunk (profiled), device {device:.2f} ms: {kinds}\n{p['table_host']}")
    peak = f", peak {r['peak_mem_gb']:.2f} GB" if r.get("peak_mem_gb") is not None else ""
    return (f"{case:10s} {name:24s} {kind:5s}: {r['tokens']:,} tokens in {r['wall_s']:.2f} s "
            f"({fmt_rate(r['tok_s'])} tokens/s{peak}; {r['triton_cache_new_files']} new kernel files)")


def study(args) -> int:
    import torch
    smoke = args.cpu_smoke
    sizes = dict(SIZES["smoke" if smoke else "gpu"])
    for key in ("lanes", "corpus_tokens", "doc_tokens"):
        if getattr(args, key):
            sizes[key] = getattr(args, key)
    if not smoke and not torch.cuda.is_available():
        sys.exit("error: eval_speed.py times eval.py on a GPU; --cpu-smoke runs it on the CPU")
    recipes = [r for r in args.recipes.split(",") if r]
    for r in recipes:
        if r not in RECIPE_TOKENIZER:
            sys.exit(f"error: --recipes {r}: expected some of {', '.join(RECIPE_TOKENIZER)}")
    keeps = [k.strip() for k in args.kv_keep.split(",") if k.strip()]
    if not keeps or any(k != "recipe" and not k.isdigit() for k in keeps):
        sys.exit(f"error: --kv-keep {args.kv_keep}: expected 'recipe' and/or counts, e.g. recipe,0")
    if args.cases is None:
        args.cases = "64_lanes,1m_doc" if smoke else ",".join(CASES)
    cases = [c for c in args.cases.split(",") if c]
    if args.breakdown is None:
        args.breakdown = "64_lanes" if smoke else "64_lanes,1m_doc"
    cold = cases if args.cold is None else [c for c in args.cold.split(",") if c]
    chosen = [c for c in args.breakdown.split(",") if c] + cold
    if not cases or not all(c in CASES for c in cases) or not all(c in cases for c in chosen):
        sys.exit(f"error: --cases, --cold, --breakdown: expected some of {', '.join(CASES)} (those "
                 f"of --cold and --breakdown among --cases)")
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="eval-speed-"))
    for sub in ("ckpt", "text", "cache", "json"):   # this benchmark's scratch, made again
        shutil.rmtree(work / sub, ignore_errors=True)
        (work / sub).mkdir(parents=True)
    timeout = args.timeout or (120 if smoke else 300)
    report = {"goals": GOALS | KEPT_GOAL, "reference": REFERENCE, "smoke": smoke,
              "sizes": sizes | {"short_share": SHORT_SHARE},
              "cases": {c: {} for c in cases}, "models": {}, "corpora": {}, "failures": []}

    from data_packing import load_tokenizer
    models, texts = [], {}   # texts: the text folders of each tokenizer
    for name, recipe, keep in variants(recipes, keeps):
        tok = ("bytes" if smoke or RECIPE_TOKENIZER[recipe] == "bytes"
               else str(TOKENIZERS / RECIPE_TOKENIZER[recipe]))
        tok_name = Path(tok).name
        if tok_name not in texts:
            texts[tok_name] = work / "text" / tok_name
            t0 = time.perf_counter()
            report["corpora"][tok_name] = write_corpora(texts[tok_name], load_tokenizer(tok), sizes,
                                                        site_packages=not smoke)
            report["corpora"][tok_name]["write_s"] = time.perf_counter() - t0
        export = work / "ckpt" / slug(name)
        report["models"][name] = build_export(recipe, keep, tok, export, smoke)
        print(f"{name}: {report['models'][name]['parameters']:,} parameters, saved to {export}",
              file=sys.stderr, flush=True)
        models.append((name, tok_name, export))

    first_of = {}
    breakdowns = [c for c in args.breakdown.split(",") if c]
    for name, tok_name, export in models:
        first = first_of.setdefault(tok_name, name) == name
        plan = run_plan(cases, first, cold) + [(c, "breakdown") for c in breakdowns if first]
        plan += [(c, "profile") for c in breakdowns if first and args.profile]
        for case, kind in plan:
            lanes = sizes["lanes"] if case == "64_lanes" else 1
            cache = work / "cache" / f"{tok_name}-{case}"
            tag = slug(f"{case}-{name}-{kind}")
            if kind in ("breakdown", "profile"):
                r = breakdown_run(case, export, texts[tok_name] / case, lanes, cache, work / "json",
                                  tag, smoke, timeout, args.profile if kind == "profile" else 0)
            else:
                r = eval_run(export, texts[tok_name] / case, lanes, cache,
                             work / "json" / f"{tag}.json", smoke, timeout, cold=kind == "cold")
            report["cases"][case].setdefault(name, {})[kind] = r
            print(describe(case, name, kind, r), flush=True)
            if "error" in r:
                report["failures"].append(f"{case} {name} {kind}: rc {r['rc']}")

    for runs in (r for by_model in report["cases"].values() for r in by_model.values()):
        if "wall_s" in runs.get("cold", {}) and "wall_s" in runs.get("warm", {}):
            runs["cold_extra_s"] = runs["cold"]["wall_s"] - runs["warm"]["wall_s"]
    head = recipes[0] if HEADLINE_RECIPE not in recipes else HEADLINE_RECIPE
    zero = next((n for n, r, k in variants(recipes, keeps) if r == head and k == "0"), None)
    report = headline(report["cases"], head, zero) | report
    device = torch.device("cpu" if smoke else "cuda")
    from benchmarks.common import environment, write_report
    report = environment(device) | report
    gpu = "cpu" if smoke else torch.cuda.get_device_name()
    path = write_report(report, "eval_speed", args.out, smoke, gpu)
    if not args.work:   # a folder of its own: the runs' JSON kept, the models and data not
        for sub in ("ckpt", "text", "cache"):
            shutil.rmtree(work / sub, ignore_errors=True)
    print(f"64 lanes: {fmt_rate(report['eval_tok_s_64_lanes'])} tokens/s (goal 2.5M); one 1M-token "
          f"document: {fmt_rate(report['eval_tok_s_1m_doc'])} (goal 500K); wrote {path}")
    if report["failures"]:
        print(f"failures: {report['failures']}", file=sys.stderr)
        return 1
    return 0


def fmt_rate(v) -> str:
    return "-" if v is None else f"{v / 1e6:.2f}M" if v >= 1e6 else f"{v / 1e3:.0f}K"


def format_breakdown(case: str, name: str, b: dict) -> str:
    lines = [f"{case} {name} breakdown: {b['tokens']:,} tokens in {b['wall_s']:.2f} s "
             f"({fmt_rate(b['tok_s'])} tokens/s; the goal's wall {b['goal_wall_s']:.2f} s; the "
             f"steady chunks {fmt_rate(b['steady_tok_s'] or 0)} tokens/s)"]
    lines += [f"    {k[:-2]:22s} {v:8.3f} s  {b['shares'][k]:6.1%}" for k, v in b["phases"].items()]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recipes", default=HEADLINE_RECIPE,
                    help=f"comma-separated, of {', '.join(RECIPE_TOKENIZER)} (default {HEADLINE_RECIPE})")
    ap.add_argument("--kv-keep", default="recipe,0",
                    help="the models' model.kv_keep: 'recipe' (its own) and/or counts (default "
                         "recipe,0: the recipe's and the shape before kept tokens)")
    ap.add_argument("--cases", default=None,
                    help=f"some of {', '.join(CASES)} (default all; smoke 64_lanes,1m_doc)")
    ap.add_argument("--cold", default=None,
                    help="cases also run cold, their data cache emptied first (default: every "
                         "case; '' for none)")
    ap.add_argument("--breakdown", default=None,
                    help="cases whose warm run is also timed phase by phase (default "
                         "64_lanes,1m_doc; smoke 64_lanes; '' for none)")
    ap.add_argument("--profile", type=int, default=0, metavar="N",
                    help="then one more warm run of each --breakdown case with N steady chunks "
                         "under torch's profiler: device and host time a chunk, kernels by kind, "
                         "operators by host time (default 0: none)")
    ap.add_argument("--lanes", type=int, default=0, help="64_lanes' lanes (default 64; smoke 4)")
    ap.add_argument("--corpus-tokens", type=int, default=0,
                    help="64_lanes' tokens, about (default 16M; smoke 12K)")
    ap.add_argument("--doc-tokens", type=int, default=0,
                    help="1m_doc's tokens, at least (default 2^20; smoke 3K)")
    ap.add_argument("--timeout", type=float, default=0, help="seconds a run may take (default 300)")
    ap.add_argument("--work", help="scratch folder (its ckpt, text, cache and json made again and "
                                   "kept; default a new temporary folder, its runs' JSON kept)")
    ap.add_argument("--out", help="result file (default benchmarks/results/eval_speed_<gpu>.json)")
    ap.add_argument("--cpu-smoke", action="store_true",
                    help="a tiny model, the stdlib's text, bytes as tokens, on the CPU")
    ap.add_argument("--child", metavar="SPEC", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:   # and ends as eval.py does (its exit_now: no interpreter teardown)
        import eval as eval_cli
        eval_cli.exit_now(child(args.child))
    return study(args)


if __name__ == "__main__":
    sys.exit(main())
