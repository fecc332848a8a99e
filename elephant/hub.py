"""Export folders for trained models, loading them back, and publishing them on the Hugging Face Hub.

An export folder holds
    config.json         {"format": "elephant", "model_type": "elephant", "architectures",
                        "elephant_version", "model": ModelConfig, and when known "data" / "optim" /
                        "train" (the training recipe) and "metrics"}
    model.safetensors   the weights (tied weights stored once); loading never unpickles anything
    tokenizer files     whatever the data_packing tokenizer's save(dir) writes (tokenizer.json and
                        tokenizer_config.json among them, for transformers' AutoTokenizer)
    generation_config.json   with a tokenizer: its end-of-text id as eos and the padded vocabulary
                        ids past the tokenizer's suppressed, as eval.py's generation samples
    README.md           a model card: architecture, data, evaluation, how to load
`model_type` and `architectures` are what transformers' Auto classes read (elephant/hf.py
registers the classes they name); exports written before them load here all the same.
It is written into a temporary folder and renamed into place, so a reader sees the old export or
the new one, never half of one. `from_pretrained` takes such a folder, a Hub id, a training run
dir or a checkpoint folder (`run_dir/checkpoints/step_NNNNNNN/`, see elephant/checkpoint.py).

Every user-facing failure is a `HubError` with a one-line message naming the file at fault.

    python -m elephant.hub export RUN_DIR OUT_DIR [--step N]
    python -m elephant.hub push RUN_DIR_OR_EXPORT_DIR user/name [--private] [--message M]

The Hub token comes from HF_TOKEN or `hf auth login` (or the `token` argument); it is never printed.
"""
from __future__ import annotations

import argparse
import contextlib
import difflib
import json
import math
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_model, save_model

from .config import ConfigError, ModelConfig

CONFIG = "config.json"
WEIGHTS = "model.safetensors"
CARD = "README.md"
FORMAT = "elephant"
GENERATION_CONFIG = "generation_config.json"
MODEL_TYPE = "elephant"                     # transformers' AutoConfig key (elephant/hf.py)
ARCHITECTURE = "ElephantForCausalLM"
CONFIG_KEYS = ("format", "model_type", "architectures", "elephant_version", "model", "data",
               "optim", "train", "metrics")
RECIPE_SECTIONS = ("data", "optim", "train")
# files by which data_packing.load_tokenizer(dir) recognizes a saved tokenizer
TOKENIZER_FILES = ("tokenizer.json", "bytes_tokenizer.json", "vocab.json")
REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


class HubError(ValueError):
    """A missing, corrupt or mismatched export, or a failed Hub call; one line, meant for the user."""


