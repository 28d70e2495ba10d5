"""deepcomm's logger ("deepcomm", Python's logging); what a new Buffer reports through it is buffer_report.py.

``DEEPCOMM_LOG=info`` (or ``debug``, ``warning``, ``error``) attaches a stderr handler to the "deepcomm" logger at
that level. Without it deepcomm adds no handler: configure the logger as any other (``logging.getLogger("deepcomm")``).
"""
from __future__ import annotations

import logging
import os

LOG_ENV = "DEEPCOMM_LOG"
LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}

logger = logging.getLogger("deepcomm")
_handler = None  # the handler DEEPCOMM_LOG attached, kept so that a second call does not add another


def configure_from_env() -> None:
    """Apply ``$DEEPCOMM_LOG`` (trimmed, any case; empty: leave the logger alone). ``ValueError`` names the
    variable when its value is not a level."""
    global _handler
    value = os.environ.get(LOG_ENV, "").strip().lower()
    if not value:
        return
    if value not in LEVELS:
        raise ValueError(f"{LOG_ENV}: expected one of {', '.join(LEVELS)}, got {os.environ[LOG_ENV]!r}")
    if _handler is None:
        _handler = logging.StreamHandler()
        _handler.setFormatter(logging.Formatter("[deepcomm %(levelname)s] %(message)s"))
        logger.addHandler(_handler)
    logger.setLevel(LEVELS[value])
