"""Training FLOPs per token, GPU peak table and MFU (dsflow.model.flops)."""

import pytest
import torch

from conftest import tiny_v2
from dsflow.model.flops import (
    GPU_PEAK_TFLOPS,
    flops_per_token,
    gpu_key,
    mfu,
    mfu_peak,
    peak_flops,
)
from dsflow.model.presets import PRESETS, activated_matmul_params, model_config, param_counts

V = 1000


def _dense_tiny(**extra):
    return model_config("tiny", V, {"first_k_dense_replace": 4, **extra})


def test_dense_config_by_hand():
    c = _dense_tiny()
    H, L, heads, T = 128, 4, 4, 128
    qk, v, kv_lora, rope, inter = 32 + 16, 32, 32, 16, 384
    attn_w = H * heads * qk + H * (kv_lora + rope) + kv_lora * heads * (32 + v) + heads * v * H
    mlp_w = 3 * H * inter
    matmul = L * (attn_w + mlp_w) + V * H  # + lm_head; embedding lookup and norms excluded
    expected = 6 * matmul + 6 * L * heads * (qk + v) * T
    assert flops_per_token(c, T) == expected


def test_dense_config_with_q_lora_by_hand():
    c = _dense_tiny(q_lora_rank=24)
    H, L, heads = 128, 4, 4
    q = H * 24 + 24 * heads * 48
    attn_w = q + H * (32 + 16) + 32 * heads * (32 + 32) + heads * 32 * H
    matmul = L * (attn_w + 3 * H * 384) + V * H
    assert flops_per_token(c, 64) == 6 * matmul + 6 * L * heads * (48 + 32) * 64


def test_moe_counts_only_topk_experts():
    base = model_config("tiny", V)
    H, mi = base.hidden_size, base.moe_intermediate_size
    n_moe = base.num_hidden_layers - base.first_k_dense_replace
    # Doubling the routed experts adds only router weights (E x H per MoE layer), no expert FLOPs.
    more = model_config("tiny", V, {"n_routed_experts": 16})
    assert flops_per_token(more, 128) - flops_per_token(base, 128) == 6 * n_moe * 8 * H
    # One more expert per token adds exactly one expert's matmuls per MoE layer.
    k3 = model_config("tiny", V, {"num_experts_per_tok": 3})
    assert flops_per_token(k3, 128) - flops_per_token(base, 128) == 6 * n_moe * 3 * H * mi
    # Shared experts always count.
    s2 = model_config("tiny", V, {"n_shared_experts": 2})
    assert flops_per_token(s2, 128) - flops_per_token(base, 128) == 6 * n_moe * 3 * H * mi


def test_attention_term_is_linear_in_seq_len_without_causal_discount():
    c = model_config("tiny", V)
    per_token = 6 * c.num_hidden_layers * c.num_attention_heads * (48 + 32)
    assert flops_per_token(c, 256) - flops_per_token(c, 128) == per_token * 128


def test_tied_lm_head_still_counts_as_matmul():
    assert flops_per_token(model_config("tiny", V, {"tie_word_embeddings": True}), 128) == (
        flops_per_token(model_config("tiny", V), 128)
    )


def test_deepseek_v3_order_of_magnitude():
    c = model_config("deepseek-v3", PRESETS["deepseek-v3"]["published_vocab_size"])
    f = flops_per_token(c, 4096)
    assert 6 * 36e9 < f < 6 * 37e9 + 6 * 61 * 128 * 320 * 4096 * 1.01


def test_deepseek_v2_lite_by_hand():
    """The published V2-Lite shape, written out: MLA without q_lora, 1 dense + 26 MoE layers
    (2 shared + 6 of 64 routed experts), the softmax router's E x H matmul, the lm_head."""
    c = model_config("deepseek-v2-lite", 102400)
    H, T = 2048, 4096
    attn = H * 16 * 192 + H * (512 + 64) + 512 * 16 * (128 + 128) + 16 * 128 * H
    moe = 2 * 3 * H * 1408 + 64 * H + 6 * 3 * H * 1408
    matmul = 27 * attn + 3 * H * 10944 + 26 * moe + 102400 * H
    assert flops_per_token(c, T) == 6 * matmul + 6 * 27 * 16 * (192 + 128) * T
    # ~2.24B activated non-embedding weights: ~13.4 GFLOPs per token before attention
    assert 6 * 2.2e9 < flops_per_token(c, 1) < 6 * 2.5e9


def test_families_of_one_shape_have_the_same_flops_and_params():
    """A V2 router scores with softmax, a V3 one with sigmoids and a bias buffer: the same
    weights and matmuls for the same shape."""
    v2 = model_config("deepseek-v2-lite", V, tiny_v2())
    v3 = model_config("tiny", V, {"norm_topk_prob": False})
    assert (v2.model_type, v3.model_type) == ("deepseek_v2", "deepseek_v3")
    assert flops_per_token(v2, 128) == flops_per_token(v3, 128)
    assert param_counts(v2) == param_counts(v3)


