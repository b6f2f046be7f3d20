"""The capacity planner's arithmetic, its benchmark reading and its refusals of bad input."""
from __future__ import annotations

import json
import math

import pytest
from hypothesis import given, strategies as st

from tokenmill import capacity
from tokenmill.capacity import CapacityError, plan, rate_from_bench


def test_twenty_million_requests_a_day():
    p = plan(20e6, 1300, worker_tokens_per_s=2500, output_fraction=0.25, headroom=0.3, peak_factor=5)
    assert p.avg_requests_per_s == pytest.approx(231.48, abs=0.01)
    assert p.avg_tokens_per_s == pytest.approx(300_925.9, abs=0.1)
    assert p.avg_input_tokens_per_s == pytest.approx(225_694.4, abs=0.1)
    assert p.avg_output_tokens_per_s == pytest.approx(75_231.5, abs=0.1)
    assert p.peak_requests_per_s == pytest.approx(1157.4, abs=0.1)
    assert p.peak_tokens_per_s == pytest.approx(1_504_629.6, abs=0.1)
    assert p.usable_tokens_per_s_per_worker == pytest.approx(1750)
    assert p.workers_for_average == math.ceil(300_925.93 / 1750) == 172
    assert p.workers_for_peak == math.ceil(1_504_629.6 / 1750) == 860
    assert p.tokens_per_day == 26e9
    assert any("partitions of `work`" in n for n in p.notes)


def test_exact_fit_does_not_round_up_a_worker():
    # 86,400 requests/day = 1 req/s; 1000 tokens each; a worker usable at exactly 1000 tokens/s
    p = plan(86_400, 1000, worker_tokens_per_s=1000, headroom=0.0, peak_factor=1)
    assert p.avg_requests_per_s == 1.0
    assert p.workers_for_average == p.workers_for_peak == 1
    assert not p.notes


def test_tiny_demand_still_needs_one_worker():
    assert plan(1, 1, worker_tokens_per_s=1e6).workers_for_peak == 1


@given(rpd=st.floats(1, 1e10), tpr=st.floats(1, 1e5), rate=st.floats(1, 1e7),
       headroom=st.floats(0, 0.95), peak=st.floats(1, 20), frac=st.floats(0, 1))
def test_workers_cover_the_peak(rpd, tpr, rate, headroom, peak, frac):
    p = plan(rpd, tpr, rate, output_fraction=frac, headroom=headroom, peak_factor=peak)
    usable = rate * (1 - headroom)
    assert p.workers_for_peak * usable >= p.peak_tokens_per_s * (1 - 1e-9)
    assert (p.workers_for_peak - 1) * usable < p.peak_tokens_per_s or p.workers_for_peak == 1
    assert p.workers_for_average <= p.workers_for_peak
    assert p.avg_input_tokens_per_s + p.avg_output_tokens_per_s == pytest.approx(p.avg_tokens_per_s)


