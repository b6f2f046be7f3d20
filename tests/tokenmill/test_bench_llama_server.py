"""The llama-server peer of `bench serve` (tokenmill/benchmarks/engine/llama_server.py): what it is started with and
how the two runs are compared. Running it needs llama.cpp built; `tokenmill bench serve
--compare-llama-server` does that (docs/benchmarks.md)."""
from __future__ import annotations

from pathlib import Path

from tokenmill.benchmarks.engine import llama_server
from tokenmill.benchmarks.harness.streaming_client import Outcome, carries_tokens
from tokenmill.benchmarks.platform.serve import summarize


def test_the_server_gets_one_slot_per_request_in_flight_each_with_its_own_share_of_the_context():
    cmd = llama_server.server_command(Path("m.gguf"), 8123, slots=16, tokens_per_slot=600, threads=1)
    arg = dict(zip(cmd[1::2], cmd[2::2]))
    assert arg["--parallel"] == "16" and arg["--ctx-size"] == str(16 * 600)  # llama-server splits it per slot
    assert arg["--threads"] == arg["--threads-batch"] == "1" and arg["--port"] == "8123"
    assert "--no-repack" not in cmd
    assert "--no-repack" in llama_server.server_command(Path("m.gguf"), 8123, 16, 600, 1, repack=False)


def test_a_slot_fits_the_longest_prompt_and_output_of_the_workload():
    # SmolLM2's tokenizer makes up to ~3.2 tokens of one of bench serve's random words
    assert llama_server.tokens_per_slot(128, 32, 0.0, 0) >= 128 * 3.2 + 32
    longer = llama_server.tokens_per_slot(128, 32, 0.5, 64)
    assert longer >= (192 + 64) * 3.2 + 48


def outcome(ttft: float, tokens: int, e2e: float) -> Outcome:
    o = Outcome(phase="steady", ok=True, ttft_s=ttft, e2el_s=e2e, output_tokens=tokens, prompt_tokens=10)
    o.itl_s = [(e2e - ttft) / (tokens - 1)] * (tokens - 1)
    return o


def test_the_comparison_is_tokenmill_over_the_peer_on_the_same_metrics():
    fast = summarize([outcome(0.1, 11, 1.1)] * 4, duration_s=2.0)
    slow = summarize([outcome(0.2, 11, 2.2)] * 4, duration_s=4.0)
    rows = {r["metric"]: r for r in llama_server.compare(fast, slow)}
    assert abs(rows["output_throughput"]["ratio"] - 2.0) < 1e-9 and rows["output_throughput"]["higher_is_better"]
    assert abs(rows["ttft_ms p50"]["ratio"] - 0.5) < 1e-9 and not rows["ttft_ms p50"]["higher_is_better"]
    table = llama_server.format_comparison(list(rows.values()))
    assert "tpot_ms p50" in table and "0.500" in table


def test_a_metric_the_peer_lacks_has_no_ratio():
    ok = summarize([outcome(0.1, 11, 1.1)], duration_s=1.0)
    nothing = summarize([Outcome(phase="steady")], duration_s=1.0)
    rows = {r["metric"]: r for r in llama_server.compare(ok, nothing)}
    assert rows["ttft_ms p50"]["ratio"] is None


def test_only_chunks_with_text_count_as_tokens_reaching_the_client():
    assert carries_tokens({"choices": [{"text": " a", "finish_reason": None}]})
    assert carries_tokens({"choices": [{"delta": {"role": "assistant", "content": "Hi"}}]})
    assert carries_tokens({"choices": [{"delta": {"tool_calls": [{"index": 0}]}}]})
    # llama-server closes a stream with an empty choice that has only the finish reason (and the usage)
    assert not carries_tokens({"choices": [{"text": "", "finish_reason": "length"}], "usage": {}})
    assert not carries_tokens({"choices": [], "usage": {"completion_tokens": 8}})
