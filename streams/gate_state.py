"""What the gate knows, rebuilt from its table entries, and the entries its changes make dirty.

The gate's parts (admission, endings, release, preemption) share one ``GateState``: the
requests by stage, the quota ledger, the fair queue, the pool's credits, the input
positions, and the outputs and table entries not yet taken by the owner loop. The methods
here are the bookkeeping every part does the same way: a request queued, released or
ended, a tenant's counters changed. The table's layout is durable_state.py's.
"""
from __future__ import annotations

from typing import Any, NotRequired, TypedDict

from schedulers import AgingPolicy, Charge, FairQueueConfig, PriorityClass, QueuedRequest, QuotaConfig, TokenUsage
from schedulers.fairness_index import ServiceWindow
from schemas import topics
from schemas.records import InferenceRequested
from streams import durable_state as ds
from streams.config import StreamsSettings
from streams.credits import PoolCredits
from streams.gate_metrics import GateMetrics
from streams.gate_outputs import Output, ran, streamed_tokens
from streams.tenants import TenantBook


class QueuedEntry(TypedDict):
    """The ``r/`` entry of a queued request."""
    st: str  # "queued"
    rec: InferenceRequested
    q: dict[str, Any]  # its queue entry (QueuedRequest.to_dict and its seq)
    res: dict[str, Any] | None  # its reservation (QuotaLedger.reservation_state)


class ReleasedEntry(TypedDict):
    """The ``r/`` entry of a released request that has not ended, and what the gate keeps of it."""
    st: str  # "released"
    tenant: str
    model: str
    priority: str
    charge: dict[str, Any] | None  # Charge.to_dict, None for one released by a previous owner
    released_at: float
    res: dict[str, Any] | None
    # Entries written before these were kept have none of them.
    rec: NotRequired[InferenceRequested]  # kept so a preempted request can be queued again
    tier: NotRequired[str]
    seq: NotRequired[int | None]  # its place in the queue, where it goes back if it is preempted
    enqueued_at: NotRequired[float]
    resumed_tokens: NotRequired[int]  # streamed before its last preemption (already settled)


