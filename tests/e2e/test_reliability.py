"""Faults, kills and bad input lose nothing (docs/reliability.md): every test injects one fault.

The training faults run as one chain on one run directory, each phase a rerun of the last:
a rank SIGKILLed inside a step, a kill in the middle of a checkpoint save, a full disk while
saving, a persistently NaN loss, SIGTERM to the stage (and a second run bumping into the lock);
the last rerun must end exactly where an uninterrupted run (`baseline`) ends. Each phase also
checks that the steps it trained match the baseline's, so a fault that corrupted anything would
show at the phase that caused it.
"""

from __future__ import annotations

import datetime
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import psutil
import pytest
import yaml
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from conftest import ROOT, dsflow, start, start_stage, tiny_run, update_params, wait_for
from conftest import run as run_command
from dsflow import dsconfig
from dsflow import params as params_mod
from dsflow.errors import UsageError
from dsflow.train import checkpoint as ckpt

TRAIN = tiny_run(
    3, 12, seq_len=64, micro_batch=1,
    grad_accum=2,  # so that a rank can die between two micro-steps of one step
    global_batch=None, eval_every=6, eval_batches=2, checkpoint_every=3, keep_checkpoints=2,
    max_bad_steps=10, optimizer={"lr": 0.003},
    # Constant after warmup, so the schedule does not depend on max_steps (the SIGTERM phase
    # runs with a large budget).
    schedule={"kind": "warmup", "warmup_steps": 2},
)  # fmt: skip
TIMEOUT = 300  # no training run here may take longer: a hang fails the test instead


def train_copy(prepared: Path, dest: Path) -> Path:
    shutil.copytree(
        prepared, dest, ignore=shutil.ignore_patterns("checkpoints", "models", "dvclive", "metrics")
    )
    update_params(dest, TRAIN)
    return dest


def train(repo: Path, env: dict | None = None) -> SimpleNamespace:
    t0 = time.time()
    proc = dsflow("train", cwd=repo, env=env or {}, check=False, timeout=TIMEOUT)
    return SimpleNamespace(
        proc=proc,
        wall=time.time() - t0,
        done=time.time(),
        **snapshot(repo),
        ranks=alive_ranks(repo),
    )


def snapshot(repo: Path) -> dict:
    """What later phases will change: the checkpoint directory and the logged curves."""
    root = repo / "checkpoints"
    latest = (root / "latest").read_text().strip() if (root / "latest").exists() else None
    return {
        "latest": latest,
        "entries": sorted(p.name for p in root.iterdir()) if root.exists() else [],
        "loss": curve(repo),
        "skipped": curve(repo, "train/skipped_steps"),
        "step_s": curve(repo, "perf/step_s"),
    }


def curve(repo: Path, name: str = "train/loss") -> dict[int, float]:
    tsv = repo / f"dvclive/plots/metrics/{name}.tsv"
    if not tsv.exists():
        return {}
    rows = tsv.read_text().splitlines()[1:]
    return {int(r.split("\t")[0]): float(r.split("\t")[1]) for r in rows}


def alive_ranks(repo: Path) -> list[int]:
    """PIDs of training ranks still running in `repo` (there must be none once the stage exits)."""
    pids = []
    for p in psutil.process_iter(["cmdline"]):
        try:
            if "dsflow.train.loop" in " ".join(p.info["cmdline"] or []) and p.cwd() == str(repo):
                pids.append(p.pid)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return pids


def last_line(proc) -> str:
    return proc.stderr.strip().splitlines()[-1]


def assert_out_of_space(run, tag: str, kept: str) -> str:
    """The run ended in the one line of a save that found the disk full, `kept` the newest."""
    assert run.proc.returncode == 2
    line = last_line(run.proc)
    assert line.startswith(
        f"dsflow train: error: no space left on device while saving checkpoint {tag}"
    ), run.proc.stderr[-3000:]
    assert f"the previous checkpoint {kept} is intact" in line
    assert run.latest == kept
    return line


def assert_matches_baseline(phase, baseline, steps):
    for step in steps:
        assert phase.loss[step] == pytest.approx(baseline.loss[step], rel=1e-6), step


# --------------------------------------------------------------------------- the training chain


@pytest.fixture(scope="module")
def baseline(prepared, tmp_path_factory):
    """The same run, uninterrupted."""
    repo = train_copy(prepared, tmp_path_factory.mktemp("baseline") / "repo")
    run = train(repo)
    assert run.proc.returncode == 0, run.proc.stderr[-3000:]
    run.metrics = json.loads((repo / "metrics/train.json").read_text())
    run.repo = repo
    return run


@pytest.fixture(scope="module")
def chain_repo(prepared, tmp_path_factory):
    # The chain reads each step's numbers one step late, as GPU runs do by default
    # (train.perf.async_metrics), and is held against a baseline that reads them at once:
    # recovery must not depend on when the numbers are read (checkpoints every 3 steps: two
    # steps of three are read late).
    repo = train_copy(prepared, tmp_path_factory.mktemp("chain") / "repo")
    update_params(repo, {"train": {"perf": {"async_metrics": True}}})
    return repo


