"""Generation with carried state (elephant.generate): the token-by-token step path equals the chunked
forward (memory read at each chunk's start, write slots every chunk_len tokens, the KV window, Mamba
conv/SSM state, resets), the prompt path equals the steps, greedy is deterministic and seeded
sampling reproduces, bad input gets a one-line error, and eval.py --prompt streams the text."""
import pytest
import torch

import eval as eval_cli
from data_packing.tokenizer import ByteTokenizer
from elephant import generate
from elephant.config import ModelConfig
from elephant.generate import Decoder, GenerationError, TextStream, sample
from elephant.hub import save_pretrained
from elephant.model import ElephantLM

V = 61


def make(dtype=torch.float64, seed=0, **kw) -> ElephantLM:
    base = dict(vocab_size=V, d_model=32, n_heads=4, layers="MAMA", d_mlp=48, d_state=16,
                mamba_head_dim=16, expand=2, d_conv=4, ssd_chunk=8, n_mem=0, kv_window=0)
    base.update(kw)
    torch.manual_seed(seed)
    model = ElephantLM(ModelConfig(**base)).to(dtype).eval()
    if base["n_mem"] and base.get("mem_update", "gated") == "gated":
        with torch.no_grad():  # open some gates and close others, so both paths are exercised
            model.mem_gate_bias.copy_(torch.linspace(-4, 2, base["n_mem"]))
            model.mem_gate.normal_(std=0.3)
    if base.get("attn_x0"):
        with torch.no_grad():  # gains other than their initial 1, so that each one must be read
            for block in model.blocks:
                if block.x0_gain is not None:
                    block.x0_gain.uniform_(0.2, 2.0)
    return model


def forward_chunks(model, tokens, T, reset_at=None):
    """Logits of the chunked forward; lane 1 starts a new document at chunk `reset_at`."""
    state, outs = None, []
    for c in range(0, tokens.shape[1], T):
        reset = None
        if reset_at is not None and c // T == reset_at:
            reset = torch.tensor([False, True])
        logits, state = model(tokens[:, c:c + T], state, reset)
        outs.append(logits)
    return torch.cat(outs, dim=1)


def decode_tokens(dec, tokens, T, reset_at):
    """Logits of the Decoder's token steps over `tokens`; lane 1 starts a new document where
    chunk `reset_at` of forward_chunks starts."""
    got = []
    for t in range(tokens.shape[1]):
        if t == reset_at * T:
            dec.reset([False, True])
        got.append(dec.step(tokens[:, t]))
    return torch.stack(got, dim=1)


CASES = [("MAMA", 0, 0, 0), ("MAMA", 2, 8, 0), ("MAMA", 3, 3, 0), ("AA", 2, 0, 0), ("AA", 0, 6, 0),
         ("MM", 2, 0, 0), ("AMMA", 1, 12, 0),
         ("MAMA", 2, 5, 3), ("AA", 0, 4, 6),     # kept tokens past the window (kv_keep)
         ("MDAD", 2, 5, 0), ("DD", 0, 0, 0)]     # gated delta rule layers (GatedDeltaNet.step)


@pytest.mark.parametrize("layers, n_mem, kv_window, kv_keep", CASES)
def test_step_path_equals_chunked_forward(layers, n_mem, kv_window, kv_keep, mem_rotary="none",
                                          attn_x0=False, **kw):
    T = 5
    model = make(layers=layers, n_mem=n_mem, kv_window=kv_window, kv_keep=kv_keep,
                 mem_rotary=mem_rotary, attn_x0=attn_x0, **kw)
    tokens = torch.randint(0, V, (2, 4 * T + 3))   # five chunks, the last partial
    want = forward_chunks(model, tokens, T, reset_at=2)
    got = decode_tokens(Decoder(model, 2, T), tokens, T, reset_at=2)
    assert (got - want).abs().max().item() < 1e-9


@pytest.mark.parametrize("mem_rotary", ["chunk", "free"])
def test_step_path_equals_chunked_forward_with_rotated_or_free_memory(mem_rotary):
    test_step_path_equals_chunked_forward("MAMA", 2, 5, 3, mem_rotary=mem_rotary)