# ---------------------------------------------------------------------------------------------
# save
def save_pretrained(model: torch.nn.Module, out_dir: str | Path, tokenizer=None,
                    train_config: dict | None = None, metrics: dict | None = None,
                    name: str | None = None) -> Path:
    """Write an export folder (see the module docstring) atomically and return its path.

    train_config: the run's Config.to_dict() (its data / optim / train sections are kept);
    metrics: {name: value} or {split: {name: value}}, shown in the model card and kept in config.json.
    name: what the model card calls the model and loads in its example (default: the folder's
    name; give the Hub id when the folder is meant for the Hub). An existing `out_dir` is
    replaced only if it is an export folder itself.
    """
    model = _unwrap(model)
    cfg = _model_config(model)
    out_dir = Path(out_dir)
    if out_dir.exists() and not _is_export(out_dir):
        raise HubError(f"{out_dir} exists and is not an elephant export folder (no {CONFIG} with "
                       f'"format": "{FORMAT}"); refusing to replace it, choose another folder')
    config = {"format": FORMAT, "model_type": MODEL_TYPE, "architectures": [ARCHITECTURE],
              "elephant_version": elephant_version(), "model": cfg.to_dict()}
    if train_config is not None:
        if hasattr(train_config, "to_dict"):
            train_config = train_config.to_dict()
        config.update({s: train_config[s] for s in RECIPE_SECTIONS if s in train_config})
    if metrics:
        config["metrics"] = _finite(metrics)

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        save_model(model, str(tmp / WEIGHTS), metadata={"format": "pt"})
        if tokenizer is not None:
            tokenizer.save(tmp)
            generation = generation_defaults(tokenizer, cfg.vocab_size)
            (tmp / GENERATION_CONFIG).write_text(json.dumps(generation, indent=2) + "\n")
        (tmp / CONFIG).write_text(json.dumps(config, indent=2) + "\n")
        (tmp / CARD).write_text(model_card(config, _count_params(model), name=name or out_dir.name))
        for f in tmp.rglob("*"):
            if f.is_file():
                with open(f, "rb") as fh:
                    os.fsync(fh.fileno())
        old = None
        if out_dir.exists():
            old = out_dir.parent / f".{out_dir.name}.old-{os.getpid()}"
            shutil.rmtree(old, ignore_errors=True)
            os.replace(out_dir, old)
        os.replace(tmp, out_dir)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def generation_defaults(tokenizer, vocab_size: int) -> dict:
    """transformers' generation settings that make its generate() sample as eval.py does: stop
    after the end-of-text token and never sample an id past the tokenizer's vocabulary (the
    model's is padded: ids vocab..vocab_size-1 are suppressed)."""
    out = {}
    eot = getattr(tokenizer, "eot_id", None)
    if eot is not None:
        out.update(eos_token_id=int(eot), pad_token_id=int(eot))
    if tokenizer.vocab_size < vocab_size:
        out["suppress_tokens"] = list(range(tokenizer.vocab_size, vocab_size))
    return out


