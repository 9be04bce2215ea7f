"""Mistakes in a training request fail before launch, in one line that shows the fix."""

from __future__ import annotations

import re

import pytest

from conftest import dsflow, update_params
from dsflow import checks, dsconfig, machine
from dsflow.errors import UsageError
from dsflow.model.build import build_model
from dsflow.model.presets import model_config
from dsflow.params import deep_merge, load
from dsflow.plan import comm
from dsflow.train import stage as train


def test_the_classic_inconsistent_batch_fails_with_the_numbers_and_a_fix():
    with pytest.raises(UsageError) as exc:
        dsconfig.resolve_batch(16, 4, 64, 3)
    msg = str(exc.value)
    assert "64" in msg and "16 x grad_accum 4 x 3" in msg and "192" in msg
    assert "set global_batch: 192" in msg


@pytest.mark.parametrize(
    "micro, accum, global_batch, world, expect",
    [
        (16, 4, None, 3, (16, 4)),
        (16, None, 96, 3, (16, 2)),
        (None, 2, 96, 3, (16, 2)),
        (16, 4, 192, 3, (16, 4)),
    ],
)
def test_any_two_determine_the_third(micro, accum, global_batch, world, expect):
    b = dsconfig.resolve_batch(micro, accum, global_batch, world)
    assert (b.micro, b.accum) == expect and b.global_batch == b.micro * b.accum * world


def test_global_batch_not_divisible():
    with pytest.raises(UsageError, match="not a multiple of micro_batch 16 x 3 rank"):
        dsconfig.resolve_batch(16, None, 100, 3)


def test_fewer_than_two_given():
    with pytest.raises(UsageError, match="at least two"):
        dsconfig.resolve_batch(None, None, 64, 3)


def _fake_cuda(monkeypatch, n):
    """n visible GPUs, as machine.py asks torch for them (once per process, so not torch.cuda)."""
    gpus = [{"index": i, "name": "NVIDIA H100", "total_memory": 80 * 10**9} for i in range(n)]
    monkeypatch.setattr(machine, "gpus", lambda: gpus)


def test_too_many_gpus_is_an_error_not_a_fallback(monkeypatch):
    _fake_cuda(monkeypatch, 2)
    base = {"device": "auto", "gpus": 3}
    with pytest.raises(UsageError, match="3 GPUs requested but 2 visible"):
        machine.resolve_device(base)
    assert machine.resolve_device({"device": "auto", "gpus": "auto"}) == ("cuda", 2)
    assert machine.resolve_device({"device": "cpu", "gpus": 3}) == ("cpu", 3)
    _fake_cuda(monkeypatch, 0)
    with pytest.raises(UsageError, match="no CUDA GPU is visible"):
        machine.resolve_device({"device": "cuda", "gpus": 1})
    assert machine.resolve_device({"device": "auto", "gpus": 3}) == ("cpu", 3)


def test_precision_auto_is_bf16_on_gpus_and_fp32_on_cpu_ranks(prepared, tmp_path, monkeypatch):
    """train.precision auto (the default) resolves once, in the train stage: the ranks' run spec,
    DeepSpeed's config and the planner's request hold the precision the run trains in."""
    import shutil

    from conftest import tiny_run
    from dsflow.params import validate
    from dsflow.plan import request

    assert load()["train"]["precision"] == "auto"
    assert [machine.resolve_precision("auto", d) for d in ("cuda", "cpu")] == ["bf16", "fp32"]
    assert machine.resolve_precision("bf16", "cpu") == "bf16"  # an explicit choice stays
    repo = tmp_path / "repo"
    shutil.copytree(prepared, repo, ignore=shutil.ignore_patterns("checkpoints", "models"))
    monkeypatch.chdir(repo)
    params = validate(deep_merge(load(), tiny_run(1, 2, precision="auto", zero_stage=2)))
    spec = train.resolve_run(params)
    assert spec["params"]["train"]["precision"] == "fp32"
    assert not spec["ds_config"].get("bf16", {}).get("enabled")
    assert request.resolve(params, None, world=1).precision == "fp32"
    _fake_cuda(monkeypatch, 1)
    gpu = request.resolve(params, None, world=1, gpu_mem_bytes=80 * 10**9)
    assert (gpu.device, gpu.precision) == ("cuda", "bf16")


