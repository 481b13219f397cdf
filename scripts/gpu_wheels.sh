#!/usr/bin/env bash
# The wheels a lent GPU machine lacks for scripts/gpu_bench.py, scripts/gpu_graphs.py and
# `omni bench step --sizes full` (its image has torch and transformers 5.17 but no network),
# downloaded into .whl/ (git-ignored) for the device tool to carry. There, before the scripts:
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
#   export PYTHONPATH=/tmp/site:.:services/stage_worker
# (docs/development.md, GPU runs). The versions are this checkout's .venv's.
set -euo pipefail
cd "$(dirname "$0")/.."
py=.venv/bin/python
version() { "$py" -c "import importlib.metadata as m; print(m.version('$1'))"; }
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64; do
  platforms+=(--platform "$p")
done
for pkg in transformers pydantic pydantic-core annotated-types typing-inspection typing-extensions msgspec soxr regex; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${platforms[@]}" -d .whl "$pkg==$(version "$pkg")"
done
du -sh .whl