def elephant_version() -> str:
    try:
        from importlib.metadata import PackageNotFoundError, version
        return version("elephant")
    except PackageNotFoundError:
        pass
    pyproject = Path(__file__).resolve().parents[1] / "pyproject.toml"
    try:
        import tomllib
        return tomllib.loads(pyproject.read_text())["project"]["version"]
    except (OSError, KeyError, ValueError):
        return "unknown"


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The plain module under torch.compile (_orig_mod) and DDP / FSDP-style (module) wrappers."""
    while True:
        inner = getattr(model, "_orig_mod", None) or getattr(model, "module", None)
        if not isinstance(inner, torch.nn.Module):
            return model
        model = inner


def _model_config(model: torch.nn.Module) -> ModelConfig:
    cfg = getattr(model, "cfg", None)
    if not isinstance(cfg, ModelConfig):
        raise HubError(f"save_pretrained: {type(model).__name__} has no .cfg ModelConfig; "
                       f"expected an elephant.model.ElephantLM")
    return cfg


def _count_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())   # parameters() yields tied weights once


def _finite(obj):
    """Metrics as standard JSON: NaN and infinities become null."""
    if isinstance(obj, dict):
        return {str(k): _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    return obj


def _is_export(path: Path) -> bool:
    try:
        return json.loads((path / CONFIG).read_text()).get("format") == FORMAT
    except (OSError, ValueError, AttributeError):
        return False


# ---------------------------------------------------------------------------------------------
# model card
def model_card(config: dict, n_params: int, name: str = "elephant model") -> str:
    m = config["model"]
    layers = m["layers"]
    rows = [
        ("layers", f"`{layers}` ({len(layers)}: {layers.count('M')} Mamba-2, "
                   f"{layers.count('A')} attention"
                   + (f", {layers.count('D')} gated delta rule)" if "D" in layers else ")")),
        ("d_model", m["d_model"]),
        ("attention heads", m["n_heads"]),
        ("MLP hidden (elephant GLU)", m["d_mlp"]),
        ("Mamba-2 d_state / head dim / expand", f"{m['d_state']} / {m['mamba_head_dim']} / {m['expand']}"),
        ("memory tokens (RMT)", m["n_mem"]),
        ("KV window (attention cache carried across chunks)", m["kv_window"]),
        ("attention reads the token embeddings (attn_x0)", m.get("attn_x0", False)),
        ("vocabulary", m["vocab_size"]),
        ("tied embeddings", m["tied_embeddings"]),
        ("parameters", f"{n_params:,} ({_human(n_params)})"),
    ]
    out = ["---", "library_name: elephant", "tags:", "- elephant", "- mamba2", "- recurrent-memory",
           "- text-generation", "---", "", f"# {name}", "",
           "A hybrid Mamba-2 / attention language model with recurrent memory, trained with "
           "elephant. It reads a document chunk by chunk and carries its state (SSM and conv "
           "state, a window of attention keys/values, memory tokens) from one chunk to the next, "
           "so it has no fixed context limit.", "", "## Architecture", "",
           "| | |", "|---|---|"]
    out += [f"| {k} | {v} |" for k, v in rows]
    data, train = config.get("data"), config.get("train")
    if data or train:
        out += ["", "## Training data", "", "| | |", "|---|---|"]
        for key in ("source", "path", "tokenizer", "train_split", "append_eot"):
            if data and data.get(key) not in (None, ""):
                out.append(f"| data.{key} | {data[key]} |")
        for key in ("chunk_len", "lanes", "grad_accum", "max_steps", "seed"):
            if train and key in train:
                out.append(f"| train.{key} | {train[key]} |")
    metrics = config.get("metrics")
    if metrics:
        out += ["", "## Evaluation", ""] + _metrics_table(metrics)
        out += ["", "Bits per byte and word perplexity (whitespace-separated words of the raw "
                "text) compare across tokenizers; token perplexity does not."]
    out += ["", "## How to load", "", "```python",
            "from elephant.hub import from_pretrained", "",
            f'model, tokenizer, config = from_pretrained("{name}")  # a folder or a Hub id',
            "logits, state = model(tokens)           # tokens: (B, T) int64",
            "logits, state = model(next_tokens, state)  # the next chunk, carrying the state",
            "```", "", "## Generate", "", "```python", "from elephant import generate", "",
            'ids = generate(model, tokenizer.encode("The elephant"), max_new_tokens=200,',
            "               temperature=0.8, top_k=200, seed=0, config=config)",
            "print(tokenizer.decode(ids))", "```", "",
            "or from the command line, streaming the text as it is written:", "", "```bash",
            f'python eval.py --checkpoint {name} --prompt "The elephant" --max-new-tokens 200',
            "```", "", "## With transformers", "", "```python",
            "import elephant.hf  # registers the elephant model type with the Auto classes",
            "from transformers import AutoModelForCausalLM, AutoTokenizer", "",
            f'model = AutoModelForCausalLM.from_pretrained("{name}")',
            f'tokenizer = AutoTokenizer.from_pretrained("{name}")',
            'ids = tokenizer("The elephant", return_tensors="pt").input_ids',
            "out = model.generate(ids, max_new_tokens=200, do_sample=False)",
            "print(tokenizer.decode(out[0]))", "```", "",
            "Generation carries the state as training did (memory read and written every "
            "`train.chunk_len` tokens, the rolling attention window, the Mamba state advanced "
            "token by token), so memory stays flat however long the text grows.", ""]
    return "\n".join(out)


def _human(n: int) -> str:
    for div, unit in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= div:
            return f"{n / div:.1f}{unit}"
    return str(n)


def _metrics_table(metrics: dict) -> list[str]:
    def fmt(v):
        if isinstance(v, float):
            return f"{v:.4f}"
        return "n/a" if v is None else str(v)

    scalar = (int, float, str, bool, type(None))
    flat = {k: v for k, v in metrics.items() if isinstance(v, scalar)}
    nested = {k: v for k, v in metrics.items() if isinstance(v, dict)}
    lines = []
    if flat:
        lines += ["| metric | value |", "|---|---:|"] + [f"| {k} | {fmt(v)} |" for k, v in flat.items()]
    if nested:
        if lines:
            lines.append("")
        lines += ["| evaluation | metric | value |", "|---|---|---:|"]
        for split, values in nested.items():
            lines += [f"| {split} | {k} | {fmt(v)} |" for k, v in values.items() if isinstance(v, scalar)]
    return lines


# ---------------------------------------------------------------------------------------------
# load
def from_pretrained(dir_or_repo_id: str | Path, device: str | torch.device = "cpu",
                    revision: str | None = None, kv_keep: int | None = None,
                    kv_keep_read: int | None = None, token: str | None = None,
                    cache_dir: str | Path | None = None, local_files_only: bool = False):
    """Load (model in eval mode on `device`, tokenizer or None, config dict) from an export
    folder, a Hub id ("user/name", downloaded with huggingface_hub.snapshot_download, which takes
    `revision`, `token`, `cache_dir` and `local_files_only`), a training run dir or a checkpoint
    folder. `kv_keep`: how many kept tokens each attention layer holds here, in place of the
    number it trained with (default: its model.kv_keep_infer, if set), and `kv_keep_read` how many
    of them each query reads (`with_kept_capacity`); the config returned says so."""
    download = dict(revision=revision, token=token, cache_dir=cache_dir,
                    local_files_only=local_files_only)
    folder = _resolve(dir_or_repo_id, **{k: v for k, v in download.items() if v})
    if (folder / CONFIG).is_file():
        config = read_config(folder / CONFIG)
        weights = folder / WEIGHTS
        tokenizer = _load_tokenizer_dir(folder)
    else:
        config, weights = _checkpoint_config(folder)
        tokenizer = _load_tokenizer_spec(config, folder)
    if kv_keep is None:
        kv_keep = int(config["model"].get("kv_keep_infer", 0)) or None
    if kv_keep is not None or kv_keep_read is not None:
        config = with_kept_capacity(config, kv_keep, str(dir_or_repo_id), kv_keep_read)
    model = build_model(config, weights)
    return model.to(device).eval(), tokenizer, config


def with_kept_capacity(config: dict, kv_keep: int | None, name: str,
                       read: int | None = None) -> dict:
    """`config` with model.kv_keep = `kv_keep`. The kept tokens are chosen by a learned score of
    each token alone and read at a fixed distance, so the weights do not depend on how many are
    kept: a model trained with K may keep more, so that what it keeps can outlast a longer
    stream. Each query still reads as many as it did in training (model.kv_keep_read: the trained
    one, else the trained K), its best-matching ones: read all at once, more kept tokens dilute
    the read (docs/RESULTS.md). `read`: that many instead (0: all; None: as trained); `kv_keep`
    None: as trained. HubError for a model trained without kept tokens, which has no score, or a
    count below 1."""
    trained = int(config["model"].get("kv_keep", 0))
    kv_keep = trained if kv_keep is None else kv_keep
    if read is not None and read < 0:
        raise HubError(f"kv_keep_read {read}: expected 0 (read every kept token) or more")
    if kv_keep < 1:
        raise HubError(f"kv_keep {kv_keep}: expected at least 1 kept token (to drop them all, "
                       "evaluate with the kept tokens ablated instead)")
    if not trained:
        raise HubError(f"{name}: trained without kept tokens (model.kv_keep 0), so it has no keep "
                       f"score to choose {kv_keep} of them")
    read = (int(config["model"].get("kv_keep_read", 0)) or trained) if read is None else read
    return {**config, "model": {**config["model"], "kv_keep": kv_keep, "kv_keep_read": read,
                                "kv_keep_infer": 0}}   # the capacity is now kv_keep itself


def read_config(path: Path) -> dict:
    """Read and check an export's config.json; ModelConfig errors name the key at fault."""
    try:
        config = json.loads(path.read_text())
    except OSError as e:
        raise HubError(f"{path}: unreadable ({e.strerror})") from None
    except ValueError as e:
        raise HubError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(config, dict):
        raise HubError(f'{path}: expected a JSON object with a "model" table')
    if config.get("format") != FORMAT and not isinstance(config.get("model"), dict):
        kind = config.get("model_type")
        kind = f" (its model_type is {kind!r})" if isinstance(kind, str) else ""
        raise HubError(f'{path}: not an elephant export{kind}: expected "format": "{FORMAT}" and '
                       f'a "model" table')
    if not isinstance(config.get("model"), dict):
        raise HubError(f'{path}: expected a JSON object with a "model" table')
    for key in config:
        if key not in CONFIG_KEYS:
            match = difflib.get_close_matches(key, CONFIG_KEYS, n=1, cutoff=0.5)
            hint = f" (did you mean {match[0]}?)" if match else f" (expected {', '.join(CONFIG_KEYS)})"
            raise HubError(f"{path}: unknown key {key!r}{hint}")
    try:
        ModelConfig.from_dict(config["model"])
    except ConfigError as e:
        raise HubError(f"{path}: {e}") from None
    return config


