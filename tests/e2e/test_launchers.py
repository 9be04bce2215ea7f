"""Both launch options start the same ranks and train the same model."""

from __future__ import annotations

import shutil

import pytest

from conftest import dsflow, losses, tiny_run, update_params

pytestmark = pytest.mark.slow

RUN = tiny_run(gpus=2, steps=3)


def test_deepspeed_launcher_matches_torchrun(prepared, tmp_path):
    curves = {}
    for launcher in ("torchrun", "deepspeed"):
        repo = tmp_path / launcher
        shutil.copytree(prepared, repo)
        update_params(repo, RUN)
        update_params(repo, {"train": {"launcher": launcher}})
        dsflow("train", cwd=repo, timeout=600)
        curves[launcher] = losses(repo)
    assert len(curves["torchrun"]) == 3
    assert curves["deepspeed"] == pytest.approx(curves["torchrun"], rel=1e-6)
