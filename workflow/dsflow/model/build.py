"""Building a Hugging Face model of either DeepSeek family (``DeepseekV3ForCausalLM`` or
``DeepseekV2ForCausalLM``): fresh from a preset's config, or loaded from a checkpoint folder. The
shapes, families and their parameter counts live in :mod:`dsflow.model.presets`.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import re
import sys
from pathlib import Path
from typing import Any

from dsflow import safeload
from dsflow.atomic import atomic_dir
from dsflow.errors import UsageError
from dsflow.model import fp8, mtp, source
from dsflow.model.presets import config_class, config_problems

# The HF model class of each family (presets.FAMILIES).
MODEL_CLASSES = {"deepseek_v3": "DeepseekV3ForCausalLM", "deepseek_v2": "DeepseekV2ForCausalLM"}


def model_class(model_type: str) -> type:
    import transformers

    return getattr(transformers, MODEL_CLASSES[model_type])


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
    config: Any,
    *,
    device_type: str,
    pretrained: str | None = None,
    dtype: Any = None,
    mtp_depth: int = 0,
) -> Any:
    """The family's HF model (``config.model_type``) on CPU: fresh from ``config`` or loaded
    from ``pretrained``.

    Fresh init is deterministic given ``torch.manual_seed``. With ``pretrained`` (a local
    directory written by ``save_pretrained``) the checkpoint's own config and family are used;
    the tokenizer's vocabulary (``config.vocab_size``) must fit its embeddings, and every
    weight must be there (:func:`load_pretrained`). ``config`` is not mutated.
    ``dtype`` None means fp32 weights in both cases (transformers 5 would otherwise load a
    checkpoint in its saved dtype, e.g. bf16, leaving the optimizer without fp32 weights);
    DeepSpeed casts to bf16/fp16 itself. Like HF, a fresh model is in train mode, a loaded
    one in eval mode. ``mtp_depth`` > 0 attaches DeepSeek-V3's multi-token prediction modules
    (``model.mtp``, :mod:`dsflow.model.mtp`), from the checkpoint's MTP layers when loaded;
    the config's ``num_mtp_layers`` (config.json's ``num_nextn_predict_layers``) says how many
    the model carries.
    """
    import torch
    from transformers import AutoModelForCausalLM

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
        model = load_pretrained(pretrained, config.vocab_size, **kwargs)
    _ensure_fp32_router_bias(model)
    _attach_mtp(model, mtp_depth, pretrained)
    return model


def _attach_mtp(model: Any, depth: int, pretrained: str | None) -> None:
    """``model.mtp`` with ``depth`` modules: fresh, or the checkpoint's first ``depth`` MTP
    layers (a checkpoint with fewer is a one-line UsageError; with some and depth 0, one log
    line says they are left out)."""
    mtp.check_depth(depth, model.config.model_type)
    layers = model.config.num_hidden_layers
    stored = mtp_layers_stored(pretrained, layers) if pretrained else 0
    if depth > stored and pretrained:
        raise UsageError(_too_deep(depth, pretrained, stored, layers))
    if stored and not depth and os.environ.get("RANK", "0") == "0":  # once, not per rank
        print(
            f"[dsflow] model.pretrained {pretrained!r} holds {stored} MTP layer(s), not trained "
            "with model.mtp_depth 0 (a LoRA export keeps them as they are, a full one leaves "
            "them out)",
            file=sys.stderr,
        )
    model.config.num_mtp_layers = depth
    module = mtp.attach(model, depth)
    if module is not None and pretrained:
        with _published_reader(pretrained) as read:
            mtp.load_published(module, read)


def attach_stored_mtp(model: Any, folder: str) -> int:
    """The MTP layers a model folder's safetensors hold (an export: `save_hf`), attached to
    `model` (loaded from that folder by plain transformers, which leaves them out) as
    ``model.mtp``; returns how many (0 for none, or for the V2 family)."""
    if model.config.model_type != "deepseek_v3":
        return 0
    depth = mtp_layers_stored(folder, model.config.num_hidden_layers)
    if depth:
        _attach_mtp(model, depth, folder)
    return depth


def check_mtp(model: dict, config: Any) -> None:
    """model.mtp_depth against the model (`config`: the preset's, or model.pretrained's own,
    `model` resolved by dsflow.model.source) before any rank builds it: the V3 family only,
    and no more depths than the checkpoint holds; one line each."""
    depth = model.get("mtp_depth", 0)
    mtp.check_depth(depth, config.model_type)
    if depth and model["pretrained"]:
        layers = config.num_hidden_layers
        stored = mtp_layers_stored(model["pretrained"], layers)
        if depth > stored:
            raise UsageError(_too_deep(depth, model["pretrained"], stored, layers))


def _too_deep(depth: int, pretrained: str, stored: int, layers: int) -> str:
    return (
        f"model.mtp_depth {depth}: model.pretrained {pretrained!r} holds {stored} MTP "
        f"layer(s) (model.layers.{layers}.* on); set model.mtp_depth <= {stored}"
    )


def mtp_layers_stored(pretrained: str, layers: int) -> int:
    """How many MTP layers (``model.layers.{layers + k}.eh_proj``) the checkpoint's
    safetensors hold."""
    from safetensors import safe_open

    found = set()
    for name in source.weight_files(pretrained, Path(pretrained)):
        with safe_open(os.path.join(pretrained, name), "pt") as fh:
            for key in fh.keys():
                match = re.match(r"model\.layers\.(\d+)\.eh_proj\.weight$", key)
                if match and int(match.group(1)) >= layers:
                    found.add(int(match.group(1)))
    n = 0
    while layers + n in found:
        n += 1
    return n


@contextlib.contextmanager
def _published_reader(pretrained: str):
    """read(name) -> fp32 tensor from the checkpoint's safetensors (block-FP8 dequantized); a
    missing tensor is a one-line UsageError."""
    from safetensors import safe_open

    block = fp8.block_size(pretrained)
    with contextlib.ExitStack() as stack:
        where = {}
        for name in source.weight_files(pretrained, Path(pretrained)):
            fh = stack.enter_context(safe_open(os.path.join(pretrained, name), "pt"))
            where.update(dict.fromkeys(fh.keys(), fh))

        def read(key: str) -> Any:
            if key not in where:
                raise UsageError(
                    f"model.pretrained {pretrained!r} lacks MTP weight {key} (model.mtp_depth): "
                    "a partial or damaged download; download the checkpoint again"
                )
            tensor = where[key].get_tensor(key)
            scale = key + fp8._SCALE_SUFFIX
            if block is not None and scale in where:
                return fp8.dequantize(tensor, where[scale].get_tensor(scale), block)
            return tensor

        yield read


def load_pretrained(pretrained: str, tokens: int, **kwargs: Any) -> Any:
    """The checkpoint's model, as its family's class, with every weight from the checkpoint:
    a shard of the index or a tensor missing, a tensor of another shape (which transformers
    5 would initialise at random, with a warning) or a tokenizer of more than ``tokens``
    embeddings is a one-line UsageError. Weights from safetensors only."""
    ck_config = load_checkpoint_config(pretrained)
    check_vocab_fits(pretrained, ck_config.vocab_size, tokens)
    root = Path(pretrained)
    source.check_weights(pretrained, root, source.loadable(root))
    try:
        # A block-FP8 checkpoint (DeepSeek-V3's published weights) is dequantized on load.
        model, info = fp8.from_pretrained(
            model_class(ck_config.model_type),
            pretrained,
            config=ck_config,
            use_safetensors=True,
            output_loading_info=True,
            ignore_mismatched_sizes=True,  # reported below in one line, not raised at length
            **kwargs,
        )
    except UsageError:  # fp8's one-line refusals
        raise
    except Exception as exc:  # noqa: BLE001 - OSError, SafetensorError, shape errors...
        detail = " ".join(str(exc).split())
        raise UsageError(
            f"cannot load pretrained checkpoint {pretrained}: {type(exc).__name__}: {detail}"
        ) from None
    _refuse_partial(pretrained, info)
    return model


def check_vocab_fits(pretrained: str, checkpoint_vocab: int, tokens: int) -> None:
    """The tokenizer's ids must index the checkpoint's embeddings; fewer tokens than rows is
    fine (DeepSeek pads its embeddings: 100,015 tokens in 102,400 rows for V2)."""
    if tokens > checkpoint_vocab:
        raise UsageError(
            f"the tokenizer has {tokens} tokens but model.pretrained {pretrained} has "
            f"vocab_size {checkpoint_vocab}: use the tokenizer the checkpoint was trained with "
            "(tokenizer.pretrained), or resize the checkpoint's embeddings and save it again"
        )


def _refuse_partial(pretrained: str, info: dict) -> None:
    missing = sorted(info.get("missing_keys") or [])
    mismatched = sorted(info.get("mismatched_keys") or [])
    if missing:
        raise UsageError(
            f"pretrained checkpoint {pretrained!r} lacks {len(missing)} weight(s) the model "
            f"needs ({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''}): a partial "
            "or damaged download; download the checkpoint again"
        )
    if mismatched:
        key, saved, wanted = mismatched[0]
        raise UsageError(
            f"pretrained checkpoint {pretrained!r}: {len(mismatched)} weight(s) do not match "
            f"its config.json (first: {key} is {tuple(saved)}, the config makes "
            f"{tuple(wanted)})"
        )


def load_checkpoint_config(pretrained: str) -> Any:
    """The checkpoint's HF config, as its family's class (``presets.FAMILIES``); a folder that
    is not a checkpoint, another model_type or a config HF would route differently from how
    it says is a one-line UsageError."""
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
        source.refuse_other_family(repr(pretrained), model_type)
        fp8.block_size(pretrained)  # refuses any quantization but DeepSeek's block FP8
        # Dequantized on load, so the model and what it saves carry no quantization_config.
        config = fp8.strip(config_class(model_type).from_pretrained(pretrained))
    except UsageError:
        raise
    except Exception as exc:  # noqa: BLE001 - bad JSON, strict-dataclass validation, ...
        detail = " ".join(str(exc).split())
        raise UsageError(
            f"cannot read config of pretrained checkpoint {pretrained!r}: {detail}"
        ) from None
    problems = config_problems(config)
    if problems:
        raise UsageError(f"model.pretrained {pretrained!r}: " + "; ".join(problems))
    return config


def save_hf(module: Any, out: str | os.PathLike, tokenizer: str | os.PathLike, state_dict=None):
    """An HF model folder (what `AutoModelForCausalLM.from_pretrained` loads), written atomically:
    the module's config and weights as safetensors, in the module's dtype, and the tokenizer,
    with every file's content hash (safeload.RECORD, checked before the folder is loaded).
    ``state_dict`` replaces the module's own weights (ZeRO-3 gathers them from every rank).
    Multi-token prediction modules (``module.mtp``) go into a shard of their own under the
    published checkpoint's names (``model.layers.{num_hidden_layers + k - 1}.*``), which
    transformers leaves out on load as it does DeepSeek-V3's own."""
    from transformers import AutoTokenizer

    with atomic_dir(out) as tmp:
        write_weights(module, Path(tmp), state_dict)
        AutoTokenizer.from_pretrained(tokenizer).save_pretrained(tmp)
        # safetensors writes the file itself, so the hashes are read back once, here.
        safeload.record_folder(tmp)


