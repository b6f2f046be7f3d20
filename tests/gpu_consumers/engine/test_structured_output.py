"""Structured output in the engine: with a random model, every answer that ends by itself matches
its schema, under sampling, n > 1, batching, preemption and resumption; a failing constraint ends
only its own sequence."""
from __future__ import annotations

import json

import jsonschema
import pytest
from transformers import AutoTokenizer

from gpu_consumers.engine import Engine, SamplingParams
from gpu_consumers.engine.core.sequence import CONSTRAINT_VIOLATED
from structured_outputs.grammars import GrammarCompiler

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "role"],
          "properties": {"name": {"type": "string", "maxLength": 6},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "role": {"enum": ["admin", "user", "guest"]},
                         "tags": {"type": "array", "items": {"type": "string", "maxLength": 3}, "maxItems": 2}}}
PROMPT = [5, 17, 42, 99, 130, 7, 250]


@pytest.fixture(scope="module")
def grammars(tok_model_dir):
    tok = AutoTokenizer.from_pretrained(tok_model_dir)
    return GrammarCompiler(tok, 512, [tok.eos_token_id])


def constrained(grammars, schema=PERSON, spec=None, **kw) -> SamplingParams:
    params = SamplingParams(**{"max_tokens": 200, "temperature": 1.0, **kw})
    spec = spec or {"type": "json_schema", "schema": schema}
    params.constraint = grammars.factory(grammars.compile(spec))  # compiled once, then cached
    return params


def tool_calls_of(text: str):
    from ingress.serving.tool_calls import ToolCallParser

    parser = ToolCallParser("c")
    parser.feed(text)
    parser.finish()
    return parser


def engine(tok_model_dir, **kw) -> Engine:
    return Engine.from_pretrained(tok_model_dir, **{"num_kv_blocks": 512, "block_size": 8, **kw})


def test_every_sampled_answer_matches_the_schema(tok_model_dir, grammars):
    results = engine(tok_model_dir).generate([PROMPT] * 40, [constrained(grammars, seed=s) for s in range(40)])
    stopped = [r for r in results if r.finish_reason == "stop"]
    assert len(stopped) >= 36  # a random model still ends almost every bounded answer by itself
    for r in stopped:
        jsonschema.validate(json.loads(r.text), PERSON)
    for r in results:
        assert r.finish_reason in ("stop", "length")


def test_json_object_mode_gives_a_json_object(tok_model_dir, grammars):
    params = [constrained(grammars, spec={"type": "json_object"}, max_tokens=120, temperature=0.7, seed=s)
              for s in range(12)]
    for r in engine(tok_model_dir).generate([PROMPT] * 12, params):
        if r.finish_reason == "stop":
            assert isinstance(json.loads(r.text), dict)


def test_each_of_n_choices_has_its_own_matcher(tok_model_dir, grammars):
    [r] = engine(tok_model_dir).generate([PROMPT], constrained(grammars, n=4, seed=3))
    texts = [c.text for c in r.choices if c.finish_reason == "stop"]
    assert len(texts) >= 3 and len(set(texts)) > 1
    for t in texts:
        jsonschema.validate(json.loads(t), PERSON)


def test_a_seeded_constrained_answer_is_the_same_alone_and_in_a_mixed_batch(tok_model_dir, grammars):
    alone = engine(tok_model_dir).generate([PROMPT], constrained(grammars, seed=11))[0]
    others = [SamplingParams(max_tokens=30, temperature=1.0, seed=s, ignore_eos=True) for s in range(5)]
    mixed = engine(tok_model_dir).generate([PROMPT[:3]] * 5 + [PROMPT], others + [constrained(grammars, seed=11)])
    assert mixed[-1].token_ids == alone.token_ids and mixed[-1].finish_reason == alone.finish_reason


def test_max_tokens_cuts_with_length(tok_model_dir, grammars):
    [r] = engine(tok_model_dir).generate([PROMPT], constrained(grammars, seed=1, max_tokens=4))
    assert r.finish_reason == "length" and len(r.token_ids) == 4
    with pytest.raises(json.JSONDecodeError):
        json.loads(r.text)


def test_preemption_by_recompute_keeps_the_answer(tok_model_dir, grammars):
    prompts = [PROMPT + [i] * 20 for i in range(6)]
    params = [constrained(grammars, seed=s) for s in range(6)]
    roomy = engine(tok_model_dir).generate(prompts, params)
    tight = engine(tok_model_dir, num_kv_blocks=30)
    out = tight.generate(prompts, [constrained(grammars, seed=s) for s in range(6)])
    assert tight.scheduler.num_preemptions > 0
    assert [r.token_ids for r in out] == [r.token_ids for r in roomy]


def test_a_resumed_request_replays_its_tokens_into_the_matcher(tok_model_dir, grammars):
    whole = engine(tok_model_dir).generate([PROMPT], constrained(grammars, seed=21))[0]
    cut = 7
    assert len(whole.token_ids) > cut
    resumed = engine(tok_model_dir)
    resumed.add_request("r", PROMPT, constrained(grammars, seed=21), resume_token_ids=whole.token_ids[:cut])
    rest = []
    while resumed.has_unfinished_requests():
        for out in resumed.step():
            rest += out.new_token_ids
    assert whole.token_ids[:cut] + rest == whole.token_ids
    with pytest.raises(ValueError, match="response_format"):  # tokens the grammar forbids cannot resume
        resumed.add_request("bad", PROMPT, constrained(grammars, seed=21), resume_token_ids=[300, 301])


class Refusing:
    def fill_bitmask(self, bitmask, row):
        pass

    def accept(self, token_id):
        return False

    def is_complete(self):
        return False


