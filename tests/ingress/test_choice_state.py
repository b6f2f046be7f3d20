"""ChoiceState.accept: each token reaches the client exactly once, whatever is replayed."""
from ingress.serving.request_view import ChoiceState


def item(first, tokens, text, finish=None, usage=None):
    return {"first_token_index": first, "token_ids": tokens, "text": text, "finish_reason": finish, "usage": usage}


def test_tokens_in_order_are_passed_on_and_counted():
    c = ChoiceState()
    assert c.accept(item(0, [5], "He")) == "He"
    assert c.accept(item(1, [6, 7], "llo")) == "llo"
    assert c.token_ids == [5, 6, 7] and c.next_index == 3 and "".join(c.text) == "Hello"


def test_a_replay_of_what_the_client_has_adds_nothing():
    # a worker died mid-stream; its successor regenerates from the seed and sends index 0 onwards again
    c = ChoiceState()
    c.accept(item(0, [5], "He"))
    c.accept(item(1, [6], "l"))
    assert c.accept(item(0, [5], "He")) is None
    assert c.accept(item(1, [6], "l")) is None
    assert c.accept(item(2, [7], "lo")) == "lo"
    assert c.token_ids == [5, 6, 7] and "".join(c.text) == "Hello"


def test_a_replayed_empty_item_below_the_position_is_dropped_but_one_at_it_passes():
    c = ChoiceState()
    c.accept(item(0, [5], "H"))
    assert c.accept(item(0, [], "")) is None
    assert c.accept(item(1, [], "", finish="stop", usage={"completion_tokens": 1})) == ""
    assert c.finish_reason == "stop" and c.completion_tokens == 1


def test_the_end_is_final_and_completion_tokens_fall_back_to_the_position():
    c = ChoiceState()
    c.accept(item(0, [5, 6], "Hi"))
    assert c.accept(item(2, [7], "!", finish="length")) == "!"
    assert c.finish_reason == "length" and c.completion_tokens == 3
    assert c.accept(item(3, [8], "?")) is None and c.token_ids == [5, 6, 7]
