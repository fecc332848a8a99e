"""RollingChunkBatcher: every token once, in order, one lane per document, exact resume, disjoint ranks."""
import json

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from data_packing import DataError, RollingChunkBatcher, TokenizedCorpus


def corpus_of(lengths):
    """Documents whose tokens are all distinct (1, 2, 3, ...), so any misplaced token shows."""
    bounds = np.cumsum([0, *lengths])
    return TokenizedCorpus.from_documents([np.arange(a, b) + 1 for a, b in zip(bounds[:-1], bounds[1:])])


def replay(batcher):
    """Rebuild each document from the batches: {doc: (lane, tokens seen, resets, chunks)}."""
    seen = {}
    for batch in batcher:
        for b, d in enumerate(batch.doc_ids.tolist()):
            row, mask = batch.tokens[b], batch.loss_mask[b]
            if d < 0:
                assert not mask.any() and not batch.reset[b] and not row.any()
                continue
            n = int(mask.sum())
            assert mask[:n].all() and not mask[n:].any() and not row[n + 1 :].any()  # real, then padding
            if d not in seen:
                seen[d] = {"lane": b, "tokens": [int(row[0])], "resets": [], "chunks": 0}
            s = seen[d]
            assert s["lane"] == b  # a document stays in its lane
            assert int(row[0]) == s["tokens"][-1]  # chunks overlap by one token
            s["tokens"] += row[1 : n + 1].tolist()
            s["resets"].append(bool(batch.reset[b]))
            s["chunks"] += 1
    return seen


@settings(max_examples=150, deadline=None)
@given(lengths=st.lists(st.integers(1, 40), min_size=1, max_size=25), lanes=st.integers(1, 6),
       chunk_len=st.integers(1, 9), seed=st.integers(0, 2**32 - 1))
