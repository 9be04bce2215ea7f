"""What a rank reads is checked before launch, a rank's failure is one line from the stage, and a
hung rank is found and stopped (docs/reliability.md).

Pre-launch refusals run the train stage up to the launch only; the rank faults run two CPU ranks
of the tiny preset for a few steps."""

from __future__ import annotations

import json
import os
import shutil
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from conftest import dsflow, start_stage, tiny_run, update_params, wait_for
from dsflow import launch
from dsflow.data.shards import load_index
from dsflow.errors import UsageError
from dsflow.train.stage import rank_failure

TIMEOUT = 300  # no train stage here may take longer: a hang fails the test instead
HANG_S = 15  # train.collective_timeout_s of the hang tests


def train_copy(prepared: Path, dest: Path, **train) -> Path:
    shutil.copytree(
        prepared, dest, ignore=shutil.ignore_patterns("checkpoints", "models", "dvclive", "metrics")
    )
    update_params(dest, tiny_run(2, 4, **train))
    return dest


def refused(repo: Path) -> str:
    """The train stage's one line, refused before any rank started."""
    proc = dsflow("train", cwd=repo, check=False, timeout=TIMEOUT)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert not (repo / "checkpoints").exists()  # no rank started, nothing written
    lines = proc.stderr.strip().splitlines()
    errors = [line for line in lines if line.startswith("dsflow train: error")]
    assert errors == lines[-1:], proc.stderr[-3000:]  # one line (torch may warn on import)
    return lines[-1]


# --------------------------------------------------------------------------- before launch


@pytest.mark.slow
def test_a_deleted_tokenizer_fails_the_train_stage_before_launch(prepared, tmp_path):
    repo = train_copy(prepared, tmp_path / "repo")
    (repo / "data/tokenizer/tokenizer.json").unlink()
    assert refused(repo) == (
        "dsflow train: error: data/tokenizer/tokenizer.json: missing; rerun the tokenizer stage "
        "(python -m dsflow tokenizer)"
    )


def tiny_checkpoint(out: Path) -> Path:
    """A tiny deepseek_v3 checkpoint (save_pretrained) whose embeddings fit the test tokenizer."""
    from dsflow.model.build import build_model
    from dsflow.model.presets import model_config

    build_model(model_config("tiny", 400), device_type="cpu").save_pretrained(out)
    return out


def rewrite_tensor(folder: Path, name: str, tensor) -> None:
    from safetensors.torch import load_file, save_file

    weights = load_file(folder / "model.safetensors")
    assert name in weights
    weights[name] = tensor
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})


@pytest.mark.slow
def test_a_damaged_pretrained_checkpoint_fails_before_launch(prepared, tmp_path):
    import torch

    good = tiny_checkpoint(tmp_path / "good")
    repo = train_copy(prepared, tmp_path / "repo")
    # A routed expert of another width: the checkpoint holds the experts one by one, the model
    # fused (transformers 5), and the shape is checked across that convention.
    wrong = tmp_path / "wrong"
    shutil.copytree(good, wrong)
    expert = "model.layers.1.mlp.experts.3.up_proj.weight"
    rewrite_tensor(wrong, expert, torch.zeros(64, 100))
    update_params(repo, {"model": {"pretrained": str(wrong)}})
    assert refused(repo) == (
        f"dsflow train: error: {wrong}/model.safetensors: tensor {expert} has shape (64, 100), "
        "but the config.json beside it makes (64, 128); download the checkpoint again (or save "
        "it again)"
    )
    truncated = tmp_path / "truncated"
    shutil.copytree(good, truncated)
    weights = truncated / "model.safetensors"
    size = weights.stat().st_size
    with open(weights, "r+b") as f:
        f.truncate(size - 1000)
    update_params(repo, {"model": {"pretrained": str(truncated)}})
    line = refused(repo)
    assert line.startswith(
        f"dsflow train: error: {weights}: {size - 1000} bytes, its header describes {size} "
        "(truncated)"
    )


