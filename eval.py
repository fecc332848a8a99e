#!/usr/bin/env python
"""Evaluate an elephant model over whole documents, optionally beside a Hugging Face baseline.

    python eval.py --checkpoint runs/default                       # the run's own data, test split
    python eval.py --checkpoint runs/wt103-70m --split test \
        --baseline EleutherAI/pythia-70m-deduped --json wt103.json --plot positions.png
    python eval.py --checkpoint user/model --data wikitext-103 --data-path /data/wikitext-103-raw
    python eval.py --checkpoint user/model --prompt "The elephant" --max-new-tokens 200  # sample

Every document is streamed chunk by chunk with carried state (no context limit; memory does not
grow with document length). Reported: token loss and perplexity, bits per byte and word perplexity
(Wikitext convention: whitespace-separated words of the raw text), the counts, and the per-document
mean loss (labelled: the figure the model this project descends from reported). Bits per byte and
word perplexity are the fair comparison across tokenizers.
"""
import argparse
import sys
from pathlib import Path


def parse(argv):
    from elephant.config import add_kept_arguments
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", required=True,
                   help="run dir, checkpoint folder, export folder or Hub id (user/name)")
    p.add_argument("--data", help="a recipe (.toml: its [data]) or a source name; default: the "
                                  "checkpoint's own data")
    p.add_argument("--data-path", help="local folder / file of the source")
    p.add_argument("--tokenizer", help="tokenizer to read the data with (default: the checkpoint's)")
    p.add_argument("--split", default="test", help="train | valid | test (default test)")
    p.add_argument("--max-docs", type=int, default=0, help="only the first N documents (0: all)")
    p.add_argument("--lanes", type=int, default=8, help="documents evaluated side by side")
    p.add_argument("--chunk-len", type=int, default=0, help="tokens per chunk (default: the run's)")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda")
    p.add_argument("--no-cuda-graph", dest="cuda_graph", action="store_false",
                   help="run every chunk eagerly (by default on a GPU, each chunk after the first "
                        "is one CUDA graph replay: 11x faster for one lane, the same loss)")
    p.add_argument("--no-compact", dest="compact", action="store_false",
                   help="keep every lane to the end of the pass (by default, once no document is "
                        "left to start and at most an eighth of the lanes still read one, the "
                        "batch shrinks to them: a long last document is read at the speed of one "
                        "lane, not of a batch of padding; the same sums)")
    p.add_argument("--no-side", dest="side", action="store_false", default=None,
                   help="read every document in the one batch (by default on a GPU the documents "
                        "that would outlast it, each more chunks than an even share over the lanes, "
                        "up to an eighth of the lanes, are read by a side batch on a stream of its "
                        "own beside the others: the same sums; on an H100, 64 lanes over 16M "
                        "tokens of source files 1.84M -> 1.99-2.02M tokens/s)")
    p.add_argument("--side", dest="side", action="store_true", default=None,
                   help="the side batch on the CPU too (where the two batches take turns, no faster)")
    p.add_argument("--reset-every", default="0", metavar="N",
                   help="the context ablation: reset each document's state every N tokens (e.g. "
                        "2048, 2K; a multiple of the chunk length), as if a new document started "
                        "there; the loss by position stays by the position in the document "
                        "(default 0: carried to the end)")
    p.add_argument("--drop", default="", metavar="PARTS",
                   help="what each carried part is worth: clear these parts of the state after "
                        "every chunk, carry the rest (comma-separated: window, kept, assoc "
                        "(the attention's associative memory), memory, ssm "
                        "(the Mamba and delta rule layers' conv and recurrent state), delta (the "
                        "D layers' alone); e.g. --drop memory,kept); the loss by "
                        "position compares band by band with the carried run's")
    add_kept_arguments(p)
    n = p.add_argument_group("the needle test (instead of the loss): a key with a random value "
                             "stated in held-out text of the model's data, stated again N tokens "
                             "later; the value's next-token accuracy (elephant/needle.py)")
    n.add_argument("--needle", metavar="DISTANCES",
                   help="comma-separated distances in tokens, e.g. 1K,4K,64K,1M")
    n.add_argument("--needle-keys", default="1", metavar="N[,N]",
                   help="facts per document, the first of them asked (default 1; e.g. 1,8)")
    n.add_argument("--needle-form", default="assign",
                   help="how the fact is stated (data_packing/recall.py TEMPLATES; default assign, "
                        "'silver_fox_code = 482913', a form the training mix leaves out)")
    n.add_argument("--needle-lanes", type=int, default=64,
                   help="documents per pass of distances up to 128K (default 64)")
    n.add_argument("--needle-long-lanes", type=int, default=16,
                   help="documents per pass of a longer distance (default 16)")
    p.add_argument("--json", help="write all results to this JSON file")
    p.add_argument("--plot", help="PNG of the mean loss by position in the document")
    p.add_argument("--baseline", help="Hugging Face causal LM (hub id or path), e.g. "
                                      "EleutherAI/pythia-70m-deduped")
    p.add_argument("--baseline-max-len", type=int, default=2048, help="rolling window (tokens)")
    p.add_argument("--baseline-stride", type=int, default=None,
                   help="window stride (default: the window length)")
    p.add_argument("--push-to-hub", metavar="USER/NAME",
                   help="export the model with these results and upload it")
    p.add_argument("--no-progress", action="store_true")
    g = p.add_argument_group("generation (instead of evaluation): stream a continuation to stdout")
    g.add_argument("--prompt", help="text to continue (echoed before the continuation)")
    g.add_argument("--prompt-file", help="read the prompt from this file (only the continuation is "
                                         "printed); any length: it is read chunk by chunk")
    g.add_argument("--max-new-tokens", type=int, default=256)
    g.add_argument("--temperature", type=float, default=0.8, help="0: greedy (default 0.8)")
    g.add_argument("--top-k", type=int, default=200, help="0: off (default 200)")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling; 1: off (default)")
    g.add_argument("--seed", type=int, default=None, help="seed of the sampling (default: random)")
    g.add_argument("--eager", action="store_true", help="no CUDA graph for the decoding step")
    p.add_argument("overrides", nargs="*", metavar="data.KEY=VALUE",
                   help="overrides of the data evaluated (data.path=..., data.cache_dir=...), "
                        "anywhere among the flags; applied after --data and --data-path")
    p.set_defaults(json_written=False)
    return p.parse_intermixed_args(argv)


