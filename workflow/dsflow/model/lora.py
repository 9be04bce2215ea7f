"""LoRA fine-tuning of a DeepSeek model with PEFT: which weights get adapters, and the exports.

`train.finetune: lora` freezes the base model and trains low-rank adapters (B A, rank r, scaled
by alpha / r) on the weight groups named in `train.lora.targets`:

- `attention`: MLA's projections (q_proj or q_a_proj / q_b_proj, kv_a_proj_with_mqa, kv_b_proj,
  o_proj), as PEFT's ordinary `nn.Linear` adapters (these alone take `dropout`);
- `dense_mlp`: the dense layers' gate/up/down projections;
- `shared_experts`: the MoE layers' shared experts;
- `experts`: the routed experts' fused weights (`gate_up_proj` [E, 2I, H] and `down_proj`), one
  adapter per expert (PEFT's parameter adapters).

The MLP groups go through PEFT's parameter adapters (`target_parameters`) even where the weight
sits in an `nn.Linear`: since transformers 5 fused DeepSeek's experts, PEFT reads a module target
named `gate_proj`, `up_proj` or `down_proj` as the experts of a transformers-4 adapter and moves it
onto the fused weights, so a dense layer's projections could not be targeted by name, and an
adapter saved that way would load onto other weights. Parameter targets load back as they were
saved. The routers (and their balancing biases), norms and embeddings stay frozen as they are.

DeepSeek-V3's multi-token prediction modules (`model.mtp_depth` > 0, `hf.mtp`, loaded from the
checkpoint's MTP layers) train the same way: each depth's decoder layer is reached by the same
targets as the main layers (PEFT matches names by suffix), and its `eh_proj` (2H -> H, the one
linear without a counterpart in the main layers) gets an `nn.Linear` adapter whatever the
targets, since it is where the depth takes in the main model's moving hidden state. Its enorm,
hnorm and shared_head.norm stay frozen like the other norms.
"""

from __future__ import annotations

import functools
from typing import Any

from dsflow.errors import UsageError

ADAPTER = "adapter"  # the adapter's folder inside the merged model's (models/final/adapter)
BIASES = "router_biases.safetensors"  # beside PEFT's files in the adapter folder
BIAS = "e_score_correction_bias"

GROUPS: dict[str, dict[str, list[str]]] = {
    "attention": {
        "modules": ["q_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"]
    },
    "dense_mlp": {"parameters": [f"mlp.{p}_proj.weight" for p in ("gate", "up", "down")]},
    "shared_experts": {
        "parameters": [f"shared_experts.{p}_proj.weight" for p in ("gate", "up", "down")]
    },
    "experts": {"parameters": ["experts.gate_up_proj", "experts.down_proj"]},
}
# Adapted in every multi-token prediction depth (dsflow.model.mtp), whatever the targets.
MTP_MODULES = ["eh_proj"]


def _matches(model: Any, group: str) -> list[str]:
    """The names in `model` that `group`'s targets reach (PEFT's suffix rule)."""
    spec = GROUPS[group]
    modules = [n for n, _ in model.named_modules()]
    params = [n for n, _ in model.named_parameters()]
    hits = [n for n in modules for t in spec.get("modules", []) if n.endswith("." + t)]
    hits += [n for n in params for t in spec.get("parameters", []) if n.endswith("." + t)]
    return hits


def check(model: Any, lora: dict) -> None:
    """One line for a LoRA setting this model cannot take (before PEFT raises its own)."""
    if lora["rank"] < 1:
        raise UsageError(f"train.lora.rank: {lora['rank']}; give a rank of 1 or more")
    unknown = [g for g in lora["targets"] if g not in GROUPS]
    if unknown or not lora["targets"]:
        raise UsageError(
            f"train.lora.targets: {unknown or 'empty'}; choose from {', '.join(GROUPS)}"
        )
    for group in lora["targets"]:
        if not _matches(model, group):
            raise UsageError(
                f"train.lora.targets: {group!r} matches no weight of this model "
                f"({type(model).__name__}); drop it from the list"
            )
    if lora["dropout"] and set(lora["targets"]) - {"attention"}:
        # PEFT's parameter adapters add B A to the weight itself, where dropout has no input.
        raise UsageError(
            f"train.lora.dropout: {lora['dropout']} works on the attention target only "
            "(the MLP adapters are merged into their weights); set it to 0 or target attention only"
        )


