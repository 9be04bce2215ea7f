"""A clone used the usual way: a venv inside it, Snakemake then DVC, the README's commands.

A venv in the checkout is neither copied nor walked by the tests' project copies; the mtime
marker Snakemake leaves in a folder output does not make DVC see it modified; a train stage
started on a run that checkpoints/ holds finished writes that run's outputs again, not a run of
no step; a resumed run's wall_s counts its earlier parts; an ad-hoc plan leaves the plan stage's
output alone; a failed or interrupted stage leaves the previous output as it was.
"""

from __future__ import annotations

import json
import math
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

import conftest
from conftest import dsflow, rewound_copy, run, start_stage, tiny_run, update_params

# --------------------------------------------------------------------------- a venv inside


def fake_venv(folder: Path) -> Path:
    """What `python -m venv` leaves that matters here: pyvenv.cfg, and a big-ish file."""
    (folder / "lib/python3/site-packages").mkdir(parents=True)
    (folder / "pyvenv.cfg").write_text("home = /usr/bin\n")
    (folder / "lib/python3/site-packages/big.bin").write_bytes(b"\0" * (4 << 20))
    return folder


@pytest.fixture
def checkout(tmp_path, monkeypatch) -> Path:
    """A small git checkout with the project's .gitignore, the tests' ROOT: a venv at .venv,
    another under any name deeper down, and stage outputs the README says to commit."""
    root = tmp_path / "clone"
    (root / "workflow/dsflow").mkdir(parents=True)
    (root / "workflow/dsflow/stage.py").write_text("print('a stage')\n")
    shutil.copy(conftest.ROOT / ".gitignore", root / ".gitignore")
    (root / "data").mkdir()
    (root / "data/.gitignore").write_text("/raw\n")
    run(["git", "init", "-q"], cwd=root)
    for folder in ("metrics", "dvclive"):
        (root / folder).mkdir()
        (root / folder / "train.json").write_text("{}\n")
    run(["git", "add", "-A"], cwd=root)  # what the README's commit after `dvc repro` adds
    fake_venv(root / ".venv")
    fake_venv(root / "tools/py311")  # a venv no .gitignore names
    monkeypatch.setattr(conftest, "ROOT", root)
    return root


PROJECT = [".gitignore", "data/.gitignore", "workflow/dsflow/stage.py"]


def test_a_venv_in_the_checkout_is_not_copied(checkout, tmp_path):
    listed = run(["git", "ls-files", "--others", "--exclude-standard"], cwd=checkout).stdout
    assert ".venv/" not in listed  # .gitignore names it
    assert sorted(conftest.project_files()) == PROJECT
    copy = conftest.copy_project(tmp_path / "copy")
    assert sorted(str(p.relative_to(copy)) for p in copy.rglob("*") if p.is_file()) == PROJECT


def test_a_venv_in_a_checkout_without_git_is_not_walked(checkout, monkeypatch):
    def no_git(*args, **kwargs):
        raise FileNotFoundError("git")

    walked = []
    iterdir = Path.iterdir

    def recorded(self):
        walked.append(self)
        return iterdir(self)

    monkeypatch.setattr(conftest.subprocess, "run", no_git)
    monkeypatch.setattr(Path, "iterdir", recorded)
    assert conftest.project_files() == PROJECT
    venvs = (checkout / ".venv", checkout / "tools/py311")
    assert walked and not [p for p in walked if any(p.is_relative_to(v) for v in venvs)]


def test_dvc_ignores_snakemakes_marker_and_venvs(tmp_path):
    """Snakemake marks a finished directory() output (data/raw, models/final, ...) with a
    .snakemake_timestamp file in it: with the project's .dvcignore DVC still finds the output
    as it recorded it, and never walks a venv."""
    repo = tmp_path / "repo"
    repo.mkdir()
    shutil.copytree(conftest.ROOT / ".dvc", repo / ".dvc", ignore=shutil.ignore_patterns("tmp"))
    shutil.copy(conftest.ROOT / ".dvcignore", repo / ".dvcignore")
    (repo / "dvc.yaml").write_text(
        "stages:\n  download:\n    cmd: mkdir -p data/raw && echo x > data/raw/train.parquet\n"
        "    outs:\n      - data/raw\n"
    )
    run(["git", "init", "-q"], cwd=repo)
    run(["dvc", "repro", "-q"], cwd=repo)
    (repo / "data/raw/.snakemake_timestamp").touch()
    assert json.loads(run(["dvc", "status", "--json"], cwd=repo).stdout) == {}
    from dvc.repo import Repo

    with Repo(str(repo)) as dvc:
        for venv in (".venv", "venv", "env"):
            assert dvc.dvcignore.is_ignored_dir(str(repo / venv))


# --------------------------------------------------------------------------- a finished run again

RUN = tiny_run(gpus=1, steps=4, checkpoint_every=2, eval_every=2)
DELAY_S = 3  # per step of the first run: its first part is longer than a resumed part


