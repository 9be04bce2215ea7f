"""LoRA adapters (dsflow.model.lora): what they reach, what they leave frozen, and both exports."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import ROOT, tiny_v2
from dsflow.errors import UsageError
from dsflow.model import lora
from dsflow.model.balance import ExpertBalancer
from dsflow.model.build import build_model
from dsflow.model.presets import model_config

VOCAB = 97
ALL = {"rank": 4, "alpha": 8, "dropout": 0.0, "targets": list(lora.GROUPS)}


def _config(family: str = "deepseek_v3", **overrides):
    if family == "deepseek_v2":
        return model_config("deepseek-v2-lite", VOCAB, tiny_v2(**overrides))
    return model_config("tiny", VOCAB, overrides)


def _base(seed: int = 0, family: str = "deepseek_v3", mtp_depth: int = 0, **overrides):
    torch.manual_seed(seed)
    return build_model(_config(family, **overrides), device_type="cpu", mtp_depth=mtp_depth)


def _batch(seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (2, 24), generator=g)


def _train(model, steps: int = 3, balancer=None):
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model.train()
    for step in range(steps):
        x = _batch(step)
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        if balancer is not None:
            balancer.update()


def _base_names(peft_model):
    """Base weight name (as in the plain model) -> tensor, for every non-adapter parameter."""
    out = {}
    for name, p in peft_model.named_parameters():
        if "lora_" in name:
            continue
        plain = name.removeprefix("base_model.model.").replace(".base_layer", "")
        out[plain] = p.detach().clone()
    return out


@pytest.mark.parametrize("family", ["deepseek_v3", "deepseek_v2"])
def test_every_group_reaches_its_weights_and_only_adapters_train(family):
    model = _base(family=family)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    peft_model = lora.attach(model, ALL)
    adapted = {n.split(".lora_")[0] for n, p in peft_model.named_parameters() if p.requires_grad}
    text = " ".join(sorted(adapted))
    for needle in ("self_attn.kv_b_proj", "layers.0.mlp.gate_proj", "shared_experts.down_proj"):
        assert needle in text
    assert any(n.endswith("mlp.experts") for n in adapted)  # the fused routed experts
    assert all("lora_" in n for n, p in peft_model.named_parameters() if p.requires_grad)
    _train(peft_model)
    after = _base_names(peft_model)
    assert set(after) == set(before)
    for name, tensor in before.items():
        assert torch.equal(after[name], tensor), name
    lora_b = [p for n, p in peft_model.named_parameters() if "lora_B" in n]
    assert all(p.abs().sum() > 0 for p in lora_b)  # every adapter moved off its zero start


def test_router_biases_still_balance_under_lora():
    peft_model = lora.attach(_base(), ALL)
    balancer = ExpertBalancer(peft_model, gamma=1e-2)
    assert len(balancer.routers) == 3
    _train(peft_model, steps=2, balancer=balancer)
    biases = torch.stack(balancer.bias_state())
    assert biases.abs().max() > 0


def test_merged_and_adapter_exports_reproduce_the_adapted_model(tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = _base()
    base.save_pretrained(tmp_path / "base")
    peft_model = lora.attach(base, ALL)
    _train(peft_model)
    peft_model.eval()
    x = _batch(7)
    with torch.no_grad():
        want = peft_model(input_ids=x, labels=x).loss
    lora.save_adapter(peft_model, str(tmp_path / "adapter"))
    lora.merged(peft_model).save_pretrained(tmp_path / "merged")

    plain = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    assert not any("lora" in n for n, _ in plain.named_parameters())
    fresh_base = AutoModelForCausalLM.from_pretrained(tmp_path / "base")
    adapted = PeftModel.from_pretrained(fresh_base, tmp_path / "adapter").eval()
    with torch.no_grad():
        got_merged = plain(input_ids=x, labels=x).loss
        got_adapter = adapted(input_ids=x, labels=x).loss
    torch.testing.assert_close(got_adapter, want, rtol=0, atol=0)
    torch.testing.assert_close(got_merged, want, rtol=1e-5, atol=1e-6)


def test_a_lora_export_keeps_the_base_checkpoints_mtp_layers(tmp_path):
    """A DeepSeek-V3 checkpoint laid out with its MTP layer (model.layers.{L}.*): LoRA trains
    the main model (mtp_depth 0) and models/final keeps the MTP layer exactly as it was."""
    from safetensors import safe_open
    from test_mtp import tokenizer_folder

    from dsflow.model import mtp
    from dsflow.model.build import save_hf
    from dsflow.safeload import check_model_folder

    torch.manual_seed(0)
    with_mtp = build_model(_config(), device_type="cpu", mtp_depth=1)
    tokenizer = tokenizer_folder(tmp_path / "tokenizer")
    save_hf(with_mtp, tmp_path / "base", tokenizer)
    base = str(tmp_path / "base")
    peft_model = lora.attach(build_model(_config(), device_type="cpu", pretrained=base), ALL)
    _train(peft_model)
    lora.save_final(peft_model, base, tmp_path / "final", tokenizer, "fp32")

    check_model_folder(tmp_path / "final", "rerun")  # the shard is hashed with the rest
    want = mtp.published_state(with_mtp.state_dict())
    with safe_open(str(tmp_path / "final" / "model-mtp.safetensors"), "pt") as fh:
        assert set(fh.keys()) == set(want)
        assert all(torch.equal(fh.get_tensor(k), want[k]) for k in want)
    config = json.loads((tmp_path / "final" / "config.json").read_text())
    assert config["num_nextn_predict_layers"] == 1
    # The main weights are the merged, trained ones, not the base's.
    merged = build_model(_config(), device_type="cpu", pretrained=str(tmp_path / "final"))
    q = "model.layers.0.self_attn.o_proj.weight"
    assert not torch.equal(merged.state_dict()[q], with_mtp.state_dict()[q])


def _train_with_mtp(peft_model, steps: int, balancer=None) -> list[list[float]]:
    """`steps` AdamW steps of the train stage's loss (main + MTP) on one batch; each step's
    losses before its update, [main, depth 1, ...]."""
    from dsflow.model.loss import TrainingLM

    trainee = TrainingLM(peft_model.get_base_model().train(), ce_chunk=0)
    opt = torch.optim.AdamW([p for p in peft_model.parameters() if p.requires_grad], lr=1e-2)
    x, seen = _batch(5), []
    for _ in range(steps):
        trainee(x[:, :-1], x[:, 1:]).backward()
        opt.step()
        opt.zero_grad()
        if balancer is not None:
            balancer.update()
        seen.append(trainee.last_losses.tolist())
    return seen


def test_lora_trains_the_mtp_modules_as_the_main_layers_and_their_eh_proj():
    """An MTP depth gets the adapters a main MoE layer gets, and one on eh_proj; its norms,
    router and every base weight stay bit-identical; its loss falls; the balancer moves its
    router's bias."""
    model = _base(mtp_depth=1)
    L = model.config.num_hidden_layers
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    peft_model = lora.attach(model, ALL)
    adapted = {
        n.split(".lora_")[0].removeprefix("base_model.model.")
        for n, p in peft_model.named_parameters()
        if p.requires_grad
    }
    last_main = f"model.layers.{L - 1}."
    like_main = {n.replace(last_main, f"mtp.layers.{L}.") for n in adapted if last_main in n}
    assert {n for n in adapted if n.startswith("mtp.")} == like_main | {f"mtp.layers.{L}.eh_proj"}
    balancer = ExpertBalancer(peft_model, gamma=1e-2)
    assert balancer.layers[-1] == L  # the MTP block's router
    losses = _train_with_mtp(peft_model, steps=12, balancer=balancer)
    assert losses[-1][1] < losses[0][1] - 0.5, losses
    after = _base_names(peft_model)
    assert set(after) == set(before)
    for name, tensor in before.items():
        assert torch.equal(after[name], tensor), name
    lora_b = [(n, p) for n, p in peft_model.named_parameters() if "lora_B" in n and ".mtp." in n]
    assert lora_b and all(p.abs().sum() > 0 for _, p in lora_b)
    assert model.mtp.layers[str(L)].mlp.gate.e_score_correction_bias.abs().sum() > 0


