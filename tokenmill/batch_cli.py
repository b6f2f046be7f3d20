"""`tokenmill batch submit|status|collect|cancel`: offline bulk inference from the command line.

    tokenmill batch submit input.jsonl --api-key KEY [--model-map gpt-4o-mini=tokenmill-small]
    tokenmill batch status BATCH_ID [--json]
    tokenmill batch collect BATCH_ID -o output.jsonl [--errors errors.jsonl] [--no-wait] [--timeout S]
    tokenmill batch cancel BATCH_ID

The batch's state (manifest, validation errors, collected files) lives under
`.local/batches/<batch_id>/` on the machine that submitted it ($TOKENMILL_BATCH_DIR).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from infra import settings
from infra.config import default_max_tokens
from tokenmill.progress import bar
from ingress.api.batches.service import DEFAULT_WINDOW, BatchRefused, BatchService
from ingress.api.batches.store import BatchStore, jsonl


class LazyModels:
    """Served models by name, loading a tokenizer only when a line first names that model."""

    def __init__(self):
        from infra.config import served_models

        self.specs = served_models()
        self.loaded: dict[str, Any] = {}

    def __call__(self, name: str):
        if name not in self.specs:
            return None
        if name not in self.loaded:
            from ingress.serving.served_model import ServedModel

            self.loaded[name] = ServedModel(self.specs[name])
        return self.loaded[name]


class LazyAdapters:
    """The tenants' LoRA adapters, read from `adapters` once, the first time a line names one."""

    def __init__(self):
        self.catalog = None

    def __call__(self, tenant_id: str, model: str):
        from lora.adapters import AdapterFollower, split_model_id

        if split_model_id(model) is None:
            return None
        if self.catalog is None:
            self.catalog = AdapterFollower("batch-cli-adapters", dead_letters=False).catch_up()
        return self.catalog.resolve(tenant_id, model)


def _service(with_models: bool = False) -> BatchService:
    if with_models:
        return BatchService(BatchStore(), LazyModels(), default_max_tokens(), adapters=LazyAdapters())
    return BatchService(BatchStore())


def _authenticate(api_key: str):
    from ingress.tenancy.directory import TenantFollower
    from infra.config import key_secret

    directory = TenantFollower(client_id="batch-cli-tenants").catch_up()
    return directory.authenticate(api_key, key_secret())


def cmd_submit(args) -> int:
    from ingress.api.batches.parse import parse_model_map

    api_key = args.api_key or settings.API_KEY.get()
    if not api_key:
        print("error: give --api-key (or set TOKENMILL_API_KEY)", file=sys.stderr)
        return 2
    try:
        model_map = parse_model_map(args.model_map)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    content = Path(args.input).read_bytes()
    caller = _authenticate(api_key)
    if caller is None:
        print("error: incorrect, revoked or unknown API key", file=sys.stderr)
        return 1
    service = _service(with_models=True)
    try:
        manifest, fresh = service.submit(content, caller.tenant, caller.key_id, model_map=model_map,
                                         completion_window=args.completion_window, input_name=Path(args.input).name)
    except BatchRefused as exc:
        print(f"error: {exc.message}", file=sys.stderr)
        return 1
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    finally:
        service.close()
    bid = manifest["batch_id"]
    folder = service.store.batch_dir(bid)
    if fresh:
        print(f"published {len(manifest['requests'])} requests, refused {manifest['invalid']} lines "
              f"(see {folder / 'errors.jsonl'})", file=sys.stderr)
    else:
        print(f"batch {bid} was already published; nothing sent again", file=sys.stderr)
    print(bid)
    return 0


def _status_line(status: str, counts: dict[str, int]) -> str:
    return (f"status {status}: total {counts['total']}, completed {counts['completed']}, failed {counts['failed']} "
            f"(invalid {counts['invalid']}), cancelled {counts['cancelled']}, expired {counts['expired']}, "
            f"in progress {counts['in_progress']}")


