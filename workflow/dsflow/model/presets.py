"""Model presets and configs of the two DeepSeek families (MLA + DeepSeekMoE) HF transformers
builds: ``deepseek_v3`` (``DeepseekV3ForCausalLM``: sigmoid router scores with a routing bias)
and ``deepseek_v2`` (``DeepseekV2ForCausalLM``: softmax router scores, greedy or group-limited
greedy top-k, no bias).

Everything here is about the *shape* of the model: the presets, the analytic parameter
counts (no instantiation, so the published 671B shape can be counted on a laptop), and the
HF config of a preset. Building the model lives in :mod:`dsflow.model.build`, training FLOPs
in :mod:`dsflow.model.flops`, expert load balancing in :mod:`dsflow.model.balance`.
"""

from __future__ import annotations

import copy
import dataclasses
import operator
from typing import Any

from dsflow.errors import UsageError

# Keys of a PRESETS entry that are not config kwargs ("model_type": the family, default V3).
_META_KEYS = ("description", "published_vocab_size", "model_type")

# The families, by config.json's model_type.
FAMILIES = ("deepseek_v3", "deepseek_v2")
# DeepSeek-V2's config.json keys that HF's DeepseekV2Config does not declare but keeps (as
# extra attributes, saved again by save_pretrained): its balance loss, which dsflow trains with
# (dsflow.model.balance, which has their defaults).
V2_BALANCE_KEYS = ("aux_loss_alpha", "seq_aux")
# Top-k methods HF's DeepseekV2TopkRouter implements.
V2_TOPK_METHODS = ("greedy", "group_limited_greedy")

# YaRN long-context RoPE of the published DeepSeek-V2/V3 checkpoints (4K -> 160K).
_YARN_V3 = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 40.0,
    "original_max_position_embeddings": 4096,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
}
_YARN_V2 = {**_YARN_V3, "mscale": 0.707, "mscale_all_dim": 0.707}

