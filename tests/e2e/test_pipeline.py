"""Both front-ends drive one DAG in a real git + DVC repo: no-ops, partial reruns, determinism."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from conftest import SMALL_PARAMS, commit_all, copy_project, git_dvc_repo, run, update_params

pytestmark = pytest.mark.slow

DATA_STAGES = ("pretrained", "download", "tokenizer", "tokenize", "shard")


def git_changes(repo: Path) -> set[str]:
    """The paths `git status` shows as changed or new."""
    out = run(["git", "status", "--porcelain", "--untracked-files=all"], cwd=repo).stdout
    return {line[3:] for line in out.splitlines()}


def snakemake_jobs(repo, *args) -> set[str]:
    """Rules Snakemake would run (dry run)."""
    out = run(["snakemake", "-n", "--cores", "1", *args], cwd=repo).stdout
    if "Nothing to be done" in out:
        return set()
    return set(re.findall(r"^rule (\w+):", out, flags=re.M)) - {"all"}


def dvc_ran(output: str) -> set[str]:
    return set(re.findall(r"Running stage '(\w+)'", output))


def test_dvc_repro_then_snakemake_and_dvc_are_up_to_date(tmp_path):
    repo = git_dvc_repo(tmp_path / "repo")
    first = run(["dvc", "repro", "shard"], cwd=repo)
    assert dvc_ran(first.stdout) == set(DATA_STAGES)
    # DVC's own files (.dvc/tmp, .dvc/cache) and the stage outputs stay out of git's way.
    assert git_changes(repo) == {"dvc.lock"}
    digests = {p.name: p.read_bytes() for p in (repo / "data/shards/train").iterdir()}

    assert snakemake_jobs(repo, "shard") == set()
    second = run(["dvc", "repro", "shard"], cwd=repo)
    assert dvc_ran(second.stdout) == set()
    assert "up to date" in run(["dvc", "status", "--with-deps", "shard"], cwd=repo).stdout

    update_params(repo, {"tokenizer": {"vocab_size": 400}})
    status = run(["dvc", "status", "--with-deps", "shard"], cwd=repo).stdout
    changed = set(re.findall(r"^(\w+):", status, flags=re.M))
    assert changed == {"tokenizer"}  # DVC reports the direct change; repro cascades
    third = run(["dvc", "repro", "shard"], cwd=repo)
    assert dvc_ran(third.stdout) == {"tokenizer", "tokenize", "shard"}

    # Back to the first params: DVC's run cache restores the outputs without running...
    update_params(repo, {"tokenizer": {"vocab_size": SMALL_PARAMS["tokenizer"]["vocab_size"]}})
    fourth = run(["dvc", "repro", "shard"], cwd=repo)
    assert dvc_ran(fourth.stdout) == set() and "cached" in fourth.stdout
    assert {p.name: p.read_bytes() for p in (repo / "data/shards/train").iterdir()} == digests
    # ...and really running the stages again gives byte-identical outputs.
    fifth = run(["dvc", "repro", "--no-run-cache", "--force", "shard"], cwd=repo)
    assert dvc_ran(fifth.stdout) == set(DATA_STAGES)
    assert {p.name: p.read_bytes() for p in (repo / "data/shards/train").iterdir()} == digests


def check_snakemake_reruns_only_what_a_param_touches(repo: Path) -> None:
    """In a project Snakemake has run the data stages of."""
    assert (repo / "data/shards/train/index.json").exists()
    assert (repo / "logs/shard.log").exists()
    assert snakemake_jobs(repo, "shard") == set()

    update_params(repo, {"tokenizer": {"vocab_size": 400}})
    assert snakemake_jobs(repo, "shard") == {"tokenizer", "tokenize", "shard"}
    run(["snakemake", "--cores", "2", "shard"], cwd=repo)
    assert snakemake_jobs(repo, "shard") == set()


def test_overlay_reaches_the_stage_through_snakemake(tmp_path):
    repo = copy_project(tmp_path / "repo")
    update_params(repo, SMALL_PARAMS)
    (repo / "overlay.yaml").write_text("download:\n  max_docs: 123\n")
    run(["snakemake", "--cores", "1", "download", "--configfile", "overlay.yaml"], cwd=repo)
    manifest = json.loads((repo / "data/raw/manifest.json").read_text())
    assert manifest["splits"]["train"]["docs"] + manifest["splits"]["val"]["docs"] == 123
    shutil.rmtree(repo / "data/raw")


def exp_show(repo: Path, *args: str) -> tuple[list[str], str]:
    """`dvc exp show` with `args`, as CSV: its column names, and its output. (The table's
    header is no place to read names from: DVC draws the table at most 1024 characters wide
    and shortens the names of a wider one.)"""
    out = run(["dvc", "exp", "show", *args, "--csv"], cwd=repo).stdout
    return out.splitlines()[0].split(","), out


def check_readme_exp_show(repo: Path) -> None:
    """The README's `dvc exp show -n 2 --only-changed`, printed to a pipe, not a terminal:
    the table holds the changed param, named in full, and both of its values."""
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES", "TERM")}
    out = subprocess.run(
        ["dvc", "exp", "show", "-n", "2", "--only-changed"],
        cwd=repo,
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    header = next(line for line in out.splitlines() if line.split()[:1] == ["Experiment"])
    print(f"dvc exp show -n 2 --only-changed: {len(header)} characters wide")
    assert "train.optimizer.lr" in header.split(), header
    assert "0.001" in out and "0.003" in out


def check_exp_show(repo: Path) -> None:
    """The commands docs/evaluation.md gives for `dvc exp show`, after two runs that differ in
    train.optimizer.lr: each prints that change, and no column that did not change."""
    sections = set(yaml.safe_load((repo / "params.yaml").read_text()))  # seed, train, ...
    # Every column, as CSV: the plain table has too many to print them all.
    every = run(["dvc", "exp", "show", "-n", "2", "--csv"], cwd=repo).stdout.splitlines()[0]
    every = every.split(",")
    changed, _ = exp_show(repo, "-n", "2", "--only-changed")
    assert "train.optimizer.lr" in changed and "models/final" in changed
    unchanged = {"train.optimizer.betas", "seed", "model.preset"}
    assert unchanged <= set(every) and not unchanged & set(changed)
    no_deps, _ = exp_show(repo, "-n", "2", "--only-changed", "--drop", ".*/[^:]*$")
    params = [c for c in no_deps if c.split(".")[0] in sections]
    assert params == ["train.optimizer.lr"]
    assert "bits_per_byte" in no_deps and not [c for c in no_deps if "/" in c and ":" not in c]
    keep = "Experiment|train\\.optimizer\\.lr|.*val_loss|bits_per_byte"
    kept, out = exp_show(repo, "-n", "2", "--drop", ".*", "--keep", keep)
    assert kept == [
        "Experiment",
        "metrics/train.json:val_loss",
        "bits_per_byte",
        "metrics/eval.json:val_loss",
        "train.optimizer.lr",
    ]
    assert "0.001" in out and "0.003" in out
    check_readme_exp_show(repo)


def final_model(repo: Path) -> dict[str, bytes]:
    """models/final's files, without the .snakemake_timestamp Snakemake marks a finished folder
    output with; printed: the val loss and the weights' digest."""
    files = {p.name: p.read_bytes() for p in (repo / "models/final").iterdir()}
    files.pop(".snakemake_timestamp", None)
    loss = json.loads((repo / "metrics/train.json").read_text())["val_loss"]
    digest = hashlib.sha256(files["model.safetensors"]).hexdigest()
    print(f"{repo.name}: val_loss {loss!r}, model.safetensors sha256 {digest}")
    return files


