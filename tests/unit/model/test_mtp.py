"""DeepSeek-V3's multi-token prediction (model.mtp_depth, dsflow.model.mtp) on tiny CPU models:
the loss against the technical report's equations, its gradients, the expert balancer, MFU,
the published checkpoint layout on export and load, and a 2-rank run that resumes bit-exactly."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import torch.nn.functional as F

from conftest import ROOT, dsflow, losses, rewound_copy, tiny_run, tiny_v2, update_params
from dsflow.errors import UsageError
from dsflow.model import mtp
from dsflow.model.build import build_model, check_mtp, save_hf
from dsflow.model.loss import TrainingLM, mean_loss, mtp_weight_at
from dsflow.model.presets import model_config
from dsflow.params import deep_merge

VOCAB = 96
SEQ = 12


def tiny(depth: int, seed: int = 0, overrides: dict | None = None):
    torch.manual_seed(seed)
    config = model_config("tiny", VOCAB, overrides or {})
    return build_model(config, device_type="cpu", mtp_depth=depth)


# The MTP blocks dense: their index (num_hidden_layers + k - 1) below first_k_dense_replace.
DENSE_MTP = {"first_k_dense_replace": 8}


def windows(seed: int = 1, batch: int = 3) -> torch.Tensor:
    torch.manual_seed(seed)
    return torch.randint(0, VOCAB, (batch, SEQ + 1))


def rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def reference_loss(hf, w: torch.Tensor, lam: float) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The report's eqs. 21-25 written out: for depth k, position i (0-based, window w of
    SEQ + 1 tokens) h'_i = M_k [RMSNorm(Emb(t_{i+k})); RMSNorm(h^{k-1}_i)] (embedding first,
    as the published weights are used), h^k_i = TRM_k(h'_i), logits = head(RMSNorm(h^k_i))
    predicting t_{i+k+1}; loss = L_main + lam / D * sum_k L_k."""
    eps, emb = hf.config.rms_norm_eps, hf.model.embed_tokens.weight
    head = hf.lm_head.weight
    h = hf.model(input_ids=w[:, :-1]).last_hidden_state  # h^0, after the main model's norm
    main = F.cross_entropy((h @ head.t()).flatten(0, 1), w[:, 1:].flatten())
    depths = []
    for k, layer in enumerate(hf.mtp.layers.values(), start=1):
        n = SEQ - k  # positions i with t_{i+k+1} inside the window
        e = emb[w[:, k : k + n]]
        joined = torch.cat(
            [rms(e, layer.enorm.weight, eps), rms(h[:, :n], layer.hnorm.weight, eps)], -1
        )
        x = joined @ layer.eh_proj.weight.t()
        rope = hf.model.rotary_emb(x, torch.arange(n)[None])
        a = rms(x, layer.input_layernorm.weight, eps)
        x = x + layer.self_attn(hidden_states=a, attention_mask=None, position_embeddings=rope)[0]
        h = x + layer.mlp(rms(x, layer.post_attention_layernorm.weight, eps))
        logits = rms(h, layer.shared_head.norm.weight, eps) @ head.t()
        depths.append(F.cross_entropy(logits.flatten(0, 1), w[:, k + 1 : k + 1 + n].flatten()))
    return main + lam / len(depths) * sum(depths), depths


@pytest.mark.parametrize("block", [{}, DENSE_MTP], ids=["moe", "dense"])
@pytest.mark.parametrize("ce_chunk", [0, 7])
def test_the_loss_and_its_gradients_are_the_reports_equations(ce_chunk, block):
    # A dense block runs on the whole window with its tail ignored, an MoE block on the
    # positions it predicts for: both are the equations, gradients included.
    hf = tiny(2, overrides=block)
    assert all(layer.full_length == bool(block) for layer in hf.mtp.layers.values())
    w = windows()
    trainee = TrainingLM(hf, ce_chunk=ce_chunk, mtp_weight=0.3)
    got = trainee(w[:, :-1], w[:, 1:])
    got.backward()
    grads = {name: p.grad.clone() for name, p in hf.named_parameters()}
    hf.zero_grad()
    want, depths = reference_loss(hf, w, 0.3)
    want.backward()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(trainee.last_losses[1:], torch.stack(depths).detach())
    for name, p in hf.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-4, atol=1e-6)
    # The main loss is the one validation measures.
    torch.testing.assert_close(trainee.last_losses[0], mean_loss(hf, w[:, :-1], w[:, 1:]))


