"""The grammar compiler's limits: a schema that could cost too much is refused before it compiles,
a compile that runs past its limit is stopped (its process killed, its slot freed) and remembered,
one tenant flooding slow schemas cannot take the other tenants' compile slots, a full compile queue
answers busy, and a compile that fails in an unexpected way is that spec's error."""
import os
import threading

import pytest
from transformers import AutoTokenizer

from structured_outputs import grammars
from structured_outputs.grammars import GrammarBusy, GrammarCompiler, GrammarError, compiler_for_checkpoint, spec_key
from structured_outputs.schema_limits import SchemaLimits, SchemaTooCostly, check_schema, pattern_cost
from tests.support.waiting import wait_until

SPEC = {"type": "json_schema", "schema": {"type": "object", "properties": {"a": {"type": "integer"}}}}
# 37.6 s to compile for SmolLM2's vocabulary; with {1,20} it did not finish in 60 s
PATHOLOGICAL = "^(([a-z]{1,8}){1,8}){1,8}$"


def string_spec(pattern: str) -> dict:
    return {"type": "json_schema", "schema": {"type": "object", "required": ["s"],
                                              "properties": {"s": {"type": "string", "pattern": pattern}}}}


def slow_spec(i: int) -> dict:
    """Admitted only by a compiler whose pattern limits are off, and slow to compile (seconds)."""
    return string_spec(f"^(([a-{chr(ord('k') + i)}]{{1,20}}){{1,20}}){{1,20}}$")


@pytest.fixture(scope="module")
def compiler(tiny_model_dir):
    c = compiler_for_checkpoint(tiny_model_dir, AutoTokenizer.from_pretrained(tiny_model_dir))
    yield c
    c.close()


@pytest.fixture(scope="module")
def unlimited(tiny_model_dir):
    """Two compile processes, a 1 s compile limit, and no pattern limit: slow schemas get compiled."""
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    c = GrammarCompiler(tok, len(tok), [tok.eos_token_id], processes=2, limit_s=1.0,
                        limits=SchemaLimits(max_repeat_product=10**12, max_repeat_total=10**12))
    assert c.pool.wait_all_up(600)  # its processes are up
    yield c
    c.close()


def test_pattern_cost_counts_nested_repetitions_only():
    limits = SchemaLimits()
    assert pattern_cost(PATHOLOGICAL, limits) == 512
    assert pattern_cost("^([a-z]{1,8}){1,8}$", limits) == 64
    # one bounded repetition, however large, a fixed-width body, or a fixed count are cheap
    for cheap in ("^[a-z]{1,512}$", "^(ab|cd){1,64}$", r"^(\d{3}-){2}\d{4}$",
                  r"^[a-z0-9._%+-]+@[a-z0-9.-]+\.[a-z]{2,}$", "^([A-Z][a-z]+ )+$"):
        assert pattern_cost(cheap, limits) <= limits.max_repeat_product, cheap


def test_schema_limits_name_where_the_cost_is():
    with pytest.raises(SchemaTooCostly) as deep:
        node: dict = {"type": "string"}
        for _ in range(40):
            node = {"type": "array", "items": node}
        check_schema(node)
    assert "nested more than" in str(deep.value)
    with pytest.raises(SchemaTooCostly) as keyed:
        check_schema({"type": "object", "patternProperties": {PATHOLOGICAL: {"type": "string"}}})
    assert keyed.value.path == f"#/patternProperties/{PATHOLOGICAL}"
    with pytest.raises(SchemaTooCostly):
        check_schema({"enum": list(range(5000))})
    check_schema({"enum": [{"pattern": PATHOLOGICAL}]})  # a value, not a schema: no pattern to compile


def test_refuse_costly_answers_from_the_limits_alone(compiler):
    submitted = compiler.pool.submitted
    with pytest.raises(GrammarError) as refused:
        compiler.refuse_costly(string_spec(PATHOLOGICAL + " "))
    assert "#/properties/s/pattern" in str(refused.value)
    compiler.refuse_costly(string_spec("^[a-z]{1,8}$"))  # within the limits: nothing to say, nothing compiled
    assert compiler.pool.submitted == submitted


