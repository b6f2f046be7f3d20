"""The benchmarks' lean HTTP/1.1 client (tokenmill/benchmarks/harness/client.py): its keep-alive pool against a
server that closes connections under it, and the open loop that every private-stack benchmark sends from."""
from __future__ import annotations

import asyncio
import json

import pytest

from tokenmill.benchmarks.harness.client import ConnectionPool, completion_request, open_loop


async def _server(close_after: int, body: bytes = b'{"ok": true}'):
    """A keep-alive HTTP server that answers `close_after` requests per connection, then closes it
    as the next one arrives, without answering (a keep-alive timeout racing the client's write)."""
    served = []

    async def read_request(reader):
        head = await reader.readuntil(b"\r\n\r\n")
        length = int([h for h in head.split(b"\r\n") if h.lower().startswith(b"content-length")][0].split(b":")[1])
        await reader.readexactly(length)

    async def handle(reader, writer):
        try:
            for _ in range(close_after):
                await read_request(reader)
                served.append(1)
                writer.write(b"HTTP/1.1 200 OK\r\nx-request-id: r%d\r\ncontent-length: %d\r\n\r\n"
                             % (len(served), len(body)) + body)
                await writer.drain()
            await read_request(reader)
        except asyncio.IncompleteReadError:  # the client closed the connection
            pass
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1], served


async def test_pool_resends_on_a_keepalive_connection_the_server_closed():
    server, port, served = await _server(close_after=1)
    pool = ConnectionPool(port)
    try:
        for i in range(3):
            status, headers, body = await pool.request(completion_request("k", "hi", 1))
            assert status == 200 and headers["x-request-id"] == f"r{i + 1}"
        assert len(served) == 3  # each request reached the server exactly once
    finally:
        pool.close()
        server.close()


async def test_pool_reports_a_fresh_connection_closed_without_an_answer():
    server, port, served = await _server(close_after=0)
    pool = ConnectionPool(port)
    try:
        with pytest.raises(ConnectionError):
            await pool.request(completion_request("k", "hi", 1))
    finally:
        pool.close()
        server.close()


async def test_the_open_loop_sends_every_arrival_once_and_reads_its_usage():
    usage = json.dumps({"usage": {"completion_tokens": 2, "prompt_tokens": 5}}).encode()
    server, port, served = await _server(close_after=1000, body=usage)
    try:
        answers, span = await open_loop(port, "k", rate=200.0, seconds=0.05, max_tokens=2, prompt_words=3, seed=7)
    finally:
        server.close()
    assert answers and len(served) == len(answers) and span > 0
    assert all(a.status == 200 and a.completion_tokens == 2 and a.prompt_tokens == 5 and a.error is None
               and a.latency_s is not None for a in answers)
    assert sorted(a.request_id for a in answers) == sorted(f"r{i + 1}" for i in range(len(answers)))
