"""bench/http.py's StreamingClient against a hand-written HTTP/1.1 server: chunked bodies (with
chunk extensions and trailers) and sized ones, errors and 429s, connections kept alive and reused,
or closed where the server says so or closes them while idle; and the httpx path reading the same
streams to the same records."""

from __future__ import annotations

import asyncio
import json
import time

import httpx

from bench import common, http


def sse(obj) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


def token(text: str) -> bytes:
    return sse({"choices": [{"text": text, "finish_reason": None, "logprobs": {"tokens": [text]}}]})


class Server:
    """Answers each request by the "mode" in its JSON body; counts connections and requests."""

    def __init__(self) -> None:
        self.connections = 0
        self.requests: list[dict] = []
        self.close_idle = False  # close each connection right after its response

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except asyncio.IncompleteReadError:
                    return
                lines = head.decode().split("\r\n")
                assert lines[0] == "POST /v1/completions HTTP/1.1"
                headers = dict(ln.lower().split(": ", 1) for ln in lines[1:] if ln)
                length = int(headers["content-length"])
                body = json.loads(await reader.readexactly(length))
                self.requests.append(body)
                if not await self.respond(body.get("mode", "chunked"), writer) or self.close_idle:
                    return
        finally:
            writer.close()

    async def respond(self, mode: str, writer: asyncio.StreamWriter) -> bool:
        if mode in ("chunked", "close"):
            extra = "Connection: close\r\n" if mode == "close" else ""
            writer.write(f"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                         f"Transfer-Encoding: chunked\r\n{extra}\r\n".encode())
            frames = [token("a"), token("b") + token("c"), sse({"choices": [{"text": "", "finish_reason": "length"}]}),
                      sse({"choices": [], "usage": {"completion_tokens": 3}}), b"data: [DONE]\n\n"]
            for i, frame in enumerate(frames):
                ext = b";x=1" if i == 1 else b""
                # the finishing frame arrives split across two chunks
                parts = [frame[:7], frame[7:]] if i == 2 else [frame]
                for part in parts:
                    writer.write(b"%x%s\r\n%s\r\n" % (len(part), ext, part))
                    await writer.drain()
                    await asyncio.sleep(0.001)
            writer.write(b"0\r\nX-Trailer: 1\r\n\r\n")
            await writer.drain()
            return mode != "close"
        status, text = {"busy": (429, b'{"error": "full"}'), "bad": (400, b'{"error": "bad max_tokens"}')}[mode]
        writer.write(b"HTTP/1.1 %d X\r\nContent-Length: %d\r\n\r\n%s" % (status, len(text), text))
        await writer.drain()
        return True


def run(scenario) -> None:
    """`scenario(server, url)` against a fresh Server, within 30 s."""
    async def main():
        server = Server()
        listener = await asyncio.start_server(server.handle, "127.0.0.1", 0)
        try:
            await asyncio.wait_for(scenario(server, f"http://127.0.0.1:{listener.sockets[0].getsockname()[1]}"), 30)
        finally:
            listener.close()
            await listener.wait_closed()

    asyncio.run(main())


async def request(client: http.StreamingClient, mode: str) -> common.StreamRecord:
    return await http._streaming_request(client, {"mode": mode}, common.StreamRecord(mode, time.perf_counter()))


def test_streaming_client_reads_each_kind_of_response():
    async def scenario(server: Server, url: str) -> None:
        client = http.StreamingClient(url)
        try:
            first = await request(client, "chunked")
            assert [n for _, n in first.arrivals] == [1, 1, 1]
            assert (first.finish_reason, first.reported_tokens, first.error) == ("length", 3, None)
            assert first.sent is not None and first.arrivals[0][0] >= first.sent
            busy, bad = await request(client, "busy"), await request(client, "bad")
            assert busy.rejected and busy.error is None and not busy.arrivals
            assert not bad.rejected and bad.error.startswith("HTTP 400") and "bad max_tokens" in bad.error
            assert server.connections == 1  # every response above was read to its end: one connection
            closing = await request(client, "close")
            assert [n for _, n in closing.arrivals] == [1, 1, 1]
            await request(client, "chunked")
            assert server.connections == 2  # the server closed the last one: a new one was opened
            # concurrent requests each get a connection of their own
            records = await asyncio.gather(*(request(client, "chunked") for _ in range(3)))
            assert all(r.num_tokens == 3 for r in records) and server.connections == 4
            assert len(server.requests) == 8
        finally:
            await client.aclose()

    run(scenario)


def test_streaming_client_does_not_reuse_a_connection_the_server_closed():
    async def scenario(server: Server, url: str) -> None:
        server.close_idle = True  # as uvicorn does to a keep-alive connection idle for 5 s
        client = http.StreamingClient(url)
        try:
            for i in range(3):
                # a client busy elsewhere (its loop blocked): the close reaches its socket while
                # the loop cannot see it, so the pooled connection does not look closed yet
                time.sleep(0.1)
                record = await request(client, "chunked")
                assert record.num_tokens == 3 and record.error is None
                assert server.connections == i + 1
        finally:
            await client.aclose()

    run(scenario)


def test_httpx_path_reads_the_same_records():
    async def scenario(server: Server, url: str) -> None:
        streaming = http.StreamingClient(url)
        try:
            async with httpx.AsyncClient() as client:
                pair = [await http.http_request(c, url, "x", (1, 2), 3, 0) for c in (streaming, client)]
        finally:
            await streaming.aclose()
        for record in pair:
            assert ([n for _, n in record.arrivals], record.finish_reason, record.reported_tokens) == ([1, 1, 1], "length", 3)
        assert pair[0].sent is not None and pair[1].sent is None
        assert server.requests[0] == server.requests[1] == http.completion_body((1, 2), 3, 0)

    run(scenario)


def test_streaming_client_takes_plain_http_urls_with_a_prefix():
    client = http.StreamingClient("http://[::1]:8080/api/")
    assert (client.host, client.port, client.prefix, client.authority) == ("::1", 8080, "/api", "[::1]:8080")
    try:
        http.StreamingClient("https://example.com")
    except ValueError as e:
        assert "--client httpx" in str(e)
    else:
        raise AssertionError("https was taken")
