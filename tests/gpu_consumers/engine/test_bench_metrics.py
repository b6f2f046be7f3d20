"""Benchmark helpers: workload shapes and metric definitions (vllm bench serve style)."""

from __future__ import annotations

from tokenmill.benchmarks.engine.compare import Req, Run, make_workload
from tokenmill.benchmarks.harness.report import percentile as pct


def test_workload_shapes():
    m = make_workload("mixed", 50, 8192)
    assert all(32 <= len(r.prompt) <= 1024 and 16 <= r.max_tokens <= 256 for r in m)
    d = make_workload("decode-heavy", 50, 8192)
    assert all(16 <= len(r.prompt) <= 64 and 128 <= r.max_tokens <= 512 for r in d)
    s = make_workload("shared-prefix", 10, 8192)
    assert all(r.prompt[:1024] == s[0].prompt[:1024] for r in s)
    assert len({tuple(r.prompt[1024:]) for r in s}) == 10
    o = make_workload("online", 30, 8192)
    arr = [r.arrival for r in o]
    assert arr == sorted(arr) and arr[0] > 0
    assert make_workload("mixed", 5, 8192)[0].prompt == m[0].prompt  # deterministic


def test_metrics():
    reqs = [Req([1] * 10, 3, arrival=0.0), Req([1] * 5, 2, arrival=1.0)]
    run = Run("x", "online", reqs, start=100.0, end=104.0,
              token_times=[[100.5, 100.7, 101.1], [101.5, 102.5]])
    r = run.result()
    assert r["output_tokens"] == 5 and r["input_tokens"] == 15
    assert r["output_tokens_per_s"] == 5 / 4
    assert r["ttft_p50_s"] == 0.5  # (0.5, 0.5)
    # TPOT excludes the first token: (101.1-100.5)/2 = 0.3, (102.5-101.5)/1 = 1.0
    assert abs(r["tpot_p50_s"] - 0.65) < 1e-9
    # ITL pools all gaps: 0.2, 0.4, 1.0
    assert abs(r["itl_p50_s"] - 0.4) < 1e-9
    assert pct([1, 2, 3, 4], 50) == 2.5
