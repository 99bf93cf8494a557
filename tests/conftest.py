"""Shared fixtures: real servers started as subprocesses, talked to through the stubs.

The helpers themselves live in ``sglang_admin.client.testing`` (tools import them from there);
they are re-exported here for the tests that import them from ``tests.conftest``.
"""

from __future__ import annotations

import os

from sglang_admin.constants import RANK_OPENMP_DEFAULTS

# OpenMP threads that sleep as soon as they wait, in the test process (transformers'
# references, the unit tests' runners): on the loaded 2-core machine any spinning costs the
# cores that the test process, the servers and the ranks share. 32 greedy transformers calls
# on a tiny model took 10 s of CPU on 2 threads with libgomp's default wait, 1.7 s with the
# ranks' short spin, 0.6 s sleeping; the unit tests 130-146 s against 50 s. Read by the
# OpenMP runtime when torch is imported (the test modules import it at collection), so set
# here and taken back once collection is done (pytest_collection_finish): the workers and
# processes the tests start get the environment they would get without it (the ranks their
# own RANK_OPENMP_DEFAULTS, which test_rank_openmp.py checks). A variable the user set wins.
_PASSIVE_HERE = not any(name in os.environ for name in RANK_OPENMP_DEFAULTS)
if _PASSIVE_HERE:
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"

from collections.abc import Iterator  # noqa: E402
from pathlib import Path  # noqa: E402

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


def pytest_configure(config: pytest.Config) -> None:
    """The ``long`` marker; under xdist, the workers' OpenMP setting; and with
    ``SGLANG_ADMIN_TEST_COST=file.json``, each module's wall and CPU seconds recorded
    (tests/cost.py; docs/test-suite-cost.md quotes them)."""
    config.addinivalue_line(
        "markers", "long: a soak, fuzz or benchmark-style run of fixed length; `make test` "
        "leaves it to `make test-long` (docs/test-suite-cost.md)")
    path = os.environ.get("SGLANG_ADMIN_TEST_COST")
    controller = _parallel(config) and not getattr(config, "workerinput", None)
    if controller and _PASSIVE_HERE:
        # xdist's workers inherit this process's environment: each sets (and takes back)
        # its own OpenMP setting, as one process does (see the top of this file)
        os.environ.pop("OMP_WAIT_POLICY", None)
    if path and not controller:  # an xdist controller runs no test: its workers record
        from tests.cost import CostRecorder

        config.pluginmanager.register(CostRecorder(Path(path)), "sglang-admin-cost")


def _session_worker_args(name: str, tmp: Path) -> list[str]:
    """The flags of the session's shared workers (the fixtures below), by fixture name."""
    if name == "server":
        (tmp / "profiles").mkdir(exist_ok=True)
        return ["--log-requests", "--profile-dir", str(tmp / "profiles")]
    if name == "dp2_server":
        return ["--dp-size", "2", "--profile-dir", str(tmp / "profiles"), "--log-requests",
                "--watchdog-probe-timeout", "120", "--enable-metrics"]
    if name == "small_server":
        return ["--max-running-requests", "2"]
    raise KeyError(name)


SESSION_WORKERS = ("server", "dp2_server", "small_server")
_BOOTING: dict[str, ServerProc] = {}  # started during collection, not yet taken


def _session_worker(name: str, factory: pytest.TempPathFactory) -> ServerProc:
    """The shared worker ``name``, SERVING: the one booted during collection, or a new one."""
    srv = _BOOTING.pop(name, None)
    if srv is None:
        tmp = factory.mktemp(name)
        srv = start_server(tmp, *_session_worker_args(name, tmp), wait=False)
    wait_started(srv)
    return srv


def _runs_the_integration_tests(config: pytest.Config) -> bool:
    """The run's paths hold all of tests/integration (the whole suite, ``tests``, or
    ``tests/integration`` itself), not a few files or tests of it."""
    integration = ROOT / "tests" / "integration"
    for arg in config.args:
        path = Path(arg.split("::")[0])
        path = (path if path.is_absolute() else Path(config.invocation_params.dir) / path)
        if path.resolve() in (integration, *integration.parents):
            return True
    return False


def _parallel(config: pytest.Config) -> bool:
    """A pytest-xdist run (``-n N``): the controller runs no test, and each of its workers
    gets only some modules, so none boots the shared workers ahead: a worker starts the
    ones its tests take, when they take them."""
    return bool(getattr(config, "workerinput", None)) or bool(
        getattr(config.option, "numprocesses", None))


