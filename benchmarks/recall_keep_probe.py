"""How long a kept token lasts: does a fact leave the kept tokens (model.kv_keep) over a long gap?

    python benchmarks/recall_keep_probe.py --checkpoint runs/recall-long --distance 256K
           [--lanes 4] [--device cpu] [--out benchmarks/results/recall_keep_probe.json]

Streams held-out recall documents (one fact, asked once after `--distance` tokens of filler;
`data_packing.recall.eval_document`) chunk by chunk with carried state and records, after every
chunk and for every attention layer, how many of its kept tokens come from the fact's statement
(the tokens from 48 before the fact's last digit to it), and the keep scores: the lowest score in
the kept set against the best score the fact's tokens had when they were kept. A fact that holds
to the end stays in the kept set; one that is displaced leaves it when the kept set's lowest
score rises past its tokens' scores (the top `kv_keep` scores over an ever longer stream of
filler rise too). Writes the curve (chunk index against fact tokens kept, lowest kept score) and
the answer's digit accuracy to --out (JSON with the command, device and date).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.common import environment  # noqa: E402

SPAN = 48   # tokens of the fact's statement before its last digit counted as "the fact"


@torch.no_grad()
def probe(model, tokenizer, distance: int, lanes: int, chunk_len: int, device, seed: int = 1234,
          every: int = 8) -> dict:
    from data_packing.recall import eval_document
    rng = np.random.default_rng(seed)
    docs = [eval_document(rng, tokenizer, [distance], 1) for _ in range(lanes)]
    # the fact's statement ends `distance` tokens before the answer (the distance is counted
    # from the previous mention's last token to the first answer token)
    fact_end = np.array([d.queries[0].answer_start - d.queries[0].distance for d in docs])
    L = max(len(d.tokens) for d in docs)
    n_chunks = -(-(L - 1) // chunk_len)
    tokens = np.zeros((lanes, n_chunks * chunk_len + 1), dtype=np.int64)
    for b, d in enumerate(docs):
        tokens[b, :len(d.tokens)] = d.tokens
    attn = [i for i, kind in enumerate(model.cfg.layers) if kind == "A"]
    lo = torch.as_tensor(fact_end - SPAN, device=device)[:, None]
    hi = torch.as_tensor(fact_end, device=device)[:, None]
    model.eval()
    state = model.init_state(lanes, device=device)
    reset = torch.ones(lanes, dtype=torch.bool, device=device)
    curve, fact_scores = [], {}
    hits = total = 0
    for c in range(n_chunks):
        a = c * chunk_len
        inp = torch.from_numpy(tokens[:, a:a + chunk_len]).to(device)
        logits, state = model(inp, state, reset if c == 0 else None)
        for b, d in enumerate(docs):
            q = d.queries[0]
            for t in range(q.answer_start, q.answer_start + q.answer_len):
                if a <= t - 1 < a + chunk_len:
                    hits += int(logits[b, t - 1 - a].argmax().item() == tokens[b, t])
                    total += 1
        row = {"chunk": c, "tokens": a + chunk_len, "fact_kept": [], "min_score": []}
        for i in attn:
            cache = state.kv[i]
            score = model.blocks[i].mixer.keep_score(cache.keep_x).float()        # (B, K)
            is_fact = cache.keep_valid & (cache.keep_pos >= lo) & (cache.keep_pos <= hi)
            row["fact_kept"].append(is_fact.sum(1).tolist())
            valid_score = score.masked_fill(~cache.keep_valid, float("inf"))
            row["min_score"].append(valid_score.min(1).values.tolist())
            if i not in fact_scores and bool(is_fact.any()):
                fact_scores[i] = [score[b][is_fact[b]].max().item() if is_fact[b].any() else None
                                  for b in range(lanes)]
        if c % every == 0 or c == n_chunks - 1:
            curve.append(row)
    return {"distance": distance, "lanes": lanes, "chunk_len": chunk_len, "attention_layers": attn,
            "fact_span_tokens": SPAN, "answer_digit_accuracy": hits / max(total, 1),
            "fact_best_score_when_kept": {str(k): v for k, v in fact_scores.items()},
            "curve": curve}


def main() -> int:
    from elephant.hub import from_pretrained
    from elephant.recall import parse_count
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--distance", default="256K")
    ap.add_argument("--lanes", type=int, default=4)
    ap.add_argument("--chunk-len", type=int, default=0, help="default: the checkpoint's")
    ap.add_argument("--every", type=int, default=8, help="record every this many chunks")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", default="benchmarks/results/recall_keep_probe.json")
    args = ap.parse_args()
    device = torch.device(args.device)
    model, tokenizer, config = from_pretrained(args.checkpoint, device=device)
    if not model.cfg.kv_keep:
        ap.error(f"{args.checkpoint}: the model keeps no tokens (model.kv_keep = 0)")
    chunk_len = args.chunk_len or (config.get("train") or {}).get("chunk_len", 512)
    t0 = time.perf_counter()
    result = probe(model, tokenizer, parse_count(args.distance), args.lanes, chunk_len, device,
                   every=args.every)
    result.update(environment(device), checkpoint=args.checkpoint, seconds=time.perf_counter() - t0,
                  command="python " + " ".join(sys.argv))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    last = result["curve"][-1]
    print(f"digit accuracy {result['answer_digit_accuracy']:.3f}; fact tokens kept per layer "
          f"at the end: {last['fact_kept']}; written {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