@pytest.fixture(scope="module")
def killed_mid_step(chain_repo):
    """Phase 1: rank 1 is SIGKILLed inside step 5, between its two micro-steps."""
    mark = chain_repo.parent / "fault-time"
    run = train(
        chain_repo,
        {
            "DSFLOW_FAULT_STEP": "5",
            "DSFLOW_FAULT_POINT": "micro",
            "DSFLOW_FAULT_RANK": "1",
            "DSFLOW_FAULT_MARK": str(mark),
        },
    )
    run.fault_time = float(mark.read_text()) if mark.exists() else None
    return run


@pytest.fixture(scope="module")
def killed_in_save(killed_mid_step, chain_repo):
    """Phase 2: resumes; rank 0 is SIGKILLed while saving step 6 (temp tag written, not renamed)."""
    return train(chain_repo, {"DSFLOW_FAULT_SAVE": "6"})


@pytest.fixture(scope="module")
def disk_full(killed_in_save, chain_repo):
    """Phase 3: resumes; saves step 6; rank 0's writes of step 9 fail with ENOSPC."""
    return train(chain_repo, {"DSFLOW_FAULT_ENOSPC": "9"})


@pytest.fixture(scope="module")
def nan_loss(disk_full, chain_repo):
    """Phase 4: resumes from step 6; the loss is NaN from step 8 on; max_bad_steps 2."""
    update_params(chain_repo, {"train": {"max_bad_steps": 2}})
    run = train(chain_repo, {"DSFLOW_FAULT_NAN_FROM_STEP": "8"})
    update_params(chain_repo, {"train": {"max_bad_steps": 10}})
    return run


# How long the fault injection sleeps before each step of the SIGTERM phase: far longer than
# a step of this run takes (0.2 to 0.3 s here), so that a step's time with the sleep counted
# stands clear of the plain run's steps even when the machine is loaded unevenly.
STEP_DELAY_S = 2


@pytest.fixture(scope="module")
def signalled(nan_loss, chain_repo):
    """Phase 5: resumes from step 6 with a large budget and slow steps; a second train run is
    started while it runs; SIGTERM to the stage once step 8 is logged."""
    repo = chain_repo
    update_params(repo, {"train": {"max_steps": 1000}})
    err = repo.parent / "signalled.stderr"
    with open(err, "w") as stderr:
        delay = {"DSFLOW_FAULT_STEP_DELAY": str(STEP_DELAY_S)}
        proc = start_stage("train", cwd=repo, env=delay, stderr=stderr)
        try:
            lock = repo / "checkpoints" / ckpt.LOCK_FILE
            wait_for(
                lambda: lock.exists() and "launcher" in lock.read_text(), 120, "the run's lock"
            )
            t0 = time.time()
            second = dsflow("train", cwd=repo, check=False, timeout=120)
            second_wall = time.time() - t0
            wait_for(lambda: max(curve(repo), default=0) >= 8, 120, "step 8 in loss.tsv")
            t0 = time.time()
            proc.send_signal(signal.SIGTERM)
            code = proc.wait(timeout=120)
            stop_wall = time.time() - t0
        finally:
            if proc.poll() is None:
                proc.kill()
    update_params(repo, {"train": {"max_steps": 12}})
    return SimpleNamespace(
        code=code,
        pid=proc.pid,
        stderr=err.read_text(),
        stop_wall=stop_wall,
        second=second,
        second_wall=second_wall,
        ranks=alive_ranks(repo),
        **snapshot(repo),
    )


@pytest.fixture(scope="module")
def finished(signalled, chain_repo):
    """Phase 6: a clean rerun to the end."""
    run = train(chain_repo)
    run.metrics = json.loads((chain_repo / "metrics/train.json").read_text())
    return run


@pytest.mark.slow
def test_rank_killed_mid_step_fails_fast_and_resumes(killed_mid_step, killed_in_save, baseline):
    run = killed_mid_step
    assert run.proc.returncode == 2
    assert "SIGKILL rank 1 inside step 5, after micro-step 0" in run.proc.stderr
    assert last_line(run.proc).startswith("dsflow train: error: training failed")
    assert "rerun to resume from step00000003" in last_line(run.proc)
    # The launcher noticed and every rank is gone, within a bounded time (no hang).
    assert run.fault_time is not None
    assert run.done - run.fault_time < 60
    assert run.ranks == []
    assert run.latest == "step00000003"
    assert not any(e.startswith(".tmp-") for e in run.entries)
    # Steps 1-4 were trained before the kill. Read one step late, step 4's numbers would have
    # been logged during step 5: they went with the run (the rerun resumes from step 3 and
    # trains step 4 again).
    assert_matches_baseline(run, baseline, range(1, 4))
    assert 4 not in run.loss
    assert "resumed from step 3" in killed_in_save.proc.stderr
    assert_matches_baseline(killed_in_save, baseline, range(1, 6))


