"""LoRA adapters in the engine (issue 34, docs/lora.md), on a tiny random Llama against PEFT: greedy
tokens equal PEFT's for each adapter alone, in one batch mixing 4 adapters and the base model, under
chunked prefill and preemption; prefix caching keyed by adapter; LRU eviction with more adapters than
slots; seeded sampling, structured output and resumption with an adapter; bad adapter directories end
with a clear LoraLoadError, a failed background read with LORA_LOAD_FAILED, never a hang."""
from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM

from gpu_consumers.engine import (LORA_LOAD_FAILED, Engine, LoraLoadError, LoraRequest, SamplingParams)
from formats.adapter_files import BaseShapes, validate_adapter_dir
from gpu_consumers.engine.model.model_config import ModelConfig
from tests.support.peft_reference import peft_greedy_each

MAX_NEW = 12
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# (seed, r, lora_alpha, target modules, use_rslora): ranks, scalings and targets all differ
ADAPTERS = {
    "qv": (1, 8, 16, ["q_proj", "v_proj"], False),
    "all-rs": (2, 4, 8, ALL, True),
    "mlp": (3, 16, 8, ["gate_proj", "up_proj", "down_proj"], False),
    "attn": (4, 2, 4, ["k_proj", "o_proj"], False),
    "qv2": (5, 8, 16, ["q_proj", "v_proj"], False),
}


def make_adapter(base_dir: str, out_dir: str, seed: int, r: int, alpha: float, targets: list[str],
                 rslora: bool = False, std: float = 0.15) -> str:
    """A PEFT adapter with random non-zero lora_A and lora_B (PEFT's own init leaves B at zero)."""
    from peft import LoraConfig, get_peft_model

    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    peft_model = get_peft_model(model, LoraConfig(r=r, lora_alpha=alpha, target_modules=targets,
                                                  use_rslora=rslora, lora_dropout=0.0))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * std)
    peft_model.save_pretrained(out_dir)
    return out_dir


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(11)
    shared = torch.randint(3, 512, (21,), generator=g).tolist()
    return [torch.randint(3, 512, (n,), generator=g).tolist() for n in (1, 7, 30)] + [shared + [9, 8, 7]]


PROMPTS = _prompts()


@pytest.fixture(scope="module")
def base(model_dirs) -> str:
    return model_dirs["llama-gqa-rope3"]


@pytest.fixture(scope="module")
def adapters(base, tmp_path_factory) -> dict[str, LoraRequest]:
    root = tmp_path_factory.mktemp("adapters")
    return {name: LoraRequest(f"tenant/{name}", make_adapter(base, str(root / name), *spec))
            for name, spec in ADAPTERS.items()}


@pytest.fixture(scope="module")
def reference(base, adapters) -> dict[str | None, list[list[int]]]:
    return peft_greedy_each(base, {None: None, **{name: lr.path for name, lr in adapters.items()}}, PROMPTS, MAX_NEW)


def _engine(base, **kw) -> Engine:
    return Engine.from_pretrained(base, **{"num_kv_blocks": 256, "block_size": 4, "max_num_seqs": 32,
                                           "max_num_batched_tokens": 128, **kw})


def _tokens(results) -> list[list[int]]:
    return [r.token_ids for r in results]


def test_adapters_change_the_output(reference):
    for name in ADAPTERS:
        assert reference[name] != reference[None], name


@pytest.mark.parametrize("name", list(ADAPTERS))
def test_alone_equals_peft(base, adapters, reference, name):
    engine = _engine(base, max_num_seqs=1)
    assert _tokens(engine.generate(PROMPTS, GREEDY, lora=adapters[name])) == reference[name]
    assert engine.resident_adapters() == [f"tenant/{name}"]


def _mixed(adapters, names):
    prompts, loras, keys = [], [], []
    for i, p in enumerate(PROMPTS):  # interleaved: every few queued sequences span all the adapters
        for name in names:
            prompts.append(p)
            loras.append(adapters[name] if name else None)
            keys.append((name, i))
    return prompts, loras, keys


def _record_batches(engine) -> list[set]:
    """Per step, the adapters (None: base) its batch ran with."""
    seen: list[set] = []
    prepare = engine.runner.prepare

    def spy(seqs, num_tokens):
        seen.append({s.adapter_id for s in seqs})
        return prepare(seqs, num_tokens)

    engine.runner.prepare = spy
    return seen


CONFIGS = {
    "batch": {},
    # prompts prefilled in chunks between decodes of other adapters' sequences
    "chunked": dict(max_num_seqs=8, max_num_batched_tokens=9),
    # a KV pool too small for the batch: sequences with adapters are preempted and recomputed
    "kv-pressure": dict(num_kv_blocks=24, max_num_batched_tokens=32),
}


