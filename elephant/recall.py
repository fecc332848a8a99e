"""Long-range recall: train on, or evaluate with, `data_packing/recall.py`'s synthetic facts.

    python -m elephant.recall train --config configs/recall.toml [section.key=value ...]   # any order
    python -m elephant.recall eval --checkpoint runs/recall [--distances 128,4K,64K,1M] [--json F]

`train` runs the general trainer (train.py's) on every token of the recall corpus, as a language
model is trained; `--answer-loss` trains on the loss of the answer digits alone instead
(`train_recall`: rolling lanes of documents, truncated BPTT over `bptt_chunks`, memory-only
backpropagation over 4x as many).
`eval` streams `lanes` documents side by side, chunk by chunk with carried state, exactly as
`eval.py` streams text: each document states one fact (or `--pairs` of them) and asks for it again
at every distance of `--distances` (counted in tokens from the key's previous mention). The answer
is scored teacher-forced: the model's most likely next token against each answer token. Printed:
accuracy by distance (chance: 0.10 per digit), exact-answer rate, how often the memory gates were
closed, tokens/s and peak memory (flat in the document length: the state has a fixed size).
"""
from __future__ import annotations

import argparse
import math
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import numpy as np
import torch

from elephant.config import add_kept_arguments, parse_count
from elephant.evaluate import document_chunks, dropped
from elephant.model import in_eval_mode
from elephant.state import check_parts, parse_parts

DEFAULT_DISTANCES = "128,512,1K,4K,16K,64K"
CHANCE = 0.1


def label(n: int) -> str:
    for unit, size in (("M", 1024 ** 2), ("K", 1024)):
        if n >= size and n % size == 0:
            return f"{n // size}{unit}"
    return str(n)


ABLATIONS = ("none", "memory", "kv", "keep", "kept", "assoc", "ssm", "delta")


def ablate(model, state, part: str):
    """The state with one carried part dropped after a chunk, to see what carries a fact:
    memory -> the initial memory, kv -> an empty window, keep or kept -> no kept tokens
    (model.kv_keep), assoc -> an empty associative memory (model.kv_assoc), ssm -> zero conv and
    recurrent state of every Mamba-2 and delta rule (D) layer, delta -> of
    the D layers alone (state.drop_parts)."""
    if part == "none":
        return state
    if part not in ABLATIONS:
        raise ValueError(f"ablation: expected one of {', '.join(ABLATIONS)}, got {part!r}")
    return dropped(model, state, parse_parts(part))


def filler_for(spec: str, split: str, site_packages: bool = False) -> str | None:
    """The filler text of `data.recall_filler` = `spec` for `split` (None for "": synthetic)."""
    if not spec:
        return None
    from data_packing.sources import filler_text, recall_filler
    return filler_text(recall_filler(spec, split, site_packages))


