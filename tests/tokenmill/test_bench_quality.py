"""The quality benchmark runs end to end on a tiny model: float32 agrees with its own generation at every
position (the harness's own check), int8 is measured against it, and the JSON says so."""
import json
import math

from infra.paths import REPO_ROOT
from tokenmill.benchmarks.engine import quality


def test_quality_bench_measures_int8_against_float32(tiny_model_dir, tmp_path):
    out = tmp_path / "quality.json"
    result = quality.main(["--model", str(tiny_model_dir), "--prompts", "4", "--tokens", "8",
                           "--text", str(REPO_ROOT / "README.md"), "--json", str(out)])
    float32, int8 = result["rows"]
    assert (float32["weights"], int8["weights"]) == ("float32", "int8")
    assert float32["agreement"] == 1.0
    assert 0.0 <= int8["agreement"] <= 1.0 and 0.0 <= int8["prefix"] <= 8
    assert all(math.isfinite(r["perplexity"]) and r["perplexity"] > 1 for r in (float32, int8))
    assert json.loads(out.read_text())["rows"][1]["weights"] == "int8"


def test_quality_bench_measures_a_whole_model_dtype_beside_the_quantizations(tiny_model_dir, tmp_path):
    result = quality.main(["--model", str(tiny_model_dir), "--prompts", "2", "--tokens", "4", "--quantizations", "",
                           "--dtypes", "bfloat16", "--text", str(REPO_ROOT / "README.md"),
                           "--json", str(tmp_path / "quality.json")])
    assert [r["weights"] for r in result["rows"]] == ["float32", "bfloat16"]
    bf16 = result["rows"][1]
    assert 0.0 <= bf16["agreement"] <= 1.0 and math.isfinite(bf16["perplexity"])


def test_identical_prefix_counts_leading_tokens_only():
    assert quality.identical_prefix([[1, 2, 3, 4], [5, 6]], [[1, 2, 9, 4], [7, 6]]) == 1.0
