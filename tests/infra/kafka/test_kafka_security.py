"""Kafka TLS/SASL settings from the environment reach every client: librdkafka and Faust alike."""
from __future__ import annotations

import faust
import pytest

from infra.kafka import clients as kafka_clients
from infra.kafka import security as kafka_security

SASL_SSL = {"KAFKA_SECURITY_PROTOCOL": "SASL_SSL", "KAFKA_SASL_MECHANISM": "scram-sha-512",
            "KAFKA_SASL_USERNAME": "tokenmill-worker", "KAFKA_SASL_PASSWORD": "pw"}


@pytest.fixture
def env(monkeypatch):
    for name in ("KAFKA_SECURITY_PROTOCOL", "KAFKA_SASL_MECHANISM", "KAFKA_SASL_USERNAME", "KAFKA_SASL_PASSWORD",
                 "KAFKA_SSL_CA_LOCATION", "KAFKA_SSL_CERTIFICATE_LOCATION", "KAFKA_SSL_KEY_LOCATION"):
        monkeypatch.delenv(name, raising=False)

    def set_env(values: dict[str, str]) -> None:
        for name, value in values.items():
            monkeypatch.setenv(name, value)
    return set_env


def test_plaintext_by_default_adds_nothing(env):
    assert kafka_security.librdkafka_settings() == {}
    assert kafka_security.faust_credentials() is None
    assert "security.protocol" not in kafka_clients.producer_config("p")


def test_sasl_ssl_reaches_producers_consumers_admin_clients_and_faust(env):
    env(SASL_SSL)
    want = {"security.protocol": "sasl_ssl", "sasl.mechanism": "SCRAM-SHA-512", "sasl.username": "tokenmill-worker",
            "sasl.password": "pw"}
    for cfg in (kafka_clients.producer_config("p"), kafka_clients.consumer_config("g", "c"),
                kafka_clients.admin_config()):
        assert want.items() <= cfg.items()
    creds = kafka_security.faust_credentials()
    assert isinstance(creds, faust.SASLCredentials) and creds.username == "tokenmill-worker"


@pytest.mark.parametrize("values", [
    {"KAFKA_SECURITY_PROTOCOL": "telnet"},
    {"KAFKA_SECURITY_PROTOCOL": "sasl_plaintext", "KAFKA_SASL_MECHANISM": "PLAIN"},  # no credentials
    {"KAFKA_SECURITY_PROTOCOL": "sasl_ssl", "KAFKA_SASL_USERNAME": "u", "KAFKA_SASL_PASSWORD": "p"},  # no mechanism
])
def test_incomplete_or_unknown_settings_are_refused_not_ignored(env, values):
    env(values)
    with pytest.raises(kafka_security.KafkaSecurityError):
        kafka_clients.producer_config("p")
