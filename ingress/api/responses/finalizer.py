"""The one writer of a background response's final record: whoever sees its `RequestCompleted`.

A background response is stored `queued` when it is created; its answer arrives as reply events on
`batch-results` and its end as the `RequestCompleted` the worker (or, for one that never ran, the gate)
writes to `usage`. Every ingress process is a member of one consumer group on `usage`, so each completion
is seen by exactly one of them at a time. For a completion of a background response that is not final yet,
that member reads the response's reply events back, settles the record from them and from the
completion's status (finished: completed or incomplete; cancelled: cancelled, with the text generated up
to then; failed or shed: failed, with the worker's error if it sent one) and writes it, then commits.

So the final state is written once, when the request ends, whether or not anyone polls: a response whose
reply events later age out of `batch-results` (7 days) is final long before. Readers (GET, replays,
cancel) compute what the events show but never write; cancel asks the workers to stop and waits for this
writer's record, so a response that finished first is answered as finished and never overwritten. A member
that dies before committing leaves its completions to the next owner of the partition, which writes the
same record (writes are idempotent: a record already final is left alone). A completion that arrives
before this process's view has the response's record (a response is stored just after its request is
queued, and another process's record arrives a moment later) is kept for a minute and matched when the
record comes.
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import OrderedDict

from confluent_kafka import Consumer

from infra.kafka import clients as kafka_clients
from infra.kafka.group_consumer import OFF_TOKEN_PATH, HealingGroupConsumer
from ingress.api.responses.background_replies import BackgroundReplies
from ingress.api.responses.follower import ResponseFollower
from ingress.api.responses.store import FINAL_STATUSES
from ingress.api.responses.turn import ResponseLog, Turn
from ingress.kafka.producer import AsyncProducer
from ingress.kafka.reads import KafkaReads
from ingress.kafka.reply_events import ReplyEvent
from ingress.serving.request_stream import error_from_event
from ingress.serving.request_view import ChatView
from schemas import codec, topics
from schemas.records import RequestCompleted, RequestError, StoredResponse

log = logging.getLogger(__name__)

GROUP_ID = "ingress-response-finalizer"
# The worker writes a request's last reply before its completion, to another topic: a read of the replies
# that does not show the end yet is tried again for this long before the record is settled from the
# completion alone.
REPLIES_CATCH_UP_S = 5.0
FINALIZE_TIMEOUT_S = 60.0
ATTEMPTS = 3
# Completions not matched yet are kept this long (and at most this many) for a record on its way
RECENT_S = 60.0
RECENT_MAX = 100_000


def settled_record(record: StoredResponse, completed: RequestCompleted, events: list[ReplyEvent]) -> StoredResponse:
    """The final record of a background response: its reply events applied, then the completion's status."""
    view = ChatView(response_id=record["response_id"], model=record["model"], n=1,
                    prompt_tokens=record["input_tokens"])
    turn = Turn(log=None, record=record.copy(), view=view)
    error: RequestError | None = None
    for event in events:
        if event[0] == "error":
            error = event[1]
        else:
            view.apply(event[1])
    status = completed["status"]
    if status == "finished" and view.finished:
        turn.settle()
    elif status == "finished" or status == "cancelled":
        # the text generated up to its end (a finished one whose last events are not readable: its usage)
        turn.record.update({"output_text": "".join(view.choices[0].text),
                            "input_tokens": completed["prompt_tokens"],
                            "output_tokens": completed["completion_tokens"],
                            "cached_tokens": completed["cached_tokens"],
                            "status": "completed" if status == "finished" else "cancelled"})
    elif error is not None:
        turn.fail(error_from_event(error))
    else:
        turn.record.update({"status": "failed", "error_message": (
            "deadline_exceeded: The request did not finish in time." if status == "shed"
            else "server_error: The request failed.")})
    return turn.record


