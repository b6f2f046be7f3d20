"""Release: queued requests go to `work` against the pool's credits, in the fair queue's order.

Slots a preemption freed go first to the requests they were freed for; then the queue
releases what fits the credits on offer, each release addressed to a worker by placement.
"""
from __future__ import annotations

from schedulers import QueuedRequest, Release
from streams.gate_outputs import released_work
from streams.gate_state import GateState
from streams.placement import Placer


class ReleaseRound:
    def __init__(self, state: GateState, placer: Placer) -> None:
        self.state = state
        self.placer = placer

    def run(self, now: float) -> int:
        """Release what the credits allow now; returns how many were released."""
        st = self.state
        available = st.credits.available(now)
        if not any(v > 0 for v in available.values()) or not st.records:
            return 0
        released = 0
        # Slots freed by preemption go to the requests they were freed for.
        for model, owed in st.owed.items():
            for rid in list(owed):
                if available.get(model, 0) <= 0:
                    break
                del owed[rid]
                owed_release = st.queue.pop_request(rid, now)
                if owed_release is not None:
                    available[model] -= 1
                    self._release(owed_release, now)
                    released += 1

        def can_start(request: QueuedRequest) -> bool:
            return available.get(request.payload, 0) > 0

        for release in st.queue.releases(now, can_start):
            available[release.request.payload] -= 1
            self._release(release, now)
            released += 1
            if available[release.request.payload] <= 0 and not any(v > 0 for v in available.values()):
                break  # every credit is used: the rest of the queue need not be looked at
        if released:
            st.credits_dirty = True
            st.queue_dirty = True
        return released

    def _release(self, release: Release, now: float) -> None:
        st = self.state
        req = release.request
        rec = st.records.pop(req.request_id)
        where = self.placer.address(rec, now)
        st.emit(released_work(rec, now, st.work_topic, where.partition))
        st.credits.on_release(req.payload, req.request_id, now, where.worker_id)
        st.metrics.placed(req.payload, where.worker_id, where.reason, where.loads_adapter)
        st.mark_released(req.request_id, rec, release.charge, now, req, release.tier, release.seq)
        st.metrics.released(req.tenant_id, req.priority.value, now - req.enqueued_at,
                            max(0.0, now - rec["timestamp_ms"] / 1000.0))