def test_a_user_ds_config_sets_the_precision_the_spec_records(prepared, tmp_path, monkeypatch):
    """A ds_config file that turns bf16 on trains in bf16: the spec (metrics, the MFU's peak,
    LoRA's dtype, the fingerprint) says so, not train.precision's fp32; fp16 on CPU is refused
    in one line naming the file."""
    import json
    import shutil

    from conftest import tiny_run
    from dsflow.params import validate

    repo = tmp_path / "repo"
    shutil.copytree(prepared, repo, ignore=shutil.ignore_patterns("checkpoints", "models"))
    monkeypatch.chdir(repo)
    base = deep_merge(load(), tiny_run(1, 2, precision="auto", zero_stage=2))
    plain = train.resolve_run(validate(base))
    (repo / "ds.json").write_text(json.dumps({"bf16": {"enabled": True}}))
    spec = train.resolve_run(validate(deep_merge(base, {"train": {"ds_config": "ds.json"}})))
    assert plain["params"]["train"]["precision"] == "fp32"
    assert spec["params"]["train"]["precision"] == "bf16" and spec["ds_config"]["bf16"]["enabled"]
    # The planner is asked for the same precision (the stage plans with_file_precision's params).
    planned = train.with_file_precision(
        validate(deep_merge(base, {"train": {"ds_config": "ds.json"}})), "cpu"
    )
    assert planned["train"]["precision"] == "bf16"
    (repo / "ds.json").write_text(
        json.dumps({"bfloat16": {"enabled": True}})
    )  # DeepSpeed's old name
    assert dsconfig.with_user_precision("fp32", "ds.json") == "bf16"
    spec = train.resolve_run(validate(deep_merge(base, {"train": {"ds_config": "ds.json"}})))
    assert spec["params"]["train"]["precision"] == "bf16" and spec["ds_config"]["bf16"]["enabled"]
    assert "bfloat16" not in spec["ds_config"]
    (repo / "ds.json").write_text(json.dumps({"bf16": {"enabled": False}}))
    assert dsconfig.with_user_precision("bf16", "ds.json") == "fp32"
    (repo / "ds.json").write_text(json.dumps({"bfloat16": True}))
    with pytest.raises(UsageError, match=r"^ds.json: bfloat16 must be a JSON object, got true$"):
        dsconfig.with_user_precision("fp32", "ds.json")
    (repo / "ds.json").write_text(json.dumps({"fp16": {"enabled": True}}))
    with pytest.raises(UsageError) as exc:
        train.resolve_run(validate(deep_merge(base, {"train": {"ds_config": "ds.json"}})))
    assert str(exc.value).startswith("ds.json: fp16 is enabled, but DeepSpeed's CPU accelerator")


def test_ds_config_generation_and_user_merge(tmp_path):
    import json

    # zero_stage: auto is the train stage's to resolve (train.stage.plan_memory) before this.
    t = {**load()["train"], "zero_stage": 2}
    with pytest.raises(ValueError, match=r"dsflow\.train\.stage\.plan_memory first"):
        dsconfig.build({**t, "zero_stage": "auto"}, dsconfig.resolve_batch(4, 2, None, 3), 9, "cpu")
    batch = dsconfig.resolve_batch(4, 2, None, 3)
    # So is reduce_bucket_size: auto on several GPUs (the planner's bucket); on CPU, one size.
    assert t["zero"]["reduce_bucket_size"] == "auto"
    with pytest.raises(ValueError, match=r"reduce_bucket_size: auto .*plan_memory first"):
        dsconfig.build(t, batch, 9, "cuda")
    on_cpu = dsconfig.build(t, batch, 9, "cpu")["zero_optimization"]
    assert on_cpu["reduce_bucket_size"] == comm.ONE_RANK_BUCKET
    t = {**t, "zero": {**t["zero"], "reduce_bucket_size": 40_000_000}}
    cfg = dsconfig.build({**t, "precision": "fp16"}, batch, 100, "cuda")
    assert cfg["train_batch_size"] == 24 and cfg["fp16"]["loss_scale"] == 0
    assert cfg["zero_optimization"]["reduce_bucket_size"] == 40_000_000
    assert cfg["scheduler"]["type"] == "WarmupCosineLR"
    warm = dsconfig.build({**t, "schedule": {**t["schedule"], "kind": "warmup"}}, batch, 100, "cpu")
    assert warm["scheduler"]["type"] == "WarmupLR" and warm["optimizer"]["params"]["torch_adam"]
    user = tmp_path / "ds.json"
    user.write_text(
        json.dumps({"zero_optimization": {"reduce_bucket_size": 5}, "train_batch_size": 24})
    )
    merged = dsconfig.merge_user(cfg, user)
    assert merged["zero_optimization"]["reduce_bucket_size"] == 5
    assert merged["zero_optimization"]["stage"] == 2
    # "auto" in the file (HF's "fill it in") keeps the bucket dsflow built and planned for.
    user.write_text(json.dumps({"zero_optimization": {"reduce_bucket_size": "auto"}}))
    assert dsconfig.merge_user(cfg, user)["zero_optimization"]["reduce_bucket_size"] == 40_000_000
    user.write_text(json.dumps({"train_batch_size": 64}))
    with pytest.raises(UsageError, match="train_batch_size 64 differs from params.yaml's 24"):
        dsconfig.merge_user(cfg, user)
    user.write_text("{not json")
    with pytest.raises(UsageError, match="invalid JSON at line 1"):
        dsconfig.merge_user(cfg, user)


