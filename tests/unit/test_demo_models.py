"""`omni models init-demo`: in `make serve`'s set-up, which installs no torchvision, a family whose
tiny checkpoint needs a package missing there is left out by name, not the whole set-up failed
(Qwen-Image-Edit's Qwen2-VL processor has a video part that is torchvision's only); and what it
writes is readable by whoever may read its other files."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

from omni_stage.engines.registry import DIFFUSERS_FAMILIES, FAMILIES
from tests.helpers import weights_readable_as_their_configs

EVERY = (*FAMILIES.values(), *DIFFUSERS_FAMILIES.values())


def test_without_torchvision_only_qwen_image_edit_is_left_out() -> None:
    """In a Python where `import torchvision` fails (its sys.modules entry None, as where it is
    not installed), the image-edit family is the one that names it; here nothing is missing."""
    code = (
        "import sys; sys.modules['torchvision'] = None\n"
        "from omni_stage.engines.registry import DIFFUSERS_FAMILIES, FAMILIES\n"
        "print({f.demo: f.missing() for f in (*FAMILIES.values(), *DIFFUSERS_FAMILIES.values())})\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    missing = ast.literal_eval(out.stdout.strip().splitlines()[-1])
    assert missing == {f.demo: ["torchvision"] if f.demo == "image-edit" else [] for f in EVERY}
    assert all(f.missing() == [] for f in EVERY)


def test_the_demo_weights_are_readable_as_their_configs(demo_dir: Path) -> None:
    """As any file written here: a demo built by one user (an image's build, as root) and served by
    another (the stage pods' uid) loads."""
    models = list((demo_dir / "models").glob("tiny-*"))  # (other tests keep their files beside)
    assert len(models) >= 7 and all(weights_readable_as_their_configs(d) for d in models)
