"""Tenants, their API keys and their LoRA adapters: `tenants`, `keys`, `adapters`."""
from __future__ import annotations

import json
import sys
from pathlib import Path

def tenant_admin():
    from ingress.tenancy.tenant_admin import TenantAdmin
    from infra.config import key_secret

    return TenantAdmin(key_secret())


def cmd_tenants(args) -> None:
    admin = tenant_admin()
    if args.action == "list":
        for t in admin.tenants():
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
    admin = tenant_admin()
    if args.action == "issue":
        issued = admin.issue_key(args.target)
        print(f"key (shown once): {issued.key}\nprefix: {issued.prefix}")
    elif args.action == "revoke":
        print(f"revoked {args.target} of tenant {admin.revoke_key(args.target)}")
    else:
        for t in admin.tenants():
            for k in t["api_keys"]:
                if args.target in (None, t["tenant_id"]):
                    print(f"{k['prefix']:<20} tenant={t['tenant_id']:<16} revoked={bool(k['revoked_ms'])}")


# --- LoRA adapters (docs/lora.md) -------------------------------------------------------
def cmd_adapters(args) -> None:
    """Register, list or delete a tenant's LoRA adapters on `adapters`, with the admin API's checks."""
    from lora import adapters
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


def add_tenancy_commands(sub) -> None:
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


