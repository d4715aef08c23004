"""HTTP benchmark: streaming clients against `python -m server`, then the same workload on the
engine directly, and the difference: what the serving layer costs.

    python bench/http.py --model PATH [--url http://HOST:PORT] [--users 1,4,8,32] [--out DIR]

Starts the server as a child process on a free port (or uses `--url`), waits for /health, and
runs each concurrency level `--repeats` times (the report gives each figure's median): N async
streams on one client (`StreamingClient`, or httpx with `--client httpx`), each one streaming
POST /v1/completions with a fixed token-id prompt, fixed max_tokens and ignore_eos. `logprobs` 0
makes every token its own SSE frame (a frame is otherwise skipped while text is held back), so
frame arrival times are token times. The server starts with a small --max-queue (8) so that the
32-client level exercises 429s. Before the levels, each side sends a burst of short requests, as
many as the largest level the server takes (so the HTTP client's connections are open before
anything is timed). Then the server is stopped and a child process runs the identical requests
through `Engine.submit` (bench/engine.py's helpers, with the EngineConfig the server's parser
makes of the same flags, `--server-args` included), so the two never share the device; it loads
its step programs from the server's persistent compilation cache (`--compile-cache`) rather than
compiling them again (on the H200 a cold compile is about 100 s per side). Reports throughput
(generated tok/s over the wall time and in the steady state), TTFT and inter-token latency
p50/p99, 429 counts, and the serving layer's cost in %. Writes bench/results/http-<date>.json
and prints a table.

Each level also reads the server's own /metrics before and after it: the mean TTFT its engine
thread measured splits the HTTP side's into the engine's part and what the HTTP layer adds, and
the handler's own histograms split that layer into the handler's work before submit, the
first token's way to its frame, and what lies outside the handler (the client, the connection,
uvicorn). Where an inter-token p99 stands apart from its p50, each side's share of gaps over 5
and 10 ms (pooled over the level's runs) says how many gaps make it: the client's, the server's
engine thread's (from its histogram) and the engine direct's; beside them the GC collections of
the server and of its engine process (from /metrics) and of this client during the level.

This process never imports JAX: the server and the engine run in children, one at a time.
"""

from __future__ import annotations

import pathlib
import sys

if __package__ in (None, ""):  # run as a script: this file would shadow the stdlib's `http`
    sys.path[0] = str(pathlib.Path(__file__).resolve().parents[1])

import argparse  # noqa: E402
import asyncio  # noqa: E402
import contextlib  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import select  # noqa: E402
import shlex  # noqa: E402
import signal  # noqa: E402
import socket  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import urllib.parse  # noqa: E402
from typing import Any  # noqa: E402

import numpy as np  # noqa: E402

from bench import common  # noqa: E402
from bench.server_metrics import (  # noqa: E402
    GcRecorder, engine_timing_means, engine_timing_sums, scrape_after, server_tails)

log = logging.getLogger("bench.http")


def prompts_for(seed: int, users: int, length: int, vocab_size: int) -> list[tuple[int, ...]]:
    """The prompts of one level: the same on both sides."""
    rng = np.random.default_rng([seed, users])
    return [common.random_prompt(rng, length, vocab_size) for _ in range(users)]


def vocab_size_of(model: pathlib.Path) -> int:
    from model.gguf_file import GGUFFile  # numpy and gguf only

    meta = GGUFFile(model).metadata
    arch = meta.get("general.architecture")
    return int(meta.get(f"{arch}.vocab_size") or len(meta["tokenizer.ggml.tokens"]))


# ---------------------------------------------------------------------------------------------
# the server side


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def engine_flags(args: argparse.Namespace) -> list[str]:
    """The `python -m server` flags that make the engine of both sides: the server is started
    with them, and the engine-direct side builds its EngineConfig from them with the server's own
    parser, `--server-args` included (last: they override)."""
    return [
        "--model", str(args.model), "--slots", str(args.slots), "--max-queue", str(args.max_queue),
        "--max-context", str(args.max_context), "--prefill-budget", str(args.prefill_budget),
        "--numerics", "native",  # speed; on a GPU auto is native anyway
        *shlex.split(args.server_args),
    ]


