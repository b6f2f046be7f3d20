"""Tells workers this process still reads its reply partition; when the beats stop (or a new process
takes the partition over), they cancel the requests nobody will read (gpu_consumers/reply_readers.py)."""
from __future__ import annotations

import asyncio

from ingress.kafka.producer import AsyncProducer
from schemas import codec, topics


class Heartbeat:
    def __init__(self, producer: AsyncProducer, reply_partition: int, incarnation: str, interval_s: float):
        self.producer, self.reply_partition = producer, reply_partition
        self.incarnation, self.interval_s = incarnation, interval_s
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._beat())

    async def _beat(self) -> None:
        while True:
            self._send(stopping=False)
            await asyncio.sleep(self.interval_s)

    def _send(self, stopping: bool) -> None:
        beat = codec.new_event("IngressHeartbeat", reply_topic=topics.REPLIES.name,
                               reply_partition=self.reply_partition, incarnation=self.incarnation,
                               interval_ms=int(self.interval_s * 1000), stopping=stopping)
        self.producer.send_nowait(topics.INGRESS_HEARTBEATS.name, f"{topics.REPLIES.name}:{self.reply_partition}",
                                  "IngressHeartbeat", beat)

    def stop(self) -> None:
        """The last beat says the process is going: its requests can be cancelled at once."""
        if self._task:
            self._task.cancel()
            self._send(stopping=True)
