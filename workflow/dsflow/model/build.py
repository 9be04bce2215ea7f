"""Building a Hugging Face ``DeepseekV3ForCausalLM``: fresh from a preset's config, or loaded from a
checkpoint folder. The shapes and their parameter counts live in :mod:`dsflow.model.presets`.
"""

from __future__ import annotations

import copy
import json
import os
from typing import Any

from dsflow.atomic import atomic_dir
from dsflow.errors import UsageError


def experts_implementation_for(device_type: str) -> str:
    """``grouped_mm`` on CUDA (torch grouped GEMM, SM80+), ``eager`` (per-expert loop) elsewhere.

    transformers 5.x picks ``grouped_mm`` by default for every device when the Experts class is
    decorated with ``@use_experts_implementation`` (DeepseekV3Experts is), falling back to a
    python-loop kernel at call time when the device cannot run it; we choose explicitly.
    """
    return "grouped_mm" if device_type == "cuda" else "eager"


def _ensure_fp32_router_bias(model: Any) -> None:
    """Keep every router's ``e_score_correction_bias`` in fp32.

    HF lists it in ``_keep_in_fp32_modules_strict`` but only ``from_pretrained`` honours that:
    ``from_config(dtype=bf16)`` creates the buffer in bf16 (the default dtype during init).
    A bf16 bias would swallow the balancer's small ``gamma`` steps.
    """
    import torch

    for name, buf in model.named_buffers():
        if name.endswith("e_score_correction_bias") and buf.dtype != torch.float32:
            buf.data = buf.data.float()


def build_model(
    config: Any, *, device_type: str, pretrained: str | None = None, dtype: Any = None
) -> Any:
    """A ``DeepseekV3ForCausalLM`` on CPU: fresh from ``config`` or loaded from ``pretrained``.

    Fresh init is deterministic given ``torch.manual_seed``. With ``pretrained`` (a local
    directory written by ``save_pretrained``) the checkpoint's own architecture is used; its
    vocab_size must equal ``config.vocab_size`` (the tokenizer's). ``config`` is not mutated.
    ``dtype`` None means fp32 weights in both cases (transformers 5 would otherwise load a
    checkpoint in its saved dtype, e.g. bf16, leaving the optimizer without fp32 weights);
    DeepSpeed casts to bf16/fp16 itself. Like HF, a fresh model is in train mode, a loaded
    one in eval mode.
    """
    import torch
    from transformers import AutoModelForCausalLM, DeepseekV3Config, DeepseekV3ForCausalLM

    if isinstance(dtype, str):
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}.get(
            dtype, getattr(torch, dtype, None)
        )
    kwargs: dict[str, Any] = dict(
        attn_implementation="sdpa", experts_implementation=experts_implementation_for(device_type)
    )
    if dtype is not None:
        kwargs["dtype"] = dtype
    elif pretrained is not None:
        kwargs["dtype"] = torch.float32

    if pretrained is None:
        # _from_config mutates the config it is given (dtype, implementations): use a copy.
        model = AutoModelForCausalLM.from_config(copy.deepcopy(config), **kwargs)
    else:
        ck_config = load_checkpoint_config(pretrained)
        if ck_config.vocab_size != config.vocab_size:
            raise UsageError(
                f"checkpoint {pretrained} has vocab_size {ck_config.vocab_size} but the tokenizer "
                f"has {config.vocab_size}: use the tokenizer the checkpoint was trained with "
                "(or resize the checkpoint's embeddings and save it again)"
            )
        try:
            model = DeepseekV3ForCausalLM.from_pretrained(pretrained, **kwargs)
        except Exception as exc:  # noqa: BLE001 - OSError, SafetensorError, shape errors...
            detail = " ".join(str(exc).split())
            raise UsageError(
                f"cannot load pretrained checkpoint {pretrained}: {type(exc).__name__}: {detail}"
            ) from None
    if not isinstance(model.config, DeepseekV3Config):  # pragma: no cover - AutoModel guard
        raise UsageError(f"expected a DeepSeek-V3 model, got {type(model).__name__}")
    _ensure_fp32_router_bias(model)
    return model


def load_checkpoint_config(pretrained: str) -> Any:
    from transformers import DeepseekV3Config

    if not os.path.isdir(pretrained):
        raise UsageError(
            f"pretrained checkpoint {pretrained!r} is not a directory "
            "(expected a save_pretrained() output with config.json and *.safetensors)"
        )
    cfg_path = os.path.join(pretrained, "config.json")
    if not os.path.isfile(cfg_path):
        raise UsageError(f"pretrained checkpoint {pretrained!r} has no config.json")
    try:
        with open(cfg_path) as fh:
            model_type = json.load(fh).get("model_type")
        if model_type != "deepseek_v3":
            raise UsageError(
                f"pretrained checkpoint {pretrained!r} has model_type {model_type!r}; "
                "dsflow trains 'deepseek_v3' models only"
            )
        return DeepseekV3Config.from_pretrained(pretrained)
    except UsageError:
        raise
    except Exception as exc:  # noqa: BLE001 - bad JSON, strict-dataclass validation, ...
        detail = " ".join(str(exc).split())
        raise UsageError(
            f"cannot read config of pretrained checkpoint {pretrained!r}: {detail}"
        ) from None


def save_hf(module: Any, out: str | os.PathLike, tokenizer: str | os.PathLike, state_dict=None):
    """An HF model folder (what `AutoModelForCausalLM.from_pretrained` loads), written atomically:
    the module's config and weights as safetensors, in the module's dtype, and the tokenizer.
    ``state_dict`` replaces the module's own weights (ZeRO-3 gathers them from every rank)."""
    from transformers import AutoTokenizer

    with atomic_dir(out) as tmp:
        module.save_pretrained(tmp, state_dict=state_dict, safe_serialization=True)
        AutoTokenizer.from_pretrained(tokenizer).save_pretrained(tmp)
