"""A params edit never deletes a run, and no impossible value gets past validation.

The train stage moves the checkpoints of a run with other params into checkpoints/previous/
instead of deleting them, and only after the new run is validated and resolved; params
validation rejects NaN, +-Inf and values out of range in one line naming the key, reads YAML 1.1's
number strings (1e-3) as numbers, and says which key an unknown one probably meant."""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import pytest
import yaml

from conftest import ROOT, copy_project, dsflow, run, tiny_run, update_params
from dsflow import params as params_mod
from dsflow.errors import UsageError
from dsflow.train import checkpoint as ckpt
from dsflow.train import stage as train

BASE = yaml.safe_load((ROOT / "params.yaml").read_text())


# --------------------------------------------------------------------------- checkpoints kept


def fake_run(root: Path, fingerprint: str | None, steps=(9, 12), world: int = 2) -> None:
    """checkpoints/ as a run of `fingerprint` leaves it (None: no run.json, as when copied
    in from elsewhere by hand)."""
    for step in steps:
        tag = ckpt.tag_for(step)
        (root / tag).mkdir(parents=True)
        (root / tag / ckpt.MODEL_FILE).write_bytes(b"m" * 100)
        for rank in range(world):
            (root / tag / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt").write_bytes(b"o")
        ckpt.write_manifest(root, tag, step, world, True)
    ckpt.set_latest(root, ckpt.tag_for(steps[-1]))
    if fingerprint is not None:
        (root / "run.json").write_text(json.dumps({"fingerprint": fingerprint}))


def spec(fingerprint: str, keep: int = 1, world: int = 2) -> dict:
    return {
        "world": world,
        "fingerprint": fingerprint,
        "ds_config": {"zero_optimization": {"stage": 2}},
        "params": {"train": {"keep_previous_runs": keep}},
    }


@pytest.fixture
def checkpoints(tmp_path, monkeypatch):
    """A working directory whose checkpoints/ the train stage prepares; its log lines."""
    monkeypatch.chdir(tmp_path)
    notes: list[str] = []
    monkeypatch.setattr(train.log, "info", lambda msg, *args: notes.append(msg % args))
    return tmp_path / "checkpoints", notes


def listing(root: Path) -> dict[str, tuple[int, int]]:
    """Every file under `root` with its size and modification time."""
    return {
        str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns)
        for p in sorted(root.rglob("*"))
    }


def test_a_run_of_other_params_is_moved_aside_under_its_name_not_deleted(checkpoints):
    root, notes = checkpoints
    fake_run(root, "aaaa")
    plan = spec("bbbb")
    train.prepare_run_dir(plan)
    assert plan["resume"] is None and ckpt.tags(root) == []
    kept = root / "previous" / "aaaa-step12"
    assert ckpt.tags(kept) == ["step00000009", "step00000012"]
    assert ckpt.resume_tag(kept, 2, True) == "step00000012"
    assert json.loads((kept / "run.json").read_text())["fingerprint"] == "aaaa"
    # Never mistaken for this run's own checkpoints.
    assert ckpt.resume_tag(root, 2, True) is None
    line = next(n for n in notes if "previous/aaaa-step12" in n)
    assert "restore its params" in line
    assert json.loads((root / "run.json").read_text())["fingerprint"] == "bbbb"


def test_restoring_the_params_moves_the_run_back_and_resumes_it(checkpoints):
    root, notes = checkpoints
    fake_run(root, "aaaa")
    train.prepare_run_dir(spec("bbbb"))
    fake_run(root, "bbbb", steps=(3,))  # the new run trains a little
    plan = spec("aaaa")
    train.prepare_run_dir(plan)
    assert plan["resume"] == "step00000012"
    assert ckpt.tags(root) == ["step00000009", "step00000012"]
    assert ckpt.previous_runs(root) == ["bbbb-step3"]
    assert any("previous/aaaa-step12 holds this run" in n for n in notes)


def test_checkpoints_copied_in_from_another_run_are_kept(checkpoints):
    root, _ = checkpoints
    fake_run(root, None)
    train.prepare_run_dir(spec("bbbb"))
    assert ckpt.tags(root / "previous" / "unknown-step12") == ["step00000009", "step00000012"]


@pytest.mark.parametrize("keep", [1, 2])
def test_retention_removes_only_the_oldest_beyond_keep_previous_runs(checkpoints, keep):
    root, notes = checkpoints
    for n, fp in enumerate(["r1", "r2", "r3", "r4"]):
        fake_run(root, fp, steps=(n + 1,))
        train.prepare_run_dir(spec(f"next{n}", keep=keep))
    kept = ["r1-step1", "r2-step2", "r3-step3", "r4-step4"]
    assert ckpt.previous_runs(root) == kept[-keep:]
    removed = [n for n in notes if n.startswith("removed checkpoints/previous/")]
    assert len(removed) == 4 - keep
    assert all(f"train.keep_previous_runs: {keep}" in n for n in removed)
    assert [n.split()[1] for n in removed] == [f"checkpoints/previous/{r}," for r in kept[:-keep]]