@pytest.mark.slow
def test_kill_during_checkpoint_save_keeps_the_previous_checkpoint(killed_in_save, disk_full):
    run = killed_in_save
    assert run.proc.returncode == 2
    assert "SIGKILL rank 0 while saving step 6" in run.proc.stderr
    # The temp tag was complete but never renamed: resume cannot see it, the stage removes it.
    assert "removed checkpoints/.tmp-step00000006, left by an interrupted" in run.proc.stderr
    assert run.latest == "step00000003"
    assert "step00000006" not in run.entries and ".tmp-step00000006" not in run.entries
    assert "rerun to resume from step00000003" in last_line(run.proc)
    assert run.ranks == [] and run.wall < TIMEOUT
    assert "resumed from step 3" in disk_full.proc.stderr


@pytest.mark.slow
def test_disk_full_while_saving_keeps_the_previous_checkpoint(disk_full, nan_loss, chain_repo):
    run = disk_full
    line = assert_out_of_space(run, "step00000009", kept="step00000006")
    assert "rerun to resume from step00000006" in line
    assert ".tmp-step00000009" not in run.entries and "step00000009" not in run.entries
    assert run.ranks == []
    assert "resumed from step 6" in nan_loss.proc.stderr


@pytest.mark.slow
def test_persistent_nan_loss_stops_and_keeps_the_last_good_checkpoint(nan_loss, baseline):
    run = nan_loss
    assert run.proc.returncode == 2
    line = last_line(run.proc)
    assert "loss was non-finite (nan) for 2 consecutive step(s) (steps 8-9" in line
    assert "train.max_bad_steps: 2" in line
    assert "the last good checkpoint step00000006 is kept" in line
    assert "Traceback" not in run.proc.stderr
    assert run.latest == "step00000006" and "step00000009" not in run.entries
    # Each skipped (NaN) step is counted and logged; a NaN loss itself is never logged.
    assert run.skipped[7] == 0 and run.skipped[8] == 1 and run.skipped[9] == 2
    assert 8 not in run.loss and 9 not in run.loss
    assert_matches_baseline(run, baseline, [7])


@pytest.mark.slow
def test_the_device_step_skips_nan_updates_and_stops_after_max_bad_steps(prepared, tmp_path):
    """train.perf.device_step (bf16 ZeRO-2, 2 CPU ranks): a NaN loss from step 3 on is skipped
    on the device, the skip reaches the run's health bookkeeping (the device's verdict, read
    back), and two in a row stop the run in one line."""
    repo = train_copy(prepared, tmp_path / "repo")
    run_params = tiny_run(2, 6, precision="bf16", zero_stage=2, max_bad_steps=2)
    update_params(repo, {"train": {**run_params["train"], "perf": {"device_step": True}}})
    run = train(repo, {"DSFLOW_FAULT_NAN_FROM_STEP": "3"})
    assert run.proc.returncode == 2, run.proc.stderr[-3000:]
    assert "its step on the device" in run.proc.stderr
    line = last_line(run.proc)
    assert "loss was non-finite (nan) for 2 consecutive step(s) (steps 3-4" in line
    assert "their updates were skipped" in line
    assert run.skipped[2] == 0 and run.skipped[3] == 1 and run.skipped[4] == 2
    assert 3 not in run.loss and 4 not in run.loss


@pytest.mark.slow
def test_sigterm_checkpoints_at_the_next_step_boundary(signalled, finished, baseline):
    run = signalled
    assert run.code == 128 + signal.SIGTERM, run.stderr[-3000:]
    assert run.stop_wall < 30
    assert run.ranks == []
    stopped = max(run.loss)
    assert 8 <= stopped < 12, "the run went too far for the final phase to resume it"
    tag = ckpt.tag_for(stopped)
    assert run.latest == tag
    assert run.stderr.strip().splitlines()[-1] == (
        f"dsflow train: error: interrupted by SIGTERM: checkpoint {tag} saved; rerun to resume "
        "from it"
    )
    assert "Traceback" not in run.stderr
    assert_matches_baseline(run, baseline, range(7, stopped + 1))
    assert f"resumed from step {stopped}" in finished.proc.stderr
    # A step's time is the period since the last step ended: the sleep the fault injection
    # puts between steps counts, whole (from the second step after the resume on), as the
    # per-step bookkeeping does on a GPU.
    plain = statistics.median(baseline.step_s.values())
    for step in range(8, stopped + 1):
        assert run.step_s[step] >= STEP_DELAY_S, (step, run.step_s[step])
        assert run.step_s[step] - plain > 0.9, (step, run.step_s[step], plain)


@pytest.mark.slow
def test_a_second_train_run_fails_at_once_on_the_lock(signalled):
    second = signalled.second
    assert second.returncode == 2
    line = last_line(second)
    assert "checkpoints/.lock is held by another train run" in line
    assert f"PID {signalled.pid}," in line
    assert signalled.second_wall < 60
    assert len(second.stderr.strip().splitlines()) == 1


