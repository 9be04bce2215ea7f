"""train.perf.fp8 (dsflow.model.float8): which linears go to FP8, that training through them
stays close to bf16 (torchao's emulation on CPU runs the same casts and scales), and the one-line
refusals."""

from __future__ import annotations

import copy
import dataclasses
import json
import sys

import pytest
import torch

from conftest import dsflow, tiny_run, tiny_v2, update_params
from dsflow.errors import UsageError
from dsflow.model import fastpaths, float8
from dsflow.model.build import build_model
from dsflow.model.loss import TrainingLM
from dsflow.model.presets import model_config
from dsflow.params import deep_merge, read_yaml, validate

VOCAB = 300
# The tiny preset with a dense MLP wide enough for FP8 to pay (out_features > 1024): its
# gate_proj and up_proj are chosen, its down_proj and every other linear are not.
WIDE_MLP = {"intermediate_size": 1056}


def tiny(family):
    torch.manual_seed(0)
    if family == "deepseek_v2":
        config = model_config("deepseek-v2-lite", VOCAB, tiny_v2(**WIDE_MLP))
        return build_model(config, device_type="cpu")
    return build_model(model_config("tiny", VOCAB, WIDE_MLP), device_type="cpu")


@pytest.mark.parametrize("recipe", float8.RECIPES)
def test_shapes_chosen_are_torchaos_own(recipe):
    """dsflow's shape rule is torchao's published one for the recipe (its auto filter)."""
    utils = pytest.importorskip("torchao.float8.float8_linear_utils")
    _auto_filter_for_recipe = utils._auto_filter_for_recipe

    theirs = _auto_filter_for_recipe(recipe, filter_fqns=[])
    dims = [16, 24, 512, 1024, 1040, 2048, 2064, 4096, 4112, 8192]
    for n in dims:
        for k in dims:
            linear = torch.nn.Linear(k, n, bias=False, device="meta")
            assert float8.worthwhile(n, k, recipe) == theirs(linear, "layer"), (n, k)


@pytest.mark.parametrize("family", ["deepseek_v3", "deepseek_v2"])
def test_fp8_linears_train_like_bf16(family):
    """The chosen linears become float8 ones (the lm_head, the router and small layers stay);
    parameter names are unchanged (checkpoints, export); one bf16 forward/backward gives the
    loss and gradients of the plain model within FP8's rounding."""
    Float8Linear = pytest.importorskip("torchao.float8.float8_linear").Float8Linear
    plain = tiny(family).to(torch.bfloat16)
    fp8 = copy.deepcopy(plain)
    perf = fastpaths.Perf(False, "sdpa", 0, False, fp8="tensorwise")
    applied = fastpaths.apply(fp8, perf)
    chosen = {"model.layers.0.mlp.gate_proj", "model.layers.0.mlp.up_proj"}
    converted = {name for name, m in fp8.named_modules() if isinstance(m, Float8Linear)}
    assert converted == chosen and applied.fp8_linears == 2
    assert "FP8 tensorwise on 2 linears" in applied.describe()
    assert [n for n, _ in fp8.named_parameters()] == [n for n, _ in plain.named_parameters()]
    x = torch.randint(0, VOCAB, (2, 33), generator=torch.Generator().manual_seed(1))
    grads = []
    for model in (plain, fp8):
        loss = TrainingLM(model, ce_chunk=0)(x[:, :-1], x[:, 1:])
        loss.backward()
        grads.append((loss.detach(), model.model.layers[0].mlp.gate_proj.weight.grad.float()))
    (loss_p, grad_p), (loss_f, grad_f) = grads
    assert loss_f == pytest.approx(loss_p.item(), rel=1e-2)
    # e4m3 keeps 3 mantissa bits: a few percent of the gradient's norm, not its direction.
    gap = (grad_f - grad_p).norm() / grad_p.norm()
    assert 0 < gap < 0.1, gap.item()


