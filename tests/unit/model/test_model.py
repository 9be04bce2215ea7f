"""Presets, analytic parameter counts and model construction (dsflow.model)."""

import copy

import numpy as np
import pytest
import torch

from conftest import tiny_v2
from dsflow.errors import UsageError
from dsflow.model.build import build_model
from dsflow.model.presets import PRESETS, describe, model_config, param_counts

VOCAB = 1000
FAMILY_CLASSES = {"deepseek_v3": "DeepseekV3ForCausalLM", "deepseek_v2": "DeepseekV2ForCausalLM"}


def _numel(model):
    return sum(p.numel() for p in model.parameters())


def _meta_model(config):
    import transformers

    with torch.device("meta"):
        return getattr(transformers, FAMILY_CLASSES[config.model_type])(copy.deepcopy(config))


def _tiny_v2_config(vocab=VOCAB, **extra):
    return model_config("deepseek-v2-lite", vocab, tiny_v2(**extra))


@pytest.mark.parametrize("preset", list(PRESETS))
def test_every_preset_builds_a_config(preset):
    vocab = PRESETS[preset].get("published_vocab_size", VOCAB)
    config = model_config(preset, vocab)
    assert config.vocab_size == vocab
    assert config.model_type == PRESETS[preset].get("model_type", "deepseek_v3")
    assert isinstance(PRESETS[preset]["description"], str) and PRESETS[preset]["description"]
    assert "vocab_size" not in PRESETS[preset]
    counts = param_counts(config)
    assert counts["total"] > counts["activated"] > counts["activated_non_embedding"] > 0
    assert "layers" in describe(config) and "activated" in describe(config)


def test_tiny_counts_equal_instantiated_model():
    config = model_config("tiny", VOCAB)
    model = build_model(config, device_type="cpu")
    counts = param_counts(config)
    assert counts["total"] == _numel(model)
    assert counts["embedding"] == model.model.embed_tokens.weight.numel()
    assert counts["lm_head"] == model.lm_head.weight.numel()
    assert _numel(model) < 5_000_000


@pytest.mark.parametrize(
    "overrides",
    [
        {"q_lora_rank": 24, "attention_bias": True},
        {"tie_word_embeddings": True},
        {"first_k_dense_replace": 4},  # all dense
        {"n_shared_experts": 2, "num_experts_per_tok": 3, "n_group": 2, "topk_group": 1},
    ],
)
def test_counts_equal_instantiated_variants(overrides):
    config = model_config("tiny", VOCAB, overrides)
    assert param_counts(config)["total"] == _numel(_meta_model(config))


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"q_lora_rank": 24, "attention_bias": True, "mlp_bias": True},
        {"tie_word_embeddings": True, "first_k_dense_replace": 2},
        {"topk_method": "group_limited_greedy", "n_group": 4, "topk_group": 2},
    ],
)
def test_v2_counts_equal_instantiated_variants(overrides):
    config = _tiny_v2_config(**overrides)
    model = _meta_model(config)
    assert type(model).__name__ == "DeepseekV2ForCausalLM"
    assert param_counts(config)["total"] == _numel(model)


@pytest.mark.parametrize("preset", ["small", "medium"])
def test_small_and_medium_counts_on_meta_device(preset):
    config = model_config(preset, 50257)
    assert param_counts(config)["total"] == _numel(_meta_model(config))


@pytest.mark.parametrize("family", ["deepseek_v3", "deepseek_v2"])
def test_activated_counts_by_hand_for_tiny(family):
    """One token: everything except the non-selected routed experts and the input embedding."""
    config = model_config("tiny", VOCAB) if family == "deepseek_v3" else _tiny_v2_config()
    model = build_model(config, device_type="cpu")
    n_moe = config.num_hidden_layers - config.first_k_dense_replace
    per_expert = 3 * config.hidden_size * config.moe_intermediate_size
    unused = n_moe * (config.n_routed_experts - config.num_experts_per_tok) * per_expert
    counts = param_counts(config)
    assert counts["activated"] == _numel(model) - unused - counts["embedding"]
    assert counts["activated_with_embedding"] == _numel(model) - unused
    assert counts["activated_non_embedding"] == counts["activated"] - counts["lm_head"]


