"""lm-evaluation-harness reads elephant models: the `elephant` model of the harness, and its CLI.

    python -m elephant.lm_eval --model elephant --model_args pretrained=DIR --tasks wikitext103_local
    python -m elephant.lm_eval --model hf --model_args pretrained=EleutherAI/pythia-70m-deduped \
        --tasks wikitext103_local                                  # the same task, side by side

`python -m elephant.lm_eval` registers the model `elephant` with the harness's registry (a lazy
entry, as the harness lists its own models), adds this package's task folder (`lm_eval_tasks/`,
holding `wikitext103_local`) to the harness's include path, and hands the rest of the command line
to the harness's own CLI (`lm-eval run`, `ls`, `validate`; lm_eval >= 0.4.10).

The design choice: the adapter wraps the project's own model, state and loading and adds no
second model code (DESIGN.md, "Adapters for the ecosystem"). `pretrained` is anything
`elephant.hub.from_pretrained` takes (export folder, run dir, checkpoint folder, Hub id).
  * `loglikelihood_rolling` is `elephant.evaluate.evaluate`, the streaming evaluation eval.py
    runs, over the request texts as a corpus: every whole document chunk by chunk with carried
    state (no context limit), many documents side by side in lanes, longest first. It scores the
    tokens eval.py scores: every token of a document but the first (there is no
    beginning-of-document token) and the end-of-text token after it when the model's corpus
    appended one (data.append_eot, True by default). A Hugging Face model instead conditions the
    first token on an end-of-text token and scores no end-of-text token: as many predictions, not
    the same ones.
  * `loglikelihood` streams context + continuation the same way (a reset at the first token, the
    training's chunk framing, carried state), summing the continuation's log-probabilities and
    checking that each of its tokens is the argmax; several requests side by side, longest first.
    An empty context is the end-of-text token, as the harness gives any model.
  * `generate_until` is `elephant.generate.generate` (the chunk framing of training, memory
    written at each chunk's end), greedy unless the task samples, stopped once every lane has met
    one of its `until` strings or the end-of-text token, cut at the first stop string.
The numbers follow eval.py's settings on each device: on a GPU the scoring runs under bfloat16
autocast (its CUDA graph, compaction and side batch as well) and generation with bfloat16 weights
(a copy, made once); on the CPU everything runs in float32. `dtype` chooses otherwise.

Model arguments (`--model_args key=value,...`): pretrained (required), device (auto | cpu | cuda |
cuda:N; the harness's --device too), lanes (documents side by side; default: --batch_size when it
is a number above 1, else 8 as eval.py), chunk_len (tokens per chunk for scoring; default the
run's, else 512 as eval.py), gen_chunk_len (for generation; default the run's, as eval.py
--prompt), dtype (auto | float32 | bfloat16 | float64), append_eot (default the run's data
recipe), max_gen_toks (256), kv_keep / kv_keep_read (as eval.py's --kv-keep / --kv-keep-read),
seed (of sampled generation, 0).
"""
from __future__ import annotations

import copy
import logging
import math
import sys
from contextlib import nullcontext
from pathlib import Path

import torch
from lm_eval.api.model import TemplateLM
from tqdm import tqdm

from .model import in_eval_mode

NAME = "elephant"
TASKS = Path(__file__).resolve().parent / "lm_eval_tasks"   # the tasks shipped with the package
SUBCOMMANDS = ("run", "ls", "validate")
DTYPES = ("auto", "float32", "bfloat16", "float64")
GEN_KEYS = {"until", "max_gen_toks", "max_new_tokens", "do_sample", "temperature", "top_k", "top_p"}

log = logging.getLogger(__name__)


class AdapterError(ValueError):
    """A bad model argument or generation setting given to the harness; one line."""


