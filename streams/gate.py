"""The gate: authoritative quota, the fair queue and release against credits.

This is the whole decision logic of streams as one single-threaded state machine with
no I/O. The owner loop (owner.py) feeds it decoded events and the clock, sends the
``Output`` records it returns, and writes its dirty table entries (durable_state.py).

Lifecycle of a request id, as streams sees it::

    requests ──> reserved (QuotaLedger) ──> queued (FairQueue) ──> released to `work`
                     │                          │                       │
                     └─ 429 rejected            ├─ shed at deadline     └─ settled on `usage`
                        (RequestError only;     │  (503 + RequestCompleted "shed")
                        never admitted)         └─ cancelled (RequestCompleted "cancelled")

The gate is its parts over one shared ``GateState`` (gate_state.py): admission
(gate_admission.py), endings (gate_endings.py), release (gate_release.py) and preemption
(gate_preemption.py); the records it sends are built in gate_outputs.py.
"""
from __future__ import annotations

import time
from typing import Any, Mapping, cast

from schedulers import FairQueue, QuotaLedger
from schedulers.fairness_index import ServiceWindow
from schemas import topics
from schemas.records import (
    CapacityAdvertised,
    InferenceRequested,
    QuotaState,
    RequestCancelled,
    RequestCompleted,
    RequestPreempted,
    TenantSnapshot,
)
from streams.config import StreamsSettings
from streams.credits import PoolCredits
from streams.gate_admission import RequestAdmission
from streams.gate_endings import RequestEndings
from streams.gate_metrics import GateMetrics, NullMetrics
from streams.gate_outputs import Output, new_record
from streams.gate_preemption import Preemptions
from streams.gate_release import ReleaseRound
from streams.gate_state import GateState, ReleasedEntry
from streams.placement import Placer
from streams.tenants import TenantBook

SWEEP_INTERVAL_S = 5.0