@pytest.mark.parametrize(
    "preset,total,activated,tol_activated",
    [
        ("deepseek-v3", 671e9, 37e9, 0.02),
        ("deepseek-v2", 236e9, 21e9, 0.02),
        # 2.45B, which DeepSeek published as "2.4B" (2 significant digits: 2.1% off).
        ("deepseek-v2-lite", 15.7e9, 2.4e9, 0.025),
    ],
)
def test_published_shapes_match_papers(preset, total, activated, tol_activated):
    config = model_config(preset, PRESETS[preset]["published_vocab_size"])
    assert config.model_type == ("deepseek_v3" if preset == "deepseek-v3" else "deepseek_v2")
    counts = param_counts(config)
    assert abs(counts["total"] / total - 1) < 0.02, counts
    assert abs(counts["activated"] / activated - 1) < tol_activated, counts


def test_moonlight_is_the_v3_architecture_at_16b():
    """Moonlight-16B-A3B: DeepSeek-V3's router (sigmoid scores with the correction bias) at
    16B parameters with its 163,840-token vocabulary."""
    config = model_config("moonlight-16b-a3b", PRESETS["moonlight-16b-a3b"]["published_vocab_size"])
    assert config.model_type == "deepseek_v3" and config.routed_scaling_factor == 2.446
    assert abs(param_counts(config)["total"] / 16e9 - 1) < 0.02


def test_unknown_preset_lists_names():
    with pytest.raises(UsageError) as err:
        model_config("huge", VOCAB)
    assert "huge" in str(err.value) and "tiny" in str(err.value) and "deepseek-v3" in str(err.value)


def test_unknown_override_named_with_allowed_keys():
    with pytest.raises(UsageError) as err:
        model_config("tiny", VOCAB, {"hiden_size": 64})
    msg = str(err.value)
    assert "hiden_size" in msg and "hidden_size" in msg
    with pytest.raises(UsageError, match="tokenizer"):
        model_config("tiny", VOCAB, {"vocab_size": 10})
    with pytest.raises(UsageError, match="bogus"):
        model_config("tiny", VOCAB, bogus=1)


def test_overrides_and_runtime_apply_and_do_not_leak():
    config = model_config("tiny", VOCAB, {"num_hidden_layers": 2}, max_position_embeddings=256)
    assert config.num_hidden_layers == 2 and config.max_position_embeddings == 256
    # explicit overrides win over runtime settings
    config = model_config(
        "tiny", VOCAB, {"max_position_embeddings": 1024}, max_position_embeddings=256
    )
    assert config.max_position_embeddings == 1024
    assert model_config("tiny", VOCAB).num_hidden_layers == PRESETS["tiny"]["num_hidden_layers"]


def test_bad_values_are_usage_errors():
    with pytest.raises(UsageError, match="hidden_size"):
        model_config("tiny", VOCAB, {"hidden_size": "wide"})
    with pytest.raises(UsageError, match="vocab_size"):
        model_config("tiny", 0)
    assert model_config("tiny", np.int64(300)).vocab_size == 300


def test_inconsistent_shape_is_a_usage_error():
    with pytest.raises(UsageError, match="n_group"):
        model_config("tiny", VOCAB, {"n_group": 3})
    with pytest.raises(UsageError, match="num_experts_per_tok"):
        model_config("tiny", VOCAB, {"num_experts_per_tok": 9})