@pytest.mark.slow
def test_every_interrupted_phase_ends_where_an_uninterrupted_run_ends(finished, baseline):
    assert finished.proc.returncode == 0, finished.proc.stderr[-3000:]
    assert sorted(finished.loss) == list(range(1, 13))  # each step logged once
    assert_matches_baseline(finished, baseline, range(1, 13))
    assert finished.metrics["val_loss"] == pytest.approx(baseline.metrics["val_loss"], rel=1e-6)
    # The NaN phase's skipped steps were never checkpointed: the run resumed from before them.
    for key in ("skipped_steps", "bad_steps", "grad_norm_spikes"):
        assert finished.metrics[key] == baseline.metrics[key] == 0
    assert finished.latest == "step00000012"
    assert ".lock" not in finished.entries and ".stop" not in finished.entries


# --------------------------------------------------------------------------- background saves
# train.async_checkpoints: the same faults hit a checkpoint while its writer thread writes it.


@pytest.fixture(scope="module")
def async_repo(prepared, tmp_path_factory):
    repo = train_copy(prepared, tmp_path_factory.mktemp("async") / "repo")
    update_params(repo, {"train": {"async_checkpoints": True}})
    return repo


@pytest.fixture(scope="module")
def async_disk_full(async_repo):
    """Phase 1: rank 0's writer thread hits ENOSPC writing step 6 (training goes on meanwhile)."""
    return train(async_repo, {"DSFLOW_FAULT_ENOSPC": "6"})


@pytest.fixture(scope="module")
def async_killed(async_disk_full, async_repo):
    """Phase 2: resumes from step 3; rank 0 is SIGKILLed in its writer thread with step 9's
    files written, not yet committed."""
    return train(async_repo, {"DSFLOW_FAULT_SAVE": "9"})


@pytest.fixture(scope="module")
def async_finished(async_killed, async_repo):
    """Phase 3: a clean rerun to the end."""
    return train(async_repo)


@pytest.mark.slow
def test_a_background_write_that_fails_ends_the_run_in_one_line(async_disk_full, async_killed):
    run = async_disk_full
    assert_out_of_space(run, "step00000006", kept="step00000003")
    assert "step00000006" not in run.entries
    assert run.ranks == []
    assert "resumed from step 3" in async_killed.proc.stderr


@pytest.mark.slow
def test_a_kill_during_a_background_write_keeps_the_previous_checkpoint(
    async_killed, async_finished
):
    run = async_killed
    assert run.proc.returncode == 2
    assert "SIGKILL rank 0 while saving step 9" in run.proc.stderr
    assert run.latest == "step00000006" and "step00000009" not in run.entries
    assert run.ranks == []
    assert "removed checkpoints/.tmp-step00000009, left by an interrupted" in run.proc.stderr
    assert "resumed from step 6" in async_finished.proc.stderr


@pytest.mark.slow
def test_background_saves_end_where_saves_in_the_step_end(async_finished, async_repo, baseline):
    run = async_finished
    assert run.proc.returncode == 0, run.proc.stderr[-3000:]
    assert sorted(run.loss) == list(range(1, 13))
    assert_matches_baseline(run, baseline, range(1, 13))
    assert run.latest == "step00000012" and sorted(e for e in run.entries if "step" in e) == [
        "step00000009",
        "step00000012",
    ]
    # The same files as the run that wrote while training waited, each with its hash.
    ours, theirs = (
        json.loads((repo / "checkpoints/step00000012" / ckpt.MANIFEST).read_text())
        for repo in (async_repo, baseline.repo)
    )
    assert ours["files"].keys() == theirs["files"].keys()
    optim = [name for name in ours["files"] if ckpt.ZERO_FILE.match(name)]
    assert len(optim) == 3
    assert {n: ours[ckpt.HASHES][n] for n in optim} == {n: theirs[ckpt.HASHES][n] for n in optim}
    assert ckpt.validate_tag(async_repo / "checkpoints", "step00000012", content=True) is None
    stderr = run.proc.stderr
    assert "checkpoint step00000012: training paused" in stderr
    assert "writing in the background" in stderr
    assert "checkpoint step00000012: written in" in stderr


def _mount_tmpfs(path: Path, size: int) -> bool:
    if os.geteuid() != 0 or not shutil.which("mount"):
        return False
    path.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True
    )
    return proc.returncode == 0


