"""dsflow.model.hfkernels on CPU: which experts kernel `hf-best` takes on which GPUs and why,
how HF is handed the installed SonicMoE, and what Liger Kernel needs (the packages are faked:
CI installs neither; tests/test_cuda.py runs the real ones on a GPU)."""

from __future__ import annotations

import sys
import types

import pytest
import torch

from dsflow.errors import UsageError
from dsflow.model import fastpaths, hfkernels
from dsflow.model.build import build_model
from dsflow.model.loss import TrainingLM
from dsflow.model.presets import model_config

H100 = {"index": 0, "name": "NVIDIA H100 80GB HBM3", "capability": [9, 0]}
A100 = {"index": 1, "name": "NVIDIA A100-SXM4-80GB", "capability": [8, 0]}
PERF = fastpaths.Perf(False, "sdpa", 0, False, experts="hf-best")


@pytest.fixture
def sonicmoe_loads(monkeypatch):
    """sonic-moe imports and passes HF's checks, as on a Hopper host with the wheels."""
    monkeypatch.setattr(hfkernels, "sonicmoe_missing", lambda: None)


def test_hf_best_takes_sonicmoe_on_hopper_where_it_loads(sonicmoe_loads):
    perf = hfkernels.pick_experts(PERF, [H100])
    assert perf.experts == "sonicmoe"
    assert "compute capability 9.0" in perf.experts_why
    line = hfkernels.experts_line(perf, "cuda")
    assert line.startswith("experts: HF's sonicmoe (train.perf.experts hf-best: sonic-moe ")


@pytest.mark.parametrize(
    "gpus, why",
    [
        ([], "sonicmoe needs a GPU"),
        ([H100, A100], "needs compute capability 9.x, and GPU 1 (NVIDIA A100-SXM4-80GB) is 8.0"),
    ],
)
def test_hf_best_keeps_grouped_mm_elsewhere_and_says_why(sonicmoe_loads, gpus, why):
    perf = hfkernels.pick_experts(PERF, gpus)
    assert perf.experts == "hf"
    assert why in perf.experts_why
    assert hfkernels.experts_line(perf, "cuda").startswith("experts: HF's grouped_mm (")
    assert hfkernels.experts_line(perf, "cpu").startswith("experts: HF's eager (")


def test_sonic_moe_that_does_not_import_is_one_line(monkeypatch):
    monkeypatch.setitem(sys.modules, "sonicmoe", None)  # import sonicmoe raises ImportError
    perf = hfkernels.pick_experts(PERF, [H100])
    assert perf.experts == "hf"
    assert perf.experts_why.startswith("sonicmoe does not import here (ModuleNotFoundError")
    assert "\n" not in perf.experts_why


def test_transformers_refusing_sonic_moe_gives_its_reason(monkeypatch):
    from transformers.integrations import sonicmoe as hf_sonicmoe

    def refuse(raise_error=False):
        raise ImportError("sonic-moe requires the `kernels` package.")

    monkeypatch.setitem(sys.modules, "sonicmoe", types.ModuleType("sonicmoe"))
    monkeypatch.setattr(hf_sonicmoe, "is_sonicmoe_loadable", refuse)
    assert hfkernels.sonicmoe_missing() == (
        "is refused by transformers: sonic-moe requires the `kernels` package."
    )


def fake_sonicmoe() -> types.ModuleType:
    """What HF's loader looks up in the SonicMoE kernel: enums.ActivationType and the entry."""
    module = types.ModuleType("sonicmoe")
    module.enums = types.SimpleNamespace(ActivationType=object())
    module.moe_general_routing_inputs = lambda *args, **kwargs: None
    return module


def test_hf_loads_the_installed_sonic_moe_instead_of_fetching_it(monkeypatch):
    from transformers.integrations import hub_kernels
    from transformers.integrations import sonicmoe as hf_sonicmoe

    module = fake_sonicmoe()
    monkeypatch.setitem(sys.modules, "sonicmoe", module)
    monkeypatch.setitem(hub_kernels._KERNEL_MODULE_MAPPING, "sonic-moe", None)
    monkeypatch.setattr(hf_sonicmoe, "is_sonicmoe_loadable", lambda raise_error=False: True)
    monkeypatch.setattr(hf_sonicmoe, "_SONICMOE", None)
    model = build_model(model_config("tiny", 300), device_type="cpu")
    assert fastpaths.use_experts(model, "sonicmoe") == "sonicmoe"
    assert model.config._experts_implementation == "sonicmoe"
    # The hub would need a network; with the package in HF's table it is never asked.
    monkeypatch.setattr(hub_kernels, "get_kernel", None, raising=False)
    kernel = hf_sonicmoe.load_sonicmoe_kernel()
    assert kernel.moe_general_routing_inputs is module.moe_general_routing_inputs


