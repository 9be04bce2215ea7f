"""profiles/slurm: what the train rule asks SLURM for, checked on the sbatch call itself (a
stand-in sbatch on PATH records it; no SLURM here)."""

from __future__ import annotations

import os
import signal
import subprocess
import time

import pytest

from conftest import SMALL_PARAMS, copy_project, run, update_params

pytestmark = pytest.mark.slow

CLUSTER = {"train": {"device": "cuda", "gpus": 4, "nodes": 2}}

# sbatch.args appears by rename, last, so a test that sees it reads both files complete.
FAKE_SBATCH = """#!/bin/sh
printf '%s\\n' "$@" > "$FAKE_SLURM/sbatch.args.tmp"
cat > "$FAKE_SLURM/sbatch.stdin"
mv "$FAKE_SLURM/sbatch.args.tmp" "$FAKE_SLURM/sbatch.args"
echo 4242
"""
FAKE_SACCTMGR = "#!/bin/sh\necho my-account\n"  # the account check of the executor plugin


def fake_slurm(tmp_path) -> dict:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("sbatch", FAKE_SBATCH), ("sacctmgr", FAKE_SACCTMGR)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    return {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "FAKE_SLURM": str(tmp_path)}


def with_train_inputs(repo):
    """Upstream outputs in place (newer than the code), so only the train job is submitted."""
    (repo / "data").mkdir(exist_ok=True)
    (repo / "data/pretrained.json").write_text("{}\n")
    for out in ("data/raw", "data/tokenizer", "data/tokens", "data/shards"):
        (repo / out).mkdir(parents=True)
        (repo / out / "placeholder").write_text("")
    (repo / "reports").mkdir()
    (repo / "reports/plan.json").write_text("{}\n")


def submit(repo, env, tmp_path, timeout=240) -> list[str]:
    """Run `snakemake --profile profiles/slurm train` until it has called sbatch; its args."""
    args = tmp_path / "sbatch.args"
    proc = subprocess.Popen(
        ["snakemake", "--profile", "profiles/slurm", "train"],
        cwd=repo,
        env={**os.environ, **env},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    deadline = time.monotonic() + timeout
    try:
        while not args.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.5)
    finally:
        if proc.poll() is None:  # it now waits for the job to finish: stop it
            os.killpg(proc.pid, signal.SIGKILL)
        out = proc.communicate()[0]
    assert args.exists(), out[-3000:]
    return args.read_text().splitlines()


def test_train_job_asks_for_nodes_gpus_per_node_and_one_task_per_node(tmp_path):
    repo = copy_project(tmp_path / "repo")
    update_params(repo, SMALL_PARAMS)
    update_params(repo, CLUSTER)
    with_train_inputs(repo)
    env = fake_slurm(tmp_path)

    dry = run(["snakemake", "-n", "--profile", "profiles/slurm", "train"], cwd=repo, env=env)
    jobs = [line for line in dry.stdout.splitlines() if line.startswith("rule ")]
    assert jobs == ["rule train:"], dry.stdout[-2000:]
    resources = next(x for x in dry.stdout.splitlines() if x.strip().startswith("resources:"))
    for item in ("nodes=2", "gres=gpu:4", "gpus=4", "slurm_partition=gpu", "runtime=2880"):
        assert item in resources
    # device auto too: the submit host has no GPUs, the cluster's train nodes do.
    update_params(repo, {"train": {"device": "auto"}})
    dry = run(["snakemake", "-n", "--profile", "profiles/slurm", "train"], cwd=repo, env=env)
    resources = next(x for x in dry.stdout.splitlines() if x.strip().startswith("resources:"))
    assert "gres=gpu:4" in resources and "gpus=4" in resources, resources
    update_params(repo, {"train": {"device": "cuda"}})

    args = submit(repo, env, tmp_path)
    call = " ".join(args)
    assert "-p gpu" in call and "-A my-account" in call
    assert "-t 2880" in call  # minutes
    assert "--mem 480000" in call  # MB per node
    assert "--nodes=2" in args
    assert "--gres=gpu:4" in args  # GPUs per node
    assert "--cpus-per-task=32" in args
    # no task count: with --nodes and GPUs, sbatch runs one task per node
    assert not [a for a in args if a.startswith(("--ntasks", "-n"))]
    wrap = next(a for a in args if a.startswith("--wrap="))
    # on the first node, Snakemake's jobstep executor runs the rule, whose stage then starts
    # itself on every node (srun; tests/e2e/test_multinode.py)
    assert "--target-jobs 'train:'" in wrap and "--executor slurm-jobstep" in wrap


def test_evaluate_job_asks_for_one_node_with_the_gpus(tmp_path):
    repo = copy_project(tmp_path / "repo")
    update_params(repo, CLUSTER)
    with_train_inputs(repo)
    dry = run(["snakemake", "-n", "--profile", "profiles/slurm", "evaluate"], cwd=repo).stdout
    jobs = dry.split("rule ")
    evaluate = next(j for j in jobs if j.startswith("evaluate:"))
    resources = next(x for x in evaluate.splitlines() if x.strip().startswith("resources:"))
    assert "nodes=1" in resources and "gres=gpu:4" in resources
    train = next(j for j in jobs if j.startswith("train:"))
    assert "nodes=2" in train


def test_cpu_train_job_asks_for_one_task_per_node(tmp_path):
    repo = copy_project(tmp_path / "repo")
    update_params(repo, {"train": {"device": "cpu", "gpus": 4, "nodes": 3}})
    with_train_inputs(repo)
    args = submit(repo, fake_slurm(tmp_path), tmp_path)
    assert "--nodes=3" in args and "--ntasks=3" in args
    assert not [a for a in args if a.startswith(("--gres", "--gpus"))]