@pytest.fixture(scope="module")
def finished(prepared, tmp_path_factory) -> Path:
    """A run trained to its end: 4 steps of 3 s or more, checkpoints at 2 and 4."""
    repo = tmp_path_factory.mktemp("finished") / "repo"
    shutil.copytree(prepared, repo)
    update_params(repo, RUN)
    dsflow("train", cwd=repo, timeout=900, env={"DSFLOW_FAULT_STEP_DELAY": str(DELAY_S)})
    return repo


def outputs(repo: Path) -> dict[str, bytes]:
    """models/final, metrics/train.json and dvclive/, file by file."""
    files = {}
    for top in ("models/final", "metrics/train.json", "dvclive"):
        path = repo / top
        found = sorted(path.rglob("*")) if path.is_dir() else [path]
        for f in found:
            if f.is_file() and f.name != ".snakemake_timestamp":
                files[str(f.relative_to(repo))] = f.read_bytes()
    return files


def as_the_front_ends_leave_it(finished: Path, dest: Path) -> Path:
    """A copy of the finished run as DVC leaves it when it runs the stage again: its
    non-persistent outputs (models/final, metrics/train.json) removed."""
    shutil.copytree(finished, dest)
    shutil.rmtree(dest / "models/final")
    (dest / "metrics/train.json").unlink()
    return dest


def health_at(repo: Path, step: int) -> dict:
    """The health state (and clock) the checkpoint of `step` keeps."""
    states = repo / f"checkpoints/step{step:08d}/mp_rank_00_model_states.pt"
    return torch.load(states, map_location="cpu", weights_only=False)["health"]


def test_a_finished_run_started_again_writes_its_outputs_again(finished, tmp_path):
    """Snakemake trains, then `dvc repro` (no dvc.lock yet) runs the stage again: the run in
    checkpoints/ is finished, and the stage writes what that run wrote, byte for byte, not
    a "resumed" run of no step with a NaN loss."""
    before = outputs(finished)
    metrics = json.loads(before["metrics/train.json"])
    assert math.isfinite(metrics["train_loss"]) and metrics["wall_s"] >= 4 * DELAY_S
    repo = as_the_front_ends_leave_it(finished, tmp_path / "again")
    proc = dsflow("train", cwd=repo, timeout=900)
    assert "step00000004: this run is finished" in proc.stderr
    assert "metrics/train.json as it recorded them" in proc.stderr
    assert outputs(repo) == before


def test_a_finished_run_that_kept_no_record_rebuilds_its_metrics(finished, tmp_path):
    """Checkpoints of an older dsflow, or a run stopped between its last checkpoint and its
    outputs, keep no record: the metrics come from dvclive/ and a validation, never NaN."""
    repo = as_the_front_ends_leave_it(finished, tmp_path / "norecord")
    shutil.rmtree(repo / "checkpoints/step00000004/finished")
    proc = dsflow("train", cwd=repo, timeout=900)
    assert "metrics/train.json rebuilt from dvclive/" in proc.stderr
    want = json.loads((finished / "metrics/train.json").read_text())
    got = json.loads((repo / "metrics/train.json").read_text())
    # The last step's, as dvclive logged it.
    assert got["train_loss"] == pytest.approx(want["train_loss"], rel=1e-6)
    assert got["val_loss"] == pytest.approx(want["val_loss"], rel=1e-6)
    assert got["wall_s"] == health_at(finished, 4)["wall_s"] >= 4 * DELAY_S
    assert got["step"] == 4 and got["tokens_per_s"] > 0
    assert (repo / "models/final/model.safetensors").read_bytes() == (
        finished / "models/final/model.safetensors"
    ).read_bytes()


def test_a_resumed_runs_wall_time_counts_its_earlier_parts(finished, tmp_path):
    repo = rewound_copy(finished, tmp_path / "resumed", 2)
    earlier = health_at(finished, 2)["wall_s"]
    assert earlier >= 2 * DELAY_S
    started = time.perf_counter()
    dsflow("train", cwd=repo, timeout=900)
    this_part = time.perf_counter() - started
    wall = json.loads((repo / "metrics/train.json").read_text())["wall_s"]
    assert earlier < wall < earlier + this_part


