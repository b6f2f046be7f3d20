"""What a request refused before tokenizing never spends: a schema over the cost limits costs no tokenizer
thread (an attacker's refused schemas shared the two cores with a victim's requests, `bench isolation`)."""
from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from structured_outputs.grammars import GrammarError
from http_api.openai_errors import APIError
from ingress.serving.submitter import Submitter


class RefusingGrammars:
    def refuse_costly(self, spec):
        raise GrammarError("too costly", "response_format.json_schema.schema")

    def compile(self, spec, tenant=None):
        raise AssertionError("compiled a refused schema")


class Kind:
    param = "messages"

    def texts(self, body):
        return ["a prompt"]

    def token_ids(self, model, body):
        raise AssertionError("tokenized a request refused for its schema")


def test_a_costly_schema_is_a_400_before_its_prompt_is_tokenized():
    submitter = Submitter({}, services=None, reply_to=None, default_max_tokens=16)
    model = SimpleNamespace(surely_too_long=lambda texts: False, grammars=RefusingGrammars())
    caller = SimpleNamespace(tenant_id="attacker")
    with pytest.raises(APIError) as refused:
        asyncio.run(submitter._tokenize(caller, model, SimpleNamespace(), Kind(), {"type": "json_schema"}))
    assert refused.value.status == 400 and refused.value.code == "invalid_response_format"
    assert refused.value.param == "response_format.json_schema.schema"
