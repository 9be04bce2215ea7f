"""The planner's memory model: what training a model takes per GPU (and host), analytically.

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
- gradients during ``optimizer.step()``: DeepSpeed converts this rank's gradient partition
  to fp32 before Adam runs (4 B/param x ``1/N``; the full model at ZeRO-0; at ZeRO-3 one
  ``sub_group_size`` = 1e9 elements at a time); at ZeRO-1/2 it first copies the 16-bit
  gradients into one flat tensor (2 B/param x ``1/N`` more). These copies only exist inside the
  step, after the activations are freed, so the allocated peak is ``states + max(forward/backward
  set, step set)``. Reserved, the caching allocator puts each copy in the memory the activations
  freed while it fits and reserves the rest on top (``step_not_reused``): at a small micro batch
  the fp32 cast no longer fits beside the flat copy, and where ZeRO-1's gradients are scattered
  among the activations the freed pieces hold neither.
  DeepSpeed's own estimators (``estimate_zero2_model_states_mem_needs``: ``2P + 18P/N``) add the
  fp32 copy to the steady state; ``model_states`` here is the same sum plus the flat copy.

Activations: what autograd keeps for backward in HF's ``DeepseekV3ForCausalLM`` with SDPA
attention and the ``grouped_mm`` experts kernel (CUDA), per token, ``a`` = 2 bytes (4 in fp32).
(The sorted experts, the CUDA default, keep a little less than HF's: docs/performance.md has
the measured peaks.)

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
  ``12 x vocab`` bytes per token, often the single largest activation. With the fused
  lm_head + cross-entropy (``train.perf.ce_chunk``, on by default on CUDA) no logits are kept:
  its forward keeps the gradients of the hidden states and of the lm_head weight (fp32) for
  backward and holds one chunk of fp32 logits at a time.
- Compiled layers (``train.perf.compile``, on by default on CUDA, never at ZeRO-3) save less
  (:func:`compiled_unsaved`): Inductor recomputes cheap pointwise results in backward.
  With ``train.perf.fp8`` they also drop the inputs of float8 linears (:func:`fp8_unsaved`).
- With activation checkpointing (HF ``gradient_checkpointing_enable``, per decoder layer) only
  each layer's input stays (``a x hidden`` per token per layer); backward recomputes one layer at
  a time.
- Multi-token prediction (``model.mtp_depth``, :func:`mtp_activations`): depth k keeps what one
  more eager decoder layer keeps over ``seq_len - k`` tokens, plus its input norms, eh_proj's
  input and a head of its own through the shared lm_head.

Plus DeepSpeed's communication buckets, ZeRO-3's gathered module, and
:data:`FRAMEWORK_OVERHEAD`. The estimate is a model, not a measurement: it is meant to be within
15 % of ``torch.cuda.max_memory_reserved()``, and errs high: docs/performance.md has the
H200 runs it is held against.

Sizes are in GB = 10^9 bytes.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from dsflow import dsconfig
from dsflow.model import float8, presets
from dsflow.model.flops import flops_per_token

GB = 10**9


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
# DeepSpeed 0.19's NVMe offload defaults: pinned host buffers that stage the swap files.
DS_NVME_OPTIMIZER_BUFFERS = 4  # offload_optimizer.buffer_count (fp32, one sub-group each)
DS_NVME_PARAM_BUFFERS = 5  # offload_param.buffer_count
DS_NVME_PARAM_BUFFER_SIZE = 100_000_000  # offload_param.buffer_size (16-bit elements)


def round_gb(n: float) -> float:
    """Bytes as GB (1e9), rounded to 0.01: what plan.json holds."""
    return round(n / GB, 2)


def fmt_gb(n: float) -> str:
    """Bytes as "12.3 GB" (1e9), for messages."""
    return f"{n / GB:,.1f} GB"


@dataclass(frozen=True, kw_only=True)
class Setup:
    """How a run is laid out, as far as memory goes: everything :func:`estimate` needs besides
    the model. ``fused_optimizer``: train.perf.optimizer asks for dsflow's fused optimizer
    (dsflow.train.masteradam), which counts only at ZeRO-0 in bf16. ``bucket_sizes`` =
    (``reduce_bucket_size``, ``allgather_bucket_size``) in elements. ``offload_device``: where
    offloaded states live, ``cpu`` (host RAM) or ``nvme`` (swap files on disk, staged through
    pinned host buffers)."""

    seq_len: int
    micro_batch: int
    world: int  # ranks over every node: ZeRO partitions over all of them
    zero_stage: int
    precision: str
    offload_optimizer: bool = False
    offload_params: bool = False
    activation_checkpointing: bool = False
    bucket_sizes: tuple[int, int] = DEFAULT_BUCKETS
    overlap_comm: bool = True
    # train.zero.contiguous_gradients as given (true, false or auto): dsconfig.gradient_hooks
    # decides `auto` for whichever stage and world this setup has.
    contiguous_gradients: bool | str = "auto"
    seq_aux: bool = True
    fused_optimizer: bool = False
    offload_device: str = "cpu"
    nodes: int = 1  # machines: each host holds world / nodes ranks
    # LoRA (dsflow.model.lora.counts): trainable adapter parameters (0: a full fine-tune, every
    # parameter trains) and the base weight elements its parameter adapters copy per forward.
    lora_adapter: int = 0
    lora_merged: int = 0
    lora_merged_layer: int = 0  # the same in the decoder layer that has the most
    lora_rank_outputs: int = 0  # per token, the module adapters' A outputs (lora.counts)
    lora_rank_outputs_layer: int = 0  # the same in one decoder layer
    # LoRA without the `experts` target: the routed experts' weights get no gradient, so
    # autograd keeps none of what only a weight gradient reads (activation_bytes).
    frozen_experts: bool = False
    ce_chunk: int = 0  # train.perf.ce_chunk as resolved: 0 = the full fp32 logits
    compiled: bool = False  # train.perf.compile as resolved; no layout compiles at ZeRO-3
    fp8: str = "off"  # train.perf.fp8's recipe ("off": bf16 linears)
    mtp_depth: int = 0  # model.mtp_depth: DeepSeek-V3's multi-token-prediction modules
    experts_in_graph: bool = False  # the sorted experts in bf16: inside the compiled graphs
    # The sorted experts' rows padded per expert to a multiple of this (the Triton grouped GEMM:
    # 64; FP8 experts: 16; 0 = none): memory.expert_padding_rows. At ZeRO-3 only where
    # train.perf.experts names them (`experts_named`): `auto` keeps HF's experts there.
    expert_rows_align: int = 0
    experts_named: bool = False
    # The setting that makes the train stage refuse ZeRO-3 (train.perf.compile: true, or
    # train.perf.fp8 or fp8_experts on), so that no plan offers it; "" = none.
    no_zero3: str = ""

    @property
    def ranks_per_node(self) -> int:
        return _ceil_div(self.world, self.nodes)

    @property
    def rows_align(self) -> int:
        """How this layout pads the sorted experts' rows (`expert_rows_align`)."""
        return self.expert_rows_align if self.zero_stage != 3 or self.experts_named else 0

    @property
    def compiles(self) -> bool:
        """Whether the layers are compiled: never at ZeRO-3 (dsflow.model.fastpaths)."""
        return self.compiled and self.zero_stage != 3

    @property
    def fused(self) -> bool:
        """Whether the fused optimizer runs: at ZeRO-0 in bf16 only."""
        return self.fused_optimizer and self.zero_stage == 0 and self.precision == "bf16"

    def layout(
        self,
        zero_stage: int,
        offload_optimizer: bool,
        offload_params: bool,
        offload_device: str | None = None,
    ) -> Setup:
        """This setup in another memory layout (``offload_device`` None: this one's)."""
        return dataclasses.replace(
            self,
            zero_stage=zero_stage,
            offload_optimizer=offload_optimizer,
            offload_params=offload_params,
            offload_device=offload_device or self.offload_device,
        )


