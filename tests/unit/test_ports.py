"""The ports `free_port` hands out for servers that must be told theirs (omni_cli.ports)."""

from __future__ import annotations

import multiprocessing as mp
from concurrent.futures import ProcessPoolExecutor

from omni_cli.ports import free_port

PICKS = 300
"""Drawn at random from the roughly 18,000 ports it uses, 300 picks repeat one almost surely
(the birthday bound: about 2.4 pairs expected), two callers' 600 still more so."""


def picks(n: int) -> list[int]:
    return [free_port() for _ in range(n)]


def test_a_port_is_handed_out_once_across_processes() -> None:
    """Two processes picking at once never get the same port, nor either one twice: each
    port is leased on the machine, not just free at the moment of the pick (a LocalMooncake's
    store server binds its port seconds after the pick; CI's run of 2026-12-07 lost a
    mooncake_master at its start)."""
    with ProcessPoolExecutor(2, mp_context=mp.get_context("forkserver")) as pool:
        got = [p for ports in pool.map(picks, [PICKS, PICKS]) for p in ports]
    assert len(set(got)) == len(got) == 2 * PICKS
