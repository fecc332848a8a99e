"""Does the LM loss teach the RMT memory at all? The CPU memory test's tiny model (attention only,
no KV window, 4 gated memory slots, BPTT over 8 chunks of 32 bytes: from the fact's chunk to the
answer's, two or more chunks later, the memory is the only path) trained on one-fact documents
(synthetic filler, facts asked 40-70 bytes later), with the loss on the answer digits alone (what
tests/test_recall.py trains) or on every token of the documents (the LM loss users train with),
then scored at 64 and 96 bytes, as trained and with the memory dropped after every chunk. No
kept tokens and no window compete with the memory here: what the loss gives it is all it gets.

The carrier (`--design`): `slots`, the gated RMT memory above; `delta`, no slots and the first
layer a gated delta rule mixer (layers DA: an associative memory written and read by every token,
its state carried from chunk to chunk, ARMT's and Gated DeltaNet's design); `mamba`, the same with
a Mamba-2 mixer (MA), the hybrid's own recurrent state; `kept`, no slots, a window of one chunk
and 4 kept tokens past it (model.kv_keep); `assoc`, those and the attention's associative memory
(model.kv_assoc: what leaves the window written by the delta rule at its keep gate, read by the
queries), scored also with the kept tokens dropped (the memory alone); `assoc-drop`, the same
trained with a lane's kept tokens dropped after half its chunks (kv_keep_drop 0.5); `assoc-top2`,
only the 2 of highest keep score written of each chunk's 32 leaving (kv_assoc_writes). "dropped"
clears the carrier after every chunk (the memory, the delta / SSM state, the kept tokens).

`--loss gain`: every token, each weighted by what the carried state gains it, as LongCE weighs
tokens by their long-context gain (Fang et al. 2024, https://arxiv.org/abs/2410.23771): a pass
without gradient with the carrier dropped after every chunk gives each token's loss without it,
and a token's weight is exp(that loss - its loss as carried), clipped to [1, GAIN_CAP]. Nothing in
it knows where the answers are: at first no token gains and the weights are 1 (the LM loss).

    python benchmarks/memory_probe.py --loss answers,every --steps 600 --seeds 0,1 \
        [--design slots,delta,mamba,kept,assoc,assoc-drop,assoc-top2] \
        [--out benchmarks/results/memory_probe_<date>_cpu.json]

Each (loss, steps, seed) trains in a process of its own, two at a time (one thread each).
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

DISTANCES = [64, 96]
# design -> (layers, memory slots, the part "dropped" clears, other model settings)
_KEPT = dict(kv_window=32, kv_keep=4)   # a window of one chunk and 4 kept tokens past it
DESIGNS = {"slots": ("AA", 4, "memory", {}), "delta": ("DA", 0, "delta", {}),
           "mamba": ("MA", 0, "ssm", {}), "kept": ("AA", 0, "kept", _KEPT),
           "assoc": ("AA", 0, "assoc", _KEPT | dict(kv_assoc=True)),
           "assoc-drop": ("AA", 0, "assoc", _KEPT | dict(kv_assoc=True, kv_keep_drop=0.5)),
           "assoc-top2": ("AA", 0, "assoc", _KEPT | dict(kv_assoc=True, kv_assoc_writes=2))}
LOSSES = ("answers", "every", "gain")
GAIN_CAP = 5.0


def tiny_memory_model(design: str = "slots"):
    """The CPU memory test's model and its optimizers (tests/test_recall.py trains it on the
    answers; seed torch first): no KV window, BPTT over 8 chunks; with `design` "slots" attention
    only and 4 memory slots whose gates start half open, else DESIGNS' recurrent first layer and
    no slots."""
    from elephant.config import ModelConfig, OptimConfig
    from elephant.model import ElephantLM
    from elephant.optim import build_optimizers
    layers, n_mem, _, extra = DESIGNS[design]
    cfg = ModelConfig(**(dict(vocab_size=128, d_model=64, n_heads=4, layers=layers, d_mlp=128,
                              n_mem=n_mem, kv_window=0, bptt_chunks=8, mem_gate_init=0.0,
                              ssd_chunk=16) | extra))
    model = ElephantLM(cfg)
    return model, build_optimizers(model, OptimConfig(
        warmup_steps=20, momentum_warmup_steps=20, adam_lr=0.003, embed_lr=0.003, head_lr=0.003))


def run_one(loss: str, steps: int, seed: int, design: str = "slots") -> dict:
    """Train and score one model in this process."""
    import torch

    from data_packing.tokenizer import ByteTokenizer
    from elephant.recall import evaluate_recall, train_on_answers
    torch.set_num_threads(1)
    torch.manual_seed(seed)
    model, opt = tiny_memory_model(design)
    t0 = time.perf_counter()
    if loss == "gain":
        curve = train_on_gain(model, opt, steps, DESIGNS[design][2], seed)
    else:
        curve = train_on_answers(model, opt, steps=steps, lanes=32, chunk_len=32, gaps=(40, 70),
                                 digits=3, seed=seed, every_token=loss == "every")
    seconds = time.perf_counter() - t0
    cpu = torch.device("cpu")
    out = {"design": design, "loss": loss, "steps": steps, "seed": seed,
           "train_seconds": seconds, "curve": curve}
    drops = [("recall", "none"), ("memory_dropped", DESIGNS[design][2])]
    if DESIGNS[design][2] == "assoc":   # the memory alone: the kept tokens dropped
        drops.append(("kept_dropped", "kept"))
    for name, ablation in drops:
        r = evaluate_recall(model, ByteTokenizer(), DISTANCES, 32, 32, cpu, digits=3,
                            ablation=ablation)
        out[name] = {d: row["accuracy"] for d, row in r["by_distance"].items()}
    return out


def train_on_gain(model, opt, steps: int, carrier: str, seed: int, lanes: int = 32,
                  chunk_len: int = 32) -> list[dict]:
    """train_on_answers' documents and schedule with every token in the loss, each weighted by
    its gain from the carried state (`--loss gain`, the module doc): the loss is the weighted sum
    over the tokens' count. Returns the mean weight and the loss every 50 steps."""
    import numpy as np
    import torch

    from data_packing.tokenizer import ByteTokenizer
    from elephant.recall import ablate, answer_batch
    tok, rng, curve = ByteTokenizer(), np.random.default_rng(seed), []
    model.train()
    for step in range(steps):
        tokens, mask, n_chunks = answer_batch(rng, tok, lanes, chunk_len, (40, 70), 3,
                                              every_token=True)
        chunks = [(tokens[:, c * chunk_len:(c + 1) * chunk_len + 1],
                   mask[:, c * chunk_len:(c + 1) * chunk_len]) for c in range(n_chunks)]
        reset = torch.ones(lanes, dtype=torch.bool)
        with torch.no_grad():   # each token's loss with the carrier dropped after every chunk
            state, short = model.init_state(lanes), []
            for c, (x, m) in enumerate(chunks):
                nll, state = model(x[:, :-1], state, reset if c == 0 else None, targets=x[:, 1:],
                                   loss_mask=m, reduction="none")
                short.append(nll)
                state = ablate(model, state, carrier)
        opt.set_step(step, steps)
        state, total, weights = model.init_state(lanes), 0.0, []
        for c, (x, m) in enumerate(chunks):
            nll, state = model(x[:, :-1], state, reset if c == 0 else None, targets=x[:, 1:],
                               loss_mask=m, reduction="none")
            w = torch.exp(short[c] - nll.detach()).clamp(1.0, GAIN_CAP) * m
            total = total + (w * nll).sum()
            weights.append(w[m])
        count = float(sum(int(m.sum()) for _, m in chunks))
        (total / count).backward()
        opt.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad()
        if step % 50 == 0 or step == steps - 1:
            curve.append({"step": step, "weighted_loss": float(total) / count,
                          "mean_weight": float(torch.cat(weights).mean())})
    return curve


