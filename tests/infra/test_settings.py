"""The settings registry (infra/settings.py): the README's table is generated from it, every variable the code
names is declared there, values parse by their type, and only the registry's reader touches the environment."""
import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

from infra import env_setting, settings

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ["ingress", "streams", "gpu_consumers", "billing_pipeline", "infra", "schemas", "schedulers", "tokenmill",
            "lora", "structured_outputs", "http_api", "formats"]
# The registry's reader, and the engine's kernels (the engine imports no tokenmill package: the C compiler and
# the kernel cache directory are the only variables it reads, neither tokenmill's own).
READS_THE_ENVIRONMENT = {"infra/env_setting.py", "gpu_consumers/engine/kernels/native_library.py"}


def _sources(skip_benchmarks: bool = False):
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            rel = str(path.relative_to(ROOT))
            if skip_benchmarks and rel.startswith("tokenmill/benchmarks/"):
                continue
            yield rel, path.read_text()


def test_the_readme_table_is_the_generated_one():
    readme = ROOT.joinpath("README.md").read_text()
    table = readme.split("tests/infra/test_settings.py keeps it so -->\n\n", 1)[1].split("\n<!-- end of", 1)[0]
    assert table == env_setting.markdown_table(), "README out of date: run python -m infra.settings"


def test_every_variable_the_code_names_is_declared():
    named = set()
    for _, text in _sources():
        named |= set(re.findall(r"[\"']((?:TOKENMILL|KAFKA)_[A-Z0-9_]*[A-Z0-9])[\"']", text))
    assert {"KAFKA_BOOTSTRAP_SERVERS", "TOKENMILL_MODELS"} <= named  # the scan sees them
    assert not sorted(named - set(env_setting.REGISTRY)), "named in code, not declared in infra/settings.py"


def test_only_the_registry_reads_the_environment():
    readers = set()
    for rel, text in _sources(skip_benchmarks=True):
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv", "putenv") and \
                    isinstance(node.value, ast.Name) and node.value.id == "os":
                readers.add(rel)
    assert readers <= READS_THE_ENVIRONMENT, sorted(readers - READS_THE_ENVIRONMENT)


def test_values_parse_by_type_and_a_bad_one_names_its_variable(monkeypatch):
    monkeypatch.setenv("TOKENMILL_MAX_LORA_RANK", "16")
    monkeypatch.setenv("TOKENMILL_GRAMMAR_WARM", "0")
    monkeypatch.setenv("TOKENMILL_LOCAL_DIR", "/srv/tm")
    assert settings.MAX_LORA_RANK.get() == 16 and settings.GRAMMAR_WARM.get() is False
    assert settings.BATCH_DIR.get() == Path("/srv/tm/batches")  # a default derived from another setting
    monkeypatch.setenv("TOKENMILL_MAX_LORA_RANK", "")
    assert settings.MAX_LORA_RANK.get() == 64  # empty is unset
    monkeypatch.setenv("TOKENMILL_WORKERS", "0")
    with pytest.raises(env_setting.SettingError, match="TOKENMILL_WORKERS='0'"):
        env_setting.check_all()
    monkeypatch.setenv("TOKENMILL_WORKERS", "2")
    monkeypatch.setenv("TOKENMILL_STREAMS_TRACE", "yes")
    with pytest.raises(env_setting.SettingError, match="TOKENMILL_STREAMS_TRACE='yes': must be 0 or 1"):
        env_setting.check_all()


def test_nothing_reads_a_setting_at_import():
    """Importing every service and command reads no setting: values are read when used, after the CLI or a
    test has set them."""
    code = ("from infra import env_setting\n"
            "read = []\n"
            "get = env_setting.Setting.get\n"
            "env_setting.Setting.get = lambda self: read.append(self.name) or get(self)\n"
            "import ingress.app, streams.app, gpu_consumers.worker, billing_pipeline.service, tokenmill.cli\n"
            "import tokenmill.stack.local_stack, tokenmill.capacity, tokenmill.benchmarks\n"
            "assert not read, sorted(set(read))\n")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, timeout=300)


def test_a_service_with_a_malformed_setting_stops_at_start_with_one_line():
    env = env_setting.child_environment({"TOKENMILL_MAX_LORAS": "four"})
    done = subprocess.run([sys.executable, "-m", "tokenmill.cli", "serve", "billing"], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    assert done.stderr.strip() == "error: TOKENMILL_MAX_LORAS='four': invalid literal for int() with base 10: 'four'"
