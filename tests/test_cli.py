"""The command lines take dotted overrides anywhere among their flags (DESIGN.md: thin CLIs parse
config + overrides anywhere on the line): before, between and after the flags, in order."""
import pytest

import eval as eval_cli
import train as train_cli
from elephant import recall


def test_train_cli_takes_overrides_before_between_and_after_flags():
    args = train_cli.parse(["train.lanes=2", "--config", "c.toml", "train.run_dir=runs/x", "--resume",
                            "train.max_steps=9", "--no-progress", "model.d_model=64"])
    assert args.config == "c.toml" and args.resume and not args.restart and args.no_progress
    assert args.overrides == ["train.lanes=2", "train.run_dir=runs/x", "train.max_steps=9",
                              "model.d_model=64"]
    assert train_cli.parse(["--restart", "train.max_steps=1"]).overrides == ["train.max_steps=1"]
    assert train_cli.parse([]).overrides == []


def test_train_cli_still_refuses_resume_with_restart(capsys):
    with pytest.raises(SystemExit):
        train_cli.parse(["--resume", "train.max_steps=1", "--restart"])
    assert "not allowed with argument" in capsys.readouterr().err


def test_eval_cli_takes_data_overrides_anywhere():
    args = eval_cli.parse(["data.path=/d", "--checkpoint", "runs/x", "data.cache_dir=c", "--split",
                           "valid", "--max-docs", "3", "data.text_field=body"])
    assert args.checkpoint == "runs/x" and args.split == "valid" and args.max_docs == 3
    assert args.overrides == ["data.path=/d", "data.cache_dir=c", "data.text_field=body"]
    # a flag's value that looks like an override stays the flag's
    gen = eval_cli.parse(["--checkpoint", "runs/x", "--prompt", "a.b=c", "--max-new-tokens", "4"])
    assert gen.prompt == "a.b=c" and gen.overrides == []


def test_recall_cli_takes_train_overrides_anywhere():
    args = recall.parse(["train", "train.run_dir=x", "--config", "c.toml", "--lanes", "2",
                         "train.max_steps=1", "--resume", "model.n_mem=2"])
    assert args.command == "train" and args.config == "c.toml" and args.lanes == 2 and args.resume
    assert args.overrides == ["train.run_dir=x", "train.max_steps=1", "model.n_mem=2"]
    ev = recall.parse(["eval", "--lanes", "3", "--checkpoint", "runs/r", "--offset", "1M"])
    assert ev.command == "eval" and ev.checkpoint == "runs/r" and ev.lanes == 3 and ev.offset == "1M"


@pytest.mark.parametrize("argv", [[], ["nope"], ["--lanes", "2"]])
def test_recall_cli_without_a_subcommand_is_a_usage_error(argv, capsys):
    with pytest.raises(SystemExit) as e:
        recall.parse(argv)
    assert e.value.code == 2 and "train,eval" in capsys.readouterr().err


@pytest.mark.parametrize("script", ["train.py", "eval.py"])
def test_help_prints_without_importing_torch(script):
    """`--help` answers at once: the parsers import nothing heavy (torch takes seconds to import),
    so a user reading the flags never waits for it (elephant/__init__.py imports nothing)."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    code = (f"import runpy, sys\nsys.argv = [{script!r}, '--help']\n"
            f"try:\n    runpy.run_path({script!r}, run_name='__main__')\nexcept SystemExit:\n    pass\n"
            "print('imported torch:', 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True,
                         timeout=60)
    assert "usage:" in out.stdout and out.stdout.strip().endswith("imported torch: False"), out.stderr


def test_eval_cli_reads_drop_and_needle_flags():
    args = eval_cli.parse(["--checkpoint", "r", "--drop", "memory,kept", "--needle", "1K,64K",
                           "--needle-keys", "1,8", "data.path=/d"])
    assert args.drop == "memory,kept" and args.needle == "1K,64K" and args.needle_keys == "1,8"
    assert args.overrides == ["data.path=/d"]


@pytest.mark.parametrize("text, parts", [("memory,kept", ("kept", "memory")), ("kv,mamba", ("window", "ssm")),
                                         ("none", ()), ("", ())])
def test_drop_parts_are_named_once_in_order(text, parts):
    from elephant.state import parse_parts
    assert parse_parts(text) == parts


def test_drop_with_an_unknown_part_is_a_one_line_error():
    from elephant.config import ConfigError
    from elephant.state import parse_parts
    with pytest.raises(ConfigError, match="--drop memroy: unknown part 'memroy'; expected .*window, kept, assoc, memory, ssm"):
        parse_parts("memroy")
