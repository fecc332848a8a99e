"""Long context in the recipes users train (issue 70), and what each carried part is worth (issue 71).

The wt103-70m recipe's model, optimizer and schedule (Pythia's tokenizer) trained on real long
documents that every GPU machine has offline: the Python source of its standard library and
site-packages, files held out by path for evaluation (data_packing.sources' 90/5/5 split). Beside
it, on the same data and the same tokens per step, an all-attention model of the same size trained
at a context of 8K tokens with flash attention (SDPA's causal kernel), read at evaluation with a
sliding window of its trained context.

    python benchmarks/long_study.py prepare VARIANT[,VARIANT]       # tokenize their corpora once
    python benchmarks/long_study.py train VARIANT [--steps N] [--stop-after-s S]   # resumes
    python benchmarks/long_study.py score VARIANT [--drops] [--needle-1m] [--needle-drop PART]
                                                 [--lite] [--kv-keep N]
    python benchmarks/long_study.py speed VARIANT [--steps 60]      # alone on the GPU
    python benchmarks/long_study.py report [--hybrid today] [--out FILE]   # one results file
    python benchmarks/long_study.py smoke                           # every part, tiny, on the CPU

--recipe fineweb-124m (GPT-2's tokens) or default (bytes, the CPU quick start's model; no
transformer: its 2,048 tokens a step are under the transformer's context) studies that recipe
the same way, in --runs of its own: `today` is its file as it is, `before` the same (neither took
the mix), `with-mix` what wt103-70m took.

Variants (RUNS/<variant>, default RUNS = /tmp/long-study):
  today         configs/wt103-70m.toml as it is: since 2026-12-07 keep-mix-varied's training (keep
                cost, a quarter recall mix, curriculum) read with its 128 kept tokens; `today`
                runs before that are `before` (and before that had 8 memory slots, `memory`)
  before        the recipe before it took the mix: no keep cost, mix or curriculum
  keep          + the recall recipe's kept-token settings (kept tokens charged and dropped in
                training, 4,096 kept at inference reading 128) and its length curriculum
  keep-mix      + a fifth of the training text as recall documents (data.recall_mix)
  keep-model    the kept-token settings alone, without the drop (a recipe's [model]; no
                curriculum); -bptt8: with gradients through 8 chunks (8 lanes, the same tokens a
                step); -bptt8-mix: and a twentieth of the text as recall documents
  keep-mix-half keep without the keep drop, half the text as recall documents, gaps to 16K
                (-varied: each fact in a form drawn from a family; -wide: and gaps to 64K,
                up to 8 facts a document)
  mix-varied    the recipe as it is with a quarter of the text as recall documents, varied forms
                (keep-mix-varied: and the kept-token settings without the drop)
  nomem         the RMT memory off (model.n_mem = 0; the recipe's own since 2026-12-07)
  with-mix      wt103-70m's recall training (its keep cost, recall mix and curriculum, read from
                its file) on the recipe as it is: with --recipe fineweb-124m, what that recipe
                would take (with wt103-70m, `today`)
  memory        8 memory slots (model.n_mem = 8: the recipe before 2026-12-07)
  keep-read     trained with 512 kept slots a layer, each query reading its best 128 (the read
                learns to pick, as it must among 4,096 at inference), keep cost 0.01; -nomem: and
                the memory off
  keep512, window2k, window8k   the recipe as it is with 512 kept tokens, or a window of 2K / 8K
  assoc         the recipe as it is with the attention layers' associative memory (model.kv_assoc)
  transformer   the recipe's depth all attention (AAAAAAAA for wt103-70m), no memory, window or
                kept tokens, chunks of 8,192 (its context), the recipe's tokens a step (4 lanes for
                wt103-70m's 32,768, 16 for fineweb-124m's) with the documents packed back to back (most
                files are shorter than 8K: unpacked, half of each row would be padding), its MLP
                widened to the hybrid's size; today's data (the recipe's mix and curriculum; the
                runs of long_study_2026-12-07_H100.json read keep-mix's)
The 2026-12-07 runs (benchmarks/results/long_study_2026-12-07_H100.json) named keep-mix "recipe"
and keep "recipe-nomix": the recipe file held keep-mix's settings then.

`score` reads the held-out split: the loss over every test file with carried state, the loss by
position over the test files of over 64K tokens (the transformer reads them in chunks of 1,024
with a window of 7,168: every token sees 7K-8K tokens back), and the needle test
(elephant/needle.py: one key at 128 tokens (inside the window), 1K, 4K and 64K, with --needle-1m
also 1M; 8 keys at 64K).
`--drops` adds, over the same long files, a reset every 2K and each carried part dropped after
every chunk (window, kept, assoc, memory, ssm: elephant.evaluate's drop); `--needle-drop kept`
the one-key needle with the kept tokens dropped after every chunk (what the memory alone holds).
A variant named NAME@SEED trains with train.seed=SEED; `report` pairs each with today@SEED (vs_today_paired_nats_per_byte). `report`
gathers every scored variant into benchmarks/results/long_study_<date>_<device>.json with the goals' keys.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

TOKENIZERS = ROOT / "shared" / "data" / "tokenizers"
if not TOKENIZERS.is_dir():
    TOKENIZERS = ROOT.parent / "shared" / "data" / "tokenizers"
# --recipe: the LM recipes studied, each with its own tokenizer (shared/data/tokenizers)
RECIPES = {"wt103-70m": "gpt-neox-20b", "fineweb-124m": "gpt2", "default": "bytes"}
DATA = ["data.source=pycode", "data.site_packages=true", "data.valid_split=",
        "train.eval_every=0", "train.ckpt_every=250", "train.log_every=50", "train.keep_ckpts=1"]
# the recall recipe's kept-token settings (configs/recall.toml) and its length curriculum
_KEEP = ["model.kv_keep_infer=4096", "model.kv_keep_cost=0.01", "model.kv_keep_drop=0.1",
         "data.length_curriculum_steps=300", "data.length_curriculum_start=1024"]


def _mix(share: float, max_gap: int = 65536, forms: str = "") -> list[str]:
    """A `share` of the training text as recall documents cut from the corpus's own text, in the
    mix's forms (`forms`, default the config's; never the needle's), gaps of 64 to `max_gap`
    characters, up to 8 queries each."""
    return [f"data.recall_mix={share}", "data.recall_min_gap=64",
            f"data.recall_max_gap={max_gap}", "data.recall_max_queries=8"] + (
        [f"data.recall_mix_templates={forms}"] if forms else [])




def _settings(keys: tuple[str, ...], model, data) -> list[str]:
    """Overrides that set each dotted config key ("model.x", "data.y") to its value in `model`
    (a ModelConfig) or `data` (a DataConfig)."""
    sections = {"model": model, "data": data}
    return [f"{key}={getattr(sections[key.split('.')[0]], key.split('.')[1])}" for key in keys]


def _defaults(keys: tuple[str, ...]) -> list[str]:
    """Overrides that set each dotted config key to its default."""
    from elephant.config import DataConfig, ModelConfig
    return _settings(keys, ModelConfig(), DataConfig())


# the recipe before it took keep-mix-varied's training (2026-12-07; the baseline of every run
# until then, test loss 0.5006): the settings it took back at their defaults, as the recipe had
# them. Every variant but FROM_TODAY's is this recipe and its own overrides
# the variants that start from the recipe as it is
FROM_TODAY = ("today", "transformer", "with-mix", "keep512", "window2k", "window8k", "assoc")
TOOK = ("model.kv_keep_cost", "data.recall_mix", "data.length_curriculum_steps",
        "data.length_curriculum_start", "data.recall_mix_templates", "data.recall_max_gap",
        "data.recall_min_gap", "data.recall_max_queries")
BEFORE = _defaults(TOOK)


def _took() -> list[str]:
    """Overrides that set each of TOOK's keys to configs/wt103-70m.toml's value: the recall
    training it took (for another recipe, `with-mix`)."""
    from elephant.config import load_config
    cfg = load_config(ROOT / "configs" / "wt103-70m.toml", [])
    return _settings(TOOK, cfg.model, cfg.data)


_MIX = _mix(0.2)   # a fifth of the training text
_BPTT8 = ["model.bptt_chunks=8", "train.lanes=8"]
# the kept-token settings without the drop: a lane's kept tokens dropped after 1 chunk in 10 (the
# recall recipe's, so that its memory must learn) leave a fact 64K tokens back (128 chunks) a
# 0.9^128 ~ 1e-6 chance of outliving them in training, and the memory never learned to carry it
_NODROP = _KEEP[:2]
TF_CONTEXT = 8192   # the transformer's trained context
VARIANTS = {
    "today": [],
    "before": [],   # BEFORE alone
    "keep": _KEEP,
    "keep-mix": _KEEP + _MIX,
    # half the text as recall documents, gaps to 16K characters: more queries a token
    "keep-mix-half": _NODROP + _KEEP[3:] + _mix(0.5, max_gap=16384),
    # the same with each fact in a form drawn from a family (key styles, separators, placements:
    # data_packing/recall.py "varied"), so that recall is learned of what was stated, not of a form
    "keep-mix-half-varied": _NODROP + _KEEP[3:] + _mix(0.5, max_gap=16384, forms="varied"),
    # the same with gaps to 64K characters and up to 8 facts a document (1M and 8 keys fell short)
    "keep-mix-half-varied-wide": _NODROP + _KEEP[3:] + _mix(0.5, forms="varied") + [
        "data.recall_max_pairs=8"],
    # the recipe's model as it is (128 kept tokens, read whole at inference) with a quarter of the
    # text as recall documents in the varied forms: a data setting alone, what a recipe can take
    "mix-varied": _mix(0.25, max_gap=16384, forms="varied"),
    # the same with the kept-token settings (keep cost, 4,096 kept at inference reading 128): a
    # quarter mix alone cost no LM loss and taught no recall (2026-12-07: the kept tokens held
    # the fact at 1K in 8% of documents); the keep cost is what taught the half mix's kept tokens
    "keep-mix-varied": _NODROP + _KEEP[3:] + _mix(0.25, max_gap=16384, forms="varied"),
    # the same trained as it reads at inference: 512 kept slots a layer, each query reading its
    # best 128 (read as loaded, 4,096 reading 128, keep-mix-varied recalled to 64K but its LM loss
    # rose 0.024 over the same weights read with the 128 they trained with: the best 128 of many
    # are distractors to a read that never chose among them)
    "keep-read-mix-varied": _NODROP + _KEEP[3:] + _mix(0.25, max_gap=16384, forms="varied") + [
        "model.kv_keep=512", "model.kv_keep_read=128"],
    # the kept-token settings alone (no curriculum): what a recipe's [model] would take, and with
    # the recall recipe's gradient depth (8 chunks, 8 lanes: the same 32,768 tokens a step)
    "keep-model": _NODROP,
    # the RMT memory off (model.n_mem = 0): what it costs or saves at equal steps and time
    "nomem": ["model.n_mem=0"],
    "memory": ["model.n_mem=8"],
    # wt103-70m's recall training (keep cost, a quarter recall mix in the varied forms, the length
    # curriculum) on the recipe as it is: for --recipe fineweb-124m, what the recipe would take
    # (for wt103-70m, `today` itself)
    "with-mix": None,
    # trained with 4x the kept slots a query reads (512, reading 128), 4,096 kept at inference;
    # the memory off
    "keep-read": _NODROP + ["model.kv_keep=512", "model.kv_keep_read=128"],
    "keep-read-nomem": _NODROP + ["model.kv_keep=512", "model.kv_keep_read=128", "model.n_mem=0"],
    "keep-model-bptt8": _NODROP + _BPTT8,
    "keep-model-bptt8-mix": _NODROP + _BPTT8 + _mix(0.05),   # a twentieth of the text
    # the recipe reaching further back, against the 8K transformer that read code 2K-64K back
    # better (2026-12-07: 0.035-0.062 nats/byte lower from 4K on): 512 kept tokens read whole (as
    # the 128 are: the window's flash kernel, no per-query choice), or a 2,048-token window
    "keep512": ["model.kv_keep=512"],
    "window2k": ["model.kv_window=2048"],
    "window8k": ["model.kv_window=8192"],   # the transformer's reach, and the kept tokens past it
    # issue 71: the attention layers' associative memory, written by the delta rule with what
    # leaves the window at its keep gate (layers/assoc.py)
    "assoc": ["model.kv_assoc=true"],
    # today's data (the recipe's mix and curriculum): the hybrid it is set beside is the recipe
    "transformer": [
        "model.kv_keep_cost=0", "model.n_mem=0", "model.kv_window=0",
        "model.kv_keep=0", "model.attn_x0=false", "model.bptt_chunks=1",
        f"train.chunk_len={TF_CONTEXT}", "data.pack=true"],   # + its layers and lanes: overrides()
}
EVAL_CHUNK = 1024          # the transformer's evaluation chunk; its window: the rest of its context
LONG_TOKENS = 65536        # the position study's files: over this many tokens
INSIDE = ("0-512", "512-1K", "1K-2K", "2K-4K", "4K-8K")
BEYOND = ("16K-32K", "32K-64K", "64K-128K", "128K-256K", "256K-512K", "512K-1M", "1M+")
WORTH = ("8K-16K", "16K-32K")
SMOKE = ["model.d_model=32", "model.n_heads=2", "model.d_mlp=64", "model.d_state=16",
         "model.mamba_head_dim=16", "model.vocab_size=320", "data.tokenizer=bytes",
         "data.site_packages=false", "train.device=cpu", "train.compile=off", "train.lanes=2",
         "model.kv_window=64", "model.kv_keep=8", "model.kv_keep_infer=16",
         "data.recall_max_gap=2048"]


def split_seed(name: str) -> tuple[str, str]:
    """"keep@2" -> ("keep", "2"): a variant trained with train.seed=2 ("" for the recipe's seed),
    so that seeds of one variant and their pairs train side by side (benchmarks.common.split_seed)."""
    from benchmarks.common import split_seed as split
    try:
        return split(name, VARIANTS)
    except KeyError:
        raise SystemExit(f"unknown variant {name!r}; expected one of {', '.join(VARIANTS)}, "
                         "each may end in @SEED") from None


def overrides(name: str, args) -> list[str]:
    """The variant's overrides of the recipe (its run dir and data cache, the steps)."""
    base, seed = split_seed(name)
    out = DATA + [f"data.tokenizer={args.tokenizer}", f"data.cache_dir={args.cache}",
                  f"train.max_steps={args.steps}", f"train.run_dir={Path(args.runs) / name}"]
    own = _took() if base == "with-mix" else VARIANTS[base]
    out += ([] if base in FROM_TODAY else BEFORE) + own + ([f"train.seed={seed}"] if seed else [])
    if args.smoke:
        out += SMOKE + (["train.chunk_len=256", "train.lanes=1"] if base == "transformer" else [])
    if base == "transformer":   # the recipe's depth all attention, its tokens a step, its MLP
        from elephant.config import load_config   # widened until it has the recipe's parameters
        recipe = recipe_path(args)
        today = overrides("today", args)
        r = load_config(recipe, today)
        out.append(f"model.layers={'A' * len(r.model.layers)}")
        step = r.train.lanes * r.train.chunk_len * r.model.bptt_chunks
        if not args.smoke:   # (the smoke's own lanes and context stand)
            if step % TF_CONTEXT:
                raise SystemExit(f"transformer: {recipe.name} takes {step:,} tokens a step, not a "
                                 f"multiple of the transformer's context ({TF_CONTEXT:,})")
            out.append(f"train.lanes={step // TF_CONTEXT}")
        out.append(f"model.d_mlp={matched_mlp(out, params(today, recipe), recipe)}")
    return out


def paired(scores: dict) -> dict:
    """Each variant's test loss minus today's at the same seed (nats/byte), per seed and their mean:
    {variant: {"by_seed": {seed: diff}, "mean": ...}}."""
    out: dict = {}
    for name, score in scores.items():
        base, seed = split_seed(name)
        today = scores.get("today" + (f"@{seed}" if seed else ""))
        if base != "today" and today:
            diff = score["test"]["nats_per_byte"] - today["test"]["nats_per_byte"]
            out.setdefault(base, {"by_seed": {}})["by_seed"][seed or "recipe"] = diff
    for row in out.values():
        row["mean"] = statistics.mean(row["by_seed"].values())
    return out


def params(overrides: list[str], recipe: Path) -> int:
    """The parameter count of the recipe's model under `overrides`."""
    from elephant.config import load_config
    from elephant.model import ElephantLM
    import torch
    with torch.device("meta"):   # counted, not allocated
        return ElephantLM(load_config(recipe, overrides).model).num_params()


def matched_mlp(overrides: list[str], target: int, recipe: Path) -> int:
    """The d_mlp (a multiple of 64) that brings the count closest to `target` (it is linear in
    d_mlp: two points give the line)."""
    p64, p128 = (params(overrides + [f"model.d_mlp={d}"], recipe) for d in (64, 128))
    return max(64, 64 + 64 * round((target - p64) / ((p128 - p64) / 64) / 64))


def recipe_path(args) -> Path:
    """The recipe studied: configs/<--recipe>.toml (default wt103-70m)."""
    return ROOT / "configs" / f"{getattr(args, 'recipe', 'wt103-70m')}.toml"


def config(name: str, args):
    from elephant.config import load_config
    return load_config(recipe_path(args), overrides(name, args))


def _prepare_one(name: str, split: str, args) -> str:
    from elephant.evaluate import open_corpus
    t0 = time.perf_counter()
    corpus = open_corpus(config(name, args).data, split, progress=False)[1]
    return (f"[{name}] {split}: {len(corpus)} documents, {corpus.n_tokens / 1e6:.1f}M tokens "
            f"({time.perf_counter() - t0:.0f} s)")


def prepare(args) -> int:
    """Tokenize the corpora of the variants named (comma-separated) once, so that variants trained
    side by side find them built: each distinct corpus once (variants that read the same data share
    it), the training corpora side by side in processes of their own (a recall mix's documents are
    made in the reading process: alone, two mixes took ~75 s each on the H100 host, one after
    the other), the test corpus first."""
    from concurrent.futures import ProcessPoolExecutor

    from elephant.evaluate import corpus_request

    def first_of_each(split: str) -> list[str]:
        """The first variant of each distinct corpus of `split` (what get_corpus builds from)."""
        seen: dict[str, str] = {}
        for name in args.variant.split(","):
            key = json.dumps(corpus_request(config(name, args).data, split), sort_keys=True,
                             default=str)
            seen.setdefault(key, name)
        return list(seen.values())
    for name in first_of_each("test"):   # the mix is the training split's alone
        print(_prepare_one(name, "test", args), file=sys.stderr, flush=True)
    names = first_of_each("train")
    if len(names) == 1:
        lines = [_prepare_one(n, "train", args) for n in names]
    else:
        import multiprocessing as mp
        with ProcessPoolExecutor(len(names), mp_context=mp.get_context("spawn")) as pool:
            lines = list(pool.map(_prepare_one, names, ["train"] * len(names), [args] * len(names)))
    for line in lines:
        print(line, file=sys.stderr, flush=True)
    return 0


def train(args) -> int:
    """Train (or go on training) one variant until its steps or `--stop-after-s`."""
    from elephant.trainer import Trainer
    cfg = config(args.variant, args)
    resume = (Path(cfg.train.run_dir) / "checkpoints" / "latest").is_file()
    # a run dir without a checkpoint is a start that died (2026-12-07: a CUDA fault at step ~200
    # beside another run): begun again, the dead start moved aside (`<variant>.old-<time>`)
    trainer = Trainer(cfg, resume=resume, progress=False,
                      restart=not resume and Path(cfg.train.run_dir).is_dir())
    t0 = time.perf_counter()
    result = trainer.fit(stop_after_s=args.stop_after_s)
    print(f"[{args.variant}] step {result['step']} of {cfg.train.max_steps} in "
          f"{time.perf_counter() - t0:.0f} s{' (resumed)' if resume else ''}", file=sys.stderr)
    return 0


def train_log(run_dir: Path) -> dict:
    """A run's steps, its median training tokens/s and last loss, from log.jsonl."""
    rows = [json.loads(line) for line in (run_dir / "log.jsonl").read_text().splitlines() if line]
    steps = [r for r in rows if r.get("kind") == "train"]
    rates = [r["tokens_per_s"] for r in steps[1:]] or [r["tokens_per_s"] for r in steps]
    # wall_s: from the run's first record to its last training step, compilation included; the
    # time to train when the run went in one process alone on the GPU (side by side, shared)
    return {"steps": steps[-1]["step"] if steps else 0,
            "wall_s": round(steps[-1]["time"] - rows[0]["time"], 1) if steps and "time" in rows[0] else None,
            "tokens_per_s_median": statistics.median(rates) if rates else None,
            "last_loss": steps[-1]["loss"] if steps else None,
            "curve": [(r["step"], round(r["loss"], 4)) for r in steps]}


def load(name: str, args, device):
    """The trained variant as evaluation reads it; the transformer with its sliding window."""
    from elephant.hub import from_pretrained
    run = Path(args.runs) / name
    model, tokenizer, cfg = from_pretrained(run, device=device, kv_keep=args.kv_keep or None)
    chunk_len = cfg["train"]["chunk_len"]
    if split_seed(name)[0] == "transformer":
        from elephant.config import ModelConfig
        from elephant.model import ElephantLM
        chunk_len = min(EVAL_CHUNK, chunk_len)
        window = ModelConfig(**(cfg["model"] | {"kv_window": max(chunk_len, chunk_len * (
            cfg["train"]["chunk_len"] // chunk_len - 1))}))
        slid = ElephantLM(window).to(device)
        slid.load_state_dict(model.state_dict())
        model = slid.eval()
    return model, tokenizer, cfg, chunk_len


def band_losses(ev: dict, bytes_per_token: float) -> dict:
    """{band: loss in nats per byte} of an evaluation's position curve."""
    return {k: v["loss"] / bytes_per_token for k, v in ev["position_buckets"].items()}


def score(args) -> int:
    import torch

    from benchmarks.lm_study import long_documents
    from elephant.evaluate import evaluate, open_corpus
    from elephant.needle import autocast_for, needle_test, text_for
    name = args.variant
    cuda = torch.cuda.is_available() and not args.smoke
    device = torch.device("cuda" if cuda else "cpu")
    seconds, mark = {}, [time.perf_counter()]   # each phase's wall time: a call's scoring planned

    def phase(key: str) -> None:
        now = time.perf_counter()
        seconds[key], mark[0] = round(now - mark[0], 1), now
    model, tokenizer, cfg, chunk_len = load(name, args, device)
    data = config(name, args).data
    test = open_corpus(data, "test", progress=False)[1]
    long_test = long_documents(test, args.long_tokens, args.long_docs)
    phase("load")
    autocast = autocast_for(device)
    common = dict(chunk_len=chunk_len, device=device, autocast=autocast, cuda_graph=cuda,
                  compact=True, side=cuda)
    out = {"variant": name, "params": model.num_params(), "chunk_len": chunk_len,
           "kv_window": model.cfg.kv_window, "kv_keep": model.cfg.kv_keep,
           "kv_keep_read": model.cfg.kv_keep_read, "train": train_log(Path(args.runs) / name),
           "seconds": seconds}
    t0 = time.perf_counter()
    ev = evaluate(model, test, lanes=64, max_docs=args.test_docs, **common)
    out["test"] = {k: ev[k] for k in ("loss", "bits_per_byte", "documents", "tokens", "bytes")}
    out["test"]["nats_per_byte"] = ev["loss"] * ev["tokens"] / ev["bytes"]
    out["test"]["seconds"] = time.perf_counter() - t0
    print(f"[{name}] test loss {ev['loss']:.4f}, {out['test']['nats_per_byte']:.4f} nats/byte over "
          f"{ev['documents']} files", file=sys.stderr, flush=True)
    phase("test")
    if args.lite:   # the loss over the test files alone
        return write_score(args, name, out)
    # what is measured is kept as it comes: a scorer stopped by its call's timeout (2026-12-07:
    # two, in the label form's needle after 200 s read with 4,096 kept tokens) leaves its phases
    # done in score.json, marked `partial` with the last phase written
    write_score(args, name, {**out, "partial": "test"})
    runs = {"carried": {}}
    if args.drops:
        from elephant.state import carried_parts   # the parts this variant carries
        runs |= {"reset-2K": {"reset_every": 2048}, **{f"drop-{p}": {"drop": (p,)} for p in
                                                        carried_parts(model.cfg) if p != "delta"}}
    out["long"] = {"documents": len(long_test), "min_tokens": args.long_tokens}
    for kind, extra in runs.items():
        if not len(long_test):
            break
        t0 = time.perf_counter()
        ev = evaluate(model, long_test, lanes=min(32, len(long_test)), **common, **extra)
        bpt = ev["bytes"] / ev["tokens"]
        out["long"][kind] = {"nats_per_byte": ev["loss"] / bpt, "bands": band_losses(ev, bpt),
                             "tokens": ev["tokens"], "seconds": time.perf_counter() - t0}
        print(f"[{name}] {len(long_test)} files over {args.long_tokens // 1024}K tokens, {kind}: "
              f"{ev['loss'] / bpt:.4f} nats/byte", file=sys.stderr, flush=True)
    phase("long")
    if args.no_needle:   # the test loss and the long files' bands alone
        return write_score(args, name, out)
    write_score(args, name, {**out, "partial": "long"})
    haystack = text_for(data, "test")
    phase("haystack")
    log = lambda m: print(f"[{name}] {m}", file=sys.stderr, flush=True)   # noqa: E731
    # 128: inside the window, where copying needs no carried state (is the value copied at all?)
    short = [128, 1024, 4096, 65536] if not args.smoke else [256, 1024]
    lanes, long_lanes = (64, 16) if not args.smoke else (2, 1)
    distances = short + ([1 << 20] if args.needle_1m and not args.smoke else [])
    one = needle_test(model, tokenizer, haystack, distances, chunk_len, device, keys=(1,),
                      lanes=lanes, long_lanes=long_lanes, autocast=autocast, log=log)
    multi = needle_test(model, tokenizer, haystack, short[-1:], chunk_len, device, keys=(8,),
                        lanes=lanes, long_lanes=long_lanes, autocast=autocast, log=log)
    out["needle"] = {k: v for r in (one, multi) for k, v in r.items() if k.startswith("needle_")}
    write_score(args, name, {**out, "partial": "needle"})
    if args.needle_drop:   # the one key again with a carried part dropped after every chunk
        alone = needle_test(model, tokenizer, haystack, distances[1:], chunk_len, device, keys=(1,),
                            lanes=lanes, long_lanes=long_lanes, autocast=autocast, log=log,
                            ablation=args.needle_drop)
        out[f"needle_without_{args.needle_drop}"] = {k: v for k, v in alone.items()
                                                     if k.startswith("needle_")}
        write_score(args, name, {**out, "partial": "needle-drop"})
    # the mix's own form at every short distance (one pass): recall of a trained form beside
    # the held-out one's (what the mix taught, and what of it carries over to another form)
    trained = needle_test(model, tokenizer, haystack, short, chunk_len, device, keys=(1,),
                          lanes=lanes, long_lanes=long_lanes, form="label", autocast=autocast, log=log)
    phase("needle")
    print(f"[{name}] seconds: {seconds}", file=sys.stderr, flush=True)
    out["needle_label_form"] = {k: v for k, v in trained.items() if k.startswith("needle_")}
    out["needle_passes"] = [{k: p[k] for k in ("keys", "by_distance", "lanes", "tokens_per_s",
                                                "template")} for r in (one, multi, trained)
                            for p in r["passes"]]
    return write_score(args, name, out)


def score_path(args, name: str) -> Path:
    """RUNS/<variant>/score.json (what `report` gathers); read with `--kv-keep N` kept tokens,
    score-keep<N>.json beside it."""
    return Path(args.runs) / name / (f"score-keep{args.kv_keep}.json" if args.kv_keep else "score.json")


def write_score(args, name: str, out: dict) -> int:
    """A variant's scores into `score_path`, whole or not at all."""
    path = score_path(args, name)
    tmp = path.with_name(path.name + ".tmp")   # whole or not at all: a kill mid-write keeps the last
    tmp.write_text(json.dumps(out, indent=1))
    tmp.replace(path)
    print(f"[{name}] wrote {path}" + (f" (partial: to {out['partial']})" if "partial" in out else ""),
          file=sys.stderr)
    return 0


def speed(args) -> int:
    """The variant's training tokens/s alone on the GPU: `--steps` steps from scratch in a run dir
    of its own, the median of the log records after the first (compilation)."""
    import shutil

    from elephant.trainer import Trainer
    args.runs = str(Path(args.runs) / "speed")
    cfg = config(args.variant, args)
    cfg.train.log_every, cfg.train.ckpt_every = 10, 0
    shutil.rmtree(cfg.train.run_dir, ignore_errors=True)
    Trainer(cfg, progress=False).fit()
    log = train_log(Path(cfg.train.run_dir))
    rows = [json.loads(line) for line in (Path(cfg.train.run_dir) / "log.jsonl").read_text().splitlines()]
    rates = [r["tokens_per_s"] for r in rows if r.get("kind") == "train"][2:]
    out = {"variant": args.variant, "steps": log["steps"],
           "tokens_per_s": statistics.median(rates) if rates else None}
    (Path(args.runs).parent / f"speed-{args.variant}.json").write_text(json.dumps(out))
    print(f"[{args.variant}] alone: {out['tokens_per_s']:,.0f} tokens/s", file=sys.stderr)
    return 0


def mean_gap(a: dict, b: dict, bands) -> float | None:
    """The mean over `bands` held by both of a[band] - b[band]."""
    common = [k for k in bands if k in a and k in b]
    return sum(a[k] - b[k] for k in common) / len(common) if common else None


def worth(long: dict) -> dict:
    """What the carried parts are worth over 8K-32K, from a score's long-file runs (score
    --drops): each dropped part's loss increase (part_worth_8k_32k; memory_worth_8k_32k where the
    variant has a memory to drop) and the reset every 2K's (context_gain_8k_32k). {} without
    --drops."""
    if "reset-2K" not in long:
        return {}
    carried = long["carried"]["bands"]
    parts = {k.removeprefix("drop-"): mean_gap(v["bands"], carried, WORTH)
             for k, v in long.items() if k.startswith("drop-")}
    memory = "memory" if "memory" in parts else "assoc"   # the RMT memory, else kv_assoc's
    return {**({"memory_worth_8k_32k": parts[memory]} if memory in parts else {}),
            "part_worth_8k_32k": parts,
            "context_gain_8k_32k": mean_gap(long["reset-2K"]["bands"], carried, WORTH)}


def report(args) -> int:
    from benchmarks.common import environment
    runs = Path(args.runs)
    scores = {p.parent.name: json.loads(p.read_text()) for p in sorted(runs.glob("*/score.json"))}
    speeds = {p.stem.removeprefix("speed-"): json.loads(p.read_text())
              for p in sorted(runs.glob("speed-*.json"))}
    recipe_name = recipe_path(args).stem
    out = {"benchmark": "long_study", "recipe": recipe_name,
           **environment("cpu" if args.smoke else None),
           "steps_trained": {k: v["train"]["steps"] for k, v in scores.items()},
           "variants": scores, "speed": speeds}
    # variants scored again with another number of kept tokens at inference (score --kv-keep)
    rescored = {f"{p.parent.name} read with {p.stem.removeprefix('score-keep')} kept":
                json.loads(p.read_text()) for p in sorted(runs.glob("*/score-keep*.json"))}
    if rescored:
        out["read_with_other_kept"] = rescored
    # scorers stopped before their last phase: what each reached (its score holds the phases before)
    partial = {name: s["partial"] for name, s in {**scores, **rescored}.items() if "partial" in s}
    if partial:
        out["partial"] = partial
    recipe, tf = scores.get(args.hybrid), scores.get("transformer")
    if recipe:
        out |= recipe.get("needle", {})
        alone = recipe.get("needle_without_kept", {})   # the memory alone (issue 71)
        out |= {f"memory_alone_{d}": alone[f"needle_{d}"] for d in ("4k", "64k", "1m")
                if f"needle_{d}" in alone}
        carried = recipe.get("long", {}).get("carried", {}).get("bands", {})
        out |= worth(recipe.get("long", {}))
        if tf and "carried" in tf.get("long", {}):
            theirs = tf["long"]["carried"]["bands"]
            out["vs_long_transformer_inside"] = mean_gap(theirs, carried, INSIDE)
            out["vs_long_transformer_beyond"] = mean_gap(theirs, carried, BEYOND)
    if args.hybrid in speeds and "transformer" in speeds and speeds["transformer"]["tokens_per_s"]:
        out["speed_vs_long_transformer"] = (speeds[args.hybrid]["tokens_per_s"]
                                            / speeds["transformer"]["tokens_per_s"])
    out["vs_today_paired_nats_per_byte"] = paired(scores)
    for name, score in scores.items():   # the LM loss over every test file, paired (same seed)
        if name not in (args.hybrid, "transformer"):
            out[f"{args.hybrid}_minus_{name}_nats_per_byte".replace("-", "_")] = (
                recipe["test"]["nats_per_byte"] - score["test"]["nats_per_byte"]) if recipe else None
    path = Path(args.out) if args.out else (
        Path("/tmp") / "long_study_smoke.json" if args.smoke else ROOT / "benchmarks" / "results" /
        f"long_study_{'' if recipe_name == 'wt103-70m' else recipe_name + '_'}"
        f"{time.strftime('%Y-%m-%d')}_{out['device'].replace(' ', '_')}.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1) + "\n")
    keys = [k for k in out if k.startswith(("needle", "vs_", "speed_vs", "memory_worth", "context_gain"))
            or "_minus_" in k]
    print(json.dumps({k: out[k] for k in keys}, indent=1))
    print(f"wrote {path}", file=sys.stderr)
    return 0


def import_scores(args) -> int:
    """Variants' scores from an earlier results file (`--from`: a `report` output) into
    `score_path`, so that `report` sets them beside this run's (a transformer scored in an
    earlier session at the same steps and seed, say). The variants named (comma-separated); a
    score already there is kept."""
    if not args.from_:
        raise SystemExit("import: give --from FILE, an earlier results file")
    path = Path(args.from_)
    if not path.is_file():
        raise SystemExit(f"import: --from must name an earlier results file; {path} is not a file")
    earlier = json.loads(path.read_text()).get("variants", {})
    for name in args.variant.split(","):
        if name not in earlier:
            raise SystemExit(f"import: {path.name} has no score of {name!r} (it has "
                             f"{', '.join(earlier) or 'none'})")
        dest = score_path(args, name)
        if dest.exists():
            print(f"[{name}] kept the score in {dest}", file=sys.stderr)
            continue
        dest.parent.mkdir(parents=True, exist_ok=True)
        write_score(args, name, {**earlier[name], "imported_from": path.name})
    return 0


def smoke(args) -> int:
    """Every step at a tiny size on the CPU: train two variants a few steps, score, report."""
    import shutil
    args.smoke, args.steps = True, 4
    shutil.rmtree(args.runs, ignore_errors=True)
    args.variant = "keep-mix,transformer,today"   # two training corpora side by side, one test set
    prepare(args)
    for name in ("keep-mix", "transformer"):
        args.variant, args.stop_after_s = name, 0.0
        train(args)
        args.drops, args.needle_1m = name == "keep-mix", False
        score(args)
    args.variant, args.kv_keep, args.drops, args.lite = "keep-mix", 8, False, True
    score(args)   # read with the kept tokens it trained with, not kv_keep_infer's
    args.kv_keep, args.lite, args.hybrid = 0, False, "keep-mix"   # the hybrid scored above
    return report(args)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("command", choices=("prepare", "train", "score", "speed", "report", "import", "smoke"))
    p.add_argument("variant", nargs="?", default="keep-mix")
    p.add_argument("--hybrid", default="today",
                   help="report: the hybrid whose figures are the goals' keys (default today, the recipe)")
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--stop-after-s", type=float, default=0.0)
    p.add_argument("--runs", default="/tmp/long-study")
    p.add_argument("--cache", default="/tmp/elephant-cache")
    p.add_argument("--recipe", default="wt103-70m", choices=tuple(RECIPES),
                   help="the recipe studied (default wt103-70m); give each its own --runs")
    p.add_argument("--tokenizer", default=None,
                   help="default: the recipe's (shared/data/tokenizers: GPT-NeoX-20B's for "
                        "wt103-70m, GPT-2's for fineweb-124m; bytes for default)")
    p.add_argument("--drops", action="store_true")
    p.add_argument("--needle-1m", action="store_true")
    p.add_argument("--needle-drop", default="", metavar="PART",
                   help="score: the one-key needle again with PART dropped after every chunk "
                        "(kept: the memory alone, issue 71's memory_alone_*)")
    p.add_argument("--lite", action="store_true", help="score: the test loss alone")
    p.add_argument("--no-needle", action="store_true",
                   help="score: the test loss and the long files' loss by band, no needle")
    p.add_argument("--kv-keep", type=int, default=0,
                   help="score: read with this many kept tokens a layer (default: as the variant "
                        "is loaded), into score-keep<N>.json")
    p.add_argument("--long-tokens", type=int, default=LONG_TOKENS)
    p.add_argument("--long-docs", type=int, default=64)
    p.add_argument("--test-docs", type=int, default=0, help="the loss over the first N test files (0: all)")
    p.add_argument("--out")
    p.add_argument("--from", dest="from_", help="import: the earlier results file")
    args = p.parse_args(argv)
    tok = RECIPES[args.recipe]
    args.tokenizer = args.tokenizer or (tok if tok == "bytes" else str(TOKENIZERS / tok))
    args.smoke = False
    if args.command == "smoke":
        args.long_tokens, args.long_docs, args.test_docs = 2048, 3, 8
        args.runs = "/tmp/long-study-smoke"
        args.cache = "/tmp/long-study-smoke-cache"
        return smoke(args)
    return {"prepare": prepare, "train": train, "score": score, "speed": speed,
            "report": report, "import": import_scores}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
