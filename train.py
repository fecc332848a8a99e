#!/usr/bin/env python
"""Train an elephant model.

    python train.py --config configs/default.toml [section.key=value ...] [--resume]
    torchrun --nproc_per_node=N train.py --config configs/wt103-70m.toml

Overrides use the config's dotted names (model.d_model=768 train.max_steps=100). Errors in the
recipe, the data or a checkpoint are printed as one line (exit 2), never as a traceback.
"""
import argparse
import sys


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", help="TOML recipe (configs/*.toml); defaults when omitted")
    parser.add_argument("--resume", action="store_true",
                        help="continue the run in train.run_dir from its latest checkpoint")
    parser.add_argument("--no-progress", action="store_true", help="plain log lines, no progress bar")
    parser.add_argument("overrides", nargs="*", help="section.key=value")
    args = parser.parse_args(argv)

    from data_packing import DataError
    from elephant.checkpoint import CheckpointError
    from elephant.config import ConfigError, load_config
    from elephant.trainer import Trainer, TrainingStopped

    import torch.distributed as dist
    try:
        cfg = load_config(args.config, args.overrides)
        trainer = Trainer(cfg, resume=args.resume, progress=False if args.no_progress else None)
        result = trainer.fit()
    except (ConfigError, DataError, CheckpointError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except TrainingStopped as e:
        print(f"stopped: {e}", file=sys.stderr)
        return 3
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    if trainer.rt.main:
        ev = result["eval"]
        tail = f"; valid loss {ev['loss']:.4f}, bits/byte {ev['bits_per_byte']:.4f}" if ev else ""
        print(f"done: {result['step']} steps in {cfg.train.run_dir}{tail}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