@pytest.mark.slow
def test_real_full_disk_while_saving(prepared, baseline, tmp_path):
    """checkpoints/ on a tmpfs with room for one checkpoint: the second save hits ENOSPC."""
    repo = train_copy(prepared, tmp_path / "repo")
    update_params(repo, {"train": {"max_steps": 6}})
    size = ckpt.tag_bytes(baseline.repo / "checkpoints", "step00000012")
    root = repo / "checkpoints"
    if not _mount_tmpfs(root, int(size * 1.5)):
        pytest.skip("cannot mount a tmpfs here (needs root); the ENOSPC hook test covers it")
    try:
        run = train(repo)
        assert_out_of_space(run, "step00000006", kept="step00000003")
        assert ckpt.validate_tag(root, "step00000003", world=3, zero=True) is None
        assert ckpt.resume_tag(root, 3, True) == "step00000003"
        assert not any(e.startswith(".tmp-") for e in run.entries)  # space handed back
        assert run.ranks == []
    finally:
        subprocess.run(["umount", "-l", str(root)], capture_output=True)


# The child writes by rename, so the test never reads a file that exists but is still empty
# (CI once read '' between the open and the write), and says when its handler is in place.
CHILD = """
import os, signal, sys, time
def bye(signum, frame):
    with open(sys.argv[1] + ".tmp", "w") as f:
        f.write("SIGTERM")
    os.replace(sys.argv[1] + ".tmp", sys.argv[1])
    sys.exit(0)
signal.signal(signal.SIGTERM, bye)
open(sys.argv[1] + ".ready", "w").close()
time.sleep(60)
"""
STAGE = """
import subprocess, sys, time
from dsflow.launch import die_with_parent
child = subprocess.Popen(
    [sys.executable, "-c", sys.argv[1], sys.argv[2]],
    start_new_session=True,
    preexec_fn=die_with_parent(),
)
print(child.pid, flush=True)
time.sleep(60)
"""


def test_a_killed_stage_takes_its_launcher_down(tmp_path):
    """The launcher runs in a process group of its own (setsid) but gets SIGTERM when the stage
    dies, even by SIGKILL (it then stops the ranks, which checkpoint: see the SIGTERM test)."""
    got = tmp_path / "got"
    stage = subprocess.Popen(
        [sys.executable, "-c", STAGE, CHILD, str(got)], stdout=subprocess.PIPE, text=True
    )
    child = int(stage.stdout.readline())
    assert os.getpgid(child) != os.getpgid(stage.pid)  # Ctrl-C in a terminal reaches the stage only
    wait_for(Path(f"{got}.ready").exists, 10, "the launcher's SIGTERM handler")
    stage.kill()
    stage.wait()
    wait_for(got.exists, 10, "the launcher's SIGTERM")
    assert got.read_text() == "SIGTERM"


def test_a_rank_destroys_its_process_group_before_exiting(tmp_path):
    """Left to the interpreter's teardown, Gloo's threads sometimes abort a finished rank (-6,
    "terminate called without an active exception"; seen once in CI after a complete ZeRO-3
    run, ~1 in 10 for a bare 3-rank gloo script here). A rank's exit path (loop.shutdown)
    destroys the group first and keeps the exit code; a second call is harmless."""
    import torch.distributed as dist

    from dsflow.train import loop

    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    dist.barrier()
    assert loop.shutdown(3) == 3
    assert not dist.is_initialized()
    assert loop.shutdown(0) == 0


# --------------------------------------------------------------------------- checkpoint validation


def fake_tag(root: Path, tag: str, world: int = 3, manifest: bool = True, drop=()) -> None:
    path = root / tag
    path.mkdir(parents=True)
    names = [ckpt.MODEL_FILE] + [
        f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in range(world)
    ]
    for name in names:
        (path / name).write_bytes(b"x" * 100)
    if manifest:
        ckpt.write_manifest(root, tag, ckpt.step_of(tag), world, True)
    for name in drop:
        (path / name).unlink()


def test_resume_validates_latest_and_falls_back_to_the_newest_complete_tag(tmp_path):
    root = tmp_path
    fake_tag(root, "step00000003")
    fake_tag(root, "step00000006")
    fake_tag(root, "step00000009", drop=["zero_pp_rank_2_mp_rank_00_optim_states.pt"])
    fake_tag(
        root, "step00000012", manifest=False, drop=["zero_pp_rank_1_mp_rank_00_optim_states.pt"]
    )
    notes: list[str] = []
    ckpt.set_latest(root, "step00000009")
    assert ckpt.validate_tag(root, "step00000006", 3, True) is None
    assert "zero_pp_rank_2" in ckpt.validate_tag(root, "step00000009", 3, True)
    assert "rank(s) 1 missing" in ckpt.validate_tag(root, "step00000012", 3, True)
    assert ckpt.resume_tag(root, 3, True, notes.append) == "step00000006"
    assert notes == [
        "checkpoints/latest names step00000009, which is incomplete "
        "(zero_pp_rank_2_mp_rank_00_optim_states.pt missing): resuming from step00000006"
    ]
    # A truncated file is caught by the manifest's sizes.
    (root / "step00000006" / ckpt.MODEL_FILE).write_bytes(b"x" * 10)
    assert "truncated" in ckpt.validate_tag(root, "step00000006", 3, True)
    assert ckpt.resume_tag(root, 3, True) == "step00000003"
    # Saved by another world size: not resumable here.
    assert "saved by 3 rank(s)" in ckpt.validate_tag(root, "step00000003", 2, True)
    # Renamed but `latest` not moved yet: the newer complete tag wins.
    ckpt.set_latest(root, "step00000003")
    fake_tag(root, "step00000015")
    notes.clear()
    assert ckpt.resume_tag(root, 3, True, notes.append) == "step00000015"
    assert "a save stopped before moving latest" in notes[0]


