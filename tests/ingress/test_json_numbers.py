"""JSON's one number type: an integral number is an integer however it is spelled; a fraction is not."""
from __future__ import annotations

import pytest
from pydantic import ValidationError

from ingress.http import json_numbers
from ingress.admin.routes import TenantSettings
from ingress.protocol import ChatCompletionRequest, CompletionRequest
from ingress.tenancy.tenant_admin import TENANT_FIELDS


def test_integral_numbers_fill_integer_fields_and_floats_stay_floats():
    body = ChatCompletionRequest.model_validate(json_numbers.loads(
        '{"model": "m", "messages": [{"role": "user", "content": "hi"}], "top_k": 5.0, "n": 2e0, '
        '"max_tokens": 1.6e1, "temperature": 1.0, "top_p": 0.5}'))
    assert (body.top_k, body.n, body.max_tokens) == (5, 2, 16)
    assert type(body.top_k) is int and type(body.temperature) is float and body.top_p == 0.5


def test_token_ids_may_be_written_as_integral_floats():
    assert CompletionRequest.model_validate(json_numbers.loads('{"model": "m", "prompt": [1.0, 20]}')).prompt == [1, 20]


def test_integrality_is_decided_on_the_written_number_not_its_double():
    assert json_numbers.loads("[9007199254740993.0, 1.0000000000000001, 1e400000000]") == [
        9007199254740993, 1.0, float("inf")]
    assert json_numbers.loads("1e300") == int(1e300)


@pytest.mark.parametrize("value", ["5.5", "1e-3", "1e400", "1.0000000000000001"])
def test_a_fraction_or_an_infinity_is_still_no_integer(value):
    with pytest.raises(ValidationError):
        ChatCompletionRequest.model_validate(json_numbers.loads(
            f'{{"model": "m", "messages": [{{"role": "user", "content": "hi"}}], "top_k": {value}}}'))


def test_the_admin_body_covers_exactly_the_tenant_settings():
    assert set(TenantSettings.model_fields) == set(TENANT_FIELDS)
    assert TenantSettings.model_validate(json_numbers.loads('{"max_concurrent": 3.0}')).max_concurrent == 3
    with pytest.raises(ValidationError):
        TenantSettings.model_validate({"max_concurrent": 3, "api_keys": []})  # keys have their own routes
