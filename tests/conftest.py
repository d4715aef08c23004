"""Shared test fixtures. Tests run on the CPU; the real model comes from the user cache that
`python -m server --fetch-model` fills (the README's test command runs it first)."""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import pathlib

import pytest

from server.default_model import default_model_path

FIXTURES = pathlib.Path(__file__).parent / "fixtures"


@pytest.fixture(scope="session")
def smollm2_path() -> pathlib.Path:
    path = default_model_path()
    if not path.exists():
        pytest.fail(f"{path} is missing: run `python -m server --fetch-model` first (the README's test command does)")
    return path


@pytest.fixture(scope="session")
def fixtures_dir() -> pathlib.Path:
    return FIXTURES