# Each preset: config kwargs (vocab_size excluded: it comes from the tokenizer) plus
# "description", "model_type" when not deepseek_v3, and, for the published shapes,
# "published_vocab_size". No preset builds the multi-token-prediction (MTP) modules
# (num_mtp_layers=0; HF builds none in any case): model.mtp_depth does (dsflow.model.mtp).
PRESETS: dict[str, dict[str, Any]] = {
    "tiny": {
        "description": "CPU tests: 0.6M params + 2 x vocab x 128, 4 layers (1 dense + 3 MoE), 8 experts top-2",
        "hidden_size": 128,
        "intermediate_size": 384,
        "moe_intermediate_size": 64,
        "num_hidden_layers": 4,
        "first_k_dense_replace": 1,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "q_lora_rank": None,
        "kv_lora_rank": 32,
        "qk_nope_head_dim": 32,
        "qk_rope_head_dim": 16,
        "v_head_dim": 32,
        "n_routed_experts": 8,
        "num_experts_per_tok": 2,
        "n_shared_experts": 1,
        "n_group": 1,
        "topk_group": 1,
        "routed_scaling_factor": 1.0,
        "norm_topk_prob": True,
        "max_position_embeddings": 512,
        "num_mtp_layers": 0,
    },
    # Counts at a 50,257-token (GPT-2) vocabulary: 700M total, 148M activated (DeepSeek
    # convention: lm_head in, input embedding out; 187M with it). AdamW in mixed precision
    # needs ~16 B/param = 11.2 GB for weights + grads + fp32 master/moments: fits one 24 GB GPU
    # with room for activations (comfortably one 40/80 GB GPU).
    "small": {
        "description": "one GPU: ~150M activated / ~700M total (50K vocab), 16 layers, 64 experts top-6",
        "hidden_size": 768,
        "intermediate_size": 2048,
        "moe_intermediate_size": 256,
        "num_hidden_layers": 16,
        "first_k_dense_replace": 1,
        "num_attention_heads": 12,
        "num_key_value_heads": 12,
        "q_lora_rank": None,
        "kv_lora_rank": 256,
        "qk_nope_head_dim": 64,
        "qk_rope_head_dim": 32,
        "v_head_dim": 64,
        "n_routed_experts": 64,
        "num_experts_per_tok": 6,
        "n_shared_experts": 2,
        "n_group": 1,
        "topk_group": 1,
        "routed_scaling_factor": 1.0,
        "norm_topk_prob": True,
        "max_position_embeddings": 4096,
        "num_mtp_layers": 0,
    },
    # ZeRO-2 on 3 x 24 GB with bf16/fp16 + AdamW: every GPU keeps the full 16-bit weights
    # (2 B/param); 16-bit grads (2 B/param) and fp32 master + 2 Adam moments (12 B/param) are
    # sharded over the 3 GPUs -> 2 + 14/3 = 6.67 B/param per GPU. At 50,257 vocab this preset
    # is 1.13B total (225M activated): 1.13e9 * 6.67 B = 7.5 GB per GPU, leaving ~16 GB of the
    # 24 GB for activations, DeepSpeed's reduce/all-gather buckets and the CUDA context.
    # (Plain DDP at 16 B/param would need 18 GB before activations.) A 128K vocab adds 2 x 131M.
    "medium": {
        "description": "ZeRO-2 on 3x24 GB: ~1.13B total / ~225M activated (50K vocab), 16 layers",
        "hidden_size": 1024,
        "intermediate_size": 2816,
        "moe_intermediate_size": 320,
        "num_hidden_layers": 16,
        "first_k_dense_replace": 1,
        "num_attention_heads": 16,
        "num_key_value_heads": 16,
        "q_lora_rank": 384,
        "kv_lora_rank": 256,
        "qk_nope_head_dim": 64,
        "qk_rope_head_dim": 32,
        "v_head_dim": 64,
        "n_routed_experts": 64,
        "num_experts_per_tok": 6,
        "n_shared_experts": 2,
        "n_group": 1,
        "topk_group": 1,
        "routed_scaling_factor": 1.0,
        "norm_topk_prob": True,
        "max_position_embeddings": 4096,
        "num_mtp_layers": 0,
    },
    # Published shapes (HF config.json of deepseek-ai/DeepSeek-V2-Lite, DeepSeek-V2, DeepSeek-V3).
    # DeepSeek-V2(-Lite) route with softmax scores, greedy / group-limited greedy top-k, top-k
    # weights not normalised, and train with the sequence-wise balance loss (aux_loss_alpha).
    "deepseek-v2-lite": {
        "description": "published DeepSeek-V2-Lite shape: 15.7B total / 2.4B activated",
        "model_type": "deepseek_v2",
        "published_vocab_size": 102400,
        "hidden_size": 2048,
        "intermediate_size": 10944,
        "moe_intermediate_size": 1408,
        "num_hidden_layers": 27,
        "first_k_dense_replace": 1,
        "num_attention_heads": 16,
        "num_key_value_heads": 16,
        "q_lora_rank": None,
        "kv_lora_rank": 512,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "n_routed_experts": 64,
        "num_experts_per_tok": 6,
        "n_shared_experts": 2,
        "n_group": 1,
        "topk_group": 1,
        "topk_method": "greedy",
        "routed_scaling_factor": 1.0,
        "norm_topk_prob": False,
        "aux_loss_alpha": 0.001,
        "seq_aux": True,
        "max_position_embeddings": 163840,
        "rope_parameters": _YARN_V2,
    },
    "deepseek-v2": {
        "description": "published DeepSeek-V2 shape: 236B total / 21B activated",
        "model_type": "deepseek_v2",
        "published_vocab_size": 102400,
        "hidden_size": 5120,
        "intermediate_size": 12288,
        "moe_intermediate_size": 1536,
        "num_hidden_layers": 60,
        "first_k_dense_replace": 1,
        "num_attention_heads": 128,
        "num_key_value_heads": 128,
        "q_lora_rank": 1536,
        "kv_lora_rank": 512,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "n_routed_experts": 160,
        "num_experts_per_tok": 6,
        "n_shared_experts": 2,
        "n_group": 8,
        "topk_group": 3,
        "topk_method": "group_limited_greedy",
        "routed_scaling_factor": 16.0,
        "norm_topk_prob": False,
        "aux_loss_alpha": 0.001,
        "seq_aux": True,
        "max_position_embeddings": 163840,
        "rope_parameters": _YARN_V2,
    },
    # moonshotai/Moonlight-16B-A3B's config.json: the DeepSeek-V3 architecture (sigmoid routing
    # with the correction bias) at DeepSeek-V2-Lite's widths, a 163,840-token vocabulary.
    "moonlight-16b-a3b": {
        "description": "published Moonlight-16B-A3B shape (DeepSeek-V3 architecture): 16.0B total / 2.2B activated non-embedding",
        "published_vocab_size": 163840,
        "hidden_size": 2048,
        "intermediate_size": 11264,
        "moe_intermediate_size": 1408,
        "num_hidden_layers": 27,
        "first_k_dense_replace": 1,
        "num_attention_heads": 16,
        "num_key_value_heads": 16,
        "q_lora_rank": None,
        "kv_lora_rank": 512,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "n_routed_experts": 64,
        "num_experts_per_tok": 6,
        "n_shared_experts": 2,
        "n_group": 1,
        "topk_group": 1,
        "routed_scaling_factor": 2.446,
        "norm_topk_prob": True,
        "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-5,
        "rope_parameters": {"rope_type": "default", "rope_theta": 50000.0},
        "num_mtp_layers": 0,
    },
    "deepseek-v3": {
        "description": "published DeepSeek-V3 shape: 671B total / 37B activated (main model, no MTP module)",
        "published_vocab_size": 129280,
        "hidden_size": 7168,
        "intermediate_size": 18432,
        "moe_intermediate_size": 2048,
        "num_hidden_layers": 61,
        "first_k_dense_replace": 3,
        "num_attention_heads": 128,
        "num_key_value_heads": 128,
        "q_lora_rank": 1536,
        "kv_lora_rank": 512,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "n_routed_experts": 256,
        "num_experts_per_tok": 8,
        "n_shared_experts": 1,
        "n_group": 8,
        "topk_group": 4,
        "routed_scaling_factor": 2.5,
        "norm_topk_prob": True,
        "max_position_embeddings": 163840,
        "rope_parameters": _YARN_V3,
        "num_mtp_layers": 0,
    },
}


