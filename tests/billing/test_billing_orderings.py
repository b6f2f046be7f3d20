"""Billing around preemption, shedding, cancels and failover, without Kafka: any ordering of what can
happen to one request, run through the real gate (streams/gate.py), the real worker's usage event
(gpu_consumers/replies.py) and the real ledger pricing (billing_pipeline/ledger.py). Whatever ends the
request, its one ledger row bills exactly the completion tokens its client was streamed, and its
prompt only if a GPU ran it: a request that never ran (shed or cancelled while queued) bills nothing."""
from __future__ import annotations

from types import SimpleNamespace

from hypothesis import HealthCheck, given, settings as hsettings
from hypothesis import strategies as st

from billing_pipeline.ledger import LEDGER_COLUMNS, ledger_row
from billing_pipeline.pricing import PriceBook
from gpu_consumers.recorded_usage import RecordedUsage
from gpu_consumers.in_flight import InFlight
from gpu_consumers.replies import Replies
from schemas import codec
from streams.gate import Gate
from tests.streams.test_streams_gate import MODEL, NOW, advert, request, settings

PRICES = PriceBook({("*", "input"): ([0], [3]), ("*", "cached_input"): ([0], [1]), ("*", "output"): ([0], [7])})
PROMPT = 8
COL = {name: i for i, name in enumerate(LEDGER_COLUMNS)}


class NoMetrics:
    def __getattr__(self, name):
        return SimpleNamespace(inc=lambda *a: None, observe=lambda *a: None)

    def outcome(self, status):
        pass


class Story:
    """One request's life. `phase` is where the request is: queued (in the gate's queue), released
    (in `work`, not yet taken by a worker), pending (taken, waiting for room), running (generating
    `k` tokens in all), ended. `streamed` is what its client has received."""

    def __init__(self):
        self.gate = Gate(settings())
        self.table: dict = {}
        self.now = NOW
        self.req = request("a", max_tokens=64, prompt=PROMPT, deadline=NOW + 1000)
        self.rid = self.req["request_id"]
        self.phase = "queued"
        self.work: dict | None = None
        self.k = 0
        self.streamed = 0
        self.ran = False  # a worker started it at least once (its prompt went through a GPU)
        # A worker died mid-run and no rerun has caught up since: that run's start and tokens are known
        # to no one but the client's ingress, so the ledger cannot bill them (docs/billing.md).
        self.lost_run = False
        self.flight: InFlight | None = None
        self.releases = 0
        self.completed: list[dict] = []
        self.worker = Replies(SimpleNamespace(produce=self.worker_produced), "w1", NoMetrics(),  # type: ignore[arg-type]
                              RecordedUsage(read=lambda since_ms: set()), settle=None)  # type: ignore[arg-type]
        self.gate.on_request(self.req, self.now)
        self._collect()

    # ------------------------------------------------------------------ plumbing

    def worker_produced(self, topic, key=None, value=None, headers=None, partition=None, on_delivery=None):
        rec = codec.decode(value, headers, expect=("RequestCompleted",)).record
        self.completed.append(rec)
        self.gate.on_usage(rec, self.now)  # streams reads the worker's usage event too
        self._collect()
        if on_delivery is not None:  # the broker acknowledges it, as a real producer's poll would report
            on_delivery(None, None)

    def _collect(self) -> None:
        for out in self.gate.take_outputs():
            if out.event == "RequestCompleted":
                self.completed.append(codec.decode(*codec.encode(out.event, out.record)).record)
            elif out.event == "InferenceRequested":
                self.work = codec.decode(*codec.encode(out.event, out.record)).record
                self.releases += 1
                self.phase = "released"
        for key, value in self.gate.take_dirty().items():
            if value is None:
                self.table.pop(key, None)
            else:
                self.table[key] = value

    def _tick(self, dt: float = 1.0) -> None:
        self.now += dt

    def _worker_complete(self, status: str, finish_reason: str, with_flight: bool) -> None:
        self.worker.complete(self.work, status, flight=self.flight if with_flight else None,
                             finish_reason=finish_reason)
        self.flight = None
        self.phase = "ended"

    def _expired(self) -> bool:
        return self.now * 1000 >= self.req["deadline_ms"]

    # ------------------------------------------------------------------ what can happen

    def release(self) -> None:
        """A slot is free: the gate releases the request if it is queued (and not past its deadline)."""
        self._tick()
        self.gate.handle("capacity", None, advert(1, self.releases, ts=self.now), self.now)
        self.gate.step(self.now)
        self._collect()

    def take(self, runs: bool) -> None:
        """A worker takes the released record: it starts it (resuming from what the record carries),
        leaves it pending for room, or sheds it if its deadline has passed."""
        if self.phase != "released":
            return
        self._tick()
        if self._expired():
            self._worker_complete("shed", "deadline", with_flight=False)
            return
        if not runs:
            self.phase = "pending"
            return
        resume = self.work.get("resume") or {}
        self.flight = InFlight(self.work, 0, 0, resume.get("started_at_ms") or int(self.now * 1000))
        self.flight.first_token_at_ms = resume.get("first_token_at_ms")
        # a rerun after a worker crash regenerates what the client already has (the same tokens)
        self.k = max(len(resume.get("completion_token_ids") or []), self.streamed)
        self.flight.completion_tokens = {0: self.k}
        self.phase = "running"
        self.ran = True
        self.lost_run = False  # the rerun regenerates what the client already has, and goes on

    def generate(self, n: int) -> None:
        if self.phase != "running":
            return
        self._tick()
        self.k = min(self.k + n, 64)
        self.flight.completion_tokens = {0: self.k}
        if self.k and self.flight.first_token_at_ms is None:
            self.flight.first_token_at_ms = int(self.now * 1000)
        self.streamed = max(self.streamed, self.k)

    def preempt(self) -> None:
        """The worker gives the slot up (the gate asked), handing back what it produced."""
        if self.phase not in ("running", "pending"):
            return
        self._tick()
        resume = self.work.get("resume") or {}
        if self.phase == "running":
            tokens, started = list(range(self.k)), self.flight.started_at_ms
            first = self.flight.first_token_at_ms
        else:
            tokens = list(resume.get("completion_token_ids") or [])
            started, first = resume.get("started_at_ms"), resume.get("first_token_at_ms")
        back = codec.new_event("RequestPreempted", request_id=self.rid, tenant_id="a", model=MODEL, worker_id="w1",
                               incarnation="i1", reason="fairness", completion_token_ids=tokens, text_chars=len(tokens),
                               started_at_ms=started, first_token_at_ms=first)
        self.flight = None
        self.phase = "queued"
        self.gate.handle("capacity", b"w1", codec.decode(*codec.encode("RequestPreempted", back)).record, self.now,
                         "RequestPreempted")
        self._collect()

    def finish(self) -> None:
        if self.phase == "running":
            self._tick()
            self._worker_complete("finished", "stop", with_flight=True)

    def cancel(self) -> None:
        """The client cancels: the gate ends it if queued, else the worker that has (or will take) it."""
        if self.phase == "ended":
            return
        self._tick()
        self.gate.on_cancel({"request_id": self.rid}, self.now)
        self._collect()
        if self.phase in ("released", "pending"):
            self._worker_complete("cancelled", "cancelled", with_flight=False)
        elif self.phase == "running":
            self._worker_complete("cancelled", "cancelled", with_flight=True)
        else:
            self.phase = "ended"

    def deadline_passes(self) -> None:
        """Time runs past the deadline: the gate sheds it if queued; a worker sheds it if pending."""
        if self.phase == "ended":
            return
        self.now = max(self.now, self.req["deadline_ms"] / 1000) + 1
        self.gate.step(self.now)
        self._collect()
        if any(c["status"] == "shed" for c in self.completed):
            self.phase = "ended"
        elif self.phase == "pending":
            self._worker_complete("shed", "deadline", with_flight=False)

    def streams_failover(self) -> None:
        """The streams owner dies; a new one restores the gate from the durable state it wrote."""
        self._tick()
        self.gate = Gate(settings(), dict(self.table))

    def worker_crash(self) -> None:
        """The worker dies mid-request: `work` delivers the same record again."""
        if self.phase in ("running", "pending"):
            self._tick()
            self.lost_run = self.lost_run or self.phase == "running"
            self.flight = None
            self.phase = "released"

    def end(self) -> None:
        """However the story stopped, the request ends: a running one finishes, any other is cancelled."""
        if self.phase == "running":
            self.finish()
        self.cancel()


