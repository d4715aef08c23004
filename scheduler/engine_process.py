"""The engine in a process of its own, so that the HTTP event loop and the engine thread no
longer share one interpreter lock.

Why: inside `python -m server` the event loop (JSON, h11, Starlette's send chain: ~180 us of
Python per streamed frame on a slow CPU) and the engine thread take turns on one GIL. On the
H200 the engine thread then saw 7% of its inter-token gaps over 5 ms, against 1% for the engine
alone, and the serving layer cost 3.2-8.6% of the engine's throughput at 8 users
(bench/results/README.md, twenty-sixth session). vLLM's engine core runs apart for this reason.

`EngineProcess` has the `Engine` API the server uses: `tokenizer`, `config`, `info()`, `stats()`,
`add_observer`, `submit`, `start`, `wait_ready`, `shutdown`. This process loads only the
tokenizer (from the GGUF's metadata; it renders and tokenizes prompts) and never imports JAX. A
child process (spawned) builds the real engine with `scheduler.loader.build_engine` and runs it.

Wire: two one-way pipes of pickled tuples.
  to the child:   ("submit", key, GenerationRequest), ("cancel", key), ("shutdown", timeout_s),
                  ("slot", key, action, slot, path)
  to the parent:  ("ready", info, stats), ("failed", error, stats), ("events", [(key, event)],
                  stats), ("timing", RequestTiming), ("stats", stats, GcSnapshot), ("stopped", stats),
                  ("slot_done", key, answer, exception, stats)
A slot action (`slot_action`, scheduler/slot_files.py) runs on a thread of its own in the child,
which reads or writes the file there, and answers with "slot_done". The child's engine thread
sends a processed step's events in one message: the child's streams
are given `_PipeLoop`, which stands in for an asyncio loop. A reader thread here hands them to
their streams' loops in one `call_soon_threadsafe` per loop, as the engine does in process. The
engine's timings (TTFT, inter-token gaps for /metrics) are taken at that hand-over in the child,
so they leave out the way through the pipe to this process.

Admission is decided here, at once, as `Engine.submit` decides it: the engine state, the limits
the child reported (`validate_request`) and a capacity of num_slots + max_queue places. A place
is given back when the request's final event arrives, after the child gave back its own, so the
child never refuses what this side admitted.

Failure: if the child dies, the reader sees its pipe close: the engine is "failed" and every
open stream ends with an error event. If the parent dies, the child sees its command pipe close
and shuts its engine down; while the model still loads, a watcher thread ends the child at once
on that, or on a "shutdown". The child ignores SIGINT and SIGTERM: Ctrl-C and a service
manager's stop reach the whole process group, and the parent's orderly shutdown (uvicorn's
drain, then `shutdown`) is what ends the child; a parent forced out before that closes the
command pipe at exit (and kills the child after a grace).
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import dataclasses
import fcntl
import gc
import importlib
import itertools
import logging
import multiprocessing
import os
import signal
import sys
import threading
from typing import Any, Callable

from model.config import EngineConfig
from scheduler import grammar, slot_files
from scheduler.engine import Engine, unavailable_reason
from scheduler.gc_pauses import GcSnapshot, freeze_heap, gc_pauses
from scheduler.request_stream import RequestStream, _Cancel, _hand_over
from scheduler.requests import RequestTiming, notify, validate_request, with_min_tokens_bans
from scheduler.types import (
    FINISH_ERROR,
    Constraint,
    EngineStats,
    EngineUnavailableError,
    GenerationRequest,
    QueueFullError,
    RequestValidationError,
    StreamEvent,
)

log = logging.getLogger(__name__)

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
STATS_INTERVAL_S = 0.05  # the child sends its stats this often when they changed and no step did
STOP_GRACE_S = 10.0  # after the shutdown timeout: for the child to send its last events and exit
PIPE_BYTES = 1 << 20  # each pipe's buffer (the Linux default is 64 KiB)
F_SETPIPE_SZ = getattr(fcntl, "F_SETPIPE_SZ", 1031)  # Linux's fcntl command (named in Python 3.10+)
VOCABULARY_WAIT_S = 60.0  # a constrained submit waits this long at most for this side's vocabulary


@dataclasses.dataclass(frozen=True)
class EngineSpec:
    """What the child needs to build the engine: picklable."""

    model_path: str
    engine_config: EngineConfig
    compile_cache: str | None = None  # JAX's persistent compilation cache directory
    log_level: str = "info"
    switch_interval_s: float | None = None  # sys.setswitchinterval in the child too
    # "module:function" that the child calls with (model_path, engine_config) to build the
    # (unstarted) engine; tests name one that builds an engine over a fake model.
    builder: str = "scheduler.loader:build_engine"


class EngineProcess:
    """The `Engine` API over a child process (module docstring)."""

    def __init__(self, spec: EngineSpec, tokenizer: Any, *, model_name: str = "") -> None:
        self.tokenizer = tokenizer
        self.config = spec.engine_config
        self._spec = spec
        self._process: Any = None
        self._commands: Any = None  # this end of the command pipe
        self._events: Any = None  # this end of the event pipe
        self._send_lock = threading.Lock()
        self._reap_lock = threading.Lock()
        self._reader: threading.Thread | None = None
        self._settled = threading.Event()  # ready, failed or stopped
        config = spec.engine_config
        self._capacity = threading.BoundedSemaphore(config.num_slots + config.max_queue)
        self._keys = itertools.count()
        self._lock = threading.Lock()  # guards _streams and _is_closed
        self._streams: dict[int, RequestStream] = {}
        self._slot_calls: dict[int, concurrent.futures.Future] = {}  # slot actions the child has not answered
        self._is_closed = False  # the child's events ended: no stream may be added
        self._is_stopping = False  # `shutdown` was called
        self._froze_heap = False  # this process's heap was frozen once the engine was ready
        self._rejected = 0  # written only by the submitting (event-loop) thread
        self._observers: tuple[Callable[[RequestTiming], None], ...] = ()
        self._stats = EngineStats("loading", config.num_slots, 0, 0, 0, 0, 0, 0)
        self._info: dict[str, Any] = {"model": model_name}
        self._limits: dict[str, int | bool] = {}
        self._gc: GcSnapshot | None = None  # the child's GC pauses, as of its last stats message
        self._inbox = _CancelSender(self)
        # Constrained decoding: grammars are compiled here too, against this tokenizer, so that one
        # the child would refuse is refused at submit (HTTP 400) like any other bad input; built
        # on a thread from `start` on, while the child loads.
        self._vocabulary: grammar.Vocabulary | None = None
        self._no_vocabulary = "the vocabulary is still being built"
        self._vocabulary_built = threading.Event()

    # ---- the Engine API ----

    def start(self) -> None:
        if self._process is not None:
            raise RuntimeError("the engine process was already started")
        context = multiprocessing.get_context("spawn")  # never fork a process with threads
        child_commands, commands = context.Pipe(duplex=False)
        events, child_events = context.Pipe(duplex=False)
        for conn in (commands, events):
            _widen(conn)
        process = context.Process(
            target=child_main, args=(self._spec, child_commands, child_events), name="engine", daemon=True
        )
        try:
            process.start()
        finally:
            child_commands.close()  # the child's ends: this process keeps only its own
            child_events.close()
        self._commands, self._events, self._process = commands, events, process
        # Before multiprocessing's own exit hook (atexit runs the last registered first), which
        # would send the child a SIGTERM it ignores and then wait for it without a limit.
        atexit.register(self._stop_at_exit)
        log.info("engine process started (pid %d)", process.pid)
        self._reader = threading.Thread(target=self._read, name="engine-events", daemon=True)
        self._reader.start()
        threading.Thread(target=self._build_vocabulary, name="grammar-vocabulary", daemon=True).start()

    def _build_vocabulary(self) -> None:
        vocabulary, why = grammar.build_vocabulary(self.tokenizer)
        self._vocabulary, self._no_vocabulary = vocabulary, why or self._no_vocabulary
        self._vocabulary_built.set()

    def compile_constraint(self, constraint: Constraint) -> None:
        """Any thread: compiles a grammar as the child will (RequestValidationError: HTTP 400),
        kept here, so that a submit of it after only copies the compiled matcher."""
        if self._info.get("constrained_decoding") is False:  # the child could not build its vocabulary
            raise RequestValidationError("constrained decoding is not available in the engine process",
                                         constraint.field)
        self._vocabulary_built.wait(VOCABULARY_WAIT_S)
        grammar.matcher_for(self._vocabulary, self._no_vocabulary, constraint)

    def wait_ready(self, timeout: float | None = None) -> bool:
        self._settled.wait(timeout)
        return self._stats.state == "ready"

    def stats(self) -> EngineStats:
        stats = self._stats
        if self._is_stopping and stats.state in ("loading", "ready"):
            # From `shutdown` on: the events of requests it ends are those of a stopped engine.
            return dataclasses.replace(stats, state="stopped", requests_rejected_total=self._rejected)
        return dataclasses.replace(stats, requests_rejected_total=self._rejected)

    def info(self) -> dict:
        return dict(self._info)

    def gc_pauses(self) -> GcSnapshot | None:
        """The engine process's cyclic-GC pauses (server/metrics.py exports them); None until
        its first stats message."""
        return self._gc

    def add_observer(self, observer: Callable[[RequestTiming], None]) -> None:
        """`observer(RequestTiming)` is called on this process's reader thread as requests end."""
        self._observers = self._observers + (observer,)

    def submit(self, request: GenerationRequest, *, loop: Any = None) -> RequestStream:
        """Event-loop thread: validates and sends a request, or raises at once (as `Engine.submit`)."""
        loop = loop if loop is not None else asyncio.get_running_loop()
        stats = self.stats()
        if stats.state != "ready":
            raise EngineUnavailableError(unavailable_reason(stats))
        request = with_min_tokens_bans(request, self.tokenizer.eog_ids)
        validate_request(request, vocab_size=int(self.tokenizer.vocab_size), **self._limits)
        if request.constraint is not None:
            self.compile_constraint(request.constraint)
        if not self._capacity.acquire(blocking=False):
            self._rejected += 1
            raise QueueFullError()
        key = next(self._keys)
        stream = RequestStream(request.request_id, key, loop, self._inbox)
        with self._lock:
            if self._is_closed:
                self._capacity.release()
                raise EngineUnavailableError(unavailable_reason(self.stats()))
            self._streams[key] = stream
        try:
            is_sent = self._send(("submit", key, request))
        except BaseException:
            self._forget(key)
            raise
        if not is_sent:
            self._forget(key)
            raise EngineUnavailableError("the engine process is gone")
        return stream

    def shutdown(self, timeout: float | None = None) -> None:
        """Ends every stream (finish "error"), stops the child and waits for it."""
        self._is_stopping = True
        if self._process is None:
            self._stats = dataclasses.replace(self._stats, state="stopped")
            self._settled.set()
            return
        atexit.unregister(self._stop_at_exit)
        self._send(("shutdown", timeout))
        wait = None if timeout is None else timeout + STOP_GRACE_S
        if self._reader is not None:
            self._reader.join(wait)
        if self._join(STOP_GRACE_S) is None:
            log.warning("the engine process did not stop; killing it")
            self._kill_and_join()
        if self._reader is not None:
            self._reader.join(1.0)
        self._end_all("the engine is shutting down", state="stopped")
        self._close_pipes()
        if self._froze_heap:
            gc.unfreeze()  # as the engine thread does when it stops: collectable again

    def _stop_at_exit(self) -> None:
        """At interpreter exit (a server forced out before its shutdown ran): closing the command
        pipe stops the child; it is killed if it has not gone within the grace."""
        if self._process is None or self._join(0) is not None:
            return
        self._is_stopping = True
        self._close_pipes()
        if self._join(2 * STOP_GRACE_S) is None:
            self._kill_and_join()

    def _join(self, timeout: float) -> int | None:
        """The child's exit code once it ended within `timeout`, else None. One thread at a time:
        two threads reaping one child race in waitpid, and the loser reads no exit code."""
        with self._reap_lock:
            self._process.join(timeout)
            return self._process.exitcode

    def _kill_and_join(self) -> None:
        with self._reap_lock:
            if self._process.exitcode is None:
                self._process.kill()  # it ignores SIGTERM (child_main)
            self._process.join(STOP_GRACE_S)

    def _close_pipes(self) -> None:
        for conn in (self._commands, self._events):
            try:
                conn.close()
            except OSError:
                pass

    # ---- this process's side ----

    def slot_action(self, action: str, slot: int, path: str | None = None) -> dict:
        """`Engine.slot_action`, done in the child (which reads or writes the file). Blocks: call
        it from a worker thread."""
        slot_files.check_action(action)
        done: concurrent.futures.Future = concurrent.futures.Future()
        key = next(self._keys)
        with self._lock:
            if self._is_closed or self._stats.state != "ready":
                raise EngineUnavailableError(unavailable_reason(self._stats))
            self._slot_calls[key] = done
        if not self._send(("slot", key, action, slot, path)):
            with self._lock:
                self._slot_calls.pop(key, None)
            raise EngineUnavailableError("the engine process is gone")
        return done.result()  # the reader sets it, or fails it when the child's pipe closes

    def _forget(self, key: int) -> None:
        """A stream whose submit never reached the child: its place back, unless already ended."""
        with self._lock:
            stream = self._streams.pop(key, None)
        if stream is not None:
            self._capacity.release()

    def _send(self, message: tuple) -> bool:
        """Any thread. False when the child's pipe is gone."""
        try:
            with self._send_lock:
                self._commands.send(message)
            return True
        except (OSError, ValueError):  # broken pipe, or closed here
            return False

    def _read(self) -> None:
        """The reader thread: the child's messages until its pipe closes."""
        try:
            while True:
                message = self._events.recv()
                kind = message[0]
                if kind == "events":
                    self._stats = message[2]
                    self._deliver(message[1])
                elif kind == "timing":
                    notify(self._observers, message[1])
                elif kind == "stats":
                    if self._stats.state == "ready":  # a late one never undoes "stopped"
                        self._stats = message[1]
                    self._gc = message[2]
                elif kind == "ready":
                    info = message[1]
                    self._info = info
                    self._limits = {
                        "max_context": int(info["max_context"]),
                        "max_top_logprobs": int(info["max_top_logprobs"]),
                        "max_logit_bias": self.config.max_logit_bias,
                        "scores_prompts": bool(info.get("prompt_logprobs", False)),
                    }
                    self._stats = message[2]  # "ready" only once the limits are set
                    self._settled.set()
                    if self.config.gc_freeze:
                        freeze_heap()  # this process's heap (tokenizer, app); the child froze its own
                        self._froze_heap = True
                elif kind == "failed":
                    stats = message[2] or self._stats
                    self._stats = dataclasses.replace(stats, state="failed", error=message[1])
                    self._settled.set()
                elif kind == "stopped":
                    self._stats = dataclasses.replace(message[1] or self._stats, state="stopped")
                elif kind == "slot_done":
                    if self._stats.state == "ready":  # first: the stats as of the answer
                        self._stats = message[4]
                    with self._lock:
                        done = self._slot_calls.pop(message[1], None)
                    if done is not None and message[3] is not None:
                        done.set_exception(message[3])
                    elif done is not None:
                        done.set_result(message[2])
                else:
                    log.error("unknown message from the engine process: %r", kind)
        except (EOFError, OSError):
            pass
        except Exception:
            log.exception("reading the engine process's messages failed")
        finally:
            if self._is_stopping:
                self._end_all("the engine is shutting down", state="stopped")
            else:
                code = self._join(1.0)
                if self._stats.state in ("loading", "ready"):
                    log.error("the engine process exited unexpectedly (exit code %s)", code)
                self._end_all(f"the engine process exited (exit code {code})", state="failed")

    def _deliver(self, items: list[tuple[int, StreamEvent]]) -> None:
        """Reader thread: a step's events to their streams' loops, one hand-over per loop."""
        by_loop: dict[Any, list[tuple[RequestStream, StreamEvent]]] = {}
        for key, event in items:
            if event.finish_reason is None:
                stream = self._streams.get(key)
            else:
                with self._lock:
                    stream = self._streams.pop(key, None)
                if stream is not None:
                    self._capacity.release()
            if stream is not None:
                by_loop.setdefault(stream._loop, []).append((stream, event))
        for loop, pairs in by_loop.items():
            _hand_over(loop, pairs)

    def _end_all(self, error: str, *, state: str) -> None:
        """No more events will come: every open stream ends, no stream may start."""
        with self._lock:
            self._is_closed = True
            keys = list(self._streams)
            calls, self._slot_calls = self._slot_calls, {}
        for done in calls.values():
            done.set_exception(EngineUnavailableError(error))
        if self._stats.state in ("loading", "ready"):
            self._stats = dataclasses.replace(self._stats, state=state, error=error if state == "failed" else None)
        self._deliver([(key, StreamEvent(finish_reason=FINISH_ERROR, error=error)) for key in keys])
        self._settled.set()