def build_model(config: dict, weights: Path) -> torch.nn.Module:
    """ElephantLM(ModelConfig.from_dict(config["model"])) with the weights of a safetensors file."""
    from .model import ElephantLM

    # every tensor is read from the file (load_weights refuses one that lacks any), so the model
    # is built without its random fills: they took 1.8 s of a 62M model's 2.0 s load on a CPU.
    # (Built on the meta device instead, the fills run torch's reference kernels, whose first
    # call imports dynamo: 1.6 s more, where eval.py imports no compiler.)
    with _no_init_fills():
        model = ElephantLM(ModelConfig.from_dict(config["model"]))
    load_weights(model, weights)
    return model


_INIT_FILLS = ("normal_", "uniform_", "kaiming_uniform_", "kaiming_normal_", "xavier_uniform_",
               "xavier_normal_", "trunc_normal_", "orthogonal_", "zeros_", "ones_", "constant_")


@contextlib.contextmanager
def _no_init_fills():
    """torch.nn.init's fills as no-ops (the tensor left as allocated) while a model whose every
    tensor is then loaded is built."""
    saved = {name: getattr(torch.nn.init, name) for name in _INIT_FILLS}
    try:
        for name in _INIT_FILLS:
            setattr(torch.nn.init, name, lambda tensor, *args, **kwargs: tensor)
        yield
    finally:
        for name, fill in saved.items():
            setattr(torch.nn.init, name, fill)