class ResponseFinalizer:
    """A thread of each ingress process: its member of the finalizer group on `usage`."""

    def __init__(self, client_id: str, follower: ResponseFollower, producer: AsyncProducer, reads: KafkaReads):
        self.client_id, self.follower, self.producer, self.reads = client_id, follower, producer, reads
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.finalized = 0
        # by request id (None: a completion without one, which no response waits for)
        self._recent: OrderedDict[str | None, tuple[RequestCompleted, float]] = OrderedDict()
        self.group = HealingGroupConsumer(
            topics.USAGE.name, lambda: Consumer(kafka_clients.consumer_config(GROUP_ID, client_id)),
            f"{client_id} finalizer", OFF_TOKEN_PATH,
            rejoin_if_never_assigned=False)  # more ingress processes than partitions: some hold none

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self.group.subscribe()
        self._thread = threading.Thread(target=self._run, name="response-finalizer", daemon=True)
        self._thread.start()

    async def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:  # joined off the loop: a finalize in flight needs the loop to end
            await asyncio.to_thread(self._thread.join, 10)
        self.group.close()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._step()
            except Exception:  # noqa: BLE001 - a bad moment (broker away); the uncommitted is read again
                log.exception("response finalizer: step failed; going on")
                self._stop.wait(1.0)

    def _remember(self, completed: RequestCompleted) -> None:
        self._recent[completed["request_id"]] = (completed, time.monotonic())
        while len(self._recent) > RECENT_MAX:
            self._recent.popitem(last=False)

    def _recheck_recent(self) -> None:
        """Completions this view had no unfinished background response for when they came: the response
        is stored just after its request is queued, and another process's record reaches this view a
        moment later, so a fast request's completion can come first. Matched as its record arrives."""
        horizon = time.monotonic() - RECENT_S
        while self._recent:
            request_id, (_, seen) = next(iter(self._recent.items()))
            if seen >= horizon:
                break
            del self._recent[request_id]
        for request_id in [r for r in self._recent if r is not None and self.follower.store.unfinished(r) is not None]:
            completed, _ = self._recent.pop(request_id)
            found = self.follower.store.unfinished(request_id)
            if found is not None:
                self._finalize_with_retries(found, completed)

    def _step(self) -> None:
        self._recheck_recent()
        self.group.heal()
        client = self.group.client
        msgs = client.consume(num_messages=500, timeout=0.5)
        if not msgs:
            return
        for msg in msgs:
            if msg.error() is not None:
                continue
            try:
                event = codec.decode(msg.value(), msg.headers(), expect=("RequestCompleted",), check=True)
            except codec.UndecodableEvent:
                continue  # the ledger writer dead-letters it; nothing here to finalize
            completed = codec.record_of(event, RequestCompleted)
            request_id = completed["request_id"]
            found = self.follower.store.unfinished(request_id) if request_id is not None else None
            if found is None:
                self._remember(completed)
            else:
                self._finalize_with_retries(found, completed)
        client.commit(asynchronous=True)

    def _finalize_with_retries(self, found: tuple[str, str], completed: RequestCompleted) -> None:
        assert self._loop is not None
        for attempt in range(1, ATTEMPTS + 1):
            try:
                asyncio.run_coroutine_threadsafe(self.finalize(*found, completed), self._loop).result(FINALIZE_TIMEOUT_S)
                return
            except Exception as exc:  # noqa: BLE001 - Kafka away: its readers still see its events meanwhile
                log.warning("finalizing response %s (attempt %d of %d): %s", found[1], attempt, ATTEMPTS, exc)
                if self._stop.wait(attempt):
                    return
        log.error("response %s was not finalized; readers answer it from its reply events", found[1])

    async def finalize(self, tenant_id: str, response_id: str, completed: RequestCompleted) -> StoredResponse | None:
        """Write the final record of one background response, unless it is final already; the record."""
        record = await self.follower.record(tenant_id, response_id, self.reads)
        if record is None or record["status"] in FINAL_STATUSES:
            return record
        events = await self._events(record, completed["status"] == "finished")
        final = settled_record(record, completed, events)
        await ResponseLog(self.producer, self.follower.store).save(final)
        self.finalized += 1
        return final

    async def _events(self, record: StoredResponse, expect_end: bool) -> list[ReplyEvent]:
        replies = await self.reads.run(BackgroundReplies, record["request_id"], record["reply_partition"],
                                       record["created_at_ms"], self.reads.consumers)
        try:
            events: list[ReplyEvent] = []
            deadline = time.monotonic() + REPLIES_CATCH_UP_S
            while True:
                events += await self.reads.run(replies.read_to_end)
                ended = any(event[0] == "error" or event[1].get("finish_reason") for event in events)
                if ended or not expect_end or time.monotonic() > deadline:
                    return events
                await asyncio.sleep(0.2)
        finally:
            self.reads.after(None, replies.close)
