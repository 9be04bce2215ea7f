"""One writer per project folder (dsflow.lock), and a write the disk refuses as one line naming
the path (dsflow.errors.disk_error, caught once in dsflow.cli)."""

from __future__ import annotations

import errno
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest
import yaml

from conftest import ROOT, dsflow, start
from dsflow import cli, lock
from dsflow import params as params_mod
from dsflow.atomic import atomic_dir
from dsflow.errors import UsageError, disk_error
from dsflow.paths import STAGE_IO

# A stand-in holder: takes a stage's project lock as `python -m dsflow <stage>` does, optionally
# with an atomic_dir temp of its own and checkpoints/.lock, says "held", and keeps them until its
# stdin closes.
HOLD = r"""
import os, sys
from pathlib import Path
from dsflow import lock, params
from dsflow.train.checkpoint import RunLock
stage, temp, run_lock = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
with lock.hold(stage, params.load("params.yaml")):
    if temp:
        Path(f"data/.{temp}.tmp-{os.getpid()}").mkdir(parents=True)
    held = RunLock(Path("checkpoints")).acquire() if run_lock else None
    if held:
        held.write_holder(f"{os.getpid()}, launcher 4243")
    print("held", flush=True)
    sys.stdin.read()
"""
SINCE = r"since \d{4}-\d\d-\d\d \d\d:\d\d:\d\d"


@contextmanager
def holding(repo: Path, stage: str, temp: str = "", run_lock: bool = False):
    """A process that holds `stage`'s project lock in `repo` while the block runs."""
    proc = start(
        [sys.executable, "-c", HOLD, stage, temp, "1" if run_lock else "0"],
        cwd=repo,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout.readline().strip() == "held", "the holder did not take its lock"
        yield proc
    finally:
        if proc.poll() is None:
            proc.stdin.close()
            proc.wait(timeout=60)


@pytest.fixture
def data_repo(prepared, tmp_path) -> Path:
    """A copy of the prepared project (data stages done) that a test may write to."""
    return Path(shutil.copytree(prepared, tmp_path / "repo", symlinks=True))


def _params(repo: Path) -> dict:
    return params_mod.load(str(repo / "params.yaml"))


def test_stage_io_is_what_dvc_yaml_declares():
    stages = yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]
    for name, stage in stages.items():
        reads, writes = STAGE_IO[name]
        data = {d for d in stage.get("deps", []) if not d.startswith("workflow/")}
        outs = stage.get("outs", []) + stage.get("metrics", [])
        assert sorted(map(str, reads)) == sorted(data), name
        assert sorted(map(str, writes)) == sorted(
            next(iter(o)) if isinstance(o, dict) else o for o in outs
        ), name


def test_a_second_shard_run_is_refused_naming_the_holder_and_keeps_its_temp(data_repo):
    repo = data_repo
    log = repo / "logs/shard.log"
    log.write_text("the holder's line\n")
    shards = (repo / "data/shards").stat().st_ino
    with holding(repo, "shard", temp="shards") as holder:
        second = dsflow("shard", cwd=repo, check=False, timeout=120)
        temp = repo / f"data/.shards.tmp-{holder.pid}"
        assert temp.is_dir(), "the refused run deleted the holder's temp"
    assert second.returncode == 2
    (line,) = second.stderr.strip().splitlines()
    assert re.fullmatch(
        rf"dsflow shard: error: data/shards: in use: the shard stage \(PID {holder.pid}, "
        rf"{SINCE}\) writes it; the shard stage writes it: let that run finish \(or stop it\), "
        r"then rerun \(locks in .locks/\)",
        line,
    ), line
    lines = log.read_text().splitlines()  # the holder's log is kept; the line is added
    assert lines[0] == "the holder's line" and lines[-1].endswith(line) and len(lines) == 2
    assert (repo / "data/shards").stat().st_ino == shards


def test_a_reader_and_a_writer_of_data_shards_exclude_each_other(project, monkeypatch):
    monkeypatch.chdir(project)
    params = _params(project)
    with holding(project, "train") as trainer:  # a training reads data/shards and data/tokenizer
        for stage, path in (("shard", "data/shards"), ("tokenizer", "data/tokenizer")):
            with pytest.raises(
                lock.Busy,
                match=rf"^{path}: in use: the train stage \(PID {trainer.pid}, {SINCE}\) reads "
                rf"it; the {stage} stage writes it: ",
            ):
                with lock.hold(stage, params):
                    pass
    with holding(project, "evaluate"):  # reads data/shards, as plan does: both may
        with lock.hold("plan", params):
            pass
    with holding(project, "shard") as sharder:
        proc = dsflow("plan", cwd=project, check=False, timeout=120)
        assert proc.returncode == 2
        assert (
            proc.stderr.strip()
            .splitlines()[-1]
            .startswith(
                f"dsflow plan: error: data/shards: in use: the shard stage (PID {sharder.pid}, since "
            )
        )
        assert "; the plan stage reads it:" in proc.stderr
    with lock.hold("shard", params):  # released at the holder's exit
        pass


def test_the_lock_dies_with_a_killed_holder(project, monkeypatch):
    monkeypatch.chdir(project)
    with holding(project, "shard") as holder:
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=60)
        with lock.hold("shard", _params(project)):
            assert not list(Path(".locks").glob(f"*-{holder.pid}.json"))  # its name forgotten