def test_an_undecided_hf_best_runs_hfs_default_experts():
    model = build_model(model_config("tiny", 300), device_type="cpu")
    assert fastpaths.use_experts(model, "hf-best") == "hf"
    assert model.config._experts_implementation == "eager"  # HF's choice on CPU, as built


@pytest.fixture
def liger_supports(monkeypatch):
    """liger-kernel installed, with kernels for DeepSeek-V3 only."""
    patch = types.ModuleType("liger_kernel.transformers.monkey_patch")
    patch.MODEL_TYPE_TO_APPLY_LIGER_FN = {"deepseek_v3": None}
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers.monkey_patch", patch)


def test_liger_runs_where_it_supports_the_model(liger_supports):
    hfkernels.check_liger("deepseek_v3", 0)
    with pytest.raises(UsageError, match="has no kernels for deepseek_v2 models"):
        hfkernels.check_liger("deepseek_v2", 0)
    with pytest.raises(UsageError, match="model.mtp_depth"):
        hfkernels.check_liger("deepseek_v3", 1)
    # fp16: Liger's unscaled loss gradients would underflow.
    with pytest.raises(
        UsageError, match=r"^train\.perf\.liger: true forms .* fp16 underflows them .*liger: false$"
    ):
        hfkernels.check_liger("deepseek_v3", 0, "fp16")
    hfkernels.check_liger("deepseek_v3", 0, "fp32")


def test_liger_without_the_package_is_refused_in_one_line(monkeypatch):
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers.monkey_patch", None)
    with pytest.raises(UsageError) as refused:
        hfkernels.check_liger("deepseek_v3", 0)
    assert str(refused.value).startswith("train.perf.liger: true needs liger-kernel")
    assert "\n" not in str(refused.value)


def test_liger_brings_its_own_cross_entropy_and_experts():
    perf = fastpaths.resolve({"liger": True}, "cuda")
    assert (perf.liger, perf.ce_chunk, perf.experts) == (True, 0, "hf")
    assert fastpaths.resolve({"liger": True, "experts": "hf-best"}, "cuda").experts == "hf"
    with pytest.raises(UsageError, match="set train.perf.ce_chunk: auto or 0"):
        fastpaths.resolve({"liger": True, "ce_chunk": 4096}, "cuda")
    with pytest.raises(UsageError, match="set train.perf.experts: auto or hf"):
        fastpaths.resolve({"liger": True, "experts": "sorted"}, "cuda")


def test_the_loss_from_hfs_forward_is_the_training_loss():
    """hf_loss: the targets go to HF's forward as shift_labels (already shifted), as Liger's
    forward takes them; a forward that computes HF's loss from them gives TrainingLM's."""
    torch.manual_seed(0)
    hf = build_model(model_config("tiny", 300), device_type="cpu")
    x = torch.randint(0, 300, (2, 33), generator=torch.Generator().manual_seed(1))
    inputs, targets = x[:, :-1], x[:, 1:]
    stock = type(hf).forward

    def forward_with_loss(self, input_ids=None, shift_labels=None, **kwargs):
        out = stock(self, input_ids=input_ids, **kwargs)
        out.loss = self.loss_function(
            logits=out.logits, labels=None, shift_labels=shift_labels, vocab_size=300
        )
        return out

    plain = TrainingLM(hf)(inputs, targets)
    hf.forward = forward_with_loss.__get__(hf)
    assert TrainingLM(hf, hf_loss=True)(inputs, targets).item() == pytest.approx(plain.item())


def test_the_train_stage_decides_hf_best_once_and_says_why(prepared, tmp_path, monkeypatch, caplog):
    """The run spec the ranks read holds the decided kernel and its reason (here the CPU's:
    HF's default), and the stage's log says it in one line."""
    import shutil

    from conftest import tiny_run
    from dsflow import params as params_mod
    from dsflow.train import stage

    repo = tmp_path / "repo"
    shutil.copytree(prepared, repo, ignore=shutil.ignore_patterns("checkpoints", "models"))
    monkeypatch.chdir(repo)
    overlay = tiny_run(1, 2, zero_stage=2, perf={"experts": "hf-best"})
    params = params_mod.validate(params_mod.deep_merge(params_mod.load(), overlay))
    monkeypatch.setattr(stage.log, "propagate", True)  # a stage run earlier may have cut it
    with caplog.at_level("INFO", logger="dsflow"):
        spec = stage.resolve_run(params)
    assert (spec["perf"]["experts"], spec["perf"]["experts_why"]) == ("hf", "sonicmoe needs a GPU")
    expected = "experts: HF's eager (train.perf.experts hf-best: sonicmoe needs a GPU)"
    assert expected in caplog.messages
    liger = params_mod.deep_merge(params, {"train": {"perf": {"liger": True}}})
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers.monkey_patch", None)
    with pytest.raises(UsageError, match="^train.perf.liger: true needs liger-kernel"):
        stage.resolve_run(liger)
