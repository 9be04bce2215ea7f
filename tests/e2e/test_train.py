"""The train stage on CPU: 3 gloo ranks, tiny preset, builtin corpus."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from conftest import dsflow, losses, rewound_copy, tiny_run, update_params

pytestmark = pytest.mark.slow

TRAIN = tiny_run(
    3, 12, seq_len=64, grad_accum=1, global_batch=None, eval_every=6, eval_batches=2,
    checkpoint_every=5, optimizer={"lr": 0.003}, schedule={"warmup_steps": 2},
)  # fmt: skip


def trained_copy(prepared, dest, overlay=None, env=None, check=True):
    repo = dest
    if not repo.exists():
        shutil.copytree(
            prepared,
            repo,
            ignore=shutil.ignore_patterns("checkpoints", "models", "dvclive", "metrics"),
        )
    update_params(repo, TRAIN)
    if overlay:
        update_params(repo, overlay)
    return dsflow("train", cwd=repo, env=env or {}, check=check, timeout=900)


@pytest.fixture(scope="module")
def baseline(prepared, tmp_path_factory):
    """An uninterrupted 12-step run on 3 ranks."""
    repo = tmp_path_factory.mktemp("baseline") / "repo"
    trained_copy(prepared, repo)
    return repo


def test_loss_falls_and_outputs_exist(baseline):
    curve = losses(baseline)
    assert sorted(curve) == list(range(1, 13))
    assert curve[12] < curve[1] - 1.0
    metrics = json.loads((baseline / "metrics/train.json").read_text())
    assert metrics["world_size"] == 3 and metrics["step"] == 12
    assert metrics["val_loss"] < curve[1]
    assert len(metrics["peak_memory_gb_per_rank"]) == 3
    assert metrics["tokens"] == 12 * 2 * 3 * 64
    assert metrics["params_total"] > metrics["params_activated"] > 0
    ds = json.loads((baseline / "checkpoints/ds_config.json").read_text())
    assert ds["train_batch_size"] == 6 and ds["zero_optimization"]["stage"] == 2
    # keep_checkpoints (2): steps 10 and 12 remain, `latest` names the last.
    assert sorted(p.name for p in (baseline / "checkpoints").glob("step*")) == [
        "step00000010",
        "step00000012",
    ]
    assert (baseline / "checkpoints/latest").read_text().strip() == "step00000012"
    for name in ("experts/max_over_mean", "perf/tokens_per_s", "train/lr", "train/grad_norm"):
        assert len(losses(baseline, name)) == 12


def test_data_parallel_matches_one_rank_with_the_whole_batch(prepared, baseline, tmp_path):
    single = tmp_path / "single"
    trained_copy(prepared, single, {"train": {"gpus": 1, "micro_batch": 6}})
    a, b = losses(baseline), losses(single)
    for step in a:
        assert b[step] == pytest.approx(a[step], rel=2e-4, abs=2e-4), step


def test_a_killed_run_reading_numbers_one_step_late_resumes_to_the_same_numbers(
    prepared, baseline, tmp_path
):
    """train.perf.async_metrics (on by default on GPUs): each step's loss, gradient norm,
    expert counts, stop flag and memory are read back one step late (3 ranks: all-reduced and
    gathered on the device). Rank 1 is killed in step 7: the stage fails, keeping the checkpoint
    of step 5; the rerun resumes from it. Steps 1-4, 7-9 and 11 are read late here (checkpoints
    every 5, validation every 6): every logged number is the one the uninterrupted run read at
    once, bit for bit, each step is logged once, the checkpoints are the same, and the expert
    stats are there."""
    repo = tmp_path / "repo"
    late_overlay = {"train": {"perf": {"async_metrics": True}}}
    fault = {"DSFLOW_FAULT_STEP": "7", "DSFLOW_FAULT_RANK": "1"}
    proc = trained_copy(prepared, repo, late_overlay, env=fault, check=False)
    assert proc.returncode == 2
    assert "training failed" in proc.stderr and "resume" in proc.stderr
    assert (repo / "checkpoints/latest").read_text().strip() == "step00000005"
    assert not (repo / "models/final").exists()
    proc = trained_copy(prepared, repo, late_overlay)
    assert "resumed from step 5" in proc.stderr
    assert "step metrics read one step late" in proc.stderr
    names = ["train/loss", "train/grad_norm", "train/lr", "train/skipped_steps", "tokens"]
    names += ["val/loss", "experts/max_over_mean", "experts/entropy_min"]
    for name in names:
        late, now = losses(repo, name), losses(baseline, name)
        assert late == now and late, name
    rows = (repo / "dvclive/plots/metrics/train/loss.tsv").read_text().splitlines()[1:]
    assert len(rows) == 12  # each step logged once
    assert sorted(losses(repo, "perf/step_s")) == list(range(1, 13))
    tags = sorted(p.name for p in (repo / "checkpoints").glob("step*"))
    assert tags == sorted(p.name for p in (baseline / "checkpoints").glob("step*"))
    late = json.loads((repo / "metrics/train.json").read_text())
    now = json.loads((baseline / "metrics/train.json").read_text())
    for key in ("train_loss", "val_loss", "experts_max_over_mean", "experts_entropy_min"):
        assert late[key] == now[key] and late[key] is not None, key
    assert len(late["peak_memory_gb_per_rank"]) == 3


def _val_loss(model, repo, windows: int = 12) -> float:
    """`model`'s loss on the first `windows` windows of the val split; 12: the train stage's
    validation (2 batches of 2 windows on each of 3 ranks)."""
    from dsflow.data.shards import ShardReader
    from dsflow.model.loss import evaluate_loss

    reader = ShardReader(repo / "data/shards/val", 64, seed=1234)
    device = torch.device("cpu")
    total, count = evaluate_loss(model, reader, micro=2, device=device, max_windows=windows)
    return total / count


def exported_val_loss(repo, model: str = "models/final") -> float:
    """The validation loss of the model exported to `repo`/`model`, loaded as any Hugging Face
    client loads it (AutoModelForCausalLM.from_pretrained). In this process: a fresh one would
    pay the imports again for the same numbers."""
    from transformers import AutoModelForCausalLM

    return _val_loss(AutoModelForCausalLM.from_pretrained(repo / model), repo)


def test_exported_model_reproduces_the_final_val_loss(baseline):
    metrics = json.loads((baseline / "metrics/train.json").read_text())
    assert exported_val_loss(baseline) == pytest.approx(metrics["val_loss"], rel=1e-5)
    assert (baseline / "models/final/model.safetensors").exists()
    assert (baseline / "models/final/tokenizer.json").exists()


def test_continued_training_from_a_pretrained_checkpoint(prepared, baseline, tmp_path):
    repo = tmp_path / "continued"
    proc = trained_copy(
        prepared,
        repo,
        {
            "model": {"pretrained": str(baseline / "models/final")},
            "train": {"gpus": 1, "max_steps": 3, "micro_batch": 6},
        },
    )
    assert proc.returncode == 0
    first = losses(repo)[1]
    # It starts where the baseline ended, far below a fresh model's first loss.
    assert first < losses(baseline)[1] - 1.0


def test_fast_paths_train_the_same_curve(prepared, baseline, tmp_path):
    """train.perf's padded attention, fused cross-entropy (a chunk that does not divide the
    batch), prefetched batches, fused gradient checks and sorted experts (on CPU HF's own
    experts loop per expert) change speed, not the math: the same losses as the plain path
    (fp32, 3 ranks), and the fingerprint ignores them, so a run can resume with other
    settings."""
    repo = tmp_path / "repo"
    perf = {
        "attention": "flash_padded",
        "ce_chunk": 37,
        "prefetch": True,
        "compile": False,
        "fused_grad_checks": True,
        "experts": "sorted",
    }
    trained_copy(prepared, repo, {"train": {"perf": perf}})
    plain, fast = losses(baseline), losses(repo)
    assert plain.keys() == fast.keys()
    for step in plain:
        assert fast[step] == pytest.approx(plain[step], rel=1e-5), step
    assert losses(repo, "val/loss") == pytest.approx(losses(baseline, "val/loss"), rel=1e-5)
    run = json.loads((repo / "checkpoints/run.json").read_text())
    assert (
        run["fingerprint"]
        == json.loads((baseline / "checkpoints/run.json").read_text())["fingerprint"]
    )


def test_logging_a_step_does_not_reread_the_run_so_far(tmp_path, monkeypatch):
    """DVCLive 3.49 re-reads every metric's whole TSV at each step to post to DVC Studio, even
    when Studio is not set up, so a step's logging grows with the run (32 ms at step 2000 on
    this 2-core machine). The train stage's logger leaves that out without Studio; the TSVs and
    the summary still hold every step."""
    import dvclive.live

    from dsflow.train.metrics import Logger

    monkeypatch.chdir(tmp_path)
    for var in ("DVC_ROOT", "DVC_STUDIO_TOKEN", "STUDIO_TOKEN", "DVC_STUDIO_URL"):
        monkeypatch.delenv(var, raising=False)
    reads = []
    parse = dvclive.live.parse_metrics
    monkeypatch.setattr(dvclive.live, "parse_metrics", lambda live: reads.append(1) or parse(live))
    logger = Logger(0, 30, resumed=False)
    for step in range(1, 31):
        logger.log(step, {"train/loss": 1.0 / step, "perf/step_s": 0.1})
    assert reads == []
    logger.close()
    rows = (tmp_path / "dvclive/plots/metrics/train/loss.tsv").read_text().splitlines()
    assert len(rows) == 31 and rows[-1].split("\t")[0] == "30"
    summary = json.loads((tmp_path / "dvclive/metrics.json").read_text())
    assert summary["step"] == 30 and summary["train"]["loss"] == pytest.approx(1 / 30)


LORA = {"finetune": "lora", "lora": {"rank": 4, "alpha": 8, "targets": ["attention", "experts"]}}


def _lora_run(prepared, baseline, repo, check=True, env=None, **train):
    overlay = {
        "model": {"pretrained": str(baseline / "models/final")},
        "train": {**LORA, "max_steps": 6, "checkpoint_every": 3, "eval_every": 6, **train},
    }
    return trained_copy(prepared, repo, overlay, env=env, check=check)


def _tensors(folder, name="model.safetensors"):
    from safetensors.torch import load_file

    return load_file(str(folder / name))


def test_lora_trains_adapters_only_and_resumes_bit_exactly(prepared, baseline, tmp_path):
    """LoRA on 3 ranks (ZeRO-2): the merged model differs from its base only in the adapted
    weights and the routers' balancing biases; the adapter loads with PEFT on the base and gives
    the merged model's loss; the run, rewound to its step-3 checkpoint, resumes to the same
    losses."""
    from transformers import AutoModelForCausalLM

    from dsflow.model import lora

    whole = tmp_path / "whole"
    proc = _lora_run(prepared, baseline, whole)
    assert "LoRA:" in proc.stderr and "trainable of" in proc.stderr
    base, tuned = _tensors(baseline / "models/final"), _tensors(whole / "models/final")
    assert set(base) == set(tuned)
    changed = {k for k in base if not torch.equal(base[k], tuned[k])}
    adapted = ("self_attn.q_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "mlp.experts.")
    assert changed and all(
        any(a in k for a in adapted) or "e_score_correction_bias" in k for k in changed
    ), sorted(changed)[:5]
    assert any("e_score_correction_bias" in k for k in changed)  # the balancer still balances
    assert not any("embed_tokens" in k or "norm" in k for k in changed)

    merged = _val_loss(AutoModelForCausalLM.from_pretrained(whole / "models/final"), whole, 8)
    adapted = lora.load(str(baseline / "models/final"), str(whole / "models/final/adapter"))
    assert _val_loss(adapted.eval(), whole, 8) == pytest.approx(merged, rel=1e-5)
    dsflow("export", "--out", "models/exported", cwd=whole)  # from the last checkpoint
    exported = _tensors(whole / "models/exported")
    for name, tensor in tuned.items():
        torch.testing.assert_close(exported[name], tensor, rtol=1e-6, atol=1e-7, msg=name)
    config = json.loads((whole / "models/exported/adapter/adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(baseline / "models/final")  # as given

    resumed = rewound_copy(whole, tmp_path / "resumed", 3)
    proc = _lora_run(prepared, baseline, resumed)
    assert "resumed from step 3" in proc.stderr
    assert losses(resumed) == losses(whole) and sorted(losses(whole)) == list(range(1, 7))


def test_lora_under_zero3_resumes_on_fewer_ranks(prepared, baseline, tmp_path):
    """LoRA at ZeRO-3: the adapters are gathered to be saved; killed on 3 ranks after the
    checkpoint of step 2, the run resumes on 2 (elastic) and finishes."""
    repo = tmp_path / "zero3"
    overlay = {"zero_stage": 3, "max_steps": 4, "checkpoint_every": 2, "eval_every": 4}
    fault = {"DSFLOW_FAULT_STEP": "3", "DSFLOW_FAULT_RANK": "1"}
    proc = _lora_run(prepared, baseline, repo, check=False, env=fault, **overlay)
    assert proc.returncode == 2
    two = {"gpus": 2, "micro_batch": 3, "global_batch": 6, "grad_accum": None}
    proc = _lora_run(prepared, baseline, repo, **two, **overlay)
    assert "saved by 3 rank(s), this run has 2" in proc.stderr
    assert "resumed from step 2" in proc.stderr
    assert sorted(losses(repo)) == [1, 2, 3, 4]
    adapter = _tensors(repo / "models/final/adapter", "adapter_model.safetensors")
    assert all(t.abs().sum() > 0 for k, t in adapter.items() if "lora_B" in k)
    base, tuned = _tensors(baseline / "models/final"), _tensors(repo / "models/final")
    name = "model.layers.0.self_attn.o_proj.weight"
    assert not torch.equal(base[name], tuned[name])


def test_a_deepseek_v2_checkpoint_continues_resumes_bit_exactly_and_exports(prepared, tmp_path):
    """A tiny DeepSeek-V2 checkpoint (softmax routing, its balance loss from its config)
    trained on 3 ranks: val loss falls; a run resumed from its step-4 checkpoint logs the same
    losses bit for bit; models/final reloads in plain transformers as DeepseekV2ForCausalLM
    and gives the run's val loss."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from conftest import tiny_v2
    from dsflow.model.build import build_model
    from dsflow.model.presets import model_config

    vocab = json.loads((prepared / "data/shards/train/index.json").read_text())["vocab_size"]
    torch.manual_seed(0)
    start = build_model(model_config("deepseek-v2-lite", vocab, tiny_v2()), device_type="cpu")
    start.save_pretrained(tmp_path / "v2")
    AutoTokenizer.from_pretrained(prepared / "data/tokenizer").save_pretrained(tmp_path / "v2")
    overlay = {
        "model": {"pretrained": str(tmp_path / "v2")},
        "train": {"max_steps": 8, "eval_every": 4, "checkpoint_every": 4},
    }
    full = tmp_path / "full"
    proc = trained_copy(prepared, full, overlay)
    assert "balancing: deepseek_v2: DeepSeek-V2's sequence-wise balance loss, alpha 0.001" in (
        proc.stderr
    )
    metrics = json.loads((full / "metrics/train.json").read_text())
    assert metrics["val_loss"] < _val_loss(start.eval(), full) - 0.3

    resumed = rewound_copy(full, tmp_path / "resumed", 4)
    assert "resumed from step 4" in trained_copy(prepared, resumed, overlay).stderr
    assert losses(resumed) == losses(full) and sorted(losses(full)) == list(range(1, 9))
    again = json.loads((resumed / "metrics/train.json").read_text())
    assert again["val_loss"] == metrics["val_loss"]

    exported = AutoModelForCausalLM.from_pretrained(full / "models/final")
    assert type(exported).__name__ == "DeepseekV2ForCausalLM"
    assert exported.config.aux_loss_alpha == 0.001 and exported.config.seq_aux is True
    assert _val_loss(exported, full) == pytest.approx(metrics["val_loss"], rel=1e-5)
    dsflow("export", "--dtype", "bf16", "--out", "models/bf16", cwd=full)  # no routing bias
    assert type(AutoModelForCausalLM.from_pretrained(full / "models/bf16")).__name__ == (
        "DeepseekV2ForCausalLM"
    )
