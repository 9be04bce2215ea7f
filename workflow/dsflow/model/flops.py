"""Training FLOPs per token, GPU peak throughput and model FLOPs utilisation (MFU).

MFU is against the datasheet dense (no 2:4 sparsity) peak of the precision in use, the
convention of nanoGPT, nanochat, torchtitan and Megatron, unless ``train.peak_tflops`` sets
another. A run that measures its matmul peak (bench/train_throughput.py) shows MFU against that
beside it as "of achievable".
"""

from __future__ import annotations

import re
from typing import Any

from dsflow.model.presets import activated_matmul_params, mtp_matmul_params


def flops_per_token(config: Any, seq_len: int, frozen: bool = False, mtp_depth: int = 0) -> int:
    """Training FLOPs per token (forward + backward) of a DeepseekV3ForCausalLM or a
    DeepseekV2ForCausalLM: the families differ in how the router scores, not in matmuls.

    ``6 * N + 6 * n_layers * n_heads * (qk_head_dim + v_head_dim) * seq_len`` where

    - ``N`` is the activated non-embedding *matmul* weights (``model.activated_matmul_params``):
      MLA projections, dense MLPs, shared experts, the top-k routed experts, the routers and
      the lm_head (also when tied). The embedding lookup, norms and biases are not matmuls.
      6 = 2 (multiply-add) x 3 (forward, backward w.r.t. inputs, backward w.r.t. weights).
    - the attention term is QK^T (``qk_head_dim``) and AV (``v_head_dim``) over the full
      ``seq_len`` -- *not* halved for the causal mask, the way nanoGPT, nanochat and the PaLM
      paper (appendix B) count it, so MFU numbers compare with theirs.

    No activation recomputation is counted (that would be hardware FLOPs, not model FLOPs).
    ``frozen``: the weights train through LoRA adapters (train.finetune lora), so no weight
    gradients are computed: ``4 * N`` (the adapters' own matmuls, rank x (in + out) per weight,
    are left out: well under 1% at the ranks people use). Used by the trainer's MFU and by
    planners.

    ``mtp_depth``: DeepSeek-V3's multi-token prediction modules (dsflow.model.mtp) add, for
    depth k, eh_proj, one MoE decoder layer and the lm_head on seq_len - k of a window's
    seq_len tokens (``presets.mtp_matmul_params``, and one layer's attention term).
    """
    if seq_len <= 0:
        raise ValueError(f"seq_len must be positive, got {seq_len}")
    qk = config.qk_nope_head_dim + config.qk_rope_head_dim
    per_layer_attn = 6 * config.num_attention_heads * (qk + config.v_head_dim)
    weights = 4 if frozen else 6
    main = weights * activated_matmul_params(config)
    main += per_layer_attn * config.num_hidden_layers * int(seq_len)
    if not mtp_depth:
        return main
    # Depth k runs on seq_len - k positions (attention over them): per window of seq_len tokens.
    depth_tokens = [int(seq_len) - k for k in range(1, mtp_depth + 1)]
    mtp = sum(n * (weights * mtp_matmul_params(config) + per_layer_attn * n) for n in depth_tokens)
    return main + mtp // int(seq_len)