def load_weights(model: torch.nn.Module, weights: str | Path) -> None:
    """Load a safetensors file into `model`, refusing (HubError) a file whose tensors do not match."""
    weights = Path(weights)
    if not weights.is_file():
        raise HubError(f"{weights}: missing")
    try:
        with safe_open(str(weights), framework="pt") as f:
            shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    except (SafetensorError, OSError, ValueError) as e:
        raise HubError(f"{weights}: not a readable safetensors file ({_first_line(e)})") from None
    groups: dict = {}                        # tied weights: names that share one storage
    for name, t in model.state_dict().items():
        key = (t.data_ptr(), tuple(t.shape), t.stride()) if t.numel() else name
        groups.setdefault(key, []).append((name, tuple(t.shape)))
    names = {name for group in groups.values() for name, _ in group}
    missing, wrong = [], []
    for group in groups.values():             # a group is satisfied by any one of its names
        present = [(name, shape) for name, shape in group if name in shapes]
        if not present:
            missing.append(group[0][0])
        elif shapes[present[0][0]] != present[0][1]:
            wrong.append(present[0])
    unexpected = [k for k in shapes if k not in names]
    if wrong:
        k, shape = wrong[0]
        raise HubError(f"{weights} does not match the config: {k} has shape {list(shapes[k])} in the "
                       f"file but {list(shape)} in the model ({len(wrong)} tensors differ)")
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"{len(missing)} tensors missing (first: {missing[0]})")
        if unexpected:
            parts.append(f"{len(unexpected)} unexpected (first: {unexpected[0]})")
        raise HubError(f"{weights} does not match the config: {', '.join(parts)}")
    try:
        missing, unexpected = load_model(model, str(weights), strict=False)
    except (SafetensorError, OSError, RuntimeError, ValueError) as e:
        raise HubError(f"{weights}: corrupt or truncated ({_first_line(e)})") from None
    if missing or unexpected:
        raise HubError(f"{weights} does not match the config: missing {sorted(missing)[:3]}, "
                       f"unexpected {sorted(unexpected)[:3]}")