def test_build_is_deterministic_and_uses_eager_experts_on_cpu():
    config = model_config("tiny", VOCAB)
    torch.manual_seed(0)
    a = build_model(config, device_type="cpu")
    torch.manual_seed(0)
    b = build_model(config, device_type="cpu")
    for (name, pa), (_, pb) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        assert torch.equal(pa, pb), name
    assert a.config._experts_implementation == "eager"
    assert a.config._attn_implementation == "sdpa"
    assert a.model.layers[1].mlp.gate.e_score_correction_bias.dtype == torch.float32


def test_grouped_mm_on_cuda_matches_eager():
    """device_type="cuda" selects grouped_mm (weights are still built on CPU, where torch
    2.13's grouped_mm also runs): same logits as the eager per-expert loop."""
    config = model_config("tiny", VOCAB)
    torch.manual_seed(0)
    eager = build_model(config, device_type="cpu")
    torch.manual_seed(0)
    grouped = build_model(config, device_type="cuda")
    assert grouped.config._experts_implementation == "grouped_mm"
    ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(eager(ids).logits, grouped(ids).logits, atol=1e-5, rtol=1e-4)


def test_bf16_build_keeps_router_bias_fp32_and_config_untouched():
    config = model_config("tiny", VOCAB)
    before = config.to_dict()
    model = build_model(config, device_type="cpu", dtype=torch.bfloat16)
    assert model.lm_head.weight.dtype == torch.bfloat16
    for name, buf in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            assert buf.dtype == torch.float32, name
    assert config.to_dict() == before


def test_pretrained_round_trip_gives_identical_logits(tmp_path):
    config = model_config("tiny", VOCAB)
    torch.manual_seed(0)
    model = build_model(config, device_type="cpu").eval()
    with torch.no_grad():
        model.model.layers[1].mlp.gate.e_score_correction_bias.copy_(torch.linspace(-0.1, 0.1, 8))
    model.save_pretrained(tmp_path / "ck")
    loaded = build_model(config, device_type="cpu", pretrained=str(tmp_path / "ck")).eval()
    assert loaded.config._experts_implementation == "eager"
    ids = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, loaded(ids).logits)
    bias = loaded.model.layers[1].mlp.gate.e_score_correction_bias
    assert torch.equal(bias, torch.linspace(-0.1, 0.1, 8))


def test_pretrained_bf16_checkpoint_loads_as_fp32_by_default(tmp_path):
    config = model_config("tiny", VOCAB)
    build_model(config, device_type="cpu", dtype=torch.bfloat16).save_pretrained(tmp_path / "ck")
    loaded = build_model(config, device_type="cpu", pretrained=str(tmp_path / "ck"))
    assert loaded.lm_head.weight.dtype == torch.float32
    kept = build_model(config, device_type="cpu", pretrained=str(tmp_path / "ck"), dtype="bf16")
    assert kept.lm_head.weight.dtype == torch.bfloat16
    assert kept.model.layers[1].mlp.gate.e_score_correction_bias.dtype == torch.float32


def test_pretrained_vocab_mismatch_names_both_sizes(tmp_path):
    build_model(model_config("tiny", VOCAB), device_type="cpu").save_pretrained(tmp_path / "ck")
    with pytest.raises(UsageError) as err:
        build_model(model_config("tiny", 1234), device_type="cpu", pretrained=str(tmp_path / "ck"))
    assert "1000" in str(err.value) and "1234" in str(err.value)


