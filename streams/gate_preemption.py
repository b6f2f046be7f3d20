"""Preemption: where a model's pool is full and queued requests are owed a slot
(schedulers/preemption.py decides which), streams asks the workers running the victims to
give their slots up; a worker that does hands the request back, and it is queued again
where it stood, to resume from what it already streamed.
"""
from __future__ import annotations

import logging

from schedulers import QueuedRequest, parse_priority
from schedulers.preemption import PreemptionPolicy, RunningSequence, WaitingRequest
from schemas.records import InferenceRequested, RequestPreempted, ResumePoint
from streams.gate_outputs import preempt_requested
from streams.gate_state import GateState, ReleasedEntry

log = logging.getLogger("tokenmill.streams.gate")

# A preemption the worker has not confirmed by then (the sequence ended first, or its worker
# is gone) stops counting as a slot on the way.
PREEMPT_CONFIRM_S = 5.0
# A request preempted this often runs to its end (bounds the recompute one request can cost).
MAX_PREEMPTIONS_PER_REQUEST = 3


class Preemptions:
    def __init__(self, state: GateState, preemptions_topic: str) -> None:
        self.state = state
        self.preemptions_topic = preemptions_topic
        self.policy = PreemptionPolicy(hysteresis_s=state.settings.preempt_hysteresis_s)

    def round(self, now: float) -> int:
        """Ask workers to give up slots for queued requests owed one, per model whose pool is full.
        Returns how many preemptions were asked for."""
        st = self.state
        self._forget_unconfirmed(now)
        if not st.settings.preemption or not st.records:
            return 0
        waiting = self._waiting_on_full_pools(now)
        if not waiting:
            return 0
        running = self._running_sequences(waiting)
        asked = 0
        for model, heads in waiting.items():
            pending_for = set(st.owed.get(model, {}))
            for decision in self.policy.decide(running.get(model, []), heads, 0, pending_for, now):
                victim = decision.victim
                st.preempting[victim.request_id] = (decision.beneficiary.request_id, model, now)
                st.owed.setdefault(model, {})[decision.beneficiary.request_id] = now
                st.emit(preempt_requested(victim.request_id, victim.tenant_id, model, decision.reason,
                                          decision.beneficiary.request_id, self.preemptions_topic))
                asked += 1
        return asked

    def _forget_unconfirmed(self, now: float) -> None:
        st = self.state
        for rid in [r for r, (_, _, at) in st.preempting.items() if now - at > PREEMPT_CONFIRM_S]:
            del st.preempting[rid]
        for owed in st.owed.values():
            for rid in [r for r, at in owed.items() if now - at > PREEMPT_CONFIRM_S or r not in st.records]:
                del owed[rid]

    def _waiting_on_full_pools(self, now: float) -> dict[str, list[WaitingRequest]]:
        """Per model with no credit left, the queue's heads that wait for it."""
        st = self.state
        available = st.credits.available(now)
        waiting: dict[str, list[WaitingRequest]] = {}
        for tier, req in st.queue.heads(now):
            if req.payload in available and available[req.payload] <= 0:
                waiting.setdefault(req.payload, []).append(
                    WaitingRequest(req.request_id, req.tenant_id, tier, req.weight))
        return waiting

    def _running_sequences(self, waiting: dict[str, list[WaitingRequest]]) -> dict[str, list[RunningSequence]]:
        """Per model that has waiting heads, the released requests that could give a slot up."""
        st = self.state
        running: dict[str, list[RunningSequence]] = {}
        for rid, info in st.released.items():
            if info["model"] not in waiting or rid in st.preempting:
                continue
            rec = info.get("rec")
            preemptible = (rec is not None and rec["sampling"]["n"] == 1
                           and _preemptions(rec) < MAX_PREEMPTIONS_PER_REQUEST)
            running.setdefault(info["model"], []).append(RunningSequence(
                rid, info["tenant"], parse_priority(info.get("tier") or info["priority"]),
                st.tenants.get(info["tenant"]).fairness_weight, float(info["released_at"]), preemptible))
        return running

    def on_preempted(self, rec: RequestPreempted, now: float) -> str | None:
        """A worker gave a slot up: queue the request again where it stood, to resume from what it
        already streamed. Returns the request's tenant when it was queued again. A hand-back for a
        request that ended, or that streams never released, changes nothing."""
        st = self.state
        rid = rec.get("request_id")
        if rid is None:
            return None
        victim = st.preempting.pop(rid, None)
        info = st.released.get(rid)
        if info is None:
            return None
        original = info.get("rec")
        if original is None:  # released before records were kept with releases: cannot queue it again
            log.error("request %s was preempted but its record is unknown; ending it", rid)
            st.released.pop(rid)
            st.ledger.release(rid, now)
            st.end(rid, now)
            st.tenant_changed(info["tenant"])
            return None
        del st.released[rid]
        tokens = [int(t) for t in rec["completion_token_ids"]]
        before = info.get("resumed_tokens", 0)
        st.settle_service(info, 0 if before else len(original["prompt_token_ids"]), len(tokens) - before, now)
        queued = self._queued_again(rid, info, original, len(tokens), now)
        st.queue.requeue(queued, _seq(info, st))
        st.record_queued(rid, _resumed(original, rec, tokens), queued)
        st.metrics.preempted(info["tenant"], rec.get("reason") or "fairness")
        if victim is not None:
            log.info("request %s preempted after %d tokens for %s", rid, len(tokens), victim[0])
        return info["tenant"]

    def _queued_again(self, rid: str, info: ReleasedEntry, original: InferenceRequested, streamed: int,
                      now: float) -> QueuedRequest:
        sampling = original["sampling"]
        return QueuedRequest(
            request_id=rid, tenant_id=info["tenant"], priority=parse_priority(info["priority"]),
            prompt_tokens=len(original["prompt_token_ids"]),
            max_tokens=max(1, sampling["max_tokens"] * max(1, sampling["n"]) - streamed),
            enqueued_at=info.get("enqueued_at", now), weight=self.state.tenants.get(info["tenant"]).fairness_weight,
            deadline=original["deadline_ms"] / 1000.0, payload=original["model"])


def _preemptions(rec: InferenceRequested) -> int:
    """How often the request was preempted so far."""
    resume = rec.get("resume")
    return int(resume.get("preemptions") or 0) if resume else 0


def _seq(info: ReleasedEntry, st: GateState) -> int:
    """Its old place in the queue, or one behind everything queued (an entry that kept none)."""
    seq = info.get("seq")
    return seq if seq is not None else st.queue.next_seq()


def _resumed(original: InferenceRequested, rec: RequestPreempted, tokens: list[int]) -> InferenceRequested:
    """The request's record as it is queued again: where its sequence stopped, to resume from there."""
    resume: ResumePoint = {
        "completion_token_ids": tokens, "text_chars": int(rec["text_chars"]),
        "preemptions": _preemptions(original) + 1,
        "started_at_ms": rec.get("started_at_ms"), "first_token_at_ms": rec.get("first_token_at_ms"),
        "cached_tokens": int(rec.get("cached_tokens") or 0)}
    resumed = original.copy()
    resumed["resume"] = resume
    return resumed
