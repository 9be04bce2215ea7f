"""FP8 training of the dense linears (`train.perf.fp8`), with torchao's float8 linears.

Each chosen `nn.Linear` becomes torchao's `Float8Linear`: its weight stays a bf16/fp32
parameter (the optimizer, ZeRO, checkpoints and the HF export see what they saw), and its three
matmuls (output, input gradient, weight gradient) run in float8 with scales taken per tensor
(`tensorwise`) or per row (`rowwise`). torch.compile (`train.perf.compile`) fuses the scaling
and casting into the neighbouring kernels; without it they run as separate kernels.

Which linears: the attention projections, the dense MLPs and the shared experts, where both
dimensions are multiples of 16 (the FP8 tensor cores' requirement) and the layer is large
enough for FP8 to pay: torchao's H100 thresholds per recipe (torchao/float8 README). Left in
bf16: the lm_head (the fused cross-entropy reads its weight directly), V2's router (`gate`,
whose scores pick the experts) and the routed experts, which are fused 3-D weights, not
linears (a grouped FP8 GEMM would be needed there).

On a CUDA GPU the FP8 tensor cores need compute capability 8.9 (RTX 4090, L40S, H100, H200);
the train stage checks that before it launches. On CPU torchao's emulation runs the same
casts and scales with high-precision matmuls: slow, for tests only.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from dsflow.errors import UsageError

RECIPES = ("tensorwise", "rowwise")
MIN_CAPABILITY = (8, 9)
# The fused cross-entropy multiplies by lm_head.weight itself; V2's router is a plain linear
# named `gate` whose scores pick the experts.
SKIPPED = ("lm_head", "gate")


def worthwhile(out_features: int, in_features: int, recipe: str) -> bool:
    """Whether a linear of this shape runs faster in FP8 than in bf16 on an H100, by
    torchao's published thresholds for each recipe (N = out_features, K = in_features)."""
    n, k = out_features, in_features
    if n % 16 or k % 16:
        return False
    if recipe == "tensorwise":
        return not (k <= 4096 and n <= 1024)
    return n > 2048 and k > 1024 and not (n <= 4096 and k <= 2048)


def chosen(model: Any, recipe: str) -> list[str]:
    """Names of the linears `convert` turns into float8 ones."""
    import torch.nn as nn

    return [
        name
        for name, module in model.named_modules()
        if type(module) is nn.Linear and _eligible(name, module, recipe)
    ]


def _eligible(name: str, module: Any, recipe: str) -> bool:
    if name.rsplit(".", 1)[-1] in SKIPPED:
        return False
    return worthwhile(module.out_features, module.in_features, recipe)


def convert(model: Any, recipe: str, emulate: bool) -> int:
    """Turns the chosen linears of `model` into torchao float8 linears in place; returns how
    many. `emulate`: CPU (no FP8 tensor cores)."""
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError:
        raise UsageError(
            f"train.perf.fp8: {recipe} needs torchao, which is not installed; "
            "pip install 'dsflow[fp8]' (or torchao), or set train.perf.fp8: false"
        ) from None
    names = set(chosen(model, recipe))
    if not names:
        return 0
    config = Float8LinearConfig.from_recipe_name(recipe)
    if emulate:
        config = dataclasses.replace(config, emulate=True)
    convert_to_float8_training(
        model, config=config, module_filter_fn=lambda _module, fqn: fqn in names
    )
    return len(names)


def check_gpus(recipe: str, gpus: list[dict]) -> None:
    """One line when a GPU has no FP8 tensor cores (the train stage, before launching)."""
    for gpu in gpus:
        capability = tuple(gpu.get("capability", ()))
        if capability and capability < MIN_CAPABILITY:
            major, minor = capability
            raise UsageError(
                f"train.perf.fp8: {recipe} needs FP8 tensor cores (compute capability 8.9: "
                f"RTX 4090, L40S, H100, H200), and GPU {gpu['index']} ({gpu['name']}) is "
                f"{major}.{minor}; set train.perf.fp8: false"
            )
