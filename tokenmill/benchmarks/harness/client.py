"""A lean asyncio HTTP/1.1 client and the open loop it sends Poisson arrivals from: lean so that the load
generator, which shares the machine with the stack it measures, takes as little of its CPU as it can."""
from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass

MODEL_NAME = "tiny"  # what a private stack serves unless told otherwise (stack.PrivateStack)


@dataclass
class Answer:
    """What the client saw of one request."""
    status: int | None = None
    request_id: str | None = None
    completion_tokens: int = 0
    prompt_tokens: int = 0
    latency_s: float | None = None  # from the scheduled arrival to the last byte
    error: str | None = None


class StaleConnection(ConnectionError):
    """The connection closed before any answer began."""


class ConnectionPool:
    """Keep-alive HTTP/1.1 connections to one host; one request per connection at a time."""

    def __init__(self, port: int):
        self.port = port
        self.idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []

    async def request(self, raw: bytes) -> tuple[int, dict[str, str], bytes]:
        while self.idle:
            conn = self.idle.pop()
            if conn[0].at_eof():  # the server closed it while idle (uvicorn's keep-alive timeout)
                conn[1].close()
                continue
            try:
                return await self._exchange(conn, raw)
            except StaleConnection:
                # A keep-alive connection the server was closing as we wrote: no answer began on it
                # (uvicorn only closes idle connections), so sending again on a new one is safe.
                continue
        return await self._exchange(await asyncio.open_connection("127.0.0.1", self.port), raw)

    async def _exchange(self, conn, raw: bytes) -> tuple[int, dict[str, str], bytes]:
        reader, writer = conn
        try:
            try:
                writer.write(raw)
                status_line = await reader.readline()
            except ConnectionError as exc:
                raise StaleConnection(str(exc)) from exc
            if not status_line:
                raise StaleConnection("closed before answering")
            headers: dict[str, str] = {}
            while True:
                line = await reader.readline()
                if line in (b"\r\n", b""):
                    break
                name, _, value = line.decode("latin-1").partition(":")
                headers[name.strip().lower()] = value.strip()
            body = await reader.readexactly(int(headers.get("content-length", "0")))
        except BaseException:
            writer.close()
            raise
        if headers.get("connection", "").lower() == "close":
            writer.close()
        else:
            self.idle.append(conn)
        return int(status_line.split()[1]), headers, body

    def close(self) -> None:
        for _, writer in self.idle:
            writer.close()
        self.idle.clear()


def completion_request(api_key: str, prompt: str, max_tokens: int) -> bytes:
    body = json.dumps({"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True,
                       "temperature": 0}).encode()
    return (f"POST /v1/completions HTTP/1.1\r\nHost: bench\r\nAuthorization: Bearer {api_key}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode() + body


async def open_loop(port: int, api_key: str, rate: float, seconds: float, max_tokens: int, prompt_words: int,
                    seed: int) -> tuple[list[Answer], float]:
    """Poisson arrivals at `rate` for `seconds`; returns every answer and the time from the first
    arrival to the last answer."""
    rng = random.Random(seed)
    arrivals, t = [], 0.0
    while t < seconds:
        arrivals.append(t)
        t += rng.expovariate(rate)
    vocabulary = [f"w{i}" for i in range(500)]
    pool = ConnectionPool(port)
    answers = [Answer() for _ in arrivals]

    async def one(i: int, at: float, t0: float) -> None:
        delay = t0 + at - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        prompt = f"{seed}-{i} " + " ".join(rng.choice(vocabulary) for _ in range(prompt_words - 1))
        a = answers[i]
        try:
            status, headers, body = await asyncio.wait_for(
                pool.request(completion_request(api_key, prompt, max_tokens)), timeout=120)
            a.status, a.request_id = status, headers.get("x-request-id")
            data = json.loads(body)
            if status == 200:
                a.completion_tokens = data["usage"]["completion_tokens"]
                a.prompt_tokens = data["usage"]["prompt_tokens"]
            else:
                a.error = (data.get("error") or {}).get("code") or str(status)
        except (OSError, asyncio.TimeoutError, ValueError, KeyError, IndexError) as exc:
            a.error = type(exc).__name__
        a.latency_s = time.perf_counter() - (t0 + at)

    t0 = time.perf_counter()
    try:
        await asyncio.gather(*(one(i, at, t0) for i, at in enumerate(arrivals)))
    finally:
        pool.close()
    return answers, time.perf_counter() - t0
