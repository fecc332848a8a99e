"""Export folders, loading them back, and pushing to a (fake, local) Hugging Face Hub."""
import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from elephant import hub
from elephant.config import Config, ModelConfig
from elephant.hub import HubError, export_run, from_pretrained, push_to_hub, save_pretrained
from hubserver import FAKE_TOKEN, IGNORED

TOKEN = FAKE_TOKEN
# an export with the byte tokenizer: elephant's files, and transformers' (tokenizer.json,
# tokenizer_config.json, generation_config.json; elephant/hf.py reads them)
EXPORT_FILES = ["README.md", "bytes_tokenizer.json", "config.json", "generation_config.json",
                "model.safetensors", "tokenizer.json", "tokenizer_config.json"]


def tiny_config(**kw) -> ModelConfig:
    base = dict(vocab_size=257, d_model=32, n_heads=2, layers="MA", d_mlp=64, d_state=8,
                mamba_head_dim=16, expand=2, ssd_chunk=8, n_mem=2, kv_window=16)
    base.update(kw)
    return ModelConfig(**base)


def tiny_model(**kw):
    from elephant.model import ElephantLM
    torch.manual_seed(0)
    return ElephantLM(tiny_config(**kw)).eval()


def byte_tokenizer():
    from data_packing.tokenizer import ByteTokenizer
    return ByteTokenizer()


def recipe(model_cfg: ModelConfig) -> dict:
    cfg = Config(model=model_cfg)
    cfg.data.tokenizer = "bytes"
    return cfg.to_dict()


@pytest.fixture
def export(tmp_path):
    model = tiny_model()
    out = save_pretrained(model, tmp_path / "tiny-elephant", tokenizer=byte_tokenizer(),
                          train_config=recipe(model.cfg),
                          metrics={"wikitext-103 valid": {"bits_per_byte": 1.2345, "word_perplexity": 99.5}})
    return model, out


def _one_line(e: pytest.ExceptionInfo) -> str:
    text = str(e.value)
    assert text and "\n" not in text
    return text


# ------------------------------------------------------------------ save / load
def test_save_then_load_gives_identical_logits_over_carried_chunks(export):
    model, out = export
    assert sorted(p.name for p in out.iterdir()) == EXPORT_FILES
    loaded, tokenizer, config = from_pretrained(out)
    assert config["model"] == model.cfg.to_dict() and config["data"]["tokenizer"] == "bytes"
    assert tokenizer.encode("hé") == [104, 195, 169]
    tokens = torch.randint(0, 257, (2, 24))
    with torch.no_grad():
        a1, sa = model(tokens[:, :12])
        b1, sb = loaded(tokens[:, :12])
        a2, _ = model(tokens[:, 12:], sa)
        b2, _ = loaded(tokens[:, 12:], sb)
    assert torch.equal(a1, b1) and torch.equal(a2, b2)


def test_tied_weights_are_stored_once_and_tied_after_loading(tmp_path):
    model = tiny_model(tied_embeddings=True)
    out = save_pretrained(model, tmp_path / "tied")
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        keys = set(f.keys())
    assert ("embed.weight" in keys) != ("lm_head.weight" in keys)
    loaded, tokenizer, _ = from_pretrained(out)
    assert tokenizer is None
    assert loaded.lm_head.weight.data_ptr() == loaded.embed.weight.data_ptr()
    x = torch.randint(0, 257, (1, 9))
    with torch.no_grad():
        assert torch.equal(model(x)[0], loaded(x)[0])


def test_attention_gains_of_the_stack_input_round_trip(tmp_path):
    model = tiny_model(attn_x0=True)
    with torch.no_grad():
        for block in model.blocks:
            if block.x0_gain is not None:
                block.x0_gain.uniform_(0.2, 2.0)
    loaded, _, config = from_pretrained(save_pretrained(model, tmp_path / "x0"))
    assert config["model"]["attn_x0"] is True
    assert "(attn_x0) | True |" in (tmp_path / "x0" / "README.md").read_text()
    x = torch.randint(0, 257, (1, 9))
    with torch.no_grad():
        assert torch.equal(model(x)[0], loaded(x)[0])


def test_model_card_describes_architecture_data_and_metrics(export):
    model, out = export
    card = (out / "README.md").read_text()
    assert card.startswith("---\nlibrary_name: elephant\n")
    for text in ("`MA`", "1 Mamba-2, 1 attention", "| d_model | 32 |", "| memory tokens (RMT) | 2 |",
                 "| KV window", f"{model.num_params():,}", "| data.tokenizer | bytes |",
                 "| wikitext-103 valid | bits_per_byte | 1.2345 |", "99.5000",
                 "from elephant.hub import from_pretrained"):
        assert text in card, text
    config = json.loads((out / "config.json").read_text())
    assert set(config) == {"format", "model_type", "architectures", "elephant_version", "model",
                           "data", "optim", "train", "metrics"}


