"""What every diffusers family's tiny checkpoint writes last: the pipeline directory's
`model_index.json`, which names each part's library and class (as diffusers' own
`save_pretrained` writes it), so that a stage loads only its parts by that index."""

from __future__ import annotations

import json
from pathlib import Path


def write_index(path: Path, pipeline: str, parts: dict[str, tuple[str | None, str | None]]) -> Path:
    """`path`/model_index.json for a `pipeline` (its class name) of `parts` (name -> library,
    class; (None, None): a part the pipeline has none of); returns `path`."""
    import diffusers

    index = {"_class_name": pipeline, "_diffusers_version": diffusers.__version__}
    index |= {name: list(where) for name, where in parts.items()}
    (path / "model_index.json").write_text(json.dumps(index, indent=2))
    return path
