"""What a first run shows a new user: the plan of a pretrained checkpoint (its own vocabulary,
no other preset offered, cards named with the memory they are sold as), each stage's --help, a
stage log without noise, and the report (wrapped samples, one x axis, stages in DAG order, only
the changed metrics, offline plots)."""

from __future__ import annotations

import json
import re

import pytest

from conftest import ROOT
from dsflow import machine
from dsflow import params as params_mod
from dsflow.plan import layouts, request, stage, tables

LORA_PROFILE = ROOT / "profiles/lora-rtx4090x3.yaml"
GB = 10**9


# --------------------------------------------------------------------------- plan


@pytest.fixture
def lora_profile(tmp_path, monkeypatch):
    """profiles/lora-rtx4090x3.yaml's params in a fresh clone: DeepSeek-V2-Lite not in the
    (empty, offline) Hugging Face cache, shards of a 3,490-token local tokenizer, no GPU here."""
    from huggingface_hub import constants

    monkeypatch.chdir(tmp_path)
    index = tmp_path / "data/shards/train/index.json"
    index.parent.mkdir(parents=True)
    index.write_text(json.dumps({"vocab_size": 3490}))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf/hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("DSFLOW_PROFILES", str(LORA_PROFILE))
    monkeypatch.setattr(machine, "gpus", lambda: [])
    return params_mod.load(ROOT / "params.yaml", overlays=[str(LORA_PROFILE)])


def test_a_pretrained_checkpoint_is_planned_with_its_own_vocabulary(lora_profile):
    """The train stage builds the checkpoint's embedding (102,400 rows for V2-Lite), whatever
    the local tokenizer's size: so does the plan, before the checkpoint is downloaded."""
    plan = stage.build_plan(lora_profile, host_mem_bytes=128 * GB, disk_free_bytes=500 * GB)
    req = plan["request"]
    assert req["vocab_size"] == 102400
    assert "published vocabulary" in req["vocab_source"]
    assert round(plan["summary"]["params_total"] / 1e9, 3) == 15.706
    assert 16.0 * GB < plan["estimate"]["gpu"]["total"] < 24 * GB
    assert plan["verdict"]["fits"] is True


def test_a_pretrained_checkpoint_is_never_offered_another_preset(lora_profile):
    """With too little host RAM for V2-Lite, the old plan recommended `preset medium`: not an
    option for a fine-tune of a checkpoint. Only layouts, micro batch, offload, checkpointing."""
    plan = stage.build_plan(lora_profile, host_mem_bytes=50 * GB, disk_free_bytes=500 * GB)
    assert layouts.model_fits(plan) is False
    assert plan["strategies"] and all(r["preset"] is None for r in plan["strategies"])
    assert plan["recommendation"] is None
    assert "preset " not in tables.strategies_table(plan["strategies"])
    # Without model.pretrained, smaller presets are still the way out.
    lora_profile["model"]["pretrained"] = None
    lora_profile["train"]["finetune"] = "full"
    plan = stage.build_plan(lora_profile, host_mem_bytes=50 * GB, disk_free_bytes=500 * GB)
    assert plan["recommendation"]["preset"] is not None


CARD = re.compile(
    "|".join(re.escape(n) for n in sorted(request.GPU_MEMORY_BYTES, key=len, reverse=True))
)


def _cards_named_with_their_memory(text: str) -> list[str]:
    """Each GPU named in `text`, checked: the name is followed by the memory it is sold as."""
    named = []
    for m in CARD.finditer(text):
        name = m.group(0)
        if re.match(r"[\w]", text[m.end() : m.end() + 1]):
            continue  # a longer name (L40S, A10G): matched on its own
        said = re.match(r" with (\d+) GB", text[m.end() :])
        assert said, f"{name} named without its memory: {text!r}"
        assert int(said.group(1)) == request.GPU_NOMINAL_GB[name], text
        named.append(name)
    return named


