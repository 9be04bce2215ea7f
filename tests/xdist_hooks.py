"""`pytest -n auto` (pytest-xdist, the test extra): how many workers, and which tests go where.

tests/conftest.py takes these hooks in. They are optional: without pytest-xdist (the GPU host)
pytest never calls them and the suite runs in one process. No torch here (dsflow.machine has
none): every worker, and tests/unit/test_workers.py's small suites, import this module.
"""

from __future__ import annotations

import os

import pytest

from dsflow import machine

WORKER_RAM_GB = 6  # a worker's test starts up to 4 CPU ranks of about 1 GB, and a front-end


def gpu_only(markexpr: str) -> bool:
    """Whether `-m markexpr` selects only tests marked cuda: true for any test marked cuda
    (with every other mark), false for any test that is not."""
    if not markexpr:
        return False
    from _pytest.mark.expression import Expression  # pytest's own reading of -m

    expr = Expression.compile(markexpr)
    every_mark = expr.evaluate(lambda mark, **kwargs: True)
    return every_mark and not expr.evaluate(lambda mark, **kwargs: mark != "cuda")


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_auto_num_workers(config):
    """`-n auto`: a worker per core, as many as the RAM holds; none where `-m` selects only
    the cuda tests (one GPU); PYTEST_XDIST_AUTO_NUM_WORKERS, where set, decides as
    pytest-xdist documents."""
    if os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS"):
        return None
    if gpu_only(config.getoption("markexpr") or ""):
        return 0
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    ram = machine.host_memory_bytes()  # a container's limit where it has one
    held = cores if ram is None else int(ram / 1e9 // WORKER_RAM_GB)
    return max(1, min(cores or 1, held))


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """A file's tests on one worker (`--dist loadfile`), so that the module-scoped runs a
    file's tests share (a trained run, a killed one) are made once. pytest-xdist's default,
    `load`, reads as this (an explicit `--dist load` too); any other --dist is kept
    (`--dist worksteal` spreads a file's tests)."""
    if config.getoption("dist") != "load":
        return None
    from xdist.scheduler import LoadFileScheduling

    return LoadFileScheduling(config, log)
