"""TOKENMILL_MODELS: a directory that is not a checkpoint stops a service at start-up, in one line."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from infra.config import default_model_dir, DEFAULT_MODEL_NAME, NotACheckpoint, served_models

REPO = Path(__file__).resolve().parents[2]


def test_the_default_is_the_real_model(monkeypatch):
    monkeypatch.delenv("TOKENMILL_MODELS", raising=False)
    assert {n: s.path for n, s in served_models(check=False).items()} == {DEFAULT_MODEL_NAME: default_model_dir()}


def test_several_checkpoints_are_served_by_name(monkeypatch, tiny_model_dir):
    monkeypatch.setenv("TOKENMILL_MODELS", f"a={tiny_model_dir}, b={tiny_model_dir}")
    assert list(served_models()) == ["a", "b"]


@pytest.mark.parametrize("make, reason", [
    (lambda d: d / "missing", "no such directory"),
    (lambda d: d, "it lacks config.json, safetensors weights, a tokenizer"),
])
def test_a_directory_that_is_not_a_checkpoint_is_named_with_why(monkeypatch, tmp_path, tiny_model_dir, make,
                                                                 reason):
    bad = make(tmp_path)
    monkeypatch.setenv("TOKENMILL_MODELS", f"good={tiny_model_dir},bad={bad}")
    with pytest.raises(NotACheckpoint) as failure:
        served_models()
    assert str(failure.value).startswith("TOKENMILL_MODELS: ")
    assert f"bad={bad} is not a checkpoint directory: {reason}" in str(failure.value)
    assert "\n" not in str(failure.value)


def test_an_item_without_a_path_is_refused(monkeypatch):
    monkeypatch.setenv("TOKENMILL_MODELS", "just-a-name")
    with pytest.raises(NotACheckpoint, match="is not name=checkpoint_dir"):
        served_models()


@pytest.mark.parametrize("command", [["up"], ["serve", "ingress", "--port", "1"]])
def test_up_and_ingress_refuse_it_before_starting_anything(tmp_path, command):
    env = {**os.environ, "TOKENMILL_MODELS": f"broken={tmp_path}", "TOKENMILL_LOCAL_DIR": str(tmp_path / "local")}
    done = subprocess.run([sys.executable, "-m", "tokenmill.cli", *command], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    last = done.stderr.strip().splitlines()
    assert len(last) == 1 and f"broken={tmp_path} is not a checkpoint directory" in last[0], done.stderr
    assert not (tmp_path / "local" / "run").exists()  # nothing was started


def test_a_worker_refuses_a_directory_that_is_not_a_checkpoint(tmp_path):
    done = subprocess.run([sys.executable, "-m", "tokenmill.cli", "serve", "worker", "--model", str(tmp_path)],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    assert done.stderr.strip().splitlines()[-1] == (f"worker: --model {tmp_path} is not a checkpoint directory: it "
                                                    "lacks config.json, safetensors weights, a tokenizer")