def test_a_pathological_pattern_is_refused_before_anything_compiles(compiler):
    submitted = compiler.pool.submitted
    with pytest.raises(GrammarError) as refused:
        compiler.compile(string_spec(PATHOLOGICAL), tenant="a")
    assert refused.value.param == "response_format.json_schema.schema"
    assert "#/properties/s/pattern" in str(refused.value) and "512" in str(refused.value)
    tools = {"type": "tool_calls", "mode": "required", "parallel": False,
             "tools": [{"name": "ok", "parameters": {"type": "object"}},
                       {"name": "f", "parameters": string_spec(PATHOLOGICAL)["schema"]}]}
    with pytest.raises(GrammarError) as in_tools:
        compiler.ready(tools, tenant="a")
    assert in_tools.value.param == "tools.1.function.parameters"
    assert compiler.pool.submitted == submitted  # no compile slot was used


def test_many_patterns_each_allowed_are_refused_together_before_compiling(compiler):
    costly = "^([a-z]{1,4}){1,4}$"  # 16: at the limit for one pattern
    assert pattern_cost(costly, SchemaLimits()) == 16
    compiler.refuse_costly(string_spec(costly))  # alone it is allowed
    schema = {"type": "object", "properties": {f"p{i}": {"type": "string", "pattern": costly} for i in range(20)}}
    submitted = compiler.pool.submitted
    with pytest.raises(GrammarError, match="add up to 80 by .*TOKENMILL_MAX_SCHEMA_REPEAT_TOTAL"):
        compiler.compile({"type": "json_schema", "schema": schema}, tenant="a")
    assert compiler.pool.submitted == submitted  # refused before any compile slot was used
    simple = {"type": "object", "properties": {f"p{i}": {"type": "string", "pattern": "^[a-z]+$"} for i in range(200)}}
    check_schema(simple)  # patterns without nested repetitions cost nothing here


def test_a_compile_process_is_capped_in_memory_and_first_for_the_oom_killer(compiler):
    """Its limits, read from the kernel; and a process under them that allocates 4 GiB fails alone."""
    import subprocess
    import sys

    for child in [c for c in compiler.pool.children if c is not None]:
        limits = open(f"/proc/{child.pid}/limits").read()
        data = next(line for line in limits.splitlines() if line.startswith("Max data size"))
        assert data.split()[3] == str(2048 * 2**20), data
        assert open(f"/proc/{child.pid}/oom_score_adj").read().strip() == "1000"
    code = ("from structured_outputs.compile_child import apply_limits; apply_limits(); "
            "print(open('/proc/self/oom_score_adj').read().strip(), flush=True); b = bytearray(4 << 30)")
    hog = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert hog.returncode != 0 and "MemoryError" in hog.stderr and hog.stdout.strip() == "1000", hog
    assert compiler.compile({"type": "json_object"}, tenant="b") is not None  # and the pool serves on


def test_a_compile_past_its_limit_is_stopped_its_slot_freed_and_a_retry_fails_at_once(unlimited):
    pids = {c.pid for c in unlimited.pool.children if c is not None}
    kills = unlimited.pool.kills
    spec = slow_spec(0)
    with pytest.raises(GrammarError, match="did not compile within 1 s"):
        unlimited.compile(spec, tenant="a")
    assert unlimited.pool.kills == kills + 1
    killed = pids - {c.pid for c in unlimited.pool.children if c is not None}
    assert len(killed) == 1
    (pid,) = killed
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)  # really gone, not left running on a thread
    submitted = unlimited.pool.submitted
    with pytest.raises(GrammarError, match="did not compile within"):
        unlimited.compile(spec, tenant="a")  # remembered by digest
    assert unlimited.pool.submitted == submitted
    assert unlimited.compile({"type": "json_object"}, tenant="b") is not None  # slots still serve
    # remembered a while, not for good: an overrun may have been the machine's load
    import time

    # a spare process is started ahead after a stop: the next stopped compile's slot is back at once
    wait_until(lambda: unlimited.pool._spare is not None, 600, "a spare compile process")
    used = unlimited.pool.spares_used
    with pytest.raises(GrammarError, match="did not compile within 1 s"):
        unlimited.compile(slow_spec(13), tenant="a")
    wait_until(lambda: unlimited.pool.spares_used == used + 1, 30, "the slot taking the spare")
    assert unlimited.pool.wait_all_up(5)  # at once: no new process had to import anything
    remembered = unlimited._cache[spec_key(spec)]
    assert 0 < remembered.expires_at - time.monotonic() <= grammars.OVERRUN_REMEMBERED_S
    remembered.expires_at = time.monotonic() - 1
    assert unlimited._cached(spec_key(spec)) is None  # the next ask compiles it again


