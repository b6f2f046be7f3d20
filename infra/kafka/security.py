"""How every Kafka client of tokenmill authenticates and encrypts, from the environment.

A local stack talks plaintext to its own broker. On a shared cluster set, for every process:

=================================  ===========================================================
``KAFKA_SECURITY_PROTOCOL``        ``plaintext`` (default), ``ssl``, ``sasl_plaintext``, ``sasl_ssl``
``KAFKA_SASL_MECHANISM``           ``PLAIN``, ``SCRAM-SHA-256`` or ``SCRAM-SHA-512`` (with ``sasl_*``)
``KAFKA_SASL_USERNAME`` / ``..._PASSWORD``  the principal's credentials
``KAFKA_SSL_CA_LOCATION``          CA bundle to verify the brokers (with ``ssl`` / ``sasl_ssl``)
``KAFKA_SSL_CERTIFICATE_LOCATION`` client certificate and key, for mutual TLS
``KAFKA_SSL_KEY_LOCATION``
=================================  ===========================================================

The same settings go to librdkafka (every producer, consumer and admin client) and to
aiokafka under Faust (streams' group membership), so no client is left on plaintext.
"""
from __future__ import annotations

from typing import Any

from infra.env_setting import REGISTRY

PROTOCOLS = ("plaintext", "ssl", "sasl_plaintext", "sasl_ssl")
MECHANISMS = ("PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512")


class KafkaSecurityError(ValueError):
    """The Kafka security settings in the environment are incomplete or unknown."""


def _env(name: str) -> str | None:
    return REGISTRY[name].get() or None


def protocol() -> str:
    value = (_env("KAFKA_SECURITY_PROTOCOL") or "plaintext").lower()
    if value not in PROTOCOLS:
        raise KafkaSecurityError(f"KAFKA_SECURITY_PROTOCOL must be one of {PROTOCOLS}, not {value!r}")
    return value


def librdkafka_settings() -> dict[str, Any]:
    """Settings to merge into every librdkafka client configuration (empty for plaintext)."""
    proto = protocol()
    if proto == "plaintext":
        return {}
    out: dict[str, Any] = {"security.protocol": proto}
    if proto.startswith("sasl_"):
        mechanism = (_env("KAFKA_SASL_MECHANISM") or "").upper()
        if mechanism not in MECHANISMS:
            raise KafkaSecurityError(f"KAFKA_SASL_MECHANISM must be one of {MECHANISMS} with {proto}")
        user, password = _env("KAFKA_SASL_USERNAME"), _env("KAFKA_SASL_PASSWORD")
        if not user or not password:
            raise KafkaSecurityError(f"{proto} needs KAFKA_SASL_USERNAME and KAFKA_SASL_PASSWORD")
        out.update({"sasl.mechanism": mechanism, "sasl.username": user, "sasl.password": password})
    if proto.endswith("ssl"):
        for env, key in (("KAFKA_SSL_CA_LOCATION", "ssl.ca.location"),
                         ("KAFKA_SSL_CERTIFICATE_LOCATION", "ssl.certificate.location"),
                         ("KAFKA_SSL_KEY_LOCATION", "ssl.key.location")):
            if _env(env):
                out[key] = _env(env)
    return out


def faust_credentials():
    """The same settings as Faust broker credentials (None for plaintext)."""
    proto = protocol()
    if proto == "plaintext":
        return None
    import faust

    settings = librdkafka_settings()
    context = None
    if proto.endswith("ssl"):
        import ssl

        context = ssl.create_default_context(cafile=settings.get("ssl.ca.location"))
        if settings.get("ssl.certificate.location"):
            context.load_cert_chain(settings["ssl.certificate.location"], settings.get("ssl.key.location"))
    if proto == "ssl":
        return faust.SSLCredentials(context)
    return faust.SASLCredentials(username=settings["sasl.username"], password=settings["sasl.password"],
                                 mechanism=settings["sasl.mechanism"], ssl_context=context)
