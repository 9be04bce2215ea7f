"""Several nodes on one machine: 2 "nodes" x 2 CPU ranks train exactly what 4 ranks on one node
train, whether each node's stage is started by hand or by SLURM's srun (a stand-in on PATH)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from conftest import dsflow, losses, start_stage, tiny_run, update_params
from dsflow.launch import free_port

pytestmark = pytest.mark.slow

RUN = tiny_run(gpus=4, steps=3)
TWO_NODES = {"train": {"gpus": 2, "nodes": 2}}


def copy_of(prepared, dest, *overlays):
    shutil.copytree(prepared, dest)
    for overlay in (RUN, *overlays):
        update_params(dest, overlay)
    return dest


def start_node(repo, rank: int, **extra_env) -> subprocess.Popen:
    return start_stage(
        "train",
        cwd=repo,
        env={"NODE_RANK": str(rank), **extra_env},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


# Seconds this machine took, under its load at the time, to train the one-node run: start 4 CPU
# ranks, train 3 steps, save. A phase of two nodes does about as much (and waits 1 s a step),
# so it gets a multiple of that, never less than 300 s: on a loaded 2-core machine the ranks'
# start alone (8 processes importing torch and DeepSpeed) takes minutes.
PACE: dict[str, float] = {}


def phase_timeout() -> float:
    return max(300.0, 4 * PACE.get("one_node_s", 0.0))


def finish(procs, timeout=None) -> list[tuple[int, str]]:
    """Each node's (exit status, stderr); past the timeout, every node is killed and the
    failure shows the end of what each printed, so a hang says where it hung."""
    timeout = timeout or phase_timeout()
    deadline = time.monotonic() + timeout
    out = []
    for proc in procs:
        try:
            _, err = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            tails = [(p.communicate()[1] or "")[-2000:] for p in procs]
            said = "\n".join(f"--- node {i}:\n{t}" for i, t in enumerate(tails))
            raise AssertionError(f"the nodes did not finish in {timeout:.0f} s\n{said}") from None
        out.append((proc.returncode, err))
    return out


@pytest.fixture(scope="module")
def one_node(prepared, tmp_path_factory):
    """4 ranks on one node."""
    repo = copy_of(prepared, tmp_path_factory.mktemp("one") / "repo")
    started = time.monotonic()
    dsflow("train", cwd=repo, timeout=600)
    PACE["one_node_s"] = time.monotonic() - started
    return repo


FAKE_SRUN = r"""#!/usr/bin/env bash
# A stand-in for SLURM's srun on one machine: records its arguments, then runs the command once
# per "node" with the variables srun sets, and exits with the worst status.
printf '%s\n' "$@" > "$FAKE_SRUN_ARGS"
nodes=1
while [[ "$1" == -* ]]; do
  case "$1" in --nodes=*) nodes="${1#--nodes=}";; esac
  shift
done
pids=()
for ((i = 0; i < nodes; i++)); do
  SLURM_NODEID=$i SLURM_PROCID=$i SLURM_STEP_NUM_NODES=$nodes SLURM_STEP_NUM_TASKS=$nodes "$@" &
  pids+=($!)