# --------------------------------------------------------------------------- shapes


def largest_module(config: Any) -> tuple[int, str, int, str]:
    """(params, name) of the module with the most *direct* parameters, and (numel, name) of the
    largest single parameter, of ``DeepseekV3ForCausalLM(config)``.

    "Module" in DeepSpeed's sense (``estimate_zero3_model_states_mem_needs_all_live``: each
    module's ``parameters(recurse=False)``): ZeRO-3 gathers one module's parameters at a time.
    HF stores a layer's routed experts as two fused 3-D tensors in ONE module, so at ZeRO-3 the
    whole expert bank of a layer is gathered on every GPU at once.
    """
    d = presets._dims(config)
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


def bytes_per_element(precision: str) -> int:
    """Bytes of one weight, gradient or activation element in this training precision."""
    if precision not in ("bf16", "fp16", "fp32"):
        raise ValueError(f"precision must be bf16, fp16 or fp32, got {precision!r}")
    return 4 if precision == "fp32" else 2


def _norm(width: int, a: int) -> int:
    """RMSNorm per token: its fp32 input copy + the normalized 16-bit tensor (the output is its
    consumer's), which only the norm's weight gradient reads: `a` = 0 for a frozen norm."""
    return (4 + a) * width


def _attention_per_token(config: Any, d: dict[str, int], a: int, norm_a: int) -> int:
    heads = d["heads"]
    q = (_norm(d["q_lora"], norm_a) + a * d["q_lora"]) if config.q_lora_rank else 0
    return (
        a * d["H"]  # input of q/kv_a projections (the norm output)
        + q  # q_a_layernorm + q_b_proj input
        + _norm(d["kv_lora"], norm_a)
        + a * d["kv_lora"]  # kv_a_layernorm + kv_b_proj input
        + 2 * a * heads * d["qk"]  # query and key states (SDPA inputs)
        + a * heads * (d["nope"] + d["v"])  # kv_b_proj output, kept alive by the value view
        + 2 * a * heads * d["v"]  # SDPA output + the contiguous copy o_proj saves
        + 4 * heads  # SDPA logsumexp (fp32)
    )