@pytest.mark.parametrize(
    "name,dtype,tflops",
    [
        ("NVIDIA H200", "bf16", 989.5),
        ("NVIDIA H200 NVL", "bf16", 835.5),
        ("NVIDIA H100 80GB HBM3", "bf16", 989.5),
        ("NVIDIA H100 80GB HBM3", "tf32", 494.5),
        ("NVIDIA H100 PCIe", "fp16", 756.5),
        ("NVIDIA H100 NVL", "bfloat16", 835.5),
        ("NVIDIA A100-SXM4-80GB", "bf16", 312.0),
        ("NVIDIA A100-SXM4-40GB", "fp32", 19.5),
        ("NVIDIA A100 80GB PCIe", torch.bfloat16, 312.0),
        ("NVIDIA A10G", "bf16", 70.0),
        ("NVIDIA A10", "bf16", 125.0),
        ("NVIDIA L4", "bf16", 121.0),
        ("NVIDIA L40S", "fp16", 362.05),
        ("NVIDIA GeForce RTX 4090", "fp16", 165.2),
        ("NVIDIA GeForce RTX 3090", "bf16", 71.0),
        ("Tesla V100-SXM2-16GB", "fp16", 125.0),
        ("Tesla V100-PCIE-32GB", "fp16", 112.0),
        ("NVIDIA B200", "bf16", 2250.0),
    ],
)
def test_peak_lookup(name, dtype, tflops):
    assert peak_flops(name, dtype) == pytest.approx(tflops * 1e12)


def test_peak_none_for_cpu_unknown_and_unsupported():
    assert peak_flops("cpu", "bf16") is None
    assert peak_flops("", "bf16") is None
    assert peak_flops("AMD Instinct MI300X", "bf16") is None
    assert peak_flops("NVIDIA GeForce RTX 3090 Ti", "bf16") is None  # not in the table
    assert peak_flops("Tesla V100-SXM2-16GB", "bf16") is None  # no bf16 tensor cores
    assert peak_flops("cpu", "bf16", override_tflops=1.5) == pytest.approx(1.5e12)
    assert peak_flops("NVIDIA H200", "bf16", override_tflops=500) == pytest.approx(500e12)
    with pytest.raises(ValueError):
        peak_flops("NVIDIA H200", "int8")


def test_name_patterns_do_not_confuse_neighbours():
    assert gpu_key("NVIDIA A100-PCIE-40GB") == "A100"
    assert gpu_key("NVIDIA A10") == "A10"
    assert gpu_key("NVIDIA L40") == "L40"
    assert gpu_key("NVIDIA L4") == "L4"
    assert gpu_key("NVIDIA H100 PCIe") == "H100 PCIe"
    assert gpu_key("Tesla V100S-PCIE-32GB") == "V100S"
    for key, row in GPU_PEAK_TFLOPS.items():
        assert set(row) == {"bf16", "fp16", "tf32", "fp32"}, key


def test_mfu():
    assert mfu(1000.0, 6e9, 1e13) == pytest.approx(0.6)
    assert mfu(1000.0, 6e9, None) is None
    c = model_config("tiny", V)
    peak = peak_flops("NVIDIA H200", "bf16")
    assert 0 < mfu(1e6, flops_per_token(c, 128), peak) < 1


def test_mfu_is_against_the_datasheet_dense_peak_of_the_precision_in_use():
    """One H200 run at 40% of 989.5 TFLOP/s reads 40%, not the share of a measured matmul
    peak; train.peak_tflops overrides and says so; no peak, no MFU."""
    peak, what = mfu_peak("NVIDIA H200", "bf16")
    assert peak == pytest.approx(989.5e12)
    assert what == "H200 SXM datasheet dense bf16 peak 989.5 TFLOP/s"
    assert mfu_peak("NVIDIA GeForce RTX 4090", "fp16")[0] == pytest.approx(165.2e12)
    assert mfu_peak("NVIDIA A100-SXM4-80GB", "fp32")[1].endswith("dense fp32 peak 19.5 TFLOP/s")
    assert mfu(0.4 * 989.5e12 / 6e9, 6e9, peak) == pytest.approx(0.4)
    peak, what = mfu_peak("NVIDIA H200", "bf16", override_tflops=780)
    assert peak == pytest.approx(780e12) and what == "train.peak_tflops 780 TFLOP/s"
    peak, what = mfu_peak("cpu", "bf16")
    assert peak is None and "no datasheet peak" in what


def test_lora_counts_no_weight_gradients_for_the_frozen_weights():
    """train.finetune lora: 4 N per token (forward + input gradients) instead of 6 N; the
    attention term is the same."""
    config = model_config("tiny", 1000)
    full, lora = flops_per_token(config, 64), flops_per_token(config, 64, frozen=True)
    assert full - lora == 2 * activated_matmul_params(config)
