"""One tenant's adapter cannot touch another tenant's tokens (issue 56): a slot holding weights near the
float32 limit (forced past every check), in the same steps as two other tenants' adapters and the base
model, leaves their greedy tokens exactly as in a run without it; an adapter whose lora_alpha makes its
scaled weights infinite is refused by the engine's own read and cannot be installed into a slot; the
hostile sequence's NaN keys and values, left in blocks that victims reuse, change nothing either."""
from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from gpu_consumers.engine import LORA_LOAD_FAILED, Engine, LoraLoadError, LoraRequest, SamplingParams
from gpu_consumers.engine.lora.loader import LoadedAdapter
from test_lora import ADAPTERS, PROMPTS, make_adapter

MAX_NEW = 10
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
HOSTILE_ID = "mallory/huge"
VICTIMS = [None, "qv", "mlp"]  # the base model and two other tenants' adapters


@pytest.fixture(scope="module")
def base(model_dirs) -> str:
    return model_dirs["llama-gqa-rope3"]


@pytest.fixture(scope="module")
def victims(base, tmp_path_factory) -> dict[str, LoraRequest]:
    root = tmp_path_factory.mktemp("victims")
    return {name: LoraRequest(f"tenant-{name}/{name}", make_adapter(base, str(root / name), *ADAPTERS[name]))
            for name in VICTIMS if name}


def _engine(base, num_kv_blocks: int = 48) -> Engine:
    # few blocks by default: the hostile sequence's blocks are freed and handed to victims within the run
    return Engine.from_pretrained(base, num_kv_blocks=num_kv_blocks, block_size=4, max_num_seqs=16,
                                  max_num_batched_tokens=64, max_loras=4, max_lora_rank=16)


def _huge_adapter(engine: Engine, value: float) -> LoadedAdapter:
    """Every projection of every layer adapted, A and B all `value` (3e38: finite, and x @ A is inf)."""
    base = engine.lora.base
    weights = {}
    for layer in range(base.num_layers):
        for module in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"):
            fan_in, fan_out = base.in_out(module)
            weights[(layer, module)] = (torch.full((8, fan_in), value), torch.full((8, fan_out), value))
    return LoadedAdapter(HOSTILE_ID, 8, weights)


def _force_resident(engine: Engine, adapter: LoadedAdapter, slot: int) -> LoraRequest:
    engine.lora.slots.install(slot, adapter)
    engine.lora.resident[adapter.adapter_id] = slot
    return LoraRequest(adapter.adapter_id, "/nonexistent")  # resident: never read from its path


def _victim_load(victims):
    prompts, loras, keys = [], [], []
    for i, p in enumerate(PROMPTS):
        for name in VICTIMS:
            prompts.append(p)
            loras.append(victims[name] if name else None)
            keys.append((name, i))
    return prompts, loras, keys


def _run(engine: Engine, prompts, loras, params) -> list:
    return engine.generate(prompts, params, lora=loras)


def test_a_slot_of_huge_weights_leaves_other_tenants_tokens_unchanged(base, victims):
    prompts, loras, keys = _victim_load(victims)
    clean = [r.token_ids for r in _run(_engine(base), prompts, loras, GREEDY)]

    engine = _engine(base)
    hostile = _force_resident(engine, _huge_adapter(engine, 3e38), slot=3)
    steps_shared = []
    prepare = engine.runner.prepare

    def spy(seqs, num_tokens):
        ids = {s.adapter_id for s in seqs}
        if HOSTILE_ID in ids and len(ids) > 1:
            steps_shared.append(ids)
        return prepare(seqs, num_tokens)

    engine.runner.prepare = spy
    # the hostile tenant's sequences interleaved with the victims', greedy and sampled
    mixed_prompts, mixed_loras, mixed_params, victim_rows = [], [], [], []
    for j, (p, lora) in enumerate(zip(prompts, loras)):
        victim_rows.append(len(mixed_prompts))
        mixed_prompts += [p, p]
        mixed_loras += [lora, hostile]
        mixed_params += [GREEDY, SamplingParams(max_tokens=MAX_NEW, temperature=1.0, top_p=0.9, seed=j,
                                                ignore_eos=True)]
    results = engine.generate(mixed_prompts, mixed_params, lora=mixed_loras)
    assert steps_shared, "the hostile adapter never shared a step with another tenant"
    for key, row, want in zip(keys, victim_rows, clean):
        assert results[row].token_ids == want, key
    # the hostile sequences ended like any other (their own tokens are garbage, the engine is fine)
    assert all(len(results[row + 1].token_ids) == MAX_NEW for row in victim_rows)
    # and victims that now reuse the blocks the hostile sequences wrote NaN into still get their tokens
    again = engine.generate(prompts, GREEDY, lora=loras)
    assert [r.token_ids for r in again] == clean
    assert engine.num_free_blocks() == engine.num_total_blocks


def test_stale_nan_in_every_cache_block_changes_nothing(base, victims):
    """Whatever a block's earlier owner left in it (here NaN in every slot of every block) is never read."""
    prompts, loras, _ = _victim_load(victims)
    clean = [r.token_ids for r in _run(_engine(base), prompts, loras, GREEDY)]
    engine = _engine(base)
    for cache in engine.runner.kv_caches:
        cache.fill_(float("nan"))
    assert [r.token_ids for r in _run(engine, prompts, loras, GREEDY)] == clean


