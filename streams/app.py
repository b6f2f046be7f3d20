"""The streams process (a Faust app): the authoritative gate in front of the GPU pool.

It consumes `requests`, dead-letters what it cannot decode, and releases admitted
requests to `work` keyed by request id. (Quota authority and the fair queue that
releases against capacity credits build on this loop.)
"""
from __future__ import annotations

import logging
import time

import faust

from infra import kafka_clients
from schemas import codec, topics

log = logging.getLogger("tokenmill.streams")


def create_app(app_id: str = "tokenmill-streams") -> faust.App:
    bootstrap = kafka_clients.bootstrap_servers()
    app = faust.App(
        app_id,
        broker=",".join(f"kafka://{b}" for b in bootstrap.split(",")),
        key_serializer="raw",
        value_serializer="raw",
        producer_acks=-1,
        producer_linger=0.001,
        consumer_auto_offset_reset="earliest",
        web_enabled=False,
        topic_allow_declare=False,
        topic_disable_leader=True,
        broker_commit_every=100,
        broker_commit_interval=0.5,
        store="memory://",
    )
    requests_topic = app.topic(topics.REQUESTS.name, key_type=bytes, value_type=bytes)
    work_topic = app.topic(topics.WORK.name, key_type=bytes, value_type=bytes)
    dead_letters = app.topic(topics.DEAD_LETTERS.name, key_type=bytes, value_type=bytes)

    async def dead_letter(event, reason: str) -> None:
        msg = event.message
        log.warning("dead-lettering requests[%s]@%s: %s", msg.partition, msg.offset, reason)
        record = codec.new_event(
            "DeadLetter", source_topic=msg.topic, source_partition=msg.partition, source_offset=msg.offset,
            consumer=app_id, reason=reason[:2000], key=msg.key, value=msg.value,
        )
        value, headers = codec.encode("DeadLetter", record)
        await dead_letters.send(key=msg.key, value=value, headers=headers)

    @app.agent(requests_topic)
    async def gate(stream):
        async for event in stream.events():
            try:
                decoded = codec.decode(event.value, event.headers, expect=("InferenceRequested",))
            except codec.UndecodableEvent as exc:
                await dead_letter(event, str(exc))
                continue
            record = decoded.record
            record["released_at_ms"] = int(time.time() * 1000)
            value, headers = codec.encode("InferenceRequested", record)
            await work_topic.send(key=record["request_id"].encode(), value=value, headers=headers)

    return app


def main(argv: list[str] | None = None) -> None:
    app = create_app()
    app.main()
