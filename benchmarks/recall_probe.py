"""Why recall decays: what a trained recall model writes into its memory, and how long it stays.

    python benchmarks/recall_probe.py --checkpoint runs/recall-long [--distances 700,1500,3000,6000]
           [--lanes 32] [--device cpu] [--out benchmarks/results/recall_probe.json]

Streams held-out recall documents (one fact, asked again at each distance from its previous
mention; `data_packing.recall.eval_document`) chunk by chunk with carried state, as
`python -m elephant.recall eval` does, and records after every chunk each memory slot's write gate
and the read memory itself. For every query it then looks at the chunks from the one that holds the
fact's previous mention (where it must be written: its gates) to the one that asks for it (where it
must be read), and reports:
  - digit accuracy by how many chunk ends lie between mention and answer (0: the same chunk, inside
    the attention window; 1: the KV window may still reach it; 2 or more: only the carried state);
  - the write gates at the mention's chunk against the gates of the filler chunks after it (a memory
    that keeps a fact writes when the fact comes and stays shut over filler);
  - how much of the memory written at the mention's chunk is left k chunks later: the cosine
    similarity of the read memory to the one right after the mention, per slot, by k;
  - which slots carry the fact: accuracy at 2+ chunk ends with one slot reset to the initial
    memory after every chunk (--slot-ablation; one pass per slot).
Writes the numbers to --out (JSON with the command, device and date).
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.common import environment  # noqa: E402


@torch.no_grad()
def stream(model, tokens: np.ndarray, chunk_len: int, device, drop_slot: int | None = None):
    """Run (lanes, C * T + 1) tokens chunk by chunk; returns the argmax predictions (lanes, C * T),
    the gates (C, lanes, M) and the read memory after every chunk (C, lanes, M, D), float32.
    `drop_slot`: that memory slot goes back to the initial memory after every chunk."""
    lanes = tokens.shape[0]
    n_chunks = (tokens.shape[1] - 1) // chunk_len
    state = model.init_state(lanes, device=device)
    reset = torch.ones(lanes, dtype=torch.bool, device=device)
    preds, gates, memories = [], [], []
    for c in range(n_chunks):
        a = c * chunk_len
        inp = torch.from_numpy(tokens[:, a:a + chunk_len]).to(device)
        logits, state = model(inp, state, reset if c == 0 else None)
        if drop_slot is not None:
            state.memory = state.memory.clone()
            state.memory[:, drop_slot] = model.mem_init[drop_slot].to(state.memory.dtype)
        preds.append(logits.argmax(-1).cpu().numpy())
        gates.append(model.last_mem_gate.float().cpu().numpy())
        memories.append(state.memory.float().cpu().numpy())
    return np.concatenate(preds, 1), np.stack(gates), np.stack(memories)


def answer_accuracy(preds: np.ndarray, tokens: np.ndarray, lane: int, q) -> float:
    """The fraction of query q's answer tokens that lane `lane`'s argmax predictions got right."""
    targets = range(q.answer_start, q.answer_start + q.answer_len)
    return float(np.mean([preds[lane, t - 1] == tokens[lane, t] for t in targets]))


def cosine(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Cosine similarity over the last axis."""
    num = (a * b).sum(-1)
    return num / np.maximum(np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1), 1e-12)


