"""The one consume loop step every long-lived reader shares: wait for the first record, take what
else has already arrived, and sort out what is not a record.

librdkafka's consume(n, timeout) waits for n records or the whole timeout, whichever comes first;
poll(timeout) returns at the first one. So: block in poll, then drain without waiting.
"""
from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field

from confluent_kafka import KafkaError

log = logging.getLogger(__name__)


@dataclass
class Taken:
    records: list = field(default_factory=list)
    # Partitions whose end the consumer reached, with the end offset: the position, even where
    # compaction removed the last records below it (needs enable.partition.eof).
    ends: dict[tuple[str, int], int] = field(default_factory=dict)


def take_available(consumer, wait_s: float, max_messages: int = 500) -> Taken:
    """Records that arrived within wait_s (at most max_messages), errors logged and left out."""
    taken = Taken()
    first = consumer.poll(wait_s)
    if first is None:
        return taken
    batch = [first, *consumer.consume(num_messages=max_messages - 1, timeout=0)] if max_messages > 1 else [first]
    for msg in batch:
        err = msg.error()
        if err is None:
            taken.records.append(msg)
        elif err.code() == KafkaError._PARTITION_EOF:
            taken.ends[(msg.topic(), msg.partition())] = msg.offset()
        else:
            log.warning("consumer error: %s", err)
    return taken


def close_in_background(consumer, what: str) -> None:
    """Close a client that is being replaced without waiting for it. A stuck client's close() can
    block for good (seen: a worker whose replaced group consumer never returned from close() after
    a broker restart, so it stopped generating). The replacement never shares it with this thread."""
    def close() -> None:
        try:
            consumer.close()
        except Exception as exc:  # a client in that state may not close cleanly; it is dropped anyway
            log.warning("closing the replaced %s: %s", what, exc)

    threading.Thread(target=close, name=f"close-{what}", daemon=True).start()
