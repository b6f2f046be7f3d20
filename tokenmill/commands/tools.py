"""Benchmarks, usage analytics and the dashboard: `bench`, `usage`, `dashboard`; and the commands whose flags
their own modules parse (`queue`, `capacity`, `batch`), declared here for `--help`."""
from __future__ import annotations

from infra import settings
from tokenmill.benchmarks import BENCHES


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
    if settings.graphical_session() and webbrowser.open(url):
        print(f"opened the dashboard in your browser ({billing_url()}/dashboard)")
    else:
        print(f"open this link in a browser (it signs you in; good once, for two minutes):\n  {url}")


def cmd_bench(target: str, rest: list[str]) -> None:
    """Each benchmark parses its own flags, `--help` included."""
    import importlib

    importlib.import_module(BENCHES[target]).main(rest)


def cmd_usage(rest: list[str]) -> int:
    from billing_pipeline.cli import main

    return main(rest)  # reconcile exits 1 when streamed and billed tokens differ


def add_tool_commands(sub) -> None:
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


