"""Maintained kernel libraries, plugged into HF's model the way a user of HF plugs them in; the
bench's stock path (`baseline`) takes them where they run. dsflow's own fast paths are in
dsflow.model.fastpaths.

- `train.perf.experts: hf-best`: HF's fastest experts implementation here. That is `sonicmoe`
  (SonicMoE, Dao-AILab's CuTe-DSL MoE kernels) on GPUs of compute capability 9.x where it
  loads, else `grouped_mm`, HF's default; the train stage decides once and says why in one
  line. HF fetches SonicMoE from the Hugging Face Hub at the first forward
  (kernels-community/sonic-moe, through the `kernels` package); dsflow hands HF the installed
  pip package `sonic-moe` instead, the same entry point, so a run downloads no code.
- `train.perf.liger: true`: HF's `apply_liger_kernel` on the built model, what HF's Trainer does
  with `use_liger_kernel=True`: Liger Kernel's RMSNorm, SwiGLU MLPs, fused MoE experts and
  fused lm_head + cross-entropy, for the model types Liger supports. Its cross-entropy runs in
  HF's forward when that gets the labels, so the loss is then the HF model's output
  (dsflow.model.loss.TrainingLM).

Both need packages outside the default install; bench/README.md says which wheels and how.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.metadata
from typing import Any

from dsflow.errors import UsageError

# HF's sonicmoe runs on SM90 and newer; dsflow has compared it with grouped_mm on Hopper only.
SONICMOE_MAJOR = 9
SONICMOE_INSTALL = "bench/README.md: Maintained kernels"


def _version(distribution: str) -> str:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "(no metadata)"


def sonicmoe_missing() -> str | None:
    """Why the sonic-moe package, or what HF checks before it loads it (the `kernels` package,
    nvidia-cutlass-dsl's and apache-tvm-ffi's versions, the GPU), is not there: the rest of a
    line, or None."""
    try:
        importlib.import_module("sonicmoe")
        from transformers.integrations import sonicmoe as hf_sonicmoe
    except Exception as e:  # noqa: BLE001 - a broken CUDA library stack fails in many ways
        return f"does not import here ({type(e).__name__}: {e}; {SONICMOE_INSTALL})"
    try:
        hf_sonicmoe.is_sonicmoe_loadable(raise_error=True)
    except ImportError as e:
        return f"is refused by transformers: {e}"
    return None


def sonicmoe_refusal(gpus: list[dict]) -> str | None:
    """Why HF's sonicmoe experts do not run on these GPUs here (the rest of a line), or None."""
    if not gpus:
        return "needs a GPU"
    for gpu in gpus:
        major, minor = tuple(gpu["capability"])[:2]
        if major != SONICMOE_MAJOR:
            return (
                f"needs compute capability {SONICMOE_MAJOR}.x, and GPU {gpu['index']} "
                f"({gpu['name']}) is {major}.{minor}"
            )
    return sonicmoe_missing()


def pick_experts(perf: Any, gpus: list[dict]) -> Any:
    """`perf` (fastpaths.Perf) with `experts: hf-best` decided for these GPUs: "sonicmoe" or
    "hf" (grouped_mm on CUDA), and why in `experts_why`."""
    refusal = sonicmoe_refusal(gpus)
    if refusal is None:
        cc = ".".join(map(str, gpus[0]["capability"]))
        return dataclasses.replace(
            perf,
            experts="sonicmoe",
            experts_why=f"sonic-moe {_version('sonic-moe')} loads, compute capability {cc}",
        )
    return dataclasses.replace(perf, experts="hf", experts_why=f"sonicmoe {refusal}")


def experts_line(perf: Any, device: str) -> str:
    """The train stage's one line on `hf-best`'s choice."""
    kernel = {"sonicmoe": "sonicmoe", "hf": "grouped_mm" if device == "cuda" else "eager"}
    kernel = kernel[perf.experts]
    return f"experts: HF's {kernel} (train.perf.experts hf-best: {perf.experts_why})"


def use_sonicmoe(model: Any) -> None:
    """HF's sonicmoe experts on `model`, with the installed sonic-moe package as its kernel:
    HF's loader returns a kernel already in its table instead of fetching one from the Hub."""
    from transformers.integrations import hub_kernels

    hub_kernels._KERNEL_MODULE_MAPPING["sonic-moe"] = importlib.import_module("sonicmoe")
    model.set_experts_implementation("sonicmoe")


def liger_refusal(model_type: str) -> str | None:
    """Why Liger Kernel cannot be applied to a model of `model_type` here, or None."""
    try:
        from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN
    except ImportError as e:
        return f"needs liger-kernel, which does not import here ({e}; pip install 'dsflow[liger]')"
    if model_type not in MODEL_TYPE_TO_APPLY_LIGER_FN:
        return f"liger-kernel {_version('liger-kernel')} has no kernels for {model_type} models"
    return None


def check_liger(model_type: str, mtp_depth: int, precision: str = "bf16") -> None:
    """`train.perf.liger: true` for this model, or one line why not. Liger's fused
    cross-entropy is in HF's forward, which the multi-token prediction loss does not go
    through; it forms its gradients in the forward at unit scale, where fp16's dynamic loss
    scale cannot reach them (per-token gradients of about p / N fall below fp16's range)."""
    why = liger_refusal(model_type)
    if why is None and mtp_depth:
        why = "computes the loss in HF's forward, which model.mtp_depth's losses do not use"
    if why is None and precision == "fp16":
        why = (
            "forms its loss gradients in the forward, unscaled, where fp16 underflows them "
            "(train.perf.ce_chunk scales them by the loss scale, or train.precision: bf16)"
        )
    if why:
        raise UsageError(f"train.perf.liger: true {why}; set train.perf.liger: false")


def use_liger(model: Any) -> None:
    """Liger Kernel on `model` in place, as HF's Trainer applies it (use_liger_kernel=True,
    Liger's defaults for the model type)."""
    from transformers.integrations.liger import apply_liger_kernel

    apply_liger_kernel(model, None)
