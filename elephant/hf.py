"""transformers' Auto classes for elephant models: after `import elephant.hf`,

    model = AutoModelForCausalLM.from_pretrained(export_dir_or_hub_id)
    tokenizer = AutoTokenizer.from_pretrained(export_dir_or_hub_id)
    out = model.generate(tokenizer("The elephant", return_tensors="pt").input_ids, max_new_tokens=50)

read an export folder (`python -m elephant.hub export`) or the Hub repo it was pushed to. The
adapter adds no second model: `ElephantForCausalLM` holds the `ElephantLM` that
`elephant.hub.from_pretrained` loads (the same weights, kept-token capacity and tokenizer) and runs
it only through elephant's own entry points, so it agrees with eval.py and `elephant.generate`:
  * `model(input_ids, labels=...)` reads the sequence chunk by chunk with carried state, as eval.py
    does, at the chunk length the model trained with (config.train.chunk_len), and the loss is
    `ElephantLM.loss` under transformers' convention (labels are the inputs, shifted inside;
    -100 is ignored): the cross-entropy eval.py reports, without training's extra costs;
  * `generate()` carries the recurrent state as its cache: `ElephantCache` holds an
    `elephant.generate.Decoder` (attention window, kept tokens, Mamba conv/SSM state, memory), all
    of fixed size, so memory stays flat however long the text. The prompt is read by
    `elephant.generate.read_prompt` and every new token by `Decoder.step`, exactly as
    `elephant.generate` does: memory tokens are read and written every chunk_len tokens, and greedy
    decoding gives eval.py --temperature 0's tokens. The export's generation_config.json stops at
    the end-of-text token and never samples the padded vocabulary ids, as eval.py does.

Design choice: loading goes through `elephant.hub.from_pretrained`, not transformers' own weight
loader (which builds the model on the meta device, renames keys and initializes what it thinks is
missing): one loader and one format, exports written before this adapter included (those load with
`ElephantForCausalLM.from_pretrained`; the Auto classes need config.json's model_type). So
`device_map` takes one device, and quantization is not offered. `save_pretrained` writes the files
of an elephant export.

Batches: rows of equal length, or left-padded rows (attention_mask zeros before a row's first
token, tokenizer.padding_side = "left"): a padded row is read as if alone (its document starts at
its first real token: `Decoder.reset` in generation, a pass of its own in forward).
"""
from __future__ import annotations

import tempfile
from pathlib import Path

import torch
from torch import Tensor
from transformers import (AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig,
                          GenerationMixin, PreTrainedConfig, PreTrainedModel,
                          PreTrainedTokenizerFast)
from transformers.cache_utils import Cache
from transformers.modeling_outputs import CausalLMOutputWithPast

from . import hub
from .config import ConfigError, ModelConfig
from .generate import Decoder, read_prompt, training_chunk_len
from .model import ElephantLM

# from_pretrained keywords transformers' Auto classes pass along that mean nothing here
_PASSED_BY_AUTO = ("_from_auto", "_from_pipeline", "trust_remote_code", "adapter_kwargs",
                   "force_download", "proxies", "low_cpu_mem_usage", "use_safetensors")
_DOWNLOAD = ("revision", "token", "cache_dir", "local_files_only")
_KEPT = ("kv_keep", "kv_keep_read")


