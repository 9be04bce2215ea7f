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
from dsflow.errors import UsageError
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


def test_the_plan_says_what_background_checkpoints_hold_in_host_memory(lora_profile):
    from dsflow.plan import memory

    quiet = stage.build_plan(lora_profile, host_mem_bytes=128 * GB, disk_free_bytes=500 * GB)
    assert not any("async_checkpoints" in n for n in quiet["notes"])
    lora_profile["train"]["async_checkpoints"] = True
    plan = stage.build_plan(lora_profile, host_mem_bytes=128 * GB, disk_free_bytes=500 * GB)
    inp = plan["estimate"]["inputs"]
    whole = memory.checkpoint_bytes(
        plan["estimate"]["params"]["total"],
        inp["precision"],
        inp["zero_stage"],
        inp["lora_adapter"],
    )
    [note] = [n for n in plan["notes"] if "async_checkpoints" in n]
    assert f"holds {whole / 1e9:.1f} GB of pinned host memory per node" in note  # one node


def test_a_pretrained_checkpoint_is_never_offered_another_preset(lora_profile):
    """With too little host RAM for V2-Lite, the old plan recommended `preset medium`: not an
    option for a fine-tune of a checkpoint. Only layouts, micro batch, offload, checkpointing."""
    plan = stage.build_plan(lora_profile, host_mem_bytes=50 * GB, disk_free_bytes=500 * GB)
    assert layouts.model_fits(plan) is False
    assert plan["strategies"] and all(r["preset"] is None for r in plan["strategies"])
    assert plan["recommendation"] is None
    assert "preset " not in tables.strategies_table(plan["strategies"])
    # The train stage's refusal says so too.
    small = stage.build_plan(lora_profile, gpu_mem_bytes=4 * GB, host_mem_bytes=50 * GB)
    with pytest.raises(UsageError, match="nothing fits, not even ZeRO-3 with offload") as refused:
        layouts.refuse_unless_fits(small)
    assert "preset" not in str(refused.value)
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
def test_a_tiny_cpu_trains_log_has_no_noise(trained):
    """Two CPU ranks, four steps (the shared run): the log says what happened, none of the
    lines that look like trouble and are not."""
    text = (trained / "logs/train.log").read_text()
    assert "[dsflow train] finished, wall_s=" in text
    assert [line for line in text.splitlines() if any(n in line for n in NOISE)] == []


# --------------------------------------------------------------------------- the report


def test_samples_wrap_instead_of_scrolling_past_the_edge():
    from dsflow import report

    html = report.markdown_to_html("\n".join(["```text", "a" * 500, "```"]), {})
    style = re.search(r"pre\{([^}]*)\}", html).group(1)
    assert "white-space:pre-wrap" in style and "overflow-wrap:anywhere" in style
    assert "overflow:auto" not in style


def test_each_val_loss_says_what_it_is_over():
    from dsflow import report

    params = {
        "train": {"eval_batches": 2, "micro_batch": 2, "seq_len": 64},
        "evaluate": {"max_windows": None},
    }
    train = {"step": 12, "tokens": 4608, "val_loss": 1.613, "world_size": 3}
    md = "\n".join(report.training_section(train, [], params))
    assert "over the first 12 windows of 64 tokens of data/shards/val" in md
    assert "train.eval_batches 2 x micro batch 2 x 3 rank(s)" in md
    evalm = {"val_loss": 1.624, "tokens": 51_200}
    md = "\n".join(report.evaluation_section(evalm, params))
    assert "over every window of data/shards/val, 51,200 tokens" in md
    params["evaluate"]["max_windows"] = 40
    md = "\n".join(report.evaluation_section(evalm, params))
    assert "the first 40 windows of data/shards/val (evaluate.max_windows)" in md


