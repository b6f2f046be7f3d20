"""`python -m tokenmill.stack.fetch_jars`: make sure Kafka's broker jars are in the local cache, and the class
archive every broker start maps (tokenmill/stack/kafka_class_archive.py) is made for them."""
from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from tokenmill.stack.kafka_broker import LocalKafka, ensure_jars
from tokenmill.stack.kafka_class_archive import archive_path, classpath
from tokenmill.stack.processes import free_port


def ensure_class_archive() -> Path:
    """Make the archive for the current jars unless it exists: start a broker of its own with the JVM
    dumping the classes it loaded at exit, wait until it serves, stop it (~5 s). Written under a
    temporary name and renamed, so a concurrent broker start never maps half a file."""
    ensure_jars()
    final = archive_path(classpath())
    if final.exists():
        return final
    work = Path(tempfile.mkdtemp(prefix="tokenmill-kafka-cds-"))
    partial = final.with_name(f".{final.name}.{os.getpid()}")
    try:
        broker = LocalKafka(work / "kafka", port=free_port(), controller_port=free_port(),
                            jvm_options=(f"-XX:ArchiveClassesAtExit={partial}",), class_archive=False)
        try:
            broker.start()
        finally:
            broker.stop()
        if partial.exists():
            partial.replace(final)
    finally:
        partial.unlink(missing_ok=True)
        shutil.rmtree(work, ignore_errors=True)
    return final


if __name__ == "__main__":
    print(f"Kafka jars in {ensure_jars()}, class archive {ensure_class_archive().name}")
