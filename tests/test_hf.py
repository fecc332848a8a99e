"""transformers' Auto classes read elephant exports (elephant/hf.py): AutoModelForCausalLM and
AutoTokenizer load an export folder; the adapter's logits and loss equal elephant's own chunked
reading (eval.py's evaluate) over several chunks; greedy generate() gives elephant.generate's
tokens for prompts inside and across chunk boundaries, with memory and kept tokens on; its cache
does not grow with the generated length; AutoTokenizer's ids and text equal the project
tokenizer's; a folder that is no elephant export is a one-line error."""
import ast
import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

import elephant.hf  # noqa: F401  registers the elephant model type
from data_packing import TokenizedCorpus
from data_packing.tokenizer import ByteTokenizer, load_tokenizer
from elephant import generate
from elephant.config import Config, ModelConfig
from elephant.evaluate import evaluate
from elephant.hf import ElephantCache, ElephantConfig, ElephantForCausalLM
from elephant.hub import HubError, from_pretrained, save_pretrained
from elephant.model import ElephantLM
from test_imports import imports_of, module_files

T = 8               # the export's train.chunk_len: the framing every path below must use
V = 320             # the byte tokenizer's 257 ids, padded
EOT = 256


def tiny_lm(vocab: int = V, **kw) -> ElephantLM:
    """Memory (gates some open, some shut) and kept tokens past a window shorter than a chunk."""
    base = dict(vocab_size=vocab, d_model=32, n_heads=2, layers="MA", d_mlp=48, d_state=8,
                mamba_head_dim=16, expand=2, ssd_chunk=8, n_mem=2, kv_window=6, kv_keep=3)
    base.update(kw)
    torch.manual_seed(0)
    model = ElephantLM(ModelConfig(**base)).eval()
    with torch.no_grad():
        model.mem_gate_bias.copy_(torch.tensor([-4.0, 2.0]))
        model.mem_gate.normal_(std=0.3)
    return model


def export(lm: ElephantLM, folder: Path, tokenizer) -> Path:
    cfg = Config(model=lm.cfg)
    cfg.data.tokenizer = "bytes"
    cfg.train.chunk_len = T
    return save_pretrained(lm, folder, tokenizer=tokenizer, train_config=cfg.to_dict())


@pytest.fixture(scope="module")
def byte_export(tmp_path_factory):
    return export(tiny_lm(), tmp_path_factory.mktemp("hf") / "tiny-elephant", ByteTokenizer())


@pytest.fixture(scope="module")
def loaded(byte_export):
    """(the Auto classes' model, elephant's own model, elephant's config) of the byte export."""
    lm, _, config = from_pretrained(byte_export)
    return AutoModelForCausalLM.from_pretrained(byte_export), lm, config


def chunked_logits(lm, ids: torch.Tensor) -> torch.Tensor:
    """elephant's own reading: chunk by chunk with carried state."""
    state, out = None, []
    with torch.no_grad():
        for c in range(0, ids.shape[1], T):
            logits, state = lm(ids[:, c:c + T], state)
            out.append(logits)
    return torch.cat(out, dim=1)


def _one_line(e: pytest.ExceptionInfo) -> str:
    text = str(e.value)
    assert text and "\n" not in text
    return text


# ------------------------------------------------------------------ loading
def test_auto_classes_load_the_export_with_elephants_weights_and_tokenizer(byte_export, loaded):
    model, lm, config = loaded
    written = json.loads((byte_export / "config.json").read_text())
    assert written["model_type"] == "elephant" and written["architectures"] == ["ElephantForCausalLM"]
    assert isinstance(AutoConfig.from_pretrained(byte_export), ElephantConfig)
    assert type(model) is ElephantForCausalLM and not model.training
    assert model.config.model == config["model"] and model.config.chunk_len == T
    mine, theirs = model.model.state_dict(), lm.state_dict()
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)
    tokenizer = AutoTokenizer.from_pretrained(byte_export)
    assert (tokenizer.eos_token_id, len(tokenizer)) == (EOT, 257)
    gen = model.generation_config
    assert (gen.eos_token_id, gen.pad_token_id, gen.suppress_tokens) == (EOT, EOT, list(range(257, V)))