@pytest.mark.parametrize("config", list(CONFIGS))
def test_one_batch_mixing_four_adapters_and_the_base_model(base, adapters, reference, config):
    names = [None, "qv", "all-rs", "mlp", "attn"]
    engine = _engine(base, max_loras=4, **CONFIGS[config])
    # make the four resident first, so the whole batch starts in the same step
    engine.generate([[3]] * 4, SamplingParams(max_tokens=1), lora=[adapters[n] for n in names[1:]])
    seen = _record_batches(engine)
    prompts, loras, keys = _mixed(adapters, names)
    results = engine.generate(prompts, GREEDY, lora=loras)
    for (name, i), r in zip(keys, results):
        assert r.token_ids == reference[name][i], (name, i)
    # one step ran all four adapters and the base model
    assert max(len(s) for s in seen) == 5
    if config == "kv-pressure":
        assert engine.stats["preemptions"] > 0
    assert engine.num_free_blocks() == engine.num_total_blocks


def test_base_only_batches_take_the_base_path(base, adapters, reference, monkeypatch):
    engine = _engine(base)
    assert engine.lora.slots.num_bytes() == 0  # nothing allocated until an adapter is used
    assert _tokens(engine.generate(PROMPTS, GREEDY)) == reference[None]
    engine.generate(PROMPTS[:1], GREEDY, lora=adapters["qv"])
    assert engine.lora.slots.num_bytes() > 0
    batches = []
    prepare = engine.runner.prepare
    monkeypatch.setattr(engine.runner, "prepare", lambda s, n: batches.append(prepare(s, n)) or batches[-1])
    assert _tokens(engine.generate(PROMPTS, GREEDY)) == reference[None]
    assert batches and all(b.lora is None for b in batches)


def test_prefix_cache_is_keyed_by_adapter(base, adapters, reference):
    engine = _engine(base)
    prompt = PROMPTS[2]  # 30 tokens: 7 full blocks
    first = engine.generate([prompt], GREEDY, lora=adapters["qv"])[0]
    assert first.cached_tokens == 0
    again = engine.generate([prompt], GREEDY, lora=adapters["qv"])[0]
    assert again.cached_tokens > 0 and again.token_ids == reference["qv"][2]
    other = engine.generate([prompt], GREEDY, lora=adapters["qv2"])[0]
    assert other.cached_tokens == 0 and other.token_ids == reference["qv2"][2]
    plain = engine.generate([prompt], GREEDY)[0]
    assert plain.cached_tokens == 0 and plain.token_ids == reference[None][2]
    # and the base model's cached prefix is no hit for an adapter either
    engine.generate([PROMPTS[3]], GREEDY)
    assert engine.generate([PROMPTS[3]], GREEDY, lora=adapters["mlp"])[0].cached_tokens == 0
    # a tenant's salt and the adapter together: another tenant with the same adapter id misses
    salted = engine.generate([prompt], GREEDY, cache_salt="acme", lora=adapters["qv"])[0]
    assert salted.cached_tokens == 0 and salted.token_ids == reference["qv"][2]


def test_lru_eviction_with_more_adapters_than_slots(base, adapters, reference):
    engine = _engine(base, max_loras=2)
    order = ["qv", "all-rs", "mlp", "attn", "qv"]
    for name in order:
        assert _tokens(engine.generate(PROMPTS, GREEDY, lora=adapters[name])) == reference[name], name
    assert engine.resident_adapters() == ["tenant/attn", "tenant/qv"]  # least recently used first
    assert engine.stats["lora_loads"] == 5 and engine.stats["lora_evictions"] == 3
    # least recently *used*: touching qv again makes attn the one to go
    engine.generate(PROMPTS[:1], GREEDY, lora=adapters["attn"])
    engine.generate(PROMPTS[:1], GREEDY, lora=adapters["qv"])
    engine.generate(PROMPTS[:1], GREEDY, lora=adapters["mlp"])
    assert engine.resident_adapters() == ["tenant/qv", "tenant/mlp"]


def test_more_adapters_queued_at_once_than_slots(base, adapters, reference):
    """Five adapters, two slots, everything queued together: sequences wait for a slot, none is
    evicted while it runs, every output equals PEFT's."""
    names = [None, "qv", "all-rs", "mlp", "attn", "qv2"]
    engine = _engine(base, max_loras=2)
    seen = _record_batches(engine)
    prompts, loras, keys = _mixed(adapters, names)
    results = engine.generate(prompts, GREEDY, lora=loras)
    for (name, i), r in zip(keys, results):
        assert r.token_ids == reference[name][i], (name, i)
    assert max(len(s - {None}) for s in seen) <= 2
    assert engine.stats["lora_loads"] >= 5