def _eval_losses(model, x) -> torch.Tensor:
    """[main, depth 1, ...]: the train stage's losses of `model` (eval mode) on windows `x`."""
    from dsflow.model.loss import TrainingLM

    trainee = TrainingLM(model.eval())
    with torch.no_grad():
        trainee(x[:, :-1], x[:, 1:])
    return trainee.last_losses


def test_a_lora_export_writes_the_trained_mtp_depth_merged_and_keeps_a_deeper_one(tmp_path):
    """A checkpoint with two MTP layers, LoRA with model.mtp_depth 1: models/final holds both
    in the published layout, the first as base + B A (eh_proj checked by hand), the second as
    the base holds it; plain transformers, dsflow's loader and lora.load all load it, and PEFT
    alone puts the adapter's main-model part on plain transformers."""
    from peft import PeftModel
    from safetensors import safe_open
    from test_mtp import tokenizer_folder
    from transformers import AutoModelForCausalLM

    from dsflow.model import mtp
    from dsflow.model.build import save_hf
    from dsflow.model.loss import mean_loss

    with_mtp = _base(mtp_depth=2)
    tokenizer = tokenizer_folder(tmp_path / "tokenizer")
    save_hf(with_mtp, tmp_path / "base", tokenizer)
    base = str(tmp_path / "base")
    net = build_model(_config(), device_type="cpu", pretrained=base, mtp_depth=1)
    peft_model = lora.attach(net, ALL)
    _train_with_mtp(peft_model, steps=3)
    lora.save_final(peft_model, base, tmp_path / "final", tokenizer, "fp32")

    L, x = net.config.num_hidden_layers, _batch(9)
    want = _eval_losses(net, x)
    first = net.mtp.layers[str(L)].eh_proj
    scale = ALL["alpha"] / ALL["rank"]
    by_hand = (
        first.base_layer.weight + scale * first.lora_B.default.weight @ first.lora_A.default.weight
    )
    stored = mtp.published_state(with_mtp.state_dict())
    merged = mtp.published_state(lora.merged(peft_model).state_dict())
    with safe_open(str(tmp_path / "final" / "model-mtp.safetensors"), "pt") as fh:
        got = {k: fh.get_tensor(k) for k in fh.keys()}
    assert set(got) == set(stored)
    assert all(got[k].shape == stored[k].shape for k in stored)
    torch.testing.assert_close(got[f"model.layers.{L}.eh_proj.weight"], by_hand)
    for key, tensor in stored.items():
        if key.startswith(f"model.layers.{L + 1}."):
            assert torch.equal(got[key], tensor), key  # the depth LoRA did not train
        else:
            torch.testing.assert_close(got[key], merged[key], rtol=0, atol=0, msg=key)
    changed = {k for k in stored if not torch.equal(got[k], stored[k])}
    assert f"model.layers.{L}.self_attn.o_proj.weight" in changed
    assert not any("norm" in k or "embed" in k or "head" in k for k in changed), changed
    assert json.loads((tmp_path / "final/config.json").read_text())["num_nextn_predict_layers"] == 2

    plain = AutoModelForCausalLM.from_pretrained(tmp_path / "final").eval()
    torch.testing.assert_close(mean_loss(plain, x[:, :-1], x[:, 1:]), want[0], rtol=1e-5, atol=1e-6)
    reloaded = build_model(
        _config(), device_type="cpu", pretrained=str(tmp_path / "final"), mtp_depth=1
    )
    adapter_dir = tmp_path / "final" / "adapter"
    adapter = lora.load(base, adapter_dir).eval().get_base_model()
    for model in (reloaded, adapter):
        torch.testing.assert_close(_eval_losses(model, x), want, rtol=1e-5, atol=1e-6)
    # PEFT alone, on plain transformers (no MTP modules): the main model's adapters load.
    peft_alone = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), adapter_dir)
    torch.testing.assert_close(
        mean_loss(peft_alone.eval(), x[:, :-1], x[:, 1:]), want[0], rtol=1e-5, atol=1e-6
    )