def test_save_replaces_an_export_atomically_but_never_another_folder(export, tmp_path):
    model, out = export
    save_pretrained(model, out)                       # replace: same folder, no leftovers
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny-elephant"]
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "config.json", "model.safetensors"]
    precious = tmp_path / "run"
    precious.mkdir()
    (precious / "notes.txt").write_text("keep me")
    with pytest.raises(HubError) as e:
        save_pretrained(model, precious)
    assert "not an elephant export" in _one_line(e)
    assert (precious / "notes.txt").read_text() == "keep me"


# ------------------------------------------------------------------ bad input
def test_missing_folder_is_a_one_line_error(tmp_path):
    with pytest.raises(HubError) as e:
        from_pretrained(tmp_path / "nope")
    assert "no such folder" in _one_line(e)


def test_empty_folder_is_neither_export_nor_checkpoint(tmp_path):
    with pytest.raises(HubError) as e:
        from_pretrained(tmp_path)
    assert "config.json missing" in _one_line(e)


def test_unknown_key_in_config_json(export):
    _, out = export
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps(dict(config, modle={})))
    with pytest.raises(HubError) as e:
        from_pretrained(out)
    assert "unknown key 'modle'" in _one_line(e) and "did you mean model" in str(e.value)
    config["model"]["d_modle"] = 32
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(HubError) as e:
        from_pretrained(out)
    assert "model.d_modle" in _one_line(e) and "config.json" in str(e.value)


def test_config_json_that_is_not_json(export):
    _, out = export
    (out / "config.json").write_text("{not json")
    with pytest.raises(HubError) as e:
        from_pretrained(out)
    assert "not valid JSON" in _one_line(e)


def test_weights_that_do_not_match_the_config(export):
    _, out = export
    config = json.loads((out / "config.json").read_text())
    config["model"]["d_mlp"] = 96
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(HubError) as e:
        from_pretrained(out)
    assert "does not match the config" in _one_line(e) and "shape" in str(e.value)
    config["model"]["d_mlp"] = 64
    config["model"]["layers"] = "MAA"
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(HubError) as e:
        from_pretrained(out)
    assert "tensors missing" in _one_line(e)


def test_truncated_or_missing_weights(export):
    _, out = export
    data = (out / "model.safetensors").read_bytes()
    (out / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(HubError) as e:
        from_pretrained(out)
    assert "model.safetensors" in _one_line(e)
    (out / "model.safetensors").unlink()
    with pytest.raises(HubError) as e:
        from_pretrained(out)
    assert "missing" in _one_line(e)


def test_hub_id_that_cannot_be_downloaded(monkeypatch):
    import huggingface_hub.constants
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(HubError) as e:
        from_pretrained("nobody-here/no-such-elephant")
    assert "downloading it from the Hub failed" in _one_line(e)


# ------------------------------------------------------------------ runs and checkpoints
def _run_dir(tmp_path: Path, model) -> Path:
    from elephant.checkpoint import save_checkpoint
    run = tmp_path / "runs" / "tiny"
    save_checkpoint(run, 7, model, {"opt": {"m": torch.zeros(3)}}, {"config": recipe(model.cfg)})
    return run


def test_export_run_and_loading_a_run_dir(tmp_path):
    model = tiny_model()
    run = _run_dir(tmp_path, model)
    x = torch.randint(0, 257, (1, 10))
    with torch.no_grad():
        want = model(x)[0]
        for source in (run, run / "checkpoints" / "step_0000007"):
            got, tok, _ = from_pretrained(source)
            assert torch.equal(got(x)[0], want) and tok.vocab_size == 257
        out = export_run(run, tmp_path / "export")
        got, tok, config = from_pretrained(out)
    assert torch.equal(got(x)[0], want) and config["train"]["chunk_len"] == Config().train.chunk_len
    assert (out / "bytes_tokenizer.json").is_file()
    with pytest.raises(HubError) as e:
        export_run(run, tmp_path / "x", step=8)
    assert "step_0000008" in _one_line(e)


# ------------------------------------------------------------------ push
def _hand_made_export(folder: Path) -> dict[str, bytes]:
    """An export folder that needs no model code: a valid config.json and arbitrary tensors."""
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"format": "elephant", "model": tiny_config().to_dict()}))
    save_file({"w": torch.randn(4, 8)}, str(folder / "model.safetensors"))
    (folder / "README.md").write_text("---\nlibrary_name: elephant\n---\n# tiny\n")
    (folder / "tokenizer.json").write_bytes(b'{"version": "1.0"}\n')
    (folder / "plots").mkdir()
    (folder / "plots" / "loss_by_position.png").write_bytes(bytes(range(256)) * 3)
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def _assert_no_token(capsys, caplog):
    out, err = capsys.readouterr()
    assert TOKEN not in out + err + caplog.text