def _live(root, name: str, rows: list[tuple[int, float]]) -> None:
    path = root / "dvclive/plots/metrics" / f"{name}.tsv"
    path.parent.mkdir(parents=True, exist_ok=True)
    key = name.split("/")[-1]
    path.write_text(f"step\t{key}\n" + "".join(f"{s}\t{v}\n" for s, v in rows))


def test_the_training_figures_share_one_x_axis(tmp_path, monkeypatch):
    from dsflow import report

    monkeypatch.chdir(tmp_path)
    for name in ("train/loss", "val/loss", "train/lr", "perf/tokens_per_s"):
        _live(tmp_path, name, [(s, 1.0 / s) for s in range(1, 11)])
    figs = report.figures({"step": 10, "tokens": 5120}, tmp_path / "none")
    axes = {name: figs[name].axes[0] for name in ("loss", "lr", "throughput")}
    assert {ax.get_xlabel() for ax in axes.values()} == {"step (512 tokens each)"}
    for ax in axes.values():  # every curve against the step
        assert list(ax.lines[0].get_xdata()) == list(range(1, 11))


def test_stage_times_are_in_dag_order(tmp_path, monkeypatch):
    from dsflow import report

    monkeypatch.chdir(tmp_path)
    (tmp_path / "logs").mkdir()
    stages = ["download", "tokenizer", "tokenize", "shard", "plan", "train", "evaluate", "report"]
    for name in [*sorted(stages), "export"]:
        (tmp_path / "logs" / f"{name}.log").write_text("[dsflow] finished, wall_s=1.5\n")
    assert [row[0] for row in report.stage_times()] == [*stages, "export"]


def test_the_comparison_lists_only_the_metrics_that_changed():
    from dsflow import report

    train = {"step": 12, "val_loss": 1.6, "tokens": 4608, "wall_s": 30.0}
    evalm = {"val_loss": 1.7, "bits_per_byte": 0.5}
    old = {
        str(report.TRAIN_METRICS): {**train, "val_loss": 1.8},
        str(report.EVAL_METRICS): evalm,
    }
    params = {"train": {"lr": 0.003}}
    md = "\n".join(report.comparison_section(params, train, evalm, ("a" * 40, old, params)))
    assert "| train.val_loss | 1.8 | 1.6 | -0.2 |" in md
    assert "tokens" not in md and "bits_per_byte" not in md and "wall_s" not in md
    assert "Metrics changed (1; 5 unchanged, not listed):" in md


def test_dvc_plots_draw_offline_with_the_bundled_template(tmp_path):
    """`dvc plots show --html-template` with the template `python -m dsflow.report PATH` writes:
    vega, vega-lite and vega-embed inline, nothing fetched from the internet."""
    import subprocess
    import sys

    import yaml

    from conftest import run

    repo = tmp_path / "repo"
    repo.mkdir()
    plots = yaml.safe_load((ROOT / "dvc.yaml").read_text())["plots"]
    (repo / "dvc.yaml").write_text(yaml.safe_dump({"plots": plots}))
    _live(repo, "train/loss", [(1, 5.0), (2, 4.0), (3, 3.5)])
    run(["git", "init", "-q"], cwd=repo)
    run(["dvc", "init", "-q"], cwd=repo)
    run([sys.executable, "-m", "dsflow.report", "offline.html"], cwd=repo)
    template = (repo / "offline.html").read_text()
    assert "{plot_divs}" in template and "{scripts}" not in template
    assert "<script src" not in template and "cdn.jsdelivr.net" not in template
    for api in ("vega.View", "vegaLite.compile", "vegaEmbed"):
        assert api.split(".")[0] in template
    proc = subprocess.run(
        ["dvc", "plots", "show", "--html-template", "offline.html", "-o", "out"],
        cwd=repo,
        capture_output=True,
        text=True,
        timeout=300,
    )
    page = (repo / "out/index.html").read_text()
    assert "vegaEmbed('#dvclive_plots_metrics_train_loss_tsv'" in page, proc.stderr
    assert "<script src" not in page and "cdn.jsdelivr.net" not in page