@pytest.mark.parametrize(
    "change, overrides, needle",
    [
        ({"rank": 0}, {}, "train.lora.rank"),
        ({"targets": ["mlp"]}, {}, "train.lora.targets: ['mlp']"),
        ({"targets": ["dense_mlp"]}, {"first_k_dense_replace": 0}, "'dense_mlp' matches no"),
        ({"dropout": 0.1}, {}, "train.lora.dropout"),
    ],
)
def test_bad_lora_settings_are_one_line(change, overrides, needle):
    with pytest.raises(UsageError) as err:
        lora.attach(_base(**overrides), {**ALL, **change})
    assert needle in str(err.value) and "\n" not in str(err.value)


def test_attention_only_takes_dropout():
    peft_model = lora.attach(_base(), {**ALL, "targets": ["attention"], "dropout": 0.1})
    assert "trainable" in lora.trainable_summary(peft_model)


@pytest.mark.parametrize(
    "targets", [["attention"], ["dense_mlp", "shared_experts"], list(lora.GROUPS)]
)
@pytest.mark.parametrize("q_lora_rank", [None, 48])
@pytest.mark.parametrize(
    "family, mtp_depth, overrides",
    [
        ("deepseek_v3", 0, {}),
        ("deepseek_v2", 0, {}),
        ("deepseek_v3", 2, {}),
        ("deepseek_v3", 2, {"first_k_dense_replace": 5}),  # a dense MTP layer, then an MoE one
    ],
)
def test_planner_counts_equal_the_adapters_peft_creates(
    targets, q_lora_rank, family, mtp_depth, overrides
):
    config = _config(family, q_lora_rank=q_lora_rank, **overrides)
    setting = {**ALL, "targets": targets}
    net = build_model(config, device_type="cpu", mtp_depth=mtp_depth)
    peft_model = lora.attach(net, setting)
    trainable = sum(p.numel() for p in peft_model.parameters() if p.requires_grad)
    assert lora.counts(config, setting, mtp_depth)["adapter"] == trainable