def peft_config(lora: dict, mtp: bool = False) -> Any:
    """PEFT's LoraConfig for train.lora; `mtp`: the model carries MTP modules (MTP_MODULES)."""
    from peft import LoraConfig

    modules = [m for g in lora["targets"] for m in GROUPS[g].get("modules", [])]
    modules += MTP_MODULES if mtp else []
    params = [p for g in lora["targets"] for p in GROUPS[g].get("parameters", [])]
    return LoraConfig(
        r=lora["rank"],
        lora_alpha=lora["alpha"],
        lora_dropout=lora["dropout"],
        target_modules=modules or None,
        target_parameters=params or None,
        bias="none",
    )


def attach(model: Any, lora: dict) -> Any:
    """`model` (an HF DeepSeek model) with fresh LoRA adapters, base weights frozen: a PEFT model
    whose adapters are its only trainable parameters. B starts at zero, so the adapted model
    computes what the base does until the first step."""
    from peft import get_peft_model

    check(model, lora)
    adapted = get_peft_model(model, peft_config(lora, getattr(model, "mtp", None) is not None))
    _direct_adapters(adapted)
    return adapted


def _direct_adapters(model: Any) -> None:
    """PEFT's parameter adapter on an `nn.Linear` weight (the dense MLPs, the shared experts)
    or on the routed experts' fused weights adds B A to the weight through
    `torch.nn.utils.parametrize`, registered and removed at every forward. Each registration
    makes a new class for the module, so torch.compile recompiles each layer until its recompile
    limit and runs the rest eagerly. The adapters found here compute the same sum and use it
    directly instead (`F.linear`; the sorted experts take the adapted weights as arguments): one
    graph for every layer. They stay PEFT's adapters (a subclass) for saving and merging."""
    import torch

    wrapper = _direct_wrapper_class()
    wrappers = [m for m in model.modules() if type(m) is wrapper.__base__]
    inner = {id(m.base_layer) for m in wrappers}  # a fused experts module's second wrapper
    for module in wrappers:
        linear = module.num_experts == 1 and module.parameter_name == "weight"
        if (linear and type(module.base_layer) is torch.nn.Linear) or (
            module.num_experts > 1 and id(module) not in inner
        ):
            module.__class__ = wrapper


@functools.cache
def _direct_wrapper_class() -> type:
    import torch.nn.functional as F
    from peft.tuners.lora.layer import ALLOWED_COMPUTE_DTYPES, ParamWrapper

    from dsflow.model import fastpaths

    class DirectWrapper(ParamWrapper):
        """W + the active adapters' B A (as PEFT forms it), then `F.linear` or the sorted
        experts with the adapted weights (see _direct_adapters); PEFT's own forward where
        it does something else (adapters off or merged, mixed batches, a low-precision base
        weight, experts other than the sorted ones, or a fused experts weight whose wrapper
        has no active adapter): correct there, but a compiled layer's graph breaks."""

        def forward(self, x: Any, *args: Any, **kwargs: Any) -> Any:
            chain = [self]  # this wrapper, then those it wraps: one per fused experts weight
            while isinstance(chain[-1].base_layer, ParamWrapper):
                chain.append(chain[-1].base_layer)
            base = chain[-1].base_layer
            if not all(_plain(w, kwargs) for w in chain):
                return super().forward(x, *args, **kwargs)
            if self.num_experts == 1:
                return F.linear(x, _adapted(self), base.bias)
            if getattr(base.config, "_experts_implementation", None) != fastpaths.SORTED_EXPERTS:
                return super().forward(x, *args, **kwargs)
            weights = {w.parameter_name: _adapted(w) for w in chain}
            return fastpaths.sorted_experts_forward(base, x, *args, **kwargs, weights=weights)

    def _plain(wrapper: ParamWrapper, kwargs: dict) -> bool:
        active = [a for a in wrapper.active_adapters if a in wrapper.lora_A]
        off = wrapper.disable_adapters or wrapper.merged or "adapter_names" in kwargs
        return bool(active) and not off and wrapper.get_param().dtype in ALLOWED_COMPUTE_DTYPES

    def _adapted(wrapper: ParamWrapper) -> Any:
        """The weight with its active adapters, formed as PEFT's parametrization forms it: one
        adapter on fused experts folds B A into W in one baddbmm, otherwise W + the deltas."""
        import torch

        param = wrapper.get_param()
        active = [a for a in wrapper.active_adapters if a in wrapper.lora_A]
        if len(active) == 1 and wrapper.num_experts > 1:
            lhs, rhs, scaling = wrapper.get_delta_factors(active[0])
            with torch.autocast(device_type=param.device.type, enabled=False):
                return torch.baddbmm(param, lhs, rhs, alpha=scaling)
        delta = wrapper.get_delta_weight(active[0])
        for name in active[1:]:
            delta = delta + wrapper.get_delta_weight(name)
        return param + delta

    # PEFT finds its wrappers by class name when another adapter is added (tuners_utils).
    DirectWrapper.__name__ = DirectWrapper.__qualname__ = ParamWrapper.__name__
    return DirectWrapper