def _mlps_per_token(
    d: dict[str, int],
    a: int,
    seq_aux: bool,
    frozen_experts: bool = False,
    frozen_base: bool = False,
) -> tuple[int, int]:
    """(dense MLP, MoE MLP) bytes per token, each with its post-attention norm. Per routed
    (token, expert) pair autograd keeps the permuted input twice and four expert-width
    tensors; with `frozen_experts` one of each fewer: the gate/up GEMM's input and the down
    GEMM's input are kept only for their weights' gradients (measured on CPU,
    tests/unit/plan/test_plan.py)."""
    H, K, E = d["H"], d["K"], d["E"]
    post_norm = _norm(H, 0 if frozen_base else a) + a * H
    dense_mlp = post_norm + 4 * a * d["inter"]
    router = (
        (4 * H if a < 4 and not frozen_base else 0)  # fp32 router input, for its gradient
        + 4 * E  # sigmoid scores
        + (4 * E if seq_aux else 0)  # the balancer's sequence-wise aux-loss scores
        + E  # group mask (bool)
        + 24 * K  # top-k indices, weights, normalisation
    )
    inputs, widths = (1, 3) if frozen_experts else (2, 4)
    routed = K * (a * (inputs * H + widths * d["mi"]) + 4 + 24)
    shared = 4 * a * d["mi"] * d["shared"]
    return dense_mlp, post_norm + router + routed + shared


def compiled_unsaved(
    d: dict[str, int], a: int, frozen_base: bool, experts_in_graph: bool
) -> tuple[int, int, int]:
    """(dense layer, MoE layer, final norm) bytes per token that compiled layers do not keep of
    what eager ones do: Inductor's partitioner recomputes cheap results in backward instead of
    saving them. Gone are every RMSNorm's fp32 input copy, one expert-width tensor of each MLP
    (the dense MLP's, the shared experts', and each routed pair's where the experts run inside
    the graph: the sorted experts in bf16, `experts_in_graph`), the kv_a norm's 16-bit output
    (kv_a's output, rope included, is kept instead) and, per MoE layer, a few router tensors.
    LoRA (`frozen_base`) keeps the routed pairs' tensors, the final norm's fp32 copy and one
    more hidden-wide 16-bit tensor per layer and at the head. Read off saved_tensors_hooks on
    CPU (every fast path; hidden 1024 and 2048, both families, LoRA with and without the
    experts, fp32) and held against autograd's count there (tests/unit/plan/test_plan.py)."""
    H, kv, rope = d["H"], d["kv_lora"], d["rope"]
    norm_a, kept = (0, a * H) if frozen_base else (a, 0)
    norms = 4 * (2 * H + d["q_lora"] + kv)  # input and post-attention norms, q_a and kv_a
    attention = norms + norm_a * kv - a * (kv + rope) - kept
    routed = d["K"] * a * d["mi"] if experts_in_graph and not frozen_base else 0
    router = d["E"] + 4 * d["K"] + 24  # a bool group mask (E), fp32 top-k weights (K), 3 int64
    moe = attention + routed + a * d["mi"] * d["shared"] + router
    return attention + a * d["inter"], moe, -a * H if frozen_base else 4 * H


def fp8_unsaved(d: dict[str, int], a: int, recipe: str) -> tuple[int, int]:
    """(dense layer, MoE layer) bytes per token that compiled layers no longer keep with
    train.perf.fp8 (`recipe`): the input of a linear that turned float8 (float8.worthwhile) is
    not saved for its weight gradient when every consumer of that input is such a linear: the
    compiled backward recomputes it (the norm, the cast) from what it keeps anyway. Read off
    saved_tensors_hooks on CPU (bench/saved_activations.py): exactly these inputs leave, at
    hidden 1024, 2048 and 4096, tensorwise and rowwise; tests/unit/plan/test_plan.py holds hidden
    2048 tensorwise. Without compile autograd keeps the same tensors as in bf16."""
    if recipe not in float8.RECIPES:
        return 0, 0
    H, heads, v = d["H"], d["heads"], d["v"]

    def gone(width: int, consumers: list[tuple[int, int]]) -> int:  # (out, in) of each
        return width if all(float8.worthwhile(o, i, recipe) for o, i in consumers) else 0

    q = [(d["q_lora"], H)] if d["q_lora"] else [(heads * d["qk"], H)]
    attention = gone(H, [*q, (d["kv_lora"] + d["rope"], H)])
    if d["q_lora"]:
        attention += gone(d["q_lora"], [(heads * d["qk"], d["q_lora"])])
    attention += gone(d["kv_lora"], [(heads * (d["nope"] + v), d["kv_lora"])])
    attention += gone(heads * v, [(H, heads * v)])
    dense = gone(H, [(d["inter"], H)] * 2) + gone(d["inter"], [(H, d["inter"])])
    shared = d["mi"] * d["shared"]  # the MoE layer's input also feeds the router and experts
    moe = gone(shared, [(H, shared)]) if shared else 0
    return a * (attention + dense), a * (attention + moe)