def test_lora_without_a_pretrained_model_is_one_line():
    import yaml

    from dsflow import params as params_mod

    raw = yaml.safe_load((ROOT / "params.yaml").read_text())
    raw["train"]["finetune"], raw["model"]["pretrained"] = "lora", None
    with pytest.raises(UsageError) as err:
        params_mod.validate(raw)
    assert "train.finetune: lora needs model.pretrained" in str(err.value)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("kind, ok", [("AdamW", True), ("Adam", True), ("OneBitAdam", False)])
def test_lora_refuses_an_optimizer_that_compresses_every_gradient(kind, ok):
    from dsflow import dsconfig

    cfg = {"optimizer": {"type": kind, "params": {}}}
    if ok:
        dsconfig.check_lora_optimizer(cfg, "train.ds_config ds.json")
        return
    with pytest.raises(UsageError, match="optimizer OneBitAdam with train.finetune: lora"):
        dsconfig.check_lora_optimizer(cfg, "train.ds_config ds.json")


@pytest.mark.slow
@pytest.mark.parametrize("mtp_depth", [0, 1])
def test_fast_paths_give_the_adapters_the_plain_paths_gradients(mtp_depth):
    """Under LoRA the fast paths (compiled layers with the router hooks traced, padded
    attention, fused cross-entropy, sorted experts through PEFT's parametrized expert weights)
    give the adapters the plain path's loss and gradients (fp32, CPU), an MTP depth's too."""
    import copy

    from dsflow.model import fastpaths
    from dsflow.model.loss import TrainingLM

    torch._dynamo.reset()
    plain = lora.attach(_base(moe_intermediate_size=16, mtp_depth=mtp_depth), ALL).get_base_model()
    for name, p in plain.named_parameters():
        if "lora_B" in name:  # B starts at zero: give the adapters something to pass back
            torch.nn.init.normal_(p, std=0.02)
    fast = copy.deepcopy(plain)
    x = _batch(3)
    inputs, targets = x[:, :-1], x[:, 1:]
    results = []
    for model, perf in (
        (plain, fastpaths.Perf(False, "sdpa", 0, False)),
        (fast, fastpaths.Perf(True, "flash_padded", 16, False, experts="sorted")),
    ):
        balancer = ExpertBalancer(model, gamma=0.0, seq_aux_alpha=0.01)
        fastpaths.apply(model, perf, balancer)
        loss = TrainingLM(model, ce_chunk=perf.ce_chunk)(inputs, targets)
        (loss + balancer.aux_loss()).backward()
        grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
        results.append((loss.detach(), grads))
    (loss_p, grads_p), (loss_f, grads_f) = results
    torch.testing.assert_close(loss_f, loss_p, rtol=1e-5, atol=1e-6)
    assert set(grads_f) == set(grads_p) and any("experts" in n for n in grads_p)
    assert any(n.startswith("mtp.") for n in grads_p) == bool(mtp_depth)
    for name, grad in grads_p.items():
        assert grads_f[name] is not None, name
        torch.testing.assert_close(grads_f[name], grad, rtol=1e-4, atol=1e-6, msg=name)


