"""Loading DeepSeek's block-FP8 checkpoints (V3, V3.1, R1 as published) as plain bf16/fp32 models.

Such a checkpoint says so in config.json (``quantization_config``: ``quant_method: fp8``,
``weight_block_size: [128, 128]``) and stores its linear weights as float8 (e4m3) with a
``<name>.weight_scale_inv`` fp32 grid, one scale per 128 x 128 block; blocks at the bottom and
right edges cover what is left of the matrix. The full-precision weight is
``fp8.float() * scale`` with each scale broadcast over its block.

transformers' own ``FineGrainedFP8Config(dequantize=True)`` is not used: it takes the block size
from ``rows // scale_rows``, which is wrong whenever a dimension is not a multiple of the block
(silently wrong weights, or an error for V3's 576-row ``kv_a_proj_with_mqa``). Here the weights
are dequantized as transformers reads them, one tensor at a time, and handed to
``from_pretrained`` as a state dict in the checkpoint's own layout, so its conversion mapping
(per-expert weights fused into ``mlp.experts.gate_up_proj``/``down_proj``) applies as for any
unquantized checkpoint. The model is the plain class with ``nn.Linear`` layers, and its config
carries no ``quantization_config``, so what ``save_pretrained`` writes loads as a plain model.

What the model builder does: load every pretrained checkpoint through
``fp8.from_pretrained(ModelClass, folder, **kwargs)`` instead of
``ModelClass.from_pretrained(folder, **kwargs)``, with the same kwargs (``config=`` the
checkpoint's own config is used without its ``quantization_config``; ``output_loading_info``
returns the same pair); a plain checkpoint goes straight through. It lets
:class:`~dsflow.errors.UsageError` through unchanged. ``block_size(folder)`` refuses any other
quantization in one line: call it where the checkpoint's config is first read, so every stage
that reads it refuses too.
"""

from __future__ import annotations

import copy
import json
import os
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from dsflow.errors import UsageError
from dsflow.model import source

_FP8_DTYPES = ("F8_E4M3", "F8_E5M2")
# Scales stored as numbers (DeepSeek's are fp32); integer-coded exponents (uint8) are not read.
_SCALE_DTYPES = ("F32", "BF16", "F16", "F8_E8M0")
_SCALE_SUFFIX = "_scale_inv"


def block_size(folder: str | os.PathLike) -> tuple[int, int] | None:
    """The (rows, cols) block of a block-FP8 checkpoint, None for an unquantized one.

    Any other ``quantization_config`` is a one-line :class:`UsageError` with the fix."""
    try:
        with open(os.path.join(folder, "config.json")) as fh:
            quant = json.load(fh).get("quantization_config")
    except (OSError, ValueError, AttributeError) as exc:
        raise UsageError(f"model.pretrained: cannot read {folder}/config.json: {exc}") from None
    if quant is None:
        return None
    method = quant.get("quant_method") if isinstance(quant, dict) else None
    if method != "fp8":
        raise UsageError(
            f"model.pretrained: {folder} is quantized with quant_method {method!r}; dsflow loads "
            "unquantized checkpoints and DeepSeek's block FP8 ('fp8' with weight_block_size) "
            "only: point model.pretrained at the model's bf16 release"
        )
    block = quant.get("weight_block_size")
    if not (
        isinstance(block, list)
        and len(block) == 2
        and all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in block)
    ):
        raise UsageError(
            f"model.pretrained: {folder}'s quantization_config.weight_block_size is {block!r}; "
            "dsflow dequantizes block-wise FP8 only (two positive integers, DeepSeek's [128, 128]): "
            "point model.pretrained at the model's bf16 release"
        )
    return block[0], block[1]