class ElephantConfig(PreTrainedConfig):
    """An export's config.json as a transformers config: the same tables (`model`: the
    ModelConfig; `data` / `optim` / `train`: the training recipe; `metrics`), checked on creation.
    `elephant_config()` gives them back in the form elephant.hub reads."""

    model_type = hub.MODEL_TYPE

    format: str = hub.FORMAT
    elephant_version: str | None = None
    model: dict | None = None
    data: dict | None = None
    optim: dict | None = None
    train: dict | None = None
    metrics: dict | None = None

    def __post_init__(self, **kwargs):
        super().__post_init__(**kwargs)
        if self.format != hub.FORMAT:
            raise ValueError(f'ElephantConfig: "format" is {self.format!r}, expected "{hub.FORMAT}"')
        if self.model is not None:
            try:
                ModelConfig.from_dict(self.model)
            except ConfigError as e:
                raise ValueError(f"ElephantConfig: {e}") from None

    def elephant_config(self) -> dict:
        """The config dict of elephant.hub (config.json's tables)."""
        out = {"format": self.format, "model": self.model}
        for key in ("elephant_version", "data", "optim", "train", "metrics"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        return out

    @property
    def chunk_len(self) -> int:
        """The chunk framing of forward and generate: the training run's train.chunk_len."""
        return training_chunk_len(self.elephant_config())

    @property
    def vocab_size(self) -> int | None:
        return None if self.model is None else int(self.model["vocab_size"])

    @property
    def hidden_size(self) -> int | None:
        return None if self.model is None else int(self.model["d_model"])

    @property
    def num_hidden_layers(self) -> int | None:
        return None if self.model is None else len(self.model["layers"])


class ElephantCache(Cache):
    """The recurrent state as generate()'s cache: an `elephant.generate.Decoder` (None until the
    first forward reads a prompt), whose tensors keep their shapes as tokens are added. It is
    not a key/value cache: it cannot be cropped (assisted decoding) or grown per layer; beam
    search's reordering is `Decoder.reorder`."""

    def __init__(self, decoder: Decoder | None = None):
        super().__init__(layers=[])
        self.decoder = decoder
        self.seen = 0      # tokens read per lane: what generate() slices a continued prompt by

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.seen

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return -1          # no limit: the state does not grow

    @property
    def is_compileable(self) -> bool:
        return False

    @property
    def is_croppable(self) -> bool:
        return False

    @property
    def is_initialized(self) -> bool:
        return self.decoder is not None

    @property
    def batch_size(self) -> int:
        return -1 if self.decoder is None else self.decoder.B

    def tensors(self) -> list[Tensor]:
        """Every tensor the state holds (for inspecting its size)."""
        if self.decoder is None:
            return []
        dec = self.decoder
        return dec._tensors() + ([] if dec.memory is None else [dec.memory])

    def reorder_cache(self, beam_idx: Tensor) -> None:
        self.decoder.reorder(beam_idx)

    def reset(self) -> None:
        self.decoder, self.seen = None, 0

    def update(self, *args, **kwargs):
        raise NotImplementedError("ElephantCache holds a recurrent state, not per-layer keys and "
                                  "values; only ElephantForCausalLM advances it")

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("ElephantCache: a recurrent state cannot be cropped back "
                                  "(assisted decoding is not supported)")

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise NotImplementedError("ElephantCache: expand the inputs before the first forward instead")

    def batch_select_indices(self, indices: Tensor) -> None:
        raise NotImplementedError("ElephantCache: selecting lanes of a started state is not supported")


class ElephantForCausalLM(PreTrainedModel, GenerationMixin):
    """An ElephantLM (`self.model`) behind transformers' causal-LM interface (see the module doc)."""

    config_class = ElephantConfig
    base_model_prefix = "model"
    main_input_name = "input_ids"

    def __init__(self, config: ElephantConfig, model: ElephantLM | None = None):
        super().__init__(config)
        if config.model is None:
            raise ValueError('ElephantForCausalLM: the config has no "model" table')
        self.model = model if model is not None else ElephantLM(ModelConfig.from_dict(config.model))
        self.post_init()

    def _init_weights(self, module) -> None:
        """Nothing: ElephantLM initializes itself, and from_pretrained loads every tensor."""

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False       # forward makes its own cache (ElephantCache), never a DynamicCache

    def get_input_embeddings(self):
        return self.model.embed

    def get_output_embeddings(self):
        return self.model.lm_head

    # ------------------------------------------------------------------ load / save
    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *model_args, config=None, **kwargs):
        """The model of an export folder, a Hub id, a run dir or a checkpoint folder, loaded by
        elephant.hub.from_pretrained, in eval mode. Keywords: dtype (or torch_dtype; "auto": as
        loaded), device_map (one device, or "auto": the GPU if there is one), kv_keep and
        kv_keep_read (as hub.from_pretrained), revision / token / cache_dir / local_files_only
        (the Hub download). Anything else is refused (one-line TypeError)."""
        if model_args:
            raise TypeError(f"{cls.__name__}.from_pretrained takes no positional model arguments")
        dtype = _dtype(kwargs.pop("dtype", None) or kwargs.pop("torch_dtype", None))
        device = _device(kwargs.pop("device_map", None))
        load = {k: kwargs.pop(k) for k in _DOWNLOAD + _KEPT if kwargs.get(k) is not None}
        if kwargs.pop("subfolder", None):
            raise TypeError(f"{cls.__name__}.from_pretrained: subfolder is not supported")
        for key in _PASSED_BY_AUTO:
            kwargs.pop(key, None)
        for key in ("torch_dtype", "dtype", "device_map") + _DOWNLOAD + _KEPT:
            kwargs.pop(key, None)                  # given as None
        if kwargs:
            raise TypeError(f"{cls.__name__}.from_pretrained: unsupported keyword(s) "
                            f"{', '.join(sorted(kwargs))}")
        lm, tokenizer, loaded = hub.from_pretrained(pretrained_model_name_or_path, device=device,
                                                    **load)
        if config is not None and not isinstance(config, ElephantConfig):
            raise TypeError(f"{cls.__name__}.from_pretrained: config must be an ElephantConfig, "
                            f"got {type(config).__name__}")
        if config is not None and config.model is not None and _arch(config.model) != _arch(loaded["model"]):
            raise ValueError(f"{pretrained_model_name_or_path}: its model table differs from the "
                             f"config given to from_pretrained")
        if dtype is not None:
            lm = lm.to(dtype)
        hf_config = ElephantConfig(**{k: v for k, v in loaded.items() if k in hub.CONFIG_KEYS},
                                   name_or_path=str(pretrained_model_name_or_path))
        model = cls(hf_config, model=lm)
        if tokenizer is not None:
            model.generation_config = GenerationConfig(
                **hub.generation_defaults(tokenizer, lm.cfg.vocab_size))
        return model.eval()

    def save_pretrained(self, save_directory, is_main_process: bool = True,
                        state_dict: dict | None = None, **kwargs) -> None:
        """Write the files of an elephant export (config.json, model.safetensors, README.md, via
        elephant.hub.save_pretrained) into `save_directory`, leaving its other files (a
        tokenizer's, a trainer's) in place; both from_pretrained read it. Sharding and format
        options are not used (one safetensors file)."""
        if state_dict is not None:
            raise NotImplementedError("ElephantForCausalLM.save_pretrained saves the model's own "
                                      "weights; a separate state_dict is not supported")
        if kwargs.pop("push_to_hub", False):
            raise NotImplementedError("push with model.push_to_hub(repo_id) or "
                                      "python -m elephant.hub push DIR user/name")
        if not is_main_process:
            return
        out = Path(save_directory)
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=out) as tmp:
            export = hub.save_pretrained(self.model, Path(tmp) / "export",
                                         train_config=self.config.elephant_config(),
                                         metrics=self.config.metrics, name=out.name)
            for f in export.iterdir():
                f.replace(out / f.name)

    # ------------------------------------------------------------------ forward
    def forward(self, input_ids: Tensor | None = None, attention_mask: Tensor | None = None,
                cache: ElephantCache | None = None, labels: Tensor | None = None,
                use_cache: bool | None = None, logits_to_keep: int = 0,
                return_dict: bool | None = None, num_items_in_batch: int | Tensor | None = None,
                **kwargs) -> CausalLMOutputWithPast | tuple:
        """input_ids (B, S) -> logits (B, S, V) (the last `logits_to_keep` only, when > 0), and
        with `labels` (B, S) the mean cross-entropy of each token's prediction of the next
        (labels -100 and padding ignored; with `num_items_in_batch`, the sum over it).

        Without a cache (and use_cache false) the rows are read chunk by chunk from a fresh state,
        as eval.py reads a document. With `cache` (or use_cache, which starts one) the tokens
        continue the cache's state, advanced in place, and the cache is returned: how generate()
        decodes."""
        for key in ("output_attentions", "output_hidden_states"):
            if kwargs.pop(key, False):
                raise NotImplementedError(f"ElephantForCausalLM: {key} is not supported")
        kwargs.pop("position_ids", None)           # positions are the state's own
        if kwargs:
            raise TypeError(f"ElephantForCausalLM.forward: unexpected keyword(s) "
                            f"{', '.join(sorted(kwargs))}")
        if input_ids is None or input_ids.dim() != 2:
            raise ValueError("ElephantForCausalLM.forward: input_ids of shape (batch, length) required")
        input_ids = input_ids.to(self.model.embed.weight.device)
        B, S = input_ids.shape
        starts, ends = _row_spans(attention_mask, B, S, input_ids.device)
        want_all = labels is not None or logits_to_keep != 1
        if cache is None and not use_cache:
            logits = self._read(input_ids, starts, ends)
        else:
            cache = cache if cache is not None else ElephantCache()
            logits = self._decode(cache, input_ids, starts, ends, last_only=not want_all)
        loss = None
        if labels is not None:
            loss = self._loss(logits, labels.to(logits.device), starts, ends, num_items_in_batch)
        if logits_to_keep and logits.shape[1] > logits_to_keep:
            logits = logits[:, -logits_to_keep:]
        out = CausalLMOutputWithPast(loss=loss, logits=logits, cache=cache)
        return out if return_dict is not False else out.to_tuple()

    def _read(self, ids: Tensor, starts: list[int] | None, ends: list[int] | None) -> Tensor:
        """eval.py's reading: chunk by chunk from a fresh state, logits (B, S, V); a padded row is
        read alone from its first to its last real token (logits 0 elsewhere)."""
        if starts is None:
            return self._chunks(ids)
        out = torch.zeros(*ids.shape, self.model.cfg.vocab_size, device=ids.device,
                          dtype=self.model.lm_head.weight.dtype)
        for b, (s, e) in enumerate(zip(starts, ends)):
            if e > s:
                out[b, s:e] = self._chunks(ids[b:b + 1, s:e])[0]
        return out

    def _chunks(self, ids: Tensor) -> Tensor:
        T, state, logits = self.config.chunk_len, None, []
        for c in range(0, ids.shape[1], T):
            out, state = self.model(ids[:, c:c + T], state)
            logits.append(out)
        return torch.cat(logits, dim=1)

    def _decode(self, cache: ElephantCache, ids: Tensor, starts: list[int] | None,
                ends: list[int] | None, last_only: bool) -> Tensor:
        """Advance the cache's state by ids (B, S); logits (B, S, V), or (B, 1, V) of the last
        token with `last_only`. A fresh cache reads the prompt as elephant.generate does."""
        if cache.decoder is None:
            if ends is not None and any(e != ids.shape[1] for e in ends):
                raise ValueError("attention_mask: a row ends in padding; pad prompts on the left "
                                 "for generation (tokenizer.padding_side = 'left')")
            if starts is None:
                cache.decoder, logits = read_prompt(self.model, ids, self.config.chunk_len,
                                                    last_only=last_only, cuda_graph=ids.is_cuda)
            else:
                logits = self._padded_prompt(cache, ids, starts)
        else:
            logits = self._continue(cache.decoder, ids)
        cache.seen += ids.shape[1]
        if last_only:
            return (logits if logits.dim() == 2 else logits[:, -1])[:, None]
        return logits

    @torch.no_grad()
    def _padded_prompt(self, cache: ElephantCache, ids: Tensor, starts: list[int]) -> Tensor:
        """Left-padded prompts, token by token: a row's document starts (Decoder.reset) at its
        first real token, so it reads its prompt as if alone."""
        dec = cache.decoder = Decoder(self.model, ids.shape[0], self.config.chunk_len,
                                      cuda_graph=ids.is_cuda)
        logits = []
        for t in range(ids.shape[1]):
            if t:
                dec.reset([s == t for s in starts])
            logits.append(dec.step(ids[:, t]).clone())   # a CUDA graph's output is overwritten
        return torch.stack(logits, dim=1)

    @torch.no_grad()
    def _continue(self, dec: Decoder, ids: Tensor) -> Tensor:
        """More tokens of every lane: one step each, or a prefill up to the chunk's end where every
        lane stands at the same point of its chunk."""
        logits, t, S = [], 0, ids.shape[1]
        while t < S:
            n = min(S - t, dec.T - dec.phase[0]) if len(set(dec.phase)) == 1 else 1
            if n == 1:     # (cloned: a CUDA graph's output is overwritten by the next step)
                logits.append(dec.step(ids[:, t])[:, None].clone())
            else:
                logits.append(dec.prefill(ids[:, t:t + n]))
            t += n
        return torch.cat(logits, dim=1)

    def _loss(self, logits: Tensor, labels: Tensor, starts, ends, num_items) -> Tensor:
        """ElephantLM.loss of the prediction at t of label t + 1 (transformers' shift)."""
        if labels.shape != logits.shape[:2]:
            raise ValueError(f"labels: expected shape {tuple(logits.shape[:2])}, got {tuple(labels.shape)}")
        targets = labels[:, 1:]
        mask = targets != -100
        if starts is not None:       # only predictions from a real token of a real token
            pos = torch.arange(labels.shape[1], device=labels.device)
            real = ((pos >= torch.tensor(starts, device=labels.device)[:, None])
                    & (pos < torch.tensor(ends, device=labels.device)[:, None]))
            mask &= real[:, :-1] & real[:, 1:]
        if num_items is None:
            return ElephantLM.loss(logits[:, :-1], targets, mask)
        return ElephantLM.loss(logits[:, :-1], targets, mask, reduction="sum") / num_items