def config_class(model_type: str) -> type:
    """The HF config class of a family (``FAMILIES``)."""
    import transformers

    return {
        "deepseek_v3": transformers.DeepseekV3Config,
        "deepseek_v2": transformers.DeepseekV2Config,
    }[model_type]


def preset_model_type(preset: str) -> str:
    return PRESETS[preset].get("model_type", "deepseek_v3")


def config_keys(model_type: str) -> list[str]:
    """The keys a config of the family takes: its HF fields, and V2's balance-loss keys."""
    keys = {f.name for f in dataclasses.fields(config_class(model_type))}
    if model_type == "deepseek_v2":
        keys |= set(V2_BALANCE_KEYS)
    return sorted(keys)


def preset_names() -> list[str]:
    return list(PRESETS)


def model_config(
    preset: str, vocab_size: int, overrides: dict | None = None, **runtime: Any
) -> Any:
    """The HF config of ``preset`` (``DeepseekV3Config`` or ``DeepseekV2Config``, by its
    family) with the tokenizer's ``vocab_size``.

    Precedence: preset < ``runtime`` (what the trainer derives, e.g. token ids, sequence length)
    < ``overrides`` (what the user asked for explicitly). Keys of both must be keys of the
    family's config (:func:`config_keys`); ``vocab_size`` can only be given as the argument.
    """
    if preset not in PRESETS:
        raise UsageError(f"unknown model preset {preset!r}; choose one of: {', '.join(PRESETS)}")
    try:
        vocab = operator.index(vocab_size)  # int, numpy integers
    except TypeError:
        vocab = -1
    if isinstance(vocab_size, bool) or vocab <= 0:
        raise UsageError(f"vocab_size must be a positive integer, got {vocab_size!r}")
    cls = config_class(preset_model_type(preset))
    allowed = [name for name in config_keys(preset_model_type(preset)) if name != "vocab_size"]
    for source, given in (("model override", overrides or {}), ("runtime setting", runtime)):
        unknown = sorted(k for k in given if k not in allowed)
        if unknown:
            hint = " (vocab_size comes from the tokenizer)" if "vocab_size" in unknown else ""
            raise UsageError(
                f"unknown {source} {', '.join(map(repr, unknown))}{hint}; "
                f"allowed {cls.__name__} keys: {', '.join(allowed)}"
            )
    kwargs = {k: copy.deepcopy(v) for k, v in PRESETS[preset].items() if k not in _META_KEYS}
    kwargs.update(copy.deepcopy(runtime))
    kwargs.update(copy.deepcopy(overrides or {}))
    kwargs["vocab_size"] = vocab
    try:
        config = cls(**kwargs)
    except Exception as exc:  # noqa: BLE001 - huggingface_hub's strict dataclass validation
        detail = " ".join(str(exc).split())
        raise UsageError(f"invalid model config for preset {preset!r}: {detail}") from None
    problems = config_problems(config)
    if problems:
        raise UsageError(f"invalid model config for preset {preset!r}: " + "; ".join(problems))
    return config


