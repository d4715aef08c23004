"""Shared test fixtures. Tests run on the CPU; the real model comes from the user cache that
`python -m server --fetch-model` fills (the README's test command runs it first)."""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import atexit
import contextlib
import pathlib
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import time

import jax
import pytest

# One persistent compilation cache for the whole run, set before any test module compiles: a
# program that several tests build (the same model, engine config and shapes) compiles once.
# It starts empty, as on a fresh CI machine, and is removed at exit. With pytest-xdist
# (`-n 2`) the controller makes it and its workers, which inherit the environment, share it.
_CACHE_ENV = "PALLAS_SERVE_TEST_JAX_CACHE"
if os.environ.get(_CACHE_ENV):
    _COMPILE_CACHE = os.environ[_CACHE_ENV]
else:
    _COMPILE_CACHE = os.environ[_CACHE_ENV] = tempfile.mkdtemp(prefix="pallas-serve-test-jax-cache-")
    atexit.register(shutil.rmtree, _COMPILE_CACHE, ignore_errors=True)
jax.config.update("jax_compilation_cache_dir", _COMPILE_CACHE)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)

from server.default_model import default_model_path

FIXTURES = pathlib.Path(__file__).parent / "fixtures"
MAKE_GGUF = pathlib.Path(__file__).resolve().parents[1] / "bench" / "make_synthetic_gguf.py"


@pytest.fixture(scope="session")
def smollm2_path() -> pathlib.Path:
    path = default_model_path()
    if not path.exists():
        pytest.fail(f"{path} is missing: run `python -m server --fetch-model` first (the README's test command does)")
    return path


@pytest.fixture(scope="session")
def fixtures_dir() -> pathlib.Path:
    return FIXTURES


@pytest.fixture(scope="session")
def tiny_tp_path(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """tiny-tp (8 heads, 4 kv heads, E=256, F=768, V=2048) in q8_0, written once per run by
    bench/make_synthetic_gguf.py (run as a script: nothing imports bench/): it splits over 2 or
    4 devices, and its greedy tokens vary."""
    out = tmp_path_factory.mktemp("tiny-tp") / "tiny-tp-q8_0.gguf"
    subprocess.run([sys.executable, str(MAKE_GGUF), "--shape", "tiny-tp", "--quant", "q8_0", "--out", str(out)],
                   check=True, capture_output=True, text=True, timeout=60)
    return out


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (for servers and coordinators the tests start), drawn below
    the kernel's ephemeral range: a port the kernel handed out could be handed out again, as the
    local end of an outgoing connection (a coordinator client's), before the server binds it."""
    try:
        low = int(pathlib.Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    for _ in range(200):
        port = random.randrange(10000, max(low, 10001))
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:  # nothing free below the range: let the kernel choose
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def running_server(args: list[str], log_path: pathlib.Path, deadline_s: float = 600):
    """`python -m server ARGS` (CPU) on a free port until /health says ready -> its base URL;
    stopped on exit. A server that exits or is not ready in time fails the test with its log."""
    import os

    import httpx

    port = free_port()
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "server", *args, "--port", str(port)],
                                stdout=log, stderr=subprocess.STDOUT, env=env)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + deadline_s
    try:
        while True:
            if proc.poll() is not None:
                pytest.fail(f"server exited with {proc.returncode}:\n{log_path.read_text()[-4000:]}")
            try:
                r = httpx.get(base + "/health", timeout=2)
                if r.status_code == 200:
                    break
                assert r.status_code == 503, r.text  # loading
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"server not ready after {deadline_s} s:\n{log_path.read_text()[-4000:]}")
            time.sleep(0.5)
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