def test_one_epoch_yields_every_token_once_in_order_one_lane_per_document(lengths, lanes, chunk_len, seed):
    corpus = corpus_of(lengths)
    batcher = RollingChunkBatcher(corpus, lanes, chunk_len, seed=seed, loop=False)
    seen = replay(batcher)
    readable = [i for i, n in enumerate(lengths) if n >= 2]
    assert sorted(seen) == readable
    assert batcher.skipped_short_docs == len(lengths) - len(readable)
    assert batcher.docs_completed == len(readable) and batcher.epoch == 0
    for d, s in seen.items():
        assert s["tokens"] == corpus.doc(d).tolist()
        assert s["resets"] == [True] + [False] * (s["chunks"] - 1)
        assert s["chunks"] == -(-(lengths[d] - 1) // chunk_len)
    predicted = sum(n - 1 for n in lengths if n >= 2)
    assert batcher.real_tokens == predicted and batcher.total_tokens == batcher.batches * lanes * chunk_len


def test_batches_have_the_contract_shapes_and_dtypes():
    batch = next(iter(RollingChunkBatcher(corpus_of([30, 5, 9]), lanes=4, chunk_len=8, seed=1)))
    assert batch.tokens.shape == (4, 9) and batch.tokens.dtype == torch.int64
    assert batch.reset.shape == (4,) and batch.reset.dtype == torch.bool and batch.reset.all()
    assert batch.loss_mask.shape == (4, 8) and batch.loss_mask.dtype == torch.bool
    assert batch.doc_ids.shape == (4,) and batch.doc_ids.dtype == torch.int64


def test_fill_counts_real_targets_and_padding_is_masked():
    batcher = RollingChunkBatcher(corpus_of([11, 3]), lanes=2, chunk_len=4, seed=0, shuffle=False, loop=False)
    batches = list(batcher)
    # Lane 0: 10 targets in chunks of 4, 4, 2; lane 1: 2 targets, then idle.
    assert [b.loss_mask.sum(1).tolist() for b in batches] == [[4, 2], [4, 0], [2, 0]]
    assert [b.doc_ids.tolist() for b in batches] == [[0, 1], [0, -1], [0, -1]]
    assert batcher.fill == pytest.approx(12 / 24) and batcher.last_fill == pytest.approx(2 / 8)
    assert batches[2].tokens[0].tolist() == [9, 10, 11, 0, 0]


def test_a_finished_lane_takes_the_next_document_at_its_next_chunk_with_reset():
    batcher = RollingChunkBatcher(corpus_of([3, 20, 4]), lanes=2, chunk_len=4, seed=0, shuffle=False)
    first, second = next(batcher), next(batcher)
    assert first.doc_ids.tolist() == [0, 1] and first.reset.tolist() == [True, True]
    assert second.doc_ids.tolist() == [2, 1] and second.reset.tolist() == [True, False]


def test_looping_continues_into_the_next_epoch_with_a_new_shuffle():
    lengths = [5] * 40
    batcher = RollingChunkBatcher(corpus_of(lengths), lanes=3, chunk_len=4, seed=7)
    order = []
    while batcher.epoch < 3:
        batch = next(batcher)
        order += [d for d, r in zip(batch.doc_ids.tolist(), batch.reset.tolist()) if r]
    epochs = [order[i : i + 40] for i in (0, 40)]
    assert all(sorted(e) == list(range(40)) for e in epochs) and epochs[0] != epochs[1]
    assert epochs[0] == batcher.epoch_order(0).tolist() and epochs[1] == batcher.epoch_order(1).tolist()


def test_two_ranks_get_disjoint_documents_whose_union_is_the_split():
    lengths = [1, *range(2, 40)]
    for world_size in (2, 3):
        docs = [set(replay(RollingChunkBatcher(corpus_of(lengths), 4, 8, seed=3, rank=r,
                                               world_size=world_size, loop=False)))
                for r in range(world_size)]
        assert sum(map(len, docs)) == len(set().union(*docs)) == len(lengths) - 1
        assert set().union(*docs) == set(range(1, len(lengths)))
        assert max(map(len, docs)) - min(map(len, docs)) <= 1


@pytest.mark.parametrize("loop, stop_after", [(True, 17), (True, 60), (False, 9)])
def test_resuming_mid_epoch_gives_the_identical_remaining_stream(loop, stop_after):
    lengths = np.random.default_rng(0).integers(1, 60, size=30).tolist()
    make = lambda: RollingChunkBatcher(corpus_of(lengths), lanes=5, chunk_len=7, seed=11, loop=loop)
    original = assert_resumes_identically(make, stop_after,
                                          ("tokens", "reset", "loss_mask", "doc_ids"))
    assert original.epoch >= 1 or not loop


def assert_resumes_identically(make, stop_after, fields):
    """A batcher from `make()` stopped after `stop_after` batches and resumed from its state (sent
    through plain JSON, no pickling) yields the same next 40 batches in every field of `fields`,
    and ends in the same state. Returns the batcher that ran through."""
    original = make()
    for _ in range(stop_after):
        next(original)
    state = json.loads(json.dumps(original.state_dict()))
    resumed = make()
    resumed.load_state_dict(state)
    rest = lambda b: [next(b, None) for _ in range(40)]
    for a, b in zip(rest(original), rest(resumed)):
        assert (a is None) == (b is None)
        if a is not None:
            for field in fields:
                assert torch.equal(getattr(a, field), getattr(b, field))
    assert original.state_dict() == resumed.state_dict()
    return original


def test_resume_refuses_a_different_setup():
    state = RollingChunkBatcher(corpus_of([5, 6]), lanes=2, chunk_len=4, seed=0).state_dict()
    with pytest.raises(DataError, match=r"saved with chunk_len=4, this batcher has chunk_len=8"):
        RollingChunkBatcher(corpus_of([5, 6]), lanes=2, chunk_len=8, seed=0).load_state_dict(state)
    with pytest.raises(DataError, match=r"saved with n_docs=2"):
        RollingChunkBatcher(corpus_of([5, 6, 7]), lanes=2, chunk_len=4, seed=0).load_state_dict(state)


def test_a_rank_without_documents_is_refused_when_looping():
    with pytest.raises(DataError, match=r"rank 2 of 3 gets no documents"):
        RollingChunkBatcher(corpus_of([1, 4, 4]), lanes=2, chunk_len=4, rank=2, world_size=3)
    assert list(RollingChunkBatcher(corpus_of([1, 4, 4]), 2, 4, rank=2, world_size=3, loop=False)) == []


# --- packing: documents back to back inside a row, with exact per-token boundaries -------------

def replay_packed(batcher):
    """Rebuild each document from packed batches through the per-token fields: {doc: targets}."""
    targets, firsts, lane_of = {}, {}, {}
    for batch in batcher:
        T = batch.loss_mask.shape[1]
        assert torch.equal(batch.reset, batch.starts[:, 0])
        assert torch.equal(batch.doc_ids, batch.token_doc_ids[:, 0])
        for b in range(batch.tokens.shape[0]):
            row, ids, starts = batch.tokens[b].tolist(), batch.token_doc_ids[b].tolist(), batch.starts[b]
            for t in range(T):
                d = ids[t]
                new = t == 0 and d >= 0 and d not in lane_of or t > 0 and d >= 0 and d != ids[t - 1]
                assert bool(starts[t]) == (new and (t > 0 or d not in lane_of)), (t, d)
                if starts[t]:
                    assert d not in firsts
                    firsts[d], lane_of[d] = row[t], b
                if d >= 0:
                    assert lane_of[d] == b  # a document stays in its lane
                nxt = ids[t + 1] if t + 1 < T else None
                if batch.loss_mask[b, t]:
                    assert d >= 0 and (nxt is None or nxt == d)
                    targets.setdefault(d, []).append(row[t + 1])
                else:  # masked: padding, or the target across a boundary
                    assert d < 0 or (nxt is not None and nxt != d) or t == T - 1
    return firsts, targets


@settings(max_examples=150, deadline=None)
@given(lengths=st.lists(st.integers(1, 40), min_size=1, max_size=25), lanes=st.integers(1, 6),
       chunk_len=st.integers(1, 9), seed=st.integers(0, 2**32 - 1))
def test_packed_epoch_yields_every_token_once_in_order(lengths, lanes, chunk_len, seed):
    corpus = corpus_of(lengths)
    batcher = RollingChunkBatcher(corpus, lanes, chunk_len, seed=seed, loop=False, pack=True)
    firsts, targets = replay_packed(batcher)
    readable = [i for i, n in enumerate(lengths) if n >= 2]
    assert sorted(firsts) == sorted(targets) == readable
    for d in readable:
        doc = corpus.doc(d).tolist()
        assert firsts[d] == doc[0] and targets[d] == doc[1:]
    assert batcher.docs_completed == len(readable)
    assert batcher.real_tokens == sum(n - 1 for n in lengths if n >= 2)


def test_packed_rows_are_full_and_boundaries_are_per_token():
    batcher = RollingChunkBatcher(corpus_of([3, 6, 9]), lanes=1, chunk_len=8, seed=0, shuffle=False,
                                  pack=True, loop=False)
    first = next(batcher)
    assert first.tokens[0].tolist() == [1, 2, 3, 4, 5, 6, 7, 8, 9]
    assert first.starts[0].tolist() == [True, False, False, True, False, False, False, False]
    assert first.token_doc_ids[0].tolist() == [0, 0, 0, 1, 1, 1, 1, 1]
    assert first.loss_mask[0].tolist() == [True, True, False, True, True, True, True, True]
    assert first.inner_starts == 1  # the host-side count of documents starting inside the chunk
    # doc 1's last token was the row's last target: doc 2 starts the next chunk with reset
    second = next(batcher)
    assert second.tokens[0].tolist() == [10, 11, 12, 13, 14, 15, 16, 17, 18]
    assert second.reset.tolist() == [True] and second.doc_ids.tolist() == [2]
    assert second.starts[0].tolist() == [True] + [False] * 7
    assert not second.inner_starts  # a start at token 0 only: the reset flag says it all

    batcher = RollingChunkBatcher(corpus_of([12, 4]), lanes=1, chunk_len=8, seed=0, shuffle=False,
                                  pack=True, loop=False)
    next(batcher)  # doc 0 goes on in the next chunk (token 9 again: chunks overlap by one)
    second = next(batcher)
    assert second.tokens[0].tolist() == [9, 10, 11, 12, 13, 14, 15, 16, 0]
    assert second.starts[0].tolist() == [False, False, False, False, True, False, False, False]
    assert second.inner_starts == 1
    assert second.token_doc_ids[0].tolist() == [0, 0, 0, 0, 1, 1, 1, 1]
    # several lanes: the count is over all of them
    batcher = RollingChunkBatcher(corpus_of([3, 2, 4, 2, 5, 3, 2]), lanes=2, chunk_len=8, seed=0,
                                  shuffle=False, pack=True, loop=False)
    b = next(batcher)
    assert b.inner_starts == int(b.starts[:, 1:].sum()) and b.inner_starts >= 3
    assert second.loss_mask[0].tolist() == [True, True, True, False, True, True, True, False]
    assert not second.reset[0] and second.doc_ids.tolist() == [0]


def test_packed_fill_is_at_least_098_on_short_web_like_documents():
    rng = np.random.default_rng(0)
    lengths = np.maximum(2, rng.lognormal(np.log(150) - 0.5 ** 2 / 2 * 4, 1.0, size=3000)).astype(int)
    assert 120 < lengths.mean() < 180
    corpus = corpus_of(lengths.tolist())
    packed = RollingChunkBatcher(corpus, lanes=8, chunk_len=256, seed=0, pack=True)
    unpacked = RollingChunkBatcher(corpus, lanes=8, chunk_len=256, seed=0)
    for _ in range(100):
        next(packed), next(unpacked)
    assert packed.fill >= 0.98 and unpacked.fill < 0.6


@pytest.mark.parametrize("loop, stop_after", [(True, 17), (True, 60), (False, 9)])
def test_packed_resume_mid_stream_gives_the_identical_remaining_stream(loop, stop_after):
    lengths = np.random.default_rng(0).integers(1, 60, size=30).tolist()
    make = lambda: RollingChunkBatcher(corpus_of(lengths), lanes=3, chunk_len=7, seed=11, loop=loop,
                                       pack=True)
    assert_resumes_identically(make, stop_after, ("tokens", "reset", "loss_mask", "doc_ids",
                                                  "starts", "token_doc_ids"))


def test_resume_refuses_a_different_packing_and_reads_version_1_unpacked():
    unpacked = RollingChunkBatcher(corpus_of([5, 6]), lanes=2, chunk_len=4, seed=0)
    state = unpacked.state_dict()
    with pytest.raises(DataError, match=r"saved with pack=False, this batcher has pack=True"):
        RollingChunkBatcher(corpus_of([5, 6]), lanes=2, chunk_len=4, seed=0, pack=True).load_state_dict(state)
    old = {k: v for k, v in state.items() if k != "pack"} | {"version": 1}
    RollingChunkBatcher(corpus_of([5, 6]), lanes=2, chunk_len=4, seed=0).load_state_dict(old)
    with pytest.raises(DataError, match=r"version 1.*data.pack=false"):
        RollingChunkBatcher(corpus_of([5, 6]), lanes=2, chunk_len=4, seed=0, pack=True).load_state_dict(old)


# --- the length curriculum: short documents first, the cap a function of the batch count --------

@pytest.mark.parametrize("pack", [False, True])
def test_length_curriculum_starts_short_documents_first_and_postpones_the_long_ones(pack):
    # a document may start a lane only under the cap, which grows from 40 tokens to the longest
    # (~400) over 60 batches; a longer one is passed over, not lost: it comes in a later epoch;
    # after the curriculum nothing is passed over
    rng = np.random.default_rng(3)
    lengths = rng.integers(2, 400, size=80).tolist()
    batcher = RollingChunkBatcher(corpus_of(lengths), lanes=3, chunk_len=16, seed=5, pack=pack,
                                  curriculum=(40, 60))
    caps, started = [], {}
    for i in range(1000):
        cap = batcher.length_cap()
        before = set(d for d in batcher._lane_doc if d >= 0)
        batch = next(batcher)
        ids = set(batch.token_doc_ids[batch.starts].tolist()) - before
        for d in ids:
            started.setdefault(d, i)
            assert cap is None or lengths[d] <= cap, (i, d, lengths[d], cap)
        caps.append(cap)
    assert caps[0] == 40 and caps[59] < max(lengths) and all(c is None for c in caps[60:])
    assert all(a <= b for a, b in zip(caps[:59], caps[1:59]))          # it only grows
    assert batcher.skipped_for_length > 0 and sorted(started) == list(range(80))   # all read
    early = [lengths[d] for d, i in started.items() if i < 30]
    assert early and max(early) <= caps[29]
    skipped = batcher.skipped_for_length
    for _ in range(50):
        next(batcher)
    assert batcher.skipped_for_length == skipped


def test_length_curriculum_resumes_exactly_and_refuses_another_curriculum():
    lengths = np.random.default_rng(1).integers(2, 90, size=40).tolist()
    make = lambda: RollingChunkBatcher(corpus_of(lengths), lanes=4, chunk_len=7, seed=2,
                                       curriculum=(4, 50))
    ran = assert_resumes_identically(make, 23, ("tokens", "reset", "loss_mask", "doc_ids"))
    assert ran.skipped_for_length > 0
    state = make().state_dict()
    with pytest.raises(DataError, match=r"saved with curriculum_batches=50, this batcher has "
                                        r"curriculum_batches=80"):
        RollingChunkBatcher(corpus_of(lengths), lanes=4, chunk_len=7, seed=2,
                            curriculum=(4, 80)).load_state_dict(state)
    plain = RollingChunkBatcher(corpus_of(lengths), lanes=4, chunk_len=7, seed=2)
    with pytest.raises(DataError, match=r"saved with curriculum_start=0, this batcher has "
                                        r"curriculum_start=4"):
        make().load_state_dict(plain.state_dict())
    with pytest.raises(DataError, match=r"saved with curriculum_start=4, this batcher has "
                                        r"curriculum_start=0"):
        plain.load_state_dict(state)
    older = {k: v for k, v in plain.state_dict().items() if not k.startswith("curriculum")}
    plain.load_state_dict(older)   # saved before the curriculum existed: off
    with pytest.raises(DataError, match=r"length curriculum needs a looping stream"):
        RollingChunkBatcher(corpus_of(lengths), 4, 7, loop=False, curriculum=(4, 50))
    # a cap below every document of a rank's epoch cannot stall the stream: one is taken anyway
    tiny = RollingChunkBatcher(corpus_of([50, 60, 70]), lanes=2, chunk_len=8, curriculum=(1, 1000))
    assert all(next(tiny).doc_ids.ge(0).any() for _ in range(20))