def config_problems(c: Any) -> list[str]:
    """What HF's model of this config would get wrong: a reshape error mid-forward, or routing
    other than the config says. Empty when the config is sound."""
    heads, kv_heads = c.num_attention_heads, c.num_key_value_heads
    problems = []
    if heads % kv_heads:
        problems.append(
            f"num_attention_heads {heads} not divisible by num_key_value_heads {kv_heads}"
        )
    if c.num_experts_per_tok > c.n_routed_experts:
        problems.append(
            f"num_experts_per_tok {c.num_experts_per_tok} > n_routed_experts {c.n_routed_experts}"
        )
    if c.qk_rope_head_dim % 2:
        problems.append("qk_rope_head_dim must be even")
    if c.model_type == "deepseek_v2":
        return problems + _v2_router_problems(c)
    problems += _group_problems(c)
    if c.n_routed_experts // (c.n_group or 1) < 2:
        problems.append("each expert group needs >= 2 experts (the router takes a top-2 per group)")
    return problems


def _group_problems(c: Any) -> list[str]:
    experts, groups = c.n_routed_experts, c.n_group or 1
    topk, topk_group = c.num_experts_per_tok, c.topk_group or 1
    if experts % groups:
        return [f"n_routed_experts {experts} not divisible by n_group {groups}"]
    if topk_group > groups:
        return [f"topk_group {topk_group} > n_group {groups}"]
    if topk > topk_group * (experts // groups):
        return [f"num_experts_per_tok {topk} > experts in the {topk_group} selected group(s)"]
    return []


def _v2_router_problems(c: Any) -> list[str]:
    """HF's DeepseekV2TopkRouter scores with softmax, implements two top-k methods and never
    normalises the top-k weights (DeepSeek's own code does with norm_topk_prob, and then
    leaves out routed_scaling_factor): a config asking otherwise would train another model."""
    problems = []
    method = c.topk_method
    if method not in V2_TOPK_METHODS:
        problems.append(f"topk_method {method!r} is not one of {', '.join(V2_TOPK_METHODS)}")
    elif method == "group_limited_greedy":
        if not c.n_group or not c.topk_group:
            problems.append("topk_method group_limited_greedy needs n_group and topk_group")
        else:
            problems += _group_problems(c)
    scoring = getattr(c, "scoring_func", "softmax")
    if scoring != "softmax":
        problems.append(f"scoring_func {scoring!r}: the DeepseekV2 router scores with softmax")
    if c.norm_topk_prob and c.num_experts_per_tok > 1:
        problems.append("norm_topk_prob true: the DeepseekV2 router never normalises the top-k")
    alpha = getattr(c, "aux_loss_alpha", 0.0)
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or alpha < 0:
        problems.append(f"aux_loss_alpha {alpha!r} must be a number >= 0")
    if not isinstance(getattr(c, "seq_aux", True), bool):
        problems.append(f"seq_aux {c.seq_aux!r} must be true or false")
    return problems


# --------------------------------------------------------------------------- parameter counts


def _dims(config: Any) -> dict[str, int]:
    L = config.num_hidden_layers
    n_dense = min(config.first_k_dense_replace or 0, L)
    return dict(
        H=config.hidden_size,
        V=config.vocab_size,
        L=L,
        n_dense=n_dense,
        n_moe=L - n_dense,
        heads=config.num_attention_heads,
        qk=config.qk_nope_head_dim + config.qk_rope_head_dim,
        nope=config.qk_nope_head_dim,
        rope=config.qk_rope_head_dim,
        v=config.v_head_dim,
        kv_lora=config.kv_lora_rank,
        q_lora=config.q_lora_rank or 0,
        E=config.n_routed_experts,
        K=config.num_experts_per_tok,
        shared=config.n_shared_experts or 0,
        mi=config.moe_intermediate_size,
        inter=config.intermediate_size,
    )


def _attention_params(config: Any) -> tuple[int, int]:
    """(matmul weights, everything else: norms + biases) of one MLA attention block."""
    d = _dims(config)
    H, heads, bias = d["H"], d["heads"], bool(config.attention_bias)
    matmul, other = 0, 0
    if config.q_lora_rank is None:
        matmul += H * heads * d["qk"]  # q_proj
    else:
        matmul += H * d["q_lora"] + d["q_lora"] * heads * d["qk"]  # q_a_proj, q_b_proj
        other += d["q_lora"] * (2 if bias else 1)  # q_a_layernorm (+ q_a_proj bias)
    matmul += H * (d["kv_lora"] + d["rope"])  # kv_a_proj_with_mqa
    matmul += d["kv_lora"] * heads * (d["nope"] + d["v"])  # kv_b_proj
    matmul += heads * d["v"] * H  # o_proj
    other += d["kv_lora"]  # kv_a_layernorm
    if bias:
        other += d["kv_lora"] + d["rope"] + H  # kv_a_proj_with_mqa and o_proj biases
    return matmul, other


def _breakdown(config: Any) -> dict[str, int]:
    """Per-component parameter counts; ``*_act`` entries are what one token touches."""
    d = _dims(config)
    H, V = d["H"], d["V"]
    attn_mm, attn_other = _attention_params(config)
    expert = 3 * H * d["mi"]  # gate, up (stored fused as gate_up_proj) and down
    tied = bool(getattr(config, "tie_word_embeddings", False))
    # DeepseekV2Config's mlp_bias: biases on the dense MLPs and the shared experts' MLP.
    shared_inter = d["shared"] * d["mi"]
    mlp_biases = d["n_dense"] * (2 * d["inter"] + H) + (d["n_moe"] * (2 * shared_inter + H))
    return dict(
        embedding=V * H,
        lm_head=0 if tied else V * H,
        lm_head_matmul=V * H,  # the logits matmul happens even when tied to the embedding
        attention_matmul=d["L"] * attn_mm,
        attention_other=d["L"] * attn_other,
        mlp_biases=mlp_biases if getattr(config, "mlp_bias", False) else 0,
        layer_norms=d["L"] * 2 * H + H,  # input + post-attention norms, final norm
        dense_mlp=d["n_dense"] * 3 * H * d["inter"],
        shared_experts=d["n_moe"] * d["shared"] * expert,
        routers=d["n_moe"] * d["E"] * H,
        routed_experts=d["n_moe"] * d["E"] * expert,
        routed_experts_act=d["n_moe"] * d["K"] * expert,
    )


def param_counts(config: Any, mtp_depth: int = 0) -> dict[str, int]:
    """Analytic parameter counts of ``DeepseekV3ForCausalLM(config)`` or
    ``DeepseekV2ForCausalLM(config)`` (nothing is instantiated). The two families have the same
    parameters for the same shape: their routers differ in how they score, not in weights.

    - ``total``: ``sum(p.numel() for p in model.parameters())`` exactly (tied weights once; a
      V3 router's ``e_score_correction_bias`` is a buffer, not a parameter, and V2 has none),
      with ``mtp_depth`` multi-token-prediction modules attached (``mtp``: theirs).
    - ``mtp``: :func:`mtp_params`; only ``total`` holds it (DeepSeek's published activated
      counts are the main model's).
    - ``activated``: the parameters one token's forward pass uses, in the convention that
      reproduces DeepSeek's published numbers (V3 37B, V2 21B, V2-Lite 2.4B): every
      attention projection and norm, dense MLPs, shared experts, the top-k routed experts,
      routers, all RMSNorms and the lm_head -- but NOT the input embedding table, which is a
      row lookup, not compute. (Counting the embedding too gives 2.66B for V2-Lite, which
      DeepSeek would have reported as 2.7B; without it 2.45B, published as 2.4B.)
    - ``activated_with_embedding``: ``activated`` + ``embedding``.
    - ``activated_non_embedding``: ``activated`` without the lm_head either (no vocab matrix).
    - ``embedding`` / ``lm_head``: vocab x hidden each; ``lm_head`` is 0 when tied.
    - ``routed_experts``: all routed-expert weights (mostly not activated by a given token).
    """
    b = _breakdown(config)
    common = (
        b["attention_matmul"]
        + b["attention_other"]
        + b["mlp_biases"]
        + b["layer_norms"]
        + b["dense_mlp"]
        + b["shared_experts"]
        + b["routers"]
    )
    mtp = mtp_params(config, mtp_depth)
    total = b["embedding"] + b["lm_head"] + common + b["routed_experts"] + mtp
    activated_non_embedding = common + b["routed_experts_act"]
    # A tied lm_head is the embedding matrix: it is activated (as the output projection).
    head = b["lm_head"] if b["lm_head"] else b["lm_head_matmul"]
    return dict(
        total=total,
        activated=activated_non_embedding + head,
        activated_with_embedding=activated_non_embedding + b["embedding"] + b["lm_head"],
        activated_non_embedding=activated_non_embedding,
        embedding=b["embedding"],
        lm_head=b["lm_head"],
        routed_experts=b["routed_experts"],
        mtp=mtp,
    )


def activated_matmul_params(config: Any) -> int:
    """Weights of the matmuls one token goes through, lm_head included (even when tied to the
    embedding), embedding lookup, norms and biases excluded. Used by :mod:`dsflow.model.flops`."""
    b = _breakdown(config)
    return (
        b["attention_matmul"]
        + b["dense_mlp"]
        + b["shared_experts"]
        + b["routers"]
        + b["routed_experts_act"]
        + b["lm_head_matmul"]
    )


def mtp_layer_is_moe(config: Any, k: int) -> bool:
    """Whether depth `k`'s decoder layer (index num_hidden_layers + k - 1) is an MoE layer, as
    HF's DeepseekV3DecoderLayer decides from its index."""
    return config.num_hidden_layers + k - 1 >= (config.first_k_dense_replace or 0)


def mtp_params(config: Any, depth: int) -> int:
    """Parameters of `depth` multi-token-prediction modules (dsflow.model.mtp): per depth
    enorm, hnorm, shared_head.norm, eh_proj (2H -> H) and one decoder layer. The embedding and
    the lm_head are the main model's; the router's e_score_correction_bias is a buffer."""
    d = _dims(config)
    H = d["H"]
    attn_mm, attn_other = _attention_params(config)
    own = 2 * H * H + 3 * H + attn_mm + attn_other + 2 * H  # + the layer's two norms
    moe = (d["shared"] + d["E"]) * 3 * H * d["mi"] + d["E"] * H
    dense = 3 * H * d["inter"]
    return sum(own + (moe if mtp_layer_is_moe(config, k) else dense) for k in range(1, depth + 1))


def mtp_matmul_params(config: Any) -> int:
    """Weights of the matmuls one token goes through in one multi-token-prediction depth
    (dsflow.model.mtp): eh_proj (2H -> H), an MoE decoder layer's (attention, shared and top-k
    routed experts, router) and the shared lm_head."""
    d = _dims(config)
    H, attn = d["H"], _attention_params(config)[0]
    expert = 3 * H * d["mi"]
    moe = (d["shared"] + d["K"]) * expert + d["E"] * H
    return 2 * H * H + attn + moe + d["V"] * H


def _human(n: float) -> str:
    if n >= 1e9:
        return f"{n / 1e9:.2f}B"
    if n >= 1e6:
        return f"{n / 1e6:.1f}M"
    return f"{n / 1e3:.1f}K"


def routing(config: Any) -> str:
    """How the family's router picks experts, in a few words."""
    if config.model_type == "deepseek_v2":
        method = {"group_limited_greedy": "group-limited greedy"}.get(config.topk_method, "greedy")
        return f"softmax routing, {method} top-k"
    return "sigmoid routing with a balancing bias"


def describe(config: Any) -> str:
    """One-line human summary of the shape and parameter counts."""
    d = _dims(config)
    counts = param_counts(config)
    q = f"q_lora {config.q_lora_rank}" if config.q_lora_rank else "no q_lora"
    return (
        f"{d['L']} layers ({d['n_dense']} dense + {d['n_moe']} MoE), hidden {d['H']}, "
        f"{d['heads']} heads MLA ({q}, kv_lora {d['kv_lora']}), "
        f"{d['E']} routed experts top-{d['K']} + {d['shared']} shared (moe_inter {d['mi']}, "
        f"{routing(config)}), "
        f"vocab {d['V']}: {_human(counts['total'])} total, {_human(counts['activated'])} activated "
        f"({_human(counts['activated_non_embedding'])} non-embedding)"
    )
