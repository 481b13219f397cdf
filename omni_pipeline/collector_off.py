"""The cyclic garbage collector off, on import: named first in a fork server's preload
(`lifecycle.preload`), and loaded by pytest as a plugin before the tests import anything
(pyproject.toml's `addopts`). Importing torch and transformers makes some 400k objects that live
as long as the process; with the collector on, it walks them again and again as they are made,
a fifth of the import's CPU (1.6 s of 7.5 here), in every `omni serve` and every pytest worker.
Whoever imported with it off turns it back on once those objects are frozen out of its sight:
each child of the fork server (`lifecycle.settle_forked_child`), pytest once it has collected
the tests (tests/conftest.py)."""

import gc

gc.disable()