def save_adapter(peft_model: Any, out: str, state_dict: dict | None = None) -> None:
    """The adapter alone (adapter_config.json + adapter_model.safetensors): PEFT's
    `PeftModel.from_pretrained(base, out)` puts it back on the base model."""
    peft_model.save_pretrained(out, state_dict=state_dict, safe_serialization=True)


def save_final(
    peft_model: Any, base: str, out: Any, tokenizer: Any, dtype: str, base_name: str | None = None
) -> None:
    """`out` (atomically): the merged model as a plain HF folder, and its adapter in
    `out`/adapter, whose config names its base as `base_name` (model.pretrained as given;
    default `base`, the local folder). Multi-token prediction layers (a DeepSeek-V3
    checkpoint's) go into `out` in the published layout: the trained depths merged, the base's
    other MTP layers unchanged. The merge starts from the base checkpoint `base` reloaded in
    `dtype` with the saved adapter put back on it (:func:`load`), so every run proves its
    adapter loads."""
    from pathlib import Path

    from safetensors.torch import save_file
    from transformers import AutoTokenizer

    from dsflow import safeload
    from dsflow.atomic import atomic_dir
    from dsflow.model.build import write_weights

    biases = {
        name: buf.detach().cpu().clone()
        for name, buf in peft_model.get_base_model().named_buffers()
        if name.endswith(BIAS)
    }
    for config in peft_model.peft_config.values():
        config.base_model_name_or_path = base_name or base
    with atomic_dir(out) as tmp:
        adapter = Path(tmp) / ADAPTER
        save_adapter(peft_model, str(adapter))
        if biases:
            save_file(biases, str(adapter / BIASES))
        model = merged(load(base, adapter, dtype))
        _keep_untrained_mtp(model, base)
        write_weights(model, Path(tmp))
        AutoTokenizer.from_pretrained(tokenizer).save_pretrained(tmp)
        safeload.record_folder(tmp)  # every file's content hash, checked before a load


def _keep_untrained_mtp(model: Any, base: str) -> None:
    """Gives merged `model` every MTP layer the base checkpoint holds: the depths it trained
    (``model.mtp``) as they are, the deeper ones (all, with model.mtp_depth 0) as the base
    holds them, as a LoRA merge leaves every weight the adapters did not reach."""
    from dsflow.model.build import attach_stored_mtp, mtp_layers_stored

    trained = getattr(model, "mtp", None)
    depth = 0 if trained is None else len(trained.layers)
    if mtp_layers_stored(base, model.config.num_hidden_layers) > depth:
        attach_stored_mtp(model, base)
        if trained is not None:
            model.mtp.layers.update(trained.layers)


def trained_mtp_depth(adapter: Any) -> int:
    """How many MTP depths the adapter in folder `adapter` trained: each has an eh_proj
    adapter (MTP_MODULES) under ``mtp.layers.N``."""
    import re
    from pathlib import Path

    from safetensors import safe_open

    with safe_open(str(Path(adapter) / "adapter_model.safetensors"), "pt") as fh:
        found = {re.search(r"\bmtp\.layers\.(\d+)\.", k) for k in fh.keys()}
    return len({m.group(1) for m in found if m})


def load(base: str, adapter: Any, dtype: str | None = None) -> Any:
    """The adapted model: base checkpoint `base` with PEFT's `PeftModel.from_pretrained(base,
    adapter)`, and the routers' balancing biases as the run left them (they are buffers, which
    the balancer moves during LoRA training and PEFT's adapter does not hold). The base's MTP
    layers that the adapter trained are attached first (``model.mtp``), so their adapters load."""
    from pathlib import Path

    from peft import PeftModel
    from safetensors.torch import load_file

    from dsflow.model.build import build_model, load_checkpoint_config

    fresh = build_model(
        load_checkpoint_config(base),
        device_type="cpu",
        pretrained=base,
        dtype=dtype,
        mtp_depth=trained_mtp_depth(adapter),
    )
    biases = Path(adapter) / BIASES
    if biases.exists():
        unexpected = fresh.load_state_dict(load_file(str(biases)), strict=False).unexpected_keys
        if unexpected:
            raise UsageError(
                f"{biases}: {len(unexpected)} router bias(es) this model does not have "
                f"({unexpected[0]}, ...); the adapter was trained on another base"
            )
    return PeftModel.from_pretrained(fresh, adapter)


