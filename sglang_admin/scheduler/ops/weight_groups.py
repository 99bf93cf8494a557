"""A rank's weight-update groups (joined from a trainer) and the one thread that blocks
on them; the handlers are in scheduler/ops/weight_sync_control.py."""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor

from sglang_admin.model.dist_group import WeightGroup

logger = logging.getLogger(__name__)


class WeightGroups:
    """This rank's weight-update groups and the thread that blocks on them."""

    def __init__(self) -> None:
        self.groups: dict[str, WeightGroup] = {}
        self.joining: set[str] = set()
        self.receiving: str | None = None  # the group a receive is writing the weights from
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="weight-sync")

    def busy(self) -> str | None:
        """Why another weight op must not run now (a receive writes the parameters)."""
        if self.receiving is None:
            return None
        return (f"weights are being received from group {self.receiving!r} "
                "(UpdateWeightsFromDistributed in progress); retry when it ends")

    def drop_buffers(self) -> None:
        """Free every group's receive buffer (memory release)."""
        for group in self.groups.values():
            group.drop_scratch()

    def close(self) -> None:
        """Leave every group (at shutdown); a receive still blocked on one then fails
        instead of holding the process's exit."""
        for group in list(self.groups.values()):
            try:
                group.destroy()
            except Exception as exc:  # noqa: BLE001 - shutting down: log and go on
                logger.warning("destroying weight group %s: %s", group.name, exc)
        self.groups.clear()
        self.pool.shutdown(wait=False, cancel_futures=True)