def test_the_base_model_runs_while_an_adapter_is_read(base, adapters, reference, monkeypatch):
    """Loading on demand does not hold other sequences: base sequences step while the read blocks."""
    import threading

    from gpu_consumers.engine.lora import manager as lora_manager

    release = threading.Event()
    real = lora_manager.load_adapter

    def slow(*a, **kw):
        release.wait(30)
        return real(*a, **kw)

    monkeypatch.setattr(lora_manager, "load_adapter", slow)
    engine = _engine(base)
    engine.add_request("base", PROMPTS[1], GREEDY)
    engine.add_request("lora", PROMPTS[1], GREEDY, lora=adapters["qv"])
    got: dict[str, list[int]] = {"base": [], "lora": []}
    while len(got["base"]) < MAX_NEW:
        for out in engine.step():
            got[out.request_id] += out.new_token_ids
    assert got["lora"] == [] and engine.stats["waiting"] == 1
    release.set()
    while engine.has_unfinished_requests():
        for out in engine.step():
            got[out.request_id] += out.new_token_ids
    assert got == {"base": reference[None][1], "lora": reference["qv"][1]}


def test_seeded_sampling_with_an_adapter_is_reproducible(base, adapters):
    params = [SamplingParams(max_tokens=MAX_NEW, temperature=0.9, seed=s, ignore_eos=True) for s in range(4)]
    alone = [_engine(base, max_num_seqs=1).generate([p], [sp], lora=adapters["all-rs"])[0].token_ids
             for p, sp in zip(PROMPTS, params)]
    engine = _engine(base)
    mixed = engine.generate(PROMPTS + PROMPTS, params + params,
                            lora=[adapters["all-rs"]] * 4 + [adapters["mlp"]] * 4)
    assert _tokens(mixed[:4]) == alone
    base_sampled = _engine(base).generate(PROMPTS, params)
    assert _tokens(base_sampled) != alone


def test_resumed_with_an_adapter_on_another_engine(base, adapters, reference):
    cut = 4
    first = _engine(base).generate(PROMPTS, SamplingParams(max_tokens=cut, temperature=0.0, ignore_eos=True),
                                   lora=adapters["mlp"])
    second = _engine(base)
    for i, (p, head) in enumerate(zip(PROMPTS, first)):
        second.add_request(f"r{i}", p, GREEDY, resume_token_ids=head.token_ids, lora=adapters["mlp"])
    tails: dict[int, list[int]] = {i: [] for i in range(len(PROMPTS))}
    while second.has_unfinished_requests():
        for out in second.step():
            tails[int(out.request_id[1:])] += out.new_token_ids
    assert [first[i].token_ids + tails[i] for i in tails] == reference["mlp"]


def test_structured_output_with_an_adapter(tok_model_dir, tmp_path):
    import jsonschema
    from transformers import AutoTokenizer

    from structured_outputs.grammars import GrammarCompiler

    schema = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
              "properties": {"name": {"type": "string", "maxLength": 6},
                             "age": {"type": "integer", "minimum": 0, "maximum": 120}}}
    tok = AutoTokenizer.from_pretrained(tok_model_dir)
    grammars = GrammarCompiler(tok, 512, [tok.eos_token_id])
    lora = LoraRequest("t/json", make_adapter(tok_model_dir, str(tmp_path / "a"), 7, 8, 16, ALL))
    params = []
    for s in range(8):
        p = SamplingParams(max_tokens=120, temperature=1.0, seed=s)
        p.constraint = grammars.factory(grammars.compile({"type": "json_schema", "schema": schema}))
        params.append(p)
    engine = Engine.from_pretrained(tok_model_dir, num_kv_blocks=256, block_size=8)
    results = engine.generate([[5, 17, 42, 99]] * 8, params, lora=[lora, None] * 4)
    stopped = [r for r in results if r.finish_reason == "stop"]
    assert len(stopped) >= 6
    for r in stopped:
        jsonschema.validate(json.loads(r.text), schema)


# ------------------------------------------------------------------------------- bad adapters
def _copy(src: str, dst) -> str:
    shutil.copytree(src, dst)
    return str(dst)


def _edit_config(path: str, **changes) -> str:
    file = os.path.join(path, "adapter_config.json")
    with open(file) as f:
        cfg = json.load(f)
    cfg.update(changes)
    with open(file, "w") as f:
        json.dump(cfg, f)
    return path


