"""`tokenmill usage`: the summary renders, and reconcile finds every difference."""
from __future__ import annotations

import time
import uuid

import pytest

from billing_events import completed
from billing_pipeline import cli, ledger
from billing_pipeline.pricing import PriceBook
from infra.kafka import clients as kafka_clients
from schemas import codec, topics


class StoreSource(cli.DirectSource):
    def __init__(self, store):
        self.store = store


def load(store, events):
    rows = [ledger.ledger_row(e, PriceBook.load(store)) for e in events]
    ledger.insert_rows(store, rows)
    ledger.refresh_buckets(store, ledger.buckets_of(rows))


def test_summary_prints_tables_and_bars(store):
    load(store, [completed(f"s-{i}", f"t{i % 2}", prompt=10, completion=i) for i in range(6)])
    text = cli.summary(StoreSource(store), since="1h")
    assert "m-small" in text and "t0" in text and "t1" in text and "█" in text
    assert "ttft p50" in text


def test_an_adapter_is_billed_on_its_own_line_at_its_own_price(store):
    from billing_pipeline import analytics
    from billing_pipeline.pricing import set_price

    past = "2020-01-01"
    set_price(store, "m-small", "output", 1.0, effective_from=past)
    set_price(store, "m-small:support", "output", 3.0, effective_from=past, tenant_id="acme")  # acme's adapter's
    load(store, [completed("a-1", "acme", completion=10, adapter="support"),
                 completed("a-2", "acme", completion=10, adapter="legal"),  # no price of its own: the base's
                 completed("a-3", "acme", completion=10),
                 completed("g-1", "globex", completion=10, adapter="support")])  # globex's own `support`
    lines = {m["model"]: m for m in analytics.tenant_totals(store, "acme")["by_model"]}
    assert set(lines) == {"m-small", "m-small:support", "m-small:legal"}
    assert {k: v["completion_tokens"] for k, v in lines.items()} == dict.fromkeys(lines, 10)
    assert lines["m-small:support"]["cost_pusd"] == 3 * lines["m-small"]["cost_pusd"] == 3 * lines["m-small:legal"]["cost_pusd"]
    assert {r["request_id"]: r["adapter"] for r in analytics.lookup_requests(store, ["a-1", "a-2", "a-3"])} == \
        {"a-1": "support", "a-2": "legal", "a-3": ""}
    assert "m-small:support" in cli.summary(StoreSource(store), since="1h")
    # one name, two tenants, one price: globex's `support` is not acme's and pays the base model's price
    globex = {m["model"]: m for m in analytics.tenant_totals(store, "globex")["by_model"]}
    assert globex["m-small:support"]["cost_pusd"] == lines["m-small"]["cost_pusd"]


def test_an_adapter_price_needs_its_tenant(store):
    from billing_pipeline.pricing import PriceBook, set_price

    with pytest.raises(ValueError, match="names an adapter, whose name is one tenant's"):
        set_price(store, "m-small:support", "output", 3.0, effective_from=0)
    set_price(store, "m-small", "output", 1.0, effective_from=0, tenant_id="acme")  # a tenant's base price
    book = PriceBook.load(store)
    assert book.price("m-small", "output", 10, tenant_id="acme") == 1_000_000
    assert book.price("m-small", "output", 10, tenant_id="globex") is None


@pytest.mark.kafka
def test_reconcile_reports_each_difference(store, producer):
    since = int(time.time() * 1000) - 1000
    p = uuid.uuid4().hex[:6]
    ok, short, unbilled = f"{p}-ok", f"{p}-short", f"{p}-unbilled"

    def batch(items):
        rec = codec.new_event("ReplyBatch", items=[
            {"request_id": rid, "choice_index": 0, "first_token_index": first, "token_ids": list(range(n)),
             "text": "x" * n} for rid, first, n in items])
        kafka_clients.produce_event(producer, topics.REPLIES.name, None, "ReplyBatch", rec, partition=0)

    batch([(ok, 0, 3), (short, 0, 2), (unbilled, 0, 1)])
    batch([(ok, 3, 2), (short, 2, 2)])
    batch([(ok, 3, 2)])  # re-sent after a worker retry: counted once
    assert producer.flush(10) == 0
    load(store, [completed(ok, "rc", completion=5), completed(short, "rc", completion=3)])

    report = cli.reconcile(StoreSource(store), since=str(since))
    mine = {d["request_id"]: d for d in report.differences if d["request_id"].startswith(p)}
    assert report.streamed[ok] == 5 and report.billed[ok] == 5
    assert set(mine) == {short, unbilled}
    assert (mine[short]["streamed"], mine[short]["billed"], mine[short]["problem"]) == (4, 3, "mismatch")
    assert mine[unbilled]["problem"] == "not billed"


def test_summary_png_draws_usage_and_latency_over_time(store, tmp_path):
    now = int(time.time() * 1000)
    load(store, [completed(f"o-{i}", f"tenant-{i % 4}", prompt=10, completion=5 + i,
                           finished_at_ms=now - (i % 3) * 20 * 60_000) for i in range(12)])
    data = StoreSource(store).summary(now - 3_600_000, None)
    over = data["over_time"]
    assert over["bucket_s"] == 60
    assert {r["tenant_id"] for r in over["usage"]} == {f"tenant-{i}" for i in range(4)}
    assert sum(r["tokens"] for r in over["usage"]) == sum(15 + i for i in range(12))
    assert len(over["latency"]) == 3  # three minutes had finished requests

    panels = cli.usage_panels(over["usage"], over["latency"], over["since_ms"], over["until_ms"], 60)
    stack = cli.tenant_stack(panels, top=2)
    assert list(stack)[-1] == "others" and len(stack) == 3
    assert sum(map(sum, stack.values())) == sum(15 + i for i in range(12))  # nothing dropped from the stack

    out = tmp_path / "usage.png"
    assert cli.summary(StoreSource(store), since="1h", png=str(out)).endswith(f"wrote {out}")
    import matplotlib.image

    assert matplotlib.image.imread(out).shape[:2] == (800, 1200)  # two rows of panels: totals, over time