def test_fp8_refusals_name_the_key(monkeypatch):
    on = {"fp8": "tensorwise"}
    assert fastpaths.resolve({"fp8": False}, "cuda").fp8 == "off"
    assert fastpaths.resolve(on, "cuda", zero_stage=2).fp8 == "tensorwise"
    for precision in ("fp16", "fp32"):
        with pytest.raises(
            UsageError, match=r"^train\.perf\.fp8: tensorwise needs train\.precision: bf16"
        ):
            fastpaths.resolve(on, "cuda", precision=precision)
    with pytest.raises(
        UsageError, match=r"^train\.perf\.fp8: tensorwise is not supported with ZeRO-3"
    ):
        fastpaths.resolve(on, "cuda", zero_stage=3)
    lora = {
        "model": {"pretrained": "org/model"},
        "train": {"finetune": "lora", "perf": {"fp8": "rowwise"}},
    }
    with pytest.raises(
        UsageError,
        match=r"^params\.yaml: train\.perf\.fp8: rowwise is not supported with train\.finetune: lora",
    ):
        validate(deep_merge(read_yaml("params.yaml"), lora))
    a100 = {"index": 0, "name": "NVIDIA A100-SXM4-80GB", "capability": [8, 0]}
    h200 = {"index": 0, "name": "NVIDIA H200", "capability": [9, 0]}
    float8.check_gpus("tensorwise", [h200])
    with pytest.raises(
        UsageError, match=r"GPU 0 \(NVIDIA A100-SXM4-80GB\) is 8\.0; set train\.perf\.fp8: false"
    ):
        float8.check_gpus("tensorwise", [h200, a100])
    monkeypatch.setitem(sys.modules, "torchao.float8", None)  # not installed
    with pytest.raises(UsageError, match=r"needs torchao, which is not installed; pip install"):
        float8.convert(torch.nn.Linear(16, 16), "tensorwise", emulate=True)


@pytest.mark.slow
def test_fp8_run_trains_and_exports_plain_weights(prepared, tmp_path):
    """The train stage with train.perf.fp8 (emulated on CPU ranks, ZeRO-2, bf16): the log names
    the FP8 linears, the loss falls, and models/final holds exactly a plain model's weights."""
    import shutil

    from transformers import AutoModelForCausalLM

    pytest.importorskip("torchao.float8")
    repo = tmp_path / "repo"
    shutil.copytree(prepared, repo)
    overlay = tiny_run(2, 8, zero_stage=2, precision="bf16", perf={"fp8": "tensorwise"})
    overlay["model"]["overrides"] = WIDE_MLP
    update_params(repo, overlay)
    out = dsflow("train", cwd=repo, timeout=900)
    assert "FP8 tensorwise on 2 linears" in out.stderr
    rows = (repo / "dvclive/plots/metrics/train/loss.tsv").read_text().splitlines()[1:]
    loss = [float(r.split("\t")[1]) for r in rows]
    assert len(loss) == 8 and loss[-1] < loss[0]
    assert json.loads((repo / "metrics/train.json").read_text())["step"] == 8
    model, info = AutoModelForCausalLM.from_pretrained(
        repo / "models/final", output_loading_info=True
    )
    assert not any(info.values()), info  # no missing, unexpected or mismatched weights
    assert type(model.model.layers[0].mlp.gate_proj) is torch.nn.Linear


def test_fp8_experts_refusals_name_the_key(monkeypatch):
    """train.perf.fp8_experts: the same precision, ZeRO-3 and LoRA refusals as fp8, and one
    line each where the model or GPU has no FP8 grouped GEMM to run; where it runs, every
    experts module is marked and the fast-paths line says so."""
    on = {"fp8_experts": True}
    assert not fastpaths.resolve({}, "cuda").fp8_experts
    assert fastpaths.resolve(on, "cuda", zero_stage=2).fp8_experts
    with pytest.raises(UsageError, match=r"^train\.perf\.fp8_experts: true needs train\.precision"):
        fastpaths.resolve(on, "cuda", precision="fp16")
    with pytest.raises(UsageError, match=r"^train\.perf\.fp8_experts: true is not supported with"):
        fastpaths.resolve(on, "cuda", zero_stage=3)
    lora = {"model": {"pretrained": "org/model"}, "train": {"finetune": "lora", "perf": on}}
    with pytest.raises(UsageError, match=r"^params\.yaml: train\.perf\.fp8_experts: true is not"):
        validate(deep_merge(read_yaml("params.yaml"), lora))

    def refusal(model, experts="sorted", device="cpu"):
        with pytest.raises(UsageError) as caught:
            fastpaths.use_fp8_experts(model, experts, torch.device(device))
        line = str(caught.value)
        assert line.startswith("train.perf.fp8_experts: true ") and "\n" not in line
        assert line.endswith("; set train.perf.fp8_experts: false")
        return line

    def machine_refusal(device, gpus):
        with pytest.raises(UsageError) as caught:
            fastpaths.check_fp8_experts_machine(device, gpus)
        return str(caught.value)

    h100 = {"index": 0, "name": "NVIDIA H100 80GB HBM3", "capability": [9, 0]}
    b200 = {"index": 1, "name": "NVIDIA B200", "capability": [10, 0]}
    fastpaths.check_fp8_experts_machine("cuda", [h100])
    assert "GPU 1 (NVIDIA B200) is not;" in machine_refusal("cuda", [h100, b200])
    assert "this run is on the cpu; set train.perf.fp8_experts: false" in machine_refusal("cpu", [])
    moe = tiny("deepseek_v3")
    dense = build_model(
        model_config("tiny", VOCAB, {"first_k_dense_replace": 99}), device_type="cpu"
    )
    assert "(this one is all dense)" in refusal(dense)
    assert "needs the sorted experts" in refusal(moe, experts="hf")
    assert "compute capability 9.x" in refusal(moe)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    odd = build_model(model_config("tiny", VOCAB, {"moe_intermediate_size": 24}), device_type="cpu")
    assert "multiples of 16, not (128, 24)" in refusal(odd, device="cuda")
    module = "torchao.prototype.moe_training.fp8_grouped_mm"
    with monkeypatch.context() as without:
        without.setitem(sys.modules, module, None)  # not installed
        assert "needs torchao, which is not installed" in refusal(moe, device="cuda")
        assert "needs torchao, which is not installed" in machine_refusal("cuda", [h100])
    monkeypatch.setattr(fastpaths, "_FP8_GMM", None)  # set below; undone after the test
    fastpaths.use_fp8_experts(moe, "sorted", torch.device("cuda"))
    assert fastpaths._FP8_GMM is sys.modules[module]._to_fp8_rowwise_then_scaled_grouped_mm
    experts = [m for m in moe.modules() if hasattr(m, "gate_up_proj")]
    assert experts and all(getattr(m, fastpaths.FP8_EXPERTS) for m in experts)
    perf = fastpaths.Perf(False, "sdpa", 0, False, experts="sorted", fp8_experts=True)
    assert perf.describe().endswith("FP8 off, FP8 routed experts (rowwise)")