def probe(model, tokenizer, distances, lanes, chunk_len, device, seed, slot_ablation: bool) -> dict:
    from data_packing.recall import eval_document
    rng = np.random.default_rng(seed)
    docs = [eval_document(rng, tokenizer, distances, 1) for _ in range(lanes)]
    L = max(len(d.tokens) for d in docs)
    n_chunks = math.ceil((L - 1) / chunk_len)
    tokens = np.zeros((lanes, n_chunks * chunk_len + 1), np.int64)
    for b, d in enumerate(docs):
        tokens[b, :len(d.tokens)] = d.tokens
    t0 = time.perf_counter()
    preds, gates, mem = stream(model, tokens, chunk_len, device)
    seconds = time.perf_counter() - t0
    M = gates.shape[-1]

    by_ends: dict[int, list[float]] = {}
    write_gate, filler_gate, retained = [], [], {}
    queries = []
    for b, d in enumerate(docs):
        for q in d.queries:
            mention_end = q.answer_start - q.distance          # the token after the previous mention
            cm = (mention_end - 1) // chunk_len                # chunk holding the mention's last token
            cq = (q.answer_start - 1) // chunk_len             # chunk whose outputs predict the answer
            acc = answer_accuracy(preds, tokens, b, q)
            ends = cq - cm                                     # chunk ends between the two
            by_ends.setdefault(min(ends, 8), []).append(acc)
            queries.append(dict(lane=b, query=q, distance=q.distance, chunk_ends=ends, accuracy=acc))
            if ends >= 2:
                write_gate.append(gates[cm, b])                # (M,) the update after the mention
                filler_gate.append(gates[cm + 1:cq, b].mean(0))
                for k in range(1, ends):
                    retained.setdefault(k, []).append(cosine(mem[cm + k, b], mem[cm, b]))
    out = {"chunks": n_chunks, "seconds": seconds, "queries": len(queries),
           "accuracy_by_chunk_ends": {str(k): {"accuracy": float(np.mean(v)), "queries": len(v)}
                                      for k, v in sorted(by_ends.items())},
           "chance": 0.1}
    if write_gate:
        wg, fg = np.stack(write_gate), np.stack(filler_gate)
        out["gates"] = {
            "write_at_mention_mean_per_slot": wg.mean(0).round(4).tolist(),
            "filler_mean_per_slot": fg.mean(0).round(4).tolist(),
            "write_at_mention_mean": float(wg.mean()), "filler_mean": float(fg.mean()),
            "all_chunks_mean_per_slot": gates.mean((0, 1)).round(4).tolist(),
            "closed_frac": float((gates == 0).mean())}
        out["memory_left_cosine_by_chunks"] = {
            str(k): {"mean": float(np.mean(v)), "per_slot": np.mean(v, 0).round(4).tolist(),
                     "queries": len(v)} for k, v in sorted(retained.items()) if len(v) >= 4}
    if slot_ablation and write_gate:
        far = [q for q in queries if q["chunk_ends"] >= 2]
        base = float(np.mean([q["accuracy"] for q in far]))
        drops = []
        for s in range(M):
            p, _, _ = stream(model, tokens, chunk_len, device, drop_slot=s)
            drops.append(float(np.mean([answer_accuracy(p, tokens, q["lane"], q["query"]) for q in far])))
        out["slot_ablation"] = {"accuracy_2plus_chunk_ends": base, "with_slot_reset": drops}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", required=True, help="run dir, export folder or Hub id")
    ap.add_argument("--distances", default="700,1500,3000,6000")
    ap.add_argument("--lanes", type=int, default=32)
    ap.add_argument("--chunk-len", type=int, default=0, help="default: the run's")
    ap.add_argument("--seed", type=int, default=4321)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--slot-ablation", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    from elephant.hub import from_pretrained
    from elephant.recall import parse_count
    device = torch.device(args.device)
    model, tokenizer, config = from_pretrained(args.checkpoint, device=device)
    model.eval()
    if not model.cfg.n_mem or model.cfg.mem_update != "gated":
        print("error: the probe reads the write gates of a gated memory (model.n_mem > 0, "
              "mem_update = gated)", file=sys.stderr)
        return 2
    chunk_len = args.chunk_len or (config.get("train") or {}).get("chunk_len", 512)
    distances = [parse_count(d) for d in args.distances.split(",")]
    result = {**environment(device),
              "command": " ".join(["python benchmarks/recall_probe.py", *(argv or sys.argv[1:])]),
              "checkpoint": args.checkpoint, "distances": distances, "lanes": args.lanes,
              "chunk_len": chunk_len,
              **probe(model, tokenizer, distances, args.lanes, chunk_len, device, args.seed,
                      args.slot_ablation)}
    print(json.dumps({k: v for k, v in result.items() if k not in ("command",)}, indent=1))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
