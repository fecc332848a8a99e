#!/usr/bin/env python
"""Train an elephant model.

    python train.py --config configs/default.toml [section.key=value ...] [--resume | --restart]
    torchrun --nproc_per_node=N train.py --config configs/wt103-70m.toml

Overrides use the config's dotted names (model.d_model=768 train.max_steps=100), anywhere among
the flags. Errors in the recipe, the data, the run dir or a checkpoint are printed as one line
(exit 2), never as a traceback. A run dir holds one run: it is locked while a process trains in it, a second start
there without --resume is refused, and --restart moves the earlier run aside (never deletes it).
SIGTERM or SIGINT finishes the step, writes a checkpoint and exits with 128 + the signal's number
(143, 130); a second signal stops at once.
"""
import argparse
import sys


def parse(argv=None) -> argparse.Namespace:
    """The flags and the overrides in any order: `--config c.toml train.run_dir=x --resume train.max_steps=9`."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", help="TOML recipe (configs/*.toml); defaults when omitted")
    again = parser.add_mutually_exclusive_group()
    again.add_argument("--resume", action="store_true",
                       help="continue the run in train.run_dir from its newest intact checkpoint")
    again.add_argument("--restart", action="store_true",
                       help="move an earlier run in train.run_dir to RUN_DIR.old-<time>, start anew")
    parser.add_argument("--no-progress", action="store_true", help="plain log lines, no progress bar")
    parser.add_argument("overrides", nargs="*", help="section.key=value")
    return parser.parse_intermixed_args(argv)


def main(argv=None) -> int:
    args = parse(argv)
    from data_packing import DataError
    from elephant.checkpoint import CheckpointError
    from elephant.config import ConfigError, load_config
    from elephant.preemption import exit_code, signal_name
    from elephant.rundir import RunDirError
    from elephant.trainer import Trainer, TrainingStopped

    import torch.distributed as dist
    try:
        cfg = load_config(args.config, args.overrides)
        trainer = Trainer(cfg, resume=args.resume, restart=args.restart,
                          progress=False if args.no_progress else None)
        result = trainer.fit()
    except (ConfigError, DataError, CheckpointError, RunDirError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # a full disk, a folder without write permission
        print(f"error: {e.filename}: {e.strerror}" if e.filename else f"error: {e}", file=sys.stderr)
        return 2
    except TrainingStopped as e:
        print(f"stopped: {e}", file=sys.stderr)
        return 3
    except KeyboardInterrupt:  # before training began: there is nothing to save yet
        print("interrupted before training started; nothing was saved", file=sys.stderr)
        return 130
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    if result.get("preempted"):
        sig = result["preempted"]
        if trainer.rt.main:
            ckpt = result["checkpoint"]
            saved = (f"wrote {ckpt}; continue with --resume" if ckpt else
                     f"no checkpoint written in a streak of non-finite losses; the newest in "
                     f"{trainer.run_dir / 'checkpoints'} is the last good one")
            print(f"stopped by {signal_name(sig)} after step {result['step']}: {saved}", file=sys.stderr)
        return exit_code(sig)
    if trainer.rt.main:
        ev = result["eval"]
        tail = f"; valid loss {ev['loss']:.4f}, bits/byte {ev['bits_per_byte']:.4f}" if ev else ""
        print(f"done: {result['step']} steps in {cfg.train.run_dir}{tail}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