def test_the_stage_removes_stale_temp_tags_and_repairs_latest(tmp_path, monkeypatch):
    from dsflow.train import stage as train

    monkeypatch.chdir(tmp_path)
    root = tmp_path / "checkpoints"
    fake_tag(root, "step00000003")
    fake_tag(root, "step00000006")  # then torn: no manifest, no model file
    (root / "step00000006" / ckpt.MANIFEST).unlink()
    (root / "step00000006" / ckpt.MODEL_FILE).unlink()
    (root / ".tmp-step00000009").mkdir()
    (root / ".tmp-step00000009" / ckpt.MODEL_FILE).write_bytes(b"partial")
    ckpt.set_latest(root, "step00000006")
    plan = {"world": 3, "fingerprint": "f1", "ds_config": {"zero_optimization": {"stage": 2}}}
    (root / "run.json").write_text(json.dumps({"fingerprint": "f1"}))
    train.prepare_run_dir(plan)
    assert plan["resume"] == "step00000003"
    assert (root / "latest").read_text() == "step00000003"
    assert not (root / ".tmp-step00000009").exists()
    # A different run's checkpoints are never resumed.
    plan["fingerprint"] = "f2"
    train.prepare_run_dir(plan)
    assert plan["resume"] is None and ckpt.tags(root) == []


def test_run_lock_is_exclusive_and_names_the_holder(tmp_path):
    with ckpt.RunLock(tmp_path) as lock:
        lock.write_holder("4242, launcher 4243")
        with pytest.raises(UsageError) as exc:
            ckpt.RunLock(tmp_path).acquire()
        msg = str(exc.value)
        assert f"{tmp_path / '.lock'} is held by another train run" in msg
        assert "PID 4242, launcher 4243" in msg and "\n" not in msg
    assert not (tmp_path / ".lock").exists()
    ckpt.RunLock(tmp_path).acquire().release()  # free again


# --------------------------------------------------------------------------- numerical bookkeeping


def test_step_health_counts_overflow_skips_nan_streaks_and_spikes():
    from dsflow.train.health import StepHealth

    h = StepHealth(max_bad=3, min_history=3, factor=5.0)
    # fp16 loss-scale overflow: finite loss, update skipped by DeepSpeed. Counted, not bad.
    e = h.observe(1, 2.5, applied=False, grad_norm=float("inf"))
    assert e == {"bad": False, "skipped": True, "spike": None, "stop": None}
    assert h.skipped == 1 and h.bad == 0
    for step, norm in zip(range(2, 6), (1.0, 1.2, 0.9, 1.1), strict=True):
        assert h.observe(step, 2.0, True, norm)["spike"] is None
    e = h.observe(6, 2.0, True, 8.0)
    assert e["spike"] == pytest.approx(8.0 / 1.05) and h.spikes == 1
    # NaN steps: skipped and counted; the streak resets on a good step.
    assert h.observe(7, float("nan"), False, float("inf"))["stop"] is None
    assert h.observe(8, float("inf"), False, None)["stop"] is None
    assert h.observe(9, 2.0, True, 1.0)["stop"] is None and h.streak == 0
    for step in (10, 11):
        assert h.observe(step, float("nan"), False, None)["stop"] is None
    stop = h.observe(12, float("nan"), False, None)["stop"]
    assert "for 3 consecutive step(s) (steps 10-12, train.max_bad_steps: 3)" in stop
    assert h.skipped == 6 and h.bad == 5
    # A NaN step that DeepSpeed applied (no overflow check) stops at once.
    assert "applied the update" in StepHealth(10).observe(1, float("nan"), True, None)["stop"]
    # Survives a resume.
    again = StepHealth(3, h.state())
    assert (again.skipped, again.bad, again.spikes) == (6, 5, 1)
    assert list(again.norms) == list(h.norms)


# --------------------------------------------------------------------------- bad data


@pytest.mark.slow
def test_corrupted_shard_fails_the_train_stage_in_one_line(prepared, tmp_path):
    repo = train_copy(prepared, tmp_path / "repo")
    shard = repo / "data/shards/train/shard_00000.bin"
    original = shard.read_bytes()
    data = bytearray(original)
    data[100] ^= 0xFF  # same size, different bytes
    shard.write_bytes(bytes(data))
    proc = dsflow("train", cwd=repo, check=False, timeout=TIMEOUT)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "dsflow train: error: data/shards/train/shard_00000.bin: sha256 mismatch (corrupted); "
        "rerun the shard stage"
    ]
    assert not (repo / "checkpoints").exists()  # refused before launch: no rank started
    val = repo / "data/shards/val/shard_00000.bin"
    val.write_bytes(val.read_bytes()[:-2])
    shard.write_bytes(original)
    proc = dsflow("train", cwd=repo, check=False, timeout=TIMEOUT)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1
    assert "data/shards/val/shard_00000.bin" in proc.stderr and "truncated" in proc.stderr
    assert "rerun the shard stage" in proc.stderr