def test_an_export_made_before_the_adapter_still_loads(byte_export, tmp_path):
    old = tmp_path / "old"
    old.mkdir()
    config = json.loads((byte_export / "config.json").read_text())
    del config["model_type"], config["architectures"]
    (old / "config.json").write_text(json.dumps(config))
    for name in ("model.safetensors", "bytes_tokenizer.json"):
        (old / name).write_bytes((byte_export / name).read_bytes())
    lm, tokenizer, _ = from_pretrained(old)
    model = ElephantForCausalLM.from_pretrained(old)
    ids = torch.randint(0, 257, (1, 2 * T + 3))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, chunked_logits(lm, ids))
    assert tokenizer.name == "bytes" and model.generation_config.eos_token_id == EOT


def test_save_pretrained_writes_an_export_beside_other_files(loaded, tmp_path):
    model, lm, _ = loaded
    out = tmp_path / "saved"
    out.mkdir()
    (out / "trainer_state.json").write_text("{}")
    model.save_pretrained(out)
    assert (out / "trainer_state.json").read_text() == "{}"
    again = AutoModelForCausalLM.from_pretrained(out)
    ids = torch.randint(0, 257, (1, T + 2))
    with torch.no_grad():
        assert torch.equal(again(ids).logits, model(ids).logits)
    assert from_pretrained(out)[2]["train"]["chunk_len"] == T


# ------------------------------------------------------------------ forward
def test_logits_and_loss_equal_elephants_own_reading_over_several_chunks(loaded):
    model, lm, _ = loaded
    n = 3 * T + 5
    torch.manual_seed(1)
    ids = torch.randint(0, 257, (2, n))
    out = model(ids, labels=ids)
    assert torch.equal(out.logits.detach(), chunked_logits(lm, ids))
    # eval.py's streaming evaluation of the same two documents: the same mean loss per token
    corpus = TokenizedCorpus.from_documents([row.numpy() for row in ids])
    corpus.doc_bytes, corpus.doc_words = np.array([n, n]), np.array([1, 1])
    want = evaluate(lm, corpus, lanes=2, chunk_len=T, device="cpu")
    assert want["tokens"] == 2 * (n - 1)
    assert out.loss.item() == pytest.approx(want["nll_sum"] / want["tokens"], rel=1e-5)
    ignored = ids.clone()
    ignored[:, 1:T] = -100           # labels -100 are not predicted
    part = model(ids, labels=ignored).loss
    per_token = torch.nn.functional.cross_entropy(out.logits[:, T - 1:-1].flatten(0, 1),
                                                  ids[:, T:].flatten())
    assert part.item() == pytest.approx(per_token.item(), rel=1e-5)


def test_a_left_padded_row_reads_as_if_alone(loaded):
    model, lm, _ = loaded
    torch.manual_seed(2)
    long, short = torch.randint(0, 257, (2 * T + 3,)), torch.randint(0, 257, (T + 1,))
    pad = len(long) - len(short)
    ids = torch.stack([long, torch.cat([torch.full((pad,), EOT), short])])
    mask = torch.ones_like(ids)
    mask[1, :pad] = 0
    out = model(ids, attention_mask=mask, labels=ids)
    assert torch.equal(out.logits[1, pad:].detach(), chunked_logits(lm, short[None])[0])
    nll = [torch.nn.functional.cross_entropy(chunked_logits(lm, x[None])[0, :-1], x[1:],
                                             reduction="sum") for x in (long, short)]
    assert out.loss.item() == pytest.approx(sum(nll).item() / (len(long) + len(short) - 2), rel=1e-5)


# ------------------------------------------------------------------ generate
@pytest.mark.parametrize("length", [1, T, T + 1, 2 * T + 5])
def test_greedy_generate_equals_elephant_generate(loaded, length):
    model, lm, config = loaded
    torch.manual_seed(length)
    prompt = torch.randint(0, 256, (length,))
    new = model.generate(prompt[None], max_new_tokens=2 * T - 3, do_sample=False)[0, length:]
    want = generate(lm, prompt.tolist(), max_new_tokens=2 * T - 3, temperature=0, eos_id=EOT,
                    vocab_size=257, config=config)
    assert new.tolist() == want


