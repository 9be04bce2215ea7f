"""Both launch options start the same ranks and train the same model."""

from __future__ import annotations

import shutil

import pytest
import yaml

from conftest import TRAINED, dsflow, losses, update_params

pytestmark = pytest.mark.slow


def test_deepspeed_launcher_matches_torchrun(prepared, trained, tmp_path):
    """The shared run (`trained`) is torchrun's; the same params with the deepspeed launcher."""
    params = yaml.safe_load((trained / "params.yaml").read_text())
    assert params["train"]["launcher"] == "torchrun"
    repo = tmp_path / "deepspeed"
    shutil.copytree(prepared, repo)
    update_params(repo, TRAINED)
    update_params(repo, {"train": {"launcher": "deepspeed"}})
    dsflow("train", cwd=repo, timeout=600)
    curves = {"torchrun": losses(trained), "deepspeed": losses(repo)}
    assert len(curves["torchrun"]) == TRAINED["train"]["max_steps"]
    assert curves["deepspeed"] == pytest.approx(curves["torchrun"], rel=1e-6)
