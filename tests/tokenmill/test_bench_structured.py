"""The structured-output benchmark runs end to end on a tiny model and reports what it measured."""
import json

import jsonschema

from tokenmill.benchmarks.engine import structured


def test_structured_bench_reports_every_run(tiny_model_dir):
    result = structured.run(str(tiny_model_dir), batch=4, max_tokens=12, repeats=1, rounds=2)
    assert [r["run"] for r in result["runs"]] == ["unconstrained", "half constrained", "all constrained"]
    assert [r["constrained"] for r in result["runs"]] == [0, 2, 4]
    assert result["runs"][0]["full_batch_step_p50_ratio"] == 1.0
    assert all(r["rounds"] == 2 and r["full_batch_steps"] > 0 for r in result["runs"])
    assert result["compile"]["schemas"] == len(structured.SCHEMAS)
    assert result["compile"]["cached_p50_ms"] < result["compile"]["compile_p50_ms"]
    json.dumps(result)  # written as JSON by `bench engine`
    assert "all constrained" in structured.format_report(result)


def test_the_benchmark_schemas_are_valid_json_schemas():
    for schema in structured.SCHEMAS.values():
        jsonschema.Draft202012Validator.check_schema(schema)