# ---------------------------------------------------------------------------------------------
def _row_spans(mask: Tensor | None, B: int, S: int, device) -> tuple[list[int] | None, list[int] | None]:
    """(first, end) of each row's real tokens by a 2-D attention_mask over the whole sequence
    (generate passes the mask of the prompt and the tokens so far; this forward's tokens are its
    last S columns), or (None, None) without padding. ValueError for a row whose real tokens are
    not one run."""
    if mask is None:
        return None, None
    if mask.dim() != 2 or mask.shape[0] != B or mask.shape[1] < S:
        raise ValueError(f"attention_mask: expected shape ({B}, >= {S}), got {tuple(mask.shape)}")
    mask = mask[:, -S:].to(device).bool()
    if bool(mask.all()):
        return None, None
    n = mask.sum(1)
    first = mask.int().argmax(1)
    pos = torch.arange(S, device=device)
    run = (pos >= first[:, None]) & (pos < (first + n)[:, None])
    if not torch.equal(run, mask):
        raise ValueError("attention_mask: each row's ones must be one run (padding only before "
                         "or after a row's tokens)")
    return first.tolist(), (first + n).tolist()


def _arch(model: dict) -> dict:
    """A model table without the kept-token capacity, which from_pretrained may change."""
    return {k: v for k, v in model.items() if k not in ("kv_keep", "kv_keep_read", "kv_keep_infer")}


