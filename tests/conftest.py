"""Shared fixtures: real servers started as subprocesses, talked to through the stubs.

The helpers themselves live in ``sglang_admin.client.testing`` (tools import them from there);
they are re-exported here for the tests that import them from ``tests.conftest``.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from sglang_admin.client.testing import (  # noqa: F401  (re-exported for the tests)
    Prestart,
    ServerProc,
    free_port,
    greedy,
    run_generate,
    start_server,
    stop_untaken,
    wait_serving,
    wait_started,
)

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProc]:
    """One worker on the embedded default model, shared by the tests that only read."""
    srv = start_server(tmp_path_factory.mktemp("server"), "--log-requests")
    yield srv
    srv.stop()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """No worker started ahead (Prestart) outlives the run."""
    stop_untaken()