def _bad_dirs(adapters, base, model_dirs, tmp_path) -> dict[str, tuple[str, str]]:
    good = adapters["qv"].path
    other_base = make_adapter(model_dirs["llama-tied"], str(tmp_path / "other"), 9, 8, 16, ["q_proj", "v_proj"])
    truncated = _copy(good, tmp_path / "truncated")
    weights = os.path.join(truncated, "adapter_model.safetensors")
    with open(weights, "r+b") as f:
        f.truncate(os.path.getsize(weights) - 100)
    garbage = _copy(good, tmp_path / "garbage")
    with open(os.path.join(garbage, "adapter_model.safetensors"), "wb") as f:
        f.write(b"\xff" * 64)
    no_weights = _copy(good, tmp_path / "no-weights")
    os.remove(os.path.join(no_weights, "adapter_model.safetensors"))
    no_config = _copy(good, tmp_path / "no-config")
    os.remove(os.path.join(no_config, "adapter_config.json"))
    bad_json = _copy(good, tmp_path / "bad-json")
    with open(os.path.join(bad_json, "adapter_config.json"), "w") as f:
        f.write("{not json")
    return {  # name: (path, what the message must say)
        "missing dir": (str(tmp_path / "nowhere"), "does not exist"),
        "no config": (no_config, "adapter_config.json is missing"),
        "config not JSON": (bad_json, "not readable JSON"),
        "no weights": (no_weights, "adapter_model.safetensors is missing"),
        "rank over the limit": (adapters["mlp"].path, "r=16 is over the engine's max_lora_rank=8"),
        "unknown target module": (_edit_config(_copy(good, tmp_path / "embed"), target_modules=["embed_tokens"]),
                                  "['embed_tokens'] are not projections"),
        "config and weights disagree": (_edit_config(_copy(good, tmp_path / "rank"), r=4),
                                        "has shape [8, 64], expected [4, 64]"),
        "another base model": (other_base, "has shape [128, 8], expected [64, 8]"),
        "DoRA": (_edit_config(_copy(good, tmp_path / "dora"), use_dora=True), "use_dora=True is not supported"),
        "not LoRA": (_edit_config(_copy(good, tmp_path / "ia3"), peft_type="IA3"), "is not LORA"),
        "truncated weights": (truncated, "past the end of the file"),
        "not safetensors": (garbage, "not a safetensors"),
    }


def test_bad_adapter_dirs_raise_a_clear_error_at_add_request(base, adapters, model_dirs, tmp_path):
    engine = _engine(base, max_lora_rank=8)
    for name, (path, message) in _bad_dirs(adapters, base, model_dirs, tmp_path).items():
        with pytest.raises(LoraLoadError, match=None) as err:
            engine.add_request(name, PROMPTS[0], GREEDY, lora=LoraRequest(name, path))
        assert message in str(err.value), f"{name}: {err.value}"
        assert isinstance(err.value, ValueError)
    assert not engine.has_unfinished_requests() and engine.resident_adapters() == []
    # the registry side runs the same checks from the base checkpoint's config.json, without torch
    with open(os.path.join(base, "config.json")) as f:
        shapes = BaseShapes.from_config_json(json.load(f))
    assert shapes == BaseShapes.from_model_config(ModelConfig.from_pretrained(base))
    spec = validate_adapter_dir(adapters["all-rs"].path, shapes, max_rank=64)
    assert spec.rank == 4 and spec.scaling == 8 / 2 and spec.target_modules == tuple(ALL)
    with pytest.raises(LoraLoadError, match="over the limit of 100"):
        validate_adapter_dir(adapters["qv"].path, shapes, max_rank=64, max_bytes=100)


def test_a_failed_background_read_ends_the_request_with_the_error(base, adapters, reference, monkeypatch):
    from gpu_consumers.engine.lora import manager as lora_manager

    def broken(adapter_id, spec, dtype, device):
        raise LoraLoadError(f"{spec.path}/adapter_model.safetensors: cannot be read (disk error)")

    monkeypatch.setattr(lora_manager, "load_adapter", broken)
    engine = _engine(base)
    engine.add_request("lora", PROMPTS[1], GREEDY, lora=adapters["qv"])
    engine.add_request("base", PROMPTS[1], GREEDY)
    outs = {}
    for _ in range(200):
        for out in engine.step():
            outs.setdefault(out.request_id, []).append(out)
        if not engine.has_unfinished_requests():
            break
    assert not engine.has_unfinished_requests()
    failed = outs["lora"][-1]
    assert failed.finished and failed.finish_reason == LORA_LOAD_FAILED and failed.new_token_ids == []
    assert "disk error" in failed.error and len(outs["lora"]) == 1
    assert [t for o in outs["base"] for t in o.new_token_ids] == reference[None][1]
    assert engine.stats["lora_load_failures"] == 1 and engine.resident_adapters() == []
    # the next request for it reads it again (here: fixed)
    monkeypatch.undo()
    assert _tokens(engine.generate(PROMPTS[1:2], GREEDY, lora=adapters["qv"])) == reference["qv"][1:2]