def expert_padding_rows(pairs: int, experts: int, align: int) -> int:
    """Rows the sorted experts add to `pairs` routed (token, expert) rows when each expert's
    rows start at a multiple of `align` (dsflow.model.fastpaths._pad_groups: a tensor of a fixed
    size, so that nothing about the routing leaves the device): the Triton grouped GEMM's tiles
    (64 rows: fp16, and bf16 outside compute capability 9.x/10.x) and the FP8 experts' groups
    (16)."""
    if not align:
        return 0
    return -(-(pairs + experts * align) // align) * align - pairs


def _routed_row(d: dict[str, int], a: int, frozen_experts: bool, compiled_away: bool) -> int:
    """Bytes autograd keeps per row of the routed experts' GEMMs (a padding row included): the
    rows' inputs and expert-width tensors as `_mlps_per_token` counts them per pair, and the
    int64 slot the padded order holds; one expert-width tensor fewer where the compiled layers
    recompute it (`compiled_unsaved`'s routed term, taken as it is for routed rows). Measured on
    CPU for eager fp16 padding rows (tests/unit/plan/test_plan.py)."""
    inputs, widths = (1, 3) if frozen_experts else (2, 4)
    return a * (inputs * d["H"] + widths * d["mi"]) + 8 - (a * d["mi"] if compiled_away else 0)


def activation_bytes(
    config: Any,
    *,
    seq_len: int,
    micro_batch: int,
    precision: str,
    seq_aux: bool = True,
    ce_chunk: int = 0,
    compiled: bool = False,
    frozen_experts: bool = False,
    frozen_base: bool = False,
    fp8: str = "off",
    experts_in_graph: bool = False,
    mtp_depth: int = 0,
    expert_rows_align: int = 0,
) -> dict[str, Any]:
    """Activation memory of one micro batch, without and with activation checkpointing.
    ``ce_chunk`` > 0: the fused lm_head + cross-entropy (dsflow.model.loss) over chunks of that
    many tokens instead of the full fp32 logits. ``compiled``: the decoder layers and the final
    norm compiled (:func:`compiled_unsaved`). ``frozen_experts``: the routed
    experts' weights do not train (LoRA without the `experts` target); ``frozen_base``: LoRA,
    where the lm_head and the routers never train, so the fused loss makes and keeps no
    gradient for the lm_head, no router keeps its fp32 input and no norm its 16-bit output.
    ``fp8``: train.perf.fp8's recipe; compiled layers then keep less (:func:`fp8_unsaved`).
    ``experts_in_graph``: the routed experts run inside the compiled graphs (the sorted experts
    in bf16), which then keep less of theirs. ``mtp_depth``: the multi-token-prediction depths
    (:func:`mtp_activations`), kept with and without activation checkpointing.
    ``expert_rows_align``: the sorted experts' rows padded per expert
    (:func:`expert_padding_rows`); each MoE layer keeps its padding rows as it keeps a routed
    (token, expert) pair's rows.

    ``saved_*`` is what autograd keeps between forward and backward (what
    ``torch.autograd.graph.saved_tensors_hooks`` sees, parameters excluded); ``peak_*`` adds the
    transient peak on top (the fp32 logits in backward, or one recomputed layer).
    """
    d = presets._dims(config)
    a = bytes_per_element(precision)
    T = micro_batch * seq_len
    H, V, K, E = d["H"], d["V"], d["K"], d["E"]

    norm_a = 0 if frozen_base else a  # the norms' 16-bit copies are for their weights' gradients
    attention = _attention_per_token(config, d, a, norm_a)
    dense_mlp, moe_mlp = _mlps_per_token(d, a, seq_aux, frozen_experts, frozen_base)
    per_tok_dense = _norm(H, norm_a) + attention + dense_mlp
    per_tok_moe = _norm(H, norm_a) + attention + moe_mlp
    rope_per_layer = a * d["rope"] * seq_len  # cos/sin in the activation dtype, per position
    router_weight = 4 * E * H if a < 4 else 0  # fp32 copy of the router weight, per MoE layer
    gone_dense, gone_moe, gone_norm = (
        compiled_unsaved(d, a, frozen_base, experts_in_graph) if compiled else (0, 0, 0)
    )
    fp8_dense, fp8_moe = fp8_unsaved(d, a, fp8) if compiled else (0, 0)
    gone_dense, gone_moe = gone_dense + fp8_dense, gone_moe + fp8_moe
    layer_dense = (per_tok_dense - gone_dense) * T + rope_per_layer
    layer_moe = (per_tok_moe - gone_moe) * T + rope_per_layer + router_weight
    routed_row = _routed_row(
        d, a, frozen_experts, compiled and experts_in_graph and not frozen_base
    )
    layer_moe += expert_padding_rows(T * K, E, expert_rows_align) * routed_row
    layers = d["n_dense"] * layer_dense + d["n_moe"] * layer_moe
    embed = 24 * T + 8 * d["rope"] * seq_len  # ids, targets, embedding indices; fp32 cos/sin
    head = (_norm(H, norm_a) + a * H) * T  # final norm + lm_head input
    logits_saved = 4 * V * T  # fp32 log_softmax output
    logits_peak = 12 * V * T  # backward: saved output + grad in + grad out, all fp32
    if ce_chunk:
        head, logits_saved, logits_peak = _fused_head(d, a, T, min(ce_chunk, T), frozen_base)
    head -= gone_norm * T
    # grouped_mm: routing-weighted expert outputs are fp32 (bf16 x fp32 scores) and are
    # un-permuted into a second fp32 copy: transient, one layer at a time (backward: their grads).
    moe_transient = (8 * H * K * T) if d["n_moe"] else 0
    largest_layer = max(layer_dense if d["n_dense"] else 0, layer_moe if d["n_moe"] else 0)
    # The depths' heads are no larger than the main one: its transient stands for theirs.
    mtp = mtp_activations(
        config, (per_tok_dense, per_tok_moe), a, micro_batch, seq_len, mtp_depth, ce_chunk
    )

    saved_full = embed + layers + mtp + head + logits_saved
    peak_full = embed + layers + mtp + head + max(logits_peak, moe_transient)
    ckpt_inputs = d["L"] * a * H * T  # each checkpointed layer keeps its input only
    saved_ckpt = embed + ckpt_inputs + mtp + head + logits_saved
    peak_ckpt = embed + ckpt_inputs + mtp + head + max(logits_peak, largest_layer + moe_transient)
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
        "mtp": mtp,
        "logits_saved": logits_saved,
        "logits_peak": logits_peak,
        "moe_transient": moe_transient,
        "checkpointed_inputs": ckpt_inputs,
        "saved_no_checkpointing": saved_full,
        "saved_checkpointing": saved_ckpt,
        "peak_no_checkpointing": peak_full,
        "peak_checkpointing": peak_ckpt,
    }