def names(text: str, known, flag: str) -> list[str]:
    """'a,b' -> ['a', 'b'], each one of `known`, else a SystemExit naming `flag`."""
    out = [x for x in text.split(",") if x]
    bad = [x for x in out if x not in known]
    if bad:
        raise SystemExit(f"{flag}: unknown {bad[0]!r}; expected one of {', '.join(known)}")
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--loss", default="answers,every", help=f"comma-separated: {', '.join(LOSSES)}")
    p.add_argument("--steps", default="600", help="comma-separated step counts")
    p.add_argument("--seeds", default="0,1")
    p.add_argument("--design", default="slots", help=f"comma-separated: {', '.join(DESIGNS)}")
    p.add_argument("--parallel", type=int, default=2)
    p.add_argument("--out")
    p.add_argument("--one", nargs=4, metavar=("LOSS", "STEPS", "SEED", "DESIGN"),
                   help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.one:
        print(json.dumps(run_one(args.one[0], int(args.one[1]), int(args.one[2]), args.one[3])))
        return 0
    losses, designs = names(args.loss, LOSSES, "--loss"), names(args.design, DESIGNS, "--design")
    runs = [(loss, int(n), int(s), d) for d in designs for loss in losses
            for n in args.steps.split(",") for s in args.seeds.split(",")]

    def spawn(spec):
        r = subprocess.run([sys.executable, __file__, "--one", *map(str, spec)],
                           capture_output=True, text=True, cwd=ROOT)
        if r.returncode:
            raise SystemExit(f"{spec}: failed\n{r.stderr[-2000:]}")
        row = json.loads(r.stdout.strip().splitlines()[-1])
        print(f"{row['design']:6s} {row['loss']:8s} {row['steps']:5d} steps seed {row['seed']}: recall "
              f"{[round(v, 2) for v in row['recall'].values()]}, memory dropped "
              f"{[round(v, 2) for v in row['memory_dropped'].values()]}"
              + (f", kept dropped {[round(v, 2) for v in row['kept_dropped'].values()]}"
                 if "kept_dropped" in row else "") + " "
              f"({row['train_seconds']:.0f} s)", flush=True)
        return row
    with ThreadPoolExecutor(args.parallel) as pool:
        rows = list(pool.map(spawn, runs))
    from benchmarks.common import environment
    out = {"benchmark": "memory_probe", **environment("cpu"), "distances": DISTANCES,
           "chance": 0.1, "designs": {d: DESIGNS[d][0] for d in designs}, "runs": rows}
    path = Path(args.out) if args.out else (
        ROOT / "benchmarks" / "results" / f"memory_probe_{time.strftime('%Y-%m-%d')}_cpu.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
