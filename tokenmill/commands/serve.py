"""`tokenmill serve SERVICE`: one service (ingress, streams, a worker, billing) in the foreground."""
from __future__ import annotations

import logging
import sys

from infra import settings
from infra.env_setting import SettingError
from infra.config import default_model_dir, DEFAULT_MODEL_NAME

# A worker's dtype unless --dtype says otherwise. On this CPU (2 cores, AVX512-BF16) bfloat16 did not
# decode the real model reliably faster than float32 (docs/benchmarks.md, "The real model"), and float32
# is the precision whose greedy tokens are tested equal to transformers'. GPUs keep bfloat16.
CPU_DTYPE = "float32"
GPU_DTYPE = "bfloat16"


def check_settings() -> None:
    """Every setting that is set parses, or the service stops before it starts anything, with one line."""
    try:
        settings.check_all()
    except SettingError as exc:
        raise SystemExit(f"error: {exc}") from None


def log_to_stdout(level: str = "INFO") -> None:
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stdout)


def serve_ingress(args) -> None:
    check_settings()
    import asyncio
    import contextlib

    import uvicorn

    from ingress.app import IngressSettings, create_admin_app, create_app
    from infra.config import admin_listener

    class AdminServer(uvicorn.Server):
        def capture_signals(self):  # the public server takes the signals; this one follows it
            return contextlib.nullcontext()

    from infra.config import NotACheckpoint, served_models

    log_to_stdout()
    try:
        models = served_models()
    except NotACheckpoint as exc:
        sys.exit(f"ingress: {exc}")
    app = create_app(IngressSettings(reply_partition=args.reply_partition, models=models))
    admin_host, admin_port = admin_listener(args.port)
    admin_host, admin_port = args.admin_host or admin_host, args.admin_port or admin_port
    public = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level="warning",
                                           access_log=False))
    admin = AdminServer(uvicorn.Config(create_admin_app(app.state.context), host=admin_host, port=admin_port,
                                       log_level="warning", access_log=False, lifespan="off"))

    async def serve_both():
        admin_serving = asyncio.create_task(admin.serve())
        try:
            await public.serve()
        finally:
            admin.should_exit = True
            await admin_serving

    logging.getLogger(__name__).info("admin API on http://%s:%d", admin_host, admin_port)
    asyncio.run(serve_both())


SUPERVISED_ENV = "TOKENMILL_STREAMS_SUPERVISED"


def serve_streams(args) -> None:
    check_settings()
    if not settings.STREAMS_SUPERVISED.get():
        # The recovery watchdog exits (status 3, streams.config.RECOVERY_EXIT_CODE) when the instance
        # is stuck, and an error in a Faust timer or agent crashes the whole app (status 1); without a
        # standby nothing else would bring the scheduler back, so this process runs the worker as a
        # child and restarts it after any exit but a clean one.
        from tokenmill.stack.processes import supervise

        raise SystemExit(supervise([sys.executable, "-m", "tokenmill.cli", "serve", "streams"],
                                   None, env={SUPERVISED_ENV: "1"}))
    log_to_stdout()
    import faust

    from streams.app import create_app

    app = create_app()
    faust.Worker(app, loglevel="WARNING").execute_from_commandline()


