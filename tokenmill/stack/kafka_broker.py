"""A real Kafka node (KRaft, broker+controller in one JVM) on loopback: by default a single-node
cluster of its own; several of them with one quorum make a cluster (tokenmill/stack/kafka_cluster.py).

The jars come from Maven Central once (`mvn dependency:copy-dependencies` over
tokenmill/stack/kafka_jars/pom.xml) into a git-ignored cache; the broker runs in the background
with its own data directory, pid file and log file.
"""
from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from tokenmill.stack import kafka_class_archive
from infra.paths import kafka_libs, REPO_ROOT

POM = REPO_ROOT / "tokenmill" / "stack" / "kafka_jars" / "pom.xml"

LOG4J2_CONFIG = """\
Configuration:
  status: warn
  Appenders:
    File:
      name: file
      fileName: "{log}"
      PatternLayout:
        pattern: "%d{{ISO8601}} %-5p [%c{{1}}] %m%n"
  Loggers:
    Root:
      level: info
      AppenderRef:
        - ref: file
    Logger:
      - name: kafka.request.logger
        level: warn
      - name: org.apache.kafka.controller
        level: warn
      - name: state.change.logger
        level: warn
"""


def ensure_jars() -> Path:
    """Fetch the broker jars into the cache if they are not there yet."""
    if not any(kafka_libs().glob("kafka_2.13-*.jar")):
        kafka_libs().mkdir(parents=True, exist_ok=True)
        # Kept from the terminal unless it fails: even quiet and in batch mode, Maven 3.8 writes bare
        # colour resets ("\x1b[0m") that showed up in `make up`'s output.
        done = subprocess.run(
            ["mvn", "-q", "-B", "-f", str(POM), "dependency:copy-dependencies",
             f"-DoutputDirectory={kafka_libs()}", "-DincludeScope=runtime"],
            capture_output=True, text=True,
        )
        if done.returncode != 0:
            output = re.sub(r"\x1b\[[0-9;]*m", "", done.stdout + done.stderr).strip()
            raise RuntimeError(f"fetching the Kafka jars with Maven failed:\n{output[-3000:]}")
    return kafka_libs()