DEFAULT = {
    "rank": 4,
    "alpha": 8,
    "dropout": 0.0,
    "targets": ["attention", "dense_mlp", "shared_experts"],
}


@pytest.mark.parametrize("family", ["deepseek_v3", "deepseek_v2"])
def test_the_linear_adapters_compute_what_peft_computes(family):
    """The dense MLP's and shared experts' adapters take F.linear on W + B A directly instead of
    PEFT's parametrization: the same loss and gradients, to the bit; with the adapters off, the
    base model's; merged, the adapted model's; and a second adapter can still be added."""

    adapted = lora.attach(_base(family=family, moe_intermediate_size=16), DEFAULT)
    wrapper = lora._direct_wrapper_class()
    direct = [m for m in adapted.modules() if type(m) is wrapper]
    layers = adapted.get_base_model().config.num_hidden_layers
    assert len(direct) == 3 * layers  # the dense MLPs' and shared experts' three projections
    loss_d = _same_as_peft(adapted, direct)
    x = _batch(2)
    base_loss = _base(family=family, moe_intermediate_size=16)(input_ids=x, labels=x).loss
    with torch.no_grad(), adapted.disable_adapter():
        assert torch.equal(adapted(input_ids=x, labels=x).loss, base_loss)
    adapted.add_adapter("second", lora.peft_config(DEFAULT))  # PEFT finds its wrappers by name
    adapted.delete_adapter("second")
    with torch.no_grad():
        merged = adapted.merge_and_unload()(input_ids=x, labels=x).loss
    torch.testing.assert_close(merged, loss_d, rtol=1e-5, atol=1e-6)


def _same_as_peft(adapted, direct) -> torch.Tensor:
    """One forward and backward with dsflow's `direct` adapters, then with PEFT's own forward
    (nonzero B, so the adapters count): the same loss and gradients, to the bit. The loss."""
    from peft.tuners.lora.layer import ParamWrapper

    for name, p in adapted.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.02)
    x = _batch(2)
    results = []
    wrapper = lora._direct_wrapper_class()
    for cls in (wrapper, ParamWrapper):  # dsflow's, then PEFT's own forward
        for m in direct:
            m.__class__ = cls
        adapted.zero_grad()
        loss = adapted(input_ids=x, labels=x).loss
        loss.backward()
        grads = {n: p.grad.clone() for n, p in adapted.named_parameters() if p.requires_grad}
        results.append((loss.detach(), grads))
    for m in direct:
        m.__class__ = wrapper
    (loss_d, grads_d), (loss_p, grads_p) = results
    assert torch.equal(loss_d, loss_p)
    assert grads_p and all(torch.equal(grads_d[n], g) for n, g in grads_p.items())
    return loss_d