@in_eval_mode
@torch.no_grad()
def evaluate_recall(model, tokenizer, distances: list[int], lanes: int, chunk_len: int, device,
                    n_pairs: int = 1, seed: int = 1234, autocast=None, progress: bool = False,
                    ablation: str = "none", digits: int = 6, offset: int = 0,
                    filler: str | None = None, template: str = "sentence") -> dict:
    """Accuracy by distance over `lanes` documents streamed side by side (see the module doc).
    `filler`: the text the documents' filler is cut from (`filler_for`), None: synthetic;
    `template`: the form of the facts (data_packing/recall.py TEMPLATES).
    `ablation` drops one carried part of the state after every chunk (see `ablate`). `offset`
    starts every document at that rotary position instead of 0: what of the model depends on
    how deep into a document it reads (nothing, where every position it uses is relative)."""
    from data_packing.recall import eval_document

    if ablation != "none":   # a part the model does not carry would measure nothing
        check_parts(parse_parts(ablation, "--ablate"), model.cfg, "--ablate")
    rng = np.random.default_rng(seed)
    docs = [eval_document(rng, tokenizer, distances, n_pairs, digits, filler, template)
            for _ in range(lanes)]
    n_chunks = document_chunks(max(len(d.tokens) for d in docs), chunk_len)
    tokens = np.zeros((lanes, n_chunks * chunk_len + 1), dtype=np.int64)
    query = np.full((lanes, n_chunks * chunk_len + 1), -1, dtype=np.int64)  # query index of a target
    digit = np.zeros((lanes, n_chunks * chunk_len + 1), dtype=np.int64)     # its place in the answer
    for b, d in enumerate(docs):
        tokens[b, :len(d.tokens)] = d.tokens
        for j, q in enumerate(d.queries):
            query[b, q.answer_start:q.answer_start + q.answer_len] = j
            digit[b, q.answer_start:q.answer_start + q.answer_len] = np.arange(q.answer_len)
    n_q = len(distances)
    correct = np.zeros((lanes, n_q))
    total = np.zeros((lanes, n_q))
    n_digits = max(q.answer_len for d in docs for q in d.queries)
    correct_at = np.zeros((n_q, n_digits))     # by the answer token's place in the answer
    total_at = np.zeros((n_q, n_digits))
    all_right = np.ones((lanes, n_q), dtype=bool)
    actual = np.array([[q.distance for q in d.queries] for d in docs])      # (lanes, n_q)
    # the chunk whose input holds each answer's first target's input token, per lane and query
    asked = np.array([[(q.answer_start - 1) // chunk_len for q in d.queries] for d in docs])
    kept_layers = [i for i, b in enumerate(model.blocks) if b.kind == "A"] if model.cfg.kv_keep else []
    kept = np.zeros((lanes, n_q, len(kept_layers)))   # share of the fact's value tokens kept
    kept_any = np.zeros((lanes, n_q))                 # ... by at least one attention layer

    state = model.init_state(lanes, device=device)
    state.pos += offset
    reset = None if offset else torch.ones(lanes, dtype=torch.bool, device=device)
    gate_zero = gate_n = 0
    peak = {}
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    bar = None
    if progress:
        from tqdm import tqdm
        bar = tqdm(total=n_chunks, desc="recall", unit=" chunks", dynamic_ncols=True)
    for c in range(n_chunks):
        a = c * chunk_len
        now = asked == c
        if kept_layers and now.any():
            _kept_fact(state, kept_layers, docs, now, offset, kept, kept_any)
        inp = torch.from_numpy(tokens[:, a:a + chunk_len]).to(device, non_blocking=True)
        with autocast() if autocast else nullcontext():
            logits, state = model(inp, state, reset if c == 0 else None)
        state = ablate(model, state, ablation)
        targets_q = query[:, a + 1:a + chunk_len + 1]
        if (targets_q >= 0).any():
            pred = logits.argmax(-1).cpu().numpy()
            hit = pred == tokens[:, a + 1:a + chunk_len + 1]
            for b, t in zip(*np.nonzero(targets_q >= 0)):
                j, i = targets_q[b, t], digit[b, a + 1 + t]
                correct[b, j] += hit[b, t]
                total[b, j] += 1
                correct_at[j, i] += hit[b, t]
                total_at[j, i] += 1
                all_right[b, j] &= bool(hit[b, t])
        gate = getattr(model, "last_mem_gate", None)
        if gate is not None and c > 0:
            gate_zero += int((gate == 0).sum())
            gate_n += gate.numel()
        done = a + chunk_len
        if device.type == "cuda":
            for mark in (64 * 1024, 1024 ** 2, 4 * 1024 ** 2):
                if done >= mark and label(mark) not in peak:
                    peak[label(mark)] = torch.cuda.max_memory_allocated(device) / 2 ** 30
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - t0
    by_distance = {}
    for j, d in enumerate(distances):
        by_distance[label(d)] = {
            "distance": d, "accuracy": float(correct[:, j].sum() / max(total[:, j].sum(), 1)),
            "exact": float(all_right[:, j].mean()), "answers": int(lanes),
            "mean_actual_distance": float(actual[:, j].mean()),
            # accuracy of the answer's first, second, ... token: where in a value recall fails
            "by_place": [float(c / max(n, 1)) for c, n in zip(correct_at[j], total_at[j])]}
        if kept_layers:
            # where a fact past the window is lost: dropped from the kept tokens, or kept and not read
            by_distance[label(d)]["held"] = float(kept_any[:, j].mean())
            by_distance[label(d)]["held_by_layer"] = [float(x) for x in kept[:, j].mean(0)]
    out = {"by_distance": by_distance, "chance": CHANCE, "ablation": ablation, "offset": offset,
           "template": template,
           "lanes": lanes,
           "chunk_len": chunk_len,
           "pairs": n_pairs, "tokens": int(lanes * n_chunks * chunk_len), "seconds": seconds,
           "tokens_per_s": lanes * n_chunks * chunk_len / max(seconds, 1e-9)}
    if gate_n:
        out["mem_gate_closed_frac"] = gate_zero / gate_n
    if device.type == "cuda":
        out["peak_mem_gb"] = torch.cuda.max_memory_allocated(device) / 2 ** 30
        out["peak_mem_gb_at"] = peak
    return out


def _kept_fact(state, layers: list[int], docs, now: np.ndarray, offset: int, kept: np.ndarray,
               kept_any: np.ndarray) -> None:
    """For each (lane, query) marked in `now` (lanes, n_q), whose answer the next chunk reads:
    the share of the value tokens of the key's previous mention (the fact, or the last answer)
    among the kept tokens of each attention layer in `layers` (model.kv_keep) that `state`
    carries into that chunk, into kept[lane, query, layer], and by any layer into
    kept_any[lane, query]."""
    pos = [state.kv[i].keep_pos.cpu().numpy() for i in layers]            # (B, K) each
    valid = [state.kv[i].keep_valid.cpu().numpy() for i in layers]
    for b, j in zip(*np.nonzero(now)):
        q = docs[b].queries[j]
        last = q.answer_start - q.distance + offset          # the mention's last value token
        span = np.arange(last - q.answer_len + 1, last + 1)
        held = [np.isin(span, p[b][v[b]]) for p, v in zip(pos, valid)]
        kept[b, j] = [h.mean() for h in held]
        kept_any[b, j] = np.logical_or.reduce(held).mean()


def answer_batch(rng: np.random.Generator, tokenizer, lanes: int, chunk_len: int,
                 gaps: tuple[int, int], digits: int = 6, log_gaps: bool = False,
                 every_token: bool = False):
    """`lanes` one-fact documents queried once at a distance in [gaps[0], gaps[1]] (uniform, or
    log-uniform with `log_gaps`), padded to whole chunks: (tokens (lanes, C * chunk_len + 1),
    answer mask (lanes, C * chunk_len) over the targets, C). `every_token`: the mask holds
    every target inside the document (the LM loss), not the answers alone."""
    from data_packing.recall import build_document

    def gap() -> int:
        if log_gaps:
            return int(round(math.exp(rng.uniform(math.log(gaps[0]), math.log(gaps[1])))))
        return int(rng.integers(gaps[0], gaps[1] + 1))
    docs = [build_document(rng, tokenizer, 1, [(0, gap())], lead=int(rng.integers(0, chunk_len)),
                           digits=digits) for _ in range(lanes)]
    n_chunks = document_chunks(max(len(d.tokens) for d in docs), chunk_len)
    tokens = np.zeros((lanes, n_chunks * chunk_len + 1), np.int64)
    mask = np.zeros((lanes, n_chunks * chunk_len), bool)
    for b, d in enumerate(docs):
        tokens[b, :len(d.tokens)] = d.tokens
        if every_token:
            mask[b, :len(d.tokens) - 1] = True
        for q in d.queries:
            mask[b, q.answer_start - 1:q.answer_start - 1 + q.answer_len] = True
    return torch.from_numpy(tokens), torch.from_numpy(mask), n_chunks


def answer_step(model, chunks: list, state, window: int = 0, memory_path: bool = False,
                autocast=None):
    """Forward and backward (no optimizer step) over consecutive `chunks` of every lane, each
    (tokens (B, T + 1), answer mask (B, T), reset (B,) bool or None), with the loss on the masked
    targets only, averaged over the step's answer tokens. Returns (loss, state after the chunks).

    window = 0: all chunks are one BPTT window (the model's bptt_chunks must cover them).
    window = k: truncated BPTT, a backward pass every k chunks with the state detached after it,
    so a fact further back than the window reaches the loss only through what carries it. With
    `memory_path` the chain of memory updates survives those detaches (memory-only
    backpropagation, `RecurrentState.track_memory_path`) and is backpropagated once the windows
    are done: the gates of every chunk of the step learn whether keeping the memory paid off."""
    if window and model.cfg.bptt_chunks < window:
        raise ValueError(f"window {window} is longer than the model's bptt_chunks "
                         f"{model.cfg.bptt_chunks}")
    from elephant.state import backprop_windows

    count = sum(m.sum() for _, m, _ in chunks).clamp(min=1).float()
    k = window or len(chunks)

    def run(part_chunks, state):
        part = 0.0
        for x, mask, reset in part_chunks:
            with autocast() if autocast else nullcontext():
                nll, state = model(x[:, :-1], state, reset, targets=x[:, 1:], loss_mask=mask,
                                   reduction="sum")
            part = part + nll
        (part / count).backward()
        return state, float(part.detach())

    state, losses = backprop_windows(state, [chunks[i:i + k] for i in range(0, len(chunks), k)],
                                     run, memory_path)
    return sum(losses) / float(count), state


def train_on_answers(model, opt, steps: int, lanes: int, chunk_len: int, gaps: tuple[int, int],
                     digits: int = 3, seed: int = 0, log=None, start_max_gap: int = 0,
                     before_step=None, memory_path: bool = False, window: int = 0,
                     log_gaps: bool = False, every_token: bool = False) -> list[dict]:
    """A short training loop with the loss on the answer digits only: the signal a CPU can afford
    (the CPU test; the CPU recall studies of docs/RESULTS.md); `every_token`: on every token of
    the documents instead (the LM loss, benchmarks/memory_probe.py). Each step is one batch of one-fact
    documents (distances uniform, or log-uniform with `log_gaps`), each a fresh lane state;
    `window` and `memory_path` as in `answer_step`. With
    `start_max_gap`, a curriculum: the largest distance grows geometrically from it to gaps[1]
    over the first half of the steps. Returns the answer loss every 50 steps.
    `before_step(step)`, if given, runs before each step (schedules)."""
    from data_packing.tokenizer import ByteTokenizer

    tok, rng, curve, t0 = ByteTokenizer(), np.random.default_rng(seed), [], time.perf_counter()
    model.train()
    device = model.embed.weight.device
    for step in range(steps):
        if before_step is not None:
            before_step(step)
        hi = gaps[1]
        if start_max_gap:
            grown = min(1.0, step / max(1, steps // 2))
            hi = int(round(start_max_gap * (gaps[1] / start_max_gap) ** grown))
        tokens, mask, n_chunks = answer_batch(rng, tok, lanes, chunk_len, (gaps[0], hi), digits,
                                              log_gaps, every_token)
        tokens, mask = tokens.to(device), mask.to(device)
        reset = torch.ones(lanes, dtype=torch.bool, device=device)
        chunks = [(tokens[:, c * chunk_len:(c + 1) * chunk_len + 1],
                   mask[:, c * chunk_len:(c + 1) * chunk_len], reset if c == 0 else None)
                  for c in range(n_chunks)]
        opt.set_step(step, steps)
        loss, _ = answer_step(model, chunks, model.init_state(lanes, device=device), window,
                              memory_path)
        opt.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad()
        if step % 50 == 0 or step == steps - 1:
            curve.append({"step": step, "loss" if every_token else "answer_loss": loss,
                          "seconds": time.perf_counter() - t0})
            if log:
                log(f"step {step} answer loss {loss:.3f}")
    return curve


class AnswerLanes:
    """Training input for the answer loss: each of `lanes` rows reads documents of `task` back to
    back, each padded to whole chunks so that a document always starts a chunk (with its lane's
    reset flag), so no step waits for its longest document. `next()` gives one chunk of every
    lane: (tokens (B, T + 1), answer mask (B, T) over the targets, reset (B,) bool)."""

    def __init__(self, task, tokenizer, lanes: int, chunk_len: int, seed: int = 0):
        self.task, self.tokenizer, self.T = task, tokenizer, chunk_len
        self.rng = np.random.default_rng(seed)
        self.tokens = [np.zeros(1, np.int64)] * lanes
        self.mask = [np.zeros(0, bool)] * lanes
        self.at = [0] * lanes                      # chunks of the lane's document already read
        self.documents = 0

    def _refill(self, b: int) -> None:
        doc = self.task.document(self.rng, self.tokenizer)
        n = max(1, document_chunks(len(doc.tokens), self.T))
        tokens = np.zeros(n * self.T + 1, np.int64)
        tokens[:len(doc.tokens)] = doc.tokens
        mask = np.zeros(n * self.T, bool)
        for q in doc.queries:
            mask[q.answer_start - 1:q.answer_start - 1 + q.answer_len] = True
        self.tokens[b], self.mask[b], self.at[b] = tokens, mask, 0
        self.documents += 1

    def next(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        T, B = self.T, len(self.tokens)
        reset = np.zeros(B, bool)
        for b in range(B):
            if self.at[b] * T >= len(self.mask[b]):
                self._refill(b)
                reset[b] = True
        a = [self.at[b] * T for b in range(B)]
        x = np.stack([self.tokens[b][a[b]:a[b] + T + 1] for b in range(B)])
        m = np.stack([self.mask[b][a[b]:a[b] + T] for b in range(B)])
        for b in range(B):
            self.at[b] += 1
        return torch.from_numpy(x), torch.from_numpy(m), torch.from_numpy(reset)


def train_recall(cfg, resume: bool = False, budget_s: float = 0.0, memory_path: bool = True,
                 log=print, stop_after_s: float = 0.0) -> dict:
    """Train `cfg` (a Config; model, optim and the data.recall_* task) on the answer loss:
    `train.lanes` rolling lanes of recall documents (AnswerLanes), every step advancing each lane
    by `step_chunks` = 4 x bptt_chunks chunks, with truncated BPTT over `bptt_chunks` and, with
    `memory_path`, memory-only backpropagation over the whole step (see `answer_step`). Runs
    `train.max_steps` steps, or as many as fit in `budget_s` seconds (measured after a warm-up,
    so the learning-rate schedule still runs to its end), then writes a checkpoint to
    `train.run_dir` that `eval` and `from_pretrained` read. With `resume`, continues from the newest
    intact checkpoint there (weights, optimizer and step; the lanes start new documents); without it,
    `train.init_from` starts from another run's weights.
    `stop_after_s` instead keeps the schedule of `train.max_steps` and stops (with a checkpoint)
    once that many seconds have passed: a long run split over several calls, each resuming the last.
    Returns a summary (steps, seconds, curve)."""
    from data_packing.recall import RecallTask
    from data_packing.tokenizer import load_tokenizer
    from elephant.checkpoint import (init_from, load_checkpoint, newest_intact_checkpoint,
                                     save_checkpoint)
    from elephant.model import ElephantLM
    from elephant.optim import build_optimizers

    from elephant.trainer import compile_mode, setup_runtime

    t, d = cfg.train, cfg.data
    from elephant.config import GRAPH_COMPILES, ConfigError
    if t.compile in GRAPH_COMPILES:
        raise ConfigError(f"train.compile = \"{t.compile}\" is train.py's (CUDA-graph steps whose "
                          f"state the trainer carries in fixed buffers); the recall trainer takes "
                          f"auto, on, model or off")
    rt = setup_runtime(cfg)          # train.device and train.dtype, as the general trainer reads them
    device = rt.device
    torch.manual_seed(t.seed)
    tokenizer = load_tokenizer(d.tokenizer)
    if tokenizer.vocab_size > cfg.model.vocab_size:
        from elephant.config import ConfigError
        raise ConfigError(f"model.vocab_size={cfg.model.vocab_size} is smaller than the "
                          f"tokenizer's vocabulary ({tokenizer.vocab_size})")
    model = ElephantLM(cfg.model).to(device)
    opt = build_optimizers(model, cfg.optim)
    step = 0
    if resume:
        ckpt, skipped = newest_intact_checkpoint(t.run_dir)
        for path, why in skipped:
            log(f"skipping {path}: {why}")
        meta, rank_state = load_checkpoint(ckpt, model)
        opt.load_state_dict(rank_state["optim"])
        step = int(meta["step"])
        log(f"resumed from {ckpt} (step {step})")
    elif t.init_from:   # a new stage (e.g. more facts per document) from another run's weights
        log(f"weights from {init_from(t.init_from, model, cfg.model.to_dict())}")
    model.compile_for(compile_mode(t.compile, device, graphs=False))   # auto: each block
    torch.manual_seed(t.seed * 1_000_003 + step)   # exploration noise (model.kv_keep) of a resumed run
    task = RecallTask(d.recall_min_gap, d.recall_max_gap, d.recall_max_pairs, d.recall_max_queries,
                      filler=filler_for(d.recall_filler, "train", d.site_packages))
    lanes = AnswerLanes(task, tokenizer, t.lanes, t.chunk_len, seed=t.seed * 1_000_003 + step)
    window = cfg.model.bptt_chunks
    step_chunks = 4 * window
    state = model.init_state(t.lanes, device=device)
    total, curve, t0, first, t10 = t.max_steps, [], time.perf_counter(), step, 0.0
    model.train()
    while step < total:
        chunks = []
        for _ in range(step_chunks):
            x, m, r = lanes.next()
            chunks.append((x.to(device, non_blocking=True), m.to(device, non_blocking=True),
                           r.to(device, non_blocking=True)))
        opt.set_step(step, total)
        loss, state = answer_step(model, chunks, state, window, memory_path, rt.autocast)
        opt.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        elapsed = time.perf_counter() - t0
        if budget_s and step == first + 10:            # compiled by now: time steps from here
            t10 = elapsed
        if budget_s and step == first + 30:            # fit the schedule to the budget
            per_step = (elapsed - t10) / 20
            total = min(total, step + max(1, int((budget_s - elapsed) / per_step)))
            log(f"{per_step:.3f} s per step: training {total} steps")
        if budget_s and elapsed > 1.05 * budget_s:      # never far past the budget
            total = step
        if stop_after_s and elapsed > stop_after_s and step < total:
            log(f"stopping at step {step} of {total} after {elapsed:.0f} s (resume to go on)")
            break
        if step % t.log_every == 0 or step == total:
            curve.append({"step": step, "answer_loss": loss, "seconds": elapsed,
                          "documents": lanes.documents})
            log(f"step {step} answer loss {loss:.4f} ({elapsed:.0f} s, {lanes.documents} documents)")
    if step > first:   # a resumed run that was already complete has nothing new to save
        save_checkpoint(t.run_dir, step, model, {"optim": opt.state_dict()},
                        {"config": cfg.to_dict(), "tokenizer": tokenizer.fingerprint, "step": step},
                        keep=t.keep_ckpts)
    return {"steps": step, "train_seconds": time.perf_counter() - t0, "curve": curve,
            "memory_path": memory_path, "step_chunks": step_chunks, "params": model.num_params()}


def format_table(result: dict, title: str = "") -> str:
    rows = result["by_distance"]
    head = "| distance | " + " | ".join(rows) + " |"
    sep = "|---|" + "---|" * len(rows)
    acc = "| digit accuracy | " + " | ".join(f"{r['accuracy']:.3f}" for r in rows.values()) + " |"
    ex = "| exact answers | " + " | ".join(f"{r['exact']:.3f}" for r in rows.values()) + " |"
    lines = ([title] if title else []) + [head, sep, acc, ex]
    if all("held" in r for r in rows.values()):
        lines.append("| fact's value kept | " + " | ".join(f"{r['held']:.3f}" for r in rows.values())
                     + " |")
    extra = (f"chance {result['chance']:.2f} per digit; {result['lanes']} documents x "
             f"{result['pairs']} fact(s); {result['tokens'] / 1e6:.1f}M tokens streamed at "
             f"{result['tokens_per_s'] / 1e3:,.0f}k tokens/s")
    if "mem_gate_closed_frac" in result:
        extra += f"; memory gates closed {result['mem_gate_closed_frac']:.1%} of slot-chunks"
    if "peak_mem_gb" in result:
        extra += f"; peak GPU memory {result['peak_mem_gb']:.2f} GB {result.get('peak_mem_gb_at', {})}"
    return "\n".join(lines + [extra])


# ---------------------------------------------------------------------- CLI
def _eval(args) -> int:
    from elephant.hub import from_pretrained

    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                          "cpu" if args.device == "auto" else args.device)
    model, tokenizer, config = from_pretrained(args.checkpoint, device=device,
                                               kv_keep=getattr(args, "kv_keep", None),
                                               kv_keep_read=getattr(args, "kv_keep_read", None))
    chunk_len = args.chunk_len or (config.get("train") or {}).get("chunk_len", 512)
    distances = [parse_count(d) for d in args.distances.split(",")]
    autocast = (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if device.type == "cuda" else None
    data = config.get("data") or {}
    spec = data.get("recall_filler", "") if args.filler is None else args.filler
    result = evaluate_recall(model, tokenizer, distances, args.lanes, chunk_len, device, args.pairs,
                             args.seed, autocast, progress=not args.no_progress and sys.stderr.isatty(),
                             ablation=args.ablate, offset=parse_count(getattr(args, "offset", "0")),
                             filler=filler_for(spec, "test", bool(data.get("site_packages"))))
    result["filler"] = spec or "synthetic"
    result["kv_keep"] = config["model"].get("kv_keep", 0)   # the kept tokens held here
    result["kv_keep_read"] = config["model"].get("kv_keep_read", 0)   # and each query's read of them
    result["checkpoint"] = str(args.checkpoint)
    # one key per distance (recall_4K, recall_1M: digit accuracy), and where and how it was measured
    result.update({f"recall_{label}": row["accuracy"] for label, row in result["by_distance"].items()})
    result.update(device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                  torch=torch.__version__, date=time.strftime("%Y-%m-%dT%H:%M:%S"),
                  command=" ".join(["python -m elephant.recall", *args.argv]))
    print(format_table(result, f"recall of {args.checkpoint}"))
    if args.json:
        from elephant.fsutil import atomic_write_json
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        atomic_write_json(args.json, result, indent=1)
    return 0


def _train(args) -> int:
    from elephant.config import ConfigError, load_config

    cfg = load_config(args.config, args.overrides)
    if not args.answer_loss:   # the general trainer: the loss on every token of the recall corpus
        for flag, given in (("--budget-s", args.budget_s), ("--no-memory-path", args.no_memory_path)):
            if given:
                raise ConfigError(f"{flag} belongs to the answer-only objective: add --answer-loss "
                                  "(the LM loss trains train.max_steps steps)")
        from elephant.trainer import Trainer
        if cfg.data.source != "recall":
            print(f"note: data.source is {cfg.data.source!r}, not 'recall'", file=sys.stderr)
        trainer = Trainer(cfg, resume=args.resume, progress=False if args.no_progress else None)
        trainer.fit(stop_after_s=args.stop_after_s)
        if not trainer.rt.main:
            return 0
    else:
        from elephant.rundir import claim_run_dir
        if cfg.data.length_curriculum_steps:   # recall.toml sets it for the LM loss
            print("note: data.length_curriculum_steps is the LM loss's; the answer-only lanes draw "
                  "documents of every length from the first step", file=sys.stderr)
        if cfg.model.kv_keep_cost:
            print("note: model.kv_keep_cost is the LM loss's; the answer-only loss does not "
                  "charge the kept tokens", file=sys.stderr)
        lock = claim_run_dir(cfg.train.run_dir, resume=args.resume, command=" ".join(sys.argv))
        try:
            info = train_recall(cfg, resume=args.resume, budget_s=args.budget_s,
                                stop_after_s=args.stop_after_s,
                                memory_path=not args.no_memory_path,
                                log=lambda m: print(m, file=sys.stderr, flush=True))
        finally:
            lock.release()
        print(f"trained {info['steps']} steps in {info['train_seconds']:.0f} s", file=sys.stderr)
    args.checkpoint = cfg.train.run_dir
    return _eval(args)


def parse(argv: list[str]) -> argparse.Namespace:
    """The subcommand, then its flags and (train) its overrides in any order. argparse cannot
    intermix the arguments of a subcommand, so the subcommand's own parser reads what follows it."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    parsers = {}
    for name in ("train", "eval"):
        s = parsers[name] = sub.add_parser(name)
        if name == "train":
            s.add_argument("--config", default="configs/recall.toml")
            s.add_argument("--resume", action="store_true")
            s.add_argument("--budget-s", type=float, default=0.0,
                           help="--answer-loss: train for about this many seconds (the schedule "
                                "fits them)")
            s.add_argument("--stop-after-s", type=float, default=0.0,
                           help="keep train.max_steps' schedule but stop (and checkpoint) after "
                                "this many seconds; --resume goes on")
            s.add_argument("--no-memory-path", action="store_true",
                           help="--answer-loss: no memory-only backpropagation past bptt_chunks")
            loss = s.add_mutually_exclusive_group()
            loss.add_argument("--lm-loss", action="store_true",
                              help="the general trainer, the loss on every token (the default)")
            loss.add_argument("--answer-loss", action="store_true",
                              help="the loss on the answer digits alone (train_recall)")
            s.add_argument("overrides", nargs="*", help="section.key=value")
        else:
            s.add_argument("--checkpoint", required=True, help="run dir, export folder or Hub id")
        s.add_argument("--distances", default=DEFAULT_DISTANCES,
                       help=f"comma-separated token distances (default {DEFAULT_DISTANCES})")
        s.add_argument("--lanes", type=int, default=32, help="documents streamed side by side")
        s.add_argument("--pairs", type=int, default=1, help="facts per document")
        s.add_argument("--chunk-len", type=int, default=0, help="default: the run's")
        s.add_argument("--seed", type=int, default=1234)
        s.add_argument("--ablate", default="none", choices=ABLATIONS,
                       help="drop one carried part of the state after every chunk")
        s.add_argument("--device", default="auto")
        s.add_argument("--filler", default=None,
                       help="the evaluation documents' filler, as data.recall_filler: \"\" for the "
                            "synthetic mix, pycode, or a text path (its test split); default: the "
                            "run's data.recall_filler")
        if name == "eval":
            s.add_argument("--offset", default="0",
                           help="start every document at this rotary position (e.g. 1M)")
            add_kept_arguments(s)
        s.add_argument("--json", help="write the results to this JSON file")
        s.add_argument("--no-progress", action="store_true")
    if argv and argv[0] in parsers:
        args = parsers[argv[0]].parse_intermixed_args(argv[1:])
        args.command = argv[0]
        return args
    return p.parse_args(argv)   # help, or the error that names the subcommands


def main(argv=None) -> int:
    argv = list(argv) if argv is not None else sys.argv[1:]
    args = parse(argv)
    args.argv = argv
    from data_packing import DataError
    from elephant.checkpoint import CheckpointError
    from elephant.config import ConfigError
    from elephant.hub import HubError
    from elephant.rundir import RunDirError
    try:
        if args.command == "eval":
            return _eval(args)
        return _train(args)
    except (ConfigError, DataError, CheckpointError, HubError, RunDirError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
