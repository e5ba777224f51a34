"""Fixtures of the family tests (`loop` and `tokenizer` are the suite's): `one_thread` for modules of tiny attention
models (`pytestmark = pytest.mark.usefixtures("one_thread")`).

A tiny attention model's operations are microseconds long: a second thread saves nothing, and while other work keeps
the CPU's cores busy two threads spin against each other (a tiny Llama's `generate` took 0.8 s against 0.012 s on one
thread). The recurrent hybrids' sequential scans do use two (Falcon-H1's test: 20 s on two, 30 s on one), so it is
not for every module."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(scope="module")
def one_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