def test_train_from_a_clean_checkout_with_both_tools(dvc_trained, snakemake_trained, tmp_path):
    """Each front-end, from a clean checkout, runs the data stages and trains: the same model,
    byte for byte. Snakemake sets OMP_NUM_THREADS to its job's cores, DVC leaves the user's
    environment (here without it): the ranks' thread counts are dsflow's either way
    (train.threads_per_rank). Then DVC runs the whole DAG twice and compares the runs, and a
    param reruns only the Snakemake jobs it touches."""
    # Both trained once per test run (conftest), copied here to go on from.
    repo = shutil.copytree(dvc_trained.repo, tmp_path / "dvc", symlinks=True)
    assert dvc_ran(dvc_trained.stdout) == {*DATA_STAGES, "plan", "train"}
    trained_by_dvc = final_model(repo)
    assert "config.json" in trained_by_dvc
    assert dvc_ran(run(["dvc", "repro", "train"], cwd=repo).stdout) == set()

    # The whole DAG, committed; then a second run with other params, and DVC compares them.
    update_params(repo, {"evaluate": {"max_windows": 20, "max_new_tokens": 8}})
    out = run(["dvc", "repro"], cwd=repo)
    assert dvc_ran(out.stdout) == {"evaluate", "report"}
    shown = run(["dvc", "metrics", "show"], cwd=repo).stdout
    assert "metrics/train.json" in shown and "bits_per_byte" in shown
    commit_all(repo, "run 1")
    update_params(repo, {"train": {"optimizer": {"lr": 0.001}}})
    out = run(["dvc", "repro"], cwd=repo)
    assert dvc_ran(out.stdout) == {"plan", "train", "evaluate", "report"}
    commit_all(repo, "run 2")
    check_exp_show(repo)
    diff = run(["dvc", "metrics", "diff", "HEAD~1", "HEAD"], cwd=repo).stdout
    for metric in ("val_loss", "bits_per_byte", "perplexity", "tokens_per_s"):
        assert metric in diff
    params_diff = run(["dvc", "params", "diff", "HEAD~1", "HEAD"], cwd=repo).stdout
    assert "train.optimizer.lr" in params_diff
    plots = run(["dvc", "plots", "diff", "HEAD~1", "HEAD", "-o", str(tmp_path / "plots")], cwd=repo)
    assert (tmp_path / "plots/index.html").exists(), plots.stdout
    report = (repo / "reports/report.md").read_text()
    assert "| train.optimizer.lr | 0.003 | 0.001 |" in report  # compared with run 1

    snake = shutil.copytree(snakemake_trained, tmp_path / "snake", symlinks=True)
    assert "model.safetensors" in trained_by_dvc
    assert final_model(snake) == trained_by_dvc
    assert (snake / "logs/train.log").exists()
    assert snakemake_jobs(snake, "train") == set()
    check_snakemake_reruns_only_what_a_param_touches(snake)
