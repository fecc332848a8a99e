"""Configuration: four dataclasses, TOML recipes, dotted command-line overrides, validation.

A recipe is a TOML file with the tables [model], [optim], [train], [data]; every field has a
default here, so a recipe names only what it changes. Overrides such as `model.d_model=768`
are parsed with the field's own type. Every error is a `ConfigError` whose message names the
key at fault, what was expected and what was given (and the closest valid key for a typo),
so the CLIs can print one line instead of a traceback.
"""
from __future__ import annotations

import dataclasses
import difflib
import re
import tomllib
import typing
from dataclasses import dataclass, field
from pathlib import Path


class ConfigError(ValueError):
    """A bad recipe, key or value; the message is meant for the user as it is."""


def add_kept_arguments(p) -> None:
    """--kv-keep and --kv-keep-read on an argparse parser (eval.py, elephant.recall eval): how a
    loaded model keeps and reads its kept tokens (hub.from_pretrained)."""
    p.add_argument("--kv-keep", type=int, default=None, metavar="K",
                   help="kept tokens per attention layer, in place of the model's own "
                        "(model.kv_keep_infer if set, else the number it trained with): more keep "
                        "what the keep score chose through a longer stream, and each query still "
                        "reads as many as in training (docs/RESULTS.md; a model trained with "
                        "kept tokens only)")
    p.add_argument("--kv-keep-read", type=int, default=None, metavar="R",
                   help="kept tokens each query reads, its best-matching ones (0: all; default: "
                        "as many as in training)")


def parse_count(text: str) -> int:
    """A token count as users write it: '512', '4K', '1M' (K = 1024, M = 1024**2)."""
    m = re.fullmatch(r"\s*(\d+)\s*([kKmM]?)\s*", text)
    if not m:
        raise ConfigError(f"not a token count: {text!r} (expected e.g. 512, 4K, 1M)")
    return int(m.group(1)) * {"": 1, "k": 1024, "m": 1024 ** 2}[m.group(2).lower()]


# Model settings that shape how a model is trained or initialised (or, kv_keep_infer, what it
# keeps once trained), not what its weights compute: a new stage (train.init_from) may change them.
TRAINING_ONLY_MODEL_KEYS = frozenset({"kv_keep_noise", "kv_keep_drop", "kv_keep_cost",
                                      "kv_keep_cost_form", "bptt_chunks", "mem_write_cost",
                                      "mem_gate_init", "init_std", "embed_std", "mamba_out_scale",
                                      "attn_x0_init", "kv_keep_infer"})


def stage_free_keys(model: dict) -> frozenset[str]:
    """The model keys a new stage of a model configured by `model` (a ModelConfig's dict) may
    change: TRAINING_ONLY_MODEL_KEYS, except attn_x0_init under a held gain (attn_x0_gain
    "fixed"), where it is the gain the weights compute with, not where learning starts."""
    if model.get("attn_x0") and model.get("attn_x0_gain") == "fixed":
        return TRAINING_ONLY_MODEL_KEYS - {"attn_x0_init"}
    return TRAINING_ONLY_MODEL_KEYS


