"""The asyncio side of ingress's Kafka producer: produce and await the broker's ack."""
from __future__ import annotations

import asyncio
import threading

from infra.kafka import clients as kafka_clients
from infra.kafka.resilient_producer import ResilientProducer


class AsyncProducer:
    def __init__(self, client_id: str):
        self._producer = ResilientProducer(kafka_clients.producer_config(client_id))
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve_callbacks, name=f"{client_id}-poll", daemon=True)
        self._thread.start()

    def _serve_callbacks(self) -> None:
        while not self._stop.is_set():
            self._producer.poll(0.05)

    async def send(self, topic: str, key: str | None, name: str, record: dict, partition: int | None = None) -> None:
        """Produce and wait until the broker has it (acks=all): only then is a request accepted."""
        loop = asyncio.get_running_loop()
        done: asyncio.Future = loop.create_future()

        def on_delivery(err, _msg) -> None:
            loop.call_soon_threadsafe(_settle, done, None if err is None else RuntimeError(str(err)))

        # produce_event is typed for confluent_kafka's Producer; ResilientProducer has the part of it that
        # produce_event calls (produce, poll), without being one
        kafka_clients.produce_event(self._producer, topic, key, name, record,  # type: ignore[arg-type]
                                    partition=partition, on_delivery=on_delivery)
        await done

    def send_nowait(self, topic: str, key: str, name: str, record: dict) -> None:
        kafka_clients.produce_event(self._producer, topic, key, name, record)  # type: ignore[arg-type]  # as in send

    def close(self) -> None:
        self._producer.flush(10)
        self._stop.set()
        self._thread.join(2)


def _settle(done: asyncio.Future, error: Exception | None) -> None:
    """The delivery report, on the loop: the first one settles the send."""
    if done.done():
        return
    if error is None:
        done.set_result(None)
    else:
        done.set_exception(error)