# --------------------------------------------------------------------------- interrupted data stages


def tree_bytes(root: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()
    }


@pytest.mark.slow
def test_killed_download_leaves_nothing_that_looks_done(project, prepared):
    """A download big enough to be killed in the middle; the rerun, at the small params, removes
    its temp dir and writes what the uninterrupted download of `prepared` wrote, byte for byte."""
    from conftest import SMALL_PARAMS

    big = {"download": {"max_docs": 40000}}
    update_params(project, big)
    proc = start_stage("download", cwd=project, stderr=subprocess.DEVNULL)
    data = project / "data"
    wait_for(lambda: list(data.glob(".raw.tmp-*")), 60, "the download's temp dir")
    time.sleep(0.5)
    assert proc.poll() is None, "the download finished before it could be killed"
    proc.kill()
    assert proc.wait() == -signal.SIGKILL
    assert not (data / "raw").exists()
    assert [p.name for p in data.glob("*raw*")] == [f".raw.tmp-{proc.pid}"]
    update_params(project, SMALL_PARAMS)
    dsflow("download", cwd=project)
    assert [p.name for p in data.glob("*raw*")] == ["raw"]  # the stale temp is gone too
    assert tree_bytes(data / "raw") == tree_bytes(prepared / "data/raw")


@pytest.mark.slow
@pytest.mark.parametrize("stage, out", [("tokenize", "tokens"), ("shard", "shards")])
def test_killed_before_the_final_rename_reruns_to_identical_bytes(prepared, tmp_path, stage, out):
    """The worst moment: everything written, the rename not done (DSFLOW_FAULT_ATOMIC)."""
    repo = tmp_path / "repo"
    shutil.copytree(prepared, repo)
    shutil.rmtree(repo / "data" / out)  # as if never run (or deleted by Snakemake for a rerun)
    proc = dsflow(stage, cwd=repo, check=False, env={"DSFLOW_FAULT_ATOMIC": out})
    assert proc.returncode == -signal.SIGKILL
    assert not (repo / "data" / out).exists()
    (leftover,) = (repo / "data").glob(f".{out}.tmp-*")
    assert any(leftover.rglob("*.json"))  # complete, yet never taken for done
    dsflow(stage, cwd=repo)
    assert not list((repo / "data").glob(f".{out}.tmp-*"))
    assert tree_bytes(repo / "data" / out) == tree_bytes(prepared / "data" / out)


# --------------------------------------------------------------------------- concurrent runs


@pytest.mark.slow
def second_concurrent_run(project, cmd: list[str], setup: list[str] | None = None) -> str:
    """Start `cmd` on a slow download, run it again while the first holds its lock; the
    second's output. The first must still finish and leave a complete output."""
    update_params(project, {"download": {"max_docs": 40000}})
    if setup:
        run_command(setup, cwd=project)
    first = start(cmd, cwd=project, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for(lambda: list((project / "data").glob(".raw.tmp-*")), 60, "the first run")
        second = run_command(cmd, cwd=project, check=False)
        assert second.returncode != 0
        assert first.wait(timeout=120) == 0
    finally:
        if first.poll() is None:
            first.kill()
    assert (project / "data/raw/manifest.json").exists()
    return second.stdout + second.stderr


def test_dvc_refuses_a_second_concurrent_repro(project):
    out = second_concurrent_run(
        project, ["dvc", "repro", "download"], setup=["dvc", "config", "core.no_scm", "true"]
    )
    # DVC's repo lock, or its per-output read/write lock, whichever it meets first.
    assert "Unable to acquire lock" in out or ("is busy" in out and "rwlock" in out), out


def test_snakemake_refuses_a_second_concurrent_run(project):
    out = second_concurrent_run(project, ["snakemake", "--cores", "1", "download"])
    assert "cannot be locked" in out, out


# --------------------------------------------------------------------------- bad params (property)

BASE = yaml.safe_load((ROOT / "params.yaml").read_text())


def _key_paths(node, prefix=()):
    for key, value in node.items():
        yield (*prefix, key)
        if isinstance(value, dict):
            yield from _key_paths(value, (*prefix, key))


PATHS = list(_key_paths(BASE))
DICT_PATHS = [()] + [p for p in PATHS if isinstance(params_mod.get(BASE, ".".join(p)), dict)]

scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(2**40), 2**40)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=12)
)
json_values = st.recursive(
    scalars,
    lambda kids: (
        st.lists(kids, max_size=3) | st.dictionaries(st.text(max_size=6), kids, max_size=3)
    ),
    max_leaves=6,
)
# YAML has more scalar types than JSON (dates), and keys that are not strings.
yaml_values = st.recursive(
    scalars | st.dates(min_value=datetime.date(1900, 1, 1)),
    lambda kids: (
        st.lists(kids, max_size=3) | st.dictionaries(st.text(max_size=6), kids, max_size=3)
    ),
    max_leaves=6,
)
new_keys = (
    st.text(st.characters(blacklist_categories=("C", "Zl", "Zp", "Zs")), min_size=1, max_size=10)
    | st.integers(-5, 5)
    | st.booleans()
    | st.none()
)
mutations = st.one_of(
    st.tuples(st.just("set"), st.sampled_from(PATHS), yaml_values),
    st.tuples(st.just("delete"), st.sampled_from(PATHS), st.none()),
    st.tuples(st.just("add"), st.sampled_from(DICT_PATHS), st.tuples(new_keys, yaml_values)),
)