@dataclass
class ModelConfig:
    vocab_size: int = 50304
    d_model: int = 512
    n_heads: int = 8                 # attention heads; head size = d_model // n_heads
    layers: str = "MAMMAMMA"         # one letter per layer: M = Mamba-2 mixer, A = attention,
                                     # D = gated delta rule mixer (layers/delta.py: n_heads heads,
                                     # keys of d_model / n_heads, values delta_expand_v times that)
    d_mlp: int = 1536                # hidden size of the GLU MLP that follows every mixer (0: no MLP)
    elephant_a: float = 1.0          # elephant activation f(x) = 1 / (1 + |x / a|^d)
    elephant_d: float = 8.0
    n_mem: int = 0                   # RMT memory tokens read at the start / written at the end of a chunk
    mem_update: str = "gated"        # gated: m' = m + g (norm(w) - m), one gate per slot | replace: m' = w
    mem_gate_min: float = 0.05       # gates below this are exactly 0: memory persists bit for bit
    mem_gate_init: float = -3.0      # initial logit of every memory gate (-3: shut, exactly, under
                                     # mem_gate_min; 0: half open). Shut gates reach much further
                                     # (docs/RESULTS.md, CPU recall study)
    mem_write_cost: float = 0.0      # loss per token per unit of mean gate: write only what pays
    mem_rotary: str = "none"         # rotary position of the memory tokens: none (unrotated, so what a
                                     # token reads of them depends on its absolute position) | chunk
                                     # (read memory at the chunk's first position, write slots at its
                                     # last: a chunk computes the same at any depth of its document;
                                     # on the recall recipe it learned to carry facts worse than none:
                                     # docs/RESULTS.md) | free (every query scores the memory's keys
                                     # without rotary, the write slots read from the chunk's last
                                     # position: position-free, and the memory read is the one
                                     # "none" learns at position 0)
    kv_window: int = 0               # cached keys/values per attention layer carried to the next chunk
    kv_keep: int = 0                 # long-term memory: keys/values of this many tokens per attention
                                     # layer kept past the window, chosen by a learned score and kept
                                     # bit for bit until better-scored tokens displace them (needs
                                     # kv_window > 0)
    kv_keep_read: int = 0            # each query reads at most this many kept tokens, those its own
                                     # scores rank highest (0: all of them). A model trained reading
                                     # K may then keep many more than K (more of a long stream's
                                     # tokens outlast it) and still read K, as it learned to
                                     # (hub.with_kept_capacity sets it so; docs/RESULTS.md)
    kv_keep_infer: int = 0           # kept tokens per attention layer when the model is loaded for
                                     # inference (hub.from_pretrained: eval.py, elephant.recall eval,
                                     # generation), each query still reading kv_keep of them; 0:
                                     # kv_keep. Training never sees it (docs/RESULTS.md)
    kv_keep_noise: float = 1.0       # Gumbel noise on the keep scores while training (exploration)
    kv_keep_drop: float = 0.0        # training only: the chance per lane and chunk that the lane's kept
                                     # tokens are dropped (every layer; later tokens refill the set), as
                                     # when a long stream displaces them, so that the memory must learn
                                     # to carry what they hold (docs/RESULTS.md)
    kv_keep_cost: float = 0.0        # training only (the LM loss): loss per token per unit of the mean
                                     # charge (kv_keep_cost_form; by default the gate, sigmoid(keep
                                     # score)) of the kept tokens a lane carries out of each BPTT window. A kept token no query reads gets no
                                     # gradient from the loss; this one lowers its score, so that
                                     # what is kept is what is read (docs/RESULTS.md)
    kv_keep_cost_form: str = "gate"  # what kv_keep_cost charges per kept slot: "gate", sigmoid(score)
                                     # (its push fades as the score grows, so the best-scored unread
                                     # tokens move least), or "softplus", -log(1 - gate) (its push is
                                     # the gate itself: strongest on the best-scored, the ones a fact
                                     # must outrank over a long stream; a read token settles where
                                     # its read's worth per window b gives gate 1 - cost / b)
    kv_assoc: bool = False           # an associative memory per attention layer: each token leaving
                                     # the window is written, by the delta rule, key (before rotary)
                                     # to value at the strength of its keep gate, sigmoid(keep
                                     # score); the layer's queries read it, gated per head, beside
                                     # the window and the kept tokens (needs kv_keep > 0: the keep
                                     # score learns there; docs/RESULTS.md)
    kv_assoc_writes: int = 0         # > 0: of the tokens leaving the window at a chunk's end, only
                                     # this many a lane are written, those of highest keep score
                                     # (0: all, each at its gate)
    rope_base: float = 10000.0
    rope_max_period: float = 0.0     # > 0: rotary frequency pairs whose period (tokens) is longer are
                                     # not rotated (partial rotary): angles that training documents
                                     # never wrap through are never met, however deep the document
    qk_norm: bool = True             # RMS-normalize queries and keys before rotary
    d_state: int = 64                # Mamba-2 SSM state size N
    mamba_head_dim: int = 64         # Mamba-2 head size P; heads = expand * d_model // P
    expand: int = 2
    d_conv: int = 4                  # causal depthwise conv width
    ssd_chunk: int = 64              # block length of the chunked SSD scan (and of the D layers'
                                     # chunked delta rule)
    delta_expand_v: float = 1.5      # D layers: each head's value size over its key size
                                     # (d_model / n_heads). 1.5 gives a D layer about the
                                     # parameters of a Mamba-2 layer at expand 2 (1.04x at
                                     # d_model 512; 2.0, 1.28x); its state is n_heads x key x value
    tied_embeddings: bool = False
    bptt_chunks: int = 1             # chunks that gradients flow through memory / SSM state
    norm_eps: float = 1e-5
    init_std: float = 0.02
    embed_std: float = 0.0           # init std of the token embedding (0: init_std). A larger one
                                     # keeps each token's identity readable in the residual stream
                                     # beside the Mamba mixers' outputs (RMS 0.08-0.16 at init) and
                                     # makes Adam's steps small beside it: with 0.02 the hybrid did
                                     # not learn to copy under the LM loss (docs/RESULTS.md)
    mamba_out_scale: float = 1.0     # the Mamba (and D) out-projection's init std, times this: its input is
                                     # normalized (RMS 1), so at 1 a mixer adds 4-8x the embedding's
                                     # RMS (0.02) to the residual stream at init
    attn_x0: bool = False            # every attention layer's input is norm1(x) + g * rmsnorm(x0),
                                     # x0 the stack's input (the token embeddings, and the memory
                                     # vectors at memory positions), g a gain from attn_x0_init
                                     # (attn_x0_gain): the token's own identity reaches the
                                     # queries, keys and values at full strength, whatever the
                                     # layers before wrote into the stream. Without it the hybrid
                                     # did not learn to copy under the LM loss among real text
                                     # (docs/RESULTS.md); every recipe turns it on
    attn_x0_init: float = 1.0        # the initial value of attn_x0's gain; the recipes (d_model
                                     # 256 and up) start it at 0.25: copying still learned before
                                     # the all-attention stack's, at a fraction of gain 1's cost in
                                     # LM loss (at d_model 64, 0.25 did not learn to copy)
    attn_x0_gain: str = "channel"    # attn_x0's gain g: "channel" (learned, one per channel),
                                     # "layer" (learned, one per attention layer) or "fixed" (held at
                                     # attn_x0_init; norm1's learned weight still sets the ratio of
                                     # stream to x0). The recipes hold it: a lower LM loss at equal
                                     # time than the learned gain's (docs/RESULTS.md)
    attn_x0_norm: bool = False       # attn_x0's sum normalized again: the attention reads
                                     # norm1(rmsnorm(x) + g * rmsnorm(x0)), RMS ~1 as without x0.
                                     # Measured, not taken: copying learned later than with the
                                     # plain sum (docs/RESULTS.md)
    residual: str = "float32"        # the residual stream's dtype under autocast: float32 (the
                                     # embeddings' dtype) | autocast (autocast's, bf16: the stream
                                     # and its gradient at half the bytes, read and written by every
                                     # norm and residual add; docs/RESULTS.md)

    @property
    def d_inner(self) -> int:
        return self.expand * self.d_model

    @property
    def mamba_heads(self) -> int:
        return self.d_inner // self.mamba_head_dim

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def delta_value_dim(self) -> int:
        """A D layer's value size per head: delta_expand_v x head_dim (validated integral)."""
        return round(self.delta_expand_v * self.head_dim)

    def validate(self) -> None:
        _positive(self, "vocab_size", "d_model", "n_heads", "d_state", "mamba_head_dim", "expand",
                  "d_conv", "ssd_chunk", "bptt_chunks", "elephant_a", "elephant_d", "rope_base",
                  "norm_eps", "init_std")
        _non_negative(self, "embed_std")
        _positive(self, "mamba_out_scale")
        _non_negative(self, "d_mlp", "n_mem", "kv_window", "kv_keep", "kv_keep_read", "kv_keep_noise",
                      "rope_max_period")
        if not 0.0 <= self.kv_keep_drop < 1.0:
            raise ConfigError(f"model.kv_keep_drop: expected a chance in [0, 1), got {self.kv_keep_drop}")
        _non_negative(self, "kv_keep_infer", "kv_assoc_writes")
        if self.kv_keep_infer and not self.kv_keep:
            raise ConfigError("model.kv_keep_infer: the capacity at inference of kept tokens that "
                              "a keep score trained with model.kv_keep > 0 chooses; set kv_keep too")
        if self.kv_keep and not self.kv_window:
            raise ConfigError("model.kv_keep: kept tokens are the ones that left the KV window; "
                              "set model.kv_window > 0 as well")
        if self.kv_assoc and not self.kv_keep:
            raise ConfigError("model.kv_assoc: a token is written to the associative memory at "
                              "the strength of its keep score, which learns with kept tokens; "
                              "set model.kv_keep > 0 as well")
        if self.attn_x0_norm and not self.attn_x0:
            raise ConfigError("model.attn_x0_norm normalizes attn_x0's sum; set model.attn_x0 = "
                              "true as well")
        _choice(self, "attn_x0_gain", ("channel", "layer", "fixed"))
        _choice(self, "mem_update", ("gated", "replace"))
        _choice(self, "kv_keep_cost_form", ("gate", "softplus"))
        _choice(self, "mem_rotary", ("none", "chunk", "free"))
        _choice(self, "residual", ("float32", "autocast"))
        _non_negative(self, "mem_write_cost", "kv_keep_cost")
        if not 0.0 <= self.mem_gate_min < 1.0:
            raise ConfigError(f"model.mem_gate_min: expected a value in [0, 1), got {self.mem_gate_min}")
        if not self.layers or set(self.layers) - {"M", "A", "D"}:
            raise ConfigError(f"model.layers: expected a non-empty string of 'M' (Mamba-2), "
                              f"'A' (attention) and 'D' (gated delta rule), got {self.layers!r}")
        if self.d_model % self.n_heads:
            raise ConfigError(f"model.n_heads: must divide model.d_model={self.d_model}, "
                              f"got {self.n_heads}")
        _positive(self, "delta_expand_v")
        value = self.delta_expand_v * self.head_dim
        if abs(value - round(value)) > 1e-9:
            raise ConfigError(f"model.delta_expand_v: times the head size d_model / n_heads = "
                              f"{self.head_dim} it must give a whole value size, got "
                              f"{self.delta_expand_v} (value size {value:g})")
        if self.head_dim % 2:
            raise ConfigError(f"model.n_heads: d_model / n_heads must be even for rotary "
                              f"positions, got head size {self.head_dim}")
        if self.d_inner % self.mamba_head_dim:
            raise ConfigError(f"model.mamba_head_dim: must divide expand * d_model = "
                              f"{self.d_inner}, got {self.mamba_head_dim}")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "ModelConfig":
        cfg = _build(cls, d, "model")
        cfg.validate()
        return cfg


