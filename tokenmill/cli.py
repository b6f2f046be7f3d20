"""`tokenmill`: the one command for every operator action."""
from __future__ import annotations

import argparse
import sys

from tokenmill.commands.local_stack import add_stack_commands
from tokenmill.commands.serve import add_serve_commands
from tokenmill.commands.tenancy import add_tenancy_commands
from tokenmill.commands.tools import BENCHES, add_tool_commands, cmd_bench, cmd_usage


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tokenmill", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    add_stack_commands(sub)
    add_serve_commands(sub)
    add_tenancy_commands(sub)
    add_tool_commands(sub)
    return p


def main(argv: list[str] | None = None) -> int | None:
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
        from tokenmill.batch_cli import main as batch_main

        raise SystemExit(batch_main(argv[1:]))
    if len(argv) > 1 and argv[0] == "bench" and argv[1] in BENCHES:
        cmd_bench(argv[1], argv[2:])
        return None
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
    return None


if __name__ == "__main__":
    main()
