"""Training fast paths, chosen in params.yaml (`train.perf`); the math stays HF's.

- `attention: flash_padded`: SDPA's flash kernel needs one head dim for Q, K and V, and MLA's
  differ (qk_nope + qk_rope for Q/K, v_head_dim for V). Zero-padding the narrower side is exact:
  softmax(Q K^T) [V, 0] = [softmax(Q K^T) V, 0] and [Q, 0][K, 0]^T = Q K^T (the softmax scale
  is passed explicitly, so the padded width never enters it). The padding is sliced off again.
- `compile`: torch.compile of every decoder layer ("regional" compilation, as torchtitan does):
  the identical layers share one compiled graph, so compilation takes seconds per layer kind,
  not minutes for the whole model, and the model object, its parameter names and HF export
  stay untouched. The expert balancer's router hook is excluded (it runs eagerly).
- `ce_chunk`: the lm_head + cross-entropy fused over token chunks (dsflow.lm), so the
  [tokens x vocab] logits are never held in full. Not with fp16: its gradients are formed
  before the dynamic loss scale, and small ones would underflow (bf16 has fp32's range).
- `fused_grad_checks`: DeepSpeed's gradient overflow check and norm in a few multi-tensor
  launches instead of ~10 per tensor (dsflow.fusedgrads; ZeRO-1/2 without CPU offload).
  `auto` turns it on for CUDA in bf16/fp32 where it fits: 1.4x the dense step on one H200
  (docs/performance.md). fp16 (dynamic loss scaling) is untested, so there it stays opt-in.
- `activation_checkpointing`: keep only each decoder layer's input and recompute the rest in
  the backward pass (HF's gradient checkpointing, non-reentrant): less memory for a larger
  micro batch, at the price of one more forward (off by default: it is slower at a given batch).

`resolve` turns the `auto` values into what is on by default: the fast paths on CUDA, off on
CPU, where torch.compile's C++ build time dwarfs the short runs and flash attention does not
exist.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from dsflow.errors import UsageError

# HF treats any implementation name containing "flash" as a flash-attn package to import.
FLASH_PADDED = "dsflow_padded_sdpa"
DEFAULT_CE_CHUNK = 8192


@dataclass(frozen=True)
class Perf:
    compile: bool
    attention: str  # "sdpa" | "flash_padded"
    ce_chunk: int  # tokens per cross-entropy chunk; 0 = full logits
    prefetch: bool
    activation_checkpointing: bool = False
    fused_grad_checks: bool = False
    compile_mode: str = "default"  # torch.compile's mode; "reduce-overhead" adds CUDA graphs

    def describe(self) -> str:
        return (
            f"compile {f'on ({self.compile_mode})' if self.compile else 'off'}, "
            f"attention {self.attention}, "
            f"cross-entropy {f'fused, {self.ce_chunk}-token chunks' if self.ce_chunk else 'full logits'}, "
            f"prefetch {'on' if self.prefetch else 'off'}, "
            f"activation checkpointing {'on' if self.activation_checkpointing else 'off'}, "
            f"fused gradient checks {'on' if self.fused_grad_checks else 'off'}"
        )


def resolve(
    perf: dict,
    device_type: str,
    zero_stage: int = 2,
    precision: str = "bf16",
    optimizer_offload: bool = False,
) -> Perf:
    """`train.perf` with every `auto` decided for this device (see the module docstring)."""
    cuda = device_type == "cuda"

    def pick(key: str, on: Any, off: Any) -> Any:
        value = perf.get(key, "auto")
        return (on if cuda else off) if value == "auto" else value

    compile_ = bool(pick("compile", True, False))
    if compile_ and zero_stage == 3:
        # ZeRO-3 gathers parameters in module hooks that compiled regions would bypass.
        if perf.get("compile", "auto") is True:
            raise UsageError(
                "train.perf.compile: true is not supported with train.zero_stage: 3; "
                "set train.perf.compile: auto (or false)"
            )
        compile_ = False
    attention = pick("attention", "flash_padded", "sdpa")
    ce_chunk = pick("ce_chunk", DEFAULT_CE_CHUNK, 0)
    if precision == "fp16" and ce_chunk:
        # The fused loss forms its gradients in the forward pass, before DeepSpeed's dynamic
        # loss scale multiplies them: in fp16 small ones would underflow.
        if perf.get("ce_chunk", "auto") != "auto":
            raise UsageError(
                f"train.perf.ce_chunk: {ce_chunk} (the fused cross-entropy) does not work with "
                "train.precision: fp16 (its gradients would underflow before loss scaling); "
                "set train.perf.ce_chunk: auto or 0, or use bf16"
            )
        ce_chunk = 0
    return Perf(
        compile=compile_,
        attention=attention,
        ce_chunk=int(ce_chunk),
        prefetch=bool(perf.get("prefetch", True)),
        activation_checkpointing=bool(perf.get("activation_checkpointing", False)),
        fused_grad_checks=fused_grad_checks(perf, zero_stage, optimizer_offload, cuda, precision),
        compile_mode=perf.get("compile_mode", "default"),
    )


def fused_grad_checks(
    perf: dict, zero_stage: int, optimizer_offload: bool, cuda: bool, precision: str
) -> bool:
    """On for CUDA where it fits and is tested (bf16/fp32); `true` insists, `false` never."""
    value = perf.get("fused_grad_checks", "auto")
    # Only DeepSpeed's ZeRO-1/2 optimizer, on the device, has the per-tensor loops it replaces.
    fits = zero_stage in (1, 2) and not optimizer_offload
    if value == "auto":
        # On CPU the per-tensor launches cost little; fp16's loss-scaled path has no test.
        return fits and cuda and precision in ("bf16", "fp32")
    if value and not fits:
        where = "train.offload.optimizer" if optimizer_offload else f"train.zero_stage {zero_stage}"
        raise UsageError(
            f"train.perf.fused_grad_checks: true needs ZeRO stage 1 or 2 without optimizer "
            f"offload (this run has {where}); set it to auto or false"
        )
    return bool(value)


def flash_padded_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """HF attention interface: SDPA with Q/K and V zero-padded to one head dim."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    qk_dim, v_dim = query.shape[-1], value.shape[-1]
    if v_dim < qk_dim:
        value = F.pad(value, (0, qk_dim - v_dim))
    elif qk_dim < v_dim:
        query = F.pad(query, (0, v_dim - qk_dim))
        key = F.pad(key, (0, v_dim - qk_dim))
    if kwargs.get("scaling") is None:
        kwargs["scaling"] = qk_dim**-0.5  # the unpadded width, as SDPA's default would be
    out, weights = sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    return out[..., :v_dim], weights