@dataclass
class OptimConfig:
    # Muon family, for hidden 2-D weights
    muon_lr: float = 0.02
    orthogonalize: str = "polar_express"   # newton_schulz | polar_express | aol (Turbo-Muon)
    ns_steps: int = 5                      # iterations of newton_schulz
    momentum: float = 0.95
    momentum_warmup_from: float = 0.85     # momentum starts here and reaches `momentum` ...
    momentum_warmup_steps: int = 300       # ... after this many steps (0: no warm-up)
    nesterov: bool = True
    normuon: bool = True                   # NorMuon variance normalization
    normuon_beta2: float = 0.95
    muon_wd: float = 0.0                   # cautious weight decay of Muon parameters
    # Adam, for embeddings, head, norms, gains, SSM scalars, conv weights
    adam_lr: float = 0.003                 # norms, gains, scalars, SSM parameters
    embed_lr: float = 0.003
    head_lr: float = 0.003
    adam_betas: tuple[float, float] = (0.9, 0.95)
    adam_eps: float = 1e-8
    adam_wd: float = 0.0
    cautious_wd: bool = True               # decay only where update and weight agree in sign
    wd_schedule: str = "lr"                # lr: follow the lr schedule | constant | linear | cosine
    # schedule shared by all groups (a multiplier on each lr)
    schedule: str = "cosine"               # constant | linear | cosine
    warmup_steps: int = 50
    cooldown_frac: float = 1.0             # fraction of the steps after warm-up spent decaying
    min_lr_frac: float = 0.0
    grad_clip: float = 1.0                 # global norm clip (0: off)

    def validate(self) -> None:
        _choice(self, "orthogonalize", ("newton_schulz", "polar_express", "aol"))
        _choice(self, "schedule", ("constant", "linear", "cosine"))
        _choice(self, "wd_schedule", ("lr", "constant", "linear", "cosine"))
        _positive(self, "muon_lr", "adam_lr", "embed_lr", "head_lr", "adam_eps", "ns_steps")
        _non_negative(self, "muon_wd", "adam_wd", "warmup_steps", "grad_clip",
                      "momentum_warmup_steps", "min_lr_frac")
        for key in ("momentum", "momentum_warmup_from", "normuon_beta2", "cooldown_frac"):
            if not 0.0 <= getattr(self, key) <= 1.0:
                raise ConfigError(f"optim.{key}: expected a value in [0, 1], got {getattr(self, key)}")
        if len(self.adam_betas) != 2 or not all(0.0 <= b < 1.0 for b in self.adam_betas):
            raise ConfigError(f"optim.adam_betas: expected two values in [0, 1), got {self.adam_betas}")


