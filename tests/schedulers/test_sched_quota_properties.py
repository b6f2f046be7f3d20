"""Property tests for QuotaLedger against an independent model of the limits."""
import json
from collections import defaultdict
from datetime import datetime, timezone

from hypothesis import given, settings
from hypothesis import strategies as st

from schedulers import QuotaLedger, RejectReason, TenantLimits, month_key, window_start

# Two minutes before a month ends, on a window boundary, so windows and months roll.
START = datetime(2025, 1, 31, 23, 58, 0, tzinfo=timezone.utc).timestamp()
TENANTS = ["a", "b"]

limits_strategy = st.builds(
    TenantLimits,
    requests_per_minute=st.one_of(st.none(), st.integers(0, 8)),
    tokens_per_minute=st.one_of(st.none(), st.integers(0, 400)),
    max_concurrent=st.one_of(st.none(), st.integers(0, 4)),
    monthly_token_budget=st.one_of(st.none(), st.integers(0, 1500)),
)
ops_strategy = st.lists(
    st.one_of(
        st.tuples(st.just("reserve"), st.sampled_from(TENANTS), st.integers(0, 150)),
        st.tuples(st.just("reserve_again"), st.integers(0, 1000)),
        st.tuples(st.just("settle"), st.integers(0, 1000), st.floats(0, 1)),
        st.tuples(st.just("release"), st.integers(0, 1000)),
        st.tuples(st.just("tick"), st.floats(0, 25)),
    ),
    max_size=100,
)


class Model:
    """Re-derives what the ledger must decide, from first principles."""

    def __init__(self, limits):
        self.limits = limits
        self.now = START
        self.n = 0
        self.ids = []
        self.open = {}  # request_id -> (tenant, reserved, window, month)
        self.ended = set()
        self.win_requests = defaultdict(int)  # (tenant, window) -> admitted requests
        self.win_tokens = defaultdict(int)  # (tenant, window) -> settled + reserved
        self.month_tokens = defaultdict(int)  # (tenant, month) -> settled + reserved
        self.max_seen_window = {t: window_start(START, 60) for t in TENANTS}
        self.seen_month = {t: month_key(START) for t in TENANTS}

    def expected_reason(self, tenant, tokens):
        lim = self.limits[tenant]
        w, m = window_start(self.now, 60), month_key(self.now)
        concurrent = sum(1 for o in self.open.values() if o[0] == tenant)
        if lim.monthly_token_budget is not None and self.month_tokens[tenant, m] + tokens > lim.monthly_token_budget:
            return RejectReason.MONTHLY_BUDGET_EXCEEDED
        if lim.requests_per_minute is not None and self.win_requests[tenant, w] + 1 > lim.requests_per_minute:
            return RejectReason.RATE_LIMIT_REQUESTS
        if lim.tokens_per_minute is not None and self.win_tokens[tenant, w] + tokens > lim.tokens_per_minute:
            return RejectReason.RATE_LIMIT_TOKENS
        if lim.max_concurrent is not None and concurrent + 1 > lim.max_concurrent:
            return RejectReason.CONCURRENCY_LIMIT
        return None

    def in_flight(self, tenant):
        mine = [o[1] for o in self.open.values() if o[0] == tenant]
        return (sum(mine), len(mine))


def run(ledger, model, op):
    """Apply one op to the ledger, check it against the model, return a trace item."""
    kind = op[0]
    if kind == "tick":
        model.now += op[1]
        return None
    if kind in ("reserve", "reserve_again"):
        return reserve_and_check(ledger, model, op)
    return end_and_check(ledger, model, op)  # settle / release