def pytest_sessionstart(session: pytest.Session) -> None:
    """A run of the integration tests boots the session's shared workers while the test
    modules are collected (one core for ~15-30 s, importing torch, transformers and the
    tests): a worker's start (~3 s of CPU at dp 1, ~6 at dp 2) then costs the run little
    wall time. pytest_collection_finish stops those that no selected test uses."""
    if not _runs_the_integration_tests(session.config) or _parallel(session.config):
        return
    factory: pytest.TempPathFactory = session.config._tmp_path_factory  # the tmpdir plugin's
    # the workers get the environment they would get after collection: without this
    # process's OpenMP setting (see the top of this file; test_rank_openmp.py checks it)
    passive = os.environ.pop("OMP_WAIT_POLICY", None) if _PASSIVE_HERE else None
    try:
        for name in SESSION_WORKERS:
            tmp = factory.mktemp(name)
            _BOOTING[name] = start_server(tmp, *_session_worker_args(name, tmp), wait=False)
    finally:
        if passive is not None:
            os.environ["OMP_WAIT_POLICY"] = passive


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProc]:
    """One worker on the embedded default model, shared by the tests that only read (and
    by those that profile it: each into its own directory under :func:`server_profiles`);
    ``--log-requests``."""
    srv = _session_worker("server", tmp_path_factory)
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def server_profiles(server: ServerProc) -> Path:
    """The session ``server``'s --profile-dir: profiles may be written under it only."""
    return Path(server.extra_args[server.extra_args.index("--profile-dir") + 1])


@pytest.fixture(scope="session")
def dp2_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProc]:
    """One ``--dp-size 2`` worker (embedded model, --profile-dir, --log-requests,
    --enable-metrics), shared by the modules that need two ranks and no other flag (admin
    ops, bad input, fuzz, profiles, rank isolation, the CLI, the served-benchmark client):
    each leaves it as it found it (no profile running, nothing in flight, every rank up).
    ``--watchdog-probe-timeout 120``: test_admin.py stops a rank for a few seconds, and it
    must come back to a live server on a loaded machine."""
    srv = _session_worker("dp2_server", tmp_path_factory)
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def small_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProc]:
    """One worker with ``--max-running-requests 2`` (a third request queues), shared by
    test_faults.py's client and deadline tests and test_slow_readers.py's preemption test;
    each leaves it idle (nothing running, no KV held)."""
    srv = _session_worker("small_server", tmp_path_factory)
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def dp2_profiles(dp2_server: ServerProc) -> Path:
    """The session ``dp2_server``'s --profile-dir (created by its first profile)."""
    return Path(dp2_server.extra_args[dp2_server.extra_args.index("--profile-dir") + 1])


# The modules that take the longest (wall seconds in the one-process run of
# docs/test-suite-cost.md, most first; the long tests aside). Run on several processes,
# they start first, so that no process is left alone with one of them at the end while the
# other has nothing to do.
LONGEST_MODULES = (
    "test_tensor_parallel.py", "test_weight_sync.py", "test_gguf.py", "test_speculative.py",
    "test_metrics.py", "test_gpu_check.py", "test_http_sidecar.py", "test_embed.py",
    "test_lora.py", "test_faults.py",
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """On several processes (xdist), the longest modules first (each module's tests keep
    their order); one process keeps pytest's order."""
    if not _parallel(config):
        return
    first = {name: i for i, name in enumerate(LONGEST_MODULES)}
    items.sort(key=lambda item: first.get(item.path.name, len(first)))


def pytest_collection_finish(session: pytest.Session) -> None:
    """The test process's OpenMP setting stays in this process (see the top of this file);
    a shared worker booted during collection that no selected test uses is stopped."""
    if _PASSIVE_HERE:
        os.environ.pop("OMP_WAIT_POLICY", None)
    used = {name for item in session.items for name in getattr(item, "fixturenames", ())}
    for name in [n for n in _BOOTING if n not in used]:
        _BOOTING.pop(name).stop()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """No worker started ahead (Prestart, or booted during collection) outlives the run."""
    stop_untaken()
    while _BOOTING:
        _BOOTING.popitem()[1].stop()
