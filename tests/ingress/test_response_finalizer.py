"""The final record of a background response, as the finalizer settles it from the reply events read back
and the request's RequestCompleted (ingress/api/responses/finalizer.py)."""
from __future__ import annotations

import time
from collections import OrderedDict
from types import SimpleNamespace

from ingress.api.responses.finalizer import ResponseFinalizer, settled_record
from ingress.api.responses.store import ResponseStore
from tests.ingress.test_response_turn import _background_record


def _item(text, tokens, finish=None, first=0):
    return ("item", {"choice_index": 0, "first_token_index": first, "token_ids": tokens, "text": text,
                     "finish_reason": finish, "logprobs": None,
                     "usage": {"completion_tokens": 3, "cached_tokens": 0} if finish else None})


def _completed(status, completion=3):
    return {"status": status, "prompt_tokens": 4, "completion_tokens": completion, "cached_tokens": 0}


def test_a_finished_request_settles_completed_or_incomplete_from_its_events():
    events = [_item("ab", [7, 8]), _item("c", [9], "stop", first=2)]
    final = settled_record(_background_record(), _completed("finished"), events)
    assert (final["status"], final["output_text"], final["output_tokens"]) == ("completed", "abc", 3)
    cut = settled_record(_background_record(), _completed("finished"), [_item("ab", [7, 8]), _item("c", [9], "length", first=2)])
    assert (cut["status"], cut["incomplete_reason"]) == ("incomplete", "max_output_tokens")


def test_a_finished_request_whose_last_events_are_unread_is_completed_from_its_usage():
    final = settled_record(_background_record(), _completed("finished", 5), [_item("ab", [7, 8])])
    assert (final["status"], final["output_text"], final["output_tokens"]) == ("completed", "ab", 5)


def test_a_cancelled_request_keeps_the_text_generated_up_to_then():
    final = settled_record(_background_record(), _completed("cancelled", 2), [_item("ab", [7, 8])])
    assert (final["status"], final["output_text"], final["output_tokens"]) == ("cancelled", "ab", 2)


def test_a_failed_request_carries_the_workers_error_and_a_shed_one_its_deadline():
    error = ("error", {"request_id": "req-1", "status_code": 500, "error_type": "server_error",
                       "code": "grammar_error", "message": "Structured output failed.", "retry_after_s": None})
    failed = settled_record(_background_record(), _completed("failed", 0), [error])
    assert failed["status"] == "failed" and failed["error_message"].startswith("grammar_error")
    shed = settled_record(_background_record(), _completed("shed", 0), [])
    assert shed["status"] == "failed" and shed["error_message"].startswith("deadline_exceeded")


def test_the_record_it_was_given_is_left_as_it_was():
    record = _background_record()
    settled_record(record, _completed("finished"), [_item("abc", [7, 8, 9], "stop")])
    assert record["status"] == "queued" and record["output_text"] == ""


def test_a_completion_that_comes_before_its_responses_record_is_finalized_when_the_record_arrives():
    finalizer = ResponseFinalizer.__new__(ResponseFinalizer)  # its matching alone: no Kafka clients
    store = ResponseStore()
    finalizer.follower, finalizer._recent = SimpleNamespace(store=store), OrderedDict()
    finalized = []
    finalizer._finalize_with_retries = lambda found, completed: finalized.append((found, completed["status"]))
    record = _background_record() | {"tenant_id": "t", "created_at": int(time.time()), "deleted": False}
    finalizer._remember({"request_id": record["request_id"], "status": "finished"})
    finalizer._recheck_recent()
    assert finalized == []  # no record yet: kept
    store.apply(record)  # the record reaches this view after the completion
    finalizer._recheck_recent()
    assert finalized == [(("t", "resp_1"), "finished")] and not finalizer._recent