def test_the_two_phase_weight_switches_at_its_fraction_of_the_run():
    hf = tiny(1)
    w = windows()
    phases = {"first": 0.3, "then": 0.1, "switch_fraction": 0.5}
    trainee = TrainingLM(hf, mtp_weight=phases, steps=10)
    seen = {}
    for step in (1, 5, 6, 10):
        trainee.step_begins(step)
        seen[step] = trainee.mtp_weight
        got = trainee(w[:, :-1], w[:, 1:])
        main, depth = trainee.last_losses
        torch.testing.assert_close(got.detach(), main + seen[step] * depth)
    assert seen == {1: 0.3, 5: 0.3, 6: 0.1, 10: 0.1}
    assert mtp_weight_at(0.2, 7, 10) == 0.2


def test_gradients_reach_the_shared_embedding_and_head_and_every_mtp_weight():
    hf = tiny(1)
    w = windows()
    TrainingLM(hf, ce_chunk=5)(w[:, :-1], w[:, 1:]).backward()
    for name, p in hf.mtp.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name
    with_mtp = (hf.model.embed_tokens.weight.grad.clone(), hf.lm_head.weight.grad.clone())
    hf.zero_grad()
    # The same weights without the MTP losses: both shared weights get other gradients.
    plain = TrainingLM(hf, ce_chunk=5)
    plain.mtp = None
    plain(w[:, :-1], w[:, 1:]).backward()
    assert not torch.allclose(with_mtp[0], hf.model.embed_tokens.weight.grad)
    assert not torch.allclose(with_mtp[1], hf.lm_head.weight.grad)


def test_training_lowers_the_mtp_loss():
    hf = tiny(1)
    w = windows(batch=4)
    trainee = TrainingLM(hf, ce_chunk=0)
    opt = torch.optim.AdamW(trainee.parameters(), lr=3e-3)
    first = None
    for _ in range(12):
        opt.zero_grad()
        trainee(w[:, :-1], w[:, 1:]).backward()
        opt.step()
        first = float(trainee.last_losses[1]) if first is None else first
    assert float(trainee.last_losses[1]) < first - 0.5


def test_the_balancer_moves_the_mtp_routers_bias():
    from dsflow.model.balance import ExpertBalancer

    hf = tiny(1)
    balancer = ExpertBalancer(hf, gamma=0.01)
    layers = hf.config.num_hidden_layers
    assert balancer.layers[-1] == layers  # the MTP block's router, by its published index
    bias = hf.mtp.layers[str(layers)].mlp.gate.e_score_correction_bias
    w = windows()
    TrainingLM(hf)(w[:, :-1], w[:, 1:]).backward()
    balancer.update()
    assert bias.abs().sum() > 0 and bias.dtype == torch.float32


def test_mfu_counts_the_mtp_depths():
    from dsflow.model.flops import flops_per_token
    from dsflow.model.presets import activated_matmul_params

    c = model_config("tiny", VOCAB, {})
    H, T = c.hidden_size, 32
    attn = 6 * c.num_attention_heads * (c.qk_nope_head_dim + c.qk_rope_head_dim + c.v_head_dim)
    # One depth: eh_proj, one more MoE layer (what a fifth layer adds) and the head.
    deeper = model_config("tiny", VOCAB, {"num_hidden_layers": 5})
    moe_layer = activated_matmul_params(deeper) - activated_matmul_params(c)
    depth = 2 * H * H + moe_layer + VOCAB * H
    want = flops_per_token(c, T) + ((T - 1) * (6 * depth + attn * (T - 1))) // T
    assert flops_per_token(c, T, mtp_depth=1) == want
    assert flops_per_token(c, T, mtp_depth=0) == flops_per_token(c, T)


# ------------------------------------------------------------------ evaluation


def drafting(depth: int, noise: float):
    """A tiny model whose layers add nothing, so the main head picks f(current token), and
    whose MTP depths pass the next token's embedding through (eh_proj = [I, noise]): they
    draft what the main model will pick, the more often the less `noise`."""
    hf = tiny(depth).eval()
    H = hf.config.hidden_size
    with torch.no_grad():
        for layer in [*hf.model.layers, *hf.mtp.layers.values()]:
            layer.self_attn.o_proj.weight.zero_()
            for p in layer.mlp.parameters():
                p.zero_()  # the routed experts' banks and the shared experts: no output
        for layer in hf.mtp.layers.values():
            layer.eh_proj.weight.copy_(torch.cat([torch.eye(H), noise * torch.randn(H, H)], 1))
    return hf


