"""A served rank process runs with the OpenMP and malloc settings the launcher gives it."""

from __future__ import annotations

import os

from sglang_admin.client.testing import ServerProc
from sglang_admin.constants import (
    RANK_OPENMP_DEFAULTS,
    rank_memory_environment,
    rank_openmp_environment,
)
from sglang_admin.pb import common_pb2 as pb


def test_rank_processes_start_with_the_spin_setting(server: ServerProc) -> None:
    info = server.stub().GetServerInfo(pb.GetServerInfoRequest(), timeout=10)
    pids = [s.pid for s in info.rank_states]
    assert pids
    # the worker inherits this process's environment; a user's own setting would win
    expected = rank_openmp_environment(dict(os.environ))
    want = {k: expected.get(k) for k in RANK_OPENMP_DEFAULTS}
    for pid in pids:
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = dict(item.decode().split("=", 1) for item in f.read().split(b"\0") if b"=" in item)
        assert {k: env.get(k) for k in RANK_OPENMP_DEFAULTS} == want, pid
        # and glibc's huge-page tunable (the user's own GLIBC_TUNABLES kept)
        tunables = rank_memory_environment(dict(os.environ))["GLIBC_TUNABLES"]
        assert env.get("GLIBC_TUNABLES") == tunables, pid