def mtp_activations(
    config: Any,
    per_token: tuple[int, int],
    a: int,
    micro: int,
    seq_len: int,
    depth: int,
    ce_chunk: int,
) -> int:
    """Bytes autograd keeps for `depth` multi-token-prediction depths (dsflow.model.mtp), from
    the (dense, MoE) decoder-layer bytes per token of eager layers: an MTP layer is not
    checkpointed (it is no HF decoder layer), and its compiled graph (fastpaths.compile_layers)
    is counted as eager, an upper bound (compiled layers keep about a quarter less);
    under LoRA it keeps what it keeps in a full fine-tune, its adapters' rank outputs counted
    with the main layers' (dsflow.model.lora.counts). Depth k, on seq_len - k positions (an MoE
    block) or all seq_len (a dense one, its tail ignored: MultiTokenPrediction.states): its
    layer, enorm and hnorm, eh_proj's 2H-wide input, and its head: shared_head.norm, then the
    lm_head's input, fp32 logits and the targets' int64 copy, or the fused loss's gradients."""
    d = presets._dims(config)
    H, V = d["H"], d["V"]
    total = 0
    for k in range(1, depth + 1):
        moe = presets.mtp_layer_is_moe(config, k)
        n = seq_len - k if moe else seq_len
        T = micro * n
        layer = (per_token[1] if moe else per_token[0]) + 2 * _norm(H, a) + 2 * a * H
        router_weight = 4 * d["E"] * H if moe and a < 4 else 0
        if ce_chunk:
            head, saved, _ = _fused_head(d, a, T, min(ce_chunk, T))
        else:
            head, saved = (_norm(H, a) + a * H + 8) * T, 4 * V * T
        total += layer * T + a * d["rope"] * n + router_weight + head + saved
    return total


def _fused_head(
    d: dict[str, int], a: int, T: int, chunk: int, frozen: bool = False
) -> tuple[int, int, int]:
    """(head, saved, peak) bytes of the fused lm_head + cross-entropy: the gradients are made
    in the forward pass, one chunk of fp32 logits at a time, and kept for backward instead of
    any logits: the hidden states' (16-bit) and the lm_head weight's (fp32; none when `frozen`).
    The peak adds one chunk's fp32 logits and their 16-bit gradient, and the weight gradient's
    16-bit product and its fp32 copy while it is added in."""
    H, V = d["H"], d["V"]
    weight_grad = 0 if frozen else 4 * V * H
    saved = a * H * T + weight_grad
    peak = saved + (4 + a) * chunk * V + (0 if frozen else (a + 4) * V * H)
    return _norm(H, 0 if frozen else a) * T, saved, peak


# --------------------------------------------------------------------------- estimate


def _ceil_div(n: int, k: int) -> int:
    return -(-n // k)


def _check(setup: Setup) -> None:
    if setup.zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"zero_stage must be 0..3, got {setup.zero_stage!r}")
    if setup.world < 1 or setup.micro_batch < 1 or setup.seq_len < 1:
        raise ValueError("world, micro_batch and seq_len must be >= 1")
    if setup.offload_optimizer and setup.zero_stage == 0:
        raise ValueError("optimizer offload needs ZeRO stage >= 1")
    if setup.offload_params and setup.zero_stage != 3:
        raise ValueError("parameter offload needs ZeRO-3")
    if setup.offload_device not in ("cpu", "nvme"):
        raise ValueError(f"offload_device must be cpu or nvme, got {setup.offload_device!r}")