def test_push_uploads_exactly_the_folder_files(fake_hub, tmp_path, capsys, caplog):
    files = _hand_made_export(tmp_path / "export")
    url = push_to_hub(tmp_path / "export", "alice/tiny-elephant")
    repo = fake_hub.repos["alice/tiny-elephant"]
    assert repo["files"] == files and not repo["private"]
    assert url.startswith(f"{fake_hub.url}/alice/tiny-elephant/commit/")
    assert fake_hub.unhandled == []
    auth = {r["path"]: {k.lower(): v for k, v in r["headers"].items()}.get("authorization")
            for r in fake_hub.requests}
    assert all(a == f"Bearer {TOKEN}" for path, a in auth.items() if path not in IGNORED)
    # a second push to the existing repo (create_repo answers 409, exist_ok) replaces the files
    (tmp_path / "export" / "README.md").write_text("---\nlibrary_name: elephant\n---\n# v2\n")
    push_to_hub(tmp_path / "export", "alice/tiny-elephant", commit_message="v2")
    assert repo["files"]["README.md"].endswith(b"# v2\n")
    _assert_no_token(capsys, caplog)


def test_push_refuses_a_folder_that_is_not_an_export(fake_hub, tmp_path):
    with pytest.raises(HubError) as e:
        push_to_hub(tmp_path, "alice/x")
    assert "not an export folder" in _one_line(e)
    files = _hand_made_export(tmp_path / "export")
    assert files
    with pytest.raises(HubError) as e:
        push_to_hub(tmp_path / "export", "not a repo id")
    assert "user/name" in _one_line(e)
    assert fake_hub.requests == []


def test_push_failure_is_one_line_without_the_token(fake_hub, tmp_path, capsys, caplog, monkeypatch):
    _hand_made_export(tmp_path / "export")
    monkeypatch.setenv("HF_ENDPOINT", fake_hub.url + "/broken")     # every call answers 404
    with pytest.raises(HubError) as e:
        push_to_hub(tmp_path / "export", "alice/x", token=TOKEN)
    assert "push to alice/x failed" in _one_line(e) and TOKEN not in str(e.value)
    _assert_no_token(capsys, caplog)


def test_cli_push_of_a_run_dir_exports_first(fake_hub, tmp_path, capsys, caplog):
    model = tiny_model()
    run = _run_dir(tmp_path, model)
    assert hub.main(["push", str(run), "alice/run", "--private"]) == 0
    repo = fake_hub.repos["alice/run"]
    assert repo["private"]
    assert sorted(repo["files"]) == EXPORT_FILES
    assert json.loads(repo["files"]["config.json"])["model"] == model.cfg.to_dict()
    assert b'from_pretrained("alice/run")' in repo["files"]["README.md"]
    out, err = capsys.readouterr()
    assert "pushed to" in out and TOKEN not in out + err + caplog.text


def test_cli_reports_errors_in_one_line(tmp_path, capsys):
    assert hub.main(["push", str(tmp_path / "missing"), "alice/x"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1


def test_loading_skips_the_random_initialisation(export, monkeypatch):
    # every tensor comes from the file, so none is filled at random first (1.8 s of a 62M
    # model's 2.0 s load on a CPU); the fills are torch.nn.init's again afterwards
    model, out = export
    fills = []
    for name in ("normal_", "uniform_"):
        real = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name, lambda self, *a, _real=real, **k:
                            (fills.append(self.numel()), _real(self, *a, **k))[1])
    init = {name: getattr(torch.nn.init, name) for name in hub._INIT_FILLS}
    loaded, _, _ = from_pretrained(out)
    assert sum(fills) < 100   # (Mamba's few per-head values are drawn as before)
    assert {name: getattr(torch.nn.init, name) for name in hub._INIT_FILLS} == init
    x = torch.randint(0, 257, (1, 9))
    with torch.no_grad():
        assert torch.equal(model(x)[0], loaded(x)[0])
    tied, _, _ = from_pretrained(save_pretrained(tiny_model(tied_embeddings=True), out.parent / "t"))
    assert tied.lm_head.weight is tied.embed.weight
    fills.clear()
    tiny_model()   # a model built otherwise is filled
    assert sum(fills) > 1000