@pytest.mark.slow
def test_a_shard_index_missing_a_key_fails_before_launch(prepared, tmp_path):
    repo = train_copy(prepared, tmp_path / "repo")
    path = repo / "data/shards/train/index.json"
    index = json.loads(path.read_text())
    del index["vocab_size"]
    path.write_text(json.dumps(index))
    assert refused(repo) == (
        "dsflow train: error: data/shards/train/index.json: key vocab_size is missing; rerun "
        "the shard stage"
    )


def test_load_index_names_the_missing_or_mistyped_key(prepared, tmp_path):
    split = tmp_path / "train"
    shutil.copytree(prepared / "data/shards/train", split)
    index = json.loads((split / "index.json").read_text())
    cases = [
        ({k: v for k, v in index.items() if k != "dtype"}, "key dtype is missing"),
        ({**index, "shards": [{"file": "shard_00000.bin"}]}, "key shards[0].tokens is missing"),
        ({**index, "shards": {}}, "key shards is {}, not a list"),
        ({**index, "vocab_size": "big"}, "key vocab_size is 'big', not an integer"),
        ({**index, "dtype": "no-such-type"}, "key dtype 'no-such-type' is no numpy dtype"),
        ([], "not a JSON object"),
    ]
    for broken, says in cases:
        (split / "index.json").write_text(json.dumps(broken))
        with pytest.raises(UsageError) as exc:
            load_index(split)
        assert str(exc.value).startswith(f"{split}/index.json: {says}")
        assert str(exc.value).endswith("rerun the shard stage")


@pytest.mark.slow
def test_evaluate_checks_the_exported_model_before_its_ranks_start(prepared, tmp_path):
    from transformers import AutoTokenizer

    repo = train_copy(prepared, tmp_path / "repo")
    update_params(repo, {"evaluate": {"ranks": 2}})  # on CPU, auto evaluates in one process
    final = tiny_checkpoint(repo / "models/final")
    AutoTokenizer.from_pretrained(repo / "data/tokenizer").save_pretrained(final)
    weights = final / "model.safetensors"
    size = weights.stat().st_size
    with open(weights, "r+b") as f:
        f.truncate(size - 10)
    proc = dsflow("evaluate", cwd=repo, check=False, timeout=TIMEOUT)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines()[-1] == (
        f"dsflow evaluate: error: models/final/model.safetensors: {size - 10} bytes, its header "
        f"describes {size} (truncated); rerun the train stage"
    )
    assert "torch.distributed.run" not in proc.stderr and "Traceback" not in proc.stderr
    (final / "tokenizer.json").unlink()
    proc = dsflow("evaluate", cwd=repo, check=False, timeout=TIMEOUT)
    assert proc.stderr.strip().splitlines()[-1] == (
        "dsflow evaluate: error: models/final/tokenizer.json: missing; rerun the train stage"
    )


# --------------------------------------------------------------------------- rank faults


def rank_pids(repo: Path) -> dict[int, int]:
    """{rank: PID} of the training ranks running in `repo`."""
    pids = {}
    for p in psutil.process_iter(["cmdline"]):
        try:
            if "dsflow.train.loop" in " ".join(p.info["cmdline"] or []) and p.cwd() == str(repo):
                pids[int(p.environ()["RANK"])] = p.pid
        except (psutil.NoSuchProcess, psutil.AccessDenied, KeyError):
            pass
    return pids


