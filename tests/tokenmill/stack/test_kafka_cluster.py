"""The local cluster's configuration, the replication every topic gets, and what `make up` / `make down`
/ `tokenmill status` do with TOKENMILL_KAFKA_BROKERS (no broker started here)."""
from types import SimpleNamespace

import pytest

from infra.kafka import clients as kafka_clients
from tokenmill.stack import local_stack as stack
from tokenmill.stack.kafka_cluster import LocalKafkaCluster, replication_settings


def _properties(node) -> dict[str, str]:
    node.data_dir.mkdir(parents=True, exist_ok=True)
    return dict(line.split("=", 1) for line in node._properties().read_text().splitlines())


def test_three_nodes_share_one_static_quorum_and_replicate_three_times(tmp_path):
    cluster = LocalKafkaCluster(tmp_path, [(9001, 9002), (9003, 9004), (9005, 9006)])
    assert cluster.bootstrap == "127.0.0.1:9001,127.0.0.1:9003,127.0.0.1:9005"
    props = [_properties(node) for node in cluster.nodes]
    assert [p["node.id"] for p in props] == ["1", "2", "3"]
    assert {p["controller.quorum.voters"] for p in props} == {"1@127.0.0.1:9002,2@127.0.0.1:9004,3@127.0.0.1:9006"}
    assert props[1]["listeners"] == "PLAINTEXT://127.0.0.1:9003,CONTROLLER://127.0.0.1:9004"
    for p in props:
        assert p["offsets.topic.replication.factor"] == p["default.replication.factor"] == "3"
        assert p["transaction.state.log.replication.factor"] == "3"
        assert p["share.coordinator.state.topic.replication.factor"] == "3"
        assert p["min.insync.replicas"] == p["transaction.state.log.min.isr"] == "2"
        assert p["share.coordinator.state.topic.min.isr"] == "2"
    assert cluster.replication_factor == 3


def test_a_cluster_never_asks_more_replicas_than_it_has_brokers():
    assert replication_settings(1)["offsets.topic.replication.factor"] == "1"
    assert replication_settings(1)["min.insync.replicas"] == "1"
    assert replication_settings(2)["default.replication.factor"] == "2"
    assert replication_settings(5)["default.replication.factor"] == "3"


def test_the_single_broker_keeps_its_settings(tmp_path):
    props = _properties(stack.LocalKafka(tmp_path, port=9001, controller_port=9002))
    assert props["node.id"] == "1" and props["controller.quorum.voters"] == "1@127.0.0.1:9002"
    assert props["offsets.topic.replication.factor"] == "1" and "min.insync.replicas" not in props


def test_a_cluster_directory_formatted_for_another_quorum_is_refused(tmp_path):
    LocalKafkaCluster(tmp_path, [(9001, 9002), (9003, 9004), (9005, 9006)])._cluster_id()
    with pytest.raises(RuntimeError, match="formatted for the quorum"):
        LocalKafkaCluster(tmp_path, [(9101, 9102), (9103, 9104), (9105, 9106)])._cluster_id()


def _admin_seeing(brokers: int):
    metadata = SimpleNamespace(brokers={i: None for i in range(1, brokers + 1)}, topics={})
    return SimpleNamespace(list_topics=lambda timeout: metadata)


def test_topics_are_replicated_as_far_as_the_cluster_allows(monkeypatch):
    monkeypatch.delenv("TOKENMILL_KAFKA_REPLICATION", raising=False)
    assert kafka_clients.replication_for(_admin_seeing(1)) == (1, {"min.insync.replicas": "1"})
    assert kafka_clients.replication_for(_admin_seeing(2)) == (2, {"min.insync.replicas": "1"})
    assert kafka_clients.replication_for(_admin_seeing(3)) == (3, {"min.insync.replicas": "2"})
    assert kafka_clients.replication_for(_admin_seeing(7)) == (3, {"min.insync.replicas": "2"})
    monkeypatch.setenv("TOKENMILL_KAFKA_REPLICATION", "2")
    assert kafka_clients.replication_for(_admin_seeing(7)) == (2, {"min.insync.replicas": "1"})
    monkeypatch.setenv("TOKENMILL_KAFKA_REPLICATION", "0")
    with pytest.raises(ValueError):
        kafka_clients.replication_for(_admin_seeing(3))


def test_make_up_starts_a_cluster_when_asked(tmp_path, monkeypatch):
    monkeypatch.setenv("TOKENMILL_LOCAL_DIR", str(tmp_path))
    monkeypatch.delenv("TOKENMILL_KAFKA_BROKERS", raising=False)
    single = stack.local_kafka()
    assert stack.broker_count() == 1 and isinstance(single, stack.LocalKafka)
    assert single.data_dir == tmp_path / "kafka-data" and single.port == 19092
    monkeypatch.setenv("TOKENMILL_KAFKA_BROKERS", "3")
    cluster = stack.local_kafka()
    assert isinstance(cluster, LocalKafkaCluster)
    # the first node where the single broker would be: the default bootstrap address reaches either
    assert cluster.bootstrap == "127.0.0.1:19092,127.0.0.1:19094,127.0.0.1:19096"
    assert cluster.nodes[0].controller_port == 19093
    assert cluster.bootstrap in stack.local_bootstraps()
    assert [b["address"] for b in stack.status()["kafka_brokers"]] == cluster.bootstrap.split(",")
    assert all(b["pid"] is None for b in stack.status()["kafka_brokers"]) and stack.status()["kafka"] is None
    monkeypatch.setenv("TOKENMILL_KAFKA_BROKERS", "0")
    with pytest.raises(ValueError):
        stack.broker_count()


def test_status_and_down_find_a_cluster_whatever_the_environment_says(tmp_path, monkeypatch):
    monkeypatch.setenv("TOKENMILL_LOCAL_DIR", str(tmp_path))
    monkeypatch.delenv("TOKENMILL_KAFKA_BROKERS", raising=False)
    for i in (1, 2, 3):
        (tmp_path / "kafka-cluster" / f"node-{i}").mkdir(parents=True)
    cluster = stack.started_cluster()
    assert cluster is not None and len(cluster.nodes) == 3
    assert cluster.bootstrap in stack.local_bootstraps()  # demo.env's address still means the local cluster