@dataclass
class DataConfig:
    source: str = "pycode"           # pycode | wikitext-103 | wikitext-2 | fineweb | fineweb-edu | text | bin | recall
    path: str = ""                   # local folder or file for the source ("" = the Hub / built-in)
    tokenizer: str = "bytes"         # bytes | a tokenizer.json path or folder | a Hub id
    train_split: str = "train"
    valid_split: str = "valid"
    cache_dir: str = "cache"         # tokenized corpora, one folder per fingerprint
    text_field: str = "text"         # for .jsonl / .parquet text sources
    append_eot: bool = True          # an end-of-document token after every document
    site_packages: bool = False      # pycode: add the environment's site-packages to the stdlib
    # recall (data_packing/recall.py): synthetic facts queried after gaps of filler
    recall_docs: int = 20000         # training documents (valid / test: a tenth, other seeds)
    recall_min_gap: int = 16         # query distances (tokens), log-uniform in [min, max]
    recall_max_gap: int = 16384
    recall_max_pairs: int = 4        # facts per document: 1..max_pairs
    recall_max_queries: int = 4      # queries per document: 1..max_queries
    recall_filler: str = ""          # the text between facts and queries: "" = a synthetic mix of
                                     # words, numbers and passkey lines; "pycode" (with site_packages)
                                     # or the path of a text source: stretches cut from its
                                     # documents of the same split, so that copying the facts is a
                                     # small part of the LM loss, as in real documents
    recall_mix: float = 0.0          # the share of the training text (in characters) made into
                                     # recall documents (data_packing/recall.py: facts stated, then
                                     # asked for after recall_min_gap..recall_max_gap characters,
                                     # recall_max_pairs / _queries a document), spread through the
                                     # corpus, their filler its own training text read in order,
                                     # none of it twice: a language model then learns to keep a stated
                                     # value and copy it when its key recurs past its window.
                                     # Training split only; evaluation reads the corpus alone. 0:
                                     # off (docs/RESULTS.md)
    recall_mix_templates: str = "sentence,label"   # the forms those facts take (recall.TEMPLATES,
                                     # comma-separated; "varied" draws each fact's key style,
                                     # separator and placement); the needle test (eval.py --needle)
                                     # reads "assign", which none of them draws
    length_curriculum_steps: int = 0   # over the first N steps a document may start a lane only
                                       # if it is no longer than a cap that grows geometrically from
                                       # length_curriculum_start tokens to the longest document; a
                                       # longer one waits for a later epoch (data_packing/batcher.py).
                                       # 0: off. Measured: the recall recipe on every byte learned to
                                       # recall past its window in more seeds with it (docs/RESULTS.md)
    length_curriculum_start: int = 1024
    pack: bool = False               # training rows hold documents back to back (exact per-token
                                     # boundaries, no padding); false: one document per row, padded.
                                     # Off by default: it pays with the chunk step as CUDA graphs
                                     # (train.compile=graphs: 1.20x real tokens/s on log-normal
                                     # lengths, H100; window, auto's choice on CUDA: 1.19x), not
                                     # with each block compiled (0.97x when last measured);
                                     # docs/RESULTS.md, issue 11
    pack_eval: bool = False          # the same for the validation pass (faster on short documents;
                                     # with memory on, the numbers differ slightly from unpacked ones)

    def validate(self) -> None:
        _choice(self, "source", ("pycode", "wikitext-103", "wikitext-2", "fineweb", "fineweb-edu",
                                 "text", "bin", "recall"))
        _non_negative(self, "length_curriculum_steps")
        _positive(self, "length_curriculum_start")
        _positive(self, "recall_docs", "recall_min_gap", "recall_max_gap", "recall_max_pairs",
                  "recall_max_queries")
        if self.recall_min_gap > self.recall_max_gap:
            raise ConfigError(f"data.recall_min_gap={self.recall_min_gap} is larger than "
                              f"data.recall_max_gap={self.recall_max_gap}")
        if not 0.0 <= self.recall_mix < 1.0:
            raise ConfigError(f"data.recall_mix: expected a share in [0, 1), got {self.recall_mix}")
        if self.recall_mix and self.source in ("recall", "bin"):
            raise ConfigError(f"data.recall_mix mixes recall documents into a text corpus; source "
                              f"{self.source!r} {'is made of them' if self.source == 'recall' else 'is pre-tokenized'}"
                              f" (set data.recall_mix = 0)")
        from data_packing.recall import TEMPLATES
        names = self.mix_templates()
        bad = [n for n in names if n not in TEMPLATES]
        if bad or not names:
            raise ConfigError(f"data.recall_mix_templates: unknown form {bad[0] if bad else '(none)'!r}; "
                              f"expected comma-separated names of {', '.join(TEMPLATES)}")

    def mix_templates(self) -> tuple[str, ...]:
        """recall_mix_templates as a tuple of names."""
        return tuple(t.strip() for t in self.recall_mix_templates.split(",") if t.strip())

    def source_options(self, split: str | None = None) -> dict:
        """Keyword arguments of data_packing.open_source for this source; for the training split
        (`split` == train_split) with recall_mix, the mix too."""
        options = self._source_options()
        if self.recall_mix and split is not None and split == self.train_split:
            options["recall_mix"] = {
                "share": self.recall_mix, "templates": self.mix_templates(),
                "min_gap": self.recall_min_gap, "max_gap": self.recall_max_gap,
                "max_pairs": self.recall_max_pairs, "max_queries": self.recall_max_queries}
        return options

    def _source_options(self) -> dict:
        if self.source == "pycode":
            return {"site_packages": self.site_packages}
        if self.source == "recall":
            recall = {"docs": self.recall_docs, "min_gap": self.recall_min_gap,
                      "max_gap": self.recall_max_gap, "max_pairs": self.recall_max_pairs,
                      "max_queries": self.recall_max_queries}
            if self.recall_filler:
                recall.update(filler=self.recall_filler, site_packages=self.site_packages)
            return {"recall": recall}
        return {}