@pytest.mark.parametrize("mem_rotary", ["none", "free"])
def test_step_path_equals_chunked_forward_reading_fewer_kept_tokens_than_it_keeps(mem_rotary):
    # model.kv_keep_read: each query its own best kept token of 3, token by token as in the chunk
    test_step_path_equals_chunked_forward("MAMA", 2, 5, 3, mem_rotary=mem_rotary, kv_keep_read=1)


@pytest.mark.parametrize("mem_rotary", ["none", "free"])
def test_step_path_reads_its_best_kept_tokens_of_many_as_the_chunked_forward_by_either_read(
        monkeypatch, mem_rotary):
    """kv_keep_read 2 of 6 kept tokens: the token step's read (its buffer and each query's best
    kept tokens merged by log-sum-exp, kept_read.top_kept_read) gives the chunked forward's
    logits by its two-part read (no gradient recorded) and by its per-query mask (with one)."""
    T = 5
    model = make(layers="MAMA", n_mem=2, kv_window=4, kv_keep=6, kv_keep_read=2,
                 mem_rotary=mem_rotary)
    with torch.no_grad():   # keep scores that rank the tokens apart
        for block in model.blocks:
            if block.kind == "A":
                block.mixer.keep_w.normal_()
    tokens = torch.randint(0, V, (2, 6 * T + 3), generator=torch.Generator().manual_seed(2))
    masked = forward_chunks(model, tokens, T, reset_at=4)
    with torch.no_grad():
        fast = forward_chunks(model, tokens, T, reset_at=4)
    import importlib
    module = importlib.import_module("elephant.generate")   # (the package exports the function)
    reads = []
    plain = module.top_kept_read

    def counted(q, keys, *args):
        reads.append(keys.shape[2])
        return plain(q, keys, *args)
    monkeypatch.setattr(module, "top_kept_read", counted)
    dec = Decoder(model, 2, T)
    got = decode_tokens(dec, tokens, T, reset_at=4)
    assert int(dec.kept[1]["keep_valid"].sum(1).min()) > 2    # more kept than a query reads
    assert reads and set(reads) == {6}
    assert (fast - masked).abs().max().item() < 1e-9
    assert (got - fast).abs().max().item() < 1e-9


@pytest.mark.parametrize("layers, n_mem, kv_window, kv_keep", [("MAMA", 2, 5, 3), ("AA", 0, 4, 0)])
def test_step_path_equals_chunked_forward_with_attention_reading_the_stack_input(
        layers, n_mem, kv_window, kv_keep):
    # attn_x0: the decoder's layers add the same normalized input (tokens, memory, write slots)
    test_step_path_equals_chunked_forward(layers, n_mem, kv_window, kv_keep, mem_rotary="free",
                                          attn_x0=True)


@pytest.mark.parametrize("mem_update", ["gated", "replace"])
def test_prompt_path_forward_prefill_and_steps_equal_forward(mem_update):
    T = 6
    model = make(n_mem=2, kv_window=8, mem_update=mem_update)
    tokens = torch.randint(0, V, (2, 4 * T + 2))
    want = forward_chunks(model, tokens, T)
    _, state = model(tokens[:, :T])
    _, state = model(tokens[:, T:2 * T], state)
    dec = Decoder(model, 2, T, state=state)
    a = dec.prefill(tokens[:, 2 * T:2 * T + 4])              # part of a chunk
    b = dec.prefill(tokens[:, 2 * T + 4:3 * T])              # the rest: the write slots run
    steps = [dec.step(tokens[:, t]) for t in range(3 * T, tokens.shape[1])]
    got = torch.cat([a, b, torch.stack(steps, 1)], dim=1)
    assert (got - want[:, 2 * T:]).abs().max().item() < 1e-9
    assert dec.prefill(tokens[:, :2], last_only=True).shape == (2, V)


def test_lanes_at_different_points_of_their_chunks():
    # lane 1 is reset mid-chunk: from then on the lanes hit their chunk boundaries at different
    # steps, and each boundary must run for its lane alone
    T = 4
    model = make(n_mem=2, kv_window=6)
    tokens = torch.randint(0, V, (2, 15))
    dec = Decoder(model, 2, T)
    for t in range(6):
        dec.step(tokens[:, t])
    dec.reset([False, True])
    got = torch.stack([dec.step(tokens[:, t]) for t in range(6, 15)], dim=1)
    want0 = forward_chunks(model, tokens[:1], T)[:, 6:]
    want1 = forward_chunks(model, tokens[1:, 6:], T)
    assert (got[:1] - want0).abs().max().item() < 1e-9
    assert (got[1:] - want1).abs().max().item() < 1e-9


