"""The broker's class archive (tokenmill/stack/kafka_class_archive.py): named for its classpath and JVM, used only
once it exists, and one a real broker maps (with -Xshare:on the JVM refuses to start on an archive it
cannot use, instead of quietly loading its classes again)."""
import pytest

from tokenmill.stack import kafka_class_archive
from tokenmill.stack.fetch_jars import ensure_class_archive
from tokenmill.stack.kafka_broker import LocalKafka
from tokenmill.stack.processes import free_port

pytestmark = pytest.mark.kafka


def test_each_classpath_has_its_own_archive_and_a_missing_one_adds_no_option():
    made = kafka_class_archive.archive_path(kafka_class_archive.classpath())
    other = kafka_class_archive.archive_path(kafka_class_archive.classpath() + ":/an/extra.jar")
    assert made != other and made.parent == other.parent
    assert not other.exists()
    assert kafka_class_archive.jvm_options(kafka_class_archive.classpath() + ":/an/extra.jar") == ()


def test_a_broker_starts_on_the_archive_it_maps(tmp_path):
    archive = ensure_class_archive()
    assert kafka_class_archive.jvm_options(kafka_class_archive.classpath()) == (f"-XX:SharedArchiveFile={archive}",)
    broker = LocalKafka(tmp_path / "kafka", port=free_port(), controller_port=free_port(), jvm_options=("-Xshare:on",))
    try:
        assert broker.start(timeout=60) == broker.bootstrap
    finally:
        broker.stop()
