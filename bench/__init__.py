"""Benchmarks: each measures our path and a baseline in the same run and reports ratios.

Run one as `python -m bench.<name> [--json]` from the repository root; the JSON object is
the last line printed. Results go into docs/benchmarks.md. Never assert timings in tests.
"""
