"""Lose a broker of a 3-broker cluster (replication factor 3, min ISR 2) for good, mid-stream: SIGKILL
the one that leads most of the partitions the streams in flight use (`requests`, `work`, `replies`).

Every stream finishes with exactly the text an undisturbed run of the same seeded prompts gives,
every request is billed once with the tokens it streamed, and a new request is served within
SERVE_AGAIN_BOUND_S of the kill. When the node comes back, every partition is fully replicated
again (its replicas all in sync) within ISR_RECOVERY_BOUND_S."""
import time

import pytest
from confluent_kafka.admin import AdminClient, ConfigResource

from infra.kafka import clients as kafka_clients
from infra.kafka import topic_reader
from schemas import codec, topics
from tests.integration import faults
from tests.integration.conftest import REPLY_PARTITION

pytestmark = [pytest.mark.kafka, pytest.mark.slow, pytest.mark.faults]

STREAMS = 6
STREAM_TOKENS = 400
# The controller fences a killed broker after 3 s (tokenmill/stack/kafka_cluster.py); its partitions then get
# new leaders, and every client must find them.
SERVE_AGAIN_BOUND_S = 10.0
ISR_RECOVERY_BOUND_S = 60.0


def _admin() -> AdminClient:
    return AdminClient(kafka_clients.admin_config())


def _partitions_holding(topic: str, request_ids: set[str]) -> set[tuple[str, int]]:
    """The partitions of `topic` that hold a record of one of these requests."""
    found = set()
    for msg in topic_reader.read_to_end(topic_reader.whole_topic(topic), "broker-loss-probe", timeout=30):
        try:
            event = codec.decode(msg.value(), msg.headers())
        except codec.UndecodableEvent:
            continue
        if event.record.get("request_id") in request_ids:
            found.add((topic, msg.partition()))
    return found


def _leaders(partitions: set[tuple[str, int]]) -> dict[tuple[str, int], int]:
    meta = _admin().list_topics(timeout=10)
    return {(t, p): meta.topics[t].partitions[p].leader for t, p in partitions}


def _active_controller(cluster) -> int | None:
    """The node that last became the quorum's leader, from the nodes' logs (for the report only: the
    clients' protocol names a random broker as "controller" in KRaft)."""
    became = []
    for node in cluster.nodes:
        for line in node.log_file.read_text(errors="replace").splitlines():
            if f"[RaftManager id={node.node_id}] Completed transition to Leader" in line:
                became.append((line[:23], node.node_id))
    return max(became)[1] if became else None


def _under_replicated() -> list[str]:
    """Partitions (of every topic on the cluster) with a replica out of the in-sync set."""
    meta = _admin().list_topics(timeout=10)
    return sorted(f"{t}[{p}] isr={pm.isrs} replicas={pm.replicas}" for t, tm in meta.topics.items()
                  for p, pm in tm.partitions.items() if len(pm.isrs) < len(pm.replicas))


def _await_fully_replicated(bound_s: float) -> float:
    """Seconds until no partition is under-replicated; fails after bound_s with the ones that are."""
    start = time.monotonic()
    lagging = _under_replicated()
    while lagging:
        assert time.monotonic() - start < bound_s, f"still under-replicated after {bound_s} s: {lagging}"
        time.sleep(0.2)  # the cluster's own state, asked again; nothing to subscribe to
        lagging = _under_replicated()
    return time.monotonic() - start


def test_every_topic_is_replicated_three_times_with_min_isr_two(kafka_cluster):
    meta = _admin().list_topics(timeout=10)
    assert len(meta.brokers) == 3
    for spec in topics.ALL_TOPICS:
        for p, pm in meta.topics[spec.name].partitions.items():
            assert len(pm.replicas) == 3 and len(pm.isrs) == 3, (spec.name, p, pm.replicas, pm.isrs)
    admin = _admin()  # held while its answer is awaited: a client destroyed first fails the call
    res = ConfigResource(ConfigResource.Type.TOPIC, topics.REPLIES.name)
    assert admin.describe_configs([res])[res].result()["min.insync.replicas"].value == "2"


def test_losing_the_leading_broker_mid_stream(kafka_cluster, cluster_stack):
    stack = cluster_stack
    undisturbed = faults.Load(stack, "broker loss", streams=STREAMS, tokens=STREAM_TOKENS).start().finish()

    load = faults.Load(stack, "broker loss", streams=STREAMS, tokens=STREAM_TOKENS).start()
    ids = {rid for rid in load.request_ids if rid}
    in_use = ({(topics.REPLIES.name, REPLY_PARTITION)} | _partitions_holding(topics.REQUESTS.name, ids)
              | _partitions_holding(topics.WORK.name, ids))
    leaders = _leaders(in_use)
    # the broker leading most of them; on a tie the one leading the reply partition
    reply_leader = leaders[(topics.REPLIES.name, REPLY_PARTITION)]
    victim = max(set(leaders.values()), key=lambda b: (list(leaders.values()).count(b), b == reply_leader))
    led = sorted(f"{t}[{p}]" for (t, p), b in leaders.items() if b == victim)
    controller = _active_controller(kafka_cluster)
    in_flight = load.in_flight()

    kafka_cluster.kill(victim)
    killed = time.monotonic()
    served_after, probes = faults.time_to_serve(stack, killed)
    print(f"broker {victim} killed (leader of {', '.join(led)}; {len(in_use)} partitions in use"
          f"{'; the active controller too' if controller == victim else ''}), "
          f"{in_flight} of {STREAMS} streams in flight: a new request served {served_after} s after the kill")
    assert in_flight > 0, "every stream ended before the kill"
    assert served_after is not None, (f"{probes[:3]}\nleaderless: {faults.leaderless()}\n"
                                      f"{faults.broker_warnings(*kafka_cluster.nodes)}\n"
                                      f"{faults.stacks_and_logs(stack)}\n{faults.probe_trails(stack, probes)}")
    finished = load.finish()
    assert [r["text"] for r in finished] == [r["text"] for r in undisturbed]
    faults.assert_billed_once(stack, undisturbed + finished)
    assert served_after <= SERVE_AGAIN_BOUND_S, probes

    leaders_after = _leaders(in_use)
    assert victim not in leaders_after.values() and -1 not in leaders_after.values(), leaders_after

    restarted = time.monotonic()
    kafka_cluster.restart(victim)
    back = time.monotonic()
    in_sync_after = _await_fully_replicated(ISR_RECOVERY_BOUND_S)
    print(f"broker {victim} restarted in {back - restarted:.1f} s; every partition fully replicated "
          f"{in_sync_after:.1f} s after it was back")
    served_after_return, probes = faults.time_to_serve(stack, time.monotonic())
    assert served_after_return is not None, probes
