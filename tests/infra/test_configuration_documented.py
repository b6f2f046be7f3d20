"""Every environment variable the code reads is in the README's configuration table."""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ["ingress", "streams", "gpu_consumers", "billing_pipeline", "infra", "schemas", "schedulers", "tokenmill",
            "lora", "structured_outputs", "http_api", "formats"]


def _variables_in_code() -> set[str]:
    found = set()
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            # as a string: a name the code looks up (not a Python constant spelled alike)
            found |= set(re.findall(r"[\"']((?:TOKENMILL|KAFKA)_[A-Z0-9_]*[A-Z0-9])[\"']", path.read_text()))
    return found


def test_every_variable_the_code_reads_is_documented():
    table = ROOT.joinpath("README.md").read_text().split("## Configuration", 1)[1].split("\n## ", 1)[0]
    documented = set(re.findall(r"`((?:TOKENMILL|KAFKA)_[A-Z0-9_]+)`", table))
    in_code = _variables_in_code()
    assert {"KAFKA_BOOTSTRAP_SERVERS", "TOKENMILL_MODELS", "TOKENMILL_STREAMS_ADVERT_TTL_S"} <= in_code  # the scan sees them
    missing = sorted(in_code - documented)
    assert not missing, f"not in the README's configuration table: {missing}"