def warmup_requests(args: argparse.Namespace) -> int:
    """Concurrent short requests each side sends before its levels: as many as the largest level
    that the server takes without a 429, so that the HTTP side has that many connections open
    before it measures (the first run of a level otherwise opens them while it is timed)."""
    return max(1, min(max(args.users), args.slots + args.max_queue))


class ServerProcess:
    """`python -m server` in a child process; its log goes to a temporary file."""

    def __init__(self, args: argparse.Namespace, command: list[str] | None = None) -> None:
        """`command`: another server command line, "{port}" standing for the port."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_file = tempfile.NamedTemporaryFile(prefix="pallas-serve-bench-", suffix=".log", delete=False)
        cmd = [
            sys.executable, "-m", "server", "--host", "127.0.0.1", "--port", "{port}", "--log-level", "warning",
            *(["--compile-cache", args.compile_cache] if args.compile_cache else []), *engine_flags(args),
        ] if command is None else command
        cmd = [part.replace("{port}", str(self.port)) for part in cmd]
        log.info("starting %s (log %s)", " ".join(cmd), self.log_file.name)
        self.started = time.perf_counter()
        self.proc = subprocess.Popen(cmd, cwd=common.ROOT, stdout=self.log_file, stderr=subprocess.STDOUT)

    def log_tail(self, lines: int = 40) -> str:
        with open(self.log_file.name, errors="replace") as f:
            return "".join(f.readlines()[-lines:])

    def wait_healthy(self, timeout: float) -> dict[str, Any]:
        import httpx

        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with status {self.proc.returncode}:\n{self.log_tail()}")
            try:
                r = httpx.get(self.url + "/health", timeout=5)
                if r.status_code == 200:
                    return r.json()
                if r.json().get("status") == "failed":
                    raise RuntimeError(f"the server failed to load: {r.json()}")
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"the server was not healthy within {timeout} s:\n{self.log_tail()}")
            time.sleep(0.5)

    def stop(self) -> None:
        """SIGINT (uvicorn's graceful shutdown), then SIGTERM; SIGKILL only if both are ignored."""
        for sig, wait_s in ((signal.SIGINT, 60), (signal.SIGTERM, 30)):
            if self.proc.poll() is not None:
                break
            self.proc.send_signal(sig)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(wait_s)
        if self.proc.poll() is None:
            log.warning("the server ignored SIGINT and SIGTERM; killing it")
            self.proc.kill()
            self.proc.wait()
        self.log_file.close()


class StreamingClient:
    """A lean HTTP/1.1 client for the timed requests: keep-alive connections over asyncio
    streams, each request written whole, the response read chunk by chunk as it arrives. A load
    generator's own time is not the server's: httpx, on one event loop with 8 streams, put its
    own milliseconds into every TTFT it measured. This one does little more than the socket
    reads (`--client httpx` keeps the other for comparison). Plain http only."""

    CONNECT_TIMEOUT_S = 30.0

    def __init__(self, url: str) -> None:
        parts = urllib.parse.urlsplit(url)
        if parts.scheme != "http":
            raise ValueError(f"the streaming client speaks plain http, not {parts.scheme!r}: use --client httpx")
        self.host, self.port = parts.hostname or "127.0.0.1", parts.port or 80
        self.prefix = parts.path.rstrip("/")  # a server behind a path prefix
        self.authority = f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"
        self._idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
        self._open: set[asyncio.StreamWriter] = set()

    @staticmethod
    def _closed_by_peer(writer: asyncio.StreamWriter) -> bool:
        """An idle connection whose socket reads ready has been closed by the server (or holds
        bytes nobody asked for): either way it is not reused."""
        sock = writer.get_extra_info("socket")
        return sock is None or bool(select.select([sock], [], [], 0)[0])

    async def _connection(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, bool]:
        """A connection to write a request on, and whether it was reused from the pool."""
        while self._idle:
            reader, writer = self._idle.pop()
            if not writer.is_closing() and not reader.at_eof() and not self._closed_by_peer(writer):
                return reader, writer, True
            self._close(writer)
        reader, writer = await asyncio.wait_for(asyncio.open_connection(self.host, self.port), self.CONNECT_TIMEOUT_S)
        self._open.add(writer)
        return reader, writer, False

    def _close(self, writer: asyncio.StreamWriter) -> None:
        self._open.discard(writer)
        writer.close()

    async def _send(self, request: bytes, record: common.StreamRecord | None) -> tuple[asyncio.StreamReader,
                                                                                        asyncio.StreamWriter, bytes]:
        """Writes `request` and reads the response's head. A reused connection that the server
        closed before answering (nothing of a status line came back) is retried once on a new
        one, as httpx does."""
        while True:
            reader, writer, reused = await self._connection()
            try:
                writer.write(request)
                if record is not None:  # the transport has tried the socket's send in write()
                    record.sent = time.perf_counter()
                await writer.drain()
                return reader, writer, await reader.readuntil(b"\r\n\r\n")
            except (asyncio.IncompleteReadError, ConnectionError) as e:
                self._close(writer)
                if not reused or (isinstance(e, asyncio.IncompleteReadError) and e.partial):
                    raise
            except BaseException:
                self._close(writer)
                raise

    async def post(self, path: str, payload: dict[str, Any], record: common.StreamRecord | None = None):
        """POST `payload` as JSON to `path` (under the URL's path); yields the status code, then
        each piece of the body as it arrives (a chunk of a chunked response). The connection
        goes back to the pool only when the body was read to its end. `record.sent`: when the
        request was handed to the socket."""
        body = json.dumps(payload).encode()
        request = (f"POST {self.prefix}{path} HTTP/1.1\r\nHost: {self.authority}\r\n"
                   f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode() + body
        reader, writer, head_bytes = await self._send(request, record)
        reusable = False
        try:
            head = head_bytes.decode("latin-1").split("\r\n")
            headers = {}
            for line in head[1:]:
                name, _, value = line.partition(":")
                headers[name.strip().lower()] = value.strip().lower()
            yield int(head[0].split(" ", 2)[1])
            if headers.get("transfer-encoding") == "chunked":
                while size := await _chunk_size(reader):
                    yield (await reader.readexactly(size + 2))[:-2]
                while (line := await reader.readline()) != b"\r\n":  # trailers
                    if not line:
                        raise asyncio.IncompleteReadError(b"", None)
            elif "content-length" in headers:
                yield await reader.readexactly(int(headers["content-length"]))
            else:  # the body runs to the connection's end
                while piece := await reader.read(65536):
                    yield piece
                return
            reusable = headers.get("connection") != "close"
        finally:
            if reusable:
                self._idle.append((reader, writer))
            else:
                self._close(writer)

    async def aclose(self) -> None:
        for writer in list(self._open):
            self._close(writer)
        self._idle.clear()


async def _chunk_size(reader: asyncio.StreamReader) -> int:
    """The size of the next chunk of a chunked body (its extensions dropped)."""
    line = await reader.readline()
    if not line.endswith(b"\n"):
        raise asyncio.IncompleteReadError(line, None)
    return int(line.split(b";")[0], 16)


def completion_body(prompt: tuple[int, ...], max_tokens: int, seed: int) -> dict[str, Any]:
    return {
        "model": "bench", "prompt": list(prompt), "max_tokens": max_tokens, "stream": True, "ignore_eos": True,
        "logprobs": 0, "temperature": 1.0, "seed": seed, "stream_options": {"include_usage": True},
    }


def read_sse_line(record: common.StreamRecord, line: str, now: float) -> bool:
    """Takes one line of the stream into `record`; False at its end ([DONE])."""
    if not line.startswith("data: "):
        return True
    data = line[6:]
    if data == "[DONE]":
        return False
    obj = json.loads(data)
    if "error" in obj:
        record.error = str(obj["error"])[:200]
    for choice in obj.get("choices") or ():
        lp = choice.get("logprobs") or {}
        n = len(lp.get("tokens") or ()) or (1 if choice.get("text") else 0)
        if n:
            record.arrivals.append((now, n))
        if choice.get("finish_reason"):
            record.finish_reason = choice["finish_reason"]
    if obj.get("usage"):
        record.reported_tokens = obj["usage"]["completion_tokens"]
    return True


async def http_request(client, url: str, label: str, prompt: tuple[int, ...], max_tokens: int,
                       seed: int) -> common.StreamRecord:
    """One streamed completion through `client`: a StreamingClient, or an httpx.AsyncClient."""
    body = completion_body(prompt, max_tokens, seed)
    record = common.StreamRecord(label, time.perf_counter())
    if isinstance(client, StreamingClient):
        return await _streaming_request(client, body, record)
    async with client.stream("POST", url + "/v1/completions", json=body) as resp:
        if resp.status_code == 429:
            record.rejected = True
            await resp.aread()
            return record
        if resp.status_code != 200:
            record.error = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
            return record
        async for line in resp.aiter_lines():
            if not read_sse_line(record, line, time.perf_counter()):
                break
    return record


async def _streaming_request(client: StreamingClient, body: dict[str, Any],
                             record: common.StreamRecord) -> common.StreamRecord:
    async with contextlib.aclosing(client.post("/v1/completions", body, record)) as response:
        status = await anext(response)
        if status != 200:
            text = b"".join([piece async for piece in response])
            record.rejected = status == 429
            if not record.rejected:
                record.error = f"HTTP {status}: {text[:200]!r}"
            return record
        pending = b""
        more = True
        async for piece in response:
            now = time.perf_counter()
            if not more:
                continue  # read to the end, so that the connection is reused
            *lines, pending = (pending + piece).split(b"\n")
            for line in lines:
                if not read_sse_line(record, line.decode().rstrip("\r"), now):
                    more = False
                    break
        if more and pending:  # a last line without its newline
            read_sse_line(record, pending.decode().rstrip("\r"), time.perf_counter())
    return record


async def run_http(url: str, args: argparse.Namespace, vocab: int, repeats: int) -> dict[str, Any]:
    """Each level of `args.users`, `repeats` times over one client (`args.client`): `combine_runs`
    per level, with the server's own view of the level's requests under "engine_side"."""
    import httpx

    out = {}
    limits = httpx.Limits(max_connections=max(args.users) + 8, max_keepalive_connections=max(args.users) + 8)
    # httpx reads /metrics (untimed) and, with --client httpx, streams the timed requests too
    async with httpx.AsyncClient(timeout=httpx.Timeout(None, connect=30), limits=limits) as metrics_client:
        client = metrics_client if getattr(args, "client", "stream") == "httpx" else StreamingClient(url)
        try:
            warm = prompts_for(args.seed + 1, 1, 64, vocab)[0]
            await asyncio.gather(*(http_request(client, url, f"warmup-{i}", warm, 8, i)
                                   for i in range(warmup_requests(args))))
            for users in args.users:
                prompts = prompts_for(args.seed, users, args.prompt_len, vocab)
                runs = []
                before = await engine_timing_sums(metrics_client, url)
                with GcRecorder() as client_gc:
                    for _ in range(repeats):
                        records = await asyncio.gather(*(
                            http_request(client, url, f"http-{users}-{i}", p, args.max_tokens, i)
                            for i, p in enumerate(prompts)
                        ))
                        runs.append(level_summary(records))
                out[str(users)] = combine_runs(runs)
                after = await scrape_after(metrics_client, url, before, out[str(users)]["ttft_count"])
                out[str(users)]["engine_side"] = engine_timing_means(before, after)
                out[str(users)]["server_tails"] = server_tails(before, after)
                out[str(users)]["client_gc"] = client_gc.summary()
                log.info("http x%d: %s", users, out[str(users)])
        finally:
            if isinstance(client, StreamingClient):
                await client.aclose()
    return out


def level_summary(records: list[common.StreamRecord]) -> dict[str, Any]:
    summary = common.summarize(records)
    reported = [r.reported_tokens for r in records if r.reported_tokens is not None]
    if reported:
        summary["usage_tokens"] = sum(reported)
    summary["finish_reasons"] = sorted({r.finish_reason for r in records if r.finish_reason})
    ttfts = [r.ttft for r in records if not r.rejected and r.ttft is not None]
    summary["ttft_ms_mean"] = round(1e3 * float(np.mean(ttfts)), 3) if ttfts else None
    summary["ttft_count"] = len(ttfts)
    sends = [r.sent - r.submitted for r in records if not r.rejected and r.ttft is not None and r.sent is not None]
    if sends:  # the client's own part of the TTFT: from the request's start to its bytes written
        summary["send_ms_mean"] = round(1e3 * float(np.mean(sends)), 3)
    if summary["errors"]:
        summary["first_error"] = next(r.error for r in records if r.error)
    return summary


# The figures of a level that are the median of its repeats; counts are summed.
MEDIAN_KEYS = ("tok_s", "steady_tok_s", "ttft_ms_p50", "ttft_ms_p99", "itl_ms_p50", "itl_ms_p99")
SUM_KEYS = ("requests", "rejected", "errors", "tokens", "usage_tokens", "itl_gaps",
            *(f"itl_over_{b}ms" for b in common.LONG_GAP_BOUNDS_MS))


def combine_runs(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One level's repeats as one summary: the median of each timing figure (a single short burst
    of 8 streams varied by several % from run to run), the sum of each count, and every run's
    throughput and TTFT under "runs"."""
    out = dict(runs[0])
    for key in MEDIAN_KEYS:
        values = [r[key] for r in runs if r.get(key) is not None]
        out[key] = round(float(np.median(values)), 3) if values else None
    for key in SUM_KEYS:
        if any(key in r for r in runs):
            out[key] = sum(r.get(key) or 0 for r in runs)
    out["finish_reasons"] = sorted({f for r in runs for f in r.get("finish_reasons", ())})
    out.pop("first_error", None)
    errors = [r["first_error"] for r in runs if r.get("first_error")]
    if errors:
        out["first_error"] = errors[0]
    # pooled over the runs' requests, as the server's histogram is
    counts = [(r["ttft_ms_mean"], r["ttft_count"]) for r in runs if r.get("ttft_ms_mean") is not None]
    total = sum(n for _, n in counts)
    out["ttft_ms_mean"] = round(sum(v * n for v, n in counts) / total, 3) if total else None
    out["ttft_count"] = total
    for b in common.LONG_GAP_BOUNDS_MS:  # pooled over the runs' gaps, as the server's histogram is
        out[f"itl_over_{b}ms_pct"] = (round(100 * out[f"itl_over_{b}ms"] / out["itl_gaps"], 3)
                                      if out.get("itl_gaps") else None)
    sends = [(r["send_ms_mean"], r["ttft_count"]) for r in runs if r.get("send_ms_mean") is not None]
    if sends and sum(n for _, n in sends):
        out["send_ms_mean"] = round(sum(v * n for v, n in sends) / sum(n for _, n in sends), 3)
    out["repeats"] = len(runs)
    out["runs"] = [{k: r.get(k) for k in ("tok_s", "steady_tok_s", "ttft_ms_p50")} for r in runs]
    return out


# ---------------------------------------------------------------------------------------------
# the engine side (a child process)


def engine_direct(args: argparse.Namespace) -> int:
    from bench import engine as bench_engine

    config = engine_config_of(args)
    if args.compile_cache:  # the server's cache: its programs, compiled once, serve this side too
        common.enable_compilation_cache(args.compile_cache)
    engine, startup = bench_engine.start_engine(args.model, config)
    vocab = engine.tokenizer.vocab_size

    async def workload() -> dict[str, Any]:
        out = {}
        warm = prompts_for(args.seed + 1, 1, 64, vocab)[0]
        await bench_engine.run_batch(engine, [bench_engine.make_request(f"warmup-{i}", warm, 8, i, logprobs=True)
                                              for i in range(warmup_requests(args))])
        for users in args.users:
            prompts = prompts_for(args.seed, users, args.prompt_len, vocab)
            runs = []
            for _ in range(args.repeats):
                reqs = [bench_engine.make_request(f"engine-{users}-{i}", p, args.max_tokens, i, logprobs=True)
                        for i, p in enumerate(prompts)]
                runs.append(level_summary(await bench_engine.run_batch(engine, reqs)))
            out[str(users)] = combine_runs(runs)
            log.info("engine x%d: %s", users, out[str(users)])
        return out

    try:
        levels = asyncio.run(workload())
    finally:
        engine.shutdown(60)
    common.write_json(args.json_out, {"startup": startup, "levels": levels, "device": common.device_info()})
    return 0


def engine_config_of(args: argparse.Namespace):
    """The EngineConfig the server builds from `engine_flags(args)` (its parser and defaults:
    e.g. --kv-dtype auto, bf16 on a GPU; an f32 cache here once made the H200 engine slower than
    the server it is compared with)."""
    from server.__main__ import build_configs, build_parser

    engine_config, _ = build_configs(build_parser().parse_args(engine_flags(args)), {})
    return engine_config


def run_engine_child(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        out = pathlib.Path(tmp) / "engine.json"
        cmd = [
            sys.executable, str(pathlib.Path(__file__).resolve()), "--engine-direct", "--json-out", str(out),
            "--model", str(args.model), "--slots", str(args.slots), "--max-queue", str(args.max_queue),
            "--max-context", str(args.max_context), "--prefill-budget", str(args.prefill_budget),
            "--users", ",".join(map(str, args.users)), "--prompt-len", str(args.prompt_len),
            "--max-tokens", str(args.max_tokens), "--seed", str(args.seed), "--repeats", str(args.repeats),
            "--compile-cache", args.compile_cache or "", f"--server-args={args.server_args}",
        ]
        log.info("engine-direct run in a child process")
        subprocess.run(cmd, check=True, cwd=common.ROOT)
        return json.loads(out.read_text())


# ---------------------------------------------------------------------------------------------


def compare(http: dict[str, Any], engine: dict[str, Any] | None) -> dict[str, Any]:
    """Serving-layer cost per level: throughput lost (%), TTFT and ITL added (ms)."""
    out = {}
    for users, h in http.items():
        e = (engine or {}).get(users)
        if not e:
            continue
        row: dict[str, Any] = {}
        for key in ("tok_s", "steady_tok_s"):
            if h.get(key) and e.get(key):
                row[f"{key}_cost_pct"] = round(100 * (e[key] - h[key]) / e[key], 1)
        for key in ("ttft_ms_p50", "ttft_ms_mean", "itl_ms_p50", "itl_ms_p99"):
            if h.get(key) is not None and e.get(key) is not None:
                row[f"{key}_added"] = round(h[key] - e[key], 3)
        side = h.get("engine_side") or {}
        if h.get("ttft_ms_mean") is not None and side.get("ttft_ms_mean") is not None:
            # the mean TTFT over HTTP, split: the server's engine thread's own (submit to first
            # token handed over) and what the HTTP layer adds around it
            row["ttft_ms_mean_http_layer"] = round(h["ttft_ms_mean"] - side["ttft_ms_mean"], 3)
            if side.get("admit_ms_mean") is not None and side.get("first_frame_ms_mean") is not None:
                # the HTTP layer's part, split: the server's handler up to submit, the server from
                # the engine's first token to its frame handed over, and outside the handler
                # (the client, the connection, uvicorn's parsing and sending). The histograms count
                # every request of the level alike only for this bench's workload (streamed, one
                # choice each, no client leaving early).
                row["ttft_ms_mean_server_admit"] = side["admit_ms_mean"]
                row["ttft_ms_mean_server_delivery"] = round(
                    side["first_frame_ms_mean"] - side["admit_ms_mean"] - side["ttft_ms_mean"], 3)
                row["ttft_ms_mean_outside_handler"] = round(h["ttft_ms_mean"] - side["first_frame_ms_mean"], 3)
                if h.get("send_ms_mean") is not None:
                    # of that, the client's own: from its request's start to the bytes written
                    row["ttft_ms_mean_client_send"] = h["send_ms_mean"]
            if e.get("ttft_ms_mean") is not None:
                row["ttft_ms_mean_engine_added"] = round(side["ttft_ms_mean"] - e["ttft_ms_mean"], 3)
        out[users] = row
    return out


def print_table(http: dict[str, Any], engine: dict[str, Any] | None, cost: dict[str, Any]) -> None:
    def f(v: Any, spec: str = ".1f") -> str:
        return "-" if v is None else format(v, spec)

    head = (f"{'users':>5} {'http tok/s':>10} {'eng tok/s':>10} {'cost %':>7} {'http TTFT':>10} {'eng TTFT':>9} "
            f"{'http ITL p50/p99':>17} {'eng ITL p50/p99':>16} {'429s':>5}")
    print("\n" + head)
    print("-" * len(head))
    for users, h in http.items():
        e = (engine or {}).get(users, {})
        c = cost.get(users, {})
        print(
            f"{users:>5} {f(h.get('tok_s')):>10} {f(e.get('tok_s')):>10} {f(c.get('tok_s_cost_pct')):>7} "
            f"{f(h.get('ttft_ms_p50')):>10} {f(e.get('ttft_ms_p50')):>9} "
            f"{f(h.get('itl_ms_p50'), '.2f') + '/' + f(h.get('itl_ms_p99'), '.2f'):>17} "
            f"{f(e.get('itl_ms_p50'), '.2f') + '/' + f(e.get('itl_ms_p99'), '.2f'):>16} "
            f"{h.get('rejected', 0):>3}/{e.get('rejected', '-')}"
        )
    print("tok/s over the wall time (first submit to last token); TTFT and ITL in ms, p50 unless noted; "
          "429s: http/engine")
    for users, h in http.items():
        side, e = h.get("engine_side") or {}, (engine or {}).get(users, {})
        c = cost.get(users, {})
        print(f"{users:>5} users, mean TTFT: {f(h.get('ttft_ms_mean'))} over HTTP = {f(side.get('ttft_ms_mean'))} in "
              f"the server's engine (of which {f(side.get('queue_ms_mean'))} queued) + the HTTP layer; engine "
              f"direct {f(e.get('ttft_ms_mean'))}")
        if c.get("ttft_ms_mean_server_admit") is not None:
            print(f"{'':>5} the HTTP layer: {f(c['ttft_ms_mean_server_admit'], '.2f')} handler to submit + "
                  f"{f(c['ttft_ms_mean_server_delivery'], '.2f')} first token to its frame + "
                  f"{f(c['ttft_ms_mean_outside_handler'], '.2f')} outside the handler (client, connection, uvicorn)")
        if c.get("ttft_ms_mean_client_send") is not None:
            print(f"{'':>5} outside the handler: {f(c['ttft_ms_mean_client_send'], '.2f')} the client writing its request "
                  f"+ {f(c['ttft_ms_mean_outside_handler'] - c['ttft_ms_mean_client_send'], '.2f')} the rest "
                  f"(connection, uvicorn, the client reading the frame)")
        tails, client_gc = h.get("server_tails") or {}, h.get("client_gc") or {}
        bounds = common.LONG_GAP_BOUNDS_MS

        def shares(side: dict[str, Any]) -> str:
            return " / ".join(f(side.get(f"itl_over_{b}ms_pct"), ".2f") for b in bounds)

        def collections(stats: dict[str, Any], prefix: str = "gc") -> str:
            return ", ".join(f"gen{g} {(stats.get(f'{prefix}{g}') or {}).get('count', '-')}, "
                             f"{f((stats.get(f'{prefix}{g}') or {}).get('ms'), '.1f')}" for g in range(3))

        engine_gc = f"; engine process {collections(tails, 'engine_gc')}" if "engine_gc0" in tails else ""
        print(f"{'':>5} inter-token gaps over {' / '.join(map(str, bounds))} ms (%): HTTP client {shares(h)}, "
              f"the server's engine thread {shares(tails)}, engine direct {shares(e)}; GC (count, ms) server "
              f"{collections(tails)}{engine_gc}; client {collections(client_gc)}")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    ap.add_argument("--model", type=pathlib.Path, required=True, help="GGUF file (also gives the vocabulary size)")
    ap.add_argument("--url", help="a running server instead of starting one (its engine flags must match)")
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("--max-queue", type=int, default=8, help="server --max-queue: slots + queue clients get a place")
    ap.add_argument("--max-context", type=int, default=4096)
    ap.add_argument("--prefill-budget", type=int, default=512)
    ap.add_argument("--users", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4, 8, 32])
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=3,
                    help="runs of each level, on both sides; the report gives the median of each figure")
    ap.add_argument("--startup-timeout", type=float, default=1800.0, help="seconds to wait for /health")
    ap.add_argument("--no-engine", action="store_true", help="skip the engine-direct comparison")
    ap.add_argument("--compile-cache", default=None,
                    help="persistent compilation cache of both sides (default: the server's own, so the engine "
                         "side loads the programs the server compiled; '': the engine side compiles its own, the server "
                         "keeps its default)")
    ap.add_argument("--client", default="stream", choices=("stream", "httpx"),
                    help="the timed requests' HTTP client: a lean one over asyncio streams, or httpx")
    ap.add_argument("--server-args", default="", help='more `python -m server` flags, e.g. "--decode-steps 4"')
    ap.add_argument("--out", type=pathlib.Path, help="results directory (default bench/results)")
    ap.add_argument("--engine-direct", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--json-out", type=pathlib.Path, help=argparse.SUPPRESS)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.repeats < 1:
        build_parser().error("--repeats must be >= 1")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request otherwise
    if args.compile_cache is None:
        from server.default_model import cache_dir  # no JAX in this process

        args.compile_cache = str(cache_dir() / "jax-compile-cache")  # the server's default
    if args.engine_direct:
        return engine_direct(args)
    stamp = common.timestamp()
    vocab = vocab_size_of(args.model)
    server = None
    startup_s = None
    health: dict[str, Any] = {}
    try:
        if args.url:
            url = args.url.rstrip("/")
            import httpx

            health = httpx.get(url + "/health", timeout=10).json()
        else:
            server = ServerProcess(args)
            url = server.url
            health = server.wait_healthy(args.startup_timeout)
            startup_s = round(time.perf_counter() - server.started, 2)
            log.info("server healthy after %.1f s", startup_s)
        http_levels = asyncio.run(run_http(url, args, vocab, args.repeats))
    finally:
        if server is not None:
            server.stop()
    engine_run = None if args.no_engine else run_engine_child(args)
    engine_levels = engine_run["levels"] if engine_run else None
    cost = compare(http_levels, engine_levels)
    result = {
        "kind": "http",
        "date": stamp,
        "git": common.git_rev(),
        "gpu": engine_run["device"]["gpu"] if engine_run else None,
        "jax": engine_run["device"]["jax"] if engine_run else None,
        "model": common.model_facts(args.model),
        "server": {"url": args.url or "child process", "args": args.server_args, "startup_s": startup_s,
                   "health": health},
        "settings": {"slots": args.slots, "max_queue": args.max_queue, "max_context": args.max_context,
                     "prompt_len": args.prompt_len, "max_tokens": args.max_tokens, "users": args.users,
                     "repeats": args.repeats, "compile_cache": args.compile_cache or None, "client": args.client,
                     "request": "POST /v1/completions, token-id prompt, stream, ignore_eos, logprobs 0, temperature 1"},
        "http": http_levels,
        "engine": engine_levels,
        "engine_startup": engine_run["startup"] if engine_run else None,
        "serving_cost": cost,
    }
    path = common.result_path(args.out, "http", stamp)
    common.write_json(path, result)
    print_table(http_levels, engine_levels, cost)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