def decode_step_by_step(hf, prompt: torch.Tensor, new_tokens: int) -> tuple[float, list]:
    """Greedy self-speculative decoding written out, one step at a time: the main model picks
    the next token; each depth drafts one more from the sequence extended by the tokens before
    it; the main model, run on the extended sequence, accepts drafts while it agrees."""
    seq, steps = prompt.tolist(), 0
    tried, taken = [0] * len(hf.mtp.layers), [0] * len(hf.mtp.layers)
    end = len(seq) + new_tokens
    with torch.no_grad():
        while len(seq) < end:
            i = len(seq) - 1
            ids = torch.tensor([seq])
            x = seq + [int(hf(input_ids=ids).logits[0, -1].argmax())]
            for k in range(1, len(hf.mtp.layers) + 1):
                if len(x) >= end:
                    break
                ids = torch.tensor([x])
                hidden = hf.model(input_ids=ids).last_hidden_state
                h = hf.mtp.hidden_states(hf, ids, hidden)[k - 1][:, i]
                layer = list(hf.mtp.layers.values())[k - 1]
                x.append(int(hf.lm_head(layer.shared_head.norm(h)).argmax()))
            picks = hf(input_ids=torch.tensor([x])).logits[0].argmax(-1)
            emitted = i + 2  # the main model's token
            for k in range(1, len(x) - i - 1):
                tried[k - 1] += 1
                if int(picks[i + k]) != x[i + k + 1]:
                    break
                taken[k - 1] += 1
                emitted += 1
            seq, steps = x[:emitted], steps + 1
    return new_tokens / steps, [a / t if t else None for a, t in zip(taken, tried, strict=True)]


@pytest.mark.parametrize("depth,noise", [(1, 0.0), (2, 0.05), (3, 0.05)])
def test_speculative_decoding_counts_what_a_step_by_step_decoder_accepts(depth, noise):
    from dsflow.model import mtp

    hf = drafting(depth, noise)
    torch.manual_seed(5)
    prompt = torch.randint(0, VOCAB, (1, 6))
    got = mtp.speculative(hf, prompt, 20)
    want, acceptance = decode_step_by_step(hf, prompt[0], 20)
    assert got["tokens_per_step"] == pytest.approx(want)
    assert got["acceptance"] == pytest.approx(acceptance)
    if noise == 0:
        assert got["acceptance"] == [1.0] and want == pytest.approx(20 / 10)
    else:  # some drafts taken at every depth, not all
        assert all(0 < rate < 1 for rate in got["acceptance"]), got
    assert 0 < got["speedup"] < got["tokens_per_step"]


def test_the_walk_takes_each_steps_accepted_drafts_and_stops_at_the_end():
    from dsflow.model.mtp import speculative_walk

    # positions 0..9; the prompt ends at 2: steps at 2 (+2 drafts), 5 (0), 6 (+1), 8 (the
    # last token: its drafts would fall outside).
    accepted = torch.tensor([[0, 0, 2, 0, 0, 0, 1, 0, 2, 0]])
    walk = speculative_walk(accepted, start=2, depth=2)
    assert walk["tokens_per_step"] == 7 / 4
    # depth 1 drafted at 2, 5, 6 (accepted at 2, 6); depth 2 at 2 (accepted) and 6 (not).
    assert walk["acceptance"] == [2 / 3, 1 / 2]


@pytest.mark.parametrize("overrides", [{}, {"q_lora_rank": 24}, {"first_k_dense_replace": 6}])
def test_param_counts_count_the_mtp_modules_exactly(overrides):
    """presets.param_counts(config, depth)'s total, which metrics/train.json and the planner
    report, is the model's with its MTP modules (dense ones past first_k_dense_replace too)."""
    from dsflow.model.presets import param_counts

    config = model_config("tiny", VOCAB, overrides)
    for depth in (1, 2):
        hf = build_model(config, device_type="cpu", mtp_depth=depth)
        counts = param_counts(config, depth)
        assert counts["mtp"] == sum(p.numel() for p in hf.mtp.parameters())
        assert counts["total"] == sum(p.numel() for p in hf.parameters())
        assert counts["activated"] == param_counts(config)["activated"]