def _port_open(host: str, port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex((host, port)) == 0


@dataclass
class LocalKafka:
    data_dir: Path
    port: int = 19092
    controller_port: int = 19093
    host: str = "127.0.0.1"
    heap: str = "512m"
    node_id: int = 1
    # controller.quorum.voters ("1@host:port,2@host:port,..."); None: this node is the whole quorum
    voters: str | None = None
    # what a new data directory is formatted with (every node of a cluster needs the same); None: a new one
    cluster_id: str | None = None
    # further broker settings, over the single-node defaults (a cluster's replication factors)
    extra: dict[str, str] = field(default_factory=dict)
    jvm_options: tuple[str, ...] = ()
    # map the broker's classes from tokenmill/stack/kafka_class_archive.py's archive when it has been made
    class_archive: bool = True

    @property
    def bootstrap(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def pid_file(self) -> Path:
        return self.data_dir / "broker.pid"

    @property
    def log_file(self) -> Path:
        return self.data_dir / "broker.log"

    def _properties(self) -> Path:
        props = {
            "process.roles": "broker,controller",
            "node.id": str(self.node_id),
            "controller.quorum.voters": self.voters or f"{self.node_id}@{self.host}:{self.controller_port}",
            "listeners": f"PLAINTEXT://{self.host}:{self.port},CONTROLLER://{self.host}:{self.controller_port}",
            "advertised.listeners": f"PLAINTEXT://{self.host}:{self.port}",
            "controller.listener.names": "CONTROLLER",
            "inter.broker.listener.name": "PLAINTEXT",
            "listener.security.protocol.map": "PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT",
            "log.dirs": str(self.data_dir / "log"),
            "num.partitions": "3",
            "offsets.topic.replication.factor": "1",
            "offsets.topic.num.partitions": "12",
            "transaction.state.log.replication.factor": "1",
            "transaction.state.log.min.isr": "1",
            "share.coordinator.state.topic.replication.factor": "1",
            "share.coordinator.state.topic.min.isr": "1",
            "group.initial.rebalance.delay.ms": "0",
            "auto.create.topics.enable": "false",
            "log.segment.bytes": str(64 * 2**20),
            "log.cleaner.dedupe.buffer.size": str(16 * 2**20),
            **self.extra,
        }
        path = self.data_dir / "server.properties"
        path.write_text("".join(f"{k}={v}\n" for k, v in props.items()))
        return path

    def _java(self, main: str, *args: str, **popen) -> list[str]:
        ensure_jars()
        classpath = kafka_class_archive.classpath()
        sharing = kafka_class_archive.jvm_options(classpath) if self.class_archive else ()
        log_config = self.data_dir / "log4j2.yaml"
        log_config.write_text(LOG4J2_CONFIG.format(log=self.log_file))
        return [
            "java", f"-Xmx{self.heap}", f"-Xms{self.heap}", "-XX:+UseG1GC", *sharing, *self.jvm_options,
            "-Djava.awt.headless=true", f"-Dlog4j2.configurationFile={log_config}", "-cp", classpath, main, *args,
        ]

    def running_pid(self) -> int | None:
        try:
            pid = int(self.pid_file.read_text())
            os.kill(pid, 0)
            return pid
        except (FileNotFoundError, ValueError, ProcessLookupError, PermissionError):
            return None

    def start(self, timeout: float = 90.0) -> str:
        """Start the broker unless it already runs; return its bootstrap address."""
        if self.running_pid() is not None:
            self.wait_ready(timeout)
            return self.bootstrap
        self.wait_ready(timeout, self.launch())
        return self.bootstrap

    def launch(self) -> subprocess.Popen:
        """Start the JVM (formatting a new data directory first) without waiting for it to be ready:
        the nodes of a cluster must all be starting before any of them can be."""
        if _port_open(self.host, self.port):
            raise RuntimeError(f"port {self.port} is taken by something that is not our broker")
        self.data_dir.mkdir(parents=True, exist_ok=True)
        props = self._properties()
        if not (self.data_dir / "log" / "meta.properties").exists():
            cluster_id = self.cluster_id or uuid.uuid4().hex[:22]
            subprocess.run(
                self._java("kafka.tools.StorageTool", "format", "-t", cluster_id, "-c", str(props)),
                check=True, stdout=subprocess.DEVNULL,
            )
        with open(self.data_dir / "broker.stdout", "ab") as out:
            proc = subprocess.Popen(
                self._java("kafka.Kafka", str(props)), stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.pid_file.write_text(str(proc.pid))
        return proc

    def wait_ready(self, timeout: float, proc: subprocess.Popen | None = None) -> None:
        """Until this node serves as a broker: its own metadata names it among the live brokers."""
        from confluent_kafka.admin import AdminClient

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if proc is not None and proc.poll() is not None:
                raise RuntimeError(f"Kafka exited with {proc.returncode}; see {self.log_file}")
            if _port_open(self.host, self.port):
                try:
                    md = AdminClient({"bootstrap.servers": self.bootstrap}).list_topics(timeout=2)
                    if self.node_id in md.brokers:
                        return
                except Exception:
                    pass
            time.sleep(0.3)
        raise TimeoutError(f"Kafka did not become ready in {timeout}s; see {self.log_file}")

    def stop(self, timeout: float = 30.0) -> None:
        pid = self.running_pid()
        if pid is None:
            return
        os.killpg(pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                break
            try:  # reap it if it is our child
                os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                pass
            time.sleep(0.2)
        else:
            os.killpg(pid, signal.SIGKILL)
        self.pid_file.unlink(missing_ok=True)

    def kill(self) -> None:
        """SIGKILL: the node is gone at once, as in a crash (no controlled shutdown, nothing flushed)."""
        pid = self.running_pid()
        if pid is None:
            return
        os.killpg(pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                if os.waitpid(pid, os.WNOHANG)[0] == pid:  # our child: reaped
                    break
            except ChildProcessError:  # not our child: gone once kill(0) fails
                try:
                    os.kill(pid, 0)
                except ProcessLookupError:
                    break
            time.sleep(0.05)
        self.pid_file.unlink(missing_ok=True)
