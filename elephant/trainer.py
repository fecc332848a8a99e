"""The training loop: every step advances every lane by `bptt_chunks` chunks of its document
(times `train.memory_windows`).

The recurrent state (KV windows, Mamba conv/SSM state, RMT memory) of a lane persists from step
to step while the lane stays in its document, and is reset by the batcher's flags when a new
document takes the lane. Gradients flow through the `bptt_chunks` chunks of a window, and the
state is detached after it. With memory and `memory_windows` > 1, a step is several windows, each
backpropagated on its own, and the chain of memory updates is kept across them
(`RecurrentState.track_memory_path`): a loss reaches the memory gates of every earlier chunk of
the step, not only of its window.

Data parallelism without a DDP wrapper: the global batch is `world_size x grad_accum` shards of
`lanes` lanes, each shard with its own batcher (rank r's micro-batch g is shard r * grad_accum + g)
and its own recurrent state, so one process with grad_accum=2 sees exactly the data of two
processes with grad_accum=1. The loss is summed and divided by the global count of real tokens;
the optimizers reduce-scatter the gradients, update their slice and all-gather.
"""
from __future__ import annotations

import json
import math
import os
import platform
import signal
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor

from .checkpoint import init_from
from .config import GRAPH_COMPILES, Config, ConfigError
from .evaluate import evaluate, open_corpus, to_device
from .fsutil import atomic_write_json
from . import run_checkpoint
from .metrics import mfu, peak_flops
from . import model as model_mod
from .model import ElephantLM
from .state import StaticCarry, backprop_windows
from .optim import build_optimizers
from .preemption import StopRequest, signal_name
from .rundir import RunDirError, RunLock, claim_run_dir


class TrainingStopped(RuntimeError):
    """The run stopped on purpose (too many non-finite losses); the message says why."""


@dataclass
class Runtime:
    device: torch.device
    dtype: torch.dtype          # autocast dtype (float32: no autocast)
    rank: int = 0
    world: int = 1

    @property
    def main(self) -> bool:
        return self.rank == 0

    def autocast(self):
        if self.dtype == torch.float32:
            return nullcontext()
        return torch.autocast(self.device.type, dtype=self.dtype)


def compile_mode(setting: str, device, graphs: bool = True) -> str:
    """train.compile -> ElephantLM.compile_for's mode. auto: nothing on the CPU; on CUDA a BPTT
    window's chunks as one CUDA graph (`window`, the fastest step: docs/RESULTS.md, issue 12) where
    the caller's steps can replay CUDA graphs (`graphs`: train.py's with one memory window; the
    memory-only backpropagation across several windows keeps what the next replay overwrites),
    else each block compiled."""
    if setting == "auto":
        if torch.device(device).type != "cuda":
            return "off"
        return "window" if graphs else "blocks"
    return {"on": "blocks", "model": "model", "graphs": "graphs", "window": "window",
            "off": "off"}[setting]


def setup_runtime(cfg: Config) -> Runtime:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    want = cfg.train.device
    if want == "auto":
        want = "cuda" if torch.cuda.is_available() else "cpu"
    if want.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"train.device={cfg.train.device}: CUDA is not available on this machine")
    if want == "cuda":
        want = f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}"
    device = torch.device(want)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}.get(cfg.train.dtype)
    if dtype is None:
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    return Runtime(device, dtype, rank, world)