def test_greedy_is_deterministic_and_follows_the_forward_argmax():
    T = 5
    model = make(n_mem=2, kv_window=8)
    prompt = torch.randint(0, V, (13,)).tolist()
    out = generate(model, prompt, max_new_tokens=12, temperature=0, chunk_len=T)
    assert out == generate(model, prompt, max_new_tokens=12, temperature=0, chunk_len=T)
    assert len(out) == 12
    text = torch.tensor([prompt + out])
    logits = forward_chunks(model, text, T)
    assert logits[0, len(prompt) - 1:-1].argmax(-1).tolist() == out


def test_a_model_left_in_training_mode_generates_as_in_evaluation():
    # exploration noise and dropped kept tokens are training-only: generation is inference, in
    # the prompt's chunked forward as in the token steps, and the model's mode is given back
    T = 4
    model = make(n_mem=2, kv_window=4, kv_keep=3, kv_keep_noise=5.0, kv_keep_drop=0.9)
    prompt = torch.randint(0, V, (4 * T + 1,)).tolist()
    want = generate(model, prompt, max_new_tokens=10, temperature=0, chunk_len=T)
    model.train()
    modes = []                                   # the mode of every chunked forward it runs
    model.register_forward_pre_hook(lambda m, args: modes.append(m.training))
    torch.manual_seed(1)
    assert generate(model, prompt, max_new_tokens=10, temperature=0, chunk_len=T) == want
    assert modes and not any(modes) and model.training


def test_prompts_of_different_lengths_generate_as_if_alone():
    model = make(n_mem=2, kv_window=8)
    prompts = [torch.randint(0, V, (n,)).tolist() for n in (3, 11, 7)]
    batch = generate(model, prompts, max_new_tokens=9, temperature=0, chunk_len=4)
    alone = [generate(model, p, max_new_tokens=9, temperature=0, chunk_len=4) for p in prompts]
    assert batch == alone


def test_seeded_sampling_reproduces():
    model = make(n_mem=2, kv_window=8)
    prompt = [[1, 2, 3], [4, 5, 6]]
    kw = dict(max_new_tokens=20, temperature=1.5, top_k=20, top_p=0.95, chunk_len=4)
    a = generate(model, prompt, seed=7, **kw)
    assert a == generate(model, prompt, seed=7, **kw)
    assert a != generate(model, prompt, seed=8, **kw)
    assert all(0 <= t < V for lane in a for t in lane)


def test_eos_stops_a_lane_and_vocab_size_limits_the_sampled_ids():
    model = make()
    first = generate(model, [3, 4], max_new_tokens=5, temperature=0, chunk_len=4)
    assert generate(model, [3, 4], max_new_tokens=5, temperature=0, chunk_len=4,
                    eos_id=first[0]) == first[:1]
    out = generate(model, [3, 4], max_new_tokens=50, temperature=2.0, seed=0, chunk_len=4,
                   vocab_size=10)
    assert max(out) < 10


def test_sample_top_k_1_and_tiny_top_p_are_greedy():
    logits = torch.randn(4, 50)
    g = torch.Generator().manual_seed(0)
    assert torch.equal(sample(logits, 1.0, top_k=1, generator=g), logits.argmax(-1))
    assert torch.equal(sample(logits, 1.0, top_p=1e-6, generator=g), logits.argmax(-1))


def test_stream_callback_sees_every_token_in_order():
    model = make(n_mem=1)
    seen = {0: [], 1: []}
    out = generate(model, [[1, 2], [3, 4, 5]], max_new_tokens=6, temperature=0, chunk_len=3,
                   stream=lambda lane, tok: seen[lane].append(tok))
    assert [seen[0], seen[1]] == out


