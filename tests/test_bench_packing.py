"""benchmarks/bench_packing.py's timing loop on the CPU at tiny shapes: what it counts (real tokens,
boundary-path chunks) is what the batches hold, for the padded and the packed paths alike."""
import pytest
import torch

from benchmarks import bench_packing
from benchmarks.common import bf16_autocast
from elephant.model import ElephantLM


def test_measure_counts_the_real_tokens_and_boundary_chunks_of_the_timed_steps():
    cfg = bench_packing.make_config(smoke=True)
    torch.manual_seed(0)
    model = ElephantLM(cfg)
    corpus = bench_packing.lognormal_corpus(200, cfg.vocab_size, 40)
    device = torch.device("cpu")
    k, B, T, warmup = cfg.bptt_chunks, 2, 32, 1
    n = 3 * k
    fills = {}
    for pack in (False, True):
        batches, fill, _ = bench_packing.batches_from(corpus, B, T, n, pack, device)
        timed = batches[warmup * k:]
        out = bench_packing.measure(model, batches, device, bf16_autocast(device), warmup)
        assert len(out["times"]) == n // k - warmup and out["tokens_per_step"] == k * B * T
        assert out["real"] == sum(int(mask.sum()) for _, _, mask, _, _ in timed)
        # the boundary path only for chunks with a document starting inside (host_skip)
        assert out["boundary_path_chunks"] == (sum(bool(inner) for *_, inner in timed) if pack else 0)
        fills[pack] = out["real"] / (len(timed) * B * T)
        # as the CUDA-graph steps carry it (the trainer's StaticCarry): the same steps and counts,
        # the state ending in the carry's buffers, with the window in the autocast dtype on CUDA
        graphed = bench_packing.measure(model, batches, device, bf16_autocast(device), warmup,
                                        graphs=True)
        assert {k: v for k, v in graphed.items() if k != "times"} == \
            {k: v for k, v in out.items() if k != "times"}
        # a step's chunks in one forward_window call (--compile window): the same counts
        windowed = bench_packing.measure(model, batches, device, bf16_autocast(device), warmup,
                                         graphs=True, window=True)
        assert {k: v for k, v in windowed.items() if k != "times"} == \
            {k: v for k, v in out.items() if k != "times"}
        names = list(model.init_state(B).tensors())
        assert len(bench_packing.CARRY.buffers) == len(names)
    assert fills[True] > 0.95 and fills[False] < fills[True]   # packing fills what padding wastes


def test_measure_sets_the_conv_form_for_its_steps_only(monkeypatch):
    # lognormal_packed_conv_tiles: the steps run with the conv_triton.SEGMENT_FORM given (read
    # by the Mamba conv when it is traced), the form before is back afterwards, also on an error
    from elephant.layers import conv_triton
    seen = []

    def steps(*args, **kwargs):
        seen.append(conv_triton.SEGMENT_FORM)
        if len(seen) == 2:
            raise RuntimeError("a failing step")
        return {"times": []}
    monkeypatch.setattr(bench_packing, "steps", steps)
    before = conv_triton.SEGMENT_FORM
    other = "tiles" if before == "starts" else "starts"
    assert bench_packing.measure(None, [], None, None, 0, conv_form=other) == {"times": []}
    assert conv_triton.SEGMENT_FORM == before
    with pytest.raises(RuntimeError, match="a failing step"):
        bench_packing.measure(None, [], None, None, 0, conv_form=other)
    assert conv_triton.SEGMENT_FORM == before and seen == [other, other]
    bench_packing.measure(None, [], None, None, 0)
    assert seen[-1] == before