def test_atomic_dir_keeps_a_live_runs_temp_and_removes_a_dead_ones(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    live = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=-1)
    try:
        for pid in (dead.pid, live.pid):
            (tmp_path / f".out.tmp-{pid}").mkdir()
        with atomic_dir(tmp_path / "out") as tmp:
            (tmp / "a").write_text("a")
        assert (tmp_path / f".out.tmp-{live.pid}").is_dir()
        assert not (tmp_path / f".out.tmp-{dead.pid}").exists()
    finally:
        live.communicate()


def test_a_stage_fails_when_its_input_is_replaced_or_deleted_under_it(data_repo, monkeypatch):
    monkeypatch.chdir(data_repo)
    params = _params(data_repo)
    with pytest.raises(UsageError, match=r"^data/shards: replaced while the plan stage ran"):
        with lock.hold("plan", params):
            shutil.copytree("data/shards", "data/rebuilt")
            shutil.rmtree("data/shards")
            os.rename("data/rebuilt", "data/shards")
    with pytest.raises(UsageError, match=r"^data/pretrained.json: deleted while the plan stage"):
        with lock.hold("plan", params):
            os.unlink("data/pretrained.json")
    with lock.hold("plan", params):  # untouched: no complaint
        pass


def test_only_the_node_that_prepares_checkpoints_holds_the_train_outputs(monkeypatch):
    monkeypatch.delenv("DSFLOW_NODE_TASK", raising=False)
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    params = params_mod.load(str(ROOT / "params.yaml"))
    reads, writes = STAGE_IO["train"]
    for node, expect in ((0, writes), (1, ())):
        train = {**params["train"], "nodes": 2, "node_rank": node}
        assert lock.stage_paths("train", {**params, "train": train}) == (reads, expect)
    monkeypatch.setenv("DSFLOW_NODE_TASK", "1")  # started by the stage that holds them
    train = {**params["train"], "nodes": 2, "node_rank": 0}
    assert lock.stage_paths("train", {**params, "train": train}) == (reads, ())


def test_a_second_train_run_is_refused_by_checkpoints_lock_once_the_first_holds_it(
    project, monkeypatch, capsys
):
    monkeypatch.chdir(project)
    monkeypatch.delenv("DSFLOW_CONFIG", raising=False)
    with holding(project, "train", run_lock=True) as first:
        assert cli.main(["train"]) == 2
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert "checkpoints/.lock is held by another train run" in line
    assert f"(PID {first.pid}, launcher 4243)" in line
    with holding(project, "train") as first:  # still planning: no checkpoints/.lock yet
        assert cli.main(["train"]) == 2
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert f"in use: the train stage (PID {first.pid}, since " in line


@pytest.mark.parametrize("code", ["EFBIG", "EDQUOT", "EIO", "ENOSPC"])
def test_a_refused_write_is_one_line_naming_the_output(data_repo, monkeypatch, capsys, code):
    monkeypatch.chdir(data_repo)
    monkeypatch.delenv("DSFLOW_CONFIG", raising=False)
    monkeypatch.setenv("DSFLOW_FAULT_WRITE", f"shards:{code}")
    before = sorted(p.name for p in Path("data").iterdir())
    shard = Path("data/shards/train/shard_00000.bin").read_bytes()
    assert cli.main(["shard"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()[-1:]
    number = getattr(errno, code)
    assert line == f"dsflow shard: error: {disk_error(OSError(number, 'x', 'data/shards'))}"
    assert line.startswith("dsflow shard: error: data/shards: ") and f"({code}), then rerun" in line
    assert Path("logs/shard.log").read_text().splitlines()[-1].endswith(line)
    # nothing half-written: the old output stays, no temp is left
    assert sorted(p.name for p in Path("data").iterdir()) == before
    assert Path("data/shards/train/shard_00000.bin").read_bytes() == shard


def test_a_real_file_size_limit_is_one_line_naming_the_output(data_repo):
    def limit():
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))

    proc = dsflow(
        "shard",
        cwd=data_repo,
        check=False,
        env={"PYTHONDONTWRITEBYTECODE": "1"},
        preexec_fn=limit,
        timeout=300,
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    (line,) = proc.stderr.strip().splitlines()[-1:]
    # numpy's tofile, which writes the shards, reports the short write without its errno (EFBIG)
    assert re.fullmatch(
        r"dsflow shard: error: data/shards: a write was cut short \(\d+ requested and \d+ "
        r"written\): the disk is full, .* past a file size limit \(`ulimit -f`\); .*, then rerun",
        line,
    ), line
    assert (data_repo / "logs/shard.log").read_text().splitlines()[-1].endswith(line)
    assert not list((data_repo / "data").glob(".shards.tmp-*"))


def test_a_bug_keeps_its_traceback(tmp_path):
    assert disk_error(FileNotFoundError(errno.ENOENT, "No such file", "x")) is None
    assert disk_error(OSError(errno.ENOSPC, "No space left on device")) is None  # no path
    assert disk_error(ValueError("bug")) is None
    assert disk_error(OSError("a message")) is None
    with pytest.raises(OSError) as caught, atomic_dir(tmp_path / "out") as tmp:
        raise OSError(errno.EIO, "Input/output error", str(tmp / "train/a.bin"))
    assert caught.value.filename == str(tmp_path / "out/train/a.bin")  # the output's path
    assert not list(tmp_path.iterdir())