class ElephantHarnessLM(TemplateLM):
    """An elephant model as an lm-evaluation-harness LM (see the module docstring)."""

    def __init__(self, pretrained: str | None = None, device: str | None = None,
                 batch_size=None, max_batch_size=None, lanes=None, chunk_len=None,
                 gen_chunk_len=None, dtype: str = "auto", append_eot=None, max_gen_toks=256,
                 kv_keep=None, kv_keep_read=None, seed=0, harness_device=None, **unknown):
        """`device`: the model argument; `harness_device`: the harness's --device (its default
        is cuda:0), used when no model argument names one, and the CPU instead where there is no
        CUDA device (as the harness's own models do). `batch_size` / `max_batch_size`: the
        harness's (--batch_size N > 1 sets the default lanes)."""
        super().__init__()
        if unknown:
            raise AdapterError(f"model_args: unknown {', '.join(sorted(unknown))}; accepted: "
                               f"pretrained, device, lanes, chunk_len, gen_chunk_len, dtype, "
                               f"append_eot, max_gen_toks, kv_keep, kv_keep_read, seed")
        if not pretrained:
            raise AdapterError("model_args: pretrained=... is required (an export folder, run "
                               "dir, checkpoint folder or Hub id)")
        from .config import DataConfig
        from .evaluate import autocast_dtype
        from .generate import training_chunk_len
        from .hub import HubError, from_pretrained

        self._device = _device(device if device not in (None, "") else harness_device,
                               fallback=device in (None, ""))
        if dtype not in DTYPES:
            raise AdapterError(f"model_args: dtype {dtype!r}; accepted: {', '.join(DTYPES)}")
        model, tokenizer, config = from_pretrained(
            str(pretrained), device=self._device, kv_keep=_count(kv_keep, "kv_keep", None),
            kv_keep_read=_count(kv_keep_read, "kv_keep_read", None))
        if tokenizer is None:
            raise HubError(f"{pretrained}: no tokenizer saved with the model, and its config "
                           f"names none")
        if tokenizer.vocab_size > model.cfg.vocab_size:
            raise HubError(f"checkpoint/tokenizer mismatch: the tokenizer has "
                           f"{tokenizer.vocab_size} tokens, the model's vocabulary "
                           f"{model.cfg.vocab_size}")
        if dtype == "float64":
            model = model.double()
        self.model, self.tokenizer, self.config = model, tokenizer, config
        cuda = self._device.type == "cuda"
        half = dtype == "bfloat16" or (dtype == "auto" and cuda)
        self.autocast = ((lambda: torch.autocast(self._device.type, dtype=torch.bfloat16))
                         if half else None)
        self.kv_dtype = autocast_dtype(self.autocast, self._device)
        self._gen_model = None   # the bfloat16 copy generation uses under `half`, made once
        self.half = half
        train = config.get("train") or {}
        self.chunk_len = _count(chunk_len, "chunk_len", None) or train.get("chunk_len", 512)
        self.gen_chunk_len = (_count(gen_chunk_len, "gen_chunk_len", None)
                              or training_chunk_len(config))
        default_lanes = 8
        if isinstance(batch_size, int) or (isinstance(batch_size, str) and batch_size.isdigit()):
            default_lanes = int(batch_size) if int(batch_size) > 1 else default_lanes
        self.lanes = _count(lanes, "lanes", None) or default_lanes
        data = config.get("data") if isinstance(config.get("data"), dict) else {}
        self.append_eot = _flag(append_eot, "append_eot",
                                data.get("append_eot", DataConfig().append_eot))
        if self.append_eot and tokenizer.eot_id is None:
            raise AdapterError(f"{pretrained}: append_eot is on but the tokenizer has no "
                               f"end-of-text token; pass append_eot=False")
        self.max_gen_toks = _count(max_gen_toks, "max_gen_toks", 256)
        self.seed = _count(seed, "seed", 0, minimum=0)
        # eval.py's defaults on this device: a CUDA graph, compaction and the side batch
        self.cuda_graph, self.side = cuda, cuda

    # ------------------------------------------------------------------ the harness's interface
    @classmethod
    def create_from_arg_obj(cls, arg_dict: dict, additional_config: dict | None = None):
        """The harness builds the model from the model arguments and its own settings (batch
        size, device): a `device` model argument wins over the harness's --device."""
        extra = {k: v for k, v in (additional_config or {}).items() if v is not None}
        extra["harness_device"] = extra.pop("device", None)
        return cls(**arg_dict, **extra)

    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: dict | None = None):
        from lm_eval.utils import simple_parse_args_string
        return cls.create_from_arg_obj(simple_parse_args_string(arg_string), additional_config)

    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eot_id

    @property
    def tokenizer_name(self) -> str:
        return f"{NAME}-{self.tokenizer.name}-{self.tokenizer.fingerprint[:16]}"

    def tok_encode(self, string: str, add_special_tokens=None, **kwargs) -> list[int]:
        return self.tokenizer.encode(string)   # the project's tokenizers add no special token

    def tok_decode(self, tokens) -> str:
        return self.tokenizer.decode(tokens)

    def document_tokens(self, text: str) -> list[int]:
        """The tokens eval.py's corpus holds for a document's text: none for a blank text (the
        corpus skips it), else its tokens and, with append_eot, the end-of-text token."""
        ids = self.tok_encode(text) if text.strip() else []
        return ids + [self.eot_token_id] if ids and self.append_eot else ids

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Each request's whole text (`args[0]`), streamed with carried state: its log-likelihood
        (minus the summed NLL of the tokens eval.py scores; 0 for a text with none)."""
        from data_packing import TokenizedCorpus

        from .evaluate import evaluate

        texts = [req.args[0] for req in requests]
        docs = [self.document_tokens(t) for t in texts]
        scored = sum(len(d) >= 2 for d in docs)
        if not scored:
            return [0.0] * len(docs)
        corpus = TokenizedCorpus.from_documents(docs)
        result = evaluate(self.model, corpus, lanes=min(self.lanes, scored), chunk_len=self.chunk_len,
                          device=self._device, autocast=self.autocast, cuda_graph=self.cuda_graph,
                          compact=True, side=self.side,
                          progress=not disable_tqdm and sys.stderr.isatty(),
                          per_document=True)
        out = [-float(nll) for nll in result["document_nll"]]
        for text, ll in zip(texts, out):
            self.cache_hook.add_partial("loglikelihood_rolling", (text,), ll)
        return out

    @torch.no_grad()
    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs):
        """[((context, continuation), context ids, continuation ids)] -> [(sum of the
        continuation's log-probabilities, whether each of its tokens is the argmax)]."""
        out: list[tuple[float, bool] | None] = [None] * len(requests)
        order = sorted(range(len(requests)),
                       key=lambda i: -(len(requests[i][1]) + len(requests[i][2])))
        batches = [order[i:i + self.lanes] for i in range(0, len(order), self.lanes)]
        for batch in tqdm(batches, desc="elephant loglikelihood", disable=disable_tqdm):
            pairs = [(requests[i][1], requests[i][2]) for i in batch]
            scores = _score_continuations(
                self.model, pairs, self.chunk_len, self._device, self.autocast, self.kv_dtype,
                self.tokenizer.vocab_size)
            for i, score in zip(batch, scores):
                out[i] = score
                self.cache_hook.add_partial("loglikelihood", requests[i][0], score)
        return out

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Each request (context, generation settings): the continuation up to the first of its
        `until` strings (or the end-of-text token, or max_gen_toks tokens)."""
        out: list[str | None] = [None] * len(requests)
        groups: dict[str, list[int]] = {}   # requests of the same settings share a batch
        for i, req in enumerate(requests):
            groups.setdefault(repr(sorted((req.args[1] or {}).items())), []).append(i)
        batches = [idx[j:j + self.lanes] for idx in groups.values()
                   for j in range(0, len(idx), self.lanes)]
        for batch in tqdm(batches, desc="elephant generate_until", disable=disable_tqdm):
            settings = self._generation_settings(requests[batch[0]].args[1] or {})
            contexts = [requests[i].args[0] for i in batch]
            texts = self._generate(contexts, **settings)
            for i, text in zip(batch, texts):
                out[i] = text
                self.cache_hook.add_partial("generate_until", requests[i].args, text)
        return out

    # ------------------------------------------------------------------ generation
    def _generation_settings(self, kwargs: dict) -> dict:
        """The harness's generation settings as generate's: until (a list), max_new_tokens,
        temperature (0: greedy, unless do_sample), top_k, top_p."""
        if not isinstance(kwargs, dict):
            raise AdapterError(f"generate_until: generation settings must be a dict, got "
                               f"{type(kwargs).__name__}")
        ignored = sorted(set(kwargs) - GEN_KEYS)
        if ignored:
            log.warning("elephant: generation settings ignored: %s", ", ".join(ignored))
        until = kwargs.get("until") or []
        until = [until] if isinstance(until, str) else list(until)
        if not all(isinstance(u, str) for u in until):
            raise AdapterError(f"generate_until: until must be a string or a list of strings, "
                               f"got {kwargs.get('until')!r}")
        limit = kwargs.get("max_gen_toks", kwargs.get("max_new_tokens", self.max_gen_toks))
        sample = bool(kwargs.get("do_sample", False))   # greedy unless the task samples
        return dict(until=[u for u in until if u], max_new_tokens=_count(limit, "max_gen_toks", 256),
                    temperature=float(kwargs.get("temperature", 1.0)) if sample else 0.0,
                    top_k=_count(kwargs.get("top_k"), "top_k", None, minimum=0),
                    top_p=None if kwargs.get("top_p") is None else float(kwargs["top_p"]))

    def _generate(self, contexts: list[str], until: list[str], **sampling) -> list[str]:
        """Continue every context in one batch of lanes; a lane is done at the end-of-text token
        or once its text holds a stop string, and the batch stops once every lane is done."""
        from .generate import generate

        eot = self.eot_token_id
        prompts = [self.tok_encode(c) or [eot] for c in contexts]
        new: list[list[int]] = [[] for _ in prompts]
        done = [False] * len(prompts)

        def watch(lane: int, token: int) -> None:
            if done[lane]:
                return
            if token == eot:
                done[lane] = True
            else:
                new[lane].append(token)
                # a trailing replacement character may be a character still incomplete: the
                # stop strings are looked for in the text before it
                text = self.tok_decode(new[lane]).rstrip("\ufffd")
                done[lane] = any(u in text for u in until)
            if all(done):
                raise _AllStopped

        try:
            generate(self._generation_model(), prompts, eos_id=eot, chunk_len=self.gen_chunk_len,
                     vocab_size=self.tokenizer.vocab_size, stream=watch, seed=self.seed,
                     **sampling)
        except _AllStopped:
            pass
        return [cut(self.tok_decode(ids), until) for ids in new]

    def _generation_model(self):
        """The model generation runs: itself, or under `half` on a GPU its bfloat16 copy (eval.py
        --prompt's weights)."""
        if not (self.half and self._device.type == "cuda"):
            return self.model
        if self._gen_model is None:
            self._gen_model = copy.deepcopy(self.model).to(torch.bfloat16)
        return self._gen_model


class _AllStopped(Exception):
    """Raised by generate_until's stream callback to end a batch once every lane is done."""


def cut(text: str, until: list[str]) -> str:
    """The text before the first occurrence of any stop string."""
    end = min((i for i in (text.find(u) for u in until if u) if i >= 0), default=len(text))
    return text[:end]


@in_eval_mode
@torch.no_grad()
def _score_continuations(model, pairs, chunk_len: int, device, autocast, kv_dtype,
                         vocab_size: int) -> list[tuple[float, bool]]:
    """(sum of log-probabilities, is greedy) of each (context ids, continuation ids), the pairs
    side by side in lanes: each lane reads context + continuation from a reset, chunk by chunk
    with carried state. Lanes are padded at their end only, which no earlier position reads."""
    B, T = len(pairs), chunk_len
    seqs = [list(c) + list(x) for c, x in pairs]
    first = torch.tensor([len(c) - 1 for c, _ in pairs], device=device)  # first continuation target
    end = torch.tensor([len(s) - 1 for s in seqs], device=device)        # past the last target
    n_chunks = max(1, math.ceil(int(end.max()) / T))
    tokens = torch.zeros(B, n_chunks * T + 1, dtype=torch.long)          # (B, chunks x T + 1)
    for b, s in enumerate(seqs):
        tokens[b, :len(s)] = torch.tensor(s)
    tokens = tokens.to(device)
    logprob = torch.zeros(B, dtype=torch.float64, device=device)
    greedy = torch.ones(B, dtype=torch.bool, device=device)
    state = model.init_state(B, device=device, kv_dtype=kv_dtype)
    reset = torch.ones(B, dtype=torch.bool, device=device)
    for c in range(n_chunks):
        with autocast() if autocast else nullcontext():
            logits, state = model(tokens[:, c * T:(c + 1) * T], state, reset)   # (B, T, V)
        reset = torch.zeros_like(reset)
        target_at = c * T + torch.arange(T, device=device)                    # (T,)
        scored = (target_at >= first[:, None]) & (target_at < end[:, None])   # (B, T)
        if not bool(scored.any()):
            continue                       # a chunk of context only: its state is all it gives
        targets = tokens[:, c * T + 1:(c + 1) * T + 1]                        # (B, T)
        wide = logits.to(torch.promote_types(logits.dtype, torch.float32))   # bf16 -> fp32
        lp = wide.log_softmax(-1).gather(-1, targets[..., None])[..., 0]
        logprob += torch.where(scored, lp.double(), 0.0).sum(1)
        top = logits[..., :vocab_size].argmax(-1)
        greedy &= ((top == targets) | ~scored).all(1)
    return [(float(lp), bool(g)) for lp, g in zip(logprob.tolist(), greedy.tolist())]


# --------------------------------------------------------------------------- model arguments
def _device(spec, fallback: bool = False) -> torch.device:
    """The device named by `spec` (auto or unset: CUDA if there is one); a CUDA device where there
    is none is an error, or with `fallback` (the harness's default) the CPU."""
    if spec in (None, "", "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(str(spec))
    except RuntimeError:
        raise AdapterError(f"device {spec!r}: expected auto, cpu, cuda or cuda:N") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        if fallback:
            log.warning("elephant: no CUDA device here; running on the CPU (device %s asked)", spec)
            return torch.device("cpu")
        raise AdapterError(f"device {spec!r}: this machine has no CUDA device")
    return device


def _count(value, name: str, default, minimum: int = 1):
    """A whole-number model argument (given as an int or a string), or `default` when unset."""
    if value is None or value == "":
        return default
    try:
        n = int(value)
        if n != float(value) or isinstance(value, bool):
            raise ValueError
    except (TypeError, ValueError):
        raise AdapterError(f"{name}={value!r} is not a whole number") from None
    if n < minimum:
        raise AdapterError(f"{name}={value!r}: expected at least {minimum}")
    return n


def _flag(value, name: str, default: bool) -> bool:
    if value is None or value == "":
        return bool(default)
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("true", "1", "yes"):
        return True
    if text in ("false", "0", "no"):
        return False
    raise AdapterError(f"model_args: {name}={value!r}; expected true or false")


# --------------------------------------------------------------------------- registry and CLI
def register() -> None:
    """Register the model `elephant` with the harness: a lazy entry, as the harness lists its own
    (so that the module run as __main__ and the module imported register one class). The
    harness's own models are listed first: its registry lists them only while it is empty."""
    import lm_eval.models  # noqa: F401  (hf, vllm, ...: lazy entries)
    from lm_eval.api.registry import model_registry

    if NAME not in model_registry:
        model_registry.register(NAME, target="elephant.lm_eval:ElephantHarnessLM")


def main(argv: list[str] | None = None) -> int:
    """The harness's CLI with the model `elephant` registered and this package's tasks on the
    include path (before any folder given with --include_path)."""
    from lm_eval._cli import HarnessCLI
    from lm_eval.utils import setup_logging

    from data_packing import DataError

    from .config import ConfigError
    from .generate import GenerationError
    from .hub import HubError

    argv = list(sys.argv[1:] if argv is None else argv)
    register()
    setup_logging()
    cli = HarnessCLI()
    saved = sys.argv
    sys.argv = ["python -m elephant.lm_eval", *argv]   # the harness's parser reads sys.argv
    try:
        args = cli.parse_args()
    finally:
        sys.argv = saved
    if getattr(args, "command", None) in SUBCOMMANDS and hasattr(args, "include_path"):
        given = args.include_path
        args.include_path = [str(TASKS)] + ([given] if isinstance(given, str) else list(given or []))
    try:
        cli.execute(args)
    except (AdapterError, HubError, DataError, ConfigError, GenerationError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