class Gate:
    """``state`` is the table's entries as read back on takeover (durable_state.py's layout), empty
    for a first start; ``self.state`` is what the gate rebuilt from them and keeps up to date."""

    def __init__(self, settings: StreamsSettings, state: dict[str, Any] | None = None,
                 metrics: GateMetrics | None = None) -> None:
        self.settings = settings
        self.state = GateState(settings, state or {}, metrics or NullMetrics())
        self.placer = Placer(self.state.credits, settings.placement)
        self.admission = RequestAdmission(self.state)
        self.endings = RequestEndings(self.state, settings.topic(topics.CANCELLATIONS))
        self.releases = ReleaseRound(self.state, self.placer)
        self.preemptions = Preemptions(self.state, settings.topic(topics.PREEMPTIONS))
        self.quota_topic = settings.topic(topics.QUOTA_STATE)
        self._quota_published: dict[str, float] = {}
        self._last_shed = 0.0
        self._last_sweep = 0.0

    # ================================================================ what it holds

    @property
    def records(self) -> dict[str, InferenceRequested]:
        """Queued requests: request id -> its record."""
        return self.state.records

    @property
    def released(self) -> dict[str, ReleasedEntry]:
        """Released requests that have not ended."""
        return self.state.released

    @property
    def ledger(self) -> QuotaLedger:
        return self.state.ledger

    @property
    def queue(self) -> FairQueue:
        return self.state.queue

    @property
    def credits(self) -> PoolCredits:
        return self.state.credits

    @property
    def service(self) -> ServiceWindow:
        return self.state.service

    @property
    def tenants(self) -> TenantBook:
        return self.state.tenants

    @property
    def positions(self) -> dict[str, int]:
        """Next offset of every input partition ("topic:partition")."""
        return self.state.positions

    @property
    def workpos(self) -> dict[str, int]:
        """Per `work` partition, the offset after the last release known delivered."""
        return self.state.workpos

    # ================================================================ inputs

    def handle(self, kind: str, key: bytes | None, record: Mapping[str, Any] | None, now: float,
               event: str | None = None) -> None:
        """One input record of `kind` (StreamsSettings.input_topics), decoded by the owner loop as an
        event its topic carries (owner.EXPECT): the casts below name that event's record type."""
        if event == "RequestPreempted":
            self.on_preempted(cast(RequestPreempted, record), now)
        elif kind == "requests":
            self.on_request(cast(InferenceRequested, record), now)
        elif kind == "usage":
            self.on_usage(cast(RequestCompleted, record), now)
        elif kind == "cancellations":
            self.on_cancel(cast(RequestCancelled, record), now)
        elif kind == "capacity":
            advert = cast(CapacityAdvertised, record)
            if self.state.credits.on_advert(advert):
                self.state.credits_dirty = True
                self.placer.on_advert(advert, now)
        elif kind == "tenants":
            self.on_tenant(key, cast(TenantSnapshot | None, record), now)

    def on_request(self, rec: InferenceRequested, now: float) -> None:
        self.admission.on_request(rec, now)

    def on_usage(self, rec: RequestCompleted, now: float) -> None:
        self.endings.on_usage(rec, now)

    def on_cancel(self, rec: RequestCancelled, now: float) -> None:
        self.endings.on_cancel(rec, now)

    def on_preempted(self, rec: RequestPreempted, now: float) -> None:
        tenant_id = self.preemptions.on_preempted(rec, now)
        if tenant_id is not None and self.state.tenants.get(tenant_id).disabled:
            self.endings.stop_tenant(tenant_id, now)  # disabled while it ran: it ends here, not resumes

    def on_tenant(self, key: bytes | None, snapshot: TenantSnapshot | None, now: float) -> None:
        """A tenant's snapshot, or its tombstone (None: deleted; the key names it)."""
        tenant_id = snapshot["tenant_id"] if snapshot else (key or b"").decode()
        applied = self.state.tenants.apply(tenant_id, snapshot)
        if applied is not None and applied.disabled:
            self.endings.stop_tenant(tenant_id, now)

    def apply_ledger_month(self, tenant_id: str, month_tokens: int, now: float) -> None:
        """Month-to-date tokens from the billing ledger, the source of truth for the monthly budget:
        whatever it counts beyond what this ledger saw (e.g. before a fresh start) is added."""
        ledger = self.state.ledger
        ledger.set_limits(tenant_id, self.state.tenants.get(tenant_id).limits)
        if ledger.apply_remote_usage(tenant_id, 0, 0, month_tokens, now):
            self.state.tenant_changed(tenant_id)

    def note_position(self, topic: str, partition: int, offset: int) -> None:
        self.state.note_position(topic, partition, offset)

    def mark_in_work(self, request_ids: list[str], now: float) -> int:
        """Takeover: these ids are already in `work` (released by a previous owner that
        did not live to record it). Returns how many were still queued here."""
        return self.endings.mark_in_work(request_ids, now)

    def on_work_delivered(self, partition: int, offset: int) -> None:
        self.state.on_work_delivered(partition, offset)

    def begin_work_positions(self, ends: dict[int, int]) -> None:
        """The first owner starts reading `work` at its end, since nothing of ours is there yet; these
        positions are saved with the next state commit, as delivered ones are."""
        self.state.begin_work_positions(ends)

    # ================================================================ periodic

    def step(self, now: float) -> None:
        """After a batch of events (and on every tick): shed, release, publish."""
        st = self.state
        if now - self._last_shed >= self.settings.shed_interval_s:
            self._last_shed = now
            self.endings.shed(now)
            if st.credits.expire(now):
                st.credits_dirty = True
            self.placer.expire(now)
        if now - self._last_sweep >= SWEEP_INTERVAL_S:
            self._last_sweep = now
            st.sweep(now)
        self.releases.run(now)
        self.preemptions.round(now)
        self._publish_quota(now)

    def _publish_quota(self, now: float) -> None:
        st = self.state
        if not st.quota_dirty:
            return
        interval = self.settings.quota_publish_interval_s
        for tenant_id in list(st.quota_dirty):
            if now - self._quota_published.get(tenant_id, 0.0) < interval:
                continue
            st.quota_dirty.discard(tenant_id)
            self._quota_published[tenant_id] = now
            usage = st.ledger.usage(tenant_id, now)
            tokens, count = st.ledger.in_flight(tenant_id)
            record = new_record(
                QuotaState, tenant_id=tenant_id, window_start_ms=int(usage.window_start * 1000),
                window_ms=int(st.quota_config.window_s * 1000), requests_in_window=usage.used_requests_in_window,
                tokens_in_window=usage.used_tokens_in_window, in_flight_requests=count, in_flight_tokens=tokens,
                month=usage.month, month_tokens_used=usage.month_used)
            record["timestamp_ms"] = int(now * 1000)
            st.emit(Output(self.quota_topic, tenant_id, "QuotaState", record))

    # ================================================================ output side

    def take_outputs(self) -> list[Output]:
        return self.state.take_outputs()

    def take_dirty(self) -> dict[str, Any]:
        return self.state.take_dirty()

    def snapshot(self, now: float | None = None) -> dict[str, Any]:
        now = time.time() if now is None else now
        credits = self.state.credits
        return {
            "depths": self.state.queue.depths(),
            "credits": credits.available(now),
            "in_transit": {m: credits.in_transit(m) for m in credits.models()},
            "released_in_flight": len(self.state.released),
        }
