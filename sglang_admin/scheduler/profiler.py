"""torch.profiler sessions of one rank (completed by the admin-surface work)."""

from __future__ import annotations

from typing import Any


class Profiler:
    """Not yet able to profile: the server answers UNIMPLEMENTED for the profile RPCs."""

    def __init__(self, rank: int, device: str) -> None:
        self.rank = rank
        self.device = device
        self.state = "idle"

    @property
    def needs_ticks(self) -> bool:
        return False

    def start(self, req: Any) -> tuple[bool, str]:
        return False, "profiling is not implemented yet"

    def stop(self) -> tuple[bool, str, list[str]]:
        return False, "profiling is not implemented yet", []

    def before_step(self, stage: str) -> None:
        pass

    def after_step(self, stage: str) -> Any:
        return None