def _resolve(source: str | Path, **download) -> Path:
    path = Path(source).expanduser()
    if path.is_dir():
        return path
    text = str(source)
    if path.exists():
        raise HubError(f"{text}: not a folder (expected an export folder with {CONFIG} + {WEIGHTS}, "
                       f"a run dir, or a Hub id user/name)")
    if not REPO_ID.match(text) or text.startswith("."):
        raise HubError(f"{text}: no such folder (expected an export folder with {CONFIG} + "
                       f"{WEIGHTS}, a run dir, or a Hub id user/name)")
    try:
        from huggingface_hub import snapshot_download
        return Path(snapshot_download(repo_id=text, **download))
    except Exception as e:  # offline, unknown repo, no access: all one message
        raise HubError(f"{text}: not a local folder, and downloading it from the Hub failed "
                       f"({type(e).__name__}: {_first_line(e)})") from None


def _checkpoint_config(folder: Path) -> tuple[dict, Path]:
    """(config dict in export form, weights path) of a run dir or checkpoint folder."""
    from .checkpoint import CheckpointError, checkpoint_to_read, read_meta, step_folders

    try:   # a run dir: its newest checkpoint whose weights verify (newer broken ones named on stderr)
        ckpt = checkpoint_to_read(folder, (WEIGHTS,))
        meta = read_meta(ckpt)
    except CheckpointError as e:
        if ((folder / "meta.json").is_file() or step_folders(folder / "checkpoints")
                or step_folders(folder)):
            raise HubError(str(e)) from None      # a checkpoint, but a broken one
        raise HubError(f"{folder}: neither an export folder ({CONFIG} missing) nor a checkpoint: {e}") from None
    full = meta.get("config")
    if not isinstance(full, dict) or not isinstance(full.get("model"), dict):
        raise HubError(f'{ckpt / "meta.json"}: no "config" with a "model" table')
    try:
        ModelConfig.from_dict(full["model"])
    except ConfigError as e:
        raise HubError(f"{ckpt / 'meta.json'}: {e}") from None
    config = {"format": FORMAT, "elephant_version": elephant_version(), "model": full["model"]}
    config.update({s: full[s] for s in RECIPE_SECTIONS if s in full})
    return config, ckpt / WEIGHTS


def _tokenizer_loader():
    try:
        from data_packing import load_tokenizer
    except ImportError:
        from data_packing.tokenizer import load_tokenizer
    return load_tokenizer


def _load_tokenizer_dir(folder: Path):
    if not any((folder / f).is_file() for f in TOKENIZER_FILES):
        return None
    try:
        return _tokenizer_loader()(folder)
    except ValueError as e:  # data_packing's DataError
        raise HubError(f"{folder}: tokenizer files unreadable: {e}") from None


def _load_tokenizer_spec(config: dict, folder: Path):
    """The tokenizer a run trained with (config data.tokenizer: "bytes", a path or a Hub id)."""
    spec = (config.get("data") or {}).get("tokenizer")
    if not spec:
        return None
    try:
        return _tokenizer_loader()(spec)
    except ValueError as e:
        raise HubError(f"{folder}: the run's tokenizer {spec!r} cannot be loaded: {e}") from None


def _first_line(e: BaseException) -> str:
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    return lines[0][:300] if lines else type(e).__name__