def tokenizer_folder(path):
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(VOCAB)}
    fast = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, "t0")))
    fast.save_pretrained(path)
    return path


def test_export_writes_the_published_layout_and_reloads_exactly(tmp_path, capsys):
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    hf = tiny(2)
    out = tmp_path / "export"
    save_hf(hf, out, tokenizer_folder(tmp_path / "tok"))
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    H, E, mi, L = 128, 8, 64, hf.config.num_hidden_layers
    shapes = {}
    for key, name in index.items():
        with safe_open(out / name, "pt") as fh:
            shapes[key] = tuple(fh.get_slice(key).get_shape())
    for n in (L, L + 1):
        assert shapes[f"model.layers.{n}.eh_proj.weight"] == (H, 2 * H)
        assert shapes[f"model.layers.{n}.enorm.weight"] == shapes[f"model.layers.{n}.hnorm.weight"]
        assert shapes[f"model.layers.{n}.shared_head.norm.weight"] == (H,)
        assert shapes[f"model.layers.{n}.shared_head.head.weight"] == (VOCAB, H)
        assert shapes[f"model.layers.{n}.embed_tokens.weight"] == (VOCAB, H)
        assert shapes[f"model.layers.{n}.mlp.experts.{E - 1}.gate_proj.weight"] == (mi, H)
        assert shapes[f"model.layers.{n}.mlp.gate.e_score_correction_bias"] == (E,)
    assert not any(k.startswith("mtp.") for k in index)
    assert json.loads((out / "config.json").read_text())["num_nextn_predict_layers"] == 2

    plain = AutoModelForCausalLM.from_pretrained(out)  # the MTP layers left out, as V3's own
    w = windows()
    torch.testing.assert_close(
        mean_loss(plain, w[:, :-1], w[:, 1:]), mean_loss(hf.eval(), w[:, :-1], w[:, 1:])
    )
    config = model_config("tiny", VOCAB, {})
    again = build_model(config, device_type="cpu", pretrained=str(out), mtp_depth=2)
    before, after = hf.mtp.state_dict(), again.mtp.state_dict()
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)

    fewer = build_model(config, device_type="cpu", pretrained=str(out), mtp_depth=1)
    assert torch.equal(
        fewer.mtp.layers[str(L)].eh_proj.weight, hf.mtp.layers[str(L)].eh_proj.weight
    )
    with pytest.raises(UsageError) as err:
        build_model(config, device_type="cpu", pretrained=str(out), mtp_depth=3)
    assert "model.mtp_depth 3" in str(err.value) and "holds 2" in str(err.value)
    assert "\n" not in str(err.value)
    with pytest.raises(UsageError, match="model.mtp_depth 3"):
        check_mtp({"mtp_depth": 3, "pretrained": str(out)}, config)
    capsys.readouterr()
    none = build_model(config, device_type="cpu", pretrained=str(out))
    assert getattr(none, "mtp", None) is None and none.config.num_mtp_layers == 0
    assert "holds 2 MTP layer(s), not trained with model.mtp_depth 0" in capsys.readouterr().err


def test_a_block_fp8_checkpoints_mtp_layer_loads_dequantized(tmp_path):
    """DeepSeek publishes V3 with float8 weights and 128 x 128 fp32 block scales, its MTP layer
    included: the MTP weights load as the fp8 values times their blocks' scales."""
    from safetensors.torch import load_file, save_file

    hf = tiny(1)
    out = tmp_path / "fp8"
    save_hf(hf, out, tokenizer_folder(tmp_path / "tok"))
    tensors = load_file(out / "model-mtp.safetensors")
    quantized = ("model.layers.4.eh_proj.weight", "model.layers.4.mlp.experts.3.up_proj.weight")
    for key in quantized:
        weight = tensors[key]
        scale = weight.abs().amax().reshape(1, 1) / 448  # one block: both dims <= 128 ...
        if weight.shape[1] > 128:  # ... or two side by side (eh_proj is 128 x 256)
            scale = torch.stack([weight[:, :128].abs().amax(), weight[:, 128:].abs().amax()])
            scale = scale.reshape(1, 2) / 448
        wide = scale.repeat_interleave(128, dim=1)[:, : weight.shape[1]]
        tensors[key] = (weight / wide).to(torch.float8_e4m3fn)
        tensors[key + "_scale_inv"] = scale
    save_file(tensors, out / "model-mtp.safetensors", metadata={"format": "pt"})
    index = json.loads((out / "model.safetensors.index.json").read_text())
    index["weight_map"].update({k + "_scale_inv": "model-mtp.safetensors" for k in quantized})
    (out / "model.safetensors.index.json").write_text(json.dumps(index))
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [128, 128],
    }
    (out / "config.json").write_text(json.dumps(config))

    loaded = build_model(
        model_config("tiny", VOCAB, {}), device_type="cpu", pretrained=str(out), mtp_depth=1
    )
    layer = loaded.mtp.layers["4"]
    for key, got in zip(
        quantized, (layer.eh_proj.weight, layer.mlp.experts.gate_up_proj[3][64:]), strict=True
    ):
        scale = tensors[key + "_scale_inv"].repeat_interleave(128, dim=1)[:, : got.shape[1]]
        want = tensors[key].float() * scale
        assert torch.equal(got.detach(), want)
    # Unquantized weights come as they were.
    assert torch.equal(layer.hnorm.weight, hf.mtp.layers["4"].hnorm.weight)


