"""`python -m dsflow export`: a checkpoint in checkpoints/ as an HF model, consolidated.

The train stage writes models/final with the trained module's weights in their training dtype
(bf16 for a bf16 run). This command writes any complete checkpoint -- whichever ZeRO stage and
number of ranks saved it -- with the optimizer's fp32 master weights gathered from all ZeRO
partitions (DeepSpeed's `get_fp32_state_dict_from_zero_checkpoint`), as fp32 or cast to bf16:
safetensors + config + tokenizer, loadable with `AutoModelForCausalLM.from_pretrained`. A ZeRO-0
checkpoint has no fp32 partitions: its module weights are written (upcast from 16 bits in a
bf16/fp16 run). It runs in one process on CPU (host RAM for the whole fp32 model, twice).

    python -m dsflow export                       # the newest checkpoint -> models/export-stepN
    python -m dsflow export --tag step00000100 --dtype bf16 --out models/step100

The checkpoint is data, never code: its files' content hashes are checked against its manifest
first, and they are unpickled with weights_only (dsflow.safeload), so a damaged or planted file
fails in one line naming it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from dsflow import safeload
from dsflow.errors import UsageError
from dsflow.model import mtp, source
from dsflow.model.build import load_checkpoint_config, save_hf
from dsflow.model.presets import model_config
from dsflow.paths import TOKENIZER, export_dir
from dsflow.progress import log
from dsflow.train import checkpoint as ckpt


def add_arguments(parser) -> None:
    parser.add_argument("--tag", help="checkpoint tag (default: the newest complete one)")
    parser.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument("--out", help="output directory (default models/export-<tag>)")


def consolidated_state_dict(root: Path, tag: str) -> dict[str, Any]:
    """Full fp32 weights and buffers of checkpoint `tag`: from the ZeRO partitions (stage 1-3),
    or the model-states file itself (stage 0, which keeps full weights there)."""
    path = root / tag
    if not any(path.glob("*zero_pp_rank_*_optim_states.pt")):
        state = safeload.torch_load(path / ckpt.MODEL_FILE, map_location="cpu")
        return {k: v.float() if v.is_floating_point() else v for k, v in state["module"].items()}
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    with safeload.weights_only():  # DeepSpeed's loads ask for weights_only=False
        return get_fp32_state_dict_from_zero_checkpoint(str(root), tag=tag)


def export_checkpoint(root: Path, tag: str, out: Path, dtype: str = "fp32") -> Path:
    # torch-heavy imports here: the command line imports this module for its arguments.
    import torch
    from transformers import AutoModelForCausalLM

    from dsflow.model.balance import find_routers

    try:
        spec = json.loads((root / "run.json").read_text())
        params, vocab = spec["params"], spec["vocab_size"]
    except (OSError, ValueError, KeyError) as e:
        raise UsageError(
            f"{root}/run.json: unreadable ({e}); it is written by the train stage"
        ) from None
    model = params["model"]
    if params["train"].get("finetune") == "lora":
        return _export_lora(root, tag, out, dtype, params)
    if model["pretrained"]:  # the train stage's folder, else found again from "source"
        config = load_checkpoint_config(str(source.folder(model)))
    else:
        config = model_config(model["preset"], vocab, model["overrides"])
    weights = consolidated_state_dict(root, tag)
    net = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # Multi-token prediction modules: written by save_hf in the published layout.
    depth = model.get("mtp_depth", 0)
    net.config.num_mtp_layers = depth
    mtp.attach(net, depth)
    missing, unexpected = net.load_state_dict(weights, strict=False)
    if missing or unexpected:
        raise UsageError(
            f"checkpoint {tag} does not match the model in {root}/run.json (missing "
            f"{sorted(missing)[:3]}, unexpected {sorted(unexpected)[:3]})"
        )
    if dtype == "bf16":
        net.to(torch.bfloat16)
        for _, router in find_routers(net):  # V3's routing bias stays fp32 (see balance.py)
            bias = getattr(router, "e_score_correction_bias", None)
            if bias is not None:
                bias.data = bias.data.float()
    save_hf(net, out, TOKENIZER)
    return out


def _export_lora(root: Path, tag: str, out: Path, dtype: str, params: dict) -> Path:
    """A LoRA checkpoint holds the adapters (and the routers' biases) only: they go back on
    the frozen base from model.pretrained, and `out` gets the merged model and the adapter
    (as models/final does)."""
    from dsflow.model import lora
    from dsflow.model.build import build_model

    base = str(source.folder(params["model"]))
    depth = params["model"].get("mtp_depth", 0)  # the MTP depths trained, adapters and all
    net = build_model(
        load_checkpoint_config(base), device_type="cpu", pretrained=base, mtp_depth=depth
    )
    adapted = lora.attach(net, params["train"]["lora"])
    missing, unexpected = net.load_state_dict(consolidated_state_dict(root, tag), strict=False)
    # Frozen weights come from the base; the adapters and V3's routing biases must be here.
    missing = [k for k in missing if "lora_" in k or k.endswith(lora.BIAS)]
    if missing or unexpected:
        raise UsageError(
            f"checkpoint {tag} does not match the LoRA model in {root}/run.json (missing "
            f"{sorted(missing)[:3]}, unexpected {sorted(unexpected)[:3]})"
        )
    lora.save_final(adapted, base, out, TOKENIZER, dtype, params["model"]["source"]["pretrained"])
    return out


def run(params: dict, args: Any = None) -> None:
    root = ckpt.CHECKPOINTS
    tag = getattr(args, "tag", None) or ckpt.resume_tag(root, note=log.info, content=True)
    if not tag:
        raise UsageError(f"{root}/ holds no intact checkpoint; run the train stage first")
    problem = ckpt.validate_tag(root, tag, elastic=True, content=True)
    if problem:
        raise UsageError(f"checkpoint {root}/{tag}: {problem}")
    dtype = getattr(args, "dtype", None) or "fp32"
    out = Path(getattr(args, "out", None) or export_dir(tag))
    export_checkpoint(root, tag, out, dtype)
    log.info("%s/%s -> %s (%s, consolidated from every rank's partition)", root, tag, out, dtype)
