"""The Responses API's typed stream events (`response.created`, `response.output_text.delta`, ...), numbered
in order (`sequence_number`), so a resumed stream (`starting_after`) sends exactly the events after one."""
from __future__ import annotations

import json
from typing import Any

from http_api.openai_errors import APIError
from ingress.api.responses.turn import Turn, message_item


class ResponseFrames:
    """The Responses API's typed stream events, numbered in order (`sequence_number`)."""

    def __init__(self, turn: Turn, starting_after: int = -1):
        self.turn = turn
        self.starting_after = starting_after  # a resumed stream sends only the events after this one

    def _event(self, kind: str, **fields) -> str:
        data = {"type": kind, "sequence_number": self.turn.sequence, **fields}
        self.turn.sequence += 1
        if data["sequence_number"] <= self.starting_after:
            return ""
        return f"event: {kind}\ndata: {json.dumps(data)}\n\n"

    def opening(self) -> list[str]:
        turn = self.turn
        in_progress = turn.view_of("in_progress", output=[])
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        created = turn.view_of("queued", output=[]) if turn.record["background"] else in_progress
        started = [self._event("response.created", response=created),
                   self._event("response.in_progress", response=in_progress)]
        if turn.calls_tools:
            return started  # whether the answer is text or calls is known at its end: items come then
        return started + [
            self._event("response.output_item.added", output_index=0,
                        item=message_item(turn.item_id, "", "in_progress")),
            self._event("response.content_part.added", item_id=turn.item_id, output_index=0, content_index=0,
                        part=part),
        ]

    def delta(self, index: int, text: str, finish_reason: str | None) -> list[str]:
        if not text or self.turn.calls_tools:
            return []
        return [self._event("response.output_text.delta", item_id=self.turn.item_id, output_index=0,
                            content_index=0, delta=text, logprobs=[])]

    async def finished(self) -> list[str]:
        turn = self.turn
        obj = turn.settle()
        if not turn.record["background"]:  # a background one's final record is the finalizer's (finalizer.py)
            await turn.save()
        text = turn.record["output_text"]
        item = obj["output"][0]
        ending = "response.completed" if obj["status"] == "completed" else "response.incomplete"
        if turn.calls_tools:
            return [*self._items(obj["output"]), self._event(ending, response=obj)]
        return [
            self._event("response.output_text.done", item_id=turn.item_id, output_index=0, content_index=0,
                        text=text, logprobs=[]),
            self._event("response.content_part.done", item_id=turn.item_id, output_index=0, content_index=0,
                        part=item["content"][0]),
            self._event("response.output_item.done", output_index=0, item=item),
            self._event(ending, response=obj),
        ]

    def _items(self, output: list[dict[str, Any]]) -> list[str]:
        """Whole output items, each announced, filled in one piece and closed."""
        frames = []
        for index, item in enumerate(output):
            if item["type"] == "function_call":
                frames += [
                    self._event("response.output_item.added", output_index=index, item={**item, "arguments": "",
                                                                                          "status": "in_progress"}),
                    self._event("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                                delta=item["arguments"]),
                    self._event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                                name=item["name"], arguments=item["arguments"]),
                ]
            else:
                part = item["content"][0]
                frames += [
                    self._event("response.output_item.added", output_index=index,
                                item={**item, "status": "in_progress", "content": []}),
                    self._event("response.content_part.added", item_id=item["id"], output_index=index,
                                content_index=0, part={**part, "text": ""}),
                    self._event("response.output_text.delta", item_id=item["id"], output_index=index,
                                content_index=0, delta=part["text"], logprobs=[]),
                    self._event("response.output_text.done", item_id=item["id"], output_index=index,
                                content_index=0, text=part["text"], logprobs=[]),
                    self._event("response.content_part.done", item_id=item["id"], output_index=index,
                                content_index=0, part=part),
                ]
            frames.append(self._event("response.output_item.done", output_index=index, item=item))
        return frames

    def error(self, err: APIError) -> list[str]:
        return [self._event("response.failed", response=self.turn.fail(err))]

    def closing(self) -> list[str]:
        return []