# Dense (no 2:4 sparsity) peak tensor-core TFLOP/s per GPU from the vendor datasheets, the
# source named above each row; datasheets that quote the sparse rate are halved.
# "fp32" is the non-tensor-core FP32 rate: what PyTorch gets for fp32 matmuls by default
# (torch.backends.cuda.matmul.allow_tf32 is False); "tf32" applies once TF32 is enabled
# (torch.set_float32_matmul_precision("high")). bf16/fp16 are with FP32 accumulate, which is
# what cuBLAS uses for PyTorch's 16-bit matmuls. None: not supported by the hardware.
GPU_PEAK_TFLOPS: dict[str, dict[str, float | None]] = {
    # NVIDIA B200 (HGX B200, 1000 W) datasheet: FP16/BF16 4.5 PFLOPS, TF32 2.2 PFLOPS with
    # sparsity; FP32 75 TFLOPS.
    "B200": {"bf16": 2250.0, "fp16": 2250.0, "tf32": 1100.0, "fp32": 75.0},
    # NVIDIA H200 datasheet (SXM): BF16/FP16 1979, TF32 989 TFLOPS with sparsity; FP32 67.
    "H200 SXM": {"bf16": 989.5, "fp16": 989.5, "tf32": 494.5, "fp32": 67.0},
    # NVIDIA H200 NVL datasheet: BF16/FP16 1671, TF32 835 TFLOPS with sparsity; FP32 60.
    "H200 NVL": {"bf16": 835.5, "fp16": 835.5, "tf32": 417.5, "fp32": 60.0},
    # NVIDIA H100 datasheet, SXM: BF16/FP16 1979, TF32 989 TFLOPS with sparsity; FP32 67.
    "H100 SXM": {"bf16": 989.5, "fp16": 989.5, "tf32": 494.5, "fp32": 67.0},
    # NVIDIA H100 datasheet, NVL: BF16/FP16 1671, TF32 835 TFLOPS with sparsity; FP32 60.
    "H100 NVL": {"bf16": 835.5, "fp16": 835.5, "tf32": 417.5, "fp32": 60.0},
    # NVIDIA H100 datasheet, PCIe: BF16/FP16 1513, TF32 756 TFLOPS with sparsity; FP32 51.
    "H100 PCIe": {"bf16": 756.5, "fp16": 756.5, "tf32": 378.0, "fp32": 51.0},
    # NVIDIA A100 datasheet (40 GB and 80 GB, SXM and PCIe alike): BF16/FP16 312, TF32 156
    # (dense), FP32 19.5 TFLOPS.
    "A100": {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5},
    # NVIDIA A10 datasheet: BF16/FP16 125, TF32 62.5 (dense); FP32 31.2 TFLOPS.
    "A10": {"bf16": 125.0, "fp16": 125.0, "tf32": 62.5, "fp32": 31.2},
    # A10G (AWS G5; no public NVIDIA datasheet): AWS/NVIDIA figures as tabulated by Baseten,
    # "NVIDIA A10 vs A10G": BF16/FP16 tensor 70, TF32 35, FP32 35 TFLOPS (dense).
    "A10G": {"bf16": 70.0, "fp16": 70.0, "tf32": 35.0, "fp32": 35.0},
    # NVIDIA L4 datasheet: BF16/FP16 242, TF32 120 TFLOPS with sparsity; FP32 30.3.
    "L4": {"bf16": 121.0, "fp16": 121.0, "tf32": 60.0, "fp32": 30.3},
    # NVIDIA L40S datasheet: BF16/FP16 362.05 dense (733 with sparsity), TF32 183 dense;
    # FP32 91.6.
    "L40S": {"bf16": 362.05, "fp16": 362.05, "tf32": 183.0, "fp32": 91.6},
    # NVIDIA L40 datasheet: BF16/FP16 362.1, TF32 181 TFLOPS with sparsity; FP32 90.5.
    "L40": {"bf16": 181.0, "fp16": 181.0, "tf32": 90.5, "fp32": 90.5},
    # NVIDIA Ada whitepaper (RTX 4090): FP16/BF16 tensor with FP32 accumulate 165.2 dense
    # (330.3 with sparsity); with FP16 accumulate 330.3 dense -- GeForce cards run FP32
    # accumulate at half rate and PyTorch matmuls accumulate in FP32, so 165.2 applies.
    # TF32 82.6 dense; FP32 82.6.
    "RTX 4090": {"bf16": 165.2, "fp16": 165.2, "tf32": 82.6, "fp32": 82.6},
    # NVIDIA Ampere GA102 whitepaper (RTX 3090): FP16/BF16 tensor with FP32 accumulate 71
    # dense (142 with FP16 accumulate); TF32 35.6 dense; FP32 35.6.
    "RTX 3090": {"bf16": 71.0, "fp16": 71.0, "tf32": 35.6, "fp32": 35.6},
    # NVIDIA V100 datasheet: SXM2 FP16 tensor 125, FP32 15.7; PCIe 112 / 14; V100S 130 / 16.4.
    # No BF16 or TF32 tensor cores: bf16 is emulated (None); "tf32" runs as plain FP32.
    "V100 SXM2": {"bf16": None, "fp16": 125.0, "tf32": 15.7, "fp32": 15.7},
    "V100 PCIe": {"bf16": None, "fp16": 112.0, "tf32": 14.0, "fp32": 14.0},
    "V100S": {"bf16": None, "fp16": 130.0, "tf32": 16.4, "fp32": 16.4},
}

