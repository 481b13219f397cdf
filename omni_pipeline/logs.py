"""One log format for every omni process; the level comes from OMNI_LOG_LEVEL (default INFO)."""

from __future__ import annotations

import logging
import os


def configure_logging() -> None:
    logging.basicConfig(
        level=os.environ.get("OMNI_LOG_LEVEL", "INFO").upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
