"""Block accounting: no leaks through finish / abort / preemption / n>1 forks."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from gpu_consumers.engine import Engine, SamplingParams
from gpu_consumers.engine.core.block_pool import BlockPool
from gpu_consumers.engine.core.sequence import KV_CACHE_FULL, SequenceStatus


def _check_refcounts(engine: Engine) -> None:
    pool = engine.kv.pool
    pool.check_invariants()
    held = Counter()
    for seqs in engine.requests.values():
        for s in seqs:
            if s.status is SequenceStatus.FINISHED:
                assert not s.block_table
            held.update(s.block_table)
    for s in engine.scheduler.waiting:
        # waiting sequences never hold blocks (preempted ones freed theirs)
        assert not s.block_table
    for b in range(1, pool.num_blocks):
        assert pool.ref_cnt[b] == held[b], (b, pool.ref_cnt[b], held[b])
    assert len(engine.scheduler.running) <= engine.max_num_seqs


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_random_stress_no_leak(model_dirs, seed):
    rng = random.Random(seed)
    engine = Engine.from_pretrained(model_dirs["llama-gqa-rope3"], num_kv_blocks=rng.choice([24, 40, 80]),
                                    block_size=4, max_num_seqs=rng.choice([3, 6]),
                                    max_num_batched_tokens=rng.choice([8, 20, 64]))
    vocab = engine.model.cfg.vocab_size
    prefixes = [[rng.randrange(3, vocab) for _ in range(rng.randrange(4, 30))] for _ in range(3)]
    next_id = 0
    live: set[str] = set()
    finished = set()
    for step in range(120):
        if rng.random() < 0.35 and next_id < 30:
            base = rng.choice(prefixes) if rng.random() < 0.6 else []
            prompt = base + [rng.randrange(3, vocab) for _ in range(rng.randrange(1, 20))]
            params = SamplingParams(max_tokens=rng.randrange(1, 24), temperature=rng.choice([0.0, 1.0]),
                                    n=rng.choice([1, 1, 2, 3]), seed=rng.randrange(100), ignore_eos=True)
            rid = f"r{next_id}"
            engine.add_request(rid, prompt, params, cache_salt=rng.choice([None, "a", "b"]))
            live.add(rid)
            next_id += 1
        if live and rng.random() < 0.08:
            rid = rng.choice(sorted(live))
            engine.abort(rid)
            live.discard(rid)
        for out in engine.step():
            assert out.request_id not in finished
            if out.finished and all(
                    s.status is SequenceStatus.FINISHED for s in engine.requests.get(out.request_id, [])):
                live.discard(out.request_id)
        _check_refcounts(engine)
    while engine.has_unfinished_requests():
        engine.step()
        _check_refcounts(engine)
    assert not engine.requests
    assert engine.num_free_blocks() == engine.num_total_blocks
    engine.kv.pool.check_invariants()
    assert engine.stats["running"] == 0 and engine.stats["waiting"] == 0
    assert engine.stats["kv_usage"] == 0.0


def test_abort_frees_blocks_at_once(model_dirs):
    engine = Engine.from_pretrained(model_dirs["qwen2-bias"], num_kv_blocks=64, block_size=4)
    engine.add_request("a", list(range(3, 40)), SamplingParams(max_tokens=50, temperature=0, n=2, ignore_eos=True))
    for _ in range(4):
        engine.step()
    assert engine.num_free_blocks() < engine.num_total_blocks
    engine.abort("a")
    assert engine.num_free_blocks() == engine.num_total_blocks
    assert not engine.has_unfinished_requests()
    assert engine.step() == []


def test_preempted_sequence_resumes_and_frees(model_dirs):
    # pool of 14 blocks * 4 tokens: two 20-token prompts growing to 44 tokens cannot both fit
    engine = Engine.from_pretrained(model_dirs["llama-tied"], num_kv_blocks=14, block_size=4,
                                    max_num_seqs=4, max_num_batched_tokens=64)
    p = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    engine.add_request("x", list(range(3, 23)), p)
    engine.add_request("y", list(range(30, 50)), p)
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
        _check_refcounts(engine)
    assert engine.stats["preemptions"] > 0
    done = {o.request_id: o for o in outs if o.finished}
    assert done["x"].completion_tokens == 24 and done["y"].completion_tokens == 24
    # first_token_index is consecutive per request even across preemption
    for rid in "xy":
        idx = [o.first_token_index for o in outs if o.request_id == rid]
        assert idx == list(range(24))
    assert engine.num_free_blocks() == engine.num_total_blocks


def test_a_sequence_the_whole_kv_cache_cannot_hold_ends_with_its_own_reason(model_dirs):
    # 6 blocks * 4 tokens = 24 tokens: a 10-token prompt asking for 40 more outgrows the whole pool
    engine = Engine.from_pretrained(model_dirs["llama-tied"], num_kv_blocks=6, block_size=4,
                                    max_num_seqs=2, max_num_batched_tokens=64)
    engine.add_request("big", list(range(3, 13)), SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    last = [o for o in outs if o.finished][-1]
    assert last.finish_reason == KV_CACHE_FULL and 0 < last.completion_tokens < 40
    assert engine.num_free_blocks() == engine.num_total_blocks


def test_block_pool_lru_eviction_order():
    pool = BlockPool(6)
    a = pool.allocate(2)
    b = pool.allocate(2)
    pool.cache_block(a[0], b"h0")
    pool.cache_block(b[0], b"h1")
    pool.free(reversed(a))  # a[0] cached -> back of queue; a[1] uncached -> front
    pool.free(reversed(b))
    # uncached blocks are reused before cached ones; then the least recently freed cached one
    first = pool.allocate(3)
    assert a[0] not in first and b[0] not in first
    assert pool.get_cached_block(b"h0") == a[0]
    nxt = pool.allocate(1)
    assert nxt == [a[0]] and pool.get_cached_block(b"h0") is None
    assert pool.get_cached_block(b"h1") == b[0]
    with pytest.raises(RuntimeError):
        pool.allocate(2)
    pool.check_invariants()


def test_can_admit_and_free_slots(model_dirs):
    engine = Engine.from_pretrained(model_dirs["llama-gqa-rope3"], num_kv_blocks=10, block_size=4, max_num_seqs=2)
    assert engine.num_free_slots() == 2
    assert engine.can_admit(20)
    assert not engine.can_admit(40)  # needs 11 blocks
    engine.add_request("a", list(range(3, 23)), SamplingParams(max_tokens=4))
    assert engine.num_free_slots() == 1
    assert not engine.can_admit(20)  # the waiting request will take 6 of the 10 blocks
    engine.add_request("b", [5, 6], SamplingParams(max_tokens=4))
    assert engine.num_free_slots() == 0 and not engine.can_admit(2)
    with pytest.raises(ValueError):
        engine.add_request("c", list(range(3, 60)), SamplingParams())  # never fits the pool