@pytest.mark.gpu
def test_greedy_generate_on_cuda_equals_elephant_generate(byte_export):
    # on CUDA both replay the token step as a CUDA graph (Decoder(cuda_graph=True))
    model = AutoModelForCausalLM.from_pretrained(byte_export, device_map="cuda")
    lm, _, config = from_pretrained(byte_export, device="cuda")
    for length in (T - 1, 2 * T + 5):
        prompt = torch.randint(0, 256, (length,))
        new = model.generate(prompt[None].cuda(), max_new_tokens=3 * T, do_sample=False)[0, length:]
        want = generate(lm, prompt.tolist(), max_new_tokens=3 * T, temperature=0, eos_id=EOT,
                        vocab_size=257, config=config)
        assert new.tolist() == want


def test_a_left_padded_batch_generates_each_prompt_as_if_alone(loaded):
    model, lm, config = loaded
    torch.manual_seed(3)
    prompts = [torch.randint(0, 256, (n,)).tolist() for n in (T + 3, 4)]
    L = max(map(len, prompts))
    ids = torch.tensor([[EOT] * (L - len(p)) + p for p in prompts])
    mask = (torch.arange(L) >= torch.tensor([L - len(p) for p in prompts])[:, None]).long()
    out = model.generate(ids, attention_mask=mask, max_new_tokens=T + 2, do_sample=False)
    for row, prompt in zip(out[:, L:].tolist(), prompts):
        want = generate(lm, prompt, max_new_tokens=T + 2, temperature=0, eos_id=EOT,
                        vocab_size=257, config=config)
        assert row[:len(want)] == want and all(t == EOT for t in row[len(want):])


def test_the_cache_is_the_recurrent_state_and_does_not_grow(loaded):
    model, _, _ = loaded
    prompt = torch.randint(0, 256, (1, T + 2))
    sizes = []
    for new in (1, 3 * T):
        cache = ElephantCache()
        out = model.generate(prompt, cache=cache, max_new_tokens=new, do_sample=False,
                             suppress_tokens=list(range(EOT, V)))       # no eos: all `new` tokens
        assert out.shape[1] == prompt.shape[1] + new
        assert cache.get_seq_length() == prompt.shape[1] + new - 1      # the last one is not read
        sizes.append([(tuple(t.shape), t.dtype) for t in cache.tensors()])
    assert sizes[0] == sizes[1] and sum(np.prod(s) for s, _ in sizes[0]) > 0


def test_generation_continues_from_the_cache_it_returned(loaded):
    model, _, _ = loaded
    prompt = torch.randint(0, 256, (1, T - 2))
    kw = dict(do_sample=False, suppress_tokens=list(range(EOT, V)))
    first = model.generate(prompt, max_new_tokens=5, return_dict_in_generate=True, **kw)
    assert isinstance(first.cache, ElephantCache)
    more = model.generate(first.sequences, cache=first.cache, max_new_tokens=T, **kw)
    assert torch.equal(more, model.generate(prompt, max_new_tokens=5 + T, **kw))


def test_beam_reordering_moves_a_lanes_whole_state(loaded):
    model, _, _ = loaded
    torch.manual_seed(4)
    a, b = torch.randint(0, 256, (2, T + 3))
    ab, reordered, bb = (model(torch.stack(p), use_cache=True).cache for p in ((a, b), (a, b), (b, b)))
    reordered.reorder_cache(torch.tensor([1, 1]))
    nxt = torch.randint(0, 256, (1, T)).expand(2, -1)   # across a chunk boundary
    got, want = model(nxt, cache=reordered).logits, model(nxt, cache=bb).logits
    assert torch.allclose(got, want, atol=1e-5)         # rows of a batch round alike to 1e-7
    assert not torch.allclose(model(nxt, cache=ab).logits[0], want[0], atol=1e-2)


# ------------------------------------------------------------------ tokenizers
def _texts(n: int = 200) -> list[str]:
    rng = random.Random(0)
    pool = list("abc XYZ\n\t.,'!") + ["é", "ß", "日本", "🐘", "<|endoftext|>", "  ", "\r\n", "\x00"]
    return [""] + ["".join(rng.choice(pool) for _ in range(rng.randrange(1, 30))) for _ in range(n)]