def test_a_failing_constraint_ends_only_its_own_sequence(tok_model_dir, grammars):
    broken = SamplingParams(max_tokens=10, temperature=0.0)
    broken.constraint = Refusing
    fine = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    out = engine(tok_model_dir).generate([PROMPT, PROMPT], [broken, fine])
    assert out[0].finish_reason == CONSTRAINT_VIOLATED
    assert out[1].finish_reason == "length" and len(out[1].token_ids) == 10


WEATHER = {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
           "properties": {"city": {"type": "string", "maxLength": 8}, "unit": {"enum": ["c", "f"]}}}
ADD = {"type": "object", "additionalProperties": False, "required": ["a", "b"],
       "properties": {"a": {"type": "integer", "minimum": -99, "maximum": 99},
                      "b": {"type": "integer", "minimum": -99, "maximum": 99}}}


@pytest.mark.parametrize("mode, parallel", [("required", True), ("required", False), ("auto", True)])
def test_tool_call_arguments_always_match_their_function(tok_model_dir, grammars, mode, parallel):
    spec = {"type": "tool_calls", "mode": mode, "parallel": parallel,
            "tools": [{"name": "weather", "parameters": WEATHER}, {"name": "add", "parameters": ADD}]}
    params = [constrained(grammars, spec=spec, max_tokens=120, seed=seed) for seed in range(24)]
    calls = 0
    for r in engine(tok_model_dir).generate([PROMPT] * 24, params):
        parser = tool_calls_of(r.text)
        # a random model rarely stops calling when it may call again: check every call it closed
        closed = parser.calls[:-1] if parser._in_call else parser.calls
        if r.finish_reason == "stop" and mode == "required":
            assert parser.calls and parser.text == "" and not parser._in_call
            assert parallel or len(parser.calls) == 1
        for c in closed:
            jsonschema.validate(json.loads(c["arguments"]), {"weather": WEATHER, "add": ADD}[c["name"]])
        calls += len(closed)
    if mode == "required":
        assert calls >= 8  # measured: 12 closed calls in 24 answers (parallel), more without


def test_unconstrained_neighbours_get_the_tokens_they_get_without_it(tok_model_dir, grammars):
    free = [SamplingParams(max_tokens=30, temperature=1.0, seed=s, ignore_eos=True) for s in range(4)]
    alone = engine(tok_model_dir).generate([PROMPT[:4]] * 4, free)
    free = [SamplingParams(max_tokens=30, temperature=1.0, seed=s, ignore_eos=True) for s in range(4)]
    mixed = engine(tok_model_dir).generate([PROMPT[:4]] * 4 + [PROMPT], free + [constrained(grammars, seed=9)])
    assert [r.token_ids for r in mixed[:4]] == [r.token_ids for r in alone]


def test_chunked_prefill_prefix_cache_logprobs_and_stop_strings_keep_the_answer_valid(tok_model_dir, grammars):
    long_prompt = PROMPT * 12  # 84 tokens: prefilled over several 16-token steps
    eng = engine(tok_model_dir, max_num_batched_tokens=16, max_num_seqs=4, enable_prefix_caching=True)
    first = eng.generate([long_prompt], constrained(grammars, seed=4, logprobs=2))[0]
    again = eng.generate([long_prompt], constrained(grammars, seed=4, logprobs=2))[0]
    assert again.cached_tokens > 0 and again.token_ids == first.token_ids  # a prefix-cache hit changes nothing
    assert len(first.choices[0].logprobs) == len(first.token_ids)
    if first.finish_reason == "stop":
        jsonschema.validate(json.loads(first.text), PERSON)
    [cut] = engine(tok_model_dir).generate([PROMPT], constrained(grammars, seed=4, stop=['"age"']))
    assert cut.finish_reason == "stop" and '"age"' not in cut.text and cut.text.startswith('{"name": ')


def test_tool_parameters_with_defs_and_recursion_are_kept(tok_model_dir, grammars):
    order = {"$defs": {"Item": {"type": "object", "additionalProperties": False, "required": ["sku", "qty"],
                                "properties": {"sku": {"type": "string", "maxLength": 4},
                                               "qty": {"type": "integer", "minimum": 1, "maximum": 9}}}},
             "type": "object", "additionalProperties": False, "required": ["items"],
             "properties": {"items": {"type": "array", "maxItems": 2, "items": {"$ref": "#/$defs/Item"}}}}
    tree = {"type": "object", "additionalProperties": False, "required": ["name", "kids"],
            "properties": {"name": {"type": "string", "maxLength": 3},
                           "kids": {"type": "array", "maxItems": 1, "items": {"$ref": "#"}}}}
    spec = {"type": "tool_calls", "mode": "required", "parallel": False,
            "tools": [{"name": "order", "index": 0, "parameters": order}, {"name": "tree", "index": 1, "parameters": tree}]}
    params = [constrained(grammars, spec=spec, max_tokens=150, seed=seed) for seed in range(16)]
    checked = 0
    for r in engine(tok_model_dir).generate([PROMPT] * 16, params):
        if r.finish_reason != "stop":
            continue
        [call] = tool_calls_of(r.text).calls
        jsonschema.validate(json.loads(call["arguments"]), {"order": order, "tree": tree}[call["name"]])
        checked += 1
    assert checked >= 8


@pytest.mark.parametrize("schema, where", [
    ({"allOf": [{"type": "integer"}, {"minimum": 3}]}, "#/allOf"),
    ({"type": "object", "properties": {"x": {"oneOf": [{"type": "integer"}, {"type": "number"}]}}},
     "#/properties/x/oneOf"),
])
def test_combinators_the_grammar_would_not_keep_are_refused(grammars, schema, where):
    from structured_outputs.grammars import GrammarError

    with pytest.raises(GrammarError, match=where):
        grammars.compile({"type": "json_schema", "schema": schema})