def _widen(conn: Any) -> None:
    """A pipe of PIPE_BYTES (Linux; 64 KiB otherwise), so that a writer seldom waits for its
    reader: the engine thread for this process's reader thread (which shares this process's GIL
    with the event loop), the event loop for the child's command loop (a long prompt's submit)."""
    try:
        fcntl.fcntl(conn.fileno(), F_SETPIPE_SZ, PIPE_BYTES)
    except OSError:  # above /proc/sys/fs/pipe-max-size, or not Linux: the default stays
        pass


class _CancelSender:
    """The parent's streams' inbox: `RequestStream.cancel` puts `_Cancel(key)` here."""

    def __init__(self, owner: EngineProcess) -> None:
        self._owner = owner

    def put(self, command: _Cancel) -> None:
        self._owner._send(("cancel", command.seq))


# ----------------------------------------------------------------------------- the child


class _Outbound:
    """The child's event pipe: one writer at a time (engine thread, command loop, stats thread)."""

    def __init__(self, conn: Any) -> None:
        self._conn = conn
        self._lock = threading.Lock()
        self.is_broken = False

    def send(self, message: tuple) -> bool:
        try:
            with self._lock:
                self._conn.send(message)
            return True
        except (OSError, ValueError):
            if not self.is_broken:
                log.warning("the server process's pipe is gone")
            self.is_broken = True
            return False


