"""A written checkpoint's weight files, readable as its other files are.

safetensors writes through a temporary file renamed into place, which leaves every
`.safetensors` file owner-only (0600) whatever the umask (safetensors/safetensors#782), while
the config beside it gets the umask's mode. A checkpoint written by one user (an image build,
an admin's shell) and served by another (the stage pods run as uid 10001) then fails to load
its weights alone. So what our writers leave gets the mode any new file gets here.
"""

from __future__ import annotations

import os
from pathlib import Path


def _umask() -> int:
    """This process's umask (read by setting it and putting it back: a restrictive value in between)."""
    mask = os.umask(0o077)
    os.umask(mask)
    return mask


def readable_as_other_files(root: Path) -> None:
    """Each `.safetensors` file under `root` gets a new file's mode (0666 less the umask)."""
    mode = 0o666 & ~_umask()
    for file in root.rglob("*.safetensors"):
        file.chmod(mode)
