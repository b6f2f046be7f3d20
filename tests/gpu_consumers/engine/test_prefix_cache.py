"""Prefix caching: hits for shared prefixes, isolation by cache_salt."""

from __future__ import annotations

from gpu_consumers.engine import Engine, SamplingParams


def _run_one(engine, rid, prompt, salt=None, max_tokens=4):
    engine.add_request(rid, prompt, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True), salt)
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    final = [o for o in outs if o.finished]
    assert len(final) == 1
    return final[0], [t for o in outs for t in o.new_token_ids]


def test_second_request_hits_and_salt_isolates(model_dirs):
    engine = Engine.from_pretrained(model_dirs["llama-gqa-rope3"], num_kv_blocks=128, block_size=8)
    prefix = list(range(10, 50))  # 40 tokens = 5 full blocks
    o1, t1 = _run_one(engine, "a", prefix + [60, 61, 62], salt="tenant-1")
    assert o1.cached_tokens == 0
    o2, t2 = _run_one(engine, "b", prefix + [70, 71], salt="tenant-1")
    assert o2.cached_tokens == 40
    o3, _ = _run_one(engine, "c", prefix + [70, 71], salt="tenant-2")
    assert o3.cached_tokens == 0
    o4, t4 = _run_one(engine, "d", prefix + [70, 71], salt=None)
    assert o4.cached_tokens == 0  # unsalted never matches salted blocks
    o5, t5 = _run_one(engine, "e", prefix + [70, 71], salt=None)
    assert o5.cached_tokens == 40
    assert t5 == t4 == t2  # cached KV gives the same result as recomputation
    st = engine.stats
    assert st["prefix_cache_hits"] == 80
    assert st["prefix_cache_queries"] == 43 + 4 * 42


def test_identical_prompt_reuses_all_but_last_token(model_dirs):
    engine = Engine.from_pretrained(model_dirs["qwen2-bias"], num_kv_blocks=128, block_size=4)
    prompt = list(range(5, 25))  # 20 tokens = 5 full blocks
    _run_one(engine, "a", prompt)
    o, _ = _run_one(engine, "b", prompt)
    # the last token must be recomputed to produce logits, so its block is not reused
    assert o.cached_tokens == 16


def test_prefix_caching_disabled(model_dirs):
    engine = Engine.from_pretrained(model_dirs["qwen2-bias"], num_kv_blocks=128, block_size=4,
                                    enable_prefix_caching=False)
    prompt = list(range(5, 25))
    _run_one(engine, "a", prompt)
    o, _ = _run_one(engine, "b", prompt)
    assert o.cached_tokens == 0


def test_generated_blocks_are_cached_too(model_dirs):
    engine = Engine.from_pretrained(model_dirs["llama-tied"], num_kv_blocks=128, block_size=4)
    prompt = list(range(5, 13))  # 8 tokens
    _, toks = _run_one(engine, "a", prompt, max_tokens=9)
    # a follow-up turn containing prompt + answer reuses the answer's KV as well
    o, _ = _run_one(engine, "b", prompt + toks + [99])
    assert o.cached_tokens == 16


def test_the_summary_a_worker_advertises_names_exactly_the_blocks_the_gate_hashes_for_the_prompt(model_dirs):
    """The gate places by hashing the prompt itself (schedulers/prefix_hash.summary_keys); the worker reports
    what its engine cached. Both must name a block the same way, salt included."""
    from gpu_consumers.prefix_summary import PrefixSummary
    from formats.prefix_hash import summary_keys, unpack_keys

    engine = Engine.from_pretrained(model_dirs["llama-gqa-rope3"], num_kv_blocks=128, block_size=8)
    summary = PrefixSummary(engine)
    assert unpack_keys(summary.take(0.0)) == set()
    prompt = list(range(10, 51))  # 41 tokens: 5 cacheable blocks
    _run_one(engine, "a", prompt, salt="tenant-1", max_tokens=1)
    held = unpack_keys(summary.take(10.0))
    mine = list(summary_keys(prompt, 8, "tenant-1"))
    assert len(mine) == 5 and set(mine) <= held
    assert not set(summary_keys(prompt, 8, "tenant-2")) & held  # another tenant's identical prompt: no match
    assert not set(summary_keys([9] + prompt[1:], 8, "tenant-1")) & held  # a different first block breaks the chain


def test_a_summary_is_due_when_the_cache_changed_and_refreshed_even_when_not(model_dirs):
    from gpu_consumers import prefix_summary
    from gpu_consumers.prefix_summary import PrefixSummary

    engine = Engine.from_pretrained(model_dirs["llama-gqa-rope3"], num_kv_blocks=128, block_size=8)
    summary = PrefixSummary(engine)
    assert summary.take(100.0) is not None
    assert summary.take(100.0 + prefix_summary.MIN_INTERVAL_S) is None  # nothing changed, no refresh due yet
    _run_one(engine, "a", list(range(10, 51)), max_tokens=1)
    assert summary.take(100.0 + prefix_summary.MIN_INTERVAL_S / 2) is None  # changed, but too soon after the last
    assert summary.take(100.0 + prefix_summary.MIN_INTERVAL_S) is not None
    assert summary.take(100.0 + prefix_summary.MIN_INTERVAL_S * 2) is None
    assert summary.take(100.0 + prefix_summary.MIN_INTERVAL_S + prefix_summary.REFRESH_S) is not None
