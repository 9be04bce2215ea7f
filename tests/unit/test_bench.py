"""bench/train_throughput.py's loss check, on made-up curves: the GPU runs it, the CPU checks it
judges rounding noise as agreement and a changed curve as disagreement."""

from __future__ import annotations

import importlib.util
import json
import math
import re
import sys

import pytest

from conftest import ROOT
from dsflow.errors import UsageError
from dsflow.paths import shard_index


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location(
        "train_throughput", ROOT / "bench/train_throughput.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def curve(wobble: float = 0.0, phase: float = 0.0, scale: float = 1.0, steps: int = 60) -> dict:
    """A decaying loss; `wobble` adds a deterministic rounding-like ripple of that relative size."""
    return {
        s: scale * (3.0 + 5.0 * math.exp(-s / 15)) * (1 + wobble * math.sin(1.7 * s + phase))
        for s in range(1, steps + 1)
    }


def test_identical_curves_differ_by_nothing(bench):
    assert bench.loss_agreement(curve(), curve()) == (0.0, 0.0)


def test_only_the_first_steps_both_runs_logged_are_compared(bench):
    base, run = curve(), curve()
    for s in range(bench.COMPARE_STEPS + 1, 61):
        run[s] *= 2  # after the compared window
    del run[7]
    assert bench.loss_agreement(base, run) == (0.0, 0.0)
    assert bench.loss_agreement(base, {100: 1.0}) is None
    assert bench.loss_agreement(base, {}) is None


def test_a_one_step_spike_counts_in_the_mean_but_is_smoothed_in_the_max(bench):
    base, run = curve(), curve()
    run[25] *= 1.30
    mean, largest = bench.loss_agreement(base, run)
    assert mean == pytest.approx(0.30 / bench.COMPARE_STEPS)
    # Spread over the centred 5-step means around it: a fifth of the spike, not all of it.
    assert largest == pytest.approx(0.30 / bench.SMOOTH, rel=0.05)


def test_the_tolerance_scales_with_the_noise_run_and_has_floors(bench):
    assert bench.tolerance(None) == (bench.FIXED_MEAN, bench.FIXED_MAX)
    assert bench.tolerance((0.0, 0.0)) == (bench.FLOOR_MEAN, bench.FLOOR_MAX)
    mean, largest = bench.tolerance((0.01, 0.02))
    assert mean == pytest.approx(bench.NOISE_FACTOR * 0.01 + bench.FLOOR_MEAN)
    assert largest == pytest.approx(bench.NOISE_FACTOR * 0.02 + bench.FLOOR_MAX)


def fake_stage(
    curves: dict, step_s=lambda name: 0.1, seen: list | None = None, more: dict | None = None
):
    """The train stage's result for `curves`; `seen` collects each run's overlay, `more` adds
    fields to every result."""

    def run_stage(name, config, variant, steps, out, profile):
        if seen is not None:
            seen.append(variant)
        vname = re.sub(r"-\d+$", "", name.split("-", 1)[1])  # dense-dsflow-2: round 2
        return {
            "name": name,
            "loss": curves[vname],
            "step_s": step_s(name),
            "data_wait": 0.001,
            "peak_gb": 10.0,
            "params_total": 200e6,
            "params_activated": 190e6,
            "wall_s": 1.0,
            **(more or {}),
        }

    return run_stage


def run_bench(bench, monkeypatch, tmp_path, curves: dict, variants: str, *more, **stage) -> int:
    """bench.main() on `curves` (variant -> losses) for the dense config, no GPU needed; `more`:
    further arguments, `stage`: fake_stage's."""
    monkeypatch.setattr(bench, "run_stage", fake_stage(curves, **stage))
    monkeypatch.setattr(bench, "matmul_peak_tflops", lambda: 700.0)
    what = "H200 SXM datasheet dense bf16 peak 989.5 TFLOP/s"
    monkeypatch.setattr(bench, "datasheet_peak_tflops", lambda: (989.5, what))
    # 1.2 GFLOP per token at seq 1024, linear in seq here so that the seq it gets shows
    flops = lambda config, frozen=False, seq=1024: 1.2e9 * seq / 1024  # noqa: E731
    monkeypatch.setattr(bench, "flops_per_token", flops)
    argv = ["x", "--configs", "dense", "--variants", variants, "--out", str(tmp_path), *more]
    monkeypatch.setattr(sys, "argv", argv)
    return bench.main()


def test_repeated_rounds_alternate_and_give_the_speedup_with_its_spread(
    bench, monkeypatch, tmp_path, capsys
):
    """--repeat 3: baseline and dsflow run in turn, three of each (and the noise run the bench
    adds, once); step times are medians and the speedup is the median of the rounds' ratios
    with their range."""
    base_s = {"1": 0.30, "2": 0.36, "3": 0.33}
    dsflow_s = {"1": 0.10, "2": 0.10, "3": 0.12}
    order = []

    def step_s(name):
        order.append(name)
        variant, round_ = name.split("-")[1:]
        return (base_s if variant == "baseline" else dsflow_s)[round_]

    curves = {"baseline": curve(), "dsflow": curve(), "noise": curve(0.005, phase=2.0)}
    code = run_bench(
        bench, monkeypatch, tmp_path, curves, "baseline,dsflow", "--repeat", "3", step_s=step_s
    )
    out = capsys.readouterr().out
    assert code == 0
    timed = [f"dense-{v}-{k}" for k in "123" for v in ("baseline", "dsflow")]
    assert order == [*timed[:2], "dense-noise-1", *timed[2:]]
    run = json.loads((tmp_path / "results.json").read_text())["runs"]["dense"]["dsflow"]
    assert run["step_s"] == pytest.approx(0.10)
    assert run["tokens_per_s"] == pytest.approx(16 * 1024 / 0.10)
    # rounds: 3.00x, 3.60x, 2.75x
    assert "3.00x (2.75-3.60)" in out


@pytest.mark.parametrize(
    "dsflow, noise, listed, agrees",
    [
        # Rounding-sized differences, the noise run's as large: the same math.
        (curve(0.01, phase=1.0), curve(0.01, phase=2.0), True, True),
        # A 3% ripple, outside the fixed 1% mean, with a noise run that drifts as much: bf16
        # noise. Not asked for, the bench adds the noise run (at the fixed tolerance a run
        # like this reads DISAGREE).
        (curve(0.03, phase=1.0), curve(0.03, phase=2.0), False, True),
        (curve(0.03, phase=1.0), curve(0.03, phase=2.0), True, True),
        # A curve 3% higher at every step is another result, whatever the noise run did.
        (curve(scale=1.03), curve(0.005, phase=2.0), True, False),
    ],
)
def test_the_bench_verdict_judges_dsflow_against_the_noise_run(
    bench, monkeypatch, tmp_path, capsys, dsflow, noise, listed, agrees
):
    curves = {"baseline": curve(), "dsflow": dsflow, "noise": noise}
    variants = "baseline,noise,dsflow" if listed else "baseline,dsflow"
    code = run_bench(bench, monkeypatch, tmp_path, curves, variants)
    out = capsys.readouterr().out
    assert code == (0 if agrees else 1)
    assert ("dense: dsflow vs baseline agree" in out) == agrees
    assert ("dense: dsflow vs baseline DISAGREE" in out) != agrees
    assert ("adding noise, the loss check's reference" in out) != listed
    drift = bench.loss_agreement(curves["baseline"], noise)
    noisy = drift[0] > bench.FIXED_MEAN or drift[1] > bench.FIXED_MAX
    assert ("warning: the noise runs drifted" in out) == noisy
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["runs"]["dense"]["dsflow"]["loss_agrees"] is agrees
    assert results["loss_tolerance"]["dense"]["from_noise_run"]
    # 16 x 1024 tokens in 0.1 s: MFU against the datasheet's 989.5 TFLOP/s, "of achievable"
    # against the 700 measured.
    run = results["runs"]["dense"]["dsflow"]
    assert run["mfu"] == pytest.approx(163840 * 1.2e9 / 989.5e12)
    assert run["mfu_of_achievable"] == pytest.approx(163840 * 1.2e9 / 700e12)
    assert results["datasheet_peak_tflops"] == 989.5 and results["peak_tflops"] == 700.0
    assert "MFU: of the H200 SXM datasheet dense bf16 peak 989.5 TFLOP/s" in out


def test_every_lever_is_judged_and_a_run_without_losses_disagrees(
    bench, monkeypatch, tmp_path, capsys
):
    """Each run but the references gets a verdict and counts for the exit code; a run that
    logged no losses disagrees instead of stopping the bench; the noise runs are references,
    not judged, and noisy ones draw a warning."""
    curves = {
        "baseline": curve(),
        "noise": curve(0.03, phase=2.0),
        "noise-ce": curve(0.01, phase=3.0),
        "dsflow": curve(0.01, phase=1.0),
        "zero1": {},
    }
    assert run_bench(bench, monkeypatch, tmp_path, curves, ",".join(curves)) == 1
    out = capsys.readouterr().out
    assert "dense: dsflow vs baseline agree" in out
    assert "dense: zero1 vs baseline DISAGREE" in out
    assert "noise vs baseline" not in out and "noise-ce vs baseline" not in out
    assert "warning: the noise runs drifted" in out
    runs = json.loads((tmp_path / "results.json").read_text())["runs"]["dense"]
    assert all(runs[v]["loss_agrees"] is None for v in ("baseline", "noise", "noise-ce"))


def test_the_noise_level_is_the_largest_difference_between_two_reference_runs(bench):
    """One noise run can happen to round almost like the baseline; every pair of reference
    runs is another draw of the noise, and the largest counts."""
    base, close, far = curve(), curve(0.002, phase=2.0), curve(0.02, phase=3.0)
    runs = {"baseline": {"loss": base}, "noise": {"loss": close}, "dsflow": {"loss": far}}
    assert bench.noise_level({"baseline": {"loss": base}, "dsflow": {"loss": far}}) is None
    assert bench.noise_level(runs) == bench.loss_agreement(base, close)
    runs["noise-ce"] = {"loss": far}
    level = bench.noise_level(runs)
    # Three references, three draws (noise-ce vs noise counts too): the largest of each.
    pairs = [bench.loss_agreement(a, b) for a, b in ((base, close), (base, far), (close, far))]
    assert level == (max(d[0] for d in pairs), max(d[1] for d in pairs))
    assert level[0] > bench.loss_agreement(base, close)[0]
    # A run that drifts like noise-ce: outside the tolerance of the close noise run alone,
    # inside the one of both.
    run = bench.loss_agreement(base, curve(0.02, phase=4.0))
    narrow, wide = bench.tolerance(bench.loss_agreement(base, close)), bench.tolerance(level)
    assert run[0] > narrow[0] and run[0] <= wide[0] and run[1] <= wide[1]


@pytest.mark.parametrize(
    "variants, reference, added, adds",
    [
        (["baseline", "dsflow"], "baseline", set(), "noise"),
        (["baseline", "noise-ce", "dsflow"], "baseline", set(), None),
        (["baseline", "dsflow"], "baseline", {"noise"}, None),  # from --add-runs
        (["dsflow", "fp8"], "dsflow", set(), "no-flash"),
        (["dsflow", "fp8"], "dsflow", {"dsflow"}, "no-flash"),
        (["baseline"], "baseline", set(), None),  # nothing compared
        (["dsflow", "zero1"], "baseline", set(), None),  # no reference: nothing compared
        (["dsflow"], "baseline", {"baseline"}, "noise"),  # the reference from --add-runs
    ],
)
def test_a_comparison_without_a_noise_run_gets_one(bench, variants, reference, added, adds):
    assert bench.noise_run_to_add(variants, reference, added) == adds


def test_the_table_names_each_runs_experts_and_why_hf_best_took_them(
    bench, monkeypatch, tmp_path, capsys
):
    curves = {"baseline": curve(), "noise": curve(0.005, phase=2.0)}
    why = "sonic-moe 0.1.2.post1 loads, compute capability 9.0"
    more = {"experts": "sonicmoe", "experts_why": why}
    run_bench(bench, monkeypatch, tmp_path, curves, "baseline,noise", more=more)
    out = capsys.readouterr().out
    assert re.search(r"\nconfig +run +experts ", out)
    assert re.search(r"\ndense +baseline +sonicmoe ", out)
    assert f"dense: experts hf-best took sonicmoe ({why}): baseline, noise" in out
    runs = json.loads((tmp_path / "results.json").read_text())["runs"]["dense"]
    assert runs["baseline"]["experts"] == "sonicmoe"


@pytest.mark.parametrize(
    "perf, experts",
    [
        ({"experts": "hf"}, "grouped_mm"),
        ({"experts": "sonicmoe"}, "sonicmoe"),
        ({"experts": "sorted"}, "sorted"),
        ({"experts": "hf", "liger": True}, "liger"),
    ],
)
def test_a_runs_experts_are_named_from_its_resolved_perf(bench, perf, experts):
    assert bench.experts_of(perf) == experts
    why = {**perf, "experts_why": "sonicmoe needs a GPU"}
    assert bench.experts_taken(bench.CONFIGS["moe"], why) == {
        "experts": experts,
        "experts_why": "sonicmoe needs a GPU",
    }
    # all layers dense: no routed experts to name
    assert bench.experts_taken(bench.CONFIGS["dense"], why)["experts"] == "none"


def test_baseline_liger_is_left_out_in_one_line_where_liger_cannot_run(
    bench, monkeypatch, tmp_path, capsys
):
    from dsflow.model import hfkernels

    curves = {v: curve() for v in ("baseline", "noise", "baseline-liger")}
    why = "needs liger-kernel, which does not import here"
    monkeypatch.setattr(hfkernels, "liger_refusal", lambda model_type: why)
    run_bench(bench, monkeypatch, tmp_path, curves, "baseline,noise,baseline-liger")
    out = capsys.readouterr().out
    assert f"dense-baseline-liger: left out: train.perf.liger: true {why}; set" in out
    assert "running dense-baseline-liger" not in out
    monkeypatch.setattr(hfkernels, "liger_refusal", lambda model_type: None)
    seen = []
    run_bench(bench, monkeypatch, tmp_path, curves, "baseline,noise,baseline-liger", seen=seen)
    assert "dense: baseline-liger vs baseline agree" in capsys.readouterr().out
    assert seen[-1]["perf"] == {**bench.VARIANTS["baseline"]["perf"], "liger": True}


def test_without_a_baseline_nothing_is_judged(bench, monkeypatch, tmp_path, capsys):
    curves = {"dsflow": curve(), "zero1": curve()}
    assert run_bench(bench, monkeypatch, tmp_path, curves, "dsflow,zero1") == 0
    assert "dense: losses not compared" in capsys.readouterr().out


def test_variants_stack_with_plus_and_a_wrong_name_stops_before_any_run(bench):
    stacked = bench.variant("zero1+sorted-compiled-hooks")
    assert stacked == {
        "zero_stage": 1,
        "perf": {"experts": "sorted", "compile_router_hooks": True},
    }
    # The later overlay wins key by key, and the earlier one's other keys stay.
    assert bench.variant("baseline+cudagraphs")["perf"] == {
        **bench.VARIANTS["baseline"]["perf"],
        "compile_mode": "reduce-overhead",
    }
    with pytest.raises(SystemExit, match="unknown zero9"):
        bench.variant("zero1+zero9")


def test_each_mtp_config_is_its_base_model_with_a_block_of_its_kind(bench):
    """X-mtp1 measures one MTP depth against X: the same main layers, and an MTP block of the
    main layers' kind (HF decides a layer's kind from its index, the block's being L)."""
    from dsflow.model.presets import PRESETS, model_config, mtp_layer_is_moe

    for name in ("dense", "moe"):
        base, with_mtp = bench.CONFIGS[name], bench.CONFIGS[f"{name}-mtp1"]
        configs = [model_config(c["preset"], 512, c["overrides"]) for c in (base, with_mtp)]
        main = [
            [i >= (c.first_k_dense_replace or 0) for i in range(c.num_hidden_layers)]
            for c in configs
        ]
        assert main[0] == main[1] and with_mtp["mtp_depth"] == 1
        assert mtp_layer_is_moe(configs[1], 1) is any(main[0]), name
    assert PRESETS["medium"]["num_hidden_layers"] == 16


def test_every_variant_and_config_is_a_valid_params_overlay(bench):
    """A misspelt train key or value in a variant fails here in one line, not on a GPU
    mid-bench (the fine-tuning variants continue from a checkpoint the bench saves; one stands
    in for it). The configs' model.overrides are HF config keys, which the schema leaves open."""
    from dsflow import params as params_mod

    base = params_mod.load(ROOT / "params.yaml")
    moe = bench.CONFIGS["moe"]
    # Each variant on one config, each config under one variant: the schema checks train and
    # model apart (but for fine-tuning's checkpoint, stood in for below).
    runs = [(moe, change) for change in bench.VARIANTS.values()]
    runs += [(config, bench.VARIANTS["dsflow"]) for config in bench.CONFIGS.values()]
    for config, change in runs:
        if change.get("finetune"):
            config = {**config, "pretrained": "checkpoint"}
        params_mod.validate(params_mod.deep_merge(base, {"model": config, "train": change}))
    with pytest.raises(UsageError, match="train.perf.compile_mode"):
        wrong = {"train": {"perf": {"compile_mode": "max_autotune"}}}
        params_mod.validate(params_mod.deep_merge(base, wrong))


def test_each_run_prints_the_planned_against_the_measured_peak(
    bench, monkeypatch, tmp_path, capsys
):
    curves = {"baseline": curve(), "noise": curve(), "dsflow": curve()}
    memory = {"reserved_gb": 10.0, "planned_gb": 11.0}
    run_bench(bench, monkeypatch, tmp_path, curves, "baseline,dsflow", more=memory)
    out = capsys.readouterr().out
    assert "planned 11.0 GB vs reserved 10.0 GB (+10%)" in out
    assert "plan/rsv" in out and " 1.10 " in out


def test_fine_tuning_variants_continue_a_saved_random_init(bench, prepared, tmp_path, monkeypatch):
    """`lora` and `full-ft` train from the config's random init, saved once as a checkpoint
    the model builder loads (the tiny preset here)."""
    from dsflow.model.build import build_model, load_checkpoint_config

    monkeypatch.chdir(prepared)
    config = {"preset": "tiny", "overrides": {}}
    folder = bench.checkpoint_of(config, tmp_path)
    assert bench.checkpoint_of(config, tmp_path) == folder  # saved once
    net = build_model(
        load_checkpoint_config(str(folder)), device_type="cpu", pretrained=str(folder)
    )
    assert net.config.vocab_size == bench.vocab_size()
    assert (folder / "tokenizer.json").exists()
    assert bench.variant("lora") == {"finetune": "lora"}


def test_time_to_quality_is_the_training_time_of_the_first_validation_at_the_target(
    prepared, tmp_path, monkeypatch, capsys
):
    """bench/time_to_quality.py on a made-up run: val bits per byte from the logged val loss
    and the val split's bytes per token, the first validation within the margin of the
    builtin corpus's entropy floor, and the step times summed up to it."""
    sys.path.insert(0, str(ROOT / "bench"))
    import time_to_quality as ttq

    monkeypatch.chdir(prepared)
    floor, per_token = ttq.entropy_floor(), ttq.bytes_per_token()
    assert 0.2 < floor < 1.0 and 1.0 < per_token < 8.0  # the builtin corpus, its tokenizer
    nats = lambda bpb: bpb * math.log(2) * per_token  # noqa: E731 - val loss at this bpb
    run = {
        "val_loss": {10: nats(3 * floor), 20: nats(1.05 * floor), 30: nats(1.01 * floor)},
        "step_s": {s: 0.5 for s in range(1, 31)},
        "wall_s": 40.0,
    }
    assert ttq.reached(run, 1.10 * floor, per_token) == (20, 10.0)
    assert ttq.reached(run, 1.001 * floor, per_token) is None
    monkeypatch.setattr(ttq, "run_variant", lambda name, args, out, target, per, progress: run)
    argv = ["x", "--variants", "dsflow", "--within", "0.1", "--out", str(tmp_path)]
    monkeypatch.setattr(sys, "argv", argv)
    assert ttq.main() == 0
    out = capsys.readouterr().out
    assert "dsflow: step 20, 10.0 s of training" in out
    saved = json.loads((tmp_path / "time_to_quality.json").read_text())
    assert saved["runs"]["dsflow"]["reached"] == [20, 10.0]
    # the test corpus is far smaller than 1500 steps of 16 x 1024 tokens: said before any run
    passes = 1500 * 16 * 1024 / json.loads(shard_index("train").read_text())["tokens"]
    assert saved["train_passes"] == pytest.approx(passes) and passes > 1
    assert f"read the train split {passes:.1f} times" in out
    # out of reach: the closest validation and how far over the floor it stayed
    monkeypatch.setattr(sys, "argv", [*argv[:4], "0.001", *argv[5:], "--steps", "1"])
    assert ttq.main() == 0
    out = capsys.readouterr().out
    assert "dsflow: not within 0% of the floor by step 30; best val" in out
    assert "(1.0% over) at step 30" in out and "times;" not in out


def test_time_to_quality_runs_each_variant_on_each_config_and_evaluates_them(
    prepared, tmp_path, monkeypatch, capsys
):
    """--config moe,moe-mtp1 (a model change measured against the model without it): the runs
    are named config/variant and train their own config; --evaluate adds the evaluate stage's
    numbers and each run's median step time, with its cost over the first run's."""
    sys.path.insert(0, str(ROOT / "bench"))
    import time_to_quality as ttq

    monkeypatch.chdir(prepared)
    per_token = ttq.bytes_per_token()
    nats = ttq.entropy_floor() * 1.05 * math.log(2) * per_token
    trained = []

    def fake_run(name, args, out, target, per, progress):
        config, vname = ttq.split_name(name, args)
        trained.append((config, vname))
        step = 0.11 if config == "moe-mtp1" else 0.10
        return {"val_loss": {20: nats}, "step_s": {s: step for s in range(1, 21)}, "wall_s": 9.0}

    def fake_eval(r):
        mtp = {"mtp_top1_accuracy_1": 0.41, "speculative_acceptance_1": 0.62}
        extra = {**mtp, "speculative_speedup": 1.45} if r["step_s"][1] > 0.10 else {}
        return {"eval": {"val_loss": 1.2345, "bits_per_byte": 0.4567, **extra}}

    monkeypatch.setattr(ttq, "run_variant", fake_run)
    monkeypatch.setattr(ttq, "evaluated", fake_eval)
    argv = ["x", "--config", "moe,moe-mtp1", "--variants", "dsflow", "--evaluate"]
    monkeypatch.setattr(sys, "argv", [*argv, "--out", str(tmp_path)])
    assert ttq.main() == 0
    assert trained == [("moe", "dsflow"), ("moe-mtp1", "dsflow")]
    out = capsys.readouterr().out
    assert "| moe/dsflow | 100.0 | +0.0% | 1.2345 | 0.4567 |  |  |  |" in out
    assert "| moe-mtp1/dsflow | 110.0 | +10.0% | 1.2345 | 0.4567 | 0.410 | 0.620 | 1.45x |" in out
    saved = json.loads((tmp_path / "time_to_quality.json").read_text())
    assert saved["runs"]["moe-mtp1/dsflow"]["eval"]["speculative_acceptance_1"] == 0.62
    monkeypatch.setattr(sys, "argv", ["x", "--config", "moe,nope", "--out", str(tmp_path)])
    with pytest.raises(SystemExit, match="--config: unknown nope"):
        ttq.main()


def test_a_run_is_judged_against_dsflow_over_the_steps_asked_for(
    bench, monkeypatch, tmp_path, capsys
):
    """--reference dsflow --compare-steps 200 (FP8 against bf16): fp8 and its speed are
    measured against dsflow, no-flash is dsflow's noise run, and a curve that parts from
    dsflow's only after step 50 is caught."""
    late = {s: v * (1.03 if s > 100 else 1.0) for s, v in curve(steps=200).items()}
    curves = {"dsflow": curve(steps=200), "no-flash": curve(0.003, phase=2.0, steps=200)}
    step_s = lambda name: 0.10 if name.endswith("dsflow") else 0.08  # noqa: E731
    for fp8, agrees in ((curve(0.003, phase=1.0, steps=200), True), (late, False)):
        curves["fp8"] = fp8
        more = ("--reference", "dsflow", "--compare-steps", "200", "--steps", "200")
        code = run_bench(
            bench, monkeypatch, tmp_path, curves, "dsflow,no-flash,fp8", *more, step_s=step_s
        )
        out = capsys.readouterr().out
        assert code == (0 if agrees else 1)
        assert f"dense: fp8 vs dsflow {'agree' if agrees else 'DISAGREE'}" in out
        assert "no-flash vs dsflow" not in out
        results = json.loads((tmp_path / "results.json").read_text())
        tol = results["loss_tolerance"]["dense"]
        assert tol["reference"] == "dsflow" and tol["steps"] == 200 and tol["from_noise_run"]
        assert "1.25x" in out  # 0.10 s / 0.08 s against dsflow
    # over the default 50 steps the late parting is not seen
    more = ("--reference", "dsflow", "--steps", "200")
    run_bench(bench, monkeypatch, tmp_path, curves, "dsflow,no-flash,fp8", *more)
    assert "dense: fp8 vs dsflow agree" in capsys.readouterr().out


def test_a_run_shorter_than_the_compared_steps_is_compared_over_its_own(
    bench, monkeypatch, tmp_path, capsys
):
    """--steps 30 with the default 50 compared steps: the loss table stops at step 30 (no
    zeros for steps never run) and the verdict says 30 steps."""
    curves = {"baseline": curve(steps=30), "dsflow": curve(0.002, phase=1.0, steps=30)}
    curves["noise"] = curve(steps=30)
    assert run_bench(bench, monkeypatch, tmp_path, curves, "baseline,dsflow", "--steps", "30") == 0
    out = capsys.readouterr().out
    columns = next(line for line in out.splitlines() if "loss at steps" in line).split()
    assert columns[-1] == "30"
    assert " 0.000" not in out
    assert "over the first 30 steps" in out
    tol = json.loads((tmp_path / "results.json").read_text())["loss_tolerance"]["dense"]
    assert tol["steps"] == 30


def test_runs_of_an_earlier_bench_join_the_comparison(bench, monkeypatch, tmp_path, capsys):
    """--add-runs: a noise run from another results.json calibrates the tolerance as if it had
    run here; a name this run has is not replaced."""
    earlier = tmp_path / "earlier"
    curves = {"dsflow": curve(), "no-flash": curve(0.03, phase=2.0)}
    run_bench(bench, monkeypatch, earlier, curves, "no-flash,dsflow")
    capsys.readouterr()
    fp8 = curve(0.03, phase=1.0)  # outside the fixed 1% mean, inside the noise run's drift
    curves = {"dsflow": curve(), "fp8": fp8, "no-flash": curve(scale=2.0)}
    more = ("--reference", "dsflow", "--add-runs", str(earlier / "results.json"))
    assert run_bench(bench, monkeypatch, tmp_path / "here", curves, "dsflow,fp8", *more) == 0
    out = capsys.readouterr().out
    assert "dense-no-flash: from" in out and "dense-dsflow: from" not in out
    assert "dense: fp8 vs dsflow agree" in out
    results = json.loads((tmp_path / "here/results.json").read_text())
    assert results["loss_tolerance"]["dense"]["from_noise_run"]
    assert re.search(r"no-flash .* added", out)  # its speed is not compared
    assert "adding no-flash" not in out
    # made at another batch shape: left out, and the bench runs its own noise run instead
    run_bench(bench, monkeypatch, tmp_path / "other", curves, "dsflow,fp8", *more, "--micro", "8")
    out = capsys.readouterr().out
    assert "seq x micro (1024, 16), not (1024, 8): left out" in out
    assert "dense: no noise run of dsflow asked for: adding no-flash" in out


def test_a_stage_is_asked_to_stop_once_the_condition_holds(bench, tmp_path, monkeypatch):
    """wait_or_stop: the stage (here a stand-in that leaves when checkpoints/.stop appears, as
    the ranks do) runs until `until` turns true, then checkpoints/.stop asks it to leave."""
    import subprocess

    monkeypatch.chdir(tmp_path)
    leaves = "import pathlib, time\nwhile not pathlib.Path('checkpoints/.stop').exists(): time.sleep(0.05)"
    polls = []
    proc = subprocess.Popen([sys.executable, "-c", leaves])
    assert bench.wait_or_stop(proc, lambda: polls.append(1) or len(polls) >= 3, poll_s=0.05)
    assert proc.returncode == 0 and (tmp_path / "checkpoints/.stop").exists() and len(polls) == 3
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    assert not bench.wait_or_stop(proc, lambda: False, poll_s=0.05)
    # a half-written row (float("")) is "not yet"; the bench stopping stops the stage too
    (tmp_path / "checkpoints/.stop").unlink()
    proc = subprocess.Popen([sys.executable, "-c", leaves])
    rows = iter(["", "", "1.0"])
    assert bench.wait_or_stop(proc, lambda: float(next(rows)) > 0, poll_s=0.05)
    proc = subprocess.Popen([sys.executable, "-c", leaves])
    with pytest.raises(ZeroDivisionError):
        bench.wait_or_stop(proc, lambda: 1 / 0, poll_s=0.05)
    assert proc.returncode is not None


def test_time_to_quality_stops_a_run_at_its_first_validation_within_the_target(
    prepared, tmp_path, monkeypatch
):
    """run_variant's stop condition reads the stage's live val loss: false before a
    validation within the target is logged, true after; the curves come back with the run, and
    go to the progress callback at each new validation."""
    sys.path.insert(0, str(ROOT / "bench"))
    import time_to_quality as ttq

    monkeypatch.chdir(prepared)
    floor, per_token = ttq.entropy_floor(), ttq.bytes_per_token()
    monkeypatch.chdir(tmp_path)  # the stage's files: not in the shared fixture
    live = tmp_path / "dvclive/plots/metrics"
    seen = []

    def run_stage(name, config, variant, steps, out, profile, until):
        assert variant["eval_every"] == 25 and name == "ttq-dsflow"
        (live / "val").mkdir(parents=True, exist_ok=True)
        (live / "perf").mkdir(parents=True, exist_ok=True)
        (live / "perf/step_s.tsv").write_text("step\tstep_s\n1\t2.0\n2\t0.5\n")
        for bpb in (2 * floor, 1.05 * floor):
            loss = bpb * math.log(2) * per_token
            with open(live / "val/loss.tsv", "a") as f:
                f.write("step\tloss\n" if f.tell() == 0 else "")
                f.write(f"{25 * (len(seen) + 1)}\t{loss}\n")
            seen.append(until())
        return {"name": name, "stopped": True, "wall_s": 9.0}

    monkeypatch.setattr(ttq.tt, "run_stage", run_stage)
    monkeypatch.setattr(sys, "argv", ["x"])
    args = ttq.parse_args()
    shown = []
    r = ttq.run_variant("dsflow", args, tmp_path / "out", 1.10 * floor, per_token, shown.append)
    assert seen == [False, True]
    assert [sorted(c["val_loss"]) for c in shown] == [[25], [25, 50]]  # at each new validation
    assert r["stopped"] and set(r["val_loss"]) == {25, 50} and r["step_s"] == {1: 2.0, 2: 0.5}


def test_time_to_quality_compares_the_variants_at_every_level_the_first_one_reached(
    prepared, tmp_path, monkeypatch, capsys
):
    """The first variant stops short of the target: the later ones run to the tightest level it
    reached, and the figure (table and plot) gives each level's training seconds and speed-up;
    --max-seconds stops a run whose training time passed it."""
    sys.path.insert(0, str(ROOT / "bench"))
    import time_to_quality as ttq

    monkeypatch.chdir(prepared)
    floor, per_token = ttq.entropy_floor(), ttq.bytes_per_token()
    nats = lambda bpb: bpb * math.log(2) * per_token  # noqa: E731 - val loss at this bpb

    def made_up(over: list[float], step_s: float) -> dict:
        val = {10 * (i + 1): nats((1 + o) * floor) for i, o in enumerate(over)}
        return {"val_loss": val, "step_s": dict.fromkeys(range(1, 10 * len(over) + 1), step_s)}

    fast = made_up([0.45, 0.25, 0.12], 0.5)  # 50% at step 10, 30% at 20, 15% at 30, not 10%
    slow = made_up([0.45, 0.4, 0.25, 0.14], 1.5)  # 30% at step 30, 15% at step 40
    assert ttq.stop_level(fast, 1.1 * floor, floor, per_token, ttq.MARGINS) == 1.15 * floor
    levels, real_run_variant = [], ttq.run_variant

    def run_variant(name, args, out, target, per, progress):
        levels.append(target)
        if name == "baseline":  # a variant's curves are kept as it runs
            progress({"val_loss": {10: 1.0}, "step_s": {1: 1.0}})
            saved = json.loads((out_dir / "time_to_quality.json").read_text())
            assert saved["runs"]["baseline"]["running"] and "dsflow" in saved["runs"]
        return {**(fast if name == "dsflow" else slow), "wall_s": 1.0}

    monkeypatch.setattr(ttq, "run_variant", run_variant)
    out_dir = tmp_path / "out"
    argv = ["x", "--variants", "dsflow,baseline", "--steps", "1", "--out", str(out_dir)]
    monkeypatch.setattr(sys, "argv", argv)
    assert ttq.main() == 0
    assert levels == [pytest.approx(1.1 * floor), pytest.approx(1.15 * floor)]
    summary = (out_dir / "time_to_quality.md").read_text()
    assert "| 30% | " in summary and "| 10.0 (20) | 45.0 (30) | 4.50x |" in summary
    assert "| 15% | " in summary and "| 15.0 (30) | 60.0 (40) | 4.00x |" in summary
    assert "| 10% | " in summary and "| not reached | not reached |  |" in summary
    assert "| 50% | " in summary and summary.count("(10) |") == 2  # both at their first val
    assert (out_dir / "time_to_quality.png").read_bytes()[:4] == b"\x89PNG"
    saved = json.loads((out_dir / "time_to_quality.json").read_text())
    assert saved["runs"]["baseline"]["milestones"]["0.15"] == [40, 60.0]
    assert "baseline ... (until val" in capsys.readouterr().out

    # --reuse: the finished dsflow run is taken from the JSON and still sets the level; the
    # baseline, cut off while running, runs again; a run saved under other settings too
    saved["runs"]["baseline"]["running"] = True
    (out_dir / "time_to_quality.json").write_text(json.dumps(saved))
    levels.clear()
    monkeypatch.setattr(sys, "argv", [*argv, "--reuse"])
    assert ttq.main() == 0
    assert levels == [pytest.approx(1.15 * floor)]  # only the baseline ran, to dsflow's level
    assert (out_dir / "time_to_quality.md").read_text() == summary
    assert "dsflow: taken from" in capsys.readouterr().out
    monkeypatch.setattr(sys, "argv", [*argv[:4], "2", *argv[5:], "--reuse"])
    assert ttq.main() == 0 and len(levels) == 3
    assert "not reusing" in capsys.readouterr().out
    # a run that neither got to its level nor trained every step (stopped by --max-seconds) is
    # run again; one that trained every step is taken although it fell short
    stopped = made_up([0.45, 0.4, 0.25], 1.5)  # the slow run, stopped at step 30
    assert not ttq.usable(stopped, 1.15 * floor, per_token, steps=40)
    assert ttq.usable(stopped, 1.15 * floor, per_token, steps=30)
    assert ttq.usable(fast, 1.15 * floor, per_token, steps=1000)

    # --max-seconds: past it the run is stopped although val is far from the target
    monkeypatch.chdir(tmp_path)
    live = tmp_path / "dvclive/plots/metrics"
    (live / "perf").mkdir(parents=True)
    (live / "perf/step_s.tsv").write_text("step\tstep_s\n1\t2.0\n2\t0.5\n")
    asked = []
    stage = lambda name, config, variant, steps, out, profile, until: asked.append(until()) or {}  # noqa: E731
    monkeypatch.setattr(ttq.tt, "run_stage", stage)
    for cap in (0, 3.0, 2.0):
        monkeypatch.setattr(sys, "argv", ["x", "--max-seconds", str(cap)])
        real_run_variant("dsflow", ttq.parse_args(), tmp_path, 1.1 * floor, per_token)
    assert asked == [False, False, True]


def test_the_batch_shape_is_a_bench_argument(bench, monkeypatch, tmp_path, capsys):
    """--micro and --seq (more tokens per expert, say) reach the stage under every variant and
    count in tokens/s, MFU and the table's header."""
    seen = []
    curves = {"dsflow": curve(), "baseline": curve(), "noise": curve()}
    more = ("--micro", "32", "--seq", "2048")
    assert run_bench(bench, monkeypatch, tmp_path, curves, "baseline,dsflow", *more, seen=seen) == 0
    assert [(v["micro_batch"], v["seq_len"]) for v in seen] == [(32, 2048)] * 3
    results = json.loads((tmp_path / "results.json").read_text())
    run = results["runs"]["dense"]["dsflow"]
    assert run["tokens_per_s"] == pytest.approx(32 * 2048 / 0.1)
    assert run["mfu"] == pytest.approx(32 * 2048 / 0.1 * 2.4e9 / 989.5e12)  # flops at seq 2048
    assert (results["seq"], results["micro"]) == (2048, 32)
    assert "seq 2048, micro 32" in capsys.readouterr().out


def test_a_failed_stage_leaves_its_whole_log_in_the_output(bench, tmp_path, monkeypatch, capsys):
    """The train stage failing (here: no data in the working directory) is a failed run, not a
    stopped bench, and its whole log is kept beside the results."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "out").mkdir()
    r = bench.run_stage("dense-x", bench.CONFIGS["dense"], {}, 2, tmp_path / "out", False)
    assert r == {"name": "dense-x", "failed": True}
    log = (tmp_path / "out/failed-dense-x.log").read_text()
    assert "dsflow train: error" in log
    out = capsys.readouterr().out
    assert "dense-x: train stage failed" in out and "dsflow train: error" in out.split("errors:")[1]
    lines = ["[rank0]: Traceback", "[rank0]: torch.OutOfMemoryError: CUDA out of memory", "x"]
    assert bench.rank_errors(lines) == [lines[1]]


def test_a_sigterm_to_the_bench_stops_the_stage_it_started(tmp_path):
    """`timeout` or a scheduler ends the bench with SIGTERM: the stage it waits on (here a
    sleeping child) is stopped with it, not left running to hold checkpoints/."""
    import os
    import signal
    import subprocess
    import time

    script = tmp_path / "bench_waits.py"
    waiting = tmp_path / "waiting"
    # `until` marks that the bench polls inside wait_or_stop: the signal comes after that.
    script.write_text(
        "import importlib.util, pathlib, subprocess, sys\n"
        f"spec = importlib.util.spec_from_file_location('tt', {str(ROOT / 'bench/train_throughput.py')!r})\n"
        "tt = importlib.util.module_from_spec(spec); spec.loader.exec_module(tt)\n"
        "tt.stop_the_stage_on_sigterm()\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'])\n"
        "print(child.pid, flush=True)\n"
        f"mark = pathlib.Path({str(waiting)!r})\n"
        "tt.wait_or_stop(child, until=lambda: mark.touch() and False, poll_s=0.05)\n"
    )
    bench_proc = subprocess.Popen(
        [sys.executable, str(script)], stdout=subprocess.PIPE, text=True, env=os.environ
    )
    child = int(bench_proc.stdout.readline())
    deadline = time.monotonic() + 60
    while not waiting.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    bench_proc.send_signal(signal.SIGTERM)
    assert bench_proc.wait(timeout=60) == 128 + signal.SIGTERM
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            os.kill(child, 0)  # still there (or a zombie not yet reaped by init)
        except ProcessLookupError:
            return
        with open(f"/proc/{child}/stat") as f:
            if f.read().split(")")[-1].split()[0] == "Z":
                return
        time.sleep(0.1)
    raise AssertionError(f"the stage (pid {child}) outlived the bench")
