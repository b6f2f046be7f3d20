"""Billing fixtures: one chDB directory per pytest process (chDB allows one per process) and a
fresh database in it for every test, so tests never see each other's rows."""
from __future__ import annotations

import shutil
import tempfile
import uuid

import pytest
from confluent_kafka import Producer

from billing_pipeline import migrations
from billing_pipeline.store import Store
from infra.kafka import clients as kafka_clients


@pytest.fixture(scope="session")
def chdb_dir():
    path = tempfile.mkdtemp(prefix="tokenmill-chdb-")
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture()
def store(chdb_dir):
    s = Store(f"chdb://{chdb_dir}", f"t_{uuid.uuid4().hex[:12]}")
    migrations.migrate(s)
    yield s
    s.command("DROP DATABASE IF EXISTS {db}")
    s.close()


@pytest.fixture()
def producer(kafka_bootstrap):
    p = Producer(kafka_clients.producer_config("billing-test"))
    yield p
    p.flush(10)