def _apply(params: dict, mutation) -> str | None:
    """Apply one mutation in place; returns the key it names (None when it did not apply)."""
    kind, path, arg = mutation
    node = params
    for key in path[:-1] if kind != "add" else path:
        if not isinstance(node, dict) or key not in node:
            return None
        node = node[key]
    if not isinstance(node, dict):
        return None
    if kind == "set":
        node[path[-1]] = arg
        return ".".join(path)
    if kind == "delete":
        if path[-1] not in node:
            return None
        del node[path[-1]]
        return path[-1]
    key, value = arg
    node[key] = value
    return ".".join([*path, str(key)])


@pytest.fixture(scope="module")
def scratch(tmp_path_factory):
    return tmp_path_factory.mktemp("params")


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(mutations, min_size=1, max_size=3))
def test_any_params_file_validates_or_fails_in_one_line_naming_the_key(scratch, muts):
    params = json.loads(json.dumps(BASE))
    named = [n for n in (_apply(params, m) for m in muts) if n is not None]
    path = scratch / "params.yaml"
    path.write_text(yaml.safe_dump(params, sort_keys=False))
    try:
        params_mod.load(path, overlays=[])
    except UsageError as e:
        msg = str(e)
        assert "\n" not in msg
        assert msg.startswith(str(path))
        assert any(n in msg for n in named), (msg, named)


params_text = (ROOT / "params.yaml").read_text()


@settings(max_examples=200, deadline=None)
@given(
    st.one_of(
        st.binary(max_size=200),
        st.text(max_size=200).map(str.encode),
        st.integers(0, len(params_text)).map(lambda n: params_text[:n].encode()),
        st.tuples(st.integers(0, len(params_text)), st.text(min_size=1, max_size=5)).map(
            lambda t: (params_text[: t[0]] + t[1] + params_text[t[0] :]).encode()
        ),
    )
)
@example(b"seed: 2024-13-45\n")
@example(b"[" * 5000)
@example(b"\xff\xfe")
@example(b"{? [a, b]: 1}")
def test_malformed_yaml_fails_in_one_line(scratch, data):
    path = scratch / "garbage.yaml"
    path.write_bytes(data)
    try:
        params_mod.load(path, overlays=[])
    except UsageError as e:
        assert "\n" not in str(e) and str(e).startswith(str(path))


DS_CONFIG = json.dumps(
    dsconfig.build(
        {
            **params_mod.validate(BASE)["train"],
            "zero_stage": 2,
        },  # as train.plan_memory gives a CPU run
        dsconfig.resolve_batch(4, 2, None, 3),
        100,
        "cpu",
    )
)
ds_keys = st.sampled_from(
    [
        "fp16",
        "bf16",
        "zero_optimization",
        "optimizer",
        "scheduler",
        "train_batch_size",
        "gradient_accumulation_steps",
        "train_micro_batch_size_per_gpu",
        "gradient_clipping",
    ]
)
ds_objects = st.dictionaries(
    ds_keys,
    json_values
    | st.dictionaries(st.sampled_from(["enabled", "stage", "type"]), json_values, max_size=2),
    max_size=4,
)


@settings(max_examples=200, deadline=None)
@given(
    st.one_of(
        ds_objects.map(json.dumps),
        json_values.map(json.dumps),
        st.text(max_size=80),
        st.binary(max_size=80).map(lambda b: b.decode("latin-1")),
    ).map(str.encode)
    | st.binary(max_size=80)
)
@example(b'{"zero_optimization": {"stage": true}}')
@example(b'{"fp16": 1}')
@example(b'{"train_batch_size": "a\\nb"}')
def test_malformed_user_ds_config_fails_in_one_line(scratch, data):
    cfg = json.loads(DS_CONFIG)
    path = scratch / "ds_config.json"
    path.write_bytes(data)
    try:
        merged = dsconfig.merge_user(cfg, path)
    except UsageError as e:
        assert "\n" not in str(e) and str(path) in str(e)
    else:
        assert merged["train_batch_size"] == cfg["train_batch_size"]
        assert merged["zero_optimization"]["stage"] in (0, 1, 2, 3)