def test_a_user_ds_config_that_contradicts_itself_is_named_first(tmp_path):
    """64 != 16 x 4 x 3 is the file's own mistake: said before how params.yaml (24) relates."""
    import json

    t = {**load()["train"], "zero_stage": 2}
    cfg = dsconfig.build(t, dsconfig.resolve_batch(4, 2, None, 3), 100, "cpu")
    user = tmp_path / "ds.json"
    keys = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
    user.write_text(json.dumps(dict(zip(keys, (64, 16, 4), strict=True))))
    with pytest.raises(UsageError) as err:
        dsconfig.merge_user(cfg, user)
    line = str(err.value)
    assert line.startswith(
        f"{user}: train_batch_size 64 != train_micro_batch_size_per_gpu 16 x "
        "gradient_accumulation_steps 4 x 3 rank(s) = 192, so the file contradicts itself; "
    )
    assert line.endswith(
        "params.yaml's train section gives 24 (micro_batch 4 x grad_accum 2 x 3 rank(s)): set "
        "the batch there and remove these keys from the file"
    )
    assert "\n" not in line
    # Two keys that leave no whole third on 3 ranks contradict each other too.
    user.write_text(json.dumps({"train_batch_size": 64, "train_micro_batch_size_per_gpu": 16}))
    with pytest.raises(UsageError, match=r"64 is not a multiple of .* = 48, so no gradient_acc"):
        dsconfig.merge_user(cfg, user)
    # A file that agrees with itself (16 x 1 x 3 = 48) but not with params.yaml: the old line.
    user.write_text(json.dumps(dict(zip(keys, (48, 16, 1), strict=True))))
    with pytest.raises(UsageError, match="train_batch_size 48 differs from params.yaml's 24"):
        dsconfig.merge_user(cfg, user)
    # The file's keys matching params.yaml merge as before.
    user.write_text(json.dumps(dict(zip(keys, (24, 4, 2), strict=True))))
    assert dsconfig.merge_user(cfg, user)["train_batch_size"] == 24


def test_stage_refuses_bad_requests_before_launch(prepared, tmp_path):
    import shutil

    repo = tmp_path / "bad"
    shutil.copytree(prepared, repo)
    update_params(
        repo, {"train": {"device": "cpu", "micro_batch": 16, "grad_accum": 4, "global_batch": 64}}
    )
    proc = dsflow("train", cwd=repo, check=False)
    assert proc.returncode == 2
    assert "global_batch 64 != micro_batch 16 x grad_accum 4 x 3 rank(s) = 192" in proc.stderr
    assert not (repo / "checkpoints").exists()

    update_params(repo, {"train": {"global_batch": None, "device": "cuda"}})
    proc = dsflow("train", cwd=repo, check=False)
    assert proc.returncode == 2 and "no CUDA GPU is visible" in proc.stderr


def test_vocab_mismatch_with_a_pretrained_model(prepared, tmp_path):
    import shutil

    ckpt = tmp_path / "other_vocab"  # fewer embeddings than tokens (more would be padding)
    build_model(model_config("tiny", 300), device_type="cpu").save_pretrained(ckpt)
    repo = tmp_path / "mismatch"
    shutil.copytree(prepared, repo)
    update_params(repo, {"train": {"device": "cpu"}, "model": {"pretrained": str(ckpt)}})
    proc = dsflow("train", cwd=repo, check=False)
    assert proc.returncode == 2
    line = proc.stderr.strip().splitlines()[-1]
    assert "vocab_size 300" in line and "384" in line and "tokenizer" in line


def test_preflight_refuses_what_cannot_fit_and_sets_nccl_for_consumer_cards(monkeypatch):

    gpus = [
        {"index": i, "name": "NVIDIA GeForce RTX 4090", "total_memory": 24 * 2**30}
        for i in range(3)
    ]
    facts = machine.facts(".")
    facts.update(gpus=gpus, p2p={f"{a}-{b}": False for a in range(3) for b in range(3) if a != b})
    monkeypatch.setattr(machine, "facts", lambda *_: facts)
    monkeypatch.setattr(checks, "diagnose", lambda *_: [])
    params = deep_merge(load(), {"model": {"preset": "deepseek-v2"}, "train": {"device": "cuda"}})
    plan = {"device": "cuda", "world": 3}
    with pytest.raises(UsageError) as exc:
        train.preflight(params, plan)
    msg = str(exc.value)
    assert "\n" not in msg and "deepseek-v2" in msg
    # 236B parameters x 2 bytes on every GPU (the vocabulary here is the test tokenizer's).
    assert re.search(r"16-bit weights alone are 4[67]\d\.\d GB", msg)
    forced = deep_merge(params, {"train": {"force": True}})
    assert train.preflight(forced, plan) == machine.nccl_env(facts)
