"""One streamed (SSE) completion over httpx, and what the client saw of it (Outcome): its TTFT, inter-token
gaps, end-to-end latency and token counts, as vLLM's `benchmark_serving` defines them."""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

# answers that are the platform doing its job under overload (rate limits, queue full, deadline shedding)
SHED_STATUSES = {429: "rejected", 503: "shed"}


@dataclass
class Outcome:
    phase: str
    ok: bool = False
    status: int | None = None
    code: str | None = None
    error: str | None = None
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft_s: float | None = None
    e2el_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    sent_at_s: float = 0.0
    request_id: str | None = None  # the platform's x-request-id: joins the outcome to its events
    sent_wall_ms: float | None = None  # wall clock, for the hop breakdown against Kafka's timestamps
    first_wall_ms: float | None = None

    @property
    def tpot_s(self) -> float | None:
        if not self.ok or self.output_tokens < 2 or self.ttft_s is None or self.e2el_s is None:
            return None
        return (self.e2el_s - self.ttft_s) / (self.output_tokens - 1)

    @property
    def category(self) -> str:
        if self.ok:
            return "ok"
        return "failed" if self.status is None else SHED_STATUSES.get(self.status, "failed")

    @property
    def error_key(self) -> str:
        if self.status is None:
            return self.code or "connection_error"
        return f"{self.status} {self.code or ''}".strip()


def carries_tokens(chunk: dict) -> bool:
    for choice in chunk.get("choices") or ():
        delta = choice.get("delta") or {}
        if choice.get("text") or delta.get("content") or delta.get("tool_calls") or delta.get("reasoning_content"):
            return True
    return False


async def send_one(client, url: str, headers: dict, body: dict, chat: bool, phase: str, t0: float) -> Outcome:
    import httpx

    out = Outcome(phase=phase)
    chunks = 0
    st = time.perf_counter()
    out.sent_at_s = st - t0
    out.sent_wall_ms = time.time() * 1000
    last = None
    try:
        async with client.stream("POST", url, json=body, headers=headers) as resp:
            out.status = resp.status_code
            out.request_id = resp.headers.get("x-request-id")
            if resp.status_code != 200:
                raw = await resp.aread()
                try:
                    err = json.loads(raw)["error"]
                    out.code, out.error = err.get("code") or err.get("type"), err.get("message")
                except (ValueError, KeyError, TypeError):
                    out.error = raw[:200].decode(errors="replace")
                return out
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                now = time.perf_counter()
                obj = json.loads(data)
                if "error" in obj:
                    out.code = obj["error"].get("code") or "stream_error"
                    out.error = obj["error"].get("message")
                    out.status = None
                    return out
                if obj.get("usage"):
                    out.prompt_tokens = obj["usage"].get("prompt_tokens", 0)
                    out.output_tokens = obj["usage"].get("completion_tokens", 0)
                # every chunk with text is tokens reaching the client (ingress sends no empty ones; a chat
                # stream's first chunk carries the role with the first token); a peer's closing chunk with
                # only a finish reason is not a token
                if carries_tokens(obj):
                    chunks += 1
                    if last is None:
                        out.ttft_s = now - st
                        out.first_wall_ms = time.time() * 1000
                    else:
                        out.itl_s.append(now - last)
                    last = now
            out.e2el_s = time.perf_counter() - st
            if not out.output_tokens:  # a server without the usage chunk (a peer) streams a token per chunk
                out.output_tokens = chunks
            out.ok = out.ttft_s is not None
            if not out.ok:
                out.code, out.error = "no_tokens", "the stream ended without any token"
    except httpx.HTTPError as exc:
        out.code, out.error = type(exc).__name__, str(exc)[:200]
    except json.JSONDecodeError as exc:
        out.code, out.error = "bad_sse", str(exc)
    return out