def test_the_v2_family_has_no_mtp():
    config = model_config("deepseek-v2-lite", VOCAB, tiny_v2())
    with pytest.raises(UsageError) as err:
        build_model(config, device_type="cpu", mtp_depth=1)
    line = str(err.value)
    assert line.startswith("model.mtp_depth 1") and "deepseek_v2" in line and "\n" not in line
    with pytest.raises(UsageError, match="model.mtp_depth"):
        check_mtp({"mtp_depth": 1, "pretrained": None}, config)
    check_mtp({"mtp_depth": 0, "pretrained": None}, config)


def test_a_bad_depth_names_the_key():
    from dsflow import params as params_mod

    with pytest.raises(UsageError, match="model.mtp_depth"):
        params_mod.validate({"model": {"mtp_depth": -1}})
    with pytest.raises(UsageError, match="train.mtp.weight"):
        params_mod.validate({"train": {"mtp": {"weight": "high"}}})
    with pytest.raises(UsageError, match="train.mtp.weight"):
        params_mod.validate({"train": {"mtp": {"weight": {"first": 0.3, "switch_fraction": 1}}}})
    phases = {"first": 0.3, "then": 0.1, "switch_fraction": 0.676}
    raw = params_mod.read_yaml(ROOT / "params.yaml")
    overlay = {"train": {"mtp": {"weight": phases}}}
    filled = params_mod.validate(params_mod.deep_merge(raw, overlay))
    assert filled["train"]["mtp"] == {"weight": phases} and filled["model"]["mtp_depth"] == 0


RUN = deep_merge(
    tiny_run(2, 6, eval_every=3, checkpoint_every=3, optimizer={"lr": 0.003},
             schedule={"warmup_steps": 1}),
    {"model": {"mtp_depth": 1}},
)  # fmt: skip


