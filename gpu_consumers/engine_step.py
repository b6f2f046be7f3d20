"""One engine step and what it produced: one ReplyBatch per reply address, the usage of every request
that ended, and an error for every request the engine had to end (a grammar matcher that refused a
token, an adapter that could not be loaded) or that a failed step took down."""
from __future__ import annotations

import logging
import time
from collections import defaultdict
from typing import Any

from gpu_consumers.after_delivery import AfterDelivery, fan_out
from gpu_consumers.engine.core.sequence import CONSTRAINT_VIOLATED, LORA_LOAD_FAILED
from gpu_consumers.in_flight import InFlight, RequestBook, now_ms
from gpu_consumers.metrics import WorkerMetrics
from gpu_consumers.replies import Replies, reply_item
from schemas import codec


log = logging.getLogger("tokenmill.worker")


class EngineStep:
    def __init__(self, engine: Any, book: RequestBook, replies: Replies, metrics: WorkerMetrics, worker_id: str):
        self.engine = engine
        self.book = book
        self.replies = replies
        self.metrics = metrics
        self.worker_id = worker_id
        self.last_step_s = 0.0

    def step(self) -> int:
        """Run one step and send what it produced; the number of requests it ended (0 if it failed)."""
        try:
            began = time.perf_counter()
            outputs = self.engine.step()
            self.last_step_s = time.perf_counter() - began
            self.metrics.step_time.observe(self.last_step_s)
        except Exception:
            log.exception("engine step failed; failing every request in flight")
            for request_id, flight in list(self.book.in_flight.items()):
                self.engine.abort(request_id)
                self.replies.fail(flight, 500, "engine_error",
                                  "Generation failed on the worker; the request was not finished.")
            self.book.in_flight.clear()
            return 0
        return self.send(outputs)

    def send(self, outputs: list) -> int:
        batches: dict[tuple[str, int], list[dict]] = defaultdict(list)
        ended: list[InFlight] = []
        broken: dict[str, InFlight] = {}
        stamp = now_ms()
        for out in outputs:
            flight = self.book.in_flight.get(out.request_id)
            if flight is None or out.request_id in broken:
                continue
            if out.finished and out.finish_reason in (CONSTRAINT_VIOLATED, LORA_LOAD_FAILED):
                broken[out.request_id] = flight
                flight.error = getattr(out, "error", None) if out.finish_reason == LORA_LOAD_FAILED else None
                continue
            batches[flight.reply_address].append(reply_item(flight, out, stamp))
            if out.finished and len(flight.finished_choices) == flight.record["sampling"]["n"]:
                ended.append(flight)
        ended = [flight for flight in ended if flight.request_id not in broken]
        settles = {flight.request_id: self.replies.settle(flight.request_id, flight.partition, flight.offset)
                   for flight in ended}
        self.send_batches(batches, broken, settles)
        for request_id, flight in broken.items():
            self.end_broken(request_id, flight)
        for flight in ended:
            del self.book.in_flight[flight.request_id]
            self.replies.finished(flight, settles[flight.request_id])
        return len(ended)

    def send_batches(self, batches: dict[tuple[str, int], list[dict]], broken: dict[str, InFlight],
                     settles: dict[str, AfterDelivery]) -> None:
        """One ReplyBatch per reply address; a batch that ends requests settles each of them on delivery."""
        for (topic, partition), items in batches.items():
            items = [item for item in items if item["request_id"] not in broken]
            if items:
                reply = codec.new_event("ReplyBatch", worker_id=self.worker_id, items=items)
                ending = [settles[request_id].expect() for request_id in {item["request_id"] for item in items}
                          if request_id in settles]
                self.replies.produce(topic, None, "ReplyBatch", reply, partition=partition,
                                     on_delivery=fan_out(ending))

    def end_broken(self, request_id: str, flight: InFlight) -> None:
        """The engine ended it: this request ends with an error, the batch goes on."""
        del self.book.in_flight[request_id]
        self.engine.abort(request_id)
        if flight.error is not None:  # its LoRA adapter could not be read: a clear error, not a hang
            log.error("request %s: its adapter could not be loaded: %s", request_id, flight.error)
            self.replies.fail(flight, 500, "adapter_load_failed", f"The adapter could not be loaded: {flight.error}")
            return
        log.error("request %s: its response_format matcher refused a token; ended with an error", request_id)
        self.replies.fail(flight, 500, "grammar_error",
                          "Structured output failed on the worker; the request was not finished.")