# the train.compile settings whose training steps replay CUDA graphs (the trainer marks each
# step and carries the state past it in fixed buffers)
GRAPH_COMPILES = ("graphs", "window")


@dataclass
class TrainConfig:
    run_dir: str = "runs/default"
    lanes: int = 8                   # batch rows per micro-batch; each row walks its own document
    chunk_len: int = 256             # tokens per chunk (T)
    grad_accum: int = 1              # micro-batches (groups of lanes) per optimizer step
    memory_windows: int = 1          # BPTT windows (of model.bptt_chunks) per optimizer step; > 1
                                     # with memory: memory-only backpropagation across them
    max_steps: int = 1000
    init_from: str = ""              # a checkpoint (or run dir) whose weights start this run: a new
                                     # stage (fine-tuning, a curriculum) with a fresh optimizer, data
                                     # stream and step count; its model.* settings must be this run's
    seed: int = 1337
    device: str = "auto"             # auto | cpu | cuda | cuda:N
    dtype: str = "auto"              # auto (bf16 on CUDA, fp32 on CPU) | bf16 | fp32
    compile: str = "auto"            # auto (window on CUDA with one memory window, else on; off
                                     # on the CPU) | on (each block) | model (the whole chunk) |
                                     # graphs (model, replayed as CUDA graphs in training; with one
                                     # process the clipping and optimizer step too) | window (graphs,
                                     # and a BPTT window's chunks as one graph) | off
    log_every: int = 10
    eval_every: int = 250            # 0: only at the end
    eval_docs: int = 0               # documents of the valid split per evaluation (0: all)
    ckpt_every: int = 250            # 0: only at the end
    keep_ckpts: int = 2
    max_bad_steps: int = 5           # consecutive non-finite losses before the run stops
    tensorboard: bool = True         # when tensorboard is installed

    def validate(self) -> None:
        _positive(self, "lanes", "chunk_len", "grad_accum", "memory_windows", "max_steps",
                  "log_every", "keep_ckpts", "max_bad_steps")
        _non_negative(self, "eval_every", "eval_docs", "ckpt_every")
        _choice(self, "dtype", ("auto", "bf16", "fp32"))
        _choice(self, "compile", ("auto", "on", "model", "graphs", "window", "off"))
        if self.compile in GRAPH_COMPILES and self.memory_windows > 1:
            raise ConfigError(f"train.compile = \"{self.compile}\" needs train.memory_windows = 1: "
                              "memory-only backpropagation keeps the memory of earlier windows, "
                              "which the next CUDA-graph replay would overwrite")
        if not (self.device in ("auto", "cpu", "cuda") or self.device.startswith("cuda:")):
            raise ConfigError(f"train.device: expected auto, cpu, cuda or cuda:N, got {self.device!r}")


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)

    def validate(self) -> None:
        for section in SECTIONS:
            getattr(self, section).validate()

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict, where: str = "config") -> "Config":
        unknown = set(d) - set(SECTIONS)
        if unknown:
            key = sorted(unknown)[0]
            raise ConfigError(f"{where}: unknown section [{key}]{_closest(key, SECTIONS)}")
        cfg = cls(**{s: _build(SECTIONS[s], d.get(s, {}), s) for s in SECTIONS})
        cfg.validate()
        return cfg


