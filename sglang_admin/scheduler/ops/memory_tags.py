"""Which memory tags a release or resume may act on: the refusals of SGLang's
release_memory_occupation / resume_memory_occupation misuse, decided before anything moves.

A release of a tag that is already released, or a resume of a tag that is not released,
is refused as a whole (no tag of the call is acted on), so the caller's view of what is
released stays the rank's.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from sglang_admin.constants import MEMORY_TAGS


def release_refusal(released: Collection[str], tags: Sequence[str]) -> str | None:
    """Why releasing ``tags`` is refused when ``released`` are released now (None: it is not)."""
    again = [tag for tag in tags if tag in released]
    if not again:
        return None
    verb = "is" if len(again) == 1 else "are"
    return f"{', '.join(again)} {verb} already released; resume it before releasing it again"


def resume_refusal(released: Collection[str], tags: Sequence[str]) -> str | None:
    """Why resuming ``tags`` is refused when ``released`` are released now (None: it is not)."""
    held = [tag for tag in tags if tag not in released]
    if not held:
        return None
    verb = "is" if len(held) == 1 else "are"
    now = ", ".join(tag for tag in MEMORY_TAGS if tag in released) or "nothing"
    return f"{', '.join(held)} {verb} not currently released (released now: {now})"