class Trainer:
    """One run in `train.run_dir`, which it holds locked from construction until `fit()` ends
    (or `close()`): `resume` continues the run there, `restart` moves an earlier run aside."""

    def __init__(self, cfg: Config, resume: bool = False, progress: bool | None = None,
                 restart: bool = False):
        self.cfg = cfg
        self.rt = setup_runtime(cfg)
        self.run_dir = Path(cfg.train.run_dir)
        self.progress = sys.stderr.isatty() if progress is None else progress
        self.stop_request = None   # fit's StopRequest, read by train_step with several ranks
        self.lock = self._claim_run_dir(resume, restart)
        try:
            self._setup(resume)
        except BaseException:
            self.close()
            raise

    def _setup(self, resume: bool) -> None:
        cfg, rt = self.cfg, self.rt
        torch.manual_seed(cfg.train.seed)
        np.random.seed(cfg.train.seed)

        self.tokenizer, self.train_corpus = open_corpus(cfg.data, cfg.data.train_split, rt)
        self.valid_corpus = None
        if cfg.data.valid_split:
            self.valid_corpus = open_corpus(cfg.data, cfg.data.valid_split, rt)[1]
        if self.tokenizer.vocab_size > cfg.model.vocab_size:
            raise ConfigError(f"model.vocab_size={cfg.model.vocab_size} is smaller than the "
                              f"tokenizer's vocabulary ({self.tokenizer.vocab_size})")

        self.model = ElephantLM(cfg.model).to(rt.device)
        if cfg.train.init_from and not resume:   # a resumed run has weights of its own
            ckpt = init_from(cfg.train.init_from, self.model, cfg.model.to_dict())
            if rt.main:
                print(f"weights from {ckpt}", file=sys.stderr)
        if rt.world > 1:  # every rank starts from rank 0's weights
            for p in self.model.parameters():
                dist.broadcast(p.data, 0)
        self.opt = build_optimizers(self.model, cfg.optim)
        # the mode train.compile resolves to here (auto: see compile_mode)
        self.compile = compile_mode(cfg.train.compile, rt.device, cfg.train.memory_windows == 1)
        self.model.compile_for(self.compile)

        from data_packing import RollingChunkBatcher
        t = cfg.train
        shards = rt.world * t.grad_accum
        # the length curriculum counts a lane group's batches: bptt_chunks x memory_windows a step
        steps = cfg.data.length_curriculum_steps
        curriculum = ((cfg.data.length_curriculum_start,
                       steps * cfg.model.bptt_chunks * t.memory_windows) if steps else None)
        self.batchers = [RollingChunkBatcher(self.train_corpus, lanes=t.lanes, chunk_len=t.chunk_len,
                                             seed=t.seed, rank=rt.rank * t.grad_accum + g,
                                             world_size=shards, pack=cfg.data.pack,
                                             curriculum=curriculum)
                         for g in range(t.grad_accum)]
        self.iters = [iter(b) for b in self.batchers]
        self.states = [self.init_state() for _ in range(t.grad_accum)]
        # CUDA-graph steps of one lane group carry their state in fixed buffers (StaticCarry);
        # several groups take turns on the same graphs, so each group's state and gradients are
        # moved out of the graphs' memory after its window (`_set_aside`)
        graphs = self.compile in GRAPH_COMPILES
        self.carry = StaticCarry() if graphs and t.grad_accum == 1 else None
        self.aside_grads: dict | None = {} if graphs and t.grad_accum > 1 else None
        self.step = 0
        self.bad_steps = 0
        self.skipped_steps = 0
        self.tokens_seen = 0
        self.saved_step: int | None = None  # the step of the newest checkpoint this run wrote or read
        self.resume_record: dict | None = None
        if resume:
            self._resume()
        elif rt.main:
            atomic_write_json(self.run_dir / "resolved_config.json", cfg.to_dict(), indent=1)
            atomic_write_json(self.run_dir / "env.json", environment(rt), indent=1)

    # ------------------------------------------------------------------ the run dir
    def _agree(self, value: int, op: str) -> int:
        """`value` combined over ranks by "min" or "max"; a collective, so every rank calls it at
        the same point (world size 1: the value itself)."""
        if self.rt.world == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64, device=self.rt.device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN if op == "min" else dist.ReduceOp.MAX)
        return int(t.item())

    def _claim_run_dir(self, resume: bool, restart: bool) -> RunLock | None:
        """Rank 0 locks the run dir (see rundir.py); every rank stops if it could not."""
        lock, error = None, None
        if self.rt.main:
            try:
                lock = claim_run_dir(self.run_dir, resume=resume, restart=restart,
                                     command=" ".join([Path(sys.argv[0]).name, *sys.argv[1:]]))
            except RunDirError as e:
                error = e
        if not self._agree(int(error is None), "min"):
            raise error or RunDirError(f"{self.run_dir}: rank 0 could not claim it (see its message)")
        return lock

    def close(self) -> None:
        """Release the run dir; `fit()` does it when it ends. Idempotent."""
        if self.lock is not None:
            self.lock.release()
            self.lock = None

    # ------------------------------------------------------------------ checkpoints
    def save(self) -> Path:
        """Checkpoint this step (model, every rank's optimizer, lanes' state and batchers, RNG);
        see run_checkpoint.save_run."""
        return run_checkpoint.save_run(self)

    def _resume(self) -> None:
        """Continue from the newest intact checkpoint (run_checkpoint.resume_run)."""
        run_checkpoint.resume_run(self)

    # ------------------------------------------------------------------ one step
    def train_step(self) -> dict:
        """Advance every lane by bptt_chunks x memory_windows chunks, backpropagate through each
        window of bptt_chunks (and, with memory and several windows, through the memory updates
        across them: memory-only backpropagation), update.

        One host synchronization per step: reading the loss, to skip the update of a non-finite
        step. With one window per lane group (no memory_windows) the loss's copy to the host is
        queued right after the last group's forward pass, without waiting, and its backward right
        after it; the host then waits for the copy (the forward alone) and queues the clipping and
        the optimizer step while the GPU runs the backward, so the GPU never idles between the
        forward and the backward, nor while the optimizer's many small launches are queued (a
        non-finite step has run its backward; its update is skipped and its gradients dropped).
        Else the loss is read after the last backward is queued. The batches go to the device by
        non-blocking copies and the token count is taken from the host's masks. `grad_norm` is
        returned as a 0-d device tensor: reading it waits for the GPU, so the loop reads it only
        when it logs. With several ranks `stop` is the largest stop signal (SIGTERM, SIGINT) any
        rank had received by the end of its forward (0: none; `fit` stops every rank after the step
        where it is set)."""
        rt, cfg = self.rt, self.cfg
        k, windows = cfg.model.bptt_chunks, cfg.train.memory_windows
        memory_path = windows > 1 and cfg.model.n_mem > 0
        groups = [[next(it) for _ in range(k * windows)] for it in self.iters]
        n_local = sum(int(b.loss_mask.sum()) for g in groups for b in g)   # host tensors: no sync
        if rt.world > 1:
            # through pinned memory: torch.tensor(..., device=cuda) copies from pageable memory and
            # waits for every queued kernel, which drained the GPU at each step's start
            count = to_device(torch.tensor(float(n_local), dtype=torch.float64), rt.device)
            dist.all_reduce(count)
            scale = rt.world / count.clamp(min=1).float()
        else:
            count = n_local
            scale = float(np.float32(1) / np.float32(max(n_local, 1)))  # as the float32 division

        def stage(total: Tensor):
            """Queue the step's mean loss over every rank and its token count for the host, without
            waiting; the function returned waits for them and returns (loss, tokens, stop): the
            sync. With several ranks `stop` is the largest stop signal any rank has had by now
            (`stop_request`): a small max all-reduce queued beside the loss's and read in the same
            copy, so that every rank stops after the same step without a wait of its own; else 0."""
            if rt.world > 1:
                dist.all_reduce(total)
                signum = self.stop_request.signum if self.stop_request is not None else 0
                stop = torch.full((), float(signum), dtype=torch.float64, device=total.device)
                dist.all_reduce(stop, op=dist.ReduceOp.MAX)
                values = torch.stack([total / count.clamp(min=1), count, stop])
            else:
                values = (total / max(count, 1)).reshape(1)

            def result(read: list) -> tuple[float, int, int]:
                return ((read[0], int(read[1]), int(read[2])) if rt.world > 1
                        else (read[0], count, 0))
            if not values.is_cuda:
                return lambda: result(values.tolist())
            host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
            host.copy_(values, non_blocking=True)
            done = torch.cuda.Event()
            done.record()

            def wait():
                done.synchronize()
                return result(host.tolist())
            return wait

        staged: list = []
        total = torch.zeros((), dtype=torch.float64, device=rt.device)
        for g, batches in enumerate(groups):
            on_loss = None
            if windows == 1 and g == len(groups) - 1:   # the earlier groups' losses are in total
                on_loss = lambda window_loss: staged.append(stage(total + window_loss))  # noqa: E731
            self.states[g], losses = backprop_windows(
                self.states[g], [batches[w * k:(w + 1) * k] for w in range(windows)],
                lambda window, state: self._window(window, state, scale, on_loss), memory_path)
            total += sum(losses)
        if self.aside_grads is not None:
            self._take_back_grads()
        loss, n_tokens, stop = (staged[0] if staged else stage(total))()
        out = {"loss": loss, "tokens": n_tokens}
        if rt.world > 1:
            out["stop"] = stop
        if math.isfinite(loss):
            out.update(self.opt.set_step(self.step, cfg.train.max_steps))
            if self.compile in GRAPH_COMPILES and self.opt.graphable():
                # clipping and the update compiled and replayed as one CUDA graph (with several
                # processes, the collectives around it; the CPU runs the same compiled update
                # without a graph)
                norm = self.opt.graphed_step(cfg.optim.grad_clip, model_mod.COMPILE_BACKEND)
                if cfg.optim.grad_clip:
                    out["grad_norm"] = norm
            else:
                if cfg.optim.grad_clip:
                    out["grad_norm"] = self.opt.clip_grad_norm_(cfg.optim.grad_clip)
                self.opt.step()
            self.bad_steps = 0
        else:
            # skip the update; the lanes keep their documents but restart from a clean state
            self.bad_steps += 1
            self.skipped_steps += 1
            self.states = [self.init_state() for _ in self.states]
            out["skipped"] = True
        self.opt.zero_grad(set_to_none=True)
        self.step += 1
        self.tokens_seen += n_tokens
        return out

    def init_state(self):
        """A fresh state for the lanes of one group, its attention window in the dtype the model
        computes in (model.init_state's kv_dtype)."""
        return self.model.init_state(self.cfg.train.lanes, kv_dtype=self.rt.dtype)

    def _window(self, batches: list, state, scale, on_loss=None) -> tuple:
        """Forward the chunks of one BPTT window, backpropagate their summed loss x `scale`, and
        return (the state after them, the summed loss as a float64 tensor). `on_loss`: called with
        that loss before the backward is queued."""
        rt, cfg = self.rt, self.cfg
        graphs = self.compile in GRAPH_COMPILES
        if graphs:  # a new step of the CUDA graphs: the last one's outputs may be overwritten
            torch.compiler.cudagraph_mark_step_begin()
            if self.carry is not None:
                state = self.carry.take(state)   # read in place by the first chunk's graph
        window = self.compile == "window"   # the window's chunks as one graph
        loss, chunks = 0.0, []
        for b in batches:
            tokens = to_device(b.tokens, rt.device)
            # packed rows: the boundary path only for chunks where a document starts inside
            # (the batcher's host-side count, which also sizes attention's per-document layout);
            # a start at token 0 is the reset flag. The initial memory's prefix is computed by the
            # window's first such chunk, in its own step, and the state carries it to the later
            # ones (RecurrentState.prefix)
            starts = to_device(b.starts, rt.device) if cfg.data.pack and b.inner_starts else None
            chunk = dict(tokens=tokens[:, :-1], targets=tokens[:, 1:],
                         reset=to_device(b.reset, rt.device),
                         loss_mask=to_device(b.loss_mask, rt.device), starts=starts,
                         inner_starts=b.inner_starts)
            if window:
                chunks.append(chunk)
                continue
            with rt.autocast():
                nll, state = self.model(state=state, reduction="sum", **chunk)
            loss = loss + nll
        if window:
            with rt.autocast():
                loss, state = self.model.forward_window(chunks, state)
        # model.kv_keep_cost: the kept tokens the lanes carry on, charged for the window's tokens
        cost = self.model.keep_cost(state, len(batches) * cfg.train.chunk_len)
        if cost is not None:
            loss = loss + cost
        if on_loss is not None:
            on_loss(loss.detach().double())
        # the optimizers average gradients over ranks: scale so the average is the global mean
        (loss * scale).backward()
        loss = loss.detach().double()
        if graphs:  # the state goes on past this step: out of the graphs' memory
            state = self.carry.take(state) if self.carry is not None else self._set_aside(state)
        return state, loss

    def _set_aside(self, state):
        """After a lane group's window, with several groups on CUDA graphs: the next group's replay
        reuses the graphs' memory, which holds this group's final state and the gradients its
        backward left in the parameters' `.grad`. Both are moved out: the state cloned, the
        gradients added into `aside_grads` (the first group's copied) and `.grad` cleared; the
        step's last group takes them back (`_take_back_grads`), so the update sees their sum, as
        the eager trainer accumulates it. One multi-tensor pass over the gradients a group."""
        with torch.no_grad():
            first, more = [], []
            for p in self.model.parameters():
                if p.grad is not None:
                    (more if p in self.aside_grads else first).append(p)
            if more:
                torch._foreach_add_([self.aside_grads[p] for p in more], [p.grad for p in more])
            if first:
                for p, g in zip(first, torch._foreach_mul([p.grad for p in first], 1.0)):
                    self.aside_grads[p] = g
            for p in first + more:
                p.grad = None
        return state.clone()

    def _take_back_grads(self) -> None:
        """The lane groups' summed gradients back into `.grad`, for the update."""
        for p, g in self.aside_grads.items():
            p.grad = g
        self.aside_grads = {}

    # ------------------------------------------------------------------ evaluation
    def validate(self) -> dict | None:
        if self.valid_corpus is None:
            return None
        t = self.cfg.train
        return evaluate(self.model, self.valid_corpus, lanes=t.lanes, chunk_len=t.chunk_len,
                        device=self.rt.device, autocast=self.rt.autocast, max_docs=t.eval_docs,
                        rank=self.rt.rank, world=self.rt.world, pack=self.cfg.data.pack_eval)

    # ------------------------------------------------------------------ the run
    def fit(self, stop_after_s: float = 0.0) -> dict:
        """Train to `max_steps`; on SIGTERM or SIGINT finish the step, write a checkpoint and return
        early (`preempted`: the signal's number, `checkpoint`: the folder written). With
        `stop_after_s`, a step that starts later than that many seconds after the call is taken as
        a SIGTERM's (the same stop, agreed by every rank). Releases the run dir when it returns or
        raises."""
        try:
            with StopRequest(announce=self.rt.main) as stop, \
                    RunLog(self.run_dir, self.rt.main, self.cfg.train.tensorboard) as log:
                self.stop_request = stop
                return self._fit(log, stop, time.monotonic() + stop_after_s if stop_after_s else None)
        finally:
            self.stop_request = None
            self.close()

    def _fit(self, log: "RunLog", stop: StopRequest, deadline: float | None) -> dict:
        rt, t = self.rt, self.cfg.train
        for record in (self.resume_record, self._data_record()):
            if record is not None:
                log.write(record)
        flops = self.model.flops_per_token(t.chunk_len)
        peak = peak_flops(torch.cuda.get_device_name(rt.device) if rt.device.type == "cuda" else None)
        if rt.main and self.step == 0:
            print(f"model: {self.model.num_params() / 1e6:.2f}M parameters, layers "
                  f"{self.cfg.model.layers}, {rt.world} x {t.grad_accum} x {t.lanes} lanes of "
                  f"{t.chunk_len} tokens, device {rt.device} ({str(rt.dtype).split('.')[-1]})",
                  file=sys.stderr)
            print(self.opt.table(), file=sys.stderr)
        bar = None
        if rt.main and self.progress:
            from tqdm import tqdm
            bar = tqdm(total=t.max_steps, initial=self.step, dynamic_ncols=True, desc="train")
        last_eval, preempted = None, 0
        t0, tokens0 = time.perf_counter(), self.tokens_seen
        while self.step < t.max_steps:
            if deadline is not None and not stop.signum and time.monotonic() >= deadline:
                stop.signum = signal.SIGTERM
            out = self.train_step()
            agreed = out.pop("stop", 0)   # several ranks: every rank's stop signal, reduced
            if self.bad_steps >= t.max_bad_steps:
                raise TrainingStopped(
                    f"{self.bad_steps} consecutive steps had a non-finite loss; stopped at step "
                    f"{self.step}. The last good checkpoint in {self.run_dir / 'checkpoints'} is "
                    f"intact: resume from it with a lower learning rate.")
            if self.step % t.log_every == 0 or self.step == t.max_steps:
                if rt.device.type == "cuda":
                    torch.cuda.synchronize()
                dt = time.perf_counter() - t0
                tok_s = (self.tokens_seen - tokens0) / max(dt, 1e-9)  # global real tokens
                out = {k: float(v) if torch.is_tensor(v) else v for k, v in out.items()}
                record = {"kind": "train", "step": self.step, **out, "tokens_per_s": tok_s,
                          "fill": float(np.mean([b.last_fill for b in self.batchers])),
                          "docs_completed": sum(b.docs_completed for b in self.batchers),
                          "skipped_steps": self.skipped_steps}
                m = mfu(flops, tok_s / rt.world, peak)
                if m is not None:
                    record["mfu"] = m
                if rt.device.type == "cuda":
                    record["peak_mem_gb"] = torch.cuda.max_memory_allocated(rt.device) / 2**30
                log.write(record)
                if bar is not None:
                    bar.set_postfix(loss=f"{out['loss']:.4f}", tok_s=f"{tok_s:,.0f}",
                                    fill=f"{record['fill']:.2f}",
                                    **({"mfu": f"{m:.1%}"} if m is not None else {}))
                elif rt.main:
                    print(f"step {self.step}/{t.max_steps} loss {out['loss']:.4f} "
                          f"tok/s {tok_s:,.0f} fill {record['fill']:.2f}", file=sys.stderr)
                t0, tokens0 = time.perf_counter(), self.tokens_seen
            if bar is not None:
                bar.update(1)
            # a signal on any rank stops every rank after this same step: with several ranks the
            # step reduced the ranks' signals with its loss (a per-step collective and wait here
            # drained every GPU's queue before the next step was queued)
            preempted = agreed if rt.world > 1 else stop.signum
            if preempted and self.step < t.max_steps:
                break
            if t.eval_every and self.step % t.eval_every == 0 and self.step < t.max_steps:
                last_eval = self._eval_and_log(log)
                t0, tokens0 = time.perf_counter(), self.tokens_seen
            if (t.ckpt_every and self.step % t.ckpt_every == 0 and self.step < t.max_steps
                    and not self.bad_steps):  # never checkpoint in the middle of a bad streak
                self.save()
        if bar is not None:
            bar.close()
        result = {"step": self.step, "eval": last_eval, "skipped_steps": self.skipped_steps}
        if preempted and self.step < t.max_steps:
            # in a bad streak the newest checkpoint stays the last good one
            ckpt = None if self.bad_steps else self.save()
            log.write({"kind": "preempted", "step": self.step, "signal": signal_name(preempted),
                       "checkpoint": str(ckpt) if ckpt else None})
            return dict(result, preempted=preempted, checkpoint=ckpt)
        result["eval"] = self._eval_and_log(log) or last_eval
        self.save()
        log.close()
        if rt.main:
            plot_losses(self.run_dir / "log.jsonl", self.run_dir / "loss.png")
        return result

    def _data_record(self) -> dict:
        """The corpora's counts for the log; a note when documents had bytes that are not UTF-8."""
        record = {"kind": "data", "step": self.step}
        for split, corpus in (("train", self.train_corpus), ("valid", self.valid_corpus)):
            if corpus is None:
                continue
            m = corpus.manifest
            record[split] = {"documents": len(corpus), "tokens": corpus.n_tokens,
                             "invalid_utf8_docs": m.get("invalid_utf8_docs", 0),
                             "skipped_empty_docs": m.get("skipped_empty_docs", 0)}
            bad = record[split]["invalid_utf8_docs"]
            if bad and self.rt.main:
                print(f"note: {bad} document{'s' * (bad != 1)} of the {split} split had bytes that "
                      f"are not UTF-8, replaced by U+FFFD ({corpus.path})", file=sys.stderr)
        return record

    def _eval_and_log(self, log: "RunLog") -> dict | None:
        result = self.validate()
        if result is not None:
            scalars = {k: v for k, v in result.items() if isinstance(v, (int, float))}
            log.write({"kind": "eval", "step": self.step, **scalars})
            if self.rt.main:
                print(f"eval step {self.step}: loss {result['loss']:.4f} "
                      f"bpb {result['bits_per_byte']:.4f} over {result['documents']} documents",
                      file=sys.stderr)
        return result