class GateState:
    def __init__(self, settings: StreamsSettings, state: dict[str, Any], metrics: GateMetrics) -> None:
        self.settings = settings
        self.metrics = metrics
        self.quota_config = QuotaConfig(weights=settings.token_weights, ended_ttl_s=settings.ended_ttl_s)
        self.queue_config = FairQueueConfig(aging=AgingPolicy(settings.batch_aging_s))
        self.tenants = TenantBook()
        self.service = ServiceWindow()
        self.work_topic = settings.topic(topics.WORK)
        self.usage_topic = settings.topic(topics.USAGE)
        self.out: list[Output] = []
        self.dirty: dict[str, Any] = {}
        self.queue_dirty = self.credits_dirty = self.positions_dirty = self.workpos_dirty = False
        self.quota_dirty: set[str] = set()  # tenants whose QuotaState is to be published
        # In memory only (a new owner simply asks again if the pool is still unfair):
        # victim request id -> (the request its slot is for, model, asked at)
        self.preempting: dict[str, tuple[str, str, float]] = {}
        # model -> requests a preemption freed a slot for, released ahead of the queue's order
        self.owed: dict[str, dict[str, float]] = {}
        self._restore(state)

    # ================================================================ restore

    def _restore(self, state: dict[str, Any]) -> None:
        self.records: dict[str, InferenceRequested] = {}  # queued: request id -> its record
        self.released: dict[str, ReleasedEntry] = {}  # released, not ended
        self.ended: dict[str, float] = {}
        self.early_cancels: dict[str, float] = {}
        self.in_work: dict[str, float] = {}
        usage: dict[str, dict[str, Any]] = {}
        reservations: list[dict[str, Any]] = []
        queued: list[dict[str, Any]] = []
        charges: list[dict[str, Any]] = []
        by_prefix = {ds.ENDED: self.ended, ds.EARLY_CANCEL: self.early_cancels, ds.IN_WORK: self.in_work}
        for key, value in state.items():
            if key.startswith(ds.REQ):
                rid = key[len(ds.REQ):]
                if value.get("res"):
                    reservations.append(value["res"])
                if value["st"] == "queued":
                    self.records[rid] = value["rec"]
                    queued.append(value["q"])
                else:
                    self.released[rid] = value
                    if value.get("charge"):
                        charges.append(value["charge"])
            elif key.startswith(ds.TENANT):
                usage[key[len(ds.TENANT):]] = value
            else:
                for prefix, table in by_prefix.items():
                    if key.startswith(prefix):
                        table[key[len(prefix):]] = float(value)
        self.ledger = ds.restore_ledger(usage, reservations, self.ended, self.quota_config)
        self.queue = ds.restore_queue(state.get(ds.FQ), queued, charges, self.queue_config)
        self.credits = PoolCredits.from_dict(state.get(ds.CREDITS), self.settings.advert_ttl_s,
                                             self.settings.in_transit_ttl_s)
        self.positions: dict[str, int] = dict(state.get(ds.POS) or {})
        self.workpos: dict[str, int] = dict(state.get(ds.WORKPOS) or {})
        self.quota_dirty = set(usage)

    # ================================================================ a request's stages

    def emit(self, output: Output) -> None:
        self.out.append(output)

    def record_queued(self, rid: str, rec: InferenceRequested, queued: QueuedRequest) -> None:
        """The request is in the queue now (admitted, or back after a preemption)."""
        self.records[rid] = rec
        entry: QueuedEntry = {"st": "queued", "rec": rec, "q": {**queued.to_dict(), "seq": self.queue.seq_of(rid)},
                              "res": self.ledger.reservation_state(rid)}
        self.dirty[ds.REQ + rid] = entry
        self.queue_dirty = True

    def mark_released(self, rid: str, rec: InferenceRequested, charge: Charge | None, now: float,
                      queued: QueuedRequest | None = None, tier: PriorityClass | None = None,
                      seq: int | None = None) -> None:
        # The record stays, so a preempted request can be queued again (with its place: seq).
        info: ReleasedEntry = {
            "st": "released", "tenant": rec["tenant_id"], "model": rec["model"],
            "priority": rec.get("priority", "interactive"),
            "charge": charge.to_dict() if charge else None, "released_at": now,
            "res": self.ledger.reservation_state(rid), "rec": rec,
            "tier": tier.value if tier else (rec.get("priority") or "interactive"),
            "seq": seq, "enqueued_at": queued.enqueued_at if queued else now,
            "resumed_tokens": streamed_tokens(rec)}
        self.released[rid] = info
        self.dirty[ds.REQ + rid] = info

    def end(self, rid: str, now: float) -> None:
        self.ended[rid] = now
        self.dirty[ds.REQ + rid] = None
        self.dirty[ds.ENDED + rid] = now

    def note_in_work(self, rid: str, now: float) -> None:
        self.in_work[rid] = now
        self.dirty[ds.IN_WORK + rid] = now

    def forget_in_work(self, rid: str) -> None:
        del self.in_work[rid]
        self.dirty[ds.IN_WORK + rid] = None

    def note_early_cancel(self, rid: str, now: float) -> None:
        self.early_cancels[rid] = now
        self.dirty[ds.EARLY_CANCEL + rid] = now

    def forget_early_cancel(self, rid: str) -> None:
        del self.early_cancels[rid]
        self.dirty[ds.EARLY_CANCEL + rid] = None

    def sweep(self, now: float) -> None:
        """Ended, early-cancelled and found-in-work ids are forgotten after ``ended_ttl_s``."""
        horizon = now - self.settings.ended_ttl_s
        for table, prefix in ((self.ended, ds.ENDED), (self.early_cancels, ds.EARLY_CANCEL),
                              (self.in_work, ds.IN_WORK)):
            for rid in [r for r, t in table.items() if t < horizon]:
                del table[rid]
                self.dirty[prefix + rid] = None

    # ================================================================ quota and service

    def tenant_changed(self, tenant_id: str) -> None:
        self.dirty[ds.TENANT + tenant_id] = self.ledger.tenant_state(tenant_id)
        self.quota_dirty.add(tenant_id)

    def close_reservation(self, rid: str, rec: InferenceRequested, now: float) -> None:
        """End a queued request's reservation: refunded if it never ran, or, for a preempted request
        that had started, settled with its prompt and what it streamed: the same tokens the ledger
        bills from the RequestCompleted (billing_pipeline/ledger.py ``ran``)."""
        if ran(rec):
            self.ledger.settle(rid, TokenUsage(len(rec["prompt_token_ids"]), streamed_tokens(rec), 0), now)
        else:
            self.ledger.release(rid, now)

    def settle_service(self, info: ReleasedEntry, prompt: int, completion: int, now: float) -> None:
        """Replace the release-time estimate by the service actually given."""
        charge_state = info.get("charge")
        if not charge_state:
            return
        charge = Charge.from_dict(charge_state)
        self.queue.on_usage(charge.tenant_id, prompt, completion, charge)
        self.service.add(charge.tenant_id, self.queue_config.weighted_tokens(prompt, completion) / charge.weight, now)
        self.queue_dirty = True

    # ================================================================ positions

    def note_position(self, topic: str, partition: int, offset: int) -> None:
        self.positions[f"{topic}:{partition}"] = offset + 1
        self.positions_dirty = True

    def on_work_delivered(self, partition: int, offset: int) -> None:
        key = str(partition)
        if self.workpos.get(key, -1) < offset + 1:
            self.workpos[key] = offset + 1
            self.workpos_dirty = True

    def begin_work_positions(self, ends: dict[int, int]) -> None:
        for partition, offset in ends.items():
            self.workpos[str(partition)] = offset
        self.workpos_dirty = True

    # ================================================================ taken by the owner loop

    def take_outputs(self) -> list[Output]:
        out, self.out = self.out, []
        return out

    def take_dirty(self) -> dict[str, Any]:
        if self.queue_dirty:
            self.dirty[ds.FQ] = self.queue.globals_state()
        if self.credits_dirty:
            self.dirty[ds.CREDITS] = self.credits.to_dict()
        if self.positions_dirty:
            self.dirty[ds.POS] = dict(self.positions)
        if self.workpos_dirty:
            self.dirty[ds.WORKPOS] = dict(self.workpos)
        self.queue_dirty = self.credits_dirty = self.positions_dirty = self.workpos_dirty = False
        dirty, self.dirty = self.dirty, {}
        return dirty