@pytest.mark.parametrize("kwargs, message", [
    ({"requests_per_day": 0}, "--requests-per-day must be a positive"),
    ({"requests_per_day": -5}, "--requests-per-day must be a positive"),
    ({"requests_per_day": float("nan")}, "--requests-per-day must be a positive"),
    ({"requests_per_day": float("inf")}, "--requests-per-day must be a positive"),
    ({"tokens_per_request": 0}, "--tokens-per-request must be a positive"),
    ({"worker_tokens_per_s": 0}, "worker tokens/s must be a positive"),
    ({"output_fraction": 1.5}, "--output-fraction must be between 0 and 1"),
    ({"output_fraction": -0.1}, "--output-fraction must be between 0 and 1"),
    ({"headroom": 1.0}, "--headroom must be in [0, 1)"),
    ({"headroom": -0.2}, "--headroom must be in [0, 1)"),
    ({"peak_factor": 0.5}, "--peak-factor must be >= 1"),
])
def test_bad_input_is_refused_with_a_clear_message(kwargs, message):
    args = {"requests_per_day": 20e6, "tokens_per_request": 1300, "worker_tokens_per_s": 2500, **kwargs}
    with pytest.raises(CapacityError, match=message.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        plan(**args)


def _bench(tmp_path, rows):
    path = tmp_path / "bench.json"
    path.write_text(json.dumps({"machine": {}, "results": rows}))
    return str(path)


ROWS = [
    {"system": "transformers-cb", "workload": "decode-heavy", "input_tokens": 2019, "output_tokens": 14105,
     "output_tokens_per_s": 190.9, "total_tokens_per_s": 218.3},
    {"system": "tokenmill-prefix-on", "workload": "decode-heavy", "input_tokens": 2019, "output_tokens": 14105,
     "output_tokens_per_s": 437.9, "total_tokens_per_s": 500.4},
    {"system": "tokenmill-prefix-on", "workload": "mixed", "input_tokens": 10000, "output_tokens": 2700,
     "output_tokens_per_s": 300.0, "total_tokens_per_s": 1411.0},
    {"system": "tokenmill-prefix-on", "workload": "shared-prefix", "input_tokens": 25000, "output_tokens": 700,
     "output_tokens_per_s": 90.0, "total_tokens_per_s": 9000.0},
]


def test_bench_rate_picks_prefix_on_with_the_closest_mix(tmp_path):
    path = _bench(tmp_path, ROWS)
    # 25% output is closer to mixed (21%) than to decode-heavy (87%); shared-prefix is never picked by default
    rate = rate_from_bench(path, output_fraction=0.25)
    assert rate.total_tokens_per_s == 1411.0 and "mixed" in rate.source
    rate = rate_from_bench(path, output_fraction=0.8)
    assert rate.total_tokens_per_s == 500.4 and "decode-heavy" in rate.source
    assert rate_from_bench(path, workload="shared-prefix").total_tokens_per_s == 9000.0


def test_bench_with_only_decode_heavy(tmp_path):
    rate = rate_from_bench(_bench(tmp_path, ROWS[:2]), output_fraction=0.25)
    assert rate.total_tokens_per_s == 500.4
    p = plan(20e6, 1300, rate.total_tokens_per_s, bench_output_fraction=rate.output_fraction)
    assert any("differs from the demand's" in n for n in p.notes)


@pytest.mark.parametrize("content, message", [
    (None, "benchmark file not found"),
    ("{not json", "cannot read benchmark JSON"),
    ('{"rows": []}', "has no 'results' list"),
    (json.dumps({"results": ROWS[:1]}), "no usable tokenmill-prefix-on result"),
    (json.dumps({"results": [{"system": "tokenmill-prefix-on", "workload": "mixed", "error": "boom"}]}),
     "no usable tokenmill-prefix-on result"),
])
def test_bad_bench_files(tmp_path, content, message):
    path = tmp_path / "b.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(CapacityError, match=message):
        rate_from_bench(str(path))


def test_cli_prints_the_explained_table(tmp_path, capsys):
    out_json = tmp_path / "plan.json"
    result = capacity.main(["--requests-per-day", "20e6", "--tokens-per-request", "1300",
                            "--worker-tokens-per-s", "2500", "--json", str(out_json)])
    text = capsys.readouterr().out
    assert "231.5" in text and "300,925.9" in text and "860" in text and "20,000,000 / 86,400 s" in text
    assert json.loads(out_json.read_text())["workers_for_peak"] == result.workers_for_peak == 860


def test_cli_from_bench(tmp_path, capsys):
    result = capacity.main(["--requests-per-day", "1e6", "--tokens-per-request", "1300",
                            "--from-bench", _bench(tmp_path, ROWS)])
    assert result.worker_tokens_per_s == 1411.0
    assert "tokenmill-prefix-on on mixed" in capsys.readouterr().out


@pytest.mark.parametrize("argv, message", [
    (["--requests-per-day", "lots", "--tokens-per-request", "1300", "--worker-tokens-per-s", "1"], "not a number"),
    (["--requests-per-day", "-1", "--tokens-per-request", "1300", "--worker-tokens-per-s", "1"],
     "--requests-per-day must be a positive"),
    (["--requests-per-day", "1e6", "--tokens-per-request", "1300", "--worker-tokens-per-s", "1",
      "--from-bench", "x.json"], "not allowed with"),
    (["--requests-per-day", "1e6", "--tokens-per-request", "1300", "--from-bench", "/nonexistent.json"],
     "benchmark file not found"),
])
def test_cli_errors_exit_2_with_a_message(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        capacity.main(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_without_a_source_the_last_engine_benchmark_is_used(tmp_path, monkeypatch, capsys):
    last = tmp_path / "engine.json"
    monkeypatch.setattr(capacity, "last_engine_bench", lambda: last)
    with pytest.raises(SystemExit) as exc:
        capacity.main(["--requests-per-day", "1e6", "--tokens-per-request", "1300"])
    assert exc.value.code == 2
    assert "run `tokenmill bench engine --quick` first" in capsys.readouterr().err
    last.write_text(json.dumps({"machine": {}, "results": ROWS}))
    result = capacity.main(["--requests-per-day", "1e6", "--tokens-per-request", "1300"])
    assert result.worker_tokens_per_s == 1411.0 and str(last) in result.worker_rate_source


def test_the_console_command_exits_0_after_printing_the_plan(capsys):
    from tokenmill import cli

    status = cli.main(["capacity", "--requests-per-day", "1e6", "--tokens-per-request", "1300",
                       "--worker-tokens-per-s", "500"])
    assert not status  # what the console script passes to sys.exit: None or 0, not the Plan
    assert "plan for" in capsys.readouterr().out