ACTIONS = st.one_of(
    st.just(("release",)), st.tuples(st.just("take"), st.booleans()), st.tuples(st.just("generate"), st.integers(1, 9)),
    st.just(("preempt",)), st.just(("finish",)), st.just(("cancel",)), st.just(("deadline_passes",)),
    st.just(("streams_failover",)), st.just(("worker_crash",)))


@hsettings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(ACTIONS, max_size=30))
def test_every_ordering_bills_the_streamed_tokens_and_a_request_that_never_ran_bills_nothing(actions):
    story = Story()
    for name, *args in actions:
        getattr(story, name)(*args)
        if story.phase == "ended":
            break
    story.end()
    assert len(story.completed) == 1, [c["status"] for c in story.completed]  # ends exactly once
    row = ledger_row(story.completed[0], PRICES)
    billed_prompt = row[COL["prompt_tokens"]] if row[COL["billable"]] else 0
    billed_completion = row[COL["completion_tokens"]] if row[COL["billable"]] else 0
    if story.lost_run:  # never more than the client got; what the dead run did is unknowable here
        assert billed_completion <= story.streamed and billed_prompt in (0, PROMPT)
    else:
        assert billed_completion == story.streamed
        assert billed_prompt == (PROMPT if story.ran else 0)
    assert row[COL["cost_pusd"]] == 3 * billed_prompt + 7 * billed_completion
    # the gate's quota counts the same tokens for a request it ended itself
    if story.completed[0]["worker_id"] is None:
        assert story.gate.ledger.in_flight("a") == (0, 0)


def test_preempted_after_streaming_then_shed_bills_what_was_streamed():
    story = Story()
    story.release()
    story.take(True)
    story.generate(5)
    story.preempt()
    story.deadline_passes()
    (done,) = story.completed
    assert done["status"] == "shed"
    row = ledger_row(done, PRICES)
    assert row[COL["billable"]] == 1 and row[COL["completion_tokens"]] == 5
    assert row[COL["cost_pusd"]] == 3 * PROMPT + 7 * 5


def test_cancelled_while_queued_bills_nothing():
    story = Story()
    story.cancel()
    (done,) = story.completed
    assert done["status"] == "cancelled"
    row = ledger_row(done, PRICES)
    assert row[COL["billable"]] == 0 and row[COL["cost_pusd"]] == 0
    assert story.gate.ledger.usage("a", story.now).used_tokens_in_window == 0  # refunded, not charged


def test_cancelled_while_pending_on_its_worker_bills_nothing():
    story = Story()
    story.release()
    story.take(False)
    story.cancel()
    (done,) = story.completed
    row = ledger_row(done, PRICES)
    assert done["status"] == "cancelled" and row[COL["billable"]] == 0 and row[COL["cost_pusd"]] == 0
