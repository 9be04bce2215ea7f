"""Stage `plan`: will this model fit, per GPU, before hours are spent finding out?

Everything is analytic (nothing is instantiated), from the model shape (:mod:`dsflow.model`),
the batch and the DeepSpeed ZeRO layout, and follows what DeepSpeed 0.19 and HF transformers 5
actually allocate:

Model states (``P`` parameters, ``N`` data-parallel ranks, 16-bit = bf16/fp16):

- weights: 2 B/param in 16-bit (4 in fp32), a full copy on every GPU below ZeRO-3, ``1/N`` at
  ZeRO-3, none on the GPU with ZeRO-3 parameter offload.
- gradients: 2 B/param (4 in fp32), full at ZeRO-0/1, ``1/N`` from ZeRO-2 on, on the host with
  optimizer offload at ZeRO-2/3.
- optimizer: fp32 master weights + Adam m and v = 12 B/param under mixed precision, replicated at
  ZeRO-0 and ``1/N`` from ZeRO-1 on. In fp32 training the master *is* the weights (8 B/param) at
  ZeRO-0 and ZeRO-3, but DeepSpeed's ZeRO-1/2 optimizer clones its partition anyway
  (``stage_1_and_2.py``: ``single_partition_of_fp32_groups``), so 12 B/param there too.
- fp32 gradients during ``optimizer.step()``: DeepSpeed converts this rank's gradient partition
  to fp32 before Adam runs (4 B/param x ``1/N``; the full model at ZeRO-0; at ZeRO-3 one
  ``sub_group_size`` = 1e9 elements at a time). That copy only exists inside the step, after the
  activations are freed, so the peak is ``states + max(forward/backward set, step set)``.
  DeepSpeed's own estimators (``estimate_zero2_model_states_mem_needs``: ``2P + 18P/N``) add it
  to the steady state; ``model_states`` here is the same sum, so the two compare directly.

Activations: what autograd keeps for backward in HF's ``DeepseekV3ForCausalLM`` with SDPA
attention and the ``grouped_mm`` experts kernel (CUDA), per token, ``a`` = 2 bytes (4 in fp32).
(The sorted experts, the CUDA default since the sixth session, keep a little less: on one H200
the medium MoE peaked at 32.8 GB with them against 33.1 GB with HF's, at ZeRO-1.)

- RMSNorm upcasts: it saves an fp32 copy of its input and the normalized 16-bit tensor
  (``(4 + a) x width``), its consumer saves the output (``a x width``).
- MLA: the attention input, the q_lora / kv_lora compressed latents through their norms, the
  query and key states (``heads x (nope + rope)``), the kv_b_proj output that the value view keeps
  alive (``heads x (nope + v)``), the attention output twice (SDPA's own + the contiguous copy
  o_proj saves) and SDPA's fp32 logsumexp per head. SDPA's flash / memory-efficient kernels store
  no seq x seq matrix (eager attention would add ``heads x seq^2`` per sequence per layer).
- MoE: the router's fp32 input copy and sigmoid scores (+ the balancer's sequence-wise aux loss
  scores), and per (token, top-k expert) pair the gathered input, the fused gate_up output, the
  SiLU output, the gated product, the down-projection output, the routing weight and three int64
  permutation indices; the shared experts and dense MLPs save 4 x intermediate each.
- The head: the final norm, then the logits: dsflow computes the loss in fp32
  (``F.cross_entropy(logits.float())``), so log_softmax keeps an fp32 ``vocab``-wide row per
  token and backward briefly holds three of them (saved output, incoming grad, outgoing grad):
  ``12 x vocab`` bytes per token, often the single largest activation.
- With activation checkpointing (HF ``gradient_checkpointing_enable``, per decoder layer) only
  each layer's input stays (``a x hidden`` per token per layer); backward recomputes one layer at
  a time.

Plus DeepSpeed's communication buckets, ZeRO-3's gathered module, and
:data:`FRAMEWORK_OVERHEAD`. The estimate is a model, not a measurement: it is meant to be within
~10-15 % of ``torch.cuda.max_memory_reserved()``; a GPU run will calibrate it.

Sizes print in GB = 10^9 bytes. ``--gpu-mem 24`` means 24e9 bytes: a "24 GB" RTX 4090 reports
24564 MiB (25.76e9 bytes), so the flag is slightly conservative.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dsflow.errors import UsageError
from dsflow.paths import PLAN, shard_index

GB = 10**9

# --------------------------------------------------------------------------- constants


@dataclass(frozen=True)
class Overhead:
    """Memory that is not tensors of the model: see :data:`FRAMEWORK_OVERHEAD`."""

    gpu_fixed_bytes: int
    gpu_fraction: float
    host_per_rank_bytes: int


# The one framework-overhead constant.
# - gpu_fixed_bytes, 1 GiB: the CUDA context (~0.3-0.6 GB with lazy module loading on
#   Ampere/Ada/Hopper drivers), cuBLAS/cuBLASLt workspaces (torch's default
#   CUBLAS_WORKSPACE_CONFIG, tens of MB per stream), NCCL communicators (NCCL_BUFFSIZE 4 MiB per
#   channel and peer for each of DeepSpeed's process groups: ~0.1-0.4 GB), DeepSpeed's fused-op
#   kernels. 0.8-1.2 GB is what nvidia-smi shows for an idle torch + NCCL process.
# - gpu_fraction, 8 %: the caching allocator's fragmentation (memory_reserved over
#   memory_allocated), typically 5-10 % in training loops with variable-size MoE dispatch
#   buffers; applied to everything allocated.
# - host_per_rank_bytes, 2 GB: resident size of one rank's Python + torch + transformers +
#   DeepSpeed process (CUDA libraries mapped), before any model tensor.
FRAMEWORK_OVERHEAD = Overhead(gpu_fixed_bytes=2**30, gpu_fraction=0.08, host_per_rank_bytes=2 * GB)

# DeepSpeed 0.19 defaults that dsflow's generated config does not set.
DS_ALLREDUCE_BUCKET = 500_000_000  # ZeRO-0 gradient all-reduce bucket (allreduce_bucket_size)
DS_STAGE3_PREFETCH_BUCKET = 50_000_000  # stage3_prefetch_bucket_size (16-bit elements)
DS_SUB_GROUP_SIZE = 1_000_000_000  # ZeRO-3 optimizer sub-group (fp32 gradient copy at step)

DEFAULT_BUCKETS = (200_000_000, 200_000_000)  # train.zero.{reduce,allgather}_bucket_size
DEFAULT_VOCAB = 32000

# Total memory of a GPU by flops.GPU_PEAK_TFLOPS key (nvidia-smi's "Total" as commonly reported,
# in bytes; not verified on every card here), for planning a machine that is not this one.
# A visible GPU's own torch.cuda.get_device_properties().total_memory and --gpu-mem win.
GPU_MEMORY_BYTES: dict[str, int] = {
    "B200": 183_359 * 2**20,
    "H200 SXM": 143_771 * 2**20,
    "H200 NVL": 143_771 * 2**20,
    "H100 SXM": 81_559 * 2**20,
    "H100 NVL": 95_830 * 2**20,
    "H100 PCIe": 81_559 * 2**20,
    "A100": 81_920 * 2**20,  # the 80 GB model; pass --gpu-mem 40 for the 40 GB one
    "L40S": 46_068 * 2**20,
    "L40": 46_068 * 2**20,
    "L4": 23_034 * 2**20,
    "A10": 23_028 * 2**20,
    "A10G": 23_028 * 2**20,
    "RTX 4090": 24_564 * 2**20,
    "RTX 3090": 24_576 * 2**20,
}
# Profile file names (profiles/*.yaml) that name a GPU: substring -> GPU_MEMORY_BYTES key.
PROFILE_GPUS = (
    ("4090", "RTX 4090"),
    ("3090", "RTX 3090"),
    ("h200", "H200 SXM"),
    ("h100", "H100 SXM"),
    ("a100", "A100"),
    ("b200", "B200"),
    ("l40s", "L40S"),
)


def _gb(n: float) -> float:
    return round(n / GB, 2)


def _fmt_gb(n: float) -> str:
    return f"{n / GB:,.1f} GB"


# --------------------------------------------------------------------------- shapes


def _dims(config: Any) -> dict[str, int]:
    from dsflow.model.presets import _dims as model_dims

    return model_dims(config)


def largest_module(config: Any) -> tuple[int, str, int, str]:
    """(params, name) of the module with the most *direct* parameters, and (numel, name) of the
    largest single parameter, of ``DeepseekV3ForCausalLM(config)``.

    "Module" in DeepSpeed's sense (``estimate_zero3_model_states_mem_needs_all_live``: each
    module's ``parameters(recurse=False)``): ZeRO-3 gathers one module's parameters at a time.
    HF stores a layer's routed experts as two fused 3-D tensors in ONE module, so at ZeRO-3 the
    whole expert bank of a layer is gathered on every GPU at once.
    """
    d = _dims(config)
    H, V, heads = d["H"], d["V"], d["heads"]
    bias = bool(getattr(config, "attention_bias", False))
    tied = bool(getattr(config, "tie_word_embeddings", False))
    modules: list[tuple[int, str]] = [(V * H, "embed_tokens")]
    params: list[tuple[int, str]] = [(V * H, "embed_tokens.weight")]
    if not tied:
        modules.append((V * H, "lm_head"))
    if config.q_lora_rank is None:
        modules.append((H * heads * d["qk"], "self_attn.q_proj"))
    else:
        modules.append((H * d["q_lora"] + (d["q_lora"] if bias else 0), "self_attn.q_a_proj"))
        modules.append((d["q_lora"] * heads * d["qk"], "self_attn.q_b_proj"))
    kv_a = H * (d["kv_lora"] + d["rope"]) + ((d["kv_lora"] + d["rope"]) if bias else 0)
    modules.append((kv_a, "self_attn.kv_a_proj_with_mqa"))
    modules.append((d["kv_lora"] * heads * (d["nope"] + d["v"]), "self_attn.kv_b_proj"))
    modules.append((heads * d["v"] * H + (H if bias else 0), "self_attn.o_proj"))
    params.extend(modules[1:])  # attention modules hold one weight each (+ a small bias)
    if d["n_dense"]:
        modules.append((H * d["inter"], "mlp.gate_proj (dense)"))
        params.append((H * d["inter"], "mlp.gate_proj.weight (dense)"))
    if d["n_moe"]:
        E, mi = d["E"], d["mi"]
        modules.append((E * 3 * H * mi, f"mlp.experts ({E} routed experts, fused)"))
        params.append((E * 2 * mi * H, "mlp.experts.gate_up_proj"))
        modules.append((E * H, "mlp.gate (router)"))
        if d["shared"]:
            modules.append((H * mi * d["shared"], "mlp.shared_experts.gate_proj"))
    best_module = max(modules, key=lambda m: (m[0], m[1]))
    best_param = max(params, key=lambda m: (m[0], m[1]))
    return best_module[0], best_module[1], best_param[0], best_param[1]


def _act_bytes(precision: str) -> int:
    if precision not in ("bf16", "fp16", "fp32"):
        raise ValueError(f"precision must be bf16, fp16 or fp32, got {precision!r}")
    return 4 if precision == "fp32" else 2


def activation_bytes(
    config: Any,
    *,
    seq_len: int,
    micro_batch: int,
    precision: str,
    seq_aux: bool = True,
) -> dict[str, Any]:
    """Activation memory of one micro batch, without and with activation checkpointing.

    ``saved_*`` is what autograd keeps between forward and backward (what
    ``torch.autograd.graph.saved_tensors_hooks`` sees, parameters excluded); ``peak_*`` adds the
    transient peak on top (the fp32 logits in backward, or one recomputed layer).
    """
    d = _dims(config)
    a = _act_bytes(precision)
    T = micro_batch * seq_len
    H, V, heads, K, E = d["H"], d["V"], d["heads"], d["K"], d["E"]

    def norm(
        width: int,
    ) -> int:  # fp32 input copy + normalized 16-bit; the output is the consumer's
        return (4 + a) * width

    q = (norm(d["q_lora"]) + a * d["q_lora"]) if config.q_lora_rank else 0
    attention = (
        a * H  # input of q/kv_a projections (the norm output)
        + q  # q_a_layernorm + q_b_proj input
        + norm(d["kv_lora"])
        + a * d["kv_lora"]  # kv_a_layernorm + kv_b_proj input
        + 2 * a * heads * d["qk"]  # query and key states (SDPA inputs)
        + a * heads * (d["nope"] + d["v"])  # kv_b_proj output, kept alive by the value view
        + 2 * a * heads * d["v"]  # SDPA output + the contiguous copy o_proj saves
        + 4 * heads  # SDPA logsumexp (fp32)
    )
    input_norm = norm(H)
    post_norm = norm(H) + a * H
    dense_mlp = post_norm + 4 * a * d["inter"]
    router = (
        (4 * H if a < 4 else 0)  # fp32 copy of the router input
        + 4 * E  # sigmoid scores
        + (4 * E if seq_aux else 0)  # the balancer's sequence-wise aux-loss scores
        + E  # group mask (bool)
        + 24 * K  # top-k indices, weights, normalisation
    )
    routed = K * (a * (2 * H + 4 * d["mi"]) + 4 + 24)
    shared = 4 * a * d["mi"] * d["shared"]
    moe_mlp = post_norm + router + routed + shared
    per_tok_dense = input_norm + attention + dense_mlp
    per_tok_moe = input_norm + attention + moe_mlp
    rope_per_layer = a * d["rope"] * seq_len  # cos/sin in the activation dtype, per position
    router_weight = 4 * E * H if a < 4 else 0  # fp32 copy of the router weight, per MoE layer
    layer_dense = per_tok_dense * T + rope_per_layer
    layer_moe = per_tok_moe * T + rope_per_layer + router_weight
    layers = d["n_dense"] * layer_dense + d["n_moe"] * layer_moe
    embed = 24 * T + 8 * d["rope"] * seq_len  # ids, targets, embedding indices; fp32 cos/sin
    head = (norm(H) + a * H) * T  # final norm + lm_head input
    logits_saved = 4 * V * T  # fp32 log_softmax output
    logits_peak = 12 * V * T  # backward: saved output + grad in + grad out, all fp32
    # grouped_mm: routing-weighted expert outputs are fp32 (bf16 x fp32 scores) and are
    # un-permuted into a second fp32 copy: transient, one layer at a time (backward: their grads).
    moe_transient = (8 * H * K * T) if d["n_moe"] else 0
    largest_layer = max(layer_dense if d["n_dense"] else 0, layer_moe if d["n_moe"] else 0)

    saved_full = embed + layers + head + logits_saved
    peak_full = embed + layers + head + max(logits_peak, moe_transient)
    ckpt_inputs = d["L"] * a * H * T  # each checkpointed layer keeps its input only
    saved_ckpt = embed + ckpt_inputs + head + logits_saved
    peak_ckpt = embed + ckpt_inputs + head + max(logits_peak, largest_layer + moe_transient)
    return {
        "tokens": T,
        "bytes_per_element": a,
        "per_token_dense_layer": per_tok_dense,
        "per_token_moe_layer": per_tok_moe,
        "per_token_attention": attention,
        "per_token_moe_mlp": moe_mlp,
        "layer_dense": layer_dense,
        "layer_moe": layer_moe,
        "layers": layers,
        "embedding": embed,
        "head": head,
        "logits_saved": logits_saved,
        "logits_peak": logits_peak,
        "moe_transient": moe_transient,
        "checkpointed_inputs": ckpt_inputs,
        "saved_no_checkpointing": saved_full,
        "saved_checkpointing": saved_ckpt,
        "peak_no_checkpointing": peak_full,
        "peak_checkpointing": peak_ckpt,
    }


# --------------------------------------------------------------------------- estimate


def _ceil_div(n: int, k: int) -> int:
    return -(-n // k)


def estimate(
    config: Any,
    *,
    seq_len: int,
    micro_batch: int,
    world: int,
    zero_stage: int,
    precision: str,
    offload_optimizer: bool = False,
    offload_params: bool = False,
    activation_checkpointing: bool = False,
    bucket_sizes: tuple[int, int] = DEFAULT_BUCKETS,
    overlap_comm: bool = True,
    seq_aux: bool = True,
    fused_optimizer: bool = False,
) -> dict[str, Any]:
    """Per-GPU (and host) bytes of training ``config`` with these settings; see the module doc.

    ``fused_optimizer``: train.perf.optimizer fused (dsflow.train.masteradam, ZeRO-0 bf16), which
    makes no fp32 gradient copies; DeepSpeed sees an fp32 model, so its all-reduce buckets hold
    the flattened bf16 gradients and an fp32 copy of them.

    ``bucket_sizes`` = (``reduce_bucket_size``, ``allgather_bucket_size``) in elements.
    ``gpu.total`` is the predicted peak (``max_memory_reserved`` + the fixed overhead).
    """
    from dsflow.model.presets import param_counts

    if zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"zero_stage must be 0..3, got {zero_stage!r}")
    if world < 1 or micro_batch < 1 or seq_len < 1:
        raise ValueError("world, micro_batch and seq_len must be >= 1")
    if offload_optimizer and zero_stage == 0:
        raise ValueError("optimizer offload needs ZeRO stage >= 1")
    if offload_params and zero_stage != 3:
        raise ValueError("parameter offload needs ZeRO-3")
    P = param_counts(config)["total"]
    N = world
    w = _act_bytes(precision)  # weight and gradient bytes
    fp32 = precision == "fp32"
    part = _ceil_div(P, N)  # this rank's partition
    big_module, big_module_name, big_param, big_param_name = largest_module(config)
    reduce_bucket, allgather_bucket = (int(b) for b in bucket_sizes)

    # ---- model states
    if zero_stage == 3:
        weights = 0 if offload_params else w * part
    else:
        weights = w * P
    if zero_stage <= 1:
        grads = w * P
    else:
        grads = 0 if offload_optimizer else w * part
    if fp32 and zero_stage in (0, 3):
        master = 0  # the optimizer updates the (fp32) weights themselves
    else:
        master = 4 * (P if zero_stage == 0 else part)
    adam = 8 * (P if zero_stage == 0 else part)
    fused = fused_optimizer and zero_stage == 0 and precision == "bf16"
    if zero_stage == 0:
        # FP16_Optimizer's fp32 flat gradients; the fused optimizer reads the 16-bit ones.
        grads_fp32 = 0 if fp32 or fused else 4 * P
    elif zero_stage == 3:
        grads_fp32 = 4 * min(part, DS_SUB_GROUP_SIZE)
    else:
        grads_fp32 = 4 * part
    host_optimizer = host_grads = host_params = 0
    if offload_optimizer:
        # On the host: the fp32 master + Adam partitions, an fp32 gradient partition for the CPU
        # optimizer, and a pinned 16-bit staging buffer (ZeRO-1/2: of the updated weights,
        # stage_1_and_2's param_buffer_of_bit16_for_cpu_offload_groups; ZeRO-3: of the
        # gradients, stage3's grad_partitions_flat_buffer).
        host_optimizer = master + adam
        host_grads = 4 * part + (w * part if zero_stage == 3 else 0)
        if zero_stage in (1, 2):
            host_params += w * part
        master = adam = grads_fp32 = 0
    if offload_params:
        host_params += w * part
    optimizer = master + adam

    # ---- working sets
    acts = activation_bytes(
        config, seq_len=seq_len, micro_batch=micro_batch, precision=precision, seq_aux=seq_aux
    )
    activations = acts[
        "peak_checkpointing" if activation_checkpointing else "peak_no_checkpointing"
    ]
    if zero_stage == 0:
        # fused: DeepSpeed flattens the bf16 gradients, then all-reduces an fp32 copy
        buckets = (w + 4 if fused else w) * min(P, DS_ALLREDUCE_BUCKET) if N > 1 else 0
    elif zero_stage in (1, 2):
        # reduce buckets (double-buffered with overlap_comm); the updated partitions are
        # all-gathered in place into the flat 16-bit buffer, so allgather_bucket costs nothing.
        buckets = w * reduce_bucket * (2 if overlap_comm else 1)
    else:
        buckets = w * reduce_bucket + w * DS_STAGE3_PREFETCH_BUCKET
    # ZeRO-2 grads arrive whole per parameter before being copied into a bucket and freed;
    # ZeRO-3 gathers a module's parameters and receives its gradient whole.
    grad_transient = w * big_param if zero_stage == 2 else 0
    gathered = 2 * w * big_module if zero_stage == 3 else 0
    persistent = weights + grads + optimizer
    fwd_bwd = activations + buckets + grad_transient + gathered
    step = grads_fp32
    allocated = persistent + max(fwd_bwd, step)
    oh = FRAMEWORK_OVERHEAD
    overhead = oh.gpu_fixed_bytes + int(oh.gpu_fraction * allocated)
    total = allocated + overhead

    # ---- host: every rank builds the model in fp32 on CPU (dsflow.model.build_model) before
    # DeepSpeed casts it and moves it to the GPU; offloaded states replace it afterwards.
    init_per_rank = 4 * P
    offload_per_rank = host_optimizer + host_grads + host_params
    host_per_rank = max(init_per_rank, offload_per_rank) + oh.host_per_rank_bytes
    gpu = {
        "weights": weights,
        "gradients": grads,
        "optimizer": optimizer,
        "gradients_fp32_step": grads_fp32,
        "model_states": weights + grads + optimizer + grads_fp32,
        "activations": activations,
        "buckets": buckets,
        "grad_transient": grad_transient,
        "zero3_gathered": gathered,
        "overhead": overhead,
        "allocated": allocated,
        "total": total,
    }
    return {
        "inputs": {
            "seq_len": seq_len,
            "micro_batch": micro_batch,
            "world": world,
            "zero_stage": zero_stage,
            "precision": precision,
            "offload_optimizer": bool(offload_optimizer),
            "offload_params": bool(offload_params),
            "activation_checkpointing": bool(activation_checkpointing),
            "bucket_sizes": [reduce_bucket, allgather_bucket],
            "overlap_comm": bool(overlap_comm),
            "seq_aux": bool(seq_aux),
            "fused_optimizer": bool(fused),
            "vocab_size": int(config.vocab_size),
        },
        "params": {
            "total": P,
            "largest_module": big_module,
            "largest_module_name": big_module_name,
            "largest_param": big_param,
            "largest_param_name": big_param_name,
        },
        "gpu": gpu,
        "peak_phase": "optimizer step" if step > fwd_bwd else "forward/backward",
        "activations": acts,
        "host": {
            "optimizer": host_optimizer,
            "gradients": host_grads,
            "parameters": host_params,
            "init_per_rank": init_per_rank,
            "per_rank": host_per_rank,
            "node_total": host_per_rank * N,
        },
    }


# --------------------------------------------------------------------------- verdicts


def _explain(est: dict, item: str) -> str:
    inp = est["inputs"]
    s, n = inp["zero_stage"], inp["world"]
    dtype = "fp32" if inp["precision"] == "fp32" else "16-bit"
    acts = est["activations"]
    if item == "weights":
        if s < 3:
            return (
                f"ZeRO-{s} keeps a full {dtype} copy of the weights on every GPU; "
                f"ZeRO-3 partitions them over the {n} GPU(s)"
            )
        return f"ZeRO-3 keeps 1/{n} of them per GPU; parameter offload moves them to host RAM"
    if item == "gradients":
        if s < 2:
            return f"ZeRO-{s} keeps full gradients on every GPU; ZeRO-2 partitions them"
        return f"1/{n} of the gradients per GPU"
    if item == "optimizer":
        where = (
            "replicated at ZeRO-0; ZeRO-1+ partitions them"
            if s == 0
            else f"1/{n} per GPU; optimizer offload moves them to host RAM"
        )
        return f"fp32 master weights + Adam m and v, {where}"
    if item == "activations":
        return (
            f"activations of micro batch {inp['micro_batch']} x {inp['seq_len']} tokens "
            f"(the fp32 logits/cross-entropy peak alone {_fmt_gb(acts['logits_peak'])}); "
            "activation checkpointing or a smaller micro batch shrinks them"
        )
    if item == "zero3_gathered":
        p = est["params"]
        return (
            f"ZeRO-3 gathers the largest module whole on every GPU with its gradient: "
            f"{p['largest_module_name']}, {p['largest_module'] / 1e9:.2f}B params"
        )
    if item == "gradients_fp32_step":
        return "DeepSpeed's fp32 copy of this rank's gradients during optimizer.step()"
    return item


_ITEM_NAMES = {
    "weights": "{dtype} weights",
    "gradients": "gradients",
    "optimizer": "optimizer states",
    "activations": "activations",
    "zero3_gathered": "ZeRO-3 gathered module",
    "gradients_fp32_step": "fp32 step gradients",
}


def _blocker(est: dict, gpu_mem_bytes: int) -> str:
    """The item to explain: a replicated one (more GPUs would not help) that alone exceeds the
    GPU, else the largest."""
    gpu, stage = est["gpu"], est["inputs"]["zero_stage"]
    replicated = (
        ["weights"] * (stage < 3) + ["gradients"] * (stage < 2) + ["optimizer"] * (stage < 1)
    )
    for item in replicated:
        if gpu[item] > gpu_mem_bytes:
            return item
    return max(_ITEM_NAMES, key=lambda k: (gpu[k], k))


def verdict(
    estimate: dict, gpu_mem_bytes: int, host_mem_bytes: int | None = None
) -> tuple[bool, str]:
    """(fits, one-line reason with the numbers). ``host_mem_bytes`` (optional) also checks the
    host RAM the offloaded states and the per-rank fp32 model build need."""
    gpu = estimate["gpu"]
    need = gpu["total"]
    dtype = "fp32" if estimate["inputs"]["precision"] == "fp32" else "16-bit"
    if need > gpu_mem_bytes:
        item = _blocker(estimate, gpu_mem_bytes)
        name = _ITEM_NAMES[item].format(dtype=dtype)
        alone = " alone" if gpu[item] > gpu_mem_bytes else ""
        others = sorted(
            (k for k in _ITEM_NAMES if k != item and gpu[k] > 0), key=lambda k: (-gpu[k], k)
        )[:3]
        also = ", ".join(f"{_ITEM_NAMES[k].format(dtype=dtype)} {_fmt_gb(gpu[k])}" for k in others)
        return False, (
            f"needs {_fmt_gb(need)} per GPU but {_fmt_gb(gpu_mem_bytes)} available: the "
            f"{name}{alone} {'is' if item == 'zero3_gathered' else 'are'} "
            f"{_fmt_gb(gpu[item])} ({_explain(estimate, item)})"
            + (f"; also {also}" if also else "")
        )
    host = estimate["host"]
    if host_mem_bytes is not None and host["node_total"] > host_mem_bytes:
        offloaded = host["optimizer"] + host["gradients"] + host["parameters"]
        return False, (
            f"fits the GPUs ({_fmt_gb(need)} of {_fmt_gb(gpu_mem_bytes)}) but needs "
            f"{_fmt_gb(host['node_total'])} of host RAM, {_fmt_gb(host_mem_bytes)} available "
            f"(per rank: offloaded states {_fmt_gb(offloaded)}, or the fp32 model every rank "
            f"builds first {_fmt_gb(host['init_per_rank'])})"
        )
    return True, (
        f"fits: {_fmt_gb(need)} per GPU of {_fmt_gb(gpu_mem_bytes)} "
        f"({_fmt_gb(gpu_mem_bytes - need)} headroom)"
    )


def _strategy_name(
    zero: int, opt: bool, par: bool, ckpt: bool, micro: int, preset: str | None = None
) -> str:
    parts = [f"preset {preset}"] if preset else []
    parts.append(f"ZeRO-{zero}")
    if opt and par:
        parts.append("optimizer+param offload")
    elif opt:
        parts.append("optimizer offload")
    if ckpt:
        parts.append("activation checkpointing")
    parts.append(f"micro {micro}")
    return " + ".join(parts)


def _ladder(
    zero: int, opt: bool, par: bool, ckpt: bool, micro: int
) -> list[tuple[int, bool, bool, bool, int]]:
    """Strategies in cost order: memory layouts (as configured, ZeRO-3, + optimizer offload,
    + parameter offload); within each: as configured, + checkpointing, then halving the micro
    batch down to 1 (grad_accum grows to keep the global batch)."""
    layouts = [(zero, opt, par)]
    if zero < 3:
        layouts.append((3, opt, par))
    if not opt:
        layouts.append((3, True, par))
    if not par:
        layouts.append((3, True, True))
    out = []
    for z, o, p in layouts:
        out.append((z, o, p, ckpt, micro))
        if not ckpt:
            out.append((z, o, p, True, micro))
        m = micro // 2
        while m >= 1:
            out.append((z, o, p, True, m))
            m //= 2
    seen, unique = set(), []
    for s in out:
        if s not in seen:
            seen.add(s)
            unique.append(s)
    return unique


def cheapest_fit(
    config: Any,
    *,
    seq_len: int,
    micro_batch: int,
    world: int,
    zero_stage: int,
    precision: str,
    gpu_mem_bytes: int,
    host_mem_bytes: int | None = None,
    offload_optimizer: bool = False,
    offload_params: bool = False,
    activation_checkpointing: bool = False,
    bucket_sizes: tuple[int, int] = DEFAULT_BUCKETS,
    overlap_comm: bool = True,
    smaller_presets: bool = True,
    fused_optimizer: bool = False,
) -> list[dict[str, Any]]:
    """Strategies tried in cost order until one fits; the last row is the recommendation when
    its ``fits`` is True (``recommended`` marks it), otherwise nothing fits.

    Order: as configured; activation checkpointing; micro batch halved down to 1; ZeRO-3;
    optimizer offload; parameter offload (each memory layout retried with checkpointing and
    smaller micro batches); then smaller presets (one row each, its cheapest strategy).
    """
    from dsflow.model.presets import PRESETS, model_config, param_counts

    common = dict(seq_len=seq_len, world=world, precision=precision, bucket_sizes=bucket_sizes)
    common["overlap_comm"] = overlap_comm
    common["fused_optimizer"] = fused_optimizer

    def attempt(cfg, s, preset=None) -> dict[str, Any]:
        z, o, p, c, m = s
        est = estimate(
            cfg,
            micro_batch=m,
            zero_stage=z,
            offload_optimizer=o,
            offload_params=p,
            activation_checkpointing=c,
            **common,
        )
        fits, reason = verdict(est, gpu_mem_bytes, host_mem_bytes)
        return {
            "strategy": _strategy_name(z, o, p, c, m, preset),
            "preset": preset,
            "zero_stage": z,
            "offload_optimizer": o,
            "offload_params": p,
            "activation_checkpointing": c,
            "micro_batch": m,
            "grad_accum_factor": micro_batch // m,
            "gpu_bytes": est["gpu"]["total"],
            "gpu_gb": _gb(est["gpu"]["total"]),
            "host_bytes": est["host"]["node_total"],
            "host_gb": _gb(est["host"]["node_total"]),
            "fits": fits,
            "reason": reason,
            "recommended": False,
        }

    ladder = _ladder(
        zero_stage, offload_optimizer, offload_params, activation_checkpointing, micro_batch
    )
    rows: list[dict[str, Any]] = []
    for s in ladder:
        rows.append(attempt(config, s))
        if rows[-1]["fits"]:
            rows[-1]["recommended"] = True
            return rows
    if smaller_presets:
        own = param_counts(config)["total"]
        sized = []
        for name in PRESETS:
            cfg = model_config(name, config.vocab_size)
            total = param_counts(cfg)["total"]
            if total < own:
                sized.append((total, name, cfg))
        for _, name, cfg in sorted(sized, key=lambda t: (-t[0], t[1])):
            last = None
            for s in ladder:
                last = attempt(cfg, s, preset=name)
                if last["fits"]:
                    break
            rows.append(last)
            if last["fits"]:
                last["recommended"] = True
                return rows
    return rows


def recommendation(rows: list[dict]) -> dict | None:
    return next((r for r in rows if r["recommended"]), None)


# --------------------------------------------------------------------------- tables


def plan_rows(
    config: Any,
    *,
    seq_len: int,
    micro_batch: int,
    world: int,
    precision: str,
    gpu_mem_bytes: int | None = None,
    host_mem_bytes: int | None = None,
    bucket_sizes: tuple[int, int] = DEFAULT_BUCKETS,
    overlap_comm: bool = True,
) -> list[dict[str, Any]]:
    """ZeRO 0-3 x {no offload, optimizer offload, optimizer+param offload (ZeRO-3)} x
    {no checkpointing, checkpointing}. ZeRO-0 has no offload in DeepSpeed."""
    rows = []
    for zero in (0, 1, 2, 3):
        offloads = [(False, False)]
        if zero >= 1:
            offloads.append((True, False))
        if zero == 3:
            offloads.append((True, True))
        for opt, par in offloads:
            for ckpt in (False, True):
                est = estimate(
                    config,
                    seq_len=seq_len,
                    micro_batch=micro_batch,
                    world=world,
                    zero_stage=zero,
                    precision=precision,
                    offload_optimizer=opt,
                    offload_params=par,
                    activation_checkpointing=ckpt,
                    bucket_sizes=bucket_sizes,
                    overlap_comm=overlap_comm,
                )
                fits = None
                if gpu_mem_bytes is not None:
                    fits = verdict(est, gpu_mem_bytes, host_mem_bytes)[0]
                g = est["gpu"]
                rows.append(
                    {
                        "zero_stage": zero,
                        "offload": "opt+param" if par else ("optimizer" if opt else "none"),
                        "activation_checkpointing": ckpt,
                        "weights_gb": _gb(g["weights"]),
                        "gradients_gb": _gb(g["gradients"]),
                        "optimizer_gb": _gb(g["optimizer"]),
                        "activations_gb": _gb(g["activations"]),
                        "other_gb": _gb(
                            g["total"]
                            - g["weights"]
                            - g["gradients"]
                            - g["optimizer"]
                            - g["activations"]
                        ),
                        "gpu_gb": _gb(g["total"]),
                        "host_gb": _gb(est["host"]["node_total"]),
                        "fits": fits,
                    }
                )
    return rows


def format_table(headers: list[str], rows: list[list[Any]]) -> str:
    """Plain-text table, columns aligned (numbers right, text left)."""
    cells = [[str(c) for c in r] for r in rows]
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]

    def numeric(s: str) -> bool:
        return s.replace(",", "").replace(".", "", 1).lstrip("-").isdigit()

    def line(values: list[str]) -> str:
        out = []
        for v, width in zip(values, widths, strict=True):
            out.append(v.rjust(width) if numeric(v) else v.ljust(width))
        return "  ".join(out).rstrip()

    sep = "  ".join("-" * wd for wd in widths)
    return "\n".join([line(headers), sep] + [line(r) for r in cells])


def _yes(v: bool | None) -> str:
    return "?" if v is None else ("yes" if v else "no")


PLAN_HEADERS = ["zero", "offload", "ckpt", "weights", "grads", "optim", "activ", "other"]
PLAN_HEADERS += ["per-GPU GB", "host GB", "fits"]


def format_plan_rows(rows: list[dict]) -> str:
    body = [
        [
            r["zero_stage"],
            r["offload"],
            "yes" if r["activation_checkpointing"] else "no",
            f"{r['weights_gb']:.1f}",
            f"{r['gradients_gb']:.1f}",
            f"{r['optimizer_gb']:.1f}",
            f"{r['activations_gb']:.1f}",
            f"{r['other_gb']:.1f}",
            f"{r['gpu_gb']:.1f}",
            f"{r['host_gb']:.1f}",
            _yes(r["fits"]),
        ]
        for r in rows
    ]
    return format_table(PLAN_HEADERS, body)


def plan_table(
    config: Any,
    *,
    seq_len: int,
    micro_batch: int,
    world: int,
    precision: str,
    gpu_mem_bytes: int | None = None,
    host_mem_bytes: int | None = None,
    bucket_sizes: tuple[int, int] = DEFAULT_BUCKETS,
    overlap_comm: bool = True,
) -> str:
    """:func:`plan_rows` as an aligned plain-text table (GB = 1e9 bytes; "other" = buckets,
    ZeRO-3's gathered module, the fp32 step gradients beyond the activations, overhead)."""
    rows = plan_rows(
        config,
        seq_len=seq_len,
        micro_batch=micro_batch,
        world=world,
        precision=precision,
        gpu_mem_bytes=gpu_mem_bytes,
        host_mem_bytes=host_mem_bytes,
        bucket_sizes=bucket_sizes,
        overlap_comm=overlap_comm,
    )
    return format_plan_rows(rows)


def strategies_table(rows: list[dict]) -> str:
    body = [
        [
            r["strategy"] + ("  <- recommended" if r["recommended"] else ""),
            f"{r['gpu_gb']:.1f}",
            f"{r['host_gb']:.1f}",
            _yes(r["fits"]),
        ]
        for r in rows
    ]
    return format_table(["strategy", "per-GPU GB", "host GB", "fits"], body)


# --------------------------------------------------------------------------- summary


def summary(
    config: Any,
    *,
    seq_len: int,
    tokens_per_step: int,
    precision: str,
    zero_stage: int,
    keep_checkpoints: int,
) -> dict[str, Any]:
    """Parameter counts, FLOPs (the trainer's MFU formula) and on-disk sizes.

    A DeepSpeed checkpoint holds the 16-bit module weights (mp_rank_00_model_states.pt; not at
    ZeRO-3, whose fp32 partitions suffice) and every rank's fp32 master + Adam m, v partitions
    (zero_pp_rank_*_optim_states.pt): 2 + 12 = 14 B/param under mixed precision. dsflow saves
    the new checkpoint before pruning to ``keep_checkpoints``, so keep + 1 exist at the peak,
    plus the exported HF model (models/final, safetensors in the training dtype).
    """
    from dsflow.model.flops import flops_per_token
    from dsflow.model.presets import param_counts

    counts = param_counts(config)
    P = counts["total"]
    w = _act_bytes(precision)
    module = 0 if zero_stage == 3 else w * P
    if precision == "fp32":
        optim = (8 if zero_stage in (0, 3) else 12) * P
    else:
        optim = 12 * P
    ckpt = module + optim
    export = w * P
    fpt = flops_per_token(config, seq_len)
    return {
        "params_total": P,
        "params_activated": counts["activated"],
        "params_activated_non_embedding": counts["activated_non_embedding"],
        "flops_per_token": fpt,
        "tokens_per_step": tokens_per_step,
        "flops_per_step": fpt * tokens_per_step,
        "checkpoint_bytes": ckpt,
        "export_bytes": export,
        "keep_checkpoints": keep_checkpoints,
        "disk_bytes": (keep_checkpoints + 1) * ckpt + export,
    }


# --------------------------------------------------------------------------- the stage


@dataclass
class Request:
    """Everything a plan depends on, resolved from params (+ ad-hoc flags)."""

    config: Any
    preset: str
    vocab_size: int
    vocab_source: str
    seq_len: int
    micro_batch: int
    grad_accum: int
    world: int
    zero_stage: int
    precision: str
    offload_optimizer: bool
    offload_params: bool
    activation_checkpointing: bool
    bucket_sizes: tuple[int, int]
    overlap_comm: bool
    seq_aux: bool
    keep_checkpoints: int
    gpu_mem_bytes: int | None
    gpu_mem_source: str
    host_mem_bytes: int | None
    host_mem_source: str
    notes: list[str] = dataclasses.field(default_factory=list)
    fused_optimizer: bool = False

    def estimate_kwargs(self) -> dict[str, Any]:
        return dict(
            seq_len=self.seq_len,
            micro_batch=self.micro_batch,
            world=self.world,
            zero_stage=self.zero_stage,
            precision=self.precision,
            offload_optimizer=self.offload_optimizer,
            offload_params=self.offload_params,
            activation_checkpointing=self.activation_checkpointing,
            bucket_sizes=self.bucket_sizes,
            overlap_comm=self.overlap_comm,
            fused_optimizer=self.fused_optimizer,
        )


def _arg(args: Any, name: str) -> Any:
    return getattr(args, name, None) if args is not None else None


def _index_vocab() -> int | None:
    path = shard_index("train")
    try:
        return int(json.loads(path.read_text())["vocab_size"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def visible_gpus() -> list[dict[str, Any]]:
    """[{name, total_memory}] of the visible CUDA GPUs ([] without CUDA)."""
    try:
        import torch

        if not torch.cuda.is_available():
            return []
        out = []
        for i in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(i)
            out.append({"name": props.name, "total_memory": int(props.total_memory)})
        return out
    except Exception:  # noqa: BLE001 - a broken driver is "no GPU" for planning
        return []


def host_memory_bytes() -> int | None:
    """Physical RAM of this machine, capped by a cgroup (container) memory limit."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        total = None
    for limit_file in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            text = Path(limit_file).read_text().strip()
        except OSError:
            continue
        if text.isdigit() and (total is None or int(text) < total):
            total = int(text)
    return total


def _profile_gpu(args: Any) -> str | None:
    names = list(_arg(args, "profile") or [])
    names += [p for p in os.environ.get("DSFLOW_PROFILES", "").split(os.pathsep) if p]
    for name in names:
        stem = Path(str(name)).stem.lower()
        for needle, key in PROFILE_GPUS:
            if needle in stem:
                return key
    return None


def resolve(
    params: dict,
    args: Any = None,
    *,
    world: int | None = None,
    gpus: list[dict[str, Any]] | None = None,
    gpu_mem_bytes: int | None = None,
    host_mem_bytes: int | None = None,
) -> Request:
    """The plan's inputs from params, the ad-hoc flags in ``args`` and the machine.

    - model: ``--model`` (then params' overrides / pretrained are ignored), else
      ``model.preset`` + ``model.overrides``, or a local ``model.pretrained`` checkpoint's config.
    - vocabulary: ``--vocab``; the pretrained checkpoint's; ``data/shards/train/index.json``
      (what train uses); without shards ``tokenizer.vocab_size`` (what the tokenizer stage will
      train, unless ``tokenizer.pretrained`` or ``--model``); the preset's
      ``published_vocab_size``; 32000.
    - world: ``world`` / ``--gpus`` / ``train.gpus`` x ``train.nodes`` (auto: the visible GPUs,
      else 1).
    - GPU memory: ``gpu_mem_bytes`` / ``--gpu-mem``; the smallest of the visible GPUs used
      (``torch.cuda.get_device_properties``); a GPU named by a profile file (rtx4090x3.yaml);
      else unknown. Host RAM: ``host_mem_bytes`` / ``--host-mem``; this machine's when its
      GPUs are the ones planned for; else unknown (not checked).

    ``gpus`` (the visible GPUs as :func:`visible_gpus` returns them) and ``host_mem_bytes``
    replace what this machine reports (the doctor passes its facts).
    """
    from dsflow import dsconfig
    from dsflow.model.build import load_checkpoint_config
    from dsflow.model.presets import PRESETS, model_config

    train = params["train"]
    model = params["model"]
    notes: list[str] = []
    preset, overrides, pretrained = model["preset"], model.get("overrides") or {}, None
    if _arg(args, "model"):
        if _arg(args, "model") != preset and (overrides or model.get("pretrained")):
            notes.append("--model given: params' model.overrides / model.pretrained ignored")
        preset, overrides = _arg(args, "model"), {}
    else:
        pretrained = model.get("pretrained")
    if preset not in PRESETS:
        raise UsageError(f"unknown model preset {preset!r}; choose one of: {', '.join(PRESETS)}")

    if gpus is None:
        gpus = visible_gpus()
    if world is None:
        world = _arg(args, "gpus") or train["gpus"]
        if world == "auto":
            world = len(gpus) or 1
        if not _arg(args, "gpus"):  # train.gpus is per node
            world = int(world) * train.get("nodes", 1)
    world = int(world)
    if world < 1:
        raise UsageError(f"--gpus must be >= 1, got {world}")

    vocab, vocab_source = _arg(args, "vocab"), "--vocab"
    config = None
    if vocab is None and pretrained and os.path.isdir(pretrained):
        config = load_checkpoint_config(pretrained)
        vocab, vocab_source = config.vocab_size, f"model.pretrained {pretrained}"
    elif pretrained:
        notes.append(
            f"model.pretrained {pretrained!r} is not a local directory: planned the preset"
        )
    if vocab is None:
        vocab, vocab_source = _index_vocab(), str(shard_index("train"))
    tok = params.get("tokenizer", {})
    if vocab is None and not _arg(args, "model") and not tok.get("pretrained"):
        # No shards yet: the tokenizer stage will train this many tokens (at most).
        vocab, vocab_source = tok.get("vocab_size"), "tokenizer.vocab_size"
    if vocab is None:
        vocab = PRESETS[preset].get("published_vocab_size")
        vocab_source = f"{preset}'s published vocabulary"
    if vocab is None:
        vocab, vocab_source = DEFAULT_VOCAB, "default"
    if config is None:
        config = model_config(preset, int(vocab), overrides)

    seq_len = int(_arg(args, "seq_len") or train["seq_len"])
    micro = _arg(args, "micro_batch")
    if micro is None:
        batch = dsconfig.resolve_batch(
            train["micro_batch"], train["grad_accum"], train["global_batch"], world
        )
        micro, accum = batch.micro, batch.accum
    else:
        accum = train["grad_accum"] or 1
    zero = _arg(args, "zero")
    if zero is None and train["zero_stage"] == "auto":
        zero = auto_first_stage(train, world)
        notes.append(
            f"train.zero_stage: auto: planned as ZeRO-{zero}; the train stage picks the "
            "cheapest layout that fits (see cheapest fit)"
        )
    zero = int(train["zero_stage"] if zero is None else zero)
    precision = _arg(args, "precision") or train["precision"]
    offload = train.get("offload") or {}
    offload_opt = bool(_arg(args, "offload_optimizer")) or (
        _arg(args, "zero") is None and offload.get("optimizer", "none") != "none"
    )
    offload_par = bool(_arg(args, "offload_params")) or (
        _arg(args, "zero") is None and offload.get("param", "none") != "none"
    )
    if offload_par and zero != 3:
        raise UsageError("--offload-params needs ZeRO-3 (--zero 3)")
    if offload_opt and zero == 0:
        raise UsageError("--offload-optimizer needs ZeRO stage 1, 2 or 3")
    zcfg = train.get("zero", {})
    buckets = (
        int(zcfg.get("reduce_bucket_size", DEFAULT_BUCKETS[0])),
        int(zcfg.get("allgather_bucket_size", DEFAULT_BUCKETS[1])),
    )

    gpu_source = "unknown"
    if gpu_mem_bytes is not None:
        gpu_source = "given"
    elif _arg(args, "gpu_mem") is not None:
        gpu_mem_bytes, gpu_source = int(float(_arg(args, "gpu_mem")) * GB), "--gpu-mem"
    elif gpus:
        used = gpus[: max(1, min(world, len(gpus)))]
        smallest = min(used, key=lambda g: g["total_memory"])
        gpu_mem_bytes, gpu_source = smallest["total_memory"], f"visible GPU {smallest['name']}"
    elif (key := _profile_gpu(args)) is not None:
        gpu_mem_bytes, gpu_source = GPU_MEMORY_BYTES[key], f"profile ({key})"

    host_source = "unknown"
    if host_mem_bytes is not None:
        host_source = "given"
    elif _arg(args, "host_mem") is not None:
        host_mem_bytes, host_source = int(float(_arg(args, "host_mem")) * GB), "--host-mem"
    elif gpus and gpu_source.startswith("visible"):
        host_mem_bytes, host_source = host_memory_bytes(), "this machine"

    return Request(
        config=config,
        preset=preset,
        vocab_size=int(config.vocab_size),
        vocab_source=vocab_source,
        seq_len=seq_len,
        micro_batch=int(micro),
        grad_accum=int(accum),
        world=world,
        zero_stage=zero,
        precision=precision,
        offload_optimizer=offload_opt,
        offload_params=offload_par,
        activation_checkpointing=bool(
            _arg(args, "activation_checkpointing")
            or (train.get("perf") or {}).get("activation_checkpointing", False)
        ),
        bucket_sizes=buckets,
        overlap_comm=dsconfig.gradient_hooks(
            {"overlap_comm": "auto", "contiguous_gradients": "auto", **zcfg}, zero, world, "cuda"
        )[0],
        seq_aux=float(train.get("balance", {}).get("seq_aux_alpha", 0.0)) > 0,
        fused_optimizer=fused_optimizer_wanted(train, world),
        keep_checkpoints=int(train.get("keep_checkpoints", 2)),
        gpu_mem_bytes=gpu_mem_bytes,
        gpu_mem_source=gpu_source,
        host_mem_bytes=host_mem_bytes,
        host_mem_source=host_source,
        notes=notes,
    )


def report(
    params: dict,
    args: Any = None,
    *,
    request: Request | None = None,
    **resolve_kwargs: Any,
) -> dict[str, Any]:
    """The whole plan as a JSON-able dict (what reports/plan.json holds)."""
    req = request or resolve(params, args, **resolve_kwargs)
    est = estimate(req.config, seq_aux=req.seq_aux, **req.estimate_kwargs())
    fits, reason, rows = None, "GPU memory unknown: pass --gpu-mem GB", []
    if req.gpu_mem_bytes is not None:
        fits, reason = verdict(est, req.gpu_mem_bytes, req.host_mem_bytes)
        rows = cheapest_fit(
            req.config,
            gpu_mem_bytes=req.gpu_mem_bytes,
            host_mem_bytes=req.host_mem_bytes,
            **req.estimate_kwargs(),
        )
    table_kwargs = dict(
        seq_len=req.seq_len,
        micro_batch=req.micro_batch,
        world=req.world,
        precision=req.precision,
        gpu_mem_bytes=req.gpu_mem_bytes,
        host_mem_bytes=req.host_mem_bytes,
        bucket_sizes=req.bucket_sizes,
        overlap_comm=req.overlap_comm,
    )
    notes = list(req.notes)
    rec = recommendation(rows)
    if rec and (rec["activation_checkpointing"] or rec["offload_optimizer"]):
        notes.append(
            "in params.yaml: train.perf.activation_checkpointing: true; "
            "train.offload.optimizer / train.offload.param: cpu (params need ZeRO-3)"
        )
    return {
        "request": {
            "preset": req.preset,
            "vocab_size": req.vocab_size,
            "vocab_source": req.vocab_source,
            "grad_accum": req.grad_accum,
            "gpu_mem_bytes": req.gpu_mem_bytes,
            "gpu_mem_source": req.gpu_mem_source,
            "host_mem_bytes": req.host_mem_bytes,
            "host_mem_source": req.host_mem_source,
            **est["inputs"],
        },
        "estimate": est,
        "verdict": {"fits": fits, "reason": reason},
        "recommendation": rec,
        "strategies": rows,
        "table": plan_rows(req.config, **table_kwargs),
        "summary": summary(
            req.config,
            seq_len=req.seq_len,
            tokens_per_step=req.micro_batch * req.grad_accum * req.world * req.seq_len,
            precision=req.precision,
            zero_stage=req.zero_stage,
            keep_checkpoints=req.keep_checkpoints,
        ),
        "notes": notes,
        "overhead": dataclasses.asdict(FRAMEWORK_OVERHEAD),
    }


def format_report(rep: dict) -> str:
    req, est, summ = rep["request"], rep["estimate"], rep["summary"]
    g = est["gpu"]
    gpu_mem = req["gpu_mem_bytes"]
    lines = [
        f"model {req['preset']} (vocab {req['vocab_size']}, {req['vocab_source']}): "
        f"{summ['params_total'] / 1e9:.3f}B params, {summ['params_activated'] / 1e9:.3f}B "
        f"activated, {summ['flops_per_token'] / 1e9:.2f} GFLOP/token",
        f"run: {req['world']} GPU(s), ZeRO-{req['zero_stage']}, {req['precision']}, "
        f"seq {req['seq_len']} x micro {req['micro_batch']} x accum {req['grad_accum']}"
        + (", dsflow's fused optimizer" if req.get("fused_optimizer") else "")
        + (", optimizer offload" if req["offload_optimizer"] else "")
        + (", param offload" if req["offload_params"] else "")
        + (", activation checkpointing" if req["activation_checkpointing"] else ""),
        "GPU memory: "
        + (_fmt_gb(gpu_mem) + f" ({req['gpu_mem_source']})" if gpu_mem else "unknown"),
        "per GPU: "
        + ", ".join(
            f"{k} {_fmt_gb(g[k])}"
            for k in (
                "weights",
                "gradients",
                "optimizer",
                "gradients_fp32_step",
                "activations",
                "buckets",
                "grad_transient",
                "zero3_gathered",
                "overhead",
            )
            if g[k]
        )
        + f" -> peak {_fmt_gb(g['total'])} ({est['peak_phase']})",
        f"host RAM: {_fmt_gb(est['host']['node_total'])} for {req['world']} rank(s)",
        f"disk: {_fmt_gb(summ['checkpoint_bytes'])} per checkpoint x "
        f"{summ['keep_checkpoints']} + 1 while saving + export {_fmt_gb(summ['export_bytes'])}"
        f" = {_fmt_gb(summ['disk_bytes'])}",
        f"verdict: {rep['verdict']['reason']}",
    ]
    for note in rep["notes"]:
        lines.append(f"note: {note}")
    if rep["strategies"]:
        lines += ["", strategies_table(rep["strategies"])]
    lines += ["", format_plan_rows(rep["table"])]
    return "\n".join(lines)


def add_arguments(parser: Any) -> None:
    """Optional flags of `python -m dsflow plan` that override params for an ad-hoc query."""
    from dsflow.model.presets import PRESETS

    parser.add_argument("--model", choices=list(PRESETS), metavar="PRESET", help="model preset")
    parser.add_argument("--gpus", type=int, metavar="N", help="GPUs (data-parallel ranks)")
    parser.add_argument("--gpu-mem", type=float, metavar="GB", help="memory per GPU, GB (1e9)")
    parser.add_argument("--host-mem", type=float, metavar="GB", help="host RAM, GB (1e9)")
    parser.add_argument("--vocab", type=int, metavar="N", help="vocabulary size")
    parser.add_argument("--seq-len", type=int, metavar="N")
    parser.add_argument("--micro-batch", type=int, metavar="N")
    parser.add_argument("--zero", type=int, choices=[0, 1, 2, 3])
    parser.add_argument("--precision", choices=["bf16", "fp16", "fp32"])
    parser.add_argument("--offload-optimizer", action="store_true", default=None)
    parser.add_argument("--offload-params", action="store_true", default=None)
    parser.add_argument("--activation-checkpointing", action="store_true", default=None)


def run(params: dict, args: Any = None) -> None:
    """Print the plan and write reports/plan.json (sorted keys: same inputs, same bytes)."""
    from dsflow.atomic import atomic_file

    rep = report(params, args)
    print(format_report(rep))
    with atomic_file(PLAN) as f:
        json.dump(rep, f, indent=2, sort_keys=True)
        f.write("\n")


def fused_optimizer_wanted(train: dict, world: int) -> bool:
    """train.perf.optimizer asks for dsflow's fused optimizer (dsflow.train.masteradam) where it can
    run: `fused` on any number of GPUs, `auto` on one GPU (where it was measured faster than
    DeepSpeed's, docs/performance.md) unless a DeepSpeed config file of the user's is merged
    (train.ds_config: its settings are for DeepSpeed's optimizer); bf16, the optimizer on the
    GPU. It runs at ZeRO-0."""
    value = (train.get("perf") or {}).get("optimizer", "auto")
    offload = (train.get("offload") or {}).get("optimizer", "none") != "none"
    wanted = value == "fused" or (value == "auto" and world == 1 and not train.get("ds_config"))
    return wanted and train.get("precision") == "bf16" and not offload


def auto_first_stage(train: dict, world: int) -> int:
    """The first ZeRO stage `train.zero_stage: auto` tries on GPUs: ZeRO-2; on one GPU, where
    there is nothing to partition, ZeRO-1 (no per-parameter gradient hooks); ZeRO-0 where
    dsflow's fused optimizer is wanted (`fused_optimizer_wanted`: on one GPU by default), the
    one stage it runs at; ZeRO-3 with parameter offload (it exists only there)."""
    offload = train.get("offload") or {}
    if offload.get("param", "none") != "none":
        return 3
    if fused_optimizer_wanted(train, world):
        return 0
    return 1 if world == 1 else 2


def auto_layout(
    params: dict,
    world: int,
    device_type: str,
    gpu_mem_bytes: int | None = None,
    host_mem_bytes: int | None = None,
) -> tuple[int, bool, bool, str]:
    """`train.zero_stage: auto`: (stage, offload optimizer, offload params, why) of the first
    memory layout that fits GPU (and host) memory, in cost order ZeRO-2, ZeRO-3, + optimizer
    offload, + parameter offload (one GPU: ZeRO-1, then ZeRO-2 + optimizer offload, then
    ZeRO-3 with offload; ZeRO-0 first wherever train.perf.optimizer asks for the fused
    optimizer), at the configured micro batch (offload asked for in train.offload is kept). One
    GPU has nothing to partition, so ZeRO-0/1 hold what ZeRO-2 does, and ZeRO-1 handles its
    gradients without a hook per parameter in every backward: faster on one H200
    (docs/performance.md). On CPU there is nothing to fit: ZeRO-2 (the fewest collectives).
    When nothing fits, a UsageError names the cheapest strategy that would (smaller micro
    batch, checkpointing, a smaller preset). Host RAM: `host_mem_bytes`, else this machine's."""
    offload = params["train"].get("offload") or {}
    want_opt = offload.get("optimizer", "none") != "none"
    want_par = offload.get("param", "none") != "none"
    if device_type != "cuda":
        stage = 3 if want_par else 2
        return stage, want_opt, want_par, "a CPU run: no GPU memory to fit, the fewest collectives"
    first = auto_first_stage(params["train"], world)
    pinned = copy.deepcopy(params)
    pinned["train"]["zero_stage"] = first
    req = resolve(pinned, None, world=world, gpu_mem_bytes=gpu_mem_bytes)
    if req.gpu_mem_bytes is None:
        return first, want_opt, want_par, f"GPU memory unknown: ZeRO-{first}"
    host = host_mem_bytes if host_mem_bytes is not None else host_memory_bytes()
    if world == 1:
        # ZeRO-3 partitions nothing on one GPU: ZeRO-Offload (ZeRO-2, whose CPU offload is
        # DeepSpeed's classic and tested path) comes first.
        layouts = [(first, False, False), (2, True, False), (3, True, False), (3, True, True)]
    else:
        layouts = [(first, False, False), (3, False, False), (3, True, False), (3, True, True)]
    reason = ""
    for z, o, p in layouts:
        if (want_opt and not o) or (want_par and not p):
            continue
        kwargs = {**req.estimate_kwargs(), "zero_stage": z}
        kwargs.update(offload_optimizer=o, offload_params=p)
        est = estimate(req.config, seq_aux=req.seq_aux, **kwargs)
        fits, reason = verdict(est, req.gpu_mem_bytes, host)
        if fits:
            gb = f"{_gb(est['gpu']['total']):.1f} of {_gb(req.gpu_mem_bytes):.1f} GB per GPU"
            alone = {
                0: " (ZeRO-0, for dsflow's fused optimizer)",
                1: " (one GPU: ZeRO-1, no gradient hooks)",
            }.get(z, "")
            return z, o, p, f"the planner's cheapest fit{alone}: {gb}"
    rows = cheapest_fit(
        req.config,
        gpu_mem_bytes=req.gpu_mem_bytes,
        host_mem_bytes=host,
        **{**req.estimate_kwargs(), "offload_optimizer": want_opt, "offload_params": want_par},
    )
    rec = recommendation(rows)
    hint = f"cheapest fit: {rec['strategy']}" if rec else "nothing fits, not even smaller presets"
    msg = (
        f"train.zero_stage: auto: no ZeRO layout fits {req.preset} at micro batch "
        f"{req.micro_batch} on {world} GPU(s) (ZeRO-3 with CPU offload {reason}); {hint}; "
        "see python -m dsflow plan"
    )
    raise UsageError(" ".join(msg.split()))


def check_fits(params: dict, world: int, device_type: str, gpu_mem_bytes: int | None) -> None:
    """Raise UsageError (one line: needed vs available per GPU, and the cheapest strategy that
    would fit) when the run does not fit the GPUs. Nothing to check on CPU."""
    if device_type != "cuda":
        return
    req = resolve(params, None, world=world, gpu_mem_bytes=gpu_mem_bytes)
    if req.gpu_mem_bytes is None:
        return
    est = estimate(req.config, seq_aux=req.seq_aux, **req.estimate_kwargs())
    fits, reason = verdict(est, req.gpu_mem_bytes)
    if fits:
        return
    rows = cheapest_fit(
        req.config,
        gpu_mem_bytes=req.gpu_mem_bytes,
        host_mem_bytes=host_memory_bytes(),
        **req.estimate_kwargs(),
    )
    rec = recommendation(rows)
    if rec:
        hint = f"cheapest fit: {rec['strategy']} ({rec['gpu_gb']:.1f} GB per GPU)"
    else:
        hint = "nothing fits, not even smaller presets with ZeRO-3 and offload"
    what = f"{req.preset} with ZeRO-{req.zero_stage} {req.precision} on {world} GPU(s)"
    msg = f"train: {what} {reason}; {hint}; see python -m dsflow plan"
    raise UsageError(" ".join(msg.split()))


__all__ = [
    "FRAMEWORK_OVERHEAD",
    "GPU_MEMORY_BYTES",
    "activation_bytes",
    "add_arguments",
    "auto_layout",
    "check_fits",
    "cheapest_fit",
    "estimate",
    "largest_module",
    "plan_rows",
    "plan_table",
    "report",
    "resolve",
    "run",
    "summary",
    "verdict",
]
