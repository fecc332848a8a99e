"""In-context copying under the LM loss: which part of the hybrid stops it, beside an all-attention
control of the same code, trained in the same run for the same steps.

    python benchmarks/copy_study.py --variants attn,hybrid,mamba,... --steps 800 --out DIR \
        [--shape recall|wt103-70m] [--ckpt-every 200] [--deadline-s 420] [overrides ...]

Every variant trains with the general trainer (`train.py`'s Trainer: the loss on every token) on
the recall corpus (data_packing/recall.py: a 6-digit fact, filler, then the question), one process
each, all at once on one GPU, so that they share its minutes. Then every saved checkpoint is scored
by `elephant.recall.evaluate_recall`: digit accuracy of the answer 128 (and 512) tokens after the
fact, carried state, teacher-forced; chance is 0.10. A variant is the shape's overrides plus its
own (VARIANTS) and, for what no setting expresses (a frozen or zeroed mixer, Adam on the Mamba
projections, a plain GLU), a hook applied to the model before its optimizers are built.

Writes `<out>/<variant>.json` (the training log's losses, recall by step) and `<out>/summary.json`
(device, versions, date, command, and per variant the last checkpoint's accuracy at 128 tokens,
`lm_recall_128` (or `copy`), and the first step that reached 0.99 there; `lm_recall_4k`, `_64k`
and `_1m` where --distances holds 4096, 65536 or 1048576). With kept tokens (model.kv_keep) each
distance also has "<d> held": the share of the fact's value still among the kept tokens that the
answer's chunk reads (lost from them, or kept and not read). COPY_WEIGHTS=<folder> saves each
run's last weights there before scoring (save_weights); `--score <folder>` scores such weights
in a later call, without training. `--cpu-smoke` runs a tiny version on the CPU.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from contextlib import nullcontext
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# The recall recipe's model without its carried parts (memory, window, kept tokens): what copies a
# fact inside one chunk is the stack itself. 64 lanes of 512 bytes, every token in the loss. These
# stack shapes start from the bare stack (attention without model.attn_x0, as before it was a
# setting); the x0 variants turn it on. The *-recipe shapes are the recipes as users train them.
_STACK = ["--config", "configs/recall.toml", "model.attn_x0=false", "model.n_mem=0",
          "model.kv_window=0", "model.kv_keep=0", "model.kv_keep_drop=0", "model.kv_keep_infer=0",
          "model.kv_keep_cost=0", "model.bptt_chunks=1",
          "data.recall_max_gap=2048", "train.chunk_len=512", "train.compile=auto"]
_WIDE = ["model.d_model=512", "model.n_heads=8", "model.d_mlp=1536", "model.layers=MAMMAMMA",
         "model.d_state=64", "train.lanes=32"]          # wt103-70m's width and depth
_TEXT = ["data.recall_filler=pycode", "data.site_packages=true"]


def recipe_model(recipe: str) -> list[str]:
    """Every model setting of `recipe` (configs/NAME.toml) as overrides, its defaults included, so
    that another recipe's file takes that recipe's model whole (the byte vocabulary aside)."""
    from dataclasses import fields

    from elephant.config import load_config
    model = load_config(ROOT / recipe).model
    return [f"model.{f.name}={getattr(model, f.name)}" for f in fields(model)
            if f.name != "vocab_size"]
SHAPES = {
    "recall": _STACK + ["train.lanes=64"],
    # the recall recipe as users train it: memory, window, kept tokens, BPTT over 8 chunks
    "recall-recipe": ["--config", "configs/recall.toml", "data.recall_max_gap=2048"],
    # the recall recipe as users train it, among real text (its gaps up to the recipe's 16K): a
    # fact carried past the window by memory and kept tokens, learned from the LM loss (issue 57;
    # score it at 4096 and 65536 with --distances)
    "recall-recipe-text": ["--config", "configs/recall.toml", *_TEXT],
    # the recall recipe's task, data, schedule and steps (trained on every byte, Python source as
    # the filler) with the wt103-70m recipe's [model] whole: does the LM recipe's model carry a fact
    # past its window (issue 70)? Score it at 4096 and 65536 with --distances
    "wt103-70m-model-recall-text": ["--config", "configs/recall.toml",
                                    *recipe_model("configs/wt103-70m.toml"), *_TEXT],
    # wt103-70m's model as its recipe sets it (memory, window, BPTT 2), on the same bytes
    "wt103-70m-recipe": ["--config", "configs/wt103-70m.toml", "model.vocab_size=320",
                         "data.source=recall", "data.tokenizer=bytes", "data.valid_split=",
                         "data.recall_max_gap=2048", "optim.warmup_steps=50",
                         "optim.schedule=cosine", "optim.cooldown_frac=1.0"],
    # the same stack on recall documents whose filler is real text (Python source: the standard
    # library and site-packages), where copying the fact is a small part of the loss
    "recall-text": _STACK + ["train.lanes=64", *_TEXT],
    # wt103-70m's width and depth (d_model 512, 8 layers) on the same bytes
    "wt103-70m-text": _STACK + _WIDE + _TEXT,
    "wt103-70m": _STACK + _WIDE,
}
SMOKE = ["model.d_model=32", "model.n_heads=2", "model.d_mlp=64", "model.d_state=16",
         "model.mamba_head_dim=16", "model.ssd_chunk=16", "train.lanes=4", "train.chunk_len=64",
         "data.recall_docs=200", "data.recall_max_gap=64", "train.compile=off", "train.device=cpu"]


def every_second_mamba_delta(layers: str) -> str:
    """The layer string with the 2nd, 4th, ... Mamba-2 mixer a delta rule: MAMAMA -> MADAMA."""
    out, seen = [], 0
    for c in layers:
        seen += c == "M"
        out.append("D" if c == "M" and seen % 2 == 0 else c)
    return "".join(out)


# the layer string of a variant from the shape's own (L)
LAYERS = {
    "attn": lambda L: "A" * len(L),                      # all attention, as many layers
    "attn-embed-std": lambda L: "A" * len(L),
    "attn-embed-lr-low": lambda L: "A" * len(L),
    "attn-untied-embed-std": lambda L: "A" * len(L),
    "attn-x0": lambda L: "A" * len(L),
    "attn-only-its": lambda L: "A" * L.count("A"),       # only the hybrid's attention layers
    "mamba": lambda L: "M" * len(L),
    "order": lambda L: L.translate(str.maketrans("MA", "AM")),   # Mamba and attention swapped
    "delta": every_second_mamba_delta,
    "delta-keep-drop-0.5": every_second_mamba_delta,
}

_KEEP_RECALL = ["model.kv_keep_infer=4096", "model.kv_keep_cost=0.01", "model.kv_keep_drop=0.1"]
# name: (overrides, hook names); variants named in LAYERS also change model.layers
VARIANTS = {
    "attn": ([], []),
    "attn-only-its": ([], []),
    "hybrid": ([], []),
    "mamba": ([], []),
    "order": ([], []),
    "mamba-zero": ([], ["zero_mamba"]),          # Mamba output zeroed and frozen: attention + MLPs
    "mamba-frozen": ([], ["freeze_mamba"]),      # Mamba mixers frozen at their initialisation
    "mamba-adam": ([], ["adam_mamba"]),          # Mamba projections on Adam, not Muon
    "adam-lr-low": (["optim.adam_lr=0.001"], []),
    "muon-lr-low": (["optim.muon_lr=0.005"], []),
    "out-zero": ([], ["zero_out_init"]),         # every residual output projection starts at 0
    "glu": ([], ["swiglu"]),                     # a plain SiLU GLU in place of the elephant GLU
    "nope": (["model.rope_max_period=1"], []),   # attention without rotary positions
    "embed-std": (["model.embed_std=0.16"], []),   # the token embedding started 8x larger
    "attn-embed-std": (["model.embed_std=0.16"], []),
    # and the Mamba mixers' outputs started 4x smaller
    "embed-std-mamba-out": (["model.embed_std=0.16", "model.mamba_out_scale=0.25"], []),
    "embed-lr-low": (["optim.embed_lr=0.000375"], []),   # its Adam steps 8x smaller instead
    "attn-embed-lr-low": (["optim.embed_lr=0.000375"], []),
    # the embedding untied from the head (every recipe ties them), alone and with the above
    "untied": (["model.tied_embeddings=false"], []),
    "untied-embed-std-mamba-out": (["model.tied_embeddings=false", "model.embed_std=0.16",
                                    "model.mamba_out_scale=0.25"], []),
    "attn-untied-embed-std": (["model.tied_embeddings=false", "model.embed_std=0.16"], []),
    # attention layers that read the stack's normalized input (the token embeddings) beside the
    # stream, with a learned gain (model.attn_x0)
    "x0": (["model.attn_x0=true"], []),
    "attn-x0": (["model.attn_x0=true"], []),
    "x0-half": (["model.attn_x0=true", "model.attn_x0_init=0.5"], []),       # its gain from 0.5
    "x0-quarter": (["model.attn_x0=true", "model.attn_x0_init=0.25"], []),   # its gain from 0.25
    # its gain from 0.25, held there or one per layer (model.attn_x0_gain)
    "x0-fixed": (["model.attn_x0=true", "model.attn_x0_init=0.25", "model.attn_x0_gain=fixed"], []),
    "x0-layer": (["model.attn_x0=true", "model.attn_x0_init=0.25", "model.attn_x0_gain=layer"], []),
    "x0-norm": (["model.attn_x0=true", "model.attn_x0_norm=true"], []),   # the sum normalized again
    "no-x0": (["model.attn_x0=false"], []),       # a recipe shape without it
    # the recall recipe's kept tokens never dropped in training (its kv_keep_drop is 0.1), or
    # dropped more often; and 4x as many kept tokens, trained so (read with more than it trained
    # with, the recipe's model recalled worse: docs/RESULTS.md)
    "keep-drop-0": (["model.kv_keep_drop=0"], []),
    "keep-drop-0.25": (["model.kv_keep_drop=0.25"], []),
    "keep-drop-0.5": (["model.kv_keep_drop=0.5"], []),   # the gated slots' share of delta-keep-drop-0.5
    "keep-512": (["model.kv_keep=512"], []),
    # a quarter of the kept tokens in training, so that the score must pick among 4x as many
    # bytes a slot (read later with more: COPY_KEEP_EVAL=128)
    "keep-32": (["model.kv_keep=32"], []),
    # 512 kept tokens in training, each query reading its best 128 (model.kv_keep_read): the read
    # learns to pick among more than it reads, as it must with the 4,096 a loaded recipe keeps
    "keep-512-read-128": (["model.kv_keep=512", "model.kv_keep_read=128"], []),
    # kept tokens charged for their mean gate (model.kv_keep_cost, 0.01 in the recall recipe
    # since 2026-11-29): what no query reads sinks; without it, and 5x as much
    "keep-cost": (["model.kv_keep_cost=0.01"], []),
    "keep-cost-0": (["model.kv_keep_cost=0"], []),
    "keep-cost-0.05": (["model.kv_keep_cost=0.05"], []),
    # charged softplus(score) (model.kv_keep_cost_form): pushes hardest on the best-scored unread
    # tokens, where the gate's charge pushes least; at a score of 2 it pushes 8x the gate's, so
    # smaller costs
    "keep-softplus-0.002": (["model.kv_keep_cost_form=softplus", "model.kv_keep_cost=0.002"], []),
    "keep-softplus-0.005": (["model.kv_keep_cost_form=softplus", "model.kv_keep_cost=0.005"], []),
    # issue 57's levers for a memory learned from the LM loss, on a recipe shape with memory
    "mem-windows-4": (["train.memory_windows=4"], []),   # memory-only backprop over 4 BPTT windows
    "gate-half-open": (["model.mem_gate_init=0"], []),   # memory gates start half open, not shut
    # documents no longer than a cap that grows from 1K bytes to the longest over 300 steps
    "length-curriculum": (["data.length_curriculum_steps=300", "data.length_curriculum_start=1024"], []),
    # the recall recipe's kept-token settings on another recipe's model: 4,096 kept at inference
    # (each query reading what it trained with), charged and dropped in training; and with its
    # gradient depth too (8 chunks, a quarter of the lanes: the same tokens a step as BPTT 2)
    "keep-recall": (_KEEP_RECALL, []),
    "keep-recall-bptt8": (_KEEP_RECALL + ["model.bptt_chunks=8", "train.lanes=16"], []),
    # and trained with 4x the slots a query reads, so that the read learns to pick its best 128
    # among more, as it must among the 4,096 of inference
    "keep-recall-512-read-128": (_KEEP_RECALL + ["model.kv_keep=512", "model.kv_keep_read=128"], []),
    # every second Mamba-2 mixer a gated delta rule (the D layer: an associative memory); and
    # with the kept tokens dropped after 1 chunk in 2 in training, so that what outlives a few
    # chunks must be carried by the delta rule or the memory slots
    "delta": ([], []),
    "delta-keep-drop-0.5": (["model.kv_keep_drop=0.5"], []),
    "eager": (["train.compile=off"], []),
    "reference": (["train.compile=off"], ["reference"]),   # PyTorch reference paths, no kernels
}


def variant(name: str) -> tuple[str, list[str], list[str], list[str]]:
    """A variant's (base name, overrides, hooks, seed override). "hybrid@2" is the variant hybrid
    with train.seed=2 (after the command line's overrides), so seeds of one variant train side
    by side. KeyError for an unknown one."""
    from benchmarks.common import split_seed
    base, seed = split_seed(name, VARIANTS)
    overrides, hooks = VARIANTS[base]
    return base, overrides, hooks, [f"train.seed={seed}"] if seed else []


# ------------------------------------------------------------------ the copy corpus
ALNUM = "abcdefghijklmnopqrstuvwxyz0123456789"
FILLER = ("the of and to in is was for on that with as by at from his her it an are were which "
          "this be or has had not but their one also its first new after two may such").split()


def gpu_count() -> int:
    """How many GPUs this process sees (0 without CUDA); asks without starting a CUDA context."""
    import torch
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def copy_document(rng, length: int) -> tuple[str, list[tuple[int, int]]]:
    """A document of about `length` bytes: filler words and random names in angle brackets
    (6-16 letters and digits); a name stated once recurs later, after 0 to a few hundred bytes.
    Returns the text and the byte spans of the recurrences whose bytes a copy predicts: each
    recurrence from its third character to its closing bracket (its first two characters say
    which name recurs)."""
    parts, pending, spans, n = [], [], [], 0
    while n < length:
        r = rng.random()
        if r < 0.3:
            name = "".join(rng.choice(ALNUM) for _ in range(rng.randint(6, 16)))
            piece = f"<{name}> "
            pending.append(name)
        elif r < 0.55 and pending:
            name = pending.pop(rng.randrange(len(pending)))
            piece = f"<{name}> "
            spans.append((n + 3, n + len(name) + 2))
        else:
            piece = " ".join(rng.choice(FILLER) for _ in range(rng.randint(1, 8))) + ". "
        parts.append(piece)
        n += len(piece)
    return "".join(parts), spans


def write_copy_corpus(folder: Path, docs: int, length: int, seed: int = 0) -> None:
    """train.jsonl and valid.jsonl of copy documents (the trainer's `text` source)."""
    import random
    folder.mkdir(parents=True, exist_ok=True)
    for split, n, s in (("train", docs, seed), ("valid", max(docs // 20, 8), seed + 1)):
        rng = random.Random(s)
        with open(folder / f"{split}.jsonl", "w") as f:
            for _ in range(n):
                f.write(json.dumps({"text": copy_document(rng, length)[0]}) + "\n")


def copy_accuracy(model, chunk_len: int, device: str, docs: int = 64, seed: int = 4321) -> float:
    """Next-byte accuracy on the copyable bytes of held-out copy documents that fit one chunk."""
    import random
    import torch
    rng = random.Random(seed)
    texts = [copy_document(rng, chunk_len - 48) for _ in range(docs)]
    hit = total = 0
    model.eval()
    with torch.no_grad(), (torch.autocast("cuda", dtype=torch.bfloat16) if device == "cuda"
                           else nullcontext()):
        for text, spans in texts:
            ids = list(text.encode())[:chunk_len]
            tokens = torch.tensor([ids], device=device)
            logits, _ = model(tokens)
            pred = logits[0].argmax(-1).tolist()      # pred[t] is the guess for byte t + 1
            for a, b in spans:
                for t in range(a, min(b, len(ids))):
                    hit += int(pred[t - 1] == ids[t])
                    total += 1
    return hit / max(total, 1)


# ------------------------------------------------------------------ hooks (run in the variant)
def _mamba_mixers(model):
    return [b.mixer for b in model.blocks if b.kind == "M"]


def zero_mamba(model):
    import torch
    for m in _mamba_mixers(model):
        with torch.no_grad():
            m.out_proj.weight.zero_()
        for p in m.parameters():
            p.requires_grad_(False)


def freeze_mamba(model):
    for m in _mamba_mixers(model):
        for p in m.parameters():
            p.requires_grad_(False)


def zero_out_init(model):
    import torch
    with torch.no_grad():
        for b in model.blocks:
            (b.mixer.out_proj if b.kind == "M" else b.mixer.o).weight.zero_()


def swiglu(model):
    import torch.nn.functional as F
    for b in model.blocks:
        mlp = b.mlp
        mlp.forward = (lambda m: lambda h: m.down(m.up(h) * F.silu(m.gate(h))))(mlp)


def reference(model):
    model.set_fast_paths(False)


HOOKS = {f.__name__: f for f in (zero_mamba, freeze_mamba, zero_out_init, swiglu, reference)}


def run_variant(name: str, argv: list[str]) -> int:
    """The variant's training, in this process (the parent starts one per variant)."""
    import elephant.optim.build as build
    import elephant.trainer as trainer_mod
    from elephant.config import load_config
    from elephant.model import ElephantLM

    _, own, hooks, seed = variant(name)
    config, overrides = argv[0], argv[1:]

    class Variant(ElephantLM):
        def __init__(self, cfg):
            super().__init__(cfg)
            for h in hooks:
                if h in HOOKS:
                    HOOKS[h](self)

    trainer_mod.ElephantLM = Variant
    if "adam_mamba" in hooks:
        assign = build.assign_parameters

        def adam_for_mamba(model):
            kinds = {f"blocks.{i}.mixer." for i, b in enumerate(model.blocks) if b.kind == "M"}
            return [(n, p, "other" if role == "muon" and any(n.startswith(k) for k in kinds)
                     else role, note) for n, p, role, note in assign(model)]
        build.assign_parameters = adam_for_mamba
    cfg = load_config(config, overrides)
    trainer = trainer_mod.Trainer(cfg, progress=False)
    trainer.fit()
    del trainer
    if os.environ.get("COPY_WEIGHTS"):   # before scoring: a call cut short still returns them
        save_weights(Path(cfg.train.run_dir), Path(os.environ["COPY_WEIGHTS"]), name)
    # scored here, in parallel with the other variants: the parent's deadline (SIGTERM) ends
    # training only, so a variant still scoring at the deadline goes on
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    import torch
    run_dir = Path(cfg.train.run_dir)
    device = "cuda" if cfg.train.device != "cpu" and torch.cuda.is_available() else "cpu"
    distances = sorted(int(d) for d in os.environ["COPY_DISTANCES"].split(","))
    every = sorted(int(d) for d in os.environ.get("COPY_EVERY", "").split(",") if d)
    ablate = [a for a in os.environ.get("COPY_ABLATE", "").split(",") if a]
    keep_eval = [k for k in os.environ.get("COPY_KEEP_EVAL", "").split(",") if k]
    out = Path(os.environ["COPY_OUT"], f"{name}.json")
    curve = losses(run_dir)   # training is over: read its log once for every write below

    def write(rows: list[dict], partial: bool) -> None:
        result = {"variant": name, "overrides": own + seed, "hooks": hooks,
                  "layers": cfg.model.layers, "recall": rows, "losses": curve,
                  "first_step_at_0.99": next((r["step"] for r in rows if r.get("128", 0) >= 0.99),
                                             None),
                  "lm_recall_128": rows[-1].get("128") if rows else None,
                  **(goal_keys(rows[-1], distances) if rows else {}),
                  "copy": rows[-1].get("copy") if rows else None}
        if partial:   # what a call cut short while scoring still returns
            result["partial"] = True
        out.write_text(json.dumps(result, indent=1))
    rows = score(run_dir, device, distances, int(os.environ["COPY_LANES"]), every, ablate,
                 keep_eval, scored=lambda rows: write(rows, partial=True))
    write(rows, partial=False)
    return 0


KEYS = {4096: "4k", 65536: "64k", 1048576: "1m"}   # distances named by the result keys


def goal_keys(row: dict, distances: list[int]) -> dict:
    """A checkpoint's scored `row` under issue 57's keys (lm_recall_4k, _64k, _1m): its accuracy
    past the window at each of `distances` that has one."""
    from elephant.recall import label
    return {f"lm_recall_{KEYS[d]}": row.get(label(d)) for d in distances if d in KEYS}

PART = 15 * 2 ** 20   # the device machine returns files of at most 16 MiB


def save_weights(run_dir: Path, out: Path, name: str) -> Path:
    """The run's newest checkpoint, weights and meta.json only, as a gzipped tar cut into parts
    of 15 MiB in `out`/w-<name> ("@" written "-s": the name comes back from the device machine),
    so that a later call can score it without training again (load_weights)."""
    import io
    import tarfile
    from elephant.checkpoint import step_folders
    ckpt = step_folders(run_dir / "checkpoints")[0]
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for f in ("meta.json", "model.safetensors"):
            tar.add(ckpt / f, arcname=f"{ckpt.name}/{f}")
    folder = out / f"w-{name.replace('@', '-s')}"
    folder.mkdir(parents=True, exist_ok=True)
    data = buf.getvalue()
    for i in range(0, len(data), PART):
        (folder / f"part.{i // PART:02d}").write_bytes(data[i:i + PART])
    return folder


def load_weights(folder: Path, run_dir: Path) -> Path:
    """The checkpoint folder that save_weights' parts in `folder` hold, unpacked under
    `run_dir`/checkpoints (from_pretrained reads it, or the run dir)."""
    import io
    import tarfile
    parts = sorted(folder.glob("part.*"))
    if not parts:
        raise FileNotFoundError(f"{folder}: no part.* files of saved weights")
    data = b"".join(p.read_bytes() for p in parts)
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
        names = {m.name.split("/")[0] for m in tar.getmembers()}
        tar.extractall(run_dir / "checkpoints", filter="data")
    return run_dir / "checkpoints" / names.pop()


def score(run_dir: Path, device: str, distances: list[int], lanes: int,
          every: list[int] = (), ablate: list[str] = (), keep_eval: list = (),
          scored=None) -> list[dict]:
    """Recall of every checkpoint of a run, oldest first: at the shortest of `distances` (and at
    `every`) for each, at all of them for the last (a long distance costs a pass over that many
    bytes). The last is also scored past the shortest distance with each part of `ablate`
    (elephant.recall.ABLATIONS: memory, keep, kv, ssm) dropped after every chunk, under keys like
    "4K without memory": which carried part holds the fact; and read with each number of kept
    tokens in `keep_eval` (from_pretrained(kv_keep=); "K/R": each query reading R of them,
    kv_keep_read), under keys like "1M with 2048 kept" and "1M with 4096 kept reading 32".
    `scored(rows)` is called after each pass with the rows so far, oldest first."""
    import torch
    from elephant.checkpoint import step_folders
    from elephant.hub import from_pretrained
    from elephant.recall import evaluate_recall, filler_for
    from elephant.config import ConfigError

    rows, filler = [], None
    ckpts = step_folders(run_dir / "checkpoints")   # newest first

    def report() -> None:
        if scored:
            scored(sorted(rows, key=lambda r: r["step"]))
    for ckpt in ckpts:
        model, tokenizer, config = from_pretrained(ckpt, device=device)
        autocast = (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if device == "cuda" else None
        step = int(ckpt.name.split("_")[-1])
        if os.environ.get("COPY_CORPUS") == "copy":
            rows.append({"step": step, "copy": copy_accuracy(model, config["train"]["chunk_len"],
                                                             device)})
            report()
            continue
        data = config["data"]
        if filler is None and data.get("recall_filler"):   # held-out documents of the same text
            filler = filler_for(data["recall_filler"], "test", bool(data.get("site_packages")))

        def accuracy(at: list[int], model=model, **ablation) -> dict:
            r = evaluate_recall(model, tokenizer, at, lanes, config["train"]["chunk_len"],
                                torch.device(device), 1, 1234, autocast, progress=False,
                                filler=filler, **ablation)
            # and the share of the fact's value the kept tokens still held there ("4K held"),
            # and the pass's bytes a second (eager, every lane to the longest document)
            return {**{k: v["accuracy"] for k, v in r["by_distance"].items()},
                    **{f"{k} held": v["held"] for k, v in r["by_distance"].items() if "held" in v},
                    "tok/s": round(r["tokens_per_s"])}
        last = ckpt == ckpts[0]
        rows.append({"step": step,
                     **accuracy(distances if last else sorted({min(distances), *every}))})
        report()
        past = [d for d in distances if d > min(distances)]
        for part in ablate if last else ():
            try:
                without = accuracy(past, ablation=part)
            except ConfigError as e:   # a part this model does not carry (no memory, say)
                print(f"{run_dir.name}: {e}; not dropped", flush=True)
                continue
            rows[-1].update({f"{k} without {part}": a for k, a in without.items()})
            report()
        for kept in keep_eval if last else ():   # "K" or "K/R": K kept, each query reading R
            k, _, r = str(kept).partition("/")
            wider = from_pretrained(ckpt, device=device, kv_keep=int(k),
                                    kv_keep_read=int(r) if r else None)[0]
            rows[-1].update({f"{key} with {k} kept" + (f" reading {r}" if r else ""): a
                             for key, a in accuracy(past, model=wider).items()})
            report()
    return sorted(rows, key=lambda r: r["step"])


def losses(run_dir: Path) -> list[dict]:
    path = run_dir / "log.jsonl"
    if not path.exists():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [{"step": r["step"], "loss": r["loss"]} for r in rows if "loss" in r and "step" in r]


# ------------------------------------------------------------------ the CPU probe
def fact_row(rng, text: str, T: int, min_gap: int = 8) -> tuple[list[int], tuple[int, int]]:
    """T + 1 bytes of `text` (a random stretch) with one fact stated after 0-40 bytes and asked
    for after a gap of `min_gap` to what the row leaves (data_packing/recall.py's wording), and the
    span of the answer's 6 digits."""
    from data_packing.recall import keys
    key = rng.choice(keys())
    value = "".join(rng.choice("0123456789") for _ in range(6))

    def filler(n: int) -> str:
        start = rng.randrange(len(text) - n - 1)
        return text[start:start + n]
    out = filler(rng.randint(0, 40)) + f"The code of {key} is {value}. "
    out += (filler(rng.randint(min_gap, max(min_gap, T - len(out) - 50)))
            + f"What is the code of {key}? It is ")
    span = (len(out), len(out) + 6)
    out = (out + value + ". " + filler(T + 1))[:T + 1]
    return list(out.encode()[:T + 1]), span


def cpu_probe(args) -> dict:
    """One variant on the CPU, the loss on every byte: rows of `--cpu-T` bytes of real text (cut
    from the `--filler` file, e.g. Wikitext) holding one fact and its question (fact_row), a model of the
    tiny shape (d_model 64, layers from the variant), the project's optimizers; the answer's digit
    accuracy on held-out rows (cut from `--filler-test`) every 250 steps. Returns the curve.
    With `--cpu-chunks N` a row is N chunks of `--cpu-T` bytes read one after the other with the
    state carried (memory, window, kept tokens, as the model's settings say; one backward over
    the row), and the question comes at least `--cpu-min-gap` bytes after the fact: past the
    window, only what the state carries can answer it."""
    import random

    import torch

    from elephant.config import load_config
    from elephant.model import ElephantLM
    from elephant.optim import build_optimizers
    torch.set_num_threads(1)
    train_text, test_text = (Path(f).read_text(encoding="utf-8").encode("ascii", "ignore").decode()
                             for f in (args.filler, args.filler_test))
    T, layers = args.cpu_T, "MAMA"
    name = args.variants
    overrides, hooks = VARIANTS[name]
    if name in LAYERS:
        layers = LAYERS[name](layers)
    # the project's defaults, the probe's shape, then the variant's and the command line's
    # overrides (train.* ones have nothing to act on here: the probe has no trainer)
    cfg = load_config(None, ["model.vocab_size=256", "model.d_model=64", "model.n_heads=2",
                             f"model.layers={layers}", "model.d_mlp=128", "model.d_state=16",
                             "model.mamba_head_dim=16", "model.ssd_chunk=32",
                             "optim.warmup_steps=50", "optim.momentum_warmup_steps=50",
                             *overrides, *args.overrides])
    torch.manual_seed(args.seed)
    model = ElephantLM(cfg.model)
    for h in hooks:
        HOOKS[h](model)
    opt = build_optimizers(model, cfg.optim)

    N = args.cpu_chunks
    L = N * T                                              # a row's bytes

    def batch(rng, rows, text):
        made = [fact_row(rng, text, L, args.cpu_min_gap) for _ in range(rows)]
        return torch.tensor([m[0] for m in made]), [m[1] for m in made]

    def forward(x, targets=None):
        """The row's chunks in turn, the state carried: (their logits, B x L) or the mean of
        their losses."""
        state, outs = None, []
        for c in range(N):
            out, state = model(x[:, c * T:(c + 1) * T], state,
                               targets=None if targets is None else targets[:, c * T:(c + 1) * T])
            outs.append(out)
        return torch.cat(outs, dim=1) if targets is None else sum(outs) / N

    held_out = batch(random.Random(999), 256, test_text)

    def accuracy() -> float:
        x, spans = held_out
        model.eval()
        with torch.no_grad():
            pred = forward(x[:, :-1]).argmax(-1)
        model.train()
        hits = [int(pred[i, t - 1] == x[i, t]) for i, (a, b) in enumerate(spans) if b <= L
                for t in range(a, b)]     # (an answer that does not fit the row is not asked)
        return sum(hits) / len(hits)

    rng, curve, t0 = random.Random(args.seed), [], time.time()
    for step in range(args.steps):
        opt.set_step(step, args.steps)
        x, _ = batch(rng, 16, train_text)
        loss = forward(x[:, :-1], x[:, 1:])
        loss.backward()
        opt.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad()
        if (step + 1) % 250 == 0 or step + 1 == args.steps:
            curve.append({"step": step + 1, "loss": round(loss.item(), 4), "copy": round(accuracy(), 4)})
            print(name, curve[-1], f"{time.time() - t0:.0f} s", flush=True)
    return {"variant": name, "layers": layers, "overrides": [*overrides, *args.overrides],
            "hooks": hooks, "seed": args.seed, "chunk_bytes": T, "chunks": N,
            "min_gap": args.cpu_min_gap, "curve": curve,
            "first_step_at_0.99": next((c["step"] for c in curve if c["copy"] >= 0.99), None)}


def score_saved(args, folder: Path, out: Path, runs: Path) -> int:
    """--score: the saved weights in `folder` scored as the last checkpoint of a run is."""
    import torch
    from benchmarks.common import environment
    name = folder.name.removeprefix("w-")
    run_dir = runs / name
    ckpt = load_weights(folder, run_dir)
    device = "cuda" if torch.cuda.is_available() and not args.cpu_smoke else "cpu"
    distances = sorted(int(d) for d in args.distances.split(","))
    result = {"command": " ".join(["python benchmarks/copy_study.py", *sys.argv[1:]]),
              "variant": name, "weights": str(folder), "step": int(ckpt.name.split("_")[-1]),
              **environment(torch.device(device))}
    path = out / f"{name}-scored.json"

    def write(rows: list[dict], partial: bool) -> None:
        last = rows[-1] if rows else {}
        path.write_text(json.dumps({**result, "recall": last, "partial": partial,
                                    **goal_keys(last, distances)}, indent=1))
    lanes = 8 if args.cpu_smoke else args.eval_lanes
    ablate = [a for a in args.ablate.split(",") if a]
    keep_eval = [k for k in args.keep_eval.split(",") if k]
    rows = score(run_dir, device, distances, lanes, (), ablate, keep_eval,
                 scored=lambda rows: write(rows, partial=True))
    write(rows, partial=False)
    print(name, json.dumps(rows[-1]), flush=True)
    return 0


def main() -> int:
    if len(sys.argv) > 2 and sys.argv[1] == "--variant":
        return run_variant(sys.argv[2], sys.argv[3:])
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variants", default="attn,hybrid")
    p.add_argument("--shape", default="recall", choices=sorted(SHAPES))
    p.add_argument("--steps", type=int, default=800)
    p.add_argument("--ckpt-every", type=int, default=200)
    p.add_argument("--deadline-s", type=float, default=0.0,
                   help="stop (SIGTERM: a checkpoint, then exit) variants still training after this")
    p.add_argument("--distances", default="128,512")
    p.add_argument("--every-distances", default=os.environ.get("COPY_EVERY", ""),
                   help="distances also scored at every checkpoint, not the last only (e.g. 4096: "
                        "when a fact first survives past the window, and whether it stays)")
    p.add_argument("--ablate", default=os.environ.get("COPY_ABLATE", ""),
                   help="carried parts (memory, keep, kv, ssm) each dropped after every chunk in a "
                        "second scoring of the last checkpoint past the shortest distance")
    p.add_argument("--keep-eval", default=os.environ.get("COPY_KEEP_EVAL", ""),
                   help="numbers of kept tokens (e.g. 512,2048) the last checkpoint is also read "
                        "with past the shortest distance, in place of its trained model.kv_keep")
    p.add_argument("--eval-lanes", type=int, default=64)
    p.add_argument("--parallel", type=int, default=int(os.environ.get("COPY_PARALLEL", "0")),
                   help="at most this many variants at once, the rest started as they end "
                        "(0: all at once; four of wt103-70m's width outgrow an 80 GB GPU)")
    p.add_argument("--score", metavar="FOLDER",
                   help="no training: score the weights an earlier call saved (COPY_WEIGHTS: a "
                        "folder w-<variant> of parts) at --distances, --ablate and --keep-eval, "
                        "into <out>/<variant>-scored.json")
    p.add_argument("--out", default="benchmarks/results/copy_study")
    p.add_argument("--runs", default="runs/copy_study")
    p.add_argument("--corpus", default="recall", choices=("recall", "copy"),
                   help="recall: data_packing/recall.py's facts; copy: documents of recurring "
                        "random names (write_copy_corpus), scored by copy accuracy")
    p.add_argument("--cpu-smoke", action="store_true")
    p.add_argument("--cpu", action="store_true",
                   help="the CPU probe (cpu_probe): one variant, rows of real text with a fact")
    p.add_argument("--filler", default="../shared/data/wikitext-103-raw/wiki.valid.raw",
                   help="--cpu: the text the training rows are cut from")
    p.add_argument("--filler-test", default="../shared/data/wikitext-103-raw/wiki.test.raw",
                   help="--cpu: the text the held-out rows are cut from")
    p.add_argument("--cpu-T", type=int, default=128, help="--cpu: a chunk's bytes")
    p.add_argument("--cpu-chunks", type=int, default=1, help="--cpu: chunks a row")
    p.add_argument("--cpu-min-gap", type=int, default=8,
                   help="--cpu: the fewest bytes between the fact and its question")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("overrides", nargs="*")
    args = p.parse_intermixed_args()
    names = args.variants.split(",")
    unknown = []
    for n in names:
        try:
            variant(n)
        except KeyError:
            unknown.append(n)
    if unknown:
        p.error(f"unknown variants {unknown}; known: {', '.join(VARIANTS)} (each may end in @seed)")
    if args.cpu:
        if len(names) != 1 or "@" in names[0]:
            p.error("--cpu runs one variant (start one process per variant; --seed sets its seed)")
        import torch
        from benchmarks.common import environment
        result = {"command": " ".join(["python benchmarks/copy_study.py", *sys.argv[1:]]),
                  **cpu_probe(args), **environment(torch.device("cpu"))}
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        tag = f"_{args.cpu_chunks}x{args.cpu_T}" if args.cpu_chunks > 1 else ""
        (out / f"cpu_{names[0]}{tag}_seed{args.seed}.json").write_text(json.dumps(result, indent=1))
        return 0
    out, runs = Path(args.out), Path(args.runs)
    out.mkdir(parents=True, exist_ok=True)
    if args.score:
        return score_saved(args, Path(args.score), out, runs)
    shape = SHAPES[args.shape]
    config, shape_overrides = shape[1], shape[2:]
    from elephant.config import load_config
    hybrid_layers = load_config(ROOT / config, shape_overrides).model.layers
    extra = SMOKE if args.cpu_smoke else []
    if args.corpus == "copy":
        corpus = runs / "copy_corpus"
        write_copy_corpus(corpus, 200 if args.cpu_smoke else 20000,
                          460 if not args.cpu_smoke else 120)
        extra = [*extra, "data.source=text", f"data.path={corpus}", "data.valid_split=valid"]
    procs = {}
    env = dict(os.environ, PYTHONUNBUFFERED="1", COPY_OUT=str(out), COPY_DISTANCES=args.distances,
               COPY_LANES=str(8 if args.cpu_smoke else args.eval_lanes),
               COPY_CORPUS=args.corpus, COPY_EVERY=args.every_distances, COPY_ABLATE=args.ablate,
               COPY_KEEP_EVAL=args.keep_eval)
    t0 = time.time()
    # on a machine of several GPUs the variants take them in turn (each process sees one)
    gpus = 0 if args.cpu_smoke else gpu_count()
    waiting = []   # (name, command, environment): started while fewer than --parallel run
    for i, n in enumerate(names):
        run_dir = runs / n
        base, overrides, _, seed = variant(n)
        cmd = [sys.executable, __file__, "--variant", n, config, *shape_overrides,
               *overrides, *extra, *args.overrides, *seed,
               *([f"model.layers={LAYERS[base](hybrid_layers)}"] if base in LAYERS else []),
               f"train.max_steps={args.steps}",
               f"train.ckpt_every={args.ckpt_every}", "train.keep_ckpts=100", "train.eval_every=0",
               "train.log_every=25", "train.tensorboard=false", f"train.run_dir={run_dir}"]
        own = env if gpus < 2 else dict(env, CUDA_VISIBLE_DEVICES=str(i % gpus))
        waiting.append((n, cmd, own))

    def running() -> int:
        return sum(pr.poll() is None for pr, _ in procs.values())

    def start_waiting() -> None:
        while waiting and (not args.parallel or running() < args.parallel):
            n, cmd, own = waiting.pop(0)
            log = open(out / f"{n}.log", "w")
            procs[n] = (subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=own,
                                         cwd=ROOT), log)
    start_waiting()
    stopped = False
    # the call's own limit (gpu.sh's timeout): stop waiting and sum up what the variants wrote
    cut: list[float] = []
    signal.signal(signal.SIGTERM, lambda *_: cut.append(time.time()))
    while not cut and (waiting or running()):
        if not stopped:
            start_waiting()
        if args.deadline_s and time.time() - t0 > args.deadline_s and not stopped:
            waiting.clear()   # past the deadline nothing more starts
            for n, (pr, _) in procs.items():   # those still training: checkpoint, then score
                if pr.poll() is None and not (out / f"{n}.json").exists():
                    pr.send_signal(signal.SIGTERM)
            stopped = True
        time.sleep(2)
    train_s = time.time() - t0
    import torch
    from benchmarks.common import environment
    device = "cpu" if args.cpu_smoke or not torch.cuda.is_available() else "cuda"
    summary = {"command": " ".join(["python benchmarks/copy_study.py", *sys.argv[1:]]),
               "shape": args.shape, "steps": args.steps, "train_seconds": train_s,
               # a variant still running when the parent was stopped: its last partial result
               "cut_short": bool(cut),
               "variants": {}, **environment(torch.device(device))}
    for n in names:
        path = out / f"{n}.json"
        result = json.loads(path.read_text()) if path.exists() else {"recall": [], "losses": []}
        summary["variants"][n] = {"lm_recall_128": result.get("lm_recall_128"),
                                  **{k: v for k, v in result.items() if k.startswith("lm_recall_")},
                                  "copy": result.get("copy"),
                                  "first_step_at_0.99": result.get("first_step_at_0.99"),
                                  "returncode": procs[n][0].returncode if n in procs else "not started",
                                  "layers": result.get("layers"),
                                  "final_loss": result["losses"][-1]["loss"] if result["losses"] else None}
        print(n, json.dumps(summary["variants"][n]),
              [(r["step"], round(r.get("128", r.get("copy", -1)), 3)) for r in result["recall"]],
              flush=True)
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
