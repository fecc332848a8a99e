"""The GPU's SM clock, power and temperature while each path of a benchmark ran: nvidia-smi's
samples (a CSV, as `gpu.sh packing-shapes` writes with --query-gpu=timestamp,clocks.sm,
clocks.mem,power.draw,temperature.gpu, and optionally utilization.gpu after them) averaged over
each `spans` entry of result JSONs (bench_packing.py records when each path's round ran, Unix
seconds), or over each evaluation pass of train_speed.py --eval-modes (its `span`).

    python benchmarks/clocks_by_span.py CLOCKS.csv RESULT.json [RESULT.json ...]

nvidia-smi writes its timestamps in the machine's local time, which is UTC on the device machines
(--utc-offset-h otherwise). Samples are instants every ~200 ms; a round under a second holds only
a few, so a path's figure is an indication, and a power-capped GPU's clock swings within a round.
"""
from __future__ import annotations

import argparse
import csv
import datetime
import json
import sys


def read_samples(path: str, utc_offset_h: float = 0.0) -> list[tuple]:
    """(unix seconds, SM MHz, power W, temperature C, GPU utilization % or None) of each sample
    row. The utilization is the share of the sample's period in which some kernel ran: well under
    100 while the GPU waits for its host."""
    tz = datetime.timezone(datetime.timedelta(hours=utc_offset_h))
    rows = []
    with open(path) as f:
        for r in csv.reader(f):
            if not r or r[0].startswith("timestamp"):
                continue
            t = datetime.datetime.strptime(r[0].strip(), "%Y/%m/%d %H:%M:%S.%f").replace(tzinfo=tz)
            util = float(r[5].split()[0]) if len(r) > 5 else None
            rows.append((t.timestamp(), float(r[1].split()[0]), float(r[3].split()[0]),
                         float(r[4]), util))
    return rows


def by_span(samples: list, spans: list[dict], settle_s: float = 0.05) -> list[dict]:
    """Each span's samples averaged: path, round, seconds, samples, sm_mhz (mean, min, max),
    power_w, temp_c and util (means; util None without that column); no figures where no
    sample fell inside."""
    out = []
    for s in spans:
        inside = [x for x in samples if s["start"] + settle_s <= x[0] <= s["end"]]
        row = {"path": s["path"], "round": s["round"], "seconds": s["end"] - s["start"],
               "samples": len(inside)}
        if inside:
            n = len(inside)
            row.update(sm_mhz=sum(x[1] for x in inside) / n, sm_min=min(x[1] for x in inside),
                       sm_max=max(x[1] for x in inside), power_w=sum(x[2] for x in inside) / n,
                       temp_c=sum(x[3] for x in inside) / n,
                       util=None if inside[0][4] is None else sum(x[4] for x in inside) / n)
        out.append(row)
    return out


def eval_spans(result: dict) -> list[dict]:
    """train_speed.py --eval-modes: each timed pass as a span (path: its mode and tokens/s),
    in the order they ran."""
    turns = (result.get("eval") or {}).get("modes_in_turns") or {}
    spans = [{"path": f"{mode} {run['tokens_per_s'] / 1e3:,.0f}k/s", "round": i,
              "start": run["span"][0], "end": run["span"][1]}
             for mode, runs in turns.items() for i, run in enumerate(runs) if run.get("span")]
    return sorted(spans, key=lambda s: s["start"])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("clocks")
    ap.add_argument("results", nargs="+")
    ap.add_argument("--utc-offset-h", type=float, default=0.0)
    args = ap.parse_args(argv)
    samples = read_samples(args.clocks, args.utc_offset_h)
    for path in args.results:
        result = json.load(open(path))
        spans = result.get("spans") or eval_spans(result)
        if not spans:
            print(f"{path}: no spans", file=sys.stderr)
            continue
        print(path)
        for r in by_span(samples, spans):
            if r["samples"]:
                print(f"  {r['path']:<24} round {r['round']} {r['seconds']:6.2f} s {r['samples']:4d} "
                      f"samples  SM {r['sm_mhz']:5.0f} MHz ({r['sm_min']:.0f}-{r['sm_max']:.0f})  "
                      f"{r['power_w']:4.0f} W  {r['temp_c']:.0f} C"
                      + ("" if r["util"] is None else f"  busy {r['util']:5.1f}%"))
            else:
                print(f"  {r['path']:<24} round {r['round']} {r['seconds']:6.2f} s  no samples")
    return 0


if __name__ == "__main__":
    sys.exit(main())