def serve_worker(args) -> None:
    check_settings()
    import torch

    from gpu_consumers.engine import Engine
    from gpu_consumers.refill_window import RefillWindow
    from gpu_consumers.worker import GpuWorker

    from gpu_consumers.engine import KV_CACHE_DTYPES

    from ingress.serving.checkpoint_tokenizer import load_tokenizer
    from infra.config import checkpoint_problem, kv_cache_dtype, max_lora_rank, max_loras, quantization
    from structured_outputs.grammars import warm_at_start

    log_to_stdout()
    problem = checkpoint_problem(args.model)
    if problem:
        sys.exit(f"worker: --model {args.model} is not a checkpoint directory: {problem}")
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype_name = args.dtype or (GPU_DTYPE if args.device.startswith("cuda") else CPU_DTYPE)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype_name]
    kv_dtype_name = args.kv_cache_dtype or kv_cache_dtype()
    engine = Engine.from_pretrained(args.model, device=args.device, dtype=dtype,
                                    kv_cache_memory=int(args.kv_cache_mb * 2**20), optimize=args.optimize,
                                    max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                                    max_loras=args.max_loras or max_loras(), max_lora_rank=max_lora_rank(),
                                    quantization=args.quantization or quantization(),
                                    kv_cache_dtype=KV_CACHE_DTYPES.get(kv_dtype_name) if kv_dtype_name else None,
                                    tokenizer=load_tokenizer(args.model))
    worker = GpuWorker(engine, args.model_name, worker_id=args.worker_id, metrics_port=args.metrics_port,
                       refill_window=RefillWindow(max_wait_s=args.refill_wait_ms / 1000))
    if warm_at_start():
        worker.warm_grammars()
    worker.run()


def serve_billing(args) -> None:
    check_settings()
    from billing_pipeline.service import main as billing_main

    billing_main(["--port", str(args.port)])


def add_serve_commands(sub) -> None:
    """`serve SERVICE`: one service in the foreground."""
    serve = sub.add_parser("serve", help="run one service in the foreground").add_subparsers(dest="service",
                                                                                              required=True)
    s = serve.add_parser("ingress")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8080)
    s.add_argument("--reply-partition", type=int, default=0)
    s.add_argument("--admin-host", help="where the admin API, /metrics and /docs listen (default: loopback)")
    s.add_argument("--admin-port", type=int, help="default: the public port + 1")
    s.set_defaults(fn=serve_ingress)
    s = serve.add_parser("streams")
    s.set_defaults(fn=serve_streams)
    _add_worker_command(serve)
    s = serve.add_parser("billing")
    s.add_argument("--port", type=int, default=8090)
    s.set_defaults(fn=serve_billing)


def _add_worker_command(serve) -> None:
    s = serve.add_parser("worker")
    s.add_argument("--model", default=str(default_model_dir()), help="a Hugging Face checkpoint directory")
    s.add_argument("--model-name", default=DEFAULT_MODEL_NAME)
    s.add_argument("--worker-id", default=None)
    s.add_argument("--device", default="cpu")
    s.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                   help=f"default: {CPU_DTYPE} on a CPU, {GPU_DTYPE} on a GPU (docs/benchmarks.md)")
    s.add_argument("--kv-cache-mb", type=float, default=256)
    # the engine's QUANTIZATIONS and KV_CACHE_DTYPES (gpu_consumers/engine/core/config.py), not imported: that
    # would load torch for every command
    s.add_argument("--kv-cache-dtype", choices=["float32", "float16", "bfloat16"], default=None,
                   help="the KV cache's element type (default TOKENMILL_KV_CACHE_DTYPE, unset: the weights' dtype); "
                        "16 bits halve what decode attention reads (docs/benchmarks.md)")
    s.add_argument("--quantization", choices=["int8"], default=None,
                   help="int8: projections and LM head in int8, CPU only (default TOKENMILL_QUANTIZATION, unset: "
                        "the checkpoint's precision; docs/benchmarks.md)")
    s.add_argument("--optimize", choices=["latency", "throughput"], default=None)
    s.add_argument("--max-num-seqs", type=int, default=None, help="sequences in the running batch (slots)")
    s.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="tokens in one engine step, prefill chunks included (docs/engine.md)")
    s.add_argument("--refill-wait-ms", type=float, default=50.0,
                   help="after a step that ended requests, wait up to this long for new ones before the next "
                        "step (gpu_consumers/refill_window.py); 0 turns it off")
    s.add_argument("--threads", type=int, default=0)
    s.add_argument("--metrics-port", type=int, default=0, help="serve Prometheus /metrics on this port")
    s.add_argument("--max-loras", type=int, default=None,
                   help="LoRA adapters resident at once (default TOKENMILL_MAX_LORAS, 4; docs/lora.md)")
    s.set_defaults(fn=serve_worker)