SECTIONS = {"model": ModelConfig, "optim": OptimConfig, "data": DataConfig, "train": TrainConfig}


def load_config(path: str | Path | None = None, overrides: list[str] = ()) -> Config:
    """Read a TOML recipe (or the defaults when path is None) and apply `section.key=value` overrides."""
    raw: dict = {}
    if path is not None:
        path = Path(path)
        raw = _read_recipe(path)
    for item in overrides:
        _override(raw, item)
    return Config.from_dict(raw, where=str(path) if path else "config")


def apply_overrides(cfg: Config, overrides: list[str], sections: tuple[str, ...] = tuple(SECTIONS)) -> Config:
    """A copy of cfg with `section.key=value` overrides applied and validated; an override of a
    section not in `sections` is an error (eval.py: only [data] applies to a trained model)."""
    raw = cfg.to_dict()
    for item in overrides:
        _override(raw, item, sections)
    return Config.from_dict(raw)


def _override(raw: dict, item: str, sections: tuple[str, ...] = tuple(SECTIONS)) -> None:
    """Set one `section.key=value` override in raw (a dict of sections), parsed by the field's type."""
    key, sep, value = item.partition("=")
    section, dot, name = key.strip().partition(".")
    if not sep or not dot:
        raise ConfigError(f"override {item!r}: expected section.key=value, "
                          f"for example model.d_model=768")
    if section not in SECTIONS:
        raise ConfigError(f"override {item!r}: unknown section {section!r}"
                          f"{_closest(section, SECTIONS)}")
    if section not in sections:
        raise ConfigError(f"override {item!r}: only {', '.join(s + '.*' for s in sections)} "
                          f"overrides apply here")
    fields = {f.name: f for f in dataclasses.fields(SECTIONS[section])}
    if name not in fields:
        raise ConfigError(f"unknown key {section}.{name}{_closest(name, fields, section + '.')}")
    raw.setdefault(section, {})[name] = _parse(value.strip(), _hint(SECTIONS[section], name),
                                               f"{section}.{name}")


