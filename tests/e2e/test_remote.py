"""DVC remotes: what `dvc repro` made on one machine, `dvc pull` brings back byte for byte on
another (a fresh clone), e.g. a cluster node that needs the shards."""

from __future__ import annotations

import pytest
from test_pipeline import git_dvc_repo

from conftest import run, tiny_run, update_params

pytestmark = pytest.mark.slow

TRAIN = tiny_run(gpus=1, steps=2)
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


def test_push_to_a_local_remote_and_pull_into_a_fresh_clone(tmp_path):
    repo = git_dvc_repo(tmp_path / "repo")
    update_params(repo, TRAIN)
    run(["dvc", "repro", "train"], cwd=repo)
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
    assert (clone / "checkpoints/latest").read_text().strip() == "step00000002"
    # cache: false outs (dvclive/, metrics/train.json) are not in the remote: git carries them
    assert files(clone, "dvclive") == files(repo, "dvclive")
    # what was pulled matches dvc.lock: nothing to rerun (evaluate and report never ran)
    status = run(["dvc", "status", "--with-deps", "train"], cwd=clone).stdout
    assert "Data and pipelines are up to date" in status, status
