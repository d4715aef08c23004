"""Server tests run in-process: httpx's ASGI transport against an app holding a `FakeEngine`."""

from __future__ import annotations

from typing import AsyncIterator

import httpx
import pytest
from starlette.applications import Starlette

from tests.server.fakes import FakeEngine, client_for, make_app


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
def engine() -> FakeEngine:
    return FakeEngine()


@pytest.fixture
def app(engine: FakeEngine) -> Starlette:
    return make_app(engine)


@pytest.fixture
async def client(app: Starlette) -> AsyncIterator[httpx.AsyncClient]:
    async with client_for(app) as c:
        yield c