def write_weights(module: Any, folder: Path, state_dict: dict | None = None) -> None:
    """The module's config and safetensors weights into `folder` (save_pretrained), its MTP
    modules (``module.mtp``) as a shard of their own under the published names."""
    extra: dict = {}
    if getattr(module, "mtp", None) is not None:
        full = state_dict if state_dict is not None else module.state_dict()
        extra = mtp.published_state(full)
        state_dict = {k: v for k, v in full.items() if not k.startswith("mtp.")}
    module.save_pretrained(folder, state_dict=state_dict, safe_serialization=True)
    if extra:
        _add_shard(folder, MTP_SHARD, extra)


# The shard of a saved model that holds its multi-token prediction weights.
MTP_SHARD = "model-mtp.safetensors"
_INDEX = "model.safetensors.index.json"


def _add_shard(folder: Path, name: str, tensors: dict) -> None:
    """`tensors` as one more safetensors shard of the model in `folder`, named in its index
    (a single model.safetensors becomes model-main.safetensors, indexed)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    index_path = folder / _INDEX
    if index_path.is_file():
        index = json.loads(index_path.read_text())
    else:
        os.replace(folder / "model.safetensors", folder / "model-main.safetensors")
        with safe_open(folder / "model-main.safetensors", "pt") as fh:
            keys = list(fh.keys())
            size = sum(fh.get_tensor(k).nbytes for k in keys)
        index = {
            "metadata": {"total_size": size},
            "weight_map": dict.fromkeys(keys, "model-main.safetensors"),
        }
    # Copies: the shared embedding and head appear once per depth, and safetensors refuses
    # tensors that share memory.
    tensors = {k: v.detach().to("cpu").contiguous().clone() for k, v in tensors.items()}
    save_file(tensors, str(folder / name), metadata={"format": "pt"})
    index["weight_map"].update(dict.fromkeys(tensors, name))
    meta = index.setdefault("metadata", {})
    meta["total_size"] = int(meta.get("total_size", 0)) + sum(t.nbytes for t in tensors.values())
    index["weight_map"] = dict(sorted(index["weight_map"].items()))
    index_path.write_text(json.dumps(index, indent=2) + "\n")