@pytest.mark.slow
def test_a_two_rank_run_logs_each_depth_resumes_bit_exactly_and_exports(prepared, tmp_path):
    from transformers import AutoModelForCausalLM

    from dsflow.data.shards import ShardReader
    from dsflow.model.loss import evaluate_loss

    full = tmp_path / "full"
    shutil.copytree(
        prepared, full, ignore=shutil.ignore_patterns("checkpoints", "models", "dvclive", "metrics")
    )
    update_params(full, RUN)
    dsflow("train", cwd=full, timeout=900)
    metrics = json.loads((full / "metrics/train.json").read_text())
    depth1 = losses(full, "train/mtp_loss_1")
    assert sorted(depth1) == list(range(1, 7)) and metrics["mtp_loss_1"] == depth1[6]
    assert all(v > 0 for v in depth1.values())

    resumed = rewound_copy(full, tmp_path / "resumed", 3)
    proc = dsflow("train", cwd=resumed, timeout=900)
    assert "resumed from step 3" in proc.stderr
    assert losses(resumed, "train/loss") == losses(full, "train/loss")
    assert losses(resumed, "train/mtp_loss_1") == depth1
    assert (
        json.loads((resumed / "metrics/train.json").read_text())["val_loss"]
        == (metrics["val_loss"])
    )

    final = full / "models/final"
    index = json.loads((final / "model.safetensors.index.json").read_text())["weight_map"]
    assert "model.layers.4.eh_proj.weight" in index
    plain = AutoModelForCausalLM.from_pretrained(final)
    assert plain.config.num_nextn_predict_layers == 1
    reader = ShardReader(full / "data/shards/val", 32, seed=1234)
    total, count = evaluate_loss(plain, reader, micro=2, device=torch.device("cpu"), max_windows=4)
    assert total / count == pytest.approx(metrics["val_loss"], rel=1e-5)

    # `dsflow export` of the last checkpoint, and a run continuing from it, keep the MTP weights.
    dsflow("export", "--out", "models/export", cwd=full)
    config = model_config("tiny", plain.config.vocab_size, {})
    trained = build_model(config, device_type="cpu", pretrained=str(final), mtp_depth=1)
    again = build_model(
        config, device_type="cpu", pretrained=str(full / "models/export"), mtp_depth=1
    )
    want, got = trained.mtp.state_dict(), again.mtp.state_dict()
    assert all(torch.equal(want[k], got[k]) for k in want)
    assert metrics["params_total"] == sum(p.numel() for p in trained.parameters())

    # The evaluate stage (2 ranks) scores each head's top-1 and decodes speculatively.
    update_params(full, {"evaluate": {"max_windows": 6, "speculative_prompts": 2, "ranks": 2}})
    dsflow("evaluate", cwd=full, timeout=600)
    ev = json.loads((full / "metrics/eval.json").read_text())
    w = torch.stack([torch.as_tensor(reader.tokens(i * 32, 33).astype("int64")) for i in range(6)])
    with torch.no_grad():
        hidden = trained.eval().model(input_ids=w[:, :-1]).last_hidden_state
    [draft] = mtp.drafts(trained, w[:, :-1], hidden)
    assert ev["mtp_top1_accuracy_1"] == pytest.approx((draft == w[:, 2:]).float().mean().item())
    main = trained.lm_head(hidden).argmax(-1)
    assert ev["top1_accuracy"] == pytest.approx((main == w[:, 1:]).float().mean().item())
    assert 1 <= ev["speculative_tokens_per_step"] <= 2
    assert 0 <= ev["speculative_acceptance_1"] <= 1 and ev["speculative_speedup"] > 0

    v2 = tmp_path / "v2"
    shutil.copytree(prepared, v2, ignore=shutil.ignore_patterns("checkpoints", "models"))
    update_params(v2, RUN)
    update_params(v2, {"model": {"preset": "deepseek-v2-lite", "overrides": tiny_v2()}})
    proc = dsflow("train", cwd=v2, check=False, timeout=300)
    assert proc.returncode == 2 and "model.mtp_depth 1" in proc.stderr


@pytest.mark.slow
def test_zero3_trains_the_mtp_modules_and_gathers_them_for_models_final(prepared, tmp_path):
    repo = tmp_path / "z3"
    shutil.copytree(
        prepared, repo, ignore=shutil.ignore_patterns("checkpoints", "models", "dvclive", "metrics")
    )
    update_params(repo, RUN)
    update_params(repo, {"train": {"zero_stage": 3, "max_steps": 4, "checkpoint_every": 4}})
    dsflow("train", cwd=repo, timeout=900)
    depth1 = losses(repo, "train/mtp_loss_1")
    assert sorted(depth1) == [1, 2, 3, 4] and depth1[4] < depth1[1]
    final = repo / "models/final"
    index = json.loads((final / "model.safetensors.index.json").read_text())["weight_map"]
    config = model_config("tiny", VOCAB, {})
    config.vocab_size = json.loads((final / "config.json").read_text())["vocab_size"]
    trained = build_model(config, device_type="cpu", pretrained=str(final), mtp_depth=1)
    assert "model.layers.4.mlp.experts.0.gate_proj.weight" in index
    assert trained.mtp.layers["4"].eh_proj.weight.abs().sum() > 0


LORA = {"finetune": "lora", "lora": {"rank": 4, "alpha": 8, "targets": ["attention", "experts"]}}


def mtp_checkpoint(prepared, folder):
    """A tiny V3 checkpoint with one MTP layer (model.layers.4.*) for the prepared tokenizer;
    the model saved."""
    from transformers import AutoTokenizer

    tokenizer = prepared / "data/tokenizer"
    vocab = len(AutoTokenizer.from_pretrained(tokenizer))
    torch.manual_seed(0)
    hf = build_model(model_config("tiny", vocab, {}), device_type="cpu", mtp_depth=1)
    save_hf(hf, folder, tokenizer)
    return hf