def gone(pid: int) -> bool:
    """Not running: no such process, or a zombie (its launcher, killed too, cannot reap it; a
    container's init may not either)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def steps_logged(repo: Path) -> int:
    tsv = repo / "dvclive/plots/metrics/train/loss.tsv"
    rows = tsv.read_text().splitlines()[1:] if tsv.exists() else []
    return len(rows)


@pytest.mark.slow
def test_a_rank_that_raises_is_one_line_naming_the_rank(prepared, tmp_path):
    repo = train_copy(prepared, tmp_path / "repo", checkpoint_every=1)
    env = {"DSFLOW_FAULT_RAISE": "2", "DSFLOW_FAULT_RANK": "1"}
    proc = dsflow("train", cwd=repo, check=False, timeout=TIMEOUT, env=env)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines()[-1] == (
        "dsflow train: error: training failed: rank 1 raised RuntimeError: injected fault: rank "
        "1 raised after step 2; rerun to resume from step00000001"
    )  # raised before the checkpoint of step 2
    assert proc.stderr.count("injected fault") == 1  # the rank's traceback is not on the terminal
    log = (repo / "logs/train.log").read_text()  # it is in the log
    assert "rank 1 (PID" in log and "in after_step" in log
    assert rank_pids(repo) == {}


def start_train(repo: Path, err: Path, env: dict) -> subprocess.Popen:
    with open(err, "w") as stderr:
        return start_stage("train", cwd=repo, env=env, stderr=stderr)


def stop_rank_1(repo: Path) -> int:
    """SIGSTOP rank 1 once the ranks trained two steps (the watchdog judges from step 2 on)."""
    wait_for(lambda: steps_logged(repo) >= 3, 240, "step 3 in loss.tsv")
    pid = rank_pids(repo)[1]
    os.kill(pid, signal.SIGSTOP)
    return pid


@pytest.fixture
def slow_run(prepared, tmp_path) -> Path:
    """A run of many slow steps (checkpoints every 2), which a hung rank must not outlast."""
    repo = train_copy(
        prepared, tmp_path / "repo", max_steps=400, checkpoint_every=2, collective_timeout_s=HANG_S
    )
    update_params(repo, {"train": {"eval_every": 1000}})
    return repo


@pytest.mark.slow
def test_a_stopped_rank_is_named_and_the_job_stopped(slow_run, tmp_path):
    repo, err = slow_run, tmp_path / "stderr"
    proc = start_train(repo, err, {"DSFLOW_FAULT_STEP_DELAY": "0.3"})
    try:
        pid = stop_rank_1(repo)
        t0 = time.time()
        code = proc.wait(timeout=HANG_S + launch.STOP_GRACE_S + 60)
        wall = time.time() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
    stderr = err.read_text()
    assert code == 2, stderr[-3000:]
    assert HANG_S <= wall < HANG_S + launch.STOP_GRACE_S + 30
    line = stderr.strip().splitlines()[-1]
    assert line.startswith(f"dsflow train: error: rank 1 (PID {pid}) made no progress for ")
    assert "(its process is stopped)" in line and f"train.collective_timeout_s: {HANG_S}" in line
    assert "stopped the job; rerun to resume from step0000000" in line
    assert rank_pids(repo) == {} and gone(pid)
    # Rank 0 waited for it in a collective, which failed after the run's timeout (not after
    # the 30 min that start-up and checkpoint saves are given).
    log = (repo / "logs/train.log").read_text()
    assert f"Timed out waiting {HANG_S * 1000}ms" in log


@pytest.mark.slow
def test_one_sigterm_ends_a_job_with_a_stopped_rank(slow_run, tmp_path):
    repo, err = slow_run, tmp_path / "stderr"
    proc = start_train(repo, err, {"DSFLOW_FAULT_STEP_DELAY": "0.3"})
    try:
        pid = stop_rank_1(repo)
        t0 = time.time()
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=HANG_S + launch.STOP_GRACE_S + 60)
        wall = time.time() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
    stderr = err.read_text()
    assert code == 128 + signal.SIGTERM, stderr[-3000:]
    assert wall < HANG_S + launch.STOP_GRACE_S + 30
    line = stderr.strip().splitlines()[-1]
    assert line.startswith("dsflow train: error: interrupted by SIGTERM: "), line
    assert "rank 1" in line and "rerun to resume from step0000000" in line
    assert rank_pids(repo) == {} and gone(pid)


# --------------------------------------------------------------------------- the pieces


def beat(folder: Path, rank: int, t: float, pid: int, step: int, marks: int, armed=True):
    (folder / f"rank{rank}.beat").write_bytes(launch.BEAT.pack(t, pid, step, marks, armed))


def test_the_watchdog_names_the_rank_behind_or_stopped(tmp_path):
    now = 1000.0
    watch = launch.Watchdog(tmp_path, 30, "dsflow.train.loop")
    # Rank 1 stopped in step 5 before its peer: a collective waits for it.
    beat(tmp_path, 0, now - 31, os.getpid(), 5, 3)
    beat(tmp_path, 1, now - 40, os.getpid(), 5, 2)
    line = watch.hung(now)
    assert line.startswith(f"rank 1 (PID {os.getpid()}) made no progress for 40 s in step 5")
    assert watch.hung(now - 15) is None  # silent, but not yet for the timeout
    # Level with its peer (a checkpoint save: rank 0 writes, the others wait): not hung.
    beat(tmp_path, 1, now - 40, os.getpid(), 5, 3)
    assert watch.hung(now) is None
    # Before training started (start-up may keep ranks apart for long): not judged.
    for rank in (0, 1):
        beat(tmp_path, rank, now - 400 - rank, os.getpid(), rank, 1, armed=False)
    assert watch.hung(now) is None
    # A stop request no rank can heed: every rank silent for the timeout since it came.
    assert watch.unheeded(since=now - 10, now=now) is None
    assert "within 30 s of the stop request" in watch.unheeded(since=now - 31, now=now)


def test_a_stopped_process_is_hung_even_level_with_its_peers(tmp_path):
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        os.kill(child.pid, signal.SIGSTOP)
        wait_for(lambda: launch.process_state(child.pid) == "T", 10, "the stopped state")
        now = time.time()
        beat(tmp_path, 0, now - 50, os.getpid(), 7, 4)
        beat(tmp_path, 1, now - 50, child.pid, 7, 4)
        line = launch.Watchdog(tmp_path, 30, "dsflow.train.loop").hung(now)
        assert line.startswith(f"rank 1 (PID {child.pid}) made no progress for 50 s in step 7")
        assert "(its process is stopped)" in line
    finally:
        child.kill()
        child.wait()


def test_the_heartbeat_is_what_the_watchdog_reads(tmp_path, monkeypatch):
    monkeypatch.setenv(launch.RANKS_DIR_ENV, str(tmp_path))
    monkeypatch.setenv("RANK", "3")
    heart = launch.Heartbeat.from_env()
    heart.step_begins(12)
    heart.beat()
    heart.arm()
    got = launch.read_beats(tmp_path)[3]
    assert (got.pid, got.step, got.marks, got.armed) == (os.getpid(), 12, 3, True)
    assert abs(got.time - time.time()) < 5
    assert len((tmp_path / "rank3.beat").read_bytes()) == struct.calcsize("<dqqqq")


def error(rank, t, kind, message, peer_lost=False):
    return {"rank": rank, "pid": 100 + rank, "time": t, "type": kind, "message": message,
            "peer_lost": peer_lost, "traceback": ""}  # fmt: skip


def test_the_first_cause_names_the_rank_not_the_peers_that_lost_it():
    lost = error(0, 1.0, "RuntimeError", "[gloo] Connection reset by peer", peer_lost=True)
    cause = error(2, 2.0, "ValueError", "bad value")
    assert rank_failure([lost, cause], {}) == "rank 2 raised ValueError: bad value"
    usage = error(1, 1.0, "UsageError", "pretrained checkpoint 'x' lacks 3 weight(s)")
    assert rank_failure([usage], {}) == "rank 1: pretrained checkpoint 'x' lacks 3 weight(s)"
    # Only lost peers: the rank that raised nothing died of a signal (OOM killer, SIGKILL).
    beats = {r: launch.RankBeat(r, 0.0, 100 + r, 3, 1, True) for r in range(3)}
    line = rank_failure([lost, error(2, 1.5, "RuntimeError", "gloo", peer_lost=True)], beats)
    assert line.startswith("rank 1 (PID 101) ended without a Python exception")
    assert rank_failure([], beats) is None