def test_pretrained_missing_or_broken_path(tmp_path):
    config = model_config("tiny", VOCAB)
    with pytest.raises(UsageError, match="not a directory"):
        build_model(config, device_type="cpu", pretrained=str(tmp_path / "nope"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(UsageError, match="config.json"):
        build_model(config, device_type="cpu", pretrained=str(tmp_path / "empty"))
    broken = tmp_path / "broken"
    broken.mkdir()
    config.save_pretrained(broken)  # config only, no weights
    with pytest.raises(UsageError, match=r"no \*\.safetensors weights"):
        build_model(config, device_type="cpu", pretrained=str(broken))


def test_tiny_trains_on_cpu():
    config = model_config("tiny", 256)
    torch.manual_seed(0)
    model = build_model(config, device_type="cpu").train()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    ids = torch.randint(0, 256, (4, 16), generator=torch.Generator().manual_seed(0)).repeat(1, 8)
    losses = []
    for _ in range(15):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.5


def test_pretrained_corrupt_weights(tmp_path):
    config = model_config("tiny", VOCAB)
    build_model(config, device_type="cpu").save_pretrained(tmp_path / "ck")
    (tmp_path / "ck" / "model.safetensors").write_bytes(b"garbage" * 10)
    with pytest.raises(UsageError, match="cannot load"):
        build_model(config, device_type="cpu", pretrained=str(tmp_path / "ck"))


def test_pretrained_bad_config_json(tmp_path):
    (tmp_path / "ck").mkdir()
    (tmp_path / "ck" / "config.json").write_text("{not json")
    with pytest.raises(UsageError, match="cannot read config"):
        build_model(model_config("tiny", VOCAB), device_type="cpu", pretrained=str(tmp_path / "ck"))
    (tmp_path / "ck" / "config.json").write_text('{"model_type": "llama"}')
    with pytest.raises(UsageError) as err:
        build_model(model_config("tiny", VOCAB), device_type="cpu", pretrained=str(tmp_path / "ck"))
    msg = str(err.value)
    assert "model.pretrained" in msg and "'llama'" in msg and "\n" not in msg
    assert "'deepseek_v3'" in msg and "'deepseek_v2'" in msg


# --------------------------------------------------------------------------- the DeepSeek-V2 family


def test_v2_presets_build_deepseek_v2_with_its_router():
    """DeepSeek-V2(-Lite)'s published routing: softmax, greedy / group-limited greedy top-k,
    no normalisation, the published scaling and balance loss; HF's V2 class, no bias."""
    lite = model_config("deepseek-v2-lite", 102400)
    v2 = model_config("deepseek-v2", 102400)
    assert type(lite).__name__ == type(v2).__name__ == "DeepseekV2Config"
    assert (lite.topk_method, v2.topk_method) == ("greedy", "group_limited_greedy")
    assert (v2.n_group, v2.topk_group, v2.routed_scaling_factor) == (8, 3, 16.0)
    assert lite.routed_scaling_factor == 1.0 and not lite.norm_topk_prob and not v2.norm_topk_prob
    for c in (lite, v2):
        assert (c.aux_loss_alpha, c.seq_aux) == (0.001, True)
    assert "softmax routing, group-limited greedy top-k" in describe(v2)
    assert "sigmoid routing" in describe(model_config("deepseek-v3", 129280))
    model = build_model(_tiny_v2_config(), device_type="cpu")
    assert type(model).__name__ == "DeepseekV2ForCausalLM"
    assert type(model.model.layers[1].mlp).__name__ == "DeepseekV2Moe"
    assert not [n for n, _ in model.named_buffers() if "e_score_correction_bias" in n]
    assert model.config._experts_implementation == "eager"


def test_v2_overrides_are_checked_against_the_v2_config(tmp_path):
    with pytest.raises(UsageError) as err:  # a DeepseekV3Config field, not a V2 one
        model_config("deepseek-v2-lite", VOCAB, {"num_mtp_layers": 0})
    assert "DeepseekV2Config" in str(err.value) and "topk_method" in str(err.value)
    assert "aux_loss_alpha" in str(err.value)
    with pytest.raises(UsageError, match="topk_method"):
        model_config("tiny", VOCAB, {"topk_method": "greedy"})  # a V2 key on a V3 preset
    cases = [
        ({"norm_topk_prob": True}, "norm_topk_prob"),
        ({"topk_method": "noaux_tc"}, "topk_method 'noaux_tc'"),
        ({"topk_method": "group_limited_greedy", "n_group": 3, "topk_group": 1}, "n_group 3"),
        ({"aux_loss_alpha": -1.0}, "aux_loss_alpha"),
        ({"seq_aux": "yes"}, "seq_aux"),
    ]
    for overrides, match in cases:
        with pytest.raises(UsageError, match=match):
            _tiny_v2_config(**overrides)
    # Greedy top-k ignores the groups; V2 takes a group's best expert, not a top-2.
    _tiny_v2_config(n_group=3)
    _tiny_v2_config(topk_method="group_limited_greedy", n_group=8, topk_group=2)
    assert _tiny_v2_config(aux_loss_alpha=0.01, seq_aux=False).seq_aux is False
    # A checkpoint's config.json HF would route otherwise than it says is refused alike.
    from dsflow.model.build import load_checkpoint_config

    bad = _tiny_v2_config()
    bad.norm_topk_prob, bad.scoring_func = True, "sigmoid"
    bad.save_pretrained(tmp_path / "bad")
    with pytest.raises(UsageError, match=r"^model.pretrained .*scoring_func 'sigmoid'.*norm_topk"):
        load_checkpoint_config(str(tmp_path / "bad"))


def _v2_checkpoint(path, vocab=VOCAB, shard=None):
    torch.manual_seed(0)
    model = build_model(_tiny_v2_config(vocab), device_type="cpu").eval()
    model.save_pretrained(path, **({"max_shard_size": shard} if shard else {}))
    return model


def test_v2_pretrained_round_trip_and_a_smaller_tokenizer(tmp_path):
    """A V2 checkpoint loads as DeepseekV2ForCausalLM with its own config (balance keys kept);
    a tokenizer with fewer tokens than its embeddings fits (DeepSeek pads them), more does not."""
    model = _v2_checkpoint(tmp_path / "ck")
    loaded = build_model(
        model_config("tiny", 900), device_type="cpu", pretrained=str(tmp_path / "ck")
    )
    assert type(loaded).__name__ == "DeepseekV2ForCausalLM"
    assert loaded.config.vocab_size == VOCAB and loaded.config.aux_loss_alpha == 0.001
    ids = torch.randint(0, 900, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, loaded.eval()(ids).logits)
    with pytest.raises(UsageError) as err:
        build_model(model_config("tiny", 1001), device_type="cpu", pretrained=str(tmp_path / "ck"))
    assert "1001" in str(err.value) and "vocab_size 1000" in str(err.value)


def test_partial_weights_are_refused_in_one_line(tmp_path):
    """A shard the index lists, or a tensor, missing (transformers 5 would initialise it at
    random with a warning), or a tensor of another shape: one line naming what is wrong."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    _v2_checkpoint(tmp_path / "ck", shard="200KB")
    weight_map = json.loads((tmp_path / "ck/model.safetensors.index.json").read_text())
    shards = sorted(set(weight_map["weight_map"].values()))
    assert len(shards) > 2
    config = model_config("tiny", VOCAB)

    def broken(name, damage):
        path = tmp_path / name
        shutil.copytree(tmp_path / "ck", path)
        damage(path / shards[1])
        with pytest.raises(UsageError) as err:
            build_model(config, device_type="cpu", pretrained=str(path))
        assert "\n" not in str(err.value)
        return str(err.value)

    def drop_tensor(f):
        tensors = load_file(f)
        tensors.pop(sorted(tensors)[0])
        save_file(tensors, f, metadata={"format": "pt"})

    def shrink_tensor(f):
        tensors = load_file(f)
        key = sorted(tensors)[0]
        tensors[key] = tensors[key][:-1].clone()
        save_file(tensors, f, metadata={"format": "pt"})

    msg = broken("no-shard", lambda f: f.unlink())
    assert f"lacks 1 of the {len(shards)} weight files" in msg and shards[1] in msg
    assert "lacks 1 weight(s)" in broken("no-tensor", drop_tensor)
    assert "do not match its config.json" in broken("shape", shrink_tensor)
    assert "no *.safetensors" in broken(
        "pickles", lambda f: [p.unlink() for p in f.parent.glob("*.safetensors*")]
    )