def lora_repo(prepared, repo, base, **train):
    shutil.copytree(
        prepared, repo, ignore=shutil.ignore_patterns("checkpoints", "models", "dvclive", "metrics")
    )
    update_params(repo, RUN)
    update_params(repo, {"model": {"pretrained": str(base)}, "train": {**LORA, **train}})
    return repo


def by_hand(base_state, adapter, name):
    """Published MTP weight `name` (model.layers.4.*) as base + alpha / rank * B A, from the
    adapter folder's tensors."""
    from safetensors.torch import load_file

    tensors = load_file(adapter / "adapter_model.safetensors")
    module = "base_model.model." + name.replace("model.", "mtp.", 1).removesuffix(".weight")
    scale = LORA["lora"]["alpha"] / LORA["lora"]["rank"]
    delta = tensors[f"{module}.lora_B.weight"] @ tensors[f"{module}.lora_A.weight"]
    return base_state[name] + scale * delta


def assert_trained_depth(base_state, folder, adapter):
    """The MTP shard of `folder`: the base's keys and shapes; the adapted linears are base +
    B A (two checked by hand), the routed experts moved; norms, router weight, embedding and
    head copies as the base's; the router's bias moved by the balancer."""
    from safetensors.torch import load_file

    got = load_file(folder / "model-mtp.safetensors")
    assert set(got) == set(base_state)
    assert all(got[k].shape == base_state[k].shape for k in got)
    for name in ("model.layers.4.eh_proj.weight", "model.layers.4.self_attn.o_proj.weight"):
        want = by_hand(base_state, adapter, name)
        torch.testing.assert_close(got[name], want, rtol=1e-5, atol=1e-6, msg=name)
    changed = {k for k in got if not torch.equal(got[k], base_state[k])}
    assert {
        "model.layers.4.eh_proj.weight",
        "model.layers.4.mlp.experts.0.down_proj.weight",
    } < changed
    assert "model.layers.4.mlp.gate.e_score_correction_bias" in changed
    frozen = ("norm.", "embed_tokens", "shared_head.head", "mlp.gate.weight", "shared_experts")
    assert not [k for k in changed if any(f in k for f in frozen)]


@pytest.mark.slow
def test_lora_trains_the_mtp_depth_resumes_bit_exactly_and_exports_it(prepared, tmp_path):
    """LoRA on a checkpoint with an MTP layer, model.mtp_depth 1, on 2 ranks: the depth's loss
    is logged each step; a run rewound to step 3 resumes to the same losses; models/final and
    `dsflow export` hold the depth merged (base + B A) in the published layout; plain
    transformers loads models/final."""
    from transformers import AutoModelForCausalLM

    hf = mtp_checkpoint(prepared, tmp_path / "base")
    base_state = mtp.published_state(hf.state_dict())
    repo = lora_repo(prepared, tmp_path / "lora", tmp_path / "base")
    proc = dsflow("train", cwd=repo, timeout=900)
    assert "LoRA:" in proc.stderr
    depth1 = losses(repo, "train/mtp_loss_1")
    assert sorted(depth1) == list(range(1, 7))

    resumed = rewound_copy(repo, tmp_path / "resumed", 3)
    proc = dsflow("train", cwd=resumed, timeout=900)
    assert "resumed from step 3" in proc.stderr
    assert losses(resumed, "train/loss") == losses(repo, "train/loss")
    assert losses(resumed, "train/mtp_loss_1") == depth1

    final = repo / "models/final"
    assert_trained_depth(base_state, final, final / "adapter")
    plain = AutoModelForCausalLM.from_pretrained(final)
    assert plain.config.num_nextn_predict_layers == 1
    dsflow("export", "--out", "models/export", cwd=repo)  # from the step-6 checkpoint
    assert_trained_depth(base_state, repo / "models/export", repo / "models/export/adapter")


@pytest.mark.slow
def test_lora_at_zero3_trains_the_mtp_depth(prepared, tmp_path):
    hf = mtp_checkpoint(prepared, tmp_path / "base")
    overlay = {"zero_stage": 3, "max_steps": 4, "checkpoint_every": 4, "eval_every": 4}
    repo = lora_repo(prepared, tmp_path / "z3", tmp_path / "base", **overlay)
    dsflow("train", cwd=repo, timeout=900)
    assert sorted(losses(repo, "train/mtp_loss_1")) == [1, 2, 3, 4]
    final = repo / "models/final"
    assert_trained_depth(mtp.published_state(hf.state_dict()), final, final / "adapter")
