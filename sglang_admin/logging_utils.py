"""Logging set-up shared by the server and the scheduler processes."""

from __future__ import annotations

import logging
import sys


def setup_logging(level: str, prefix: str = "server") -> None:
    """One line per record: time, process role, level, logger, message."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        logging.Formatter(f"%(asctime)s [{prefix}] %(levelname)s %(name)s: %(message)s")
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