# ---------------------------------------------------------------------------------------------
# run dir -> export folder, and the Hub
def export_run(run_dir: str | Path, out_dir: str | Path, step: int | None = None,
               metrics: dict | None = None, name: str | None = None) -> Path:
    """Export a training run's checkpoint (the newest whose weights verify, or `step`, which must
    verify) as an export folder: the model is rebuilt from the checkpoint's config and loaded (so
    a mismatch fails here, not on the Hub), and the tokenizer named by the run's data.tokenizer is
    saved beside it."""
    run_dir = Path(run_dir)
    source = run_dir / "checkpoints" / f"step_{step:07d}" if step is not None else run_dir
    if not source.is_dir():
        raise HubError(f"{source}: no such checkpoint folder")
    config, weights = _checkpoint_config(source)
    model = build_model(config, weights)
    tokenizer = _load_tokenizer_spec(config, source)
    return save_pretrained(model, out_dir, tokenizer=tokenizer, train_config=config, metrics=metrics,
                           name=name)


def push_to_hub(folder: str | Path, repo_id: str, private: bool = False, token: str | None = None,
                commit_message: str = "Upload elephant model") -> str:
    """Create `repo_id` if needed (a model repo) and upload every file of an export folder in one
    commit; returns the commit URL. HF_ENDPOINT, when set, names the Hub server."""
    folder = Path(folder)
    for f in (CONFIG, WEIGHTS):
        if not (folder / f).is_file():
            raise HubError(f"{folder}: not an export folder ({f} missing); export a run first with "
                           f"python -m elephant.hub export RUN_DIR OUT_DIR")
    read_config(folder / CONFIG)
    if not REPO_ID.match(repo_id):
        raise HubError(f"repo id {repo_id!r}: expected user/name or org/name")
    try:
        from huggingface_hub import HfApi
    except ImportError:
        raise HubError("pushing needs huggingface_hub: pip install huggingface_hub") from None
    api = HfApi(endpoint=os.environ.get("HF_ENDPOINT") or None, token=token)
    try:
        api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
        info = api.upload_folder(repo_id=repo_id, folder_path=str(folder), repo_type="model",
                                 commit_message=commit_message)
    except Exception as e:  # HTTP, auth, offline: one line, without the token
        message = _first_line(e)
        if token:
            message = message.replace(token, "***")
        raise HubError(f"push to {repo_id} failed: {type(e).__name__}: {message}") from None
    return str(getattr(info, "commit_url", info))


# ---------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m elephant.hub", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    ex = sub.add_parser("export", help="export a run's checkpoint as a folder for from_pretrained")
    ex.add_argument("run_dir")
    ex.add_argument("out_dir")
    ex.add_argument("--step", type=int, default=None,
                    help="checkpoint step (default: the newest whose weights verify)")
    pu = sub.add_parser("push", help="upload an export folder (or export a run dir first) to the Hub")
    pu.add_argument("source", help="an export folder, a run dir or a checkpoint folder")
    pu.add_argument("repo_id", help="user/name")
    pu.add_argument("--private", action="store_true")
    pu.add_argument("--step", type=int, default=None, help="checkpoint step of a run dir")
    pu.add_argument("--message", default="Upload elephant model", help="commit message")
    args = p.parse_args(argv)
    try:
        if args.cmd == "export":
            out = export_run(args.run_dir, args.out_dir, step=args.step)
            print(f"exported {args.run_dir} to {out}")
            return 0
        source = Path(args.source)
        if (source / CONFIG).is_file():
            url = push_to_hub(source, args.repo_id, private=args.private, commit_message=args.message)
        else:
            with tempfile.TemporaryDirectory(prefix="elephant-export-") as tmp:
                folder = export_run(source, Path(tmp) / "export", step=args.step, name=args.repo_id)
                print(f"exported {source} to a temporary folder")
                url = push_to_hub(folder, args.repo_id, private=args.private, commit_message=args.message)
        print(f"pushed to {url}")
        return 0
    except HubError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
