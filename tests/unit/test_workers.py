"""`pytest -n auto`: the suite's workers, as tests/xdist_hooks.py chooses them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import xdist_hooks

pytest.importorskip("xdist")

# A suite of two files of three tests each; every test notes its file, its worker and how many
# workers there are.
NOTE = """
import json, os, pathlib
def note(name):
    env = os.environ
    line = json.dumps([__name__, env.get("PYTEST_XDIST_WORKER", "main"), env.get("PYTEST_XDIST_WORKER_COUNT")])
    with open(pathlib.Path(__file__).parent / "notes.jsonl", "a") as f:
        f.write(line + "\\n")
def test_a(): note("a")
def test_b(): note("b")
def test_c(): note("c")
"""
# The suite's conftest takes the hooks in as tests/conftest.py does.
HOOKS = f"""
import sys
sys.path.insert(0, {str(Path(xdist_hooks.__file__).parent)!r})
from xdist_hooks import pytest_xdist_auto_num_workers, pytest_xdist_make_scheduler
"""


def suite(tmp_path: Path, *args: str) -> tuple[subprocess.CompletedProcess, list]:
    for name in ("test_one.py", "test_two.py"):
        (tmp_path / name).write_text(NOTE)
    (tmp_path / "conftest.py").write_text(HOOKS)
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
    env.pop("PYTEST_XDIST_AUTO_NUM_WORKERS", None)
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "xdist", *args]
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    notes = tmp_path / "notes.jsonl"
    return proc, [json.loads(line) for line in notes.read_text().splitlines()]


def test_under_n_a_files_tests_share_one_worker(tmp_path):
    """Each file's module-scoped runs are made once: its tests all go to one worker."""
    _, notes = suite(tmp_path, "-n", "2")
    assert len(notes) == 6
    workers = {module: {w for m, w, _ in notes if m == module} for module, _, _ in notes}
    assert set(workers) == {"test_one", "test_two"}
    assert all(len(w) == 1 and w != {"main"} for w in workers.values()), workers


def test_an_asked_for_dist_mode_is_kept(tmp_path):
    _, notes = suite(tmp_path, "-n", "2", "--dist", "each")
    assert len(notes) == 12  # every test on each of the two workers


def test_auto_is_a_worker_per_core_that_the_ram_holds_and_none_for_cuda(monkeypatch):
    monkeypatch.delenv("PYTEST_XDIST_AUTO_NUM_WORKERS", raising=False)

    def machine(cores: int, ram_gb: float | None) -> None:
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cores)), raising=False)
        ram = None if ram_gb is None else int(ram_gb * 1e9)
        monkeypatch.setattr(xdist_hooks.machine, "host_memory_bytes", lambda: ram)

    def workers(markexpr: str = "") -> int | None:
        options = {"markexpr": markexpr}
        return xdist_hooks.pytest_xdist_auto_num_workers(SimpleNamespace(getoption=options.get))

    machine(cores=2, ram_gb=24)
    assert workers() == 2
    assert workers("cuda") == 0 and workers("cuda and slow") == 0  # only GPU tests: one GPU
    assert workers("not cuda") == 2 and workers("slow") == 2 and workers("cuda or slow") == 2
    machine(cores=64, ram_gb=24)
    assert workers() == 24 // xdist_hooks.WORKER_RAM_GB
    machine(cores=8, ram_gb=4)
    assert workers() == 1
    machine(cores=3, ram_gb=None)  # RAM unknown: the cores decide
    assert workers() == 3
    monkeypatch.setenv("PYTEST_XDIST_AUTO_NUM_WORKERS", "3")
    assert workers() is None  # pytest-xdist's own hook reads it


def test_auto_on_the_command_line_starts_the_chosen_workers(tmp_path, monkeypatch):
    monkeypatch.delenv("PYTEST_XDIST_AUTO_NUM_WORKERS", raising=False)
    _, notes = suite(tmp_path, "-n", "auto", "--maxprocesses", "2")
    want = min(2, xdist_hooks.pytest_xdist_auto_num_workers(SimpleNamespace(getoption={}.get)))
    assert len(notes) == 6 and {count for _, _, count in notes} == {str(want)}