# ---------------------------------------------------------------------- logging
class RunLog:
    """log.jsonl (one record per line, appended, so a resumed run continues it) + TensorBoard."""

    def __init__(self, run_dir: Path, enabled: bool, tensorboard: bool):
        self.enabled = enabled
        self.file = None
        if enabled:
            path = run_dir / "log.jsonl"
            self.file = open(path, "a")
            if self.file.tell() and _last_byte(path) != b"\n":
                self.file.write("\n")  # a line cut short by a killed run must not swallow the next
        self.tb = None
        if enabled and tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
                self.tb = SummaryWriter(str(run_dir / "tb"))
            except ImportError:
                pass

    def write(self, record: dict) -> None:
        if not self.enabled:
            return
        record = {"time": time.time(), **record}
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        if self.tb is not None:
            for k, v in record.items():
                if isinstance(v, (int, float)) and k not in ("step", "time"):
                    self.tb.add_scalar(f"{record['kind']}/{k}", v, record["step"])

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
            self.file = None
        if self.tb is not None:
            self.tb.close()
            self.tb = None

    def __enter__(self) -> "RunLog":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _last_byte(path: Path) -> bytes:
    with open(path, "rb") as f:
        f.seek(-1, os.SEEK_END)
        return f.read(1)


def read_log(path: Path) -> list[dict]:
    """Records of a log.jsonl; for a step logged twice (a resumed run) the later record wins."""
    records: dict = {}
    for line in Path(path).read_text().splitlines():
        try:
            r = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut short by a killed run
        records[(r["kind"], r["step"])] = r
    return sorted(records.values(), key=lambda r: (r["step"], r["kind"]))


def plot_losses(log_path: Path, out: Path) -> Path | None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    records = read_log(log_path)
    fig, ax = plt.subplots(figsize=(7, 4))
    for kind, style in (("train", "-"), ("eval", "o-")):
        rs = [r for r in records if r["kind"] == kind and math.isfinite(r.get("loss", math.nan))]
        if rs:
            ax.plot([r["step"] for r in rs], [r["loss"] for r in rs], style,
                    label="valid" if kind == "eval" else "train")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats / token)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def environment(rt: Runtime) -> dict:
    import subprocess
    env = {"python": sys.version.split()[0], "torch": torch.__version__, "platform": platform.platform(),
           "device": str(rt.device), "world_size": rt.world, "numpy": np.__version__}
    try:
        import triton
        env["triton"] = triton.__version__
    except ImportError:
        pass
    if rt.device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(rt.device)
        env["cuda"] = torch.version.cuda
    try:
        env["git_commit"] = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                                           cwd=Path(__file__).parent, timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        pass
    return env