@pytest.mark.parametrize("prompt, kw, needle", [
    ([], {}, "empty"),
    ([[1, 2], []], {}, "prompt 1 is empty"),
    ([1, V + 5], {}, f"token {V + 5}, outside the vocabulary"),
    ([1, -1], {}, "token -1"),
    ("hello", {}, "encode it with the tokenizer"),
    (torch.tensor([1.0, 2.0]), {}, "integer token ids"),
    ([1, 2], {"max_new_tokens": 0}, "max_new_tokens must be an integer >= 1"),
    ([1, 2], {"temperature": -1.0}, "temperature"),
    ([1, 2], {"top_k": -3}, "top_k"),
    ([1, 2], {"top_p": 0.0}, "top_p"),
    ([1, 2], {"top_p": 1.5}, "top_p"),
])
def test_bad_input_gets_a_one_line_error(prompt, kw, needle):
    model = make()
    args = dict(max_new_tokens=3, chunk_len=4) | kw
    with pytest.raises(GenerationError) as e:
        generate(model, prompt, **args)
    assert needle in str(e.value) and "\n" not in str(e.value)
    assert isinstance(e.value, ValueError)


def test_text_stream_holds_back_a_split_utf8_character():
    stream = TextStream(ByteTokenizer())
    pieces = [stream.push(b) for b in "aé€".encode()]
    assert pieces == ["a", "", "é", "", "", "€"]
    assert stream.push(0xE2) == "" and stream.flush() == "\ufffd"


@pytest.fixture
def export(tmp_path):
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=260, d_model=32, n_heads=4, layers="MA", d_mlp=48, d_state=16,
                      mamba_head_dim=16, ssd_chunk=8, n_mem=2, kv_window=16)
    return save_pretrained(ElephantLM(cfg), tmp_path / "export", tokenizer=ByteTokenizer(),
                           train_config={"train": {"chunk_len": 8}})


def test_eval_cli_prompt_streams_generated_text(export, tmp_path, capsys):
    args = ["--checkpoint", str(export), "--prompt", "The elephant ", "--max-new-tokens", "20",
            "--temperature", "0", "--device", "cpu"]
    assert eval_cli.main(args) == 0
    first = capsys.readouterr().out
    assert first.startswith("The elephant ")
    assert eval_cli.main(args) == 0
    assert capsys.readouterr().out == first           # greedy: the same text again
    doc = tmp_path / "prompt.txt"
    doc.write_text("x" * 50)                          # a prompt longer than several chunks
    assert eval_cli.main(["--checkpoint", str(export), "--prompt-file", str(doc),
                          "--max-new-tokens", "5", "--seed", "1", "--device", "cpu"]) == 0
    assert "x" * 50 not in capsys.readouterr().out      # only the continuation is printed


@pytest.mark.parametrize("extra, needle", [
    (["--prompt", ""], "empty"),
    (["--prompt", "hi", "--max-new-tokens", "0"], "max_new_tokens"),
    (["--prompt", "hi", "--top-p", "2"], "top_p"),
    (["--prompt-file", "/nonexistent/prompt.txt"], "prompt.txt"),
])
def test_eval_cli_generation_errors_are_one_line(export, capsys, extra, needle):
    assert eval_cli.main(["--checkpoint", str(export), "--device", "cpu"] + extra) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and needle in err[0], err


@pytest.mark.gpu
@pytest.mark.parametrize("compiled", [False, True])
def test_cuda_graph_step_equals_eager_step(compiled):
    # the captured (and compiled) token step replays the eager one, across chunk boundaries
    T = 6
    model = make(dtype=torch.float32, n_mem=2, kv_window=8).cuda()
    tokens = torch.randint(0, V, (3, 4 * T + 1), device="cuda")
    eager, graph = Decoder(model, 3, T), Decoder(model, 3, T, cuda_graph=True, compile=compiled)
    for t in range(tokens.shape[1]):
        a, b = eager.step(tokens[:, t]), graph.step(tokens[:, t]).clone()
        assert (a - b).abs().max().item() < 1e-4, t


@pytest.mark.gpu
def test_generate_on_cuda_follows_the_forward_argmax():
    model = make(dtype=torch.float32, n_mem=2, kv_window=8).cuda()
    prompt = torch.randint(0, V, (9,)).tolist()
    out = generate(model, prompt, max_new_tokens=20, temperature=0, chunk_len=5)
    assert out == generate(model, prompt, max_new_tokens=20, temperature=0, chunk_len=5,
                           cuda_graph=False)