def cmd_status(args) -> int:
    service = _service()
    try:
        manifest, fold = service.finalize_if_done(args.batch_id)
    except KeyError:
        print(f"error: no batch {args.batch_id} under {service.store.root}", file=sys.stderr)
        return 1
    status, counts = service.status(manifest, fold)
    if args.json:
        print(json.dumps({"id": manifest["batch_id"], "status": status, "counts": counts,
                          "tenant_id": manifest["tenant_id"], "created_at_ms": manifest["created_at_ms"],
                          "deadline_ms": manifest["deadline_ms"]}))
    else:
        print(_status_line(status, counts))
    return 0


def cmd_collect(args) -> int:
    service = _service()
    deadline = time.monotonic() + args.timeout if args.timeout else None
    try:
        with bar(desc="requests ended", unit="req") as progress:
            while True:
                manifest, outputs, errors, status, counts = service.result_rows(args.batch_id, cached=True)
                progress.total = counts["total"]
                progress.update(counts["total"] - counts["in_progress"] - progress.n)
                progress.set_postfix_str(status)
                done = status not in ("in_progress", "cancelling", "validating")
                timed_out = deadline is not None and time.monotonic() >= deadline
                if done or args.no_wait or timed_out:
                    break
                time.sleep(args.interval)
    except KeyError:
        print(f"error: no batch {args.batch_id} under {service.store.root}", file=sys.stderr)
        return 1
    out = Path(args.output)
    errors_path = Path(args.errors) if args.errors else out.with_name(out.stem + ".errors.jsonl")
    _write(out, jsonl(outputs))
    _write(errors_path, jsonl(errors))
    print(_status_line(status, counts), file=sys.stderr)
    print(f"wrote {len(outputs)} results to {out} and {len(errors)} errors to {errors_path}", file=sys.stderr)
    return 0 if done else 3


def _write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def cmd_cancel(args) -> int:
    service = _service()
    try:
        manifest, sent = service.cancel(args.batch_id)
    except KeyError:
        print(f"error: no batch {args.batch_id} under {service.store.root}", file=sys.stderr)
        return 1
    finally:
        service.close()
    print(f"cancelling {manifest['batch_id']}: sent {sent} cancellations", file=sys.stderr)
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tokenmill batch", description="offline bulk inference (OpenAI Batch files)")
    sub = p.add_subparsers(dest="action", required=True)
    s = sub.add_parser("submit", help="validate and publish an OpenAI Batch input file; prints the batch id")
    s.add_argument("input", help="JSONL: custom_id, method, url, body per line")
    s.add_argument("--api-key", help="the tenant's API key (default: $TOKENMILL_API_KEY)")
    s.add_argument("--model-map", help="rename models in the file: 'gpt-4o-mini=tokenmill-small,...'")
    s.add_argument("--completion-window", default=DEFAULT_WINDOW, help="deadline of every request (default 24h)")
    s.set_defaults(fn=cmd_submit)
    s = sub.add_parser("status", help="counts: total, completed, failed, in progress")
    s.add_argument("batch_id")
    s.add_argument("--json", action="store_true")
    s.set_defaults(fn=cmd_status)
    s = sub.add_parser("collect", help="write the results (OpenAI Batch output format), waiting until done")
    s.add_argument("batch_id")
    s.add_argument("-o", "--output", required=True)
    s.add_argument("--errors", help="error file (default: <output stem>.errors.jsonl)")
    s.add_argument("--no-wait", action="store_true", help="write what has finished so far and return")
    s.add_argument("--timeout", type=float, default=0, help="stop waiting after this many seconds (0: never)")
    s.add_argument("--interval", type=float, default=1.0, help="seconds between polls while waiting")
    s.set_defaults(fn=cmd_collect)
    s = sub.add_parser("cancel", help="cancel every request of the batch that has not finished")
    s.add_argument("batch_id")
    s.set_defaults(fn=cmd_cancel)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
