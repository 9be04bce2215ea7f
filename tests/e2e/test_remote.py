"""DVC remotes: what `dvc repro` made on one machine, `dvc pull` brings back byte for byte on
another (a fresh clone), e.g. a cluster node that needs the shards."""

from __future__ import annotations

import shutil

import pytest

from conftest import FRONT_END_RUN, run

pytestmark = pytest.mark.slow

# Cached outs of dvc.yaml up to train: `dvc push` uploads them, `dvc pull` restores them.
PUSHED = [
    "data/raw",
    "data/tokenizer",
    "data/tokens",
    "data/shards",
    "reports/plan.json",
    "models/final",
    "checkpoints",  # persist: true, still cached: resume state travels too
]


def files(root, rel) -> dict[str, bytes]:
    path = root / rel
    if path.is_file():
        return {rel: path.read_bytes()}
    return {
        str(p.relative_to(root)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()
    }


def test_push_to_a_local_remote_and_pull_into_a_fresh_clone(dvc_trained, tmp_path):
    """From the clone `dvc repro train` ran in (conftest's dvc_trained, copied)."""
    repo = shutil.copytree(dvc_trained.repo, tmp_path / "repo", symlinks=True)
    remote = tmp_path / "remote"
    run(["dvc", "remote", "add", "-d", "local", str(remote)], cwd=repo)
    run(["git", "add", "-A"], cwd=repo)
    run(["git", "commit", "-qm", "trained"], cwd=repo)
    pushed = run(["dvc", "push"], cwd=repo).stdout
    assert "pushed" in pushed

    clone = tmp_path / "clone"
    run(["git", "clone", "-q", str(repo), str(clone)], cwd=tmp_path)
    assert not (clone / "data/shards").exists()
    # A node that only needs the training data pulls one stage's outputs...
    run(["dvc", "pull", "shard"], cwd=clone)
    assert files(clone, "data/shards") == files(repo, "data/shards")
    assert not (clone / "models/final").exists()
    # ...and the train stage with everything it depends on comes back byte for byte.
    run(["dvc", "pull", "--with-deps", "train"], cwd=clone)
    for out in PUSHED:
        assert files(clone, out) == files(repo, out), out
    last = FRONT_END_RUN["train"]["max_steps"]
    assert (clone / "checkpoints/latest").read_text().strip() == f"step{last:08d}"
    # cache: false outs (dvclive/, metrics/train.json) are not in the remote: git carries them
    assert files(clone, "dvclive") == files(repo, "dvclive")
    # what was pulled matches dvc.lock: nothing to rerun (evaluate and report never ran)
    status = run(["dvc", "status", "--with-deps", "train"], cwd=clone).stdout
    assert "Data and pipelines are up to date" in status, status