def _dtype(dtype) -> torch.dtype | None:
    if dtype is None or dtype == "auto":
        return None
    if isinstance(dtype, str):
        if not isinstance(getattr(torch, dtype, None), torch.dtype):
            raise ValueError(f"dtype {dtype!r}: not a torch dtype (e.g. 'bfloat16', 'float32')")
        return getattr(torch, dtype)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"dtype {dtype!r}: expected a torch.dtype, its name or 'auto'")
    return dtype


def _device(device_map) -> torch.device:
    """from_pretrained's device_map as one device ("auto": the first GPU if there is one)."""
    if isinstance(device_map, dict) and set(device_map) == {""}:
        device_map = device_map[""]
    if device_map is None:
        return torch.device("cpu")
    if device_map == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if isinstance(device_map, int):
        return torch.device("cuda", device_map)
    try:
        return torch.device(device_map)
    except (RuntimeError, TypeError):
        raise ValueError(f"device_map {device_map!r}: expected one device ('cpu', 'cuda:0', an "
                         f"index) or 'auto'; an elephant model is not split over devices") from None


AutoConfig.register(hub.MODEL_TYPE, ElephantConfig, exist_ok=True)
AutoModelForCausalLM.register(ElephantConfig, ElephantForCausalLM, exist_ok=True)
AutoTokenizer.register(ElephantConfig, tokenizer_class=PreTrainedTokenizerFast, exist_ok=True)
