"""A real Kafka cluster on loopback: N KRaft nodes, each a broker and a controller in one JVM
(tokenmill/stack/kafka_broker.py), with one static controller quorum of all N and replication factor
min(3, N), min ISR 2 (from 3 replicas) for Kafka's own topics and as the default for new ones.

Every node has its own data directory under the cluster's (`node-<id>/`), formatted with the
one cluster id the cluster keeps in `cluster.id`; starting a cluster whose directory was formatted
for a different quorum fails rather than mixing the two. Used by `TOKENMILL_KAFKA_BROKERS=3 make up`
(tokenmill/stack/local_stack.py) and by the broker-loss fault tests.
"""
from __future__ import annotations

import socket
import subprocess
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tokenmill.stack.kafka_broker import LocalKafka
from infra.kafka.clients import MAX_REPLICATION

# How soon the controller declares a SIGKILLed broker dead (fences it): its partitions get new
# leaders and it leaves every ISR only then. Kafka's defaults (2 s heartbeats, 9 s session) would
# keep a killed node's partitions leaderless for up to 9 s; these keep it near 3 s and still leave
# a loaded 2-core machine ten heartbeats' slack.
BROKER_HEARTBEAT_MS = 300
BROKER_SESSION_MS = 3000


# Several JVMs share a small machine with the stack: fewer threads each, 12 transaction-state
# partitions (Kafka's default is 50, each replicated on every node here), and the quick JIT only
# (measured on 2 cores: three nodes ready in 9 s instead of 23 s, and idle at 5% CPU each, not 11%).
SMALL_MACHINE_SETTINGS = {
    "num.network.threads": "2",
    "num.io.threads": "2",
    "background.threads": "2",
    "transaction.state.log.num.partitions": "12",
}
SMALL_MACHINE_JVM = ("-XX:TieredStopAtLevel=1", "-XX:ParallelGCThreads=1", "-XX:ConcGCThreads=1")


def replication_settings(nodes: int) -> dict[str, str]:
    """The broker settings that make a cluster of `nodes` replicate: factor min(3, N), and with 3
    replicas a write needs 2 of them in sync (one broker may be lost without losing a write)."""
    factor = min(MAX_REPLICATION, nodes)
    min_isr = str(2 if factor >= 3 else 1)
    return {
        "default.replication.factor": str(factor),
        "min.insync.replicas": min_isr,
        "offsets.topic.replication.factor": str(factor),
        "transaction.state.log.replication.factor": str(factor),
        "transaction.state.log.min.isr": min_isr,
        "share.coordinator.state.topic.replication.factor": str(factor),
        "share.coordinator.state.topic.min.isr": min_isr,
        "broker.heartbeat.interval.ms": str(BROKER_HEARTBEAT_MS),
        "broker.session.timeout.ms": str(BROKER_SESSION_MS),
    }


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalKafkaCluster:
    def __init__(self, data_dir: Path, ports: list[tuple[int, int]], host: str = "127.0.0.1", heap: str = "384m"):
        """ports: (broker port, controller port) of each node; node ids are 1..N in that order."""
        if not ports:
            raise ValueError("a cluster needs at least one node")
        self.data_dir = data_dir
        self.host = host
        self.voters = ",".join(f"{i}@{host}:{controller}" for i, (_, controller) in enumerate(ports, 1))
        extra = {**SMALL_MACHINE_SETTINGS, **replication_settings(len(ports))}
        self.nodes = [LocalKafka(data_dir / f"node-{i}", port=port, controller_port=controller, host=host, heap=heap,
                                 node_id=i, voters=self.voters, extra=extra, jvm_options=SMALL_MACHINE_JVM)
                      for i, (port, controller) in enumerate(ports, 1)]

    @classmethod
    def on_free_ports(cls, data_dir: Path, size: int = 3, **kwargs) -> "LocalKafkaCluster":
        return cls(data_dir, [(_free_port(), _free_port()) for _ in range(size)], **kwargs)

    @property
    def bootstrap(self) -> str:
        return ",".join(node.bootstrap for node in self.nodes)

    @property
    def replication_factor(self) -> int:
        return min(MAX_REPLICATION, len(self.nodes))

    def node(self, node_id: int) -> LocalKafka:
        return self.nodes[node_id - 1]

    def running_pids(self) -> dict[int, int | None]:
        return {node.node_id: node.running_pid() for node in self.nodes}

    def running(self) -> bool:
        return any(pid is not None for pid in self.running_pids().values())

    def _cluster_id(self) -> str:
        """The cluster's id, made on first start; the quorum it was formatted for must not change."""
        self.data_dir.mkdir(parents=True, exist_ok=True)
        id_file, voters_file = self.data_dir / "cluster.id", self.data_dir / "voters"
        if not id_file.exists():
            id_file.write_text(uuid.uuid4().hex[:22])
            voters_file.write_text(self.voters)
        if voters_file.read_text() != self.voters:
            raise RuntimeError(f"{self.data_dir} holds a cluster formatted for the quorum {voters_file.read_text()}, "
                               f"not {self.voters}; remove the folder to start a new cluster")
        return id_file.read_text()

    def start(self, timeout: float = 120.0) -> str:
        """Start every node that is not running, and wait until each serves; return the bootstrap list."""
        cluster_id = self._cluster_id()
        for node in self.nodes:
            node.cluster_id = cluster_id
        # In parallel: formatting a new data directory is a JVM start of its own (seconds each).
        with ThreadPoolExecutor(max_workers=len(self.nodes)) as pool:
            launched: dict[int, subprocess.Popen | None] = dict(zip(
                (node.node_id for node in self.nodes),
                pool.map(lambda node: node.launch() if node.running_pid() is None else None, self.nodes)))
        deadline = time.monotonic() + timeout
        for node in self.nodes:
            node.wait_ready(max(1.0, deadline - time.monotonic()), launched[node.node_id])
        return self.bootstrap

    def wait_for_topics(self, names: list[str], timeout: float = 60.0) -> None:
        """Until every node's own metadata has these topics, each partition led and fully in sync (a
        topic just created reaches each broker's metadata a moment later)."""
        from confluent_kafka.admin import AdminClient

        deadline = time.monotonic() + timeout
        while True:
            missing = []
            for node in self.nodes:  # a fresh client per node: its first answer comes from that node
                try:
                    meta = AdminClient({"bootstrap.servers": node.bootstrap}).list_topics(timeout=5)
                except Exception as exc:  # a node still starting answers nothing yet
                    missing.append(f"node {node.node_id}: {exc}")
                    continue
                for name in names:
                    parts = meta.topics[name].partitions if name in meta.topics else {}
                    if not parts or any(pm.leader < 0 or len(pm.isrs) < len(pm.replicas) for pm in parts.values()):
                        missing.append(f"{name} on node {node.node_id}")
            if not missing:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"topics not ready on every node in {timeout}s: {missing[:5]}")
            time.sleep(0.2)

    def stop(self, timeout: float = 30.0) -> None:
        """Stop every node. All at once: a node stopped last would otherwise wait for a quorum that
        its stopped peers can no longer form."""
        with ThreadPoolExecutor(max_workers=len(self.nodes)) as pool:
            list(pool.map(lambda node: node.stop(timeout), self.nodes))

    def kill(self, node_id: int) -> None:
        """SIGKILL one node (a crashed broker and controller)."""
        self.node(node_id).kill()

    def restart(self, node_id: int, timeout: float = 120.0) -> None:
        """Start one stopped or killed node again (on its data) and wait until it serves."""
        node = self.node(node_id)
        node.cluster_id = self._cluster_id()
        node.start(timeout)