class _OpenStreams:
    """The child's streams by key, for cancels; a stream leaves with its final event. The engine
    thread may end a request before the command loop files its stream (a deadline, a shutdown):
    its key is then kept as ended, so that filing it afterwards does not leave it here."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._open: dict[int, RequestStream] = {}
        self._ended: set[int] = set()

    def add(self, key: int, stream: RequestStream) -> None:
        with self._lock:
            if key in self._ended:
                self._ended.discard(key)
            else:
                self._open[key] = stream

    def end(self, key: int) -> None:
        with self._lock:
            if self._open.pop(key, None) is None:
                self._ended.add(key)

    def get(self, key: int) -> RequestStream | None:
        return self._open.get(key)

    def __len__(self) -> int:
        return len(self._open) + len(self._ended)


class _PipeLoop:
    """Stands in for the asyncio loop of the child's streams: what the engine thread hands over
    (`_hand_over`: one call per processed step part) goes to the parent in one message."""

    def __init__(self, out: _Outbound, engine: Engine, streams: _OpenStreams) -> None:
        self._out = out
        self._engine = engine
        self._streams = streams

    def call_soon_threadsafe(self, callback: Any, items: list[tuple[RequestStream, StreamEvent]]) -> None:
        del callback  # the loop's delivery function: the parent delivers
        batch = []
        for stream, event in items:
            batch.append((stream.tag, event))
            if event.finish_reason is not None:
                self._streams.end(stream.tag)
        if not self._out.send(("events", batch, self._engine.stats())):
            raise RuntimeError("the server process is gone")  # _hand_over: the events are dropped


def child_main(spec: EngineSpec, commands: Any, events: Any) -> None:
    """The engine process: builds and runs the engine, then serves the parent's commands. It
    leaves by `os._exit`: the interpreter's finalization with XLA's threads still running
    aborted in C++ ("terminate called after throwing an instance of ''") on the CPU."""
    _exit(_run_child(spec, commands, events))


def _exit(code: int) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _run_child(spec: EngineSpec, commands: Any, events: Any) -> int:
    """`child_main` up to its exit code."""
    # Ctrl-C (SIGINT) and a service manager's SIGTERM reach the whole process group; the parent
    # drains its requests first and then stops this process (or its pipe closes: it died).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=spec.log_level.upper(), format=LOG_FORMAT, stream=sys.stderr)
    if spec.switch_interval_s is not None:
        sys.setswitchinterval(spec.switch_interval_s)
    gc_pauses()  # recorded from the start: the load's collections count too
    out = _Outbound(events)
    loaded = threading.Event()
    watcher = threading.Thread(target=_watch_while_loading, args=(commands, out, loaded), name="engine-load-watch",
                               daemon=True)
    watcher.start()
    try:
        if spec.compile_cache is not None:
            import jax

            jax.config.update("jax_compilation_cache_dir", spec.compile_cache)
            log.info("persistent compilation cache: %s", spec.compile_cache)
        module, _, function = spec.builder.partition(":")
        engine = getattr(importlib.import_module(module), function)(spec.model_path, spec.engine_config)
        engine.add_observer(lambda timing: out.send(("timing", timing)))
        engine.start()
        is_ready = engine.wait_ready()
    except BaseException as exc:  # noqa: BLE001 - whatever it is, the parent must know
        log.exception("building the engine failed")
        out.send(("failed", f"{type(exc).__name__}: {exc}", None))
        return 1
    if not is_ready:
        out.send(("failed", engine.stats().error or "the engine failed during warm-up", engine.stats()))
        engine.shutdown(STOP_GRACE_S)
        return 1
    loaded.set()
    watcher.join()  # from here on the command loop alone reads the pipe
    if not out.send(("ready", engine.info(), engine.stats())):
        engine.shutdown(STOP_GRACE_S)
        return 1
    stop = threading.Event()
    threading.Thread(target=_send_stats, args=(engine, out, stop), name="engine-stats", daemon=True).start()
    timeout = _serve_commands(engine, commands, out)
    engine.shutdown(timeout)
    stop.set()
    out.send(("stopped", engine.stats()))
    log.info("engine process stopped")
    return 0


def _watch_while_loading(commands: Any, out: _Outbound, loaded: threading.Event) -> None:
    """Until the engine is ready the parent sends nothing but "shutdown", and a load or a compile
    cannot be interrupted: a shutdown, or the parent gone, ends this process at once (its device
    memory with it) rather than after the load."""
    while not loaded.is_set():
        try:
            if not commands.poll(0.2):
                continue
            message = commands.recv()
        except (EOFError, OSError):
            log.warning("the server process is gone while the model loads: exiting")
            _exit(1)
        if message[0] == "shutdown":
            log.info("shut down while the model loads: exiting")
            out.send(("stopped", None))
            _exit(0)
        log.error("unexpected command while the model loads: %r", message[0])


def _serve_commands(engine: Engine, commands: Any, out: _Outbound) -> float | None:
    """The child's main thread until "shutdown" or the parent's pipe closes; returns the
    shutdown timeout."""
    streams = _OpenStreams()
    loop = _PipeLoop(out, engine, streams)
    while True:
        try:
            message = commands.recv()
        except (EOFError, OSError):
            log.warning("the server process is gone: stopping the engine")
            return STOP_GRACE_S
        try:
            timeout = _handle_command(engine, message, streams, loop, out)
        except Exception:  # one bad command must not end the process's service
            log.exception("command %r failed in the engine process", message[0])
            continue
        if timeout is not _CONTINUE:
            return timeout


_CONTINUE = object()


def _handle_command(engine: Engine, message: tuple, streams: _OpenStreams, loop: _PipeLoop, out: _Outbound) -> Any:
    """One parent command; returns the shutdown timeout for "shutdown", else `_CONTINUE`."""
    kind = message[0]
    if kind == "submit":
        _, key, request = message
        try:
            stream = engine.submit(request, loop=loop, tag=key)
        except Exception as exc:  # the parent admitted it: a refusal here still ends it
            log.warning("request %s refused in the engine process: %s", request.request_id, exc)
            out.send(("events", [(key, StreamEvent(finish_reason=FINISH_ERROR, error=str(exc)))], engine.stats()))
            return _CONTINUE
        streams.add(key, stream)
    elif kind == "cancel":
        stream = streams.get(message[1])
        if stream is not None:
            stream.cancel()
    elif kind == "shutdown":
        return message[1]
    elif kind == "slot":  # off this thread: it waits for the engine thread and the file
        threading.Thread(target=_slot_action, args=(engine, message, out), name="slot-action", daemon=True).start()
    else:
        log.error("unknown command from the server process: %r", kind)
    return _CONTINUE


def _slot_action(engine: Engine, message: tuple, out: _Outbound) -> None:
    _, key, action, slot, path = message
    try:
        answer, error = engine.slot_action(action, slot, path), None
    except Exception as exc:  # noqa: BLE001 - the caller's to report
        answer, error = None, exc
    try:
        out.send(("slot_done", key, answer, error, engine.stats()))
    except Exception as exc:  # noqa: BLE001 - what does not pickle: its text instead
        what = f"{type(error).__name__}: {error}" if error is not None else f"its answer did not pickle ({exc})"
        out.send(("slot_done", key, None, RuntimeError(f"the slot action failed: {what}"), engine.stats()))


def _send_stats(engine: Engine, out: _Outbound, stop: threading.Event) -> None:
    """Stats between steps (requests waiting, state changes) and this process's GC pauses, when
    they changed."""
    pauses = gc_pauses()
    last = None
    while not stop.wait(STATS_INTERVAL_S):
        current = (engine.stats(), pauses.snapshot())
        if current != last:
            if not out.send(("stats", *current)):
                return
            last = current


def open_engine_process(spec: EngineSpec, gguf_path: str | os.PathLike[str] | None = None) -> EngineProcess:
    """An `EngineProcess` for `spec` with the tokenizer of the GGUF (`gguf_path`, by default the
    spec's model), not started (the caller starts it, as `scheduler.loader.build_engine`'s
    engine). Reads only the file's metadata here."""
    from model.gguf_file import GGUFFile
    from model.tokenizer import Tokenizer

    gguf = GGUFFile(gguf_path if gguf_path is not None else spec.model_path)
    try:
        tokenizer = Tokenizer.from_gguf_metadata(gguf.metadata)
    except ValueError as e:
        raise ValueError(f"{gguf.path}: cannot build the tokenizer: {e}") from e
    return EngineProcess(spec, tokenizer, model_name=gguf.name)
