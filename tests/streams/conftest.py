from __future__ import annotations

import uuid

import pytest

from tests.streams.harness import Probe, Publisher, StreamsProcess, Topics, streams_env


class StreamsCase:
    """One test's private world: topic prefix, publisher, probe, streams processes."""

    def __init__(self, kafka_bootstrap: str):
        self.bootstrap = kafka_bootstrap
        self.prefix = f"st{uuid.uuid4().hex[:8]}."
        self.t = Topics(self.prefix)
        self.model = f"m-{uuid.uuid4().hex[:6]}"
        self.processes: list[StreamsProcess] = []
        self.workers = []
        self.pub: Publisher | None = None
        self.probe: Probe | None = None

    def start_streams(self, name: str = "streams", wait: bool = True, **env) -> StreamsProcess:
        proc = StreamsProcess(streams_env(self.bootstrap, self.prefix, **env), name=name).start()
        self.processes.append(proc)
        if wait:
            proc.wait_active()
        self.publisher()
        if self.probe is None:
            self.probe = Probe(self.t.work, self.t.replies, self.t.usage, self.t.quota_state)
        return proc

    def publisher(self) -> Publisher:
        """The test's producer, usable before streams starts (what it publishes then is read on
        takeover, before streams handles any request)."""
        if self.pub is None:
            self.pub = Publisher(self.t)
        return self.pub

    def close(self) -> None:
        for w in self.workers:
            w.stop()
        for p in self.processes:
            p.stop()
        if self.probe:
            self.probe.close()


@pytest.fixture
def case(kafka_bootstrap):
    c = StreamsCase(kafka_bootstrap)
    yield c
    c.close()