def _model_states(P: int, s: Setup) -> tuple[dict[str, int], dict[str, int]]:
    """(per-GPU, per-rank host) bytes of weights, gradients and optimizer states. Under LoRA
    every weight is held as in a full fine-tune (frozen, in the training dtype), and gradients
    and optimizer states exist for the adapters only."""
    w = bytes_per_element(s.precision)  # weight and gradient bytes
    fp32, z = s.precision == "fp32", s.zero_stage
    if z == 3:
        weights = 0 if s.offload_params else w * _ceil_div(P, s.world)
    else:
        weights = w * P
    offloaded_params = w * _ceil_div(P, s.world)
    P = s.lora_adapter or P  # what trains
    part = _ceil_div(P, s.world)  # this rank's partition of it
    if z <= 1:
        grads = w * P
    else:
        grads = 0 if s.offload_optimizer else w * part
    if fp32 and z in (0, 3):
        master = 0  # the optimizer updates the (fp32) weights themselves
    else:
        master = 4 * (P if z == 0 else part)
    adam = 8 * (P if z == 0 else part)
    if z == 0:
        # FP16_Optimizer's fp32 flat gradients; the fused optimizer reads the 16-bit ones.
        grads_fp32 = 0 if fp32 or s.fused else 4 * P
    elif z == 3:
        grads_fp32 = 4 * min(part, DS_SUB_GROUP_SIZE)
    else:
        grads_fp32 = sum(_step_copies(P, s))
    host = {"optimizer": 0, "gradients": 0, "parameters": 0}
    if s.offload_optimizer:
        # On the host: the fp32 master + Adam partitions, an fp32 gradient partition for the CPU
        # optimizer, and a pinned 16-bit staging buffer (ZeRO-1/2: of the updated weights,
        # stage_1_and_2's param_buffer_of_bit16_for_cpu_offload_groups; ZeRO-3: of the
        # gradients, stage3's grad_partitions_flat_buffer).
        host["optimizer"] = master + adam
        host["gradients"] = 4 * part + (w * part if z == 3 else 0)
        if z in (1, 2):
            host["parameters"] += w * part
        master = adam = grads_fp32 = 0
    if s.offload_params:
        host["parameters"] += offloaded_params
    gpu = {"weights": weights, "gradients": grads, "optimizer": master + adam}
    return {**gpu, "gradients_fp32_step": grads_fp32}, host


def _nvme(host: dict[str, int], P: int, s: Setup) -> tuple[dict[str, int], int]:
    """(per-rank host bytes, per-rank swap-file bytes) of offloaded states on NVMe: the states
    CPU offload keeps in host RAM go to swap files, and host RAM keeps DeepSpeed's pinned
    buffers that stage them (one optimizer sub-group per buffer)."""
    swap = sum(host.values())
    part = _ceil_div(P, s.world)
    buffers = {"optimizer": 0, "gradients": 0, "parameters": 0}
    if s.offload_optimizer:
        buffers["optimizer"] = DS_NVME_OPTIMIZER_BUFFERS * 4 * min(part, DS_SUB_GROUP_SIZE)
    if s.offload_params:
        w = bytes_per_element(s.precision)
        buffers["parameters"] = DS_NVME_PARAM_BUFFERS * w * DS_NVME_PARAM_BUFFER_SIZE
    return buffers, swap


def _scattered_gradients(s: Setup) -> bool:
    """ZeRO-1 with gradients that are not contiguous (one rank's default,
    train.zero.contiguous_gradients): backward allocates each 16-bit gradient on its own, among
    the activations."""
    hooks = {"overlap_comm": "auto", "contiguous_gradients": s.contiguous_gradients}
    contiguous = dsconfig.gradient_hooks(hooks, s.zero_stage, s.world, "cuda")[1]
    return s.zero_stage == 1 and not contiguous and not s.offload_optimizer


def _step_copies(P: int, s: Setup) -> list[int]:
    """The gradient copies stage_1_and_2's step (ZeRO-1/2) makes of this rank's partition of
    what trains (of `P` parameters), in the order it makes them: it flattens the 16-bit
    gradients into one tensor and casts that to fp32 (in fp32 the flat copy is the cast); both
    exist at the cast, the fp32 one until the group's optimizer step. Measured on one H200
    (`moe`, micro 4 x 4, ZeRO-1, one rank): peak allocated 22.85 GB = the model states + 6 bytes
    per parameter. None with optimizer offload (the step runs on the host)."""
    if s.zero_stage not in (1, 2) or s.offload_optimizer:
        return []
    part = _ceil_div(s.lora_adapter or P, s.world)
    fp32 = s.precision == "fp32"
    return [4 * part] if fp32 else [bytes_per_element(s.precision) * part, 4 * part]


def _step_not_reused(copies: list[int], freed: int, fwd_bwd: int, s: Setup) -> int:
    """Reserved bytes that the step's gradient copies add on top of forward/backward's peak
    (`fwd_bwd`, of which the activations' `freed` bytes are free again at the step).

    The caching allocator places each copy in the freed memory while it fits there, and
    reserves it anew when not: the flat 16-bit copy takes part of the freed activations and the
    fp32 cast, twice its size, may no longer fit beside it. The freed bytes count as one block:
    the ranks' allocator has `expandable_segments` (dsflow.launch), which maps freed pages
    into one range; without it fragments could hold less. Measured on one H100 (`moe`, ZeRO-2,
    one rank): at micro 4 x 4 (4.7 GB of activations, copies of 2.1 and 4.1 GB) reserved 27.4
    GB at a peak allocation of 23.2; at micro 8 x 2 (9.4 GB of activations: both copies fit)
    reserved 28.6 at 26.83 planned allocated. Where the gradients are scattered
    (`_scattered_gradients`) the activations free memory in pieces between gradients, none
    holds a copy: at micro 8 x 2, ZeRO-1, reserved 31.98 GB at a peak allocation of 25.84, 6
    bytes per parameter apart (docs/performance.md, Planner accuracy). The reduce buckets,
    freed at each backward's end with contiguous gradients, are left out: an upper bound."""
    new = sum(copies)
    if not _scattered_gradients(s):
        left, new = freed, 0
        for size in copies:
            if size <= left:
                left -= size
            else:
                new += size
    return max(0, fwd_bwd + new - max(fwd_bwd, sum(copies)))