def test_a_card_is_named_with_the_memory_it_is_sold_as(lora_profile, monkeypatch):
    """A 24 GB RTX 4090 (24,564 MiB: 25.8e9 bytes) never reads "25.8 GB (RTX 4090)"."""
    assert set(request.GPU_NOMINAL_GB) == set(request.GPU_MEMORY_BYTES)
    text = tables.format_report(stage.build_plan(lora_profile, host_mem_bytes=50 * GB))
    assert _cards_named_with_their_memory(text) == ["RTX 4090"]
    for name, size in request.GPU_MEMORY_BYTES.items():
        machine_ = {"gpus": 3, "gpu_mem_bytes": size, "gpu": name, "host_bytes": GB}
        line = layouts.describe_machine({**machine_, "disk_bytes": GB, "strategy": "ZeRO-3"})
        assert _cards_named_with_their_memory(line) == [name]
    # A machine bigger than the asked one, as the plan stage names it.
    argv = ["--model", "deepseek-v3", "--gpus", "3", "--gpu-mem", "24", "--host-mem", "256"]
    parser = __import__("argparse").ArgumentParser()
    stage.add_arguments(parser)
    plan = stage.build_plan(lora_profile, parser.parse_args([*argv, "--disk", "100000"]))
    line = layouts.describe_machine(plan["smallest_machine"])
    assert _cards_named_with_their_memory(line)


# --------------------------------------------------------------------------- --help


def test_every_command_says_what_it_reads_writes_and_which_params_drive_it(capsys):
    from dsflow import cli

    names = [*cli.STAGES, "validate", "profile"]
    assert set(cli.STAGE_HELP) == set(names)
    for name in names:
        with pytest.raises(SystemExit) as done:
            cli.main([name, "--help"])
        assert done.value.code == 0
        text = " ".join(capsys.readouterr().out.split())
        assert "Params: " in text, name
        if name not in ("doctor", "validate", "profile"):  # these write nothing
            assert "->" in text, (name, text)
    # The text of a stage whose docstring says it is that docstring's, not a restatement.
    assert "data/raw/{train,val}.parquet + manifest.json" in cli.stage_help("download")


# --------------------------------------------------------------------------- the stage log

NOISE = (
    "deepspeed_shm_comm_op built successfully",
    "get learning rate from scheduler before it has started",
    "site-packages/",
    "  return func(*args, **kwargs)",
)


def test_the_logs_noise_is_left_out_and_real_warnings_kept_once():
    from dsflow.progress import LogLines

    venv = "/home/me/dsflow/.venv/lib/python3.11/site-packages"
    printed = [
        "DeepSpeed deepspeed.ops.comm.deepspeed_shm_comm_op built successfully",
        "[2026-12-06 08:22:29,695] [WARNING] [lr_schedules.py:938:get_lr] Attempting to get "
        "learning rate from scheduler before it has started",
        f"train:   0%|  | 0.00/6.00 [00:00<?, ?step/s]{venv}/torch/distributed/c10d_logger.py:83: "
        "FutureWarning: `all_gather_into_tensor` is deprecated.",
        "  return func(*args, **kwargs)",
        f"{venv}/torch/distributed/c10d_logger.py:83: FutureWarning: `all_gather_into_tensor` is "
        "deprecated.",
        "  return func(*args, **kwargs)",
        "/work/run/train.py:12: UserWarning: something the user should see",
        "  warnings.warn('something the user should see')",
        f"[rank1]:W1206 08:22:25.273000 28636 {venv}/torch/utils/_pytree.py:630] an Enum",
        f"[rank0]:W1206 08:22:25.340000 28635 {venv}/torch/utils/_pytree.py:630] an Enum",
        "[dsflow train] done: models/final, metrics/train.json",
    ]
    keep = LogLines()
    kept = [k.decode() for k in (keep.kept(x.encode()) for x in printed) if k is not None]
    assert kept == [
        "train:   0%|  | 0.00/6.00 [00:00<?, ?step/s]torch/distributed/c10d_logger.py:83: "
        "FutureWarning: `all_gather_into_tensor` is deprecated.",
        "/work/run/train.py:12: UserWarning: something the user should see",
        "[rank1]:W1206 08:22:25.273000 28636 torch/utils/_pytree.py:630] an Enum",
        "[dsflow train] done: models/final, metrics/train.json",
    ]


@pytest.mark.slow
def test_a_tiny_cpu_trains_log_has_no_noise(prepared, tmp_path):
    """Two CPU ranks, two steps: the log says what happened, none of the lines that look like
    trouble and are not."""
    import shutil

    from conftest import dsflow, tiny_run, update_params

    repo = tmp_path / "repo"
    shutil.copytree(prepared, repo)
    update_params(repo, tiny_run(2, 2))
    dsflow("train", cwd=repo, timeout=900)
    text = (repo / "logs/train.log").read_text()
    assert "[dsflow train] finished, wall_s=" in text
    assert [line for line in text.splitlines() if any(n in line for n in NOISE)] == []