def _read_recipe(path: Path, seen: tuple[Path, ...] = ()) -> dict:
    """A TOML recipe as a dict of sections. `base = "other.toml"` (a path relative to the file)
    starts from that recipe: every key the file sets replaces the base's, section by section (a
    second stage that changes a few settings of the first, e.g. configs/recall-stage2.toml)."""
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}"
                          + (f" (the base of {seen[-1]})" if seen else ""))
    try:
        raw = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: not valid TOML: {e}") from None
    base = raw.pop("base", None)
    if base is None:
        return raw
    if not isinstance(base, str):
        raise ConfigError(f"{path}: base must be the path of another recipe, got {base!r}")
    base_path = (path.parent / base).resolve()
    if base_path in seen or base_path == path.resolve():
        raise ConfigError(f"{path}: base {base!r} leads back to itself")
    merged = _read_recipe(base_path, seen + (path.resolve(),))
    for section, values in raw.items():
        if isinstance(values, dict) and isinstance(merged.get(section), dict):
            merged[section] = merged[section] | values
        else:
            merged[section] = values
    return merged


# ---------------------------------------------------------------------------------------------
def _build(cls, d: dict, section: str):
    if not isinstance(d, dict):
        raise ConfigError(f"[{section}]: expected a table, got {type(d).__name__}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in d.items():
        if key not in fields:
            raise ConfigError(f"unknown key {section}.{key}{_closest(key, fields, section + '.')}")
        kwargs[key] = _coerce(value, _hint(cls, key), f"{section}.{key}")
    return cls(**kwargs)


def _hint(cls, name: str):
    return typing.get_type_hints(cls)[name]


def _coerce(value, hint, key: str):
    """Check a TOML value against a field's type; ints are accepted for floats."""
    origin = typing.get_origin(hint)
    if origin is tuple:
        args = typing.get_args(hint)
        if not isinstance(value, (list, tuple)) or len(value) != len(args):
            raise ConfigError(f"{key}: expected a list of {len(args)} numbers, got {value!r}")
        return tuple(_coerce(v, a, key) for v, a in zip(value, args))
    if hint is bool:
        if isinstance(value, bool):
            return value
    elif hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif hint is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    elif hint is str:
        if isinstance(value, str):
            return value
    raise ConfigError(f"{key}: expected {hint.__name__}, got {type(value).__name__} {value!r}")


def _parse(text: str, hint, key: str):
    """Parse a command-line override's value by the field's type."""
    try:
        value = tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        value = text  # a bare word is a string: data.source=pycode
    if hint is str and not isinstance(value, str):
        value = text
    if hint is bool and isinstance(value, str):
        value = _BOOLS.get(value.lower(), value)
    return _coerce(value, hint, key)


_BOOLS = {"true": True, "false": False, "yes": True, "no": False, "on": True, "off": False,
          "1": True, "0": False}


def _closest(name: str, choices, prefix: str = "") -> str:
    match = difflib.get_close_matches(name, list(choices), n=1, cutoff=0.5)
    return f" (did you mean {prefix}{match[0]}?)" if match else ""


def _section(obj) -> str:
    return next(s for s, c in SECTIONS.items() if isinstance(obj, c))


def _positive(obj, *keys: str) -> None:
    for key in keys:
        if not getattr(obj, key) > 0:
            raise ConfigError(f"{_section(obj)}.{key}: expected a value > 0, got {getattr(obj, key)}")


def _non_negative(obj, *keys: str) -> None:
    for key in keys:
        if getattr(obj, key) < 0:
            raise ConfigError(f"{_section(obj)}.{key}: expected a value >= 0, got {getattr(obj, key)}")


def _choice(obj, key: str, allowed: tuple[str, ...]) -> None:
    if getattr(obj, key) not in allowed:
        raise ConfigError(f"{_section(obj)}.{key}: expected one of {', '.join(allowed)}, "
                          f"got {getattr(obj, key)!r}")