def main(argv=None) -> int:
    args = parse(argv)
    # the kernels' ops wait: eval.py compiles nothing and needs no autograd, and registering or
    # calling them as ops would import torch's compiler and dynamo (layers/triton_env.py)
    from elephant.layers.triton_env import lazy_ops
    lazy_ops()
    from data_packing import DataError
    from elephant.checkpoint import CheckpointError
    from elephant.config import ConfigError
    from elephant.generate import GenerationError
    from elephant.hub import HubError
    from elephant.preemption import Interrupted, exit_code, interrupt_on_signals, signal_name

    try:
        with interrupt_on_signals():
            if args.prompt is not None or args.prompt_file is not None:
                return run_generate(args)
            if args.needle:
                return run_needle(args)
            return run(args)
    except (ConfigError, DataError, CheckpointError, HubError, GenerationError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # a full disk, a folder without write permission
        print(f"error: {e.filename}: {e.strerror}" if e.filename else f"error: {e}", file=sys.stderr)
        return 2
    except Interrupted as e:
        written = f"; {args.json} was left as it was" if args.json and not args.json_written else ""
        print(f"interrupted by {signal_name(e.signum)}{written}", file=sys.stderr)
        return exit_code(e.signum)


def run(args) -> int:
    import torch

    from data_packing import get_corpus, open_source
    from data_packing.sources import canonical_split
    from elephant.evaluate import evaluate, parse_reset_every
    from elephant.fsutil import atomic_write_json
    from elephant.hub import HubError, export_run, push_to_hub, save_pretrained
    from elephant.metrics import plot_position_loss
    from elephant.state import parse_parts

    progress = not args.no_progress and sys.stderr.isatty()
    if (args.kv_keep is not None or args.kv_keep_read is not None) and args.push_to_hub:
        raise HubError("--kv-keep or --kv-keep-read with --push-to-hub: the pushed model would not "
                       "say which kept tokens its figures were measured with; push without them")
    device, model, tokenizer, config = load_for_reading(args)
    split = canonical_split(args.split)
    data = data_to_read(args, config)
    tokenizer_spec = data.tokenizer
    export_dir = Path(args.checkpoint)
    if args.tokenizer:
        tokenizer_spec = args.tokenizer
    elif (export_dir / "config.json").is_file() and (export_dir / "model.safetensors").is_file():
        tokenizer_spec = str(export_dir)  # the tokenizer files saved beside the weights
    if tokenizer.vocab_size > model.cfg.vocab_size:
        raise HubError(f"checkpoint/tokenizer mismatch: the tokenizer has {tokenizer.vocab_size} "
                       f"tokens, the model's vocabulary {model.cfg.vocab_size}")
    corpus = get_corpus(data.source, split, tokenizer_spec, data.cache_dir, path=data.path or None,
                        append_eot=data.append_eot, progress=progress, text_field=data.text_field,
                        **data.source_options())
    if corpus.manifest.get("tokenizer", {}).get("fingerprint") not in (None, tokenizer.fingerprint):
        raise HubError(f"checkpoint/tokenizer mismatch: {corpus.path} was tokenized with another "
                       f"tokenizer than the checkpoint's")

    chunk_len = args.chunk_len or (config.get("train") or {}).get("chunk_len", 512)
    reset_every = parse_reset_every(args.reset_every, chunk_len)
    drop = parse_parts(args.drop)
    if drop and args.push_to_hub:
        raise HubError("--drop with --push-to-hub: the figures of a model read with parts of its "
                       "state dropped are not its own; push without --drop")
    use_bf16 = device.type == "cuda"
    autocast = (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if use_bf16 else None
    if device.type == "cuda":   # the pass's peak below: from the weights resident at its start
        torch.cuda.reset_peak_memory_stats(device)
    ours = evaluate(model, corpus, lanes=args.lanes, chunk_len=chunk_len, device=device,
                    autocast=autocast, max_docs=args.max_docs, progress=progress,
                    cuda_graph=args.cuda_graph and device.type == "cuda", compact=args.compact,
                    side=device.type == "cuda" if args.side is None else args.side,
                    reset_every=reset_every, drop=drop)
    context = f"reset every {reset_every} tokens" if reset_every else "unlimited (recurrent)"
    if drop:
        context += f", {', '.join(drop)} dropped after every chunk"
    # peak_mem_gb: the most CUDA memory the pass held allocated (GiB; weights included), what
    # stays flat however long the documents (benchmarks/eval_speed.py); None on the CPU
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    ours.update(parameters=model.num_params(), chunk_len=chunk_len, reset_every=reset_every,
                kv_keep=model.cfg.kv_keep, drop=list(drop), context=context,
                source=data.source, split=split, peak_mem_gb=peak)
    results = {"elephant": ours}

    if args.baseline:
        results["baseline"] = score_baseline(args, data, split, device, open_source)

    print_table(results, args)
    if args.plot:
        curves = {name: r["position_buckets"] for name, r in results.items()
                  if isinstance(r, dict) and r.get("position_buckets")}
        plot_position_loss(curves, args.plot)
        print(f"wrote {args.plot}", file=sys.stderr)
    if args.json:  # all or nothing: an interrupted run leaves the file as it was
        atomic_write_json(args.json, results, indent=1, default=str)
        args.json_written = True
        print(f"wrote {args.json}", file=sys.stderr)
    if args.push_to_hub:
        metrics = {f"{data.source}/{split}": {k: ours[k] for k in
                                              ("loss", "perplexity", "bits_per_byte", "word_perplexity")}}
        src = Path(args.checkpoint)
        out = Path(data.cache_dir) / "export" / args.push_to_hub.replace("/", "--")
        if (src / "config.json").is_file():
            out = save_pretrained(model, out, tokenizer=tokenizer, train_config=config, metrics=metrics)
        else:
            out = export_run(src, out, metrics=metrics, name=args.push_to_hub)
        url = push_to_hub(out, args.push_to_hub)
        print(f"pushed to {url}", file=sys.stderr)
    return 0


def data_to_read(args, config: dict):
    """The data settings a reading of --checkpoint uses: the run's own (its config's [data]), or
    --data (a recipe's [data], or a source name), then --data-path and the data.* overrides."""
    from elephant.config import Config, DataConfig, apply_overrides, load_config
    data = DataConfig(**config["data"]) if isinstance(config.get("data"), dict) else DataConfig()
    if args.data:
        if args.data.endswith(".toml"):
            data = load_config(args.data).data
        else:
            data.source, data.path = args.data, ""
            data.validate()
    if args.data_path:
        data.path = args.data_path
    if args.overrides:
        data = apply_overrides(Config(data=data), args.overrides, sections=("data",)).data
    return data


def load_for_reading(args):
    """(device, model, tokenizer, config) of --checkpoint for every reading of it: on
    --device (auto: CUDA when there is one), with --kv-keep / --kv-keep-read, the tokenizer saved
    with it or --tokenizer's (a HubError when there is neither)."""
    import torch

    from elephant.hub import HubError, from_pretrained
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                          "cpu" if args.device == "auto" else args.device)
    model, tokenizer, config = from_pretrained(args.checkpoint, device=device, kv_keep=args.kv_keep,
                                               kv_keep_read=args.kv_keep_read)
    if args.tokenizer:
        from data_packing import load_tokenizer
        tokenizer = load_tokenizer(args.tokenizer)
    if tokenizer is None:
        raise HubError(f"{args.checkpoint}: no tokenizer saved with the model, and its config "
                       f"names none (give --tokenizer)")
    return device, model, tokenizer, config


def run_needle(args) -> int:
    """The needle test (elephant/needle.py) on the model's own kind of text, held out: its data's
    --split (default test), or --data / --data-path / data.* overrides."""
    import time

    import torch

    from elephant.config import ConfigError, parse_count
    from elephant.fsutil import atomic_write_json
    from elephant.needle import autocast_for, format_needles, needle_test, text_for

    distances = [parse_count(d) for d in args.needle.split(",") if d.strip()]
    try:
        keys = tuple(int(k) for k in args.needle_keys.split(","))
    except ValueError:
        raise ConfigError(f"--needle-keys {args.needle_keys}: expected counts such as 1 or 1,8") from None
    if not distances or min(distances) < 1 or min(keys) < 1:
        raise ConfigError(f"--needle {args.needle} --needle-keys {args.needle_keys}: distances and "
                          f"key counts must be positive")
    if args.push_to_hub or args.baseline or args.drop:
        raise ConfigError("--needle scores recall alone: leave out --push-to-hub, --baseline and --drop")
    device, model, tokenizer, config = load_for_reading(args)
    from data_packing.sources import canonical_split
    data = data_to_read(args, config)
    haystack = text_for(data, canonical_split(args.split))
    chunk_len = args.chunk_len or (config.get("train") or {}).get("chunk_len", 512)
    log = lambda m: print(m, file=sys.stderr, flush=True)   # noqa: E731
    result = needle_test(model, tokenizer, haystack, distances, chunk_len, device, keys=keys,
                         lanes=args.needle_lanes, long_lanes=args.needle_long_lanes,
                         form=args.needle_form, autocast=autocast_for(device),
                         progress=not args.no_progress and sys.stderr.isatty(), log=log)
    result.update(checkpoint=str(args.checkpoint), source=data.source, split=args.split,
                  kv_keep=model.cfg.kv_keep, kv_keep_read=model.cfg.kv_keep_read,
                  device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                  date=time.strftime("%Y-%m-%dT%H:%M:%S"))
    print(format_needles(result))
    if args.json:
        atomic_write_json(args.json, result, indent=1, default=str)
        args.json_written = True
        print(f"wrote {args.json}", file=sys.stderr)
    return 0


def run_generate(args) -> int:
    """Stream a continuation of --prompt / --prompt-file to stdout (elephant.generate: the prompt
    chunk by chunk, then token by token with carried state; memory stays flat)."""
    import time

    import torch

    from elephant.generate import (GenerationError, TextStream, check_settings, generate,
                                   training_chunk_len)

    check_settings(args.max_new_tokens, args.temperature, args.top_k, args.top_p)
    if args.prompt_file is not None:
        try:
            text = Path(args.prompt_file).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise GenerationError(f"--prompt-file {args.prompt_file}: cannot read it "
                                  f"({getattr(e, 'strerror', None) or e})") from None
    else:
        text = args.prompt
    if not text:
        raise GenerationError("the prompt is empty: give --prompt TEXT or a non-empty --prompt-file")
    device, model, tokenizer, config = load_for_reading(args)
    if device.type == "cuda":
        model = model.to(torch.bfloat16)
    ids = tokenizer.encode(text)
    if not ids:
        raise GenerationError("the prompt encodes to no tokens")
    stream, out, eot = TextStream(tokenizer), sys.stdout, tokenizer.eot_id

    def show(lane, token):
        if token != eot:
            out.write(stream.push(token))
            out.flush()

    if args.prompt_file is None:
        out.write(text)
        out.flush()
    t0 = time.perf_counter()
    new = generate(model, ids, args.max_new_tokens, temperature=args.temperature,
                   top_k=args.top_k, top_p=args.top_p, seed=args.seed, eos_id=eot,
                   chunk_len=args.chunk_len or training_chunk_len(config),
                   vocab_size=tokenizer.vocab_size, stream=show,
                   cuda_graph=False if args.eager else None)
    seconds = time.perf_counter() - t0
    out.write(stream.flush() + "\n")
    print(f"[{len(ids)} prompt tokens, {len(new)} new in {seconds:.1f} s: "
          f"{len(new) / max(seconds, 1e-9):.0f} tokens/s]", file=sys.stderr)
    return 0


def score_baseline(args, data, split, device, open_source) -> dict:
    """The baseline's figures on the same documents, or why it could not be scored."""
    from elephant.baseline import KNOWN_REFERENCE, BaselineUnavailable, load_baseline, score_documents
    from elephant.hub import HubError

    try:
        model, tok = load_baseline(args.baseline, device=device)
    except BaselineUnavailable as e:
        print(f"baseline unavailable: {e}", file=sys.stderr)
        known = KNOWN_REFERENCE.get(args.baseline, {})
        for name, (value, source) in known.items():
            print(f"  known reference {name}: {value} ({source})", file=sys.stderr)
        if not known:
            print("  no published figure for this split is on record here; none is printed",
                  file=sys.stderr)
        return {"name": args.baseline, "unavailable": str(e), "known_reference": known}
    docs = []
    for doc in open_source(data.source, split, data.path or None, text_field=data.text_field):
        text = doc.decode("utf-8", "replace") if isinstance(doc, bytes) else doc
        if not isinstance(text, str):
            raise HubError(f"{data.source} holds pre-tokenized documents: the baseline needs text")
        if text.strip():  # the corpus skips empty documents too
            docs.append(text)
        if args.max_docs and len(docs) == args.max_docs:
            break
    result = score_documents(model, tok, docs, max_len=args.baseline_max_len,
                             stride=args.baseline_stride, device=device)
    result.pop("per_document", None)
    result.update(name=args.baseline, parameters=sum(p.numel() for p in model.parameters()),
                  context=f"{args.baseline_max_len} (rolling windows)")
    return result


def print_table(results: dict, args) -> None:
    rows = [("parameters", "parameters", "{:,}"), ("context", "context", "{}"),
            ("documents", "documents", "{:,}"), ("tokens", "tokens", "{:,}"),
            ("bytes", "bytes", "{:,}"), ("words", "words", "{:,}"),
            ("token loss (nats)", "loss", "{:.4f}"), ("token perplexity", "perplexity", "{:.3f}"),
            ("bits per byte", "bits_per_byte", "{:.4f}"), ("word perplexity", "word_perplexity", "{:.3f}"),
            ("per-document mean loss*", "per_doc_mean_loss", "{:.4f}")]
    cols = [(name, r) for name, r in results.items() if "unavailable" not in r]
    width = max(len(r[0]) for r in rows)
    print(f"{'':{width}}  " + "  ".join(f"{(r.get('name') or n):>18}" for n, r in cols))
    for label, key, fmt in rows:
        cells = []
        for _, r in cols:
            v = r.get(key)
            cells.append(f"{fmt.format(v) if v is not None else '-':>18}")
        print(f"{label:{width}}  " + "  ".join(cells))
    print("* mean over documents of each document's mean token loss (the figure the model this "
          "project descends from reported); the rows above it are token-weighted.")


def exit_now(code: int) -> None:
    """End the process with `code` once its output is flushed, without the interpreter's
    teardown: every file eval.py writes is written (atomically) and closed by then, and tearing
    down torch's modules and the CUDA context took 0.5 s of a run on a CPU, ~1.1 s on an H100
    (benchmarks/eval_speed.py's breakdown, `e_exit`)."""
    import logging
    import os
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(code)


if __name__ == "__main__":
    exit_now(main() or 0)
