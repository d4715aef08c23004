"""bench/http.py's StreamingClient against a hand-written HTTP/1.1 server: chunked bodies (with
chunk extensions and trailers) and sized ones, errors and 429s, connections kept alive and reused,
or closed where the server says so."""

from __future__ import annotations

import asyncio
import json
import time

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
                if not await self.respond(body["mode"], writer):
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
                # the second frame arrives split across two chunks
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


def test_streaming_client_reads_each_kind_of_response():
    async def main():
        server = Server()
        listener = await asyncio.start_server(server.handle, "127.0.0.1", 0)
        port = listener.sockets[0].getsockname()[1]
        client = http.StreamingClient(f"http://127.0.0.1:{port}")

        async def request(mode: str) -> common.StreamRecord:
            record = common.StreamRecord(mode, time.perf_counter())
            return await http._streaming_request(client, {"mode": mode}, record)

        try:
            first = await request("chunked")
            assert [n for _, n in first.arrivals] == [1, 1, 1]
            assert (first.finish_reason, first.reported_tokens, first.error) == ("length", 3, None)
            assert first.sent is not None and first.arrivals[0][0] >= first.sent
            busy, bad = await request("busy"), await request("bad")
            assert busy.rejected and busy.error is None and not busy.arrivals
            assert not bad.rejected and bad.error.startswith("HTTP 400") and "bad max_tokens" in bad.error
            assert server.connections == 1  # every response above was read to its end: one connection
            closing = await request("close")
            assert [n for _, n in closing.arrivals] == [1, 1, 1]
            await request("chunked")
            assert server.connections == 2  # the server closed the last one: a new one was opened
            # concurrent requests each get a connection of their own
            records = await asyncio.gather(*(request("chunked") for _ in range(3)))
            assert all(r.num_tokens == 3 for r in records) and server.connections == 4
            assert len(server.requests) == 8
        finally:
            await client.aclose()
            listener.close()
            await listener.wait_closed()

    asyncio.run(main())
