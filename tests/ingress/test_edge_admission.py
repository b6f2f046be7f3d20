"""The edge's admission decisions, without Kafka: what is refused, with which code and Retry-After."""
import pytest

from ingress.tenancy.admission import EdgeAdmission
from http_api.openai_errors import APIError
from ingress.tenancy.directory import Caller

UNLIMITED = {"requests_per_minute": 0, "tokens_per_minute": 0, "max_concurrent": 0, "monthly_token_budget": 0}


def caller(**limits):
    return Caller(tenant={"tenant_id": "acme", **UNLIMITED, **limits}, key_id="k")


def test_requests_per_minute_is_charged_at_admission_and_refused_past_the_limit():
    edge, who = EdgeAdmission(), caller(requests_per_minute=2)
    for i in range(2):
        edge.release(edge.admit(who, f"r{i}", 0))
    with pytest.raises(APIError) as refused:
        edge.precheck(who)
    assert refused.value.status == 429 and refused.value.code == "rate_limit_requests"
    assert int(refused.value.headers["Retry-After"]) >= 1
    with pytest.raises(APIError) as again:
        edge.admit(who, "r3", 0)
    assert again.value.code == "rate_limit_requests"


def test_a_concurrency_slot_is_held_until_released():
    edge, who = EdgeAdmission(), caller(max_concurrent=1)
    held = edge.admit(who, "a", 0)
    with pytest.raises(APIError) as refused:
        edge.admit(who, "b", 0)
    assert refused.value.code == "concurrency_limit"
    edge.release(held)
    edge.release(held)  # a second release gives nothing back twice
    assert edge.in_flight("acme") == (0, 0)
    edge.release(edge.admit(who, "b", 0))


def test_a_request_larger_than_the_token_limit_says_so_when_it_grows_to_its_size():
    edge, who = EdgeAdmission(), caller(tokens_per_minute=100)
    reservation = edge.admit(who, "big", 0)  # counted before tokenizing
    with pytest.raises(APIError) as refused:
        edge.grow(reservation, 500)
    assert refused.value.code == "rate_limit_tokens" and "larger than the per-minute token limit" in str(
        refused.value.message)
    edge.release(reservation)
    fits = edge.admit(who, "small", 0)
    edge.grow(fits, 60)
    assert edge.in_flight("acme") == (60, 1)
    edge.settle(fits, prompt=10, completion=5, cached=0)
    assert edge.in_flight("acme") == (0, 0)