def test_fp8_experts_change_the_runs_fingerprint_and_keep_zero3_out_of_plans():
    """FP8 experts round differently: a run resumes only in the precision it trained in (off
    keeps every earlier fingerprint), and the planner offers no ZeRO-3 layout the stage would
    refuse."""
    from dsflow.plan.request import _perf
    from dsflow.train.checkpoint import fingerprint

    params = read_yaml("params.yaml")
    on = deep_merge(params, {"train": {"perf": {"fp8_experts": True}}})
    without = copy.deepcopy(params)
    del without["train"]["perf"]["fp8_experts"]
    prints = [fingerprint(p, 48, "sha") for p in (params, without, on)]
    assert prints[0] == prints[1] != prints[2]
    assert (
        _perf(on["train"], None, 1, "cuda", "bf16", [])["no_zero3"]
        == "train.perf.fp8_experts: true"
    )
    assert _perf(params["train"], None, 1, "cuda", "bf16", [])["no_zero3"] == ""


@pytest.mark.cuda
@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
    reason="torch's FP8 grouped GEMM needs a GPU of compute capability 9.x",
)
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_cuda_fp8_experts_train_like_bf16(compiled):
    """On an H100/H200: the FP8 experts' loss and gradients against the bf16 sorted experts',
    within FP8's rounding, eager and in compiled layers; every parameter gets a finite
    gradient (the padding rows feed none of them)."""
    pytest.importorskip("torchao.prototype.moe_training.fp8_grouped_mm")
    plain = tiny("deepseek_v3").to("cuda", torch.bfloat16)
    perf = fastpaths.Perf(compiled, "sdpa", 0, False, experts="sorted")
    fastpaths.apply(plain, perf)
    fp8 = tiny("deepseek_v3").to("cuda", torch.bfloat16)
    applied = fastpaths.apply(fp8, dataclasses.replace(perf, fp8_experts=True))
    assert applied.fp8_experts and "FP8 routed experts" in applied.describe()
    x = torch.randint(0, VOCAB, (4, 65), generator=torch.Generator().manual_seed(1)).cuda()
    results = []
    for model in (plain, fp8):
        loss = TrainingLM(model, ce_chunk=0)(x[:, :-1], x[:, 1:])
        loss.backward()
        results.append((loss.detach(), dict(model.named_parameters())))
    (loss_p, params_p), (loss_f, params_f) = results
    assert loss_f.item() == pytest.approx(loss_p.item(), rel=1e-2)
    for name, p in params_f.items():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
    for name in ("gate_up_proj", "down_proj"):
        full = f"model.layers.1.mlp.experts.{name}"
        want, got = params_p[full].grad.float(), params_f[full].grad.float()
        gap = (got - want).norm() / want.norm()
        assert 0 < gap < 0.1, (name, gap.item())
