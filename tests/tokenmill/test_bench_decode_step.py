"""The decode-step benchmark runs end to end on a tiny model: the step is timed against its projections
alone, the eager engine's tokens are its own reference, and an unknown variant is refused."""
import json

import pytest

from tokenmill.benchmarks.engine import decode_step


def test_decode_step_bench_times_the_step_against_its_projections(tiny_model_dir, tmp_path):
    out = tmp_path / "decode.json"
    result = decode_step.main(["--model", str(tiny_model_dir), "--batch", "2", "--prompt", "8", "--generated", "8",
                               "--variants", "eager", "--json", str(out)])
    (eager,) = result["rows"]
    floor = result["projections"]
    assert floor["step_ms"] > 0 and floor["weight_mb"] > 0 and floor["gb_per_s"] > 0
    by_f_linear = result["projections_by_f_linear"]  # the same weights by MKL's GEMM, for the comparison
    assert by_f_linear["weight_mb"] == floor["weight_mb"] and by_f_linear["step_ms"] > 0
    assert eager["variant"] == "eager" and eager["same_tokens"] is True and eager["vs_eager"] == 1.0
    # 8 generated tokens: the first comes from the prefill, 7 from decode steps, the first 3 skipped
    assert eager["decode_steps"] == 7 - decode_step.SKIPPED_STEPS
    assert eager["beyond_projections_ms"] == pytest.approx(eager["step_ms"] - floor["step_ms"])
    assert json.loads(out.read_text())["rows"][0]["tg_tok_per_s"] == pytest.approx(2 / (eager["step_ms"] / 1e3))


def test_an_unknown_variant_is_refused(tiny_model_dir, tmp_path):
    with pytest.raises(SystemExit) as exc:
        decode_step.main(["--model", str(tiny_model_dir), "--variants", "eager,fast", "--json", str(tmp_path / "x.json")])
    assert exc.value.code == 2