def _working_sets(P: int, shapes: tuple, activations: int, s: Setup) -> dict[str, int]:
    """Per-GPU bytes that exist during forward/backward only, besides the model states."""
    w = bytes_per_element(s.precision)
    big_module, _, big_param, _ = shapes
    reduce_bucket = int(s.bucket_sizes[0])
    if s.zero_stage == 0:
        # fused: DeepSpeed flattens the bf16 gradients, then all-reduces an fp32 copy
        buckets = (w + 4 if s.fused else w) * min(P, DS_ALLREDUCE_BUCKET) if s.world > 1 else 0
    elif s.zero_stage in (1, 2):
        # reduce buckets (double-buffered with overlap_comm); the updated partitions are
        # all-gathered in place into the flat 16-bit buffer, so allgather_bucket costs nothing.
        buckets = w * reduce_bucket * (2 if s.overlap_comm else 1)
    else:
        buckets = w * reduce_bucket + w * DS_STAGE3_PREFETCH_BUCKET
    return {
        "activations": activations,
        "buckets": buckets,
        # ZeRO-2 grads arrive whole per parameter before being copied into a bucket and freed;
        # ZeRO-3 gathers a module's parameters and receives its gradient whole.
        "grad_transient": w * big_param if s.zero_stage == 2 else 0,
        "zero3_gathered": 2 * w * big_module if s.zero_stage == 3 else 0,
    }


def inputs(config: Any, setup: Setup) -> dict[str, Any]:
    """The setup as an estimate records it (``fused_optimizer``: whether it counts)."""
    return {
        "seq_len": setup.seq_len,
        "micro_batch": setup.micro_batch,
        "world": setup.world,
        "zero_stage": setup.zero_stage,
        "precision": setup.precision,
        "offload_optimizer": bool(setup.offload_optimizer),
        "offload_params": bool(setup.offload_params),
        "activation_checkpointing": bool(setup.activation_checkpointing),
        "bucket_sizes": [int(b) for b in setup.bucket_sizes],
        "overlap_comm": bool(setup.overlap_comm),
        "contiguous_gradients": setup.contiguous_gradients,
        "seq_aux": bool(setup.seq_aux),
        "fused_optimizer": bool(setup.fused),
        "offload_device": setup.offload_device,
        "nodes": setup.nodes,
        "vocab_size": int(config.vocab_size),
        "lora_adapter": setup.lora_adapter,
        "frozen_experts": setup.frozen_experts,
        "ce_chunk": setup.ce_chunk,
        "compiled": setup.compiles,
        "fp8": setup.fp8,
        "experts_in_graph": setup.experts_in_graph,
        "mtp_depth": setup.mtp_depth,
        "expert_rows_align": setup.rows_align,
    }


def _lora_activations(setup: Setup, tokens: int) -> dict[str, int]:
    """Bytes of what LoRA's adapters keep for backward: the parameter adapters' W + B A copies
    and the module adapters' A outputs, from a layer's forward to its backward; every layer's
    at once, or one recomputed layer's with activation checkpointing."""
    a, ckpt = bytes_per_element(setup.precision), setup.activation_checkpointing
    ranks = setup.lora_rank_outputs_layer if ckpt else setup.lora_rank_outputs
    return {
        "lora_merged": a * (setup.lora_merged_layer if ckpt else setup.lora_merged),
        "lora_rank_outputs": a * ranks * tokens,
    }


def estimate(config: Any, setup: Setup) -> dict[str, Any]:
    """Per-GPU (and host) bytes of training ``config`` laid out as ``setup``; see the module
    doc. ``gpu.total`` is the predicted peak (``max_memory_reserved`` + the fixed overhead).

    With dsflow's fused optimizer (``setup.fused``) there are no fp32 gradient copies; DeepSpeed
    sees an fp32 model, so its all-reduce buckets hold the flattened bf16 gradients and an fp32
    copy of them.
    """
    _check(setup)
    P = presets.param_counts(config, setup.mtp_depth)["total"]
    shapes = largest_module(config)
    states, host = _model_states(P, setup)
    swap = 0
    if setup.offload_device == "nvme" and (setup.offload_optimizer or setup.offload_params):
        host, swap = _nvme(host, P, setup)
    acts = activation_bytes(
        config,
        seq_len=setup.seq_len,
        micro_batch=setup.micro_batch,
        precision=setup.precision,
        seq_aux=setup.seq_aux,
        ce_chunk=setup.ce_chunk,
        compiled=setup.compiles,
        frozen_experts=setup.frozen_experts,
        frozen_base=setup.lora_adapter > 0,
        fp8=setup.fp8,
        experts_in_graph=setup.experts_in_graph,
        mtp_depth=setup.mtp_depth,
        expert_rows_align=setup.rows_align,
    )
    peak = "peak_checkpointing" if setup.activation_checkpointing else "peak_no_checkpointing"
    acts.update(_lora_activations(setup, acts["tokens"]))
    lora_acts = acts["lora_merged"] + acts["lora_rank_outputs"]
    work = _working_sets(P, shapes, acts[peak] + lora_acts, setup)
    persistent = states["weights"] + states["gradients"] + states["optimizer"]
    fwd_bwd = sum(work.values())
    step = states["gradients_fp32_step"]
    allocated = persistent + max(fwd_bwd, step)
    freed = work["activations"] + work["grad_transient"]
    not_reused = _step_not_reused(_step_copies(P, setup), freed, fwd_bwd, setup)
    oh = FRAMEWORK_OVERHEAD
    overhead = oh.gpu_fixed_bytes + int(oh.gpu_fraction * (allocated + not_reused))
    # Host: every rank builds the model in fp32 on CPU (dsflow.model.build) before DeepSpeed
    # casts it and moves it to the GPU; offloaded states replace it afterwards.
    # LoRA loads its frozen base in the training dtype (dsflow.train.engine).
    init_per_rank = (bytes_per_element(setup.precision) if setup.lora_adapter else 4) * P
    host_per_rank = max(init_per_rank, sum(host.values())) + oh.host_per_rank_bytes
    gpu = {
        **states,
        "model_states": persistent + step,
        **work,
        "overhead": overhead,
        "step_not_reused": not_reused,
        "allocated": allocated,
        "total": allocated + overhead + not_reused,
    }
    return {
        "inputs": inputs(config, setup),
        "params": {
            "total": P,
            "largest_module": shapes[0],
            "largest_module_name": shapes[1],
            "largest_param": shapes[2],
            "largest_param_name": shapes[3],
        },
        "gpu": gpu,
        "peak_phase": "optimizer step" if step > fwd_bwd else "forward/backward",
        "activations": acts,
        "host": {
            **host,
            "init_per_rank": init_per_rank,
            "per_rank": host_per_rank,
            "node_total": host_per_rank * setup.ranks_per_node,
        },
        # NVMe offload's swap files: every rank of the node writes its partition.
        "nvme": {"per_rank": swap, "node_total": swap * setup.ranks_per_node},
    }