def test_a_tenant_flooding_slow_schemas_leaves_a_slot_for_the_others(unlimited, monkeypatch):
    monkeypatch.setenv("TOKENMILL_GRAMMAR_COMPILES_PER_TENANT", "8")
    assert unlimited.pool.wait_all_up(600)  # the process the last test's overrun killed is back
    flood = [slow_spec(i) for i in range(1, 9)]
    for spec in flood:  # queued in the background, as a worker would
        assert unlimited.ready(spec, tenant="attacker") is None
    with pytest.raises(GrammarBusy):  # past its own cap the attacker is busy, nobody else
        unlimited.ready(slow_spec(9), tenant="attacker")
    victim = string_spec("^[a-z]{1,16}$")
    assert unlimited.compile(victim, tenant="victim") is not None
    # the victim did not wait behind the flood: most of it is still waiting or compiling
    undone = [s for s in flood if spec_key(s) in unlimited._compiling]
    assert len(undone) >= 5
    assert unlimited.pool.queue.running("attacker") <= 1


def test_a_request_waiting_for_its_grammar_is_answered_busy_rather_than_waiting_forever(unlimited):
    # a single tenant's queue: its first slow schema holds a slot; its next ones wait behind it
    blockers = [slow_spec(i) for i in range(10, 12)]
    for spec in blockers:
        unlimited.ready(spec, tenant="solo")
    waiting = string_spec("^[b-z]{1,4}$")
    assert unlimited.ready(waiting, tenant="solo") is None
    key = spec_key(waiting)
    with unlimited._lock:  # as if it had waited a slot wait and a compile limit already
        unlimited._asked_at[key] -= grammars.queue_wait_s() + unlimited.limit_s() + 6
    with pytest.raises(GrammarBusy, match="waited"):
        unlimited.ready(waiting, tenant="solo")
    assert key not in unlimited._compiling  # given up, not left queued


def test_a_full_compile_queue_is_busy_not_a_bad_schema(compiler, monkeypatch):
    monkeypatch.setattr(grammars, "MAX_WAITING_COMPILES", 0)
    with pytest.raises(GrammarBusy):
        compiler.compile(SPEC)
    monkeypatch.setattr(grammars, "MAX_WAITING_COMPILES", 64)
    assert compiler.compile(SPEC) is not None


def test_an_unexpected_compile_failure_is_that_specs_error_and_nothing_stays_queued(compiler):
    spec = {"type": "json_schema", "probe": 1}  # no schema: the compile process fails on it
    with pytest.raises(GrammarError, match="could not be compiled: KeyError"):
        compiler.compile(spec)
    assert compiler._compiling == {}
    submitted = compiler.pool.submitted
    with pytest.raises(GrammarError):
        compiler.ready(spec)  # remembered, not compiled again and again
    assert compiler.pool.submitted == submitted


def test_compiles_from_many_threads_share_one_result(compiler):
    results, errors = [], []

    def go():
        try:
            results.append(compiler.compile(string_spec("^[a-c]{2,5}$"), tenant="t"))
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=go) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(results) == 8