def register_attention() -> None:
    """Make `FLASH_PADDED` a valid HF attention implementation (SDPA's mask rules)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(FLASH_PADDED, flash_padded_attention)
    AttentionMaskInterface.register(FLASH_PADDED, sdpa_mask)


def use_attention(model: Any, attention: str) -> None:
    """Switch a built HF model to `attention` ("sdpa" or "flash_padded")."""
    name = {"sdpa": "sdpa", "flash_padded": FLASH_PADDED}[attention]
    if name == FLASH_PADDED:
        register_attention()
    model.set_attn_implementation(name)


def compile_layers(model: Any, mode: str = "default") -> None:
    """torch.compile each decoder layer and the final norm in place (parameter names unchanged)."""
    import torch._dynamo

    layers = model.model.layers
    # Every layer is its own module object: leave room for one cache entry per layer and mode
    # (train forward, no-grad validation) before dynamo would fall back to eager.
    limit = 4 * (len(layers) + 2)
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, limit)
    torch._dynamo.config.accumulated_cache_size_limit = max(
        torch._dynamo.config.accumulated_cache_size_limit, 8 * limit
    )
    for layer in layers:
        layer.compile(dynamic=False, mode=mode)
    model.model.norm.compile(dynamic=False, mode=mode)


def apply(model: Any, perf: Perf) -> None:
    """Everything in `perf` that acts on the model itself (not the loss or the data)."""
    use_attention(model, perf.attention)
    if perf.activation_checkpointing:
        # Non-reentrant: the recomputation keeps autograd for the balancer's aux loss.
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if perf.compile:
        compile_layers(model, perf.compile_mode)