done
rc=0
for pid in "${pids[@]}"; do wait "$pid" || rc=$?; done
exit $rc
"""


def test_under_slurm_the_stage_runs_once_per_node_with_srun(prepared, one_node, tmp_path):
    repo = copy_of(prepared, tmp_path / "repo", TWO_NODES)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text(FAKE_SRUN)
    (bin_dir / "srun").chmod(0o755)
    args = tmp_path / "srun.args"
    env = {
        "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        "FAKE_SRUN_ARGS": str(args),
        # what the stage sees in the job step Snakemake's SLURM executor starts (srun -n1)
        "SLURM_JOB_ID": "4242",
        "SLURM_STEP_NUM_NODES": "1",
        "SLURM_STEP_NUM_TASKS": "1",
        "SLURM_GPUS": "4",
    }
    proc = dsflow("train", cwd=repo, env=env, timeout=600)
    assert args.read_text().split("\n")[:6] == [
        "--overlap",
        "--nodes=2",
        "--ntasks=2",
        "--ntasks-per-node=1",
        "--kill-on-bad-exit=1",
        sys.executable,
    ]
    assert "SLURM job 4242: the train stage on 2 nodes" in proc.stderr
    assert "this is node 0" in proc.stderr and "done: node 1 of 2" in proc.stderr
    assert "SLURM job 4242" in (repo / "logs/train.log").read_text()
    for rank in (0, 1):
        assert f"this is node {rank}" in (repo / f"logs/train.node{rank}.log").read_text()
    assert losses(repo) == losses(one_node)


def test_a_node_with_other_params_is_refused(prepared, tmp_path):
    repo = copy_of(prepared, tmp_path / "repo", TWO_NODES)
    update_params(repo, {"train": {"master_addr": "127.0.0.1", "master_port": free_port()}})
    (repo / "other.yaml").write_text("train:\n  optimizer:\n    lr: 0.001\n")
    other = {"DSFLOW_PROFILES": "other.yaml"}  # node 1 has other params
    (code0, err0), (code1, err1) = finish([start_node(repo, 0), start_node(repo, 1, **other)])
    assert (code0, code1) == (2, 2)
    last = err1.strip().splitlines()[-1]
    assert "planned a different run than node 0" in last and "same params and data" in last
    assert "another node planned a different run than node 0" in err0.strip().splitlines()[-1]
    assert not (repo / "models/final").exists()


def test_a_signal_to_one_node_stops_every_rank_and_two_torchrun_nodes_resume_the_run(
    prepared, one_node, tmp_path
):
    """Two nodes started by hand (torchrun each): SIGTERM to node 1 stops every rank of both at
    a checkpoint. Started again, they resume and finish the run 4 ranks on one node train,
    loss for loss: the same world, data and math."""
    repo = copy_of(prepared, tmp_path / "repo", TWO_NODES)
    update_params(repo, {"train": {"master_addr": "127.0.0.1", "master_port": free_port()}})
    slow = {"DSFLOW_FAULT_STEP_DELAY": "1"}
    procs = [start_node(repo, 0, **slow), start_node(repo, 1, **slow)]
    tsv = repo / "dvclive/plots/metrics/train/loss.tsv"
    deadline = time.monotonic() + phase_timeout()
    while not (tsv.exists() and len(tsv.read_text().splitlines()) > 1):
        if time.monotonic() > deadline or procs[1].poll() is not None:
            finish(procs, timeout=1)  # kills both, and fails with what each printed
            pytest.fail("no step logged")
        time.sleep(0.2)
    procs[1].send_signal(signal.SIGTERM)  # node 1 only
    (code0, err0), (code1, err1) = finish(procs)
    saved = (repo / "checkpoints/latest").read_text().strip()
    assert saved in ("step00000001", "step00000002")
    assert code1 == 128 + signal.SIGTERM, err1[-3000:]
    assert (
        err1.strip()
        .splitlines()[-1]
        .endswith(f"interrupted by SIGTERM: checkpoint {saved} saved; rerun to resume from it")
    )
    assert code0 == 2, err0[-3000:]
    assert (
        err0.strip()
        .splitlines()[-1]
        .endswith(
            f"the ranks stopped on request (checkpoints/.stop): checkpoint {saved} saved; rerun to "
            "resume from it"
        )
    )
    assert not (repo / "checkpoints/.stop").exists() and not (repo / "models/final").exists()

    (code0, err0), (code1, err1) = finish([start_node(repo, 0), start_node(repo, 1)])
    assert code0 == 0, err0[-3000:]
    assert code1 == 0, err1[-3000:]
    assert f"resumed from step {int(saved[4:])}" in err0 + err1
    assert losses(repo) == losses(one_node)  # exactly equal
    assert len(losses(repo)) == 3
    metrics = json.loads((repo / "metrics/train.json").read_text())
    assert metrics["world_size"] == 4 and metrics["tokens"] == 3 * 2 * 4 * 32
    assert "(2 nodes, this is node 0)" in err0 and "done: models/final" in err0
    assert "(2 nodes, this is node 1)" in err1 and "done: node 1 of 2" in err1
    step = repo / "checkpoints/step00000003"
    assert len(list(step.glob("zero_pp_rank_*_optim_states.pt"))) == 4
    assert not (repo / "checkpoints/.lock").exists()
    assert "this is node 0" in (repo / "logs/train.log").read_text()
    assert "this is node 1" in (repo / "logs/train.node1.log").read_text()
    run = json.loads((repo / "checkpoints/run.json").read_text())
    assert run["world"] == 4 and run["nodes"] == 2 and run["local_ranks"] == 2