@pytest.mark.parametrize("family", ["deepseek_v3", "deepseek_v2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_routed_experts_adapters_compute_what_peft_computes(dtype, family):
    """The routed experts' adapters (one wrapper per fused weight, nested) hand the adapted
    weights to the sorted experts instead of PEFT's parametrization: the same loss and
    gradients, to the bit, with one adapter and with two active; with HF's experts, or the
    adapters off, PEFT's own forward; merged, the adapted model's loss."""
    from dsflow.model import fastpaths

    experts = {**DEFAULT, "targets": ["experts"]}
    adapted = lora.attach(_base(family=family, moe_intermediate_size=16), experts).to(dtype)
    wrapper = lora._direct_wrapper_class()
    direct = [m for m in adapted.modules() if type(m) is wrapper]
    moe_layers = len(adapted.get_base_model().model.layers) - 1
    assert len(direct) == moe_layers  # the outer of each fused experts' two wrappers
    assert all(m.num_experts > 1 and type(m.base_layer).__name__ == "ParamWrapper" for m in direct)
    calls = []  # the direct path's calls (HF's dispatcher calls the registered function)
    sorted_forward = fastpaths.sorted_experts_forward

    def counted(*args, weights=None, **kwargs):
        calls.append(sorted(weights or {}))
        return sorted_forward(*args, weights=weights, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(fastpaths, "sorted_experts_forward", counted)
        with torch.no_grad():
            adapted(input_ids=_batch(3))  # HF's experts: PEFT's parametrization
        assert calls == []
    fastpaths.use_experts(adapted.get_base_model(), "sorted")
    both = ["down_proj", "gate_up_proj"]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(fastpaths, "sorted_experts_forward", counted)
        _same_as_peft(adapted, direct)
        assert calls == [both] * moe_layers  # dsflow's pass direct, PEFT's pass not
        adapted.add_adapter("second", lora.peft_config(experts))
        adapted.base_model.set_adapter(["default", "second"])
        loss = _same_as_peft(adapted, direct)  # W + both deltas, as PEFT sums them
        assert calls == [both] * (2 * moe_layers)
    x = _batch(2)
    with torch.no_grad(), adapted.disable_adapter():
        base = _base(family=family, moe_intermediate_size=16).to(dtype)
        fastpaths.use_experts(base, "sorted")
        assert torch.equal(adapted(input_ids=x, labels=x).loss, base(input_ids=x, labels=x).loss)
    with torch.no_grad():
        merged = adapted.merge_and_unload()(input_ids=x, labels=x).loss
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=2e-2, atol=1e-2)
    torch.testing.assert_close(merged, loss, **tol)


@pytest.mark.parametrize("targets", [DEFAULT["targets"], list(lora.GROUPS)])
def test_compiled_layers_under_lora_have_no_graph_break(monkeypatch, targets):
    """bf16, the default targets and all of them (the routed experts too): every compiled layer
    is one graph (PEFT's parametrization broke each layer's graph at every adapted MLP or experts
    weight and recompiled each layer). Graph breaks are dynamo's: its eager backend shows them
    without inductor's compile time."""
    from torch._dynamo.utils import counters

    from dsflow.model import fastpaths
    from dsflow.model.loss import TrainingLM

    compile_module = torch.nn.Module.compile
    monkeypatch.setattr(
        torch.nn.Module, "compile", lambda self, **kw: compile_module(self, backend="eager")
    )
    torch._dynamo.reset()
    counters.clear()
    config = {**DEFAULT, "targets": targets}
    model = lora.attach(_base(moe_intermediate_size=16), config).get_base_model()
    model = model.to(torch.bfloat16).train()
    balancer = ExpertBalancer(model, gamma=1e-3, seq_aux_alpha=0.0)
    fastpaths.apply(
        model, fastpaths.Perf(True, "flash_padded", 16, False, experts="sorted"), balancer
    )
    x = _batch(4)
    TrainingLM(model, ce_chunk=16)(x[:, :-1], x[:, 1:]).backward()
    assert not counters["graph_break"], dict(counters["graph_break"])
    torch._dynamo.reset()


def _plan(finetune: str):
    import argparse

    import yaml

    from dsflow import params as params_mod
    from dsflow.plan import stage

    params = params_mod.validate(yaml.safe_load((ROOT / "params.yaml").read_text()))
    parser = argparse.ArgumentParser()
    stage.add_arguments(parser)
    argv = "--model deepseek-v2-lite --gpus 3 --gpu-mem 24 --host-mem 128 --disk 500"
    argv += f" --seq-len 1024 --micro-batch 1 --finetune {finetune}"
    return stage.build_plan(params, parser.parse_args(argv.split()))


def test_the_write_ups_case_lora_fits_3x24gb_and_a_full_finetune_needs_offload():
    """DeepSeek-V2-Lite on 3 x 24 GB with 128 GB of host RAM: LoRA fits at ZeRO-3 (all on the
    GPUs); a full fine-tune fits no layout there, and the
    smallest machine for it offloads the optimizer to far more host RAM."""
    lora_plan = _plan("lora")
    rec = lora_plan["recommendation"]
    assert rec["fits"] and rec["zero_stage"] == 3 and not rec["offload_optimizer"]
    assert 12 < rec["gpu_gb"] < 24 and rec["host_gb"] < 128
    assert rec["disk_gb"] < 40  # the checkpoints hold the adapters alone
    assert lora_plan["summary"]["params_trainable"] < 0.01 * lora_plan["summary"]["params_total"]

    full = _plan("full")
    assert not any(s["fits"] for s in full["strategies"] if s.get("preset") is None)
    smallest = full["smallest_machine"]
    assert "offload" in smallest["strategy"] and smallest["host_bytes"] > 250e9


def test_the_lora_profile_is_the_recipe_the_planner_fits(monkeypatch):
    """profiles/lora-rtx4090x3.yaml: valid, LoRA on DeepSeek-V2-Lite, and on 3 x 24 GB GPUs
    (the name says 4090) with 128 GB of host RAM its own layout fits."""
    from dsflow import machine
    from dsflow import params as params_mod
    from dsflow.plan import stage

    profile = ROOT / "profiles/lora-rtx4090x3.yaml"
    params = params_mod.load(ROOT / "params.yaml", overlays=[str(profile)])
    assert params["train"]["finetune"] == "lora" and params["train"]["zero_stage"] == 3
    monkeypatch.setenv("DSFLOW_PROFILES", str(profile))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(machine, "gpus", lambda: [])
    plan = stage.build_plan(params, host_mem_bytes=128 * 10**9, disk_free_bytes=500 * 10**9)
    assert plan["request"]["gpu_mem_bytes"] < 26e9 and plan["request"]["world"] == 3
    assert plan["verdict"]["fits"], plan["verdict"]
    assert plan["estimate"]["gpu"]["total"] < 24e9


@pytest.mark.parametrize(
    "change, overrides, needle",
    [
        ({"targets": ["dense_mlp"]}, {"first_k_dense_replace": 0}, "'dense_mlp' matches no"),
        ({"dropout": 0.1}, {}, "train.lora.dropout"),
    ],
)
def test_the_train_stage_checks_lora_against_the_checkpoint_before_launch(
    tmp_path, change, overrides, needle
):
    """Before any rank loads the base: the checkpoint's shape, built on the meta device."""
    from dsflow.train import stage as train

    _base(**overrides).save_pretrained(tmp_path / "base")
    with pytest.raises(UsageError, match=needle):
        train.check_lora({"pretrained": str(tmp_path / "base")}, {**ALL, **change})
    train.check_lora({"pretrained": str(tmp_path / "base")}, {**ALL, "targets": ["attention"]})