def test_auto_tokenizer_of_the_byte_export_gives_byte_tokenizer_ids_and_text(byte_export):
    mine, theirs = AutoTokenizer.from_pretrained(byte_export), ByteTokenizer()
    for text in _texts():
        ids = mine(text)["input_ids"]
        assert ids == theirs.encode(text) and mine.decode(ids) == text
    rng = random.Random(1)                      # any ids: invalid UTF-8, end-of-text, padded ids
    for _ in range(300):
        ids = [rng.randrange(V) for _ in range(rng.randrange(12))]
        assert mine.decode(ids) == mine.decode(ids, skip_special_tokens=True) == theirs.decode(ids)


@pytest.mark.parametrize("name", ["gpt2", "gpt-neox-20b"])
def test_an_export_with_a_hub_tokenizer_loads_with_the_auto_classes(shared_data, tmp_path, name):
    theirs = load_tokenizer(shared_data / "tokenizers" / name)
    vocab = -(-theirs.vocab_size // 64) * 64
    lm = tiny_lm(vocab=vocab, d_model=16, n_heads=1, mamba_head_dim=8, tied_embeddings=True)
    folder = export(lm, tmp_path / name, theirs)
    model = AutoModelForCausalLM.from_pretrained(folder)
    mine = AutoTokenizer.from_pretrained(folder)
    assert mine.eos_token_id == theirs.eot_id == model.generation_config.eos_token_id
    assert model.generation_config.suppress_tokens == list(range(theirs.vocab_size, vocab))
    for text in _texts(50):
        ids = mine(text)["input_ids"]
        assert ids == theirs.encode(text) and mine.decode(ids) == theirs.decode(ids)
    ids = torch.tensor([theirs.encode("The elephant never forgets.")])
    assert torch.equal(model(ids).logits, chunked_logits(lm, ids))


# ------------------------------------------------------------------ errors and imports
def test_a_folder_that_is_no_elephant_export_is_a_one_line_error(tmp_path):
    with pytest.raises(HubError) as e:
        ElephantForCausalLM.from_pretrained(tmp_path / "missing")
    assert "no such folder" in _one_line(e)
    llama = tmp_path / "llama"
    llama.mkdir()
    (llama / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 64}))
    with pytest.raises(HubError) as e:
        ElephantForCausalLM.from_pretrained(llama)
    assert "not an elephant export (its model_type is 'llama')" in _one_line(e)
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text(json.dumps({"format": "elephant", "model_type": "elephant",
                                                    "model": {"d_modle": 32}}))
    with pytest.raises(ValueError) as e:
        AutoModelForCausalLM.from_pretrained(broken)
    assert "d_modle" in _one_line(e)


def test_unsupported_loading_options_are_refused_in_one_line(byte_export):
    with pytest.raises(TypeError) as e:
        ElephantForCausalLM.from_pretrained(byte_export, load_in_8bit=True)
    assert "load_in_8bit" in _one_line(e)
    with pytest.raises(ValueError) as e:
        ElephantForCausalLM.from_pretrained(byte_export, device_map={"model.blocks.0": 0})
    assert "not split over devices" in _one_line(e)


def test_elephant_and_its_hub_module_do_not_import_transformers():
    # every module `import elephant` / `import elephant.hub` / `from elephant import generate`
    # can reach, lazy imports included (tests/test_imports.py's graph; data_packing's submodules
    # all, as it imports them by name)
    files = module_files()
    todo = ["elephant", "elephant.hub", "elephant.generate"] + [m for m in files
                                                                 if m.startswith("data_packing")]
    reached = set()
    while todo:
        name = todo.pop()
        if name not in reached:
            reached.add(name)
            parts = name.split(".")
            todo += [".".join(parts[:i]) for i in range(1, len(parts))]
            todo += imports_of(name, files[name], set(files))
    assert {"elephant.hub", "elephant.generate", "elephant.model"} <= reached
    assert "elephant.hf" not in reached
    for name in reached:
        for node in ast.walk(ast.parse(files[name].read_text())):
            roots = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module] if isinstance(node, ast.ImportFrom) and not node.level else [])
            assert "transformers" not in {r.split(".")[0] for r in roots}, name