# --------------------------------------------------------------------------- summary


def checkpoint_bytes(P: int, precision: str, zero_stage: int, trainable: int = 0) -> int:
    """One DeepSpeed checkpoint on disk: the 16-bit module weights (mp_rank_00_model_states.pt;
    not at ZeRO-3, whose fp32 partitions suffice) and every rank's fp32 master + Adam m, v
    partitions (zero_pp_rank_*_optim_states.pt): 2 + 12 = 14 B/param under mixed precision.
    Under LoRA (``trainable`` adapter parameters) both files hold the adapters alone: the
    frozen base is not saved (it is reloaded from model.pretrained on resume)."""
    P = trainable or P
    module = 0 if zero_stage == 3 and not trainable else bytes_per_element(precision) * P
    if precision == "fp32":
        return module + (8 if zero_stage in (0, 3) else 12) * P
    return module + 12 * P


def checkpoints_on_disk(keep: int, steps: int, every: int) -> int:
    """How many checkpoints exist at once at the peak: dsflow saves the new one before pruning
    to ``keep``, so keep + 1, but never more than the run saves (every ``every`` steps, and at
    the end when the last step is not one of those)."""
    saves = steps // every + (1 if steps % every else 0)
    return max(1, min(keep + 1, saves))


def checkpoint_bytes_of(est: dict) -> int:
    """One checkpoint of a run laid out as ``est`` (:func:`checkpoint_bytes`)."""
    inp = est["inputs"]
    P = est["params"]["total"]
    return checkpoint_bytes(P, inp["precision"], inp["zero_stage"], inp["lora_adapter"])


def disk_need(est: dict, checkpoints: int) -> int:
    """Disk a run laid out as ``est`` needs: ``checkpoints`` checkpoints, the exported HF model
    and NVMe offload's swap files."""
    export = bytes_per_element(est["inputs"]["precision"]) * est["params"]["total"]
    return checkpoints * checkpoint_bytes_of(est) + export + est["nvme"]["node_total"]


def summary(
    config: Any,
    *,
    seq_len: int,
    tokens_per_step: int,
    precision: str,
    zero_stage: int,
    keep_checkpoints: int,
    checkpoints: int | None = None,
    trainable: int = 0,
    mtp_depth: int = 0,
) -> dict[str, Any]:
    """Parameter counts, FLOPs (the trainer's MFU formula) and on-disk sizes.

    ``checkpoints``: how many exist at once at the peak (:func:`checkpoints_on_disk`; default
    keep + 1), plus the exported HF model (models/final, safetensors in the training dtype).
    ``trainable``: LoRA's adapter parameters (0: every parameter trains). ``mtp_depth``: the
    multi-token-prediction depths, in the total (as metrics/train.json counts it) and FLOPs.
    """
    counts = presets.param_counts(config, mtp_depth)
    P = counts["total"]
    ckpt = checkpoint_bytes(P, precision, zero_stage, trainable)
    export = bytes_per_element(precision) * P
    checkpoints = keep_checkpoints + 1 if checkpoints is None else checkpoints
    fpt = flops_per_token(config, seq_len, frozen=bool(trainable), mtp_depth=mtp_depth)
    return {
        "params_total": P,
        "params_activated": counts["activated"],
        "params_activated_non_embedding": counts["activated_non_embedding"],
        "params_trainable": trainable or P,
        "flops_per_token": fpt,
        "tokens_per_step": tokens_per_step,
        "flops_per_step": fpt * tokens_per_step,
        "checkpoint_bytes": ckpt,
        "export_bytes": export,
        "keep_checkpoints": keep_checkpoints,
        "checkpoints": checkpoints,
        "disk_bytes": checkpoints * ckpt + export,
    }