def merged(peft_model: Any) -> Any:
    """The base model with every adapter added into its weights: a plain transformers model."""
    return peft_model.merge_and_unload()


def _linears(d: dict[str, int]) -> dict[str, list[tuple[int, int, int]]]:
    """Per group, the adapted weights of a model of dims `d` (presets._dims) as (in, out,
    copies): an adapter is rank x (in + out) per copy (a routed expert is one copy of its
    gate/up and down)."""
    H, heads, L = d["H"], d["heads"], d["L"]
    attn = [(H, d["kv_lora"] + d["rope"], L), (d["kv_lora"], heads * (d["nope"] + d["v"]), L)]
    attn.append((heads * d["v"], H, L))
    if d["q_lora"]:
        attn += [(H, d["q_lora"], L), (d["q_lora"], heads * d["qk"], L)]
    else:
        attn.append((H, heads * d["qk"], L))
    dense, mi, moe = d["inter"], d["mi"], d["n_moe"]
    shared = mi * d["shared"]
    return {
        "attention": attn,
        "dense_mlp": [(H, dense, 2 * d["n_dense"]), (dense, H, d["n_dense"])],
        "shared_experts": [(H, shared, 2 * moe), (shared, H, moe)] if shared else [],
        "experts": [(H, 2 * mi, d["E"] * moe), (mi, H, d["E"] * moe)],
    }


def _with_mtp_layers(d: dict[str, int], config: Any, depth: int) -> dict[str, int]:
    """Dims `d` with `depth` MTP modules' decoder layers counted as layers of their kind."""
    from dsflow.model import presets

    moe = sum(presets.mtp_layer_is_moe(config, k) for k in range(1, depth + 1))
    return {
        **d,
        "L": d["L"] + depth,
        "n_moe": d["n_moe"] + moe,
        "n_dense": d["n_dense"] + depth - moe,
    }


def counts(config: Any, lora: dict, mtp_depth: int = 0) -> dict[str, int]:
    """Analytic sizes for the planner: ``adapter``, the trainable parameters (what PEFT
    creates); ``merged``, the base weight elements that parameter adapters replace with
    W + B A in every forward, a copy that the matmul keeps for backward (``merged_layer``: in
    the decoder layer with the most); ``rank_outputs``, per token, the elements of the module
    adapters' A outputs, which each keeps for its B's gradient (``rank_outputs_layer``: in one
    decoder layer). `mtp_depth` MTP modules count as their decoder layers and eh_proj
    adapters (their tokens taken as the main model's)."""
    from dsflow.model import presets

    d = _with_mtp_layers(presets._dims(config), config, mtp_depth)
    shapes = _linears(d)
    adapter, merged = 0, {g: 0 for g, spec in GROUPS.items() if "parameters" in spec}
    rank_outputs = 0
    for group in lora["targets"]:
        for fan_in, fan_out, copies in shapes[group]:
            adapter += lora["rank"] * (fan_in + fan_out) * copies
            if group in merged:
                merged[group] += fan_in * fan_out * copies
            else:
                rank_outputs += lora["rank"] * copies
    moe_layer = (merged["shared_experts"] + merged["experts"]) // max(d["n_moe"], 1)
    dense_layer = merged["dense_mlp"] // max(d["n_dense"], 1)
    rank_outputs_layer = rank_outputs // d["L"]
    # Each depth's eh_proj (MTP_MODULES, 2H -> H): a module adapter beside its decoder layer.
    adapter += lora["rank"] * 3 * d["H"] * mtp_depth
    rank_outputs += lora["rank"] * mtp_depth
    return {
        "adapter": adapter,
        "merged": sum(merged.values()),
        "merged_layer": max(moe_layer, dense_layer),
        "rank_outputs": rank_outputs,
        "rank_outputs_layer": rank_outputs_layer,
    }


def trainable_summary(model: Any) -> str:
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    return f"{trainable:,} trainable of {total:,} parameters ({trainable / max(total, 1):.2%})"