def test_keep_previous_runs_zero_deletes_the_run_with_a_line(checkpoints):
    root, notes = checkpoints
    fake_run(root, "aaaa")
    train.prepare_run_dir(spec("bbbb", keep=0))
    assert ckpt.tags(root) == [] and ckpt.previous_runs(root) == []
    assert any("deleting checkpoints/ of run aaaa" in n for n in notes)


def test_where_the_run_cannot_be_moved_the_stage_refuses_and_touches_nothing(checkpoints):
    root, _ = checkpoints
    fake_run(root, "aaaa")
    (root / "previous").write_text("not a folder")
    before = listing(root)
    with pytest.raises(UsageError) as exc:
        train.prepare_run_dir(spec("bbbb"))
    assert "\n" not in str(exc.value) and "train.keep_previous_runs: 0" in str(exc.value)
    assert listing(root) == before


def test_a_move_killed_midway_is_finished_at_the_next_start(checkpoints):
    root, notes = checkpoints
    fake_run(root, "aaaa")
    staging = root / "previous" / ".moving-aaaa-step12"
    staging.mkdir(parents=True)
    os.rename(root / "step00000012", staging / "step00000012")  # the kill came here
    train.prepare_run_dir(spec("bbbb"))
    kept = root / "previous" / "aaaa-step12"
    assert ckpt.tags(kept) == ["step00000009", "step00000012"]
    assert (kept / "run.json").exists() and not staging.exists() and ckpt.tags(root) == []
    assert any("aaaa-step12, left half moved" in n for n in notes)


def test_keep_previous_runs_is_no_part_of_the_fingerprint():
    params = params_mod.validate(BASE)
    other = params_mod.deep_merge(params, {"train": {"keep_previous_runs": 5}})
    assert ckpt.fingerprint(params, 8, "d") == ckpt.fingerprint(other, 8, "d")


# --------------------------------------------------------------------------- validation


def load_text(tmp_path: Path, text: str) -> dict:
    """params.load of params.yaml with `text` (YAML) merged over it."""
    path = tmp_path / "params.yaml"
    overlay = yaml.safe_load(text)
    path.write_text(yaml.safe_dump(params_mod.deep_merge(BASE, overlay), sort_keys=False))
    return params_mod.load(path, overlays=[])


@pytest.mark.parametrize(
    "text, key",
    [
        ("train: {optimizer: {lr: .nan}}", "train.optimizer.lr"),
        ("seed: 1180591620717411303424", "seed"),  # 2**70
        ("seed: 4294967296", "seed"),  # 2**32: numpy's seed takes less
        ("model: {overrides: {hidden_size: -5}}", "model.overrides.hidden_size"),
        ("model: {overrides: {num_hidden_layers: 0}}", "model.overrides.num_hidden_layers"),
        ("train: {optimizer: {eps: .inf}}", "train.optimizer.eps"),
        ("train: {optimizer: {betas: [0.9, .nan]}}", "train.optimizer.betas.1"),
        ("train: {optimizer: {weight_decay: .inf}}", "train.optimizer.weight_decay"),
        ("train: {grad_clip: .nan}", "train.grad_clip"),
        ("train: {schedule: {min_lr_ratio: .nan}}", "train.schedule.min_lr_ratio"),
        ("train: {balance: {aux_loss_alpha: .inf}}", "train.balance.aux_loss_alpha"),
        ("shard: {shard_tokens: 1000000000000000}", "shard.shard_tokens"),
        ("train: {micro_batch: 1099511627776}", "train.micro_batch"),
        ("evaluate: {sample_seed: 1180591620717411303424}", "evaluate.sample_seed"),
        (
            "model: {overrides: {rope_parameters: {factor: .inf}}}",
            "model.overrides.rope_parameters",
        ),
        ("model: {overrides: {max_window_layers: 99999999999999999999}}", "max_window_layers"),
    ],
)
def test_non_finite_and_out_of_range_values_fail_in_one_line_naming_the_key(tmp_path, text, key):
    with pytest.raises(UsageError) as exc:
        load_text(tmp_path, text)
    msg = str(exc.value)
    assert "\n" not in msg and msg.startswith(str(tmp_path / "params.yaml"))
    assert f": {key}" in msg or f".{key}" in msg, msg


def test_shard_tokens_names_its_maximum(tmp_path):
    with pytest.raises(UsageError, match=r"<= 1073741824"):
        load_text(tmp_path, "shard: {shard_tokens: 1000000000000000}")