# torch.cuda.get_device_name() patterns -> table key; first match wins, so specific first.
_NAME_PATTERNS: list[tuple[str, str]] = [
    (r"\bB200\b", "B200"),
    (r"\bH200\b.*\bNVL\b", "H200 NVL"),
    (r"\bH200\b", "H200 SXM"),
    (r"\bH100\b.*\bNVL\b", "H100 NVL"),
    (r"\bH100\b.*\bPCIe\b", "H100 PCIe"),
    (r"\bH100\b", "H100 SXM"),  # "NVIDIA H100 80GB HBM3", "NVIDIA H100 SXM5 80GB"
    (r"\bA100\b", "A100"),  # "NVIDIA A100-SXM4-80GB", "NVIDIA A100 80GB PCIe"
    (r"\bA10G\b", "A10G"),
    (r"\bA10\b", "A10"),
    (r"\bL40S\b", "L40S"),
    (r"\bL40\b", "L40"),
    (r"\bL4\b", "L4"),
    (r"\bRTX 4090\b(?! ?D)", "RTX 4090"),
    (r"\bRTX 3090\b(?! ?Ti)", "RTX 3090"),
    (r"\bV100S\b", "V100S"),
    (r"\bV100\b.*\bPCIE\b", "V100 PCIe"),
    (r"\bV100\b", "V100 SXM2"),
]

_DTYPE_ALIASES = {
    "bf16": "bf16",
    "bfloat16": "bf16",
    "fp16": "fp16",
    "float16": "fp16",
    "half": "fp16",
    "fp32": "fp32",
    "float32": "fp32",
    "float": "fp32",
    "tf32": "tf32",
}


def gpu_key(device_name: str) -> str | None:
    """The GPU_PEAK_TFLOPS key for a ``torch.cuda.get_device_name()`` string, or None."""
    for pattern, key in _NAME_PATTERNS:
        if re.search(pattern, device_name or "", flags=re.IGNORECASE):
            return key
    return None


def _canonical(dtype: Any) -> str:
    name = str(dtype).removeprefix("torch.").lower()
    canon = _DTYPE_ALIASES.get(name)
    if canon is None:
        raise ValueError(f"unknown dtype {dtype!r}; expected one of {sorted(_DTYPE_ALIASES)}")
    return canon


def peak_flops(device_name: str, dtype: Any, override_tflops: float | None = None) -> float | None:
    """Peak dense FLOP/s of one device for ``dtype`` ("bf16", "fp16", "fp32", "tf32" or a
    torch dtype). ``override_tflops`` (TFLOP/s) wins when given; otherwise None for CPU, an
    unknown GPU or a dtype the GPU has no fast path for."""
    if override_tflops is not None:
        if override_tflops <= 0:
            raise ValueError(f"override_tflops must be positive, got {override_tflops}")
        return float(override_tflops) * 1e12
    key = gpu_key(device_name)
    if key is None:
        return None
    tflops = GPU_PEAK_TFLOPS[key].get(_canonical(dtype))
    return None if tflops is None else tflops * 1e12


def mfu_peak(
    device_name: str, dtype: Any, override_tflops: float | None = None
) -> tuple[float | None, str]:
    """(peak FLOP/s an MFU of this device is against, what that peak is): the datasheet dense
    peak of ``dtype`` (:data:`GPU_PEAK_TFLOPS`), or ``override_tflops`` (train.peak_tflops)."""
    peak = peak_flops(device_name, dtype, override_tflops)
    if override_tflops is not None:
        return peak, f"train.peak_tflops {override_tflops:g} TFLOP/s"
    if peak is None:
        return None, f"no datasheet peak for {device_name!r} in {_canonical(dtype)}"
    key = gpu_key(device_name)
    return peak, f"{key} datasheet dense {_canonical(dtype)} peak {peak / 1e12:g} TFLOP/s"


def mfu(tokens_per_s: float, flops_per_token: float, peak: float | None) -> float | None:
    """Model FLOPs utilisation in [0, 1]: achieved model FLOP/s over ``peak`` FLOP/s.

    ``tokens_per_s`` and ``peak`` must describe the same devices: per-GPU tokens/s with one
    GPU's peak, or the whole job's tokens/s with ``peak * world_size``. None without a peak.
    """
    if peak is None or peak <= 0:
        return None
    return float(tokens_per_s) * float(flops_per_token) / float(peak)