def test_ctrl_c_in_train_keeps_the_previous_outputs(finished, tmp_path):
    """SIGINT (a terminal's Ctrl-C) to a train stage continuing the finished run: it stops at
    a checkpoint and leaves models/final and metrics/train.json as they were (it removes no
    output; only a new complete one replaces it)."""
    repo = tmp_path / "more"
    shutil.copytree(finished, repo)
    before = {k: v for k, v in outputs(repo).items() if not k.startswith("dvclive")}
    update_params(repo, {"train": {"max_steps": 40, "checkpoint_every": 40}})
    proc = start_stage(
        "train",
        cwd=repo,
        env={"DSFLOW_FAULT_STEP_DELAY": "1"},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    tsv = repo / "dvclive/plots/metrics/train/loss.tsv"
    deadline = time.monotonic() + 600
    while len(tsv.read_text().splitlines()) < 6:  # header, 4 steps, and one of this run
        assert time.monotonic() < deadline and proc.poll() is None, "no step trained"
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 128 + signal.SIGINT, err[-3000:]
    assert "interrupted by SIGINT" in err.strip().splitlines()[-1]
    after = {k: v for k, v in outputs(repo).items() if not k.startswith("dvclive")}
    assert after == before


# --------------------------------------------------------------------------- ad-hoc plans

ASK = ("--model", "deepseek-v2", "--gpus", "3", "--gpu-mem", "24", "--host-mem", "256")


def test_an_ad_hoc_plan_leaves_the_stages_output_alone(project):
    dsflow("plan", cwd=project)
    plan = project / "reports/plan.json"
    stage = plan.read_bytes()
    proc = dsflow("plan", *ASK, cwd=project, check=False)
    assert proc.returncode == 1 and "nothing fits deepseek-v2" in proc.stderr
    assert "verdict: " in proc.stdout and plan.read_bytes() == stage
    assert "reports/plan.json is the stage's and stays as it is" in proc.stderr
    proc = dsflow("plan", "--model", "medium", "--gpu-mem", "24", "--out", "ask.json", cwd=project)
    asked = json.loads((project / "ask.json").read_text())
    assert asked["request"]["preset"] == "medium" and plan.read_bytes() == stage
    proc = dsflow("plan", *ASK, "--out", "reports/plan.json", cwd=project, check=False)
    line = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode == 2 and line.startswith("dsflow plan: error: --out reports/plan.json:")
    assert plan.read_bytes() == stage


# --------------------------------------------------------------------------- failed stages


def test_a_failed_download_leaves_the_previous_data(project, tmp_path):
    """A mistyped corpus path, and a file that fails halfway through the copy: the stage fails
    in one line and data/raw stays as the last good download left it."""
    dsflow("download", cwd=project)
    raw = project / "data/raw"
    good = {p.name: p.read_bytes() for p in raw.iterdir()}
    files = {"source": "files", "files": {"paths": ["corpsu/*.txt"], "store": "copy"}}
    update_params(project, {"download": files})
    proc = dsflow("download", cwd=project, check=False)
    assert proc.returncode == 2 and "matches no file" in proc.stderr.strip().splitlines()[-1]
    assert {p.name: p.read_bytes() for p in raw.iterdir()} == good
    corpus = tmp_path / "corpus.txt"
    corpus.write_bytes(b"A line of text.\n\n" * 20000 + b"\xff not UTF-8\n")
    update_params(project, {"download": {"files": {"paths": [str(corpus)], "store": "copy"}}})
    proc = dsflow("download", cwd=project, check=False)
    assert proc.returncode == 2 and "not valid UTF-8" in proc.stderr.strip().splitlines()[-1]
    assert {p.name: p.read_bytes() for p in raw.iterdir()} == good
    assert not list(raw.parent.glob(".raw.tmp-*"))


# --------------------------------------------------------------------------- both front-ends


@pytest.mark.slow
def test_snakemake_then_dvc_then_the_readmes_commit_and_diff(snakemake_trained, tmp_path):
    """The README's order in a clone: Snakemake trains, `dvc repro` (no dvc.lock yet) runs the
    stages again and finds the run finished, the README's `git add` commits it, a second run
    is committed the same way and `dvc metrics diff` compares two real runs; Snakemake's
    folder markers never make `dvc status` see a change."""
    # A clone is a committed checkout with .dvc/ shipped; Snakemake trained in it once per test
    # run (conftest), copied here to go on from.
    repo = shutil.copytree(snakemake_trained, tmp_path / "origin", symlinks=True)
    by_snakemake = outputs(repo)
    run(["dvc", "repro", "train"], cwd=repo)
    assert outputs(repo) == by_snakemake
    metrics = json.loads((repo / "metrics/train.json").read_text())
    assert math.isfinite(metrics["train_loss"]) and metrics["wall_s"] > 0.1

    readme = "git add dvc.lock params.yaml metrics dvclive && git commit -qm run1"
    run(["bash", "-c", readme], cwd=repo)
    assert run(["git", "status", "--porcelain"], cwd=repo).stdout == ""
    # Snakemake marks its folder outputs as up to date: a .snakemake_timestamp in each.
    run(["snakemake", "--cores", "1", "--touch", "--forceall", "train"], cwd=repo)
    assert (repo / "data/raw/.snakemake_timestamp").exists()
    assert json.loads(run(["dvc", "status", "train", "--json"], cwd=repo).stdout) == {}

    update_params(repo, {"train": {"optimizer": {"lr": 0.001}}})
    run(["dvc", "repro", "train"], cwd=repo)
    run(["bash", "-c", readme.replace("run1", "run2")], cwd=repo)
    diff = run(["dvc", "metrics", "diff", "HEAD~1", "HEAD", "--json"], cwd=repo).stdout
    changed = json.loads(diff)["metrics/train.json"]
    assert "val_loss" in changed and "wall_s" in changed
    numbers = [v for d in changed.values() for v in (d["old"], d["new"]) if isinstance(v, float)]
    assert numbers and all(math.isfinite(v) for v in numbers)
    baseline = json.loads(run(["git", "show", "HEAD~1:metrics/train.json"], cwd=repo).stdout)
    assert baseline == metrics  # the committed baseline is the run Snakemake trained