@pytest.mark.parametrize(
    "text, key, value",
    [
        ("train: {optimizer: {lr: 1e-3}}", "train.optimizer.lr", 0.001),
        ("train: {optimizer: {lr: 3E-4}}", "train.optimizer.lr", 0.0003),
        ("train: {lora: {alpha: .5e2}}", "train.lora.alpha", 50.0),
        ("train: {optimizer: {eps: 1e-8}}", "train.optimizer.eps", 1e-8),
        ("train: {optimizer: {betas: [0.9, 95e-2]}}", "train.optimizer.betas", [0.9, 0.95]),
        ("train: {max_tokens: 1e9, max_steps: null}", "train.max_tokens", 1_000_000_000),
        ("train: {max_steps: 1.0e+3}", "train.max_steps", 1000),
    ],
)
def test_yaml_1_1_number_strings_are_read_as_numbers(tmp_path, text, key, value):
    got = params_mod.get(load_text(tmp_path, text), key)
    assert got == value and type(got) is type(value)


def test_a_number_string_stays_a_string_where_the_schema_wants_one(tmp_path):
    params = load_text(tmp_path, "model: {pretrained: org/m, revision: 1e3}")
    assert params["model"]["revision"] == "1e3"


@pytest.mark.parametrize(
    "text, meant",
    [
        ("train: {optimzer: {lr: 0.1}}", "did you mean train.optimizer?"),
        ("train: {lr: 0.1}", "did you mean train.optimizer.lr?"),
        ("trian: {}", "did you mean train?"),
        ("tokenizer: {vocab: 3}", "did you mean tokenizer.vocab_size?"),
    ],
)
def test_an_unknown_key_says_which_was_meant_and_lists_few(tmp_path, text, meant):
    with pytest.raises(UsageError) as exc:
        load_text(tmp_path, text)
    msg = str(exc.value)
    assert meant in msg and "\n" not in msg
    listed = msg.split("(allowed under ", 1)[1].split(": ", 1)[1]
    assert listed.count(",") < params_mod.LISTED_KEYS + 1, msg


def test_the_stage_names_the_files_snakemake_read(monkeypatch):
    config = params_mod.deep_merge(BASE, {"train": {"grad_clip": float("nan")}})
    monkeypatch.setenv(params_mod.CONFIG_ENV, json.dumps(config))
    monkeypatch.setenv(params_mod.CONFIG_SOURCE_ENV, "params.yaml + profiles/h200.yaml")
    with pytest.raises(UsageError) as exc:
        params_mod.load()
    assert str(exc.value).startswith("params.yaml + profiles/h200.yaml: train.grad_clip: nan")


def test_snakemake_names_params_yaml_and_the_overlay(tmp_path):
    repo = copy_project(tmp_path / "repo")
    (tmp_path / "bad.yaml").write_text("train: {optimizer: {lr: .nan}}\n")
    cmd = [sys.executable, "-m", "snakemake", "-n", "--cores", "1"]
    proc = run([*cmd, "--configfile", str(tmp_path / "bad.yaml")], cwd=repo, check=False)
    assert proc.returncode != 0
    assert "dsflow: error: params.yaml + ../bad.yaml: train.optimizer.lr: nan" in proc.stderr


# --------------------------------------------------------------------------- the stage


@pytest.mark.parametrize(
    "text, key",
    [
        ("train: {optimizer: {lr: .nan}}", "train.optimizer.lr"),
        ("model: {overrides: {hidden_size: -5}}", "model.overrides.hidden_size"),
    ],
)
def test_a_bad_edit_fails_before_checkpoints_are_touched(tmp_path, text, key):
    repo = copy_project(tmp_path / "repo")
    root = repo / "checkpoints"
    fake_run(root, "aaaa")
    update_params(repo, yaml.safe_load(text))
    before = listing(root)
    proc = dsflow("train", cwd=repo, check=False)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and f"params.yaml: {key}:" in lines[0], proc.stderr
    assert listing(root) == before


@pytest.mark.slow
def test_an_lr_change_keeps_the_previous_run_moved_aside_and_named(prepared, tmp_path):
    repo = tmp_path / "repo"
    shutil.copytree(prepared, repo)
    update_params(repo, tiny_run(2, 2))
    dsflow("train", cwd=repo)
    first = json.loads((repo / "checkpoints/run.json").read_text())["fingerprint"]
    update_params(repo, {"train": {"optimizer": {"lr": 1e-3}}})
    proc = dsflow("train", cwd=repo)
    kept = repo / "checkpoints" / "previous" / f"{first}-step2"
    assert ckpt.tags(kept) == ["step00000002"], proc.stderr
    assert f"moved it to checkpoints/previous/{first}-step2/" in proc.stderr
    second = json.loads((repo / "checkpoints/run.json").read_text())["fingerprint"]
    assert second != first