def reserve_and_check(ledger, model, op):
    if op[0] == "reserve":
        tenant, tokens = op[1], op[2]
        rid = f"r{model.n}"
        model.n += 1
        model.ids.append((rid, tenant, tokens))
    else:
        if not model.ids:
            return None
        rid, tenant, tokens = model.ids[op[1] % len(model.ids)]
    adm = ledger.reserve(tenant, rid, tokens, model.now)
    if rid in model.open:
        assert adm.admitted, "re-reserving an open request must be idempotent"
    elif rid in model.ended:
        assert adm.reason is RejectReason.DUPLICATE_REQUEST
    else:
        expected = model.expected_reason(tenant, tokens)
        assert adm.reason is expected
        assert adm.admitted == (expected is None)
        if adm.admitted:
            count_admission(model, rid, tenant, tokens)
        elif adm.reason is not RejectReason.RATE_LIMIT_TOKENS or tokens <= model.limits[tenant].tokens_per_minute:
            assert adm.retry_after_s is not None and adm.retry_after_s >= 0
    assert model.in_flight(tenant) == ledger.in_flight(tenant)
    return ("reserve", rid, adm.admitted, adm.reason, adm.rate_limits)


def count_admission(model, rid, tenant, tokens):
    w, m = window_start(model.now, 60), month_key(model.now)
    model.open[rid] = (tenant, tokens, w, m)
    model.win_requests[tenant, w] += 1
    model.win_tokens[tenant, w] += tokens
    model.month_tokens[tenant, m] += tokens
    lim = model.limits[tenant]
    if lim.tokens_per_minute is not None:
        # Counted tokens (settled actual + in-flight estimates) of the
        # admission window stay within the limit.
        assert model.win_tokens[tenant, w] <= lim.tokens_per_minute
    if lim.requests_per_minute is not None:
        assert model.win_requests[tenant, w] <= lim.requests_per_minute
    if lim.max_concurrent is not None:
        assert model.in_flight(tenant)[1] <= lim.max_concurrent
    if lim.monthly_token_budget is not None:
        assert model.month_tokens[tenant, m] <= lim.monthly_token_budget


def end_and_check(ledger, model, op):
    kind = op[0]
    if not model.ids:
        return None
    rid, tenant, tokens = model.ids[op[1] % len(model.ids)]
    was_open = rid in model.open
    if kind == "settle":
        actual = int(tokens * op[2])  # estimates are upper bounds (max_tokens)
        ok = ledger.settle(rid, actual, model.now)
    else:
        actual = 0
        ok = ledger.release(rid, model.now)
    assert ok == was_open
    if was_open:
        _, reserved, w, m = model.open.pop(rid)
        model.win_tokens[tenant, w] += actual - reserved
        model.month_tokens[tenant, m] += actual - reserved
        model.ended.add(rid)
    assert model.in_flight(tenant) == ledger.in_flight(tenant)
    return (kind, rid, ok)


def end_everything(ledger, model):
    for rid in list(model.open):
        assert ledger.release(rid, model.now)
        model.open.pop(rid)
    for t in TENANTS:
        assert ledger.in_flight(t) == (0, 0)


@settings(max_examples=1000, deadline=None)
@given(st.fixed_dictionaries({t: limits_strategy for t in TENANTS}), ops_strategy)
def test_quota_matches_model_and_reservations_return_to_zero(limits, ops):
    ledger = QuotaLedger()
    for t, lim in limits.items():
        ledger.set_limits(t, lim)
    model = Model(limits)
    for op in ops:
        run(ledger, model, op)
    end_everything(ledger, model)


@settings(max_examples=400, deadline=None)
@given(st.fixed_dictionaries({t: limits_strategy for t in TENANTS}), ops_strategy, st.data())
def test_quota_round_trip_preserves_behaviour(limits, ops, data):
    cut = data.draw(st.integers(0, len(ops)))
    ledger = QuotaLedger()
    for t, lim in limits.items():
        ledger.set_limits(t, lim)
    model = Model(limits)
    for op in ops[:cut]:
        run(ledger, model, op)
    restored = QuotaLedger.from_dict(json.loads(json.dumps(ledger.to_dict())))
    assert restored.to_dict() == ledger.to_dict()
    # Both continue from the same point; every decision must be identical.
    import copy

    twin = copy.deepcopy(model)
    for op in ops[cut:]:
        assert run(restored, twin, op) == run(ledger, model, op)
    assert restored.to_dict() == ledger.to_dict()
    end_everything(restored, twin)