def strip(config: Any) -> Any:
    """A copy of a transformers config without ``quantization_config``: what builds and saves
    a plain model (with it, ``from_pretrained`` would quantize the layers again)."""
    config = copy.deepcopy(config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    return config


def from_pretrained(cls: Any, folder: str | os.PathLike, **kwargs: Any) -> Any:
    """``cls.from_pretrained(folder, **kwargs)``, with a block-FP8 checkpoint's weights
    dequantized to the dtype of ``kwargs`` (fp32 products rounded once)."""
    block = block_size(folder)
    if block is None:
        return cls.from_pretrained(folder, **kwargs)
    from transformers import GenerationConfig

    config = strip(kwargs.pop("config", None) or cls.config_class.from_pretrained(folder))
    with ExitStack() as files:
        state = _dequantizing_state_dict(folder, block, files)
        loaded = cls.from_pretrained(None, config=config, state_dict=state, **kwargs)
    model = loaded[0] if kwargs.get("output_loading_info") else loaded
    model.config.name_or_path = str(folder)
    if os.path.isfile(os.path.join(folder, "generation_config.json")):
        model.generation_config = GenerationConfig.from_pretrained(folder)
    return loaded


def dequantize(weight: Any, scale: Any, block: tuple[int, int]) -> Any:
    """fp32 ``weight * scale``, each scale over its ``block`` of the last two dims (edge blocks
    partial)."""
    import torch

    rows, cols = weight.shape[-2:]
    scale = scale.to(torch.float32).repeat_interleave(block[0], dim=-2)[..., :rows, :]
    scale = scale.repeat_interleave(block[1], dim=-1)[..., :cols]
    return weight.to(torch.float32) * scale


class _Dequantized:
    """A weight that transformers' loader materializes as ``tensor[...]`` (as it does the
    safetensors slices it reads itself), so one dequantized tensor lives at a time."""

    def __init__(self, weight: Any, scale: Any, block: tuple[int, int]):
        self.weight, self.scale, self.block = weight, scale, block

    def __getitem__(self, index: Any) -> Any:
        return dequantize(self.weight[...], self.scale[...], self.block)[index]


def _dequantizing_state_dict(folder: str | os.PathLike, block: tuple[int, int], files: ExitStack):
    """Every tensor of the checkpoint by its own name: float8 weights as :class:`_Dequantized`,
    the rest as safetensors slices; the scales are consumed. Shapes are checked here, from the
    headers, so a bad checkpoint fails in one line before transformers reads any weight."""
    from safetensors import safe_open

    opened = {
        file: files.enter_context(safe_open(os.path.join(folder, file), framework="pt"))
        for file in source.weight_files(str(folder), Path(folder))
    }
    slices = {key: handle.get_slice(key) for handle in opened.values() for key in handle.keys()}
    state: dict[str, Any] = {}
    for key, tensor in slices.items():
        if key.endswith(_SCALE_SUFFIX):
            if key.removesuffix(_SCALE_SUFFIX) not in slices:
                raise UsageError(f"model.pretrained: {folder} has {key} but no weight for it")
            continue
        if tensor.get_dtype() not in _FP8_DTYPES:
            state[key] = tensor
            continue
        scale = slices.get(key + _SCALE_SUFFIX)
        _check_scale(folder, key, tensor, scale, block)
        state[key] = _Dequantized(tensor, scale, block)
    return state


def _check_scale(folder, key: str, weight: Any, scale: Any, block: tuple[int, int]) -> None:
    shape = weight.get_shape()
    if len(shape) < 2:
        raise UsageError(f"model.pretrained: {folder} has a {len(shape)}-d float8 tensor {key}")
    grid = [*shape[:-2], -(-shape[-2] // block[0]), -(-shape[-1] // block[1])]
    if scale is None or scale.get_shape() != grid:
        found = "none" if scale is None else f"shape {scale.get_shape()}"
        raise UsageError(
            f"model.pretrained: {folder}: float8 weight {key} {shape} needs a "
            f"{key}{_SCALE_SUFFIX} of shape {grid} (weight_block_size {list(block)}), found "
            f"{found}: the checkpoint is incomplete or its quantization_config is wrong"
        )
    if scale.get_dtype() not in _SCALE_DTYPES:
        raise UsageError(
            f"model.pretrained: {folder}: {key}{_SCALE_SUFFIX} is {scale.get_dtype()}; dsflow "
            f"reads float scales ({', '.join(_SCALE_DTYPES)}): point model.pretrained at the "
            "model's bf16 release"
        )