def _hostile_copy(victims, tmp_path, name: str, alpha: float | None = None, b_factor: float = 1.0) -> str:
    """The qv adapter with another lora_alpha, or its lora_B weights multiplied (3e38 stays finite)."""
    from safetensors.torch import load_file, save_file

    path = str(tmp_path / name)
    shutil.copytree(victims["qv"].path, path)
    if alpha is not None:
        file = os.path.join(path, "adapter_config.json")
        with open(file) as f:
            config = json.load(f)
        config["lora_alpha"] = alpha
        with open(file, "w") as f:
            json.dump(config, f)
    if b_factor != 1.0:
        file = os.path.join(path, "adapter_model.safetensors")
        tensors = load_file(file)
        save_file({k: (v / v.abs().max() * b_factor if "lora_B" in k else v) for k, v in tensors.items()}, file)
    return path


def test_hostile_adapter_files_are_refused_by_the_engine(base, victims, tmp_path):
    """Handed straight to an engine (past registration): lora_alpha 1e300 is refused where it is added;
    lora_B weights of 3e38 (finite, so past the header checks) fail the background read with a message
    naming the tensor, that request ends with LORA_LOAD_FAILED, and the others run as without them."""
    prompts, loras, _ = _victim_load(victims)
    clean = [r.token_ids for r in _run(_engine(base), prompts, loras, GREEDY)]
    engine = _engine(base)
    alpha = LoraRequest("mallory/alpha", _hostile_copy(victims, tmp_path, "alpha", alpha=1e300))
    with pytest.raises(LoraLoadError, match="lora_alpha=1e[+]300 gives a scaling of .* over the bound of 1024"):
        engine.add_request("alpha", PROMPTS[0], GREEDY, lora=alpha)
    huge = LoraRequest("mallory/huge-b", _hostile_copy(victims, tmp_path, "huge-b", b_factor=3e38))
    big = LoraRequest("mallory/big-b", _hostile_copy(victims, tmp_path, "big-b", b_factor=1e6))
    for i, (p, lora) in enumerate(zip(prompts, loras)):
        engine.add_request(f"v{i}", p, GREEDY, lora=lora)
    engine.add_request("huge", PROMPTS[0], GREEDY, lora=huge)
    engine.add_request("big", PROMPTS[1], GREEDY, lora=big)
    tokens: dict[str, list[int]] = {}
    ends = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finished:
                ends[out.request_id] = out
    assert [tokens[f"v{i}"] for i in range(len(prompts))] == clean
    assert ends["huge"].finish_reason == LORA_LOAD_FAILED and tokens["huge"] == []
    assert "lora_B.weight' scaled by 2 holds NaN or infinite" in ends["huge"].error, ends["huge"].error
    assert ends["big"].finish_reason == LORA_LOAD_FAILED and "over the bound of 10000" in ends["big"].error


def test_a_slot_refuses_non_finite_weights(base):
    engine = _engine(base)
    bad = _huge_adapter(engine, 1.0)
    a, b = bad.weights[(1, "down_proj")]
    b[3, 5] = float("inf")
    with pytest.raises(LoraLoadError, match="layer 1 down_proj"):
        engine.lora.slots.install(0, bad)
    assert engine.lora.slots.rank[0] == 0 and not any(
        torch.count_nonzero(w[:, :, 0]) for pair in engine.lora.slots.weights.values() for w in pair)


def test_one_tenant_cannot_pin_every_adapter_slot(base, victims, tmp_path):
    """Tenant A streams long answers on 4 adapters, one per slot; tenant B's adapter request starts within a
    few steps (A's least recently used adapter is preempted: A keeps its share, half the slots), and every
    answer, A's preempted ones included, is what it is without the contention."""
    long_params = SamplingParams(max_tokens=300, temperature=0.0, ignore_eos=True)
    a_loras = [LoraRequest(f"tenant-a/n{i}", _hostile_copy(victims, tmp_path, f"a{i}", alpha=8 + i)) for i in range(4)]
    b_lora = LoraRequest("tenant-b/qv", victims["qv"].path)
    roomy = 512  # KV blocks for all five at once: the only preemption here is the slots' share
    alone = {i: _engine(base, roomy).generate([PROMPTS[i % 4]], long_params, lora=a_loras[i])[0].token_ids
             for i in range(4)}
    assert all(len(t) == 300 for t in alone.values())
    b_alone = _engine(base, roomy).generate([PROMPTS[1]], GREEDY, lora=b_lora)[0].token_ids

    engine = _engine(base, roomy)
    for i, lora in enumerate(a_loras):
        engine.add_request(f"a{i}", PROMPTS[i % 4], long_params, lora=lora)
    tokens: dict[str, list[int]] = {}
    steps = 0

    def run_until(done) -> None:
        nonlocal steps
        while not done():
            for out in engine.step():
                tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            steps += 1
            assert steps < 5000

    run_until(lambda: all(len(tokens.get(f"a{i}", [])) >= 5 for i in range(4)))  # all four slots pinned
    assert sorted(engine.resident_adapters()) == sorted(lr.adapter_id for lr in a_loras)
    engine.add_request("b", PROMPTS[1], GREEDY, lora=b_lora)
    before = steps
    run_until(lambda: len(tokens.get("b", [])) >= 1)
    assert steps - before <= 20, f"tenant B's first token took {steps - before} steps"
    assert any(len(tokens[f"a{i}"]) < 300 for i in range(4)), "A's streams ended before B started"
    assert engine.stats["lora_share_preemptions"] >= 1 and engine.stats["preemptions"] >= 1
    run_until(lambda: not engine.has_unfinished_requests())
    assert tokens["b"] == b_alone
    assert {i: tokens[f"a{i}"] for i in range(4)} == alone
