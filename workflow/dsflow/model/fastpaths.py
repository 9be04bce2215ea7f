"""Training fast paths, chosen in params.yaml (`train.perf`); the math stays HF's.

- `attention: flash_padded`: SDPA's flash kernel needs one head dim for Q, K and V, and MLA's
  differ (qk_nope + qk_rope for Q/K, v_head_dim for V). Zero-padding the narrower side is exact:
  softmax(Q K^T) [V, 0] = [softmax(Q K^T) V, 0] and [Q, 0][K, 0]^T = Q K^T (the softmax scale
  is passed explicitly, so the padded width never enters it). The padding is sliced off again.
  `auto` takes it on CPU as well, where SDPA's CPU flash kernel likewise needs one head dim.
- `compile`: torch.compile of every decoder layer ("regional" compilation, as torchtitan does):
  the identical layers share one compiled graph, so compilation takes seconds per layer kind,
  not minutes for the whole model, and the model object, its parameter names and HF export
  stay untouched; on CUDA the fused loss's softmax gradient is compiled too. The expert
  balancer's router hook runs eagerly between the graphs, which splits each MoE layer into
  several; `compile_router_hooks: true` traces it into the layer's
  graph instead (not with activation checkpointing, where the hook must tell recomputations
  apart). On a GPU that gives one graph per layer with `experts: sorted` in bf16 (in other
  dtypes they run eagerly between the graphs: see sorted_experts_forward); HF's grouped_mm
  experts still end a graph at each expert GEMM there. On by default (ignored without compile).
- `ce_chunk`: the lm_head + cross-entropy fused over token chunks (dsflow.model.loss), so the
  [tokens x vocab] logits are never held in full. Its gradients are formed in the forward
  pass; in fp16 at the dynamic loss scale the backward will bring (read from DeepSpeed's
  optimizer before each forward), so small ones do not underflow. `auto` = 8192 tokens, on CPU
  too, and off in fp16 (a chunk size turns it on).
- `fused_grad_checks`: DeepSpeed's gradient overflow check and norm in a few multi-tensor
  launches instead of ~10 per tensor (dsflow.train.fusedgrads; ZeRO-1/2 without CPU offload).
  `auto` turns it on for CUDA where it fits (its gain: docs/performance.md), in fp16 too:
  the loss-scaled gradients are 16-bit tensors whose fp32-accumulated norms are inf or NaN
  exactly where DeepSpeed's check finds an overflow.
- `experts: sorted`: the routed experts as two grouped GEMMs over the tokens sorted by expert,
  like HF's `grouped_mm`, but the token permutation's backward is made of gathers: HF writes
  it as indexing, whose backward is an accumulating scatter (sort-based on CUDA) for the
  dispatch (repeated rows: each token goes to k experts), the routing weights and the
  un-permutation. Each slot of the sort is one (token, k) pair, so the inverse permutation
  turns every scatter into a gather and a sum over a token's k rows. The same fp32 combine of
  the k weighted outputs as HF. The grouped GEMMs are torch's (CUTLASS) in bf16 on compute
  capability 9.x/10.x, else dsflow.model.groupgemm's Triton kernels (fp16; bf16 on 8.x GPUs
  such as the RTX 4090), where torch's would sync with the host in every call. `auto` =
  sorted on CUDA in bf16 and fp16 at ZeRO-0/1/2 (HF's experts elsewhere, and on a GPU below
  SM80 or for another experts layout), HF's on CPU (its gain with the hooks traced:
  docs/performance.md).
- `experts: hf-best` and `liger` (opt-in): maintained kernel libraries as a user of HF plugs
  them in, HF's `sonicmoe` experts and Liger Kernel: dsflow.model.hfkernels.
- `fp8_experts` (opt-in): the sorted experts' two grouped GEMMs in FP8 (torchao's rowwise
  grouped GEMM, SM90), each expert's rows padded with zero rows to a multiple of 16 (at least 16).
- `optimizer: fused`: dsflow's AdamW with fp32 master weights (dsflow.train.masteradam) instead of
  DeepSpeed's bf16 optimizer wrapper: one pass over memory for the whole step, no copies of
  the gradients into fp32 buffers, and no host sync (it skips a non-finite step on the device).
  ZeRO-0 in bf16 only (it partitions nothing; `zero_stage: auto` picks ZeRO-0 where it is
  wanted). `auto` = fused on one GPU, where it is faster than DeepSpeed's ZeRO-1
  (docs/performance.md); DeepSpeed's on several GPUs (unmeasured there) and CPU.
- `device_step`: DeepSpeed's ZeRO-1/2 optimizer step in bf16 without the host syncs of its
  overflow check and clipping (dsflow.train.devicestep): torch's fused AdamW inside it skips a
  non-finite step on the device. `auto` = on for CUDA where it applies (ZeRO-1/2, bf16,
  DeepSpeed's optimizer without offload, no train.ds_config file merged).
- `lean_grad_hooks`: DeepSpeed's ZeRO-1/2 per-parameter gradient copies (into the reduce
  bucket in its backward hook, then into the rank's partition buffer) in fewer launches
  (dsflow.train.gradhooks): the same gradients bit for bit. `auto` = on at ZeRO-1/2 without
  optimizer offload, CPU too.
- `async_metrics`: each step's numbers (loss, gradient norm, expert counts, memory, the stop
  flag) are read back one step late (dsflow.train.metrics), so the host queues the next step
  while the GPU finishes this one instead of waiting for it (docs/performance.md). `auto` = on
  for CUDA.
- `activation_checkpointing`: keep only each decoder layer's input and recompute the rest in
  the backward pass (HF's gradient checkpointing, non-reentrant): less memory for a larger
  micro batch, at the price of one more forward (off by default: it is slower at a given batch).

`resolve` turns the `auto` values into what is on by default: the fast paths on CUDA, off on
CPU, where torch.compile's C++ build time dwarfs the short runs; the padded attention on both.

Both families take every fast path: DeepseekV2ForCausalLM has DeepseekV3ForCausalLM's experts
layout, attention interface, router outputs (logits, weights, indices) and decoder layers.
V2's rotary embedding multiplies complex numbers, which torch.compile keeps in the layer's graph
as eager kernels (inductor generates no code for complex operators).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from dsflow.errors import UsageError
from dsflow.model import float8, hfkernels
from dsflow.params import fp8_on

# HF treats any implementation name containing "flash" as a flash-attn package to import.
FLASH_PADDED = "dsflow_padded_sdpa"
DEFAULT_CE_CHUNK = 8192
SORTED_EXPERTS = "dsflow_sorted"
FP8_EXPERTS = "dsflow_fp8_experts"  # set on an experts module: its grouped GEMMs run in FP8
FP8_GROUP_ROWS = 16  # torch's FP8 grouped GEMM needs every group's rows in multiples of 16
# The Triton grouped GEMM's rows per tile (dsflow.model.groupgemm.BLOCK_M): every expert's rows
# start at a multiple of it. Here, so that the planner reads it without importing groupgemm.
TRITON_GEMM_ROWS = 64
# Set on an experts module: the compute capability of its GPU (None: CPU), for grouped_gemm.
GEMM_CAPABILITY = "dsflow_gemm_capability"
# dsflow.model.groupgemm, imported by use_experts where a GPU may run its kernels: registering
# its torch ops loads torch's compiler (~1.5 s a process), which the launcher, the planner and
# CPU ranks never use.
groupgemm: Any = None
# train.perf with every model-side fast path off: HF's own forward and loss, as the bench's
# baseline and the GPU tests' reference run them.
PLAIN = {
    "compile": False,
    "attention": "sdpa",
    "ce_chunk": 0,
    "prefetch": False,
    "fused_grad_checks": False,
    "experts": "hf",
}


@dataclass(frozen=True)
class Perf:
    compile: bool
    attention: str  # "sdpa" | "flash_padded"
    ce_chunk: int  # tokens per cross-entropy chunk; 0 = full logits
    prefetch: bool
    activation_checkpointing: bool = False
    fused_grad_checks: bool = False
    compile_mode: str = "default"  # torch.compile's mode; "reduce-overhead" adds CUDA graphs
    # "hf" (the model's own implementation) | "sorted" (SORTED_EXPERTS) | "sonicmoe" (HF's,
    # dsflow.model.hfkernels) | "hf-best" (one of the last two, decided by the train stage)
    experts: str = "hf"
    experts_why: str = ""  # why hf-best took the one it did (dsflow.model.hfkernels)
    compile_router_hooks: bool = True  # trace the balancer's router hooks into the graphs
    # experts: auto chose sorted: keep HF's experts where sorted does not apply, not an error
    experts_fallback: bool = False
    optimizer: str = "deepspeed"  # "deepspeed" | "fused" (dsflow.train.masteradam, ZeRO-0 bf16)
    async_metrics: bool = (
        False  # each step's numbers read back one step late (dsflow.train.metrics)
    )
    device_step: bool = False  # ZeRO-1/2 bf16 step decided on the device (train.devicestep)
    lean_grad_hooks: bool = False  # ZeRO-1/2 gradient copies in fewer launches (train.gradhooks)
    fp8: str = "off"  # "off" | a dsflow.model.float8 recipe: "tensorwise" | "rowwise"
    fp8_linears: int = 0  # how many linears apply() turned into float8 ones
    fp8_experts: bool = False  # the routed experts' grouped GEMMs in FP8 (sorted experts)
    liger: bool = False  # Liger Kernel applied as HF's Trainer does (dsflow.model.hfkernels)

    @property
    def hooks_traced(self) -> bool:
        """The balancer's router hooks go into the compiled graphs (fastpaths.apply)."""
        return self.compile and self.compile_router_hooks and not self.activation_checkpointing

    def _optimizer_words(self) -> str:
        if self.optimizer == "fused":
            return "fused AdamW (fp32 masters)"
        return "DeepSpeed's, its step on the device" if self.device_step else "DeepSpeed"

    def describe(self) -> str:
        return (
            f"compile {f'on ({self.compile_mode})' if self.compile else 'off'}, "
            f"attention {self.attention}, "
            f"cross-entropy {f'fused, {self.ce_chunk}-token chunks' if self.ce_chunk else 'full logits'}, "
            f"prefetch {'on' if self.prefetch else 'off'}, "
            f"activation checkpointing {'on' if self.activation_checkpointing else 'off'}, "
            f"fused gradient checks {'on' if self.fused_grad_checks else 'off'}, "
            f"experts {self.experts}{' where it applies' if self.experts_fallback else ''}, "
            f"router hooks {'compiled' if self.hooks_traced else 'eager'}, "
            f"optimizer {self._optimizer_words()}"
            f"{', lean gradient hooks' if self.lean_grad_hooks else ''}, "
            f"step metrics {'read one step late' if self.async_metrics else 'read at once'}, "
            f"FP8 {f'{self.fp8} on {self.fp8_linears} linears' if self.fp8 != 'off' else 'off'}"
            f"{', FP8 routed experts (rowwise)' if self.fp8_experts else ''}"
            f"{', Liger Kernel (RMSNorm, SwiGLU, fused MoE, fused cross-entropy)' if self.liger else ''}"
        )


def resolve(
    perf: dict,
    device_type: str,
    zero_stage: int = 2,
    precision: str = "bf16",
    optimizer_offload: bool = False,
    world: int = 1,
    user_config: bool = False,
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
    # On CPU too: there SDPA's math kernel is MLA's, which materializes the scores; padded,
    # its flash kernel for CPU runs (the `tiny` preset's step on 3 CPU ranks 13% shorter).
    attention = pick("attention", "flash_padded", "flash_padded")
    # In fp16 the fused loss forms its gradients at the coming backward's loss scale
    # (TrainingLM.loss_scale), so they underflow no more than the plain path's; `auto` leaves
    # it off there, as the planner counts it (its fp32 weight-gradient buffer outweighs the
    # logits for the largest vocabularies at micro 1), and a chunk size turns it on. On CPU
    # too: the `tiny` main job's step on 3 CPU ranks 4.5% shorter (docs/performance.md).
    ce_chunk = perf.get("ce_chunk", "auto")
    if ce_chunk == "auto":
        ce_chunk = 0 if precision == "fp16" else DEFAULT_CE_CHUNK
    liger = bool(perf.get("liger", False))
    if liger:
        ce_chunk = _liger_ce_chunk(perf)
    # With the router hooks traced, the sorted experts shorten the MoE step in bf16 and fp16
    # at ZeRO-0/1/2 (docs/performance.md). In fp32 they run eagerly between the compiled
    # graphs (sorted_experts_forward), unmeasured for speed, while HF's compiled fp32 experts
    # are exact on a GPU; ZeRO-3's parameter gathering is untested. There, and on CPU, auto
    # keeps HF's.
    experts_auto = perf.get("experts", "auto") == "auto"
    tested = precision in ("bf16", "fp16") and zero_stage in (0, 1, 2)
    experts = ("sorted" if cuda and tested else "hf") if experts_auto else perf["experts"]
    if liger:
        experts = _liger_experts(perf)
    optimizer = optimizer_choice(
        perf, zero_stage, precision, optimizer_offload, cuda, world, user_config
    )
    return Perf(
        compile=compile_,
        attention=attention,
        ce_chunk=int(ce_chunk),
        prefetch=bool(perf.get("prefetch", True)),
        activation_checkpointing=bool(perf.get("activation_checkpointing", False)),
        fused_grad_checks=fused_grad_checks(perf, zero_stage, optimizer_offload, cuda),
        compile_mode=perf.get("compile_mode", "default"),
        experts=experts,
        experts_fallback=experts_auto and experts == "sorted",
        liger=liger,
        compile_router_hooks=bool(perf.get("compile_router_hooks", True)),
        optimizer=optimizer,
        device_step=device_step_choice(
            perf, zero_stage, precision, optimizer, optimizer_offload, cuda, user_config
        ),
        lean_grad_hooks=lean_grad_hooks(perf, zero_stage, optimizer_offload),
        async_metrics=bool(pick("async_metrics", True, False)),
        fp8=fp8_choice(perf, zero_stage, precision),
        fp8_experts=bool(perf.get("fp8_experts")) and fp8_allowed(perf, zero_stage, precision),
    )


def _liger_ce_chunk(perf: dict) -> int:
    """With Liger Kernel, its fused lm_head + cross-entropy in HF's forward, not dsflow's."""
    if perf.get("ce_chunk", "auto") not in ("auto", 0):
        raise UsageError(
            "train.perf.liger: true brings Liger's fused lm_head + cross-entropy; "
            "set train.perf.ce_chunk: auto or 0"
        )
    return 0


def _liger_experts(perf: dict) -> str:
    """With Liger Kernel, its fused MoE replaces the routed experts' forward: HF's stay below
    it, and dsflow's sorted experts would never run."""
    if perf.get("experts", "auto") == "sorted":
        raise UsageError(
            "train.perf.liger: true replaces the routed experts with Liger's fused MoE; "
            "set train.perf.experts: auto or hf"
        )
    return "hf"


def fp8_choice(perf: dict, zero_stage: int, precision: str) -> str:
    """`train.perf.fp8`, opt-in: where it runs (dsflow.model.float8) or one line why not."""
    recipe = perf.get("fp8") or "off"  # false (YAML's off too) = off
    if recipe != "off":
        fp8_allowed({"fp8": recipe}, zero_stage, precision)
    return recipe


def fp8_allowed(perf: dict, zero_stage: int, precision: str) -> bool:
    """True, or one line why FP8 (`train.perf.fp8` or `fp8_experts`, whichever is on) cannot
    run with this precision and ZeRO stage."""
    key, value = fp8_on(perf)[0]
    recipe, off = f"train.perf.{key}: {value}", f"train.perf.{key}: false"
    if precision != "bf16":
        # torchao scales each tensor into FP8 itself; fp16's dynamic loss scale is untested
        # with it, and its rowwise GEMM has no fp32 output below SM90.
        raise UsageError(
            f"{recipe} needs train.precision: bf16 (this run has {precision}); "
            f"set train.precision: bf16 or {off}"
        )
    if zero_stage == 3:
        # ZeRO-3 gathers each weight in module hooks; torchao's float8 linears under them are
        # untested (torchtitan runs them under FSDP2 with an FP8 all-gather instead).
        raise UsageError(
            f"{recipe} is not supported with ZeRO-3 (untested with DeepSpeed's partitioned "
            f"weights); use train.zero_stage 0, 1 or 2, or {off}"
        )
    return True


def optimizer_choice(
    perf: dict,
    zero_stage: int,
    precision: str,
    optimizer_offload: bool,
    cuda: bool,
    world: int = 1,
    user_config: bool = False,
) -> str:
    """`train.perf.optimizer`: dsflow's fused AdamW where it applies (ZeRO-0, bf16, the optimizer
    on the device); `auto` takes it on one GPU (faster than DeepSpeed's ZeRO-1 there,
    docs/performance.md; on several GPUs ZeRO-0 would hold a full optimizer state on each,
    and it is unmeasured there) and DeepSpeed's elsewhere: on
    CPU, where the fused one is torch's AdamW, the same as DeepSpeed's, and with a DeepSpeed
    config file of the user's merged (`user_config`: its settings are for DeepSpeed's)."""
    value = perf.get("optimizer", "auto")
    fits = zero_stage == 0 and precision == "bf16" and not optimizer_offload
    if value == "auto":
        return "fused" if cuda and world == 1 and fits and not user_config else "deepspeed"
    if value == "fused" and not fits:
        raise UsageError(
            "train.perf.optimizer: fused needs train.zero_stage 0 (or auto, where ZeRO-0 fits) "
            f"and train.precision bf16 without optimizer offload (this run has "
            f"ZeRO-{zero_stage}, {precision}); set those, or train.perf.optimizer: deepspeed"
        )
    return value


def device_step_choice(
    perf: dict,
    zero_stage: int,
    precision: str,
    optimizer: str,
    optimizer_offload: bool,
    cuda: bool,
    user_config: bool,
) -> bool:
    """`train.perf.device_step`: on for CUDA where it applies; `true` insists (CPU too: the
    tests), `false` never. A merged train.ds_config file keeps DeepSpeed's own step under auto
    (its settings are for DeepSpeed's optimizer)."""
    value = perf.get("device_step", "auto")
    fits = (
        zero_stage in (1, 2)
        and precision == "bf16"
        and optimizer == "deepspeed"
        and not optimizer_offload
    )
    if value == "auto":
        return fits and cuda and not user_config
    if value and not fits:
        raise UsageError(
            "train.perf.device_step: true needs train.zero_stage 1 or 2, train.precision bf16, "
            "train.perf.optimizer deepspeed and no optimizer offload (this run has "
            f"ZeRO-{zero_stage}, {precision}, optimizer {optimizer}"
            f"{', optimizer offload' if optimizer_offload else ''}); set it to auto or false"
        )
    return bool(value)


def lean_grad_hooks(perf: dict, zero_stage: int, optimizer_offload: bool) -> bool:
    """On wherever it fits, CPU too: the same gradients bit for bit with fewer dispatches.
    Whether DeepSpeed hooks each gradient at all (ZeRO-2; ZeRO-1 with overlap_comm) is its
    engine's choice: train.gradhooks.install finds out."""
    return _zero_optimizer_knob(perf, "lean_grad_hooks", zero_stage, optimizer_offload, True)


def fused_grad_checks(perf: dict, zero_stage: int, optimizer_offload: bool, cuda: bool) -> bool:
    """On for CUDA where it fits (bf16, fp16 and fp32); `true` insists, `false` never. On CPU
    the per-tensor launches it saves cost little."""
    return _zero_optimizer_knob(perf, "fused_grad_checks", zero_stage, optimizer_offload, cuda)


def _zero_optimizer_knob(
    perf: dict, key: str, zero_stage: int, optimizer_offload: bool, auto: bool
) -> bool:
    """A knob of DeepSpeed's ZeRO-1/2 optimizer on the device (only it has the per-tensor work
    these replace): `auto` = `auto` where it fits, `true` insists, `false` never."""
    value = perf.get(key, "auto")
    fits = zero_stage in (1, 2) and not optimizer_offload
    if value == "auto":
        return fits and auto
    if value and not fits:
        where = "train.offload.optimizer" if optimizer_offload else f"train.zero_stage {zero_stage}"
        raise UsageError(
            f"train.perf.{key}: true needs ZeRO stage 1 or 2 without optimizer "
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
    """torch.compile each decoder layer, each multi-token prediction depth (`model.mtp`, a
    decoder layer behind its norms and projection) and the final norm in place (parameter
    names unchanged)."""
    import torch._dynamo

    mtp = getattr(model, "mtp", None)
    layers = [*model.model.layers, *(mtp.layers.values() if mtp is not None else ())]
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


class CompileWatch:
    """What torch.compile did in this process, for the train stage's log: dynamo's graph breaks
    (its own counter) and the compilations it started after `mark()`. The train loop marks
    after the first step, when every graph of the run exists (validation runs eagerly), so a
    later compilation is a recompile: a guard failed, and the step ran slower while it built."""

    def __init__(self):
        from torch._dynamo import callback

        self.compiles = 0
        self.marked: int | None = None
        self.reported: tuple[int, int] = (0, 0)
        callback.callback_handler.register_start_callback(self._started)

    def _started(self, args: Any) -> None:
        from torch._dynamo.callback import CallbackTrigger

        # A lazily compiled backward or a CUDA graph recording is no new graph.
        if args.callback_trigger == CallbackTrigger.DYNAMO:
            self.compiles += 1

    def mark(self) -> None:
        self.marked = self.compiles

    def counts(self) -> tuple[int, int]:
        """(graph breaks, recompiles after the mark)."""
        from torch._dynamo.utils import counters

        breaks = sum(counters["graph_break"].values())
        return breaks, 0 if self.marked is None else self.compiles - self.marked

    def news(self) -> str | None:
        """One line on graph breaks and recompiles not reported yet; None when there are none."""
        from torch._dynamo.utils import counters

        breaks, recompiles = self.counts()
        if (breaks, recompiles) == self.reported or (breaks, recompiles) == (0, 0):
            return None
        self.reported = (breaks, recompiles)
        reasons = counters["graph_break"].most_common(1)
        top = f"; most often: {reasons[0][0].splitlines()[0][:160]}" if reasons else ""
        return (
            f"torch.compile: {breaks} graph break(s) in {len(counters['graph_break'])} "
            f"place(s), {recompiles} recompile(s) after the first step{top}"
        )


class _Dispatch(torch.autograd.Function):
    """x[order // k]: each token's row once per expert it goes to, the experts in order.

    `order` sorts the flattened (token, k) slots by expert and `inverse` undoes it, so the
    gradient is a gather through `inverse` and a sum over each token's k rows (autograd's
    backward of the same indexing would scatter-add into repeated rows). A padded `order`
    (longer than `inverse`, see _pad_groups) holds the sentinel slot `inverse.numel()` in its
    padding rows, which read a zero row."""

    @staticmethod
    def forward(ctx, x, order, inverse, top_k):
        ctx.save_for_backward(inverse)
        ctx.top_k = top_k
        return _with_zero_row(x, order, inverse).index_select(0, order // top_k)

    @staticmethod
    def backward(ctx, grad):
        (inverse,) = ctx.saved_tensors
        tokens = inverse.numel() // ctx.top_k
        per_token = grad.index_select(0, inverse).view(tokens, ctx.top_k, -1)
        return per_token.sum(1), None, None, None


class _Combine(torch.autograd.Function):
    """out[t] = sum_k weights[t, k] * rows[inverse[t * k_all + k]]: the expert outputs (rows,
    in expert order) back in token order, weighted and summed in fp32 as HF's grouped_mm path
    does; both gradients are gathers (a padding row of a padded `order` gets a zero gradient)."""

    @staticmethod
    def forward(ctx, rows, weights, order, inverse, dtype):
        tokens, top_k = weights.shape
        per_token = rows.index_select(0, inverse).view(tokens, top_k, -1)
        out = (per_token.float() * weights.float().unsqueeze(-1)).sum(1)
        ctx.save_for_backward(rows, weights, order, inverse)
        return out.to(dtype)

    @staticmethod
    def backward(ctx, grad):
        rows, weights, order, inverse = ctx.saved_tensors
        tokens, top_k = weights.shape
        grad = grad.float()
        per_token = rows.index_select(0, inverse).view(tokens, top_k, -1)
        grad_weights = (per_token.float() * grad.unsqueeze(1)).sum(-1)
        slot_weight = _with_zero_row(weights.reshape(-1), order, inverse).index_select(0, order)
        grad_rows = _with_zero_row(grad, order, inverse).index_select(0, order // top_k)
        grad_rows = grad_rows * slot_weight.float().unsqueeze(-1)
        return grad_rows.to(rows.dtype), grad_weights.to(weights.dtype), None, None, None


def _with_zero_row(x: torch.Tensor, order: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
    """`x` with a zero row appended where `order` is padded (its sentinel slot reads it)."""
    if order.numel() == inverse.numel():
        return x
    return torch.cat([x, x.new_zeros((1, *x.shape[1:]))])


def _pad_groups(
    sorted_experts: torch.Tensor, order: torch.Tensor, offsets: torch.Tensor, align: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each expert's rows padded to a multiple of `align` (FP8 grouped GEMMs need 16), at least
    `align` rows (no group is empty: whether the GEMM writes an empty group's weight gradient is
    not relied on), on the device and of a fixed size (no host sync, one compiled shape):
    (padded order, where each sorted slot went, padded group ends). The padding rows hold the
    sentinel slot `order.numel()`; the last group runs to the end, so every row is in a group
    and is finite."""
    n = order.numel()
    counts = torch.diff(offsets, prepend=offsets.new_zeros(1))
    padded = ((counts + align - 1) // align * align).clamp_min(align)
    size = -(-(n + offsets.numel() * align) // align) * align
    ends = torch.cumsum(padded, 0, dtype=torch.int32)
    shift = (ends - padded) - (offsets - counts)  # padded start - start, per expert
    ends[-1] = size
    where = torch.arange(n, device=order.device) + shift.long().index_select(0, sorted_experts)
    padded_order = torch.full((size,), n, dtype=order.dtype, device=order.device)
    return padded_order.scatter(0, where, order), where, ends


def _grouped_mm(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """x (rows, in) @ weight[e] (in, out) for the rows of expert e (ends at offsets[e])."""
    gmm = getattr(F, "grouped_mm", None) or torch._grouped_mm
    if weight.dtype == torch.bfloat16:
        # torch's grouped GEMM (CUDA SM80+, CPU), called directly: HF's dispatcher asks
        # torch.cuda.get_device_capability on every call, which torch.compile cannot trace, so
        # on a GPU each expert GEMM would end a compiled graph (use_experts checks the GPU).
        return gmm(x.to(weight.dtype), weight, offs=offsets)
    from transformers.integrations import moe

    # Other dtypes run eagerly (sorted_experts_forward): HF's dispatcher picks torch's kernel
    # or its own differentiable fallback.
    hf = getattr(moe, "_grouped_mm", None)
    if hf is not None:
        return hf(x, weight, offs=offsets)
    return gmm(x.to(weight.dtype), weight, offs=offsets)


def sorted_experts_forward(
    self: Any,
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    weights: dict[str, torch.Tensor] | None = None,
) -> torch.Tensor:
    """HF experts interface (DeepseekV3Experts, DeepseekV2Experts): the routed experts' output
    per token. Inside a compiled layer in bf16, and with the Triton GEMMs (_triton_gemm: fp16
    on a GPU): traced by torch 2.11's dynamo on an H200 (any backend, even "eager"), the fp32
    experts through torch's grouped GEMM got zero weight gradients and passed none back to the
    router or the layers below, while the forward was exact; so fp32 runs them eagerly between
    the layer's graphs (then exact, as in bf16 compiled). `weights`: any of gate_up_proj and
    down_proj to use instead of the module's (LoRA's adapted weights)."""
    if self.gate_up_proj.dtype != torch.bfloat16 and not _triton_gemm(self):
        return _sorted_experts_eager(self, hidden_states, top_k_index, top_k_weights, weights)
    return _sorted_experts(self, hidden_states, top_k_index, top_k_weights, weights)


def _sorted_experts(
    self: Any,
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    weights: dict[str, torch.Tensor] | None = None,
) -> torch.Tensor:
    top_k = top_k_index.shape[-1]
    sorted_experts, order = torch.sort(top_k_index.reshape(-1), stable=True)
    # The end of each expert's rows; from the sorted ids, so no count leaves the device.
    ends = torch.arange(1, self.num_experts + 1, device=order.device, dtype=sorted_experts.dtype)
    offsets = torch.searchsorted(sorted_experts, ends, out_int32=True)
    if getattr(self, FP8_EXPERTS, False):
        gmm = _fp8_grouped_mm
        padded, rows_of, offsets = _pad_groups(sorted_experts, order, offsets, FP8_GROUP_ROWS)
    elif _triton_gemm(self):
        gmm = groupgemm.grouped_mm  # every expert's rows start at a multiple of its tile
        padded, rows_of, offsets = _pad_groups(sorted_experts, order, offsets, groupgemm.BLOCK_M)
    else:
        gmm, padded, rows_of = _grouped_mm, order, torch.arange(order.numel(), device=order.device)
    # Slot (token, k) -> its row: the inverse of the sort (through the padding, if any).
    inverse = torch.empty_like(order).scatter_(0, order, rows_of)
    rows = _Dispatch.apply(hidden_states, padded, inverse, top_k)
    gate_up = (weights or {}).get("gate_up_proj", self.gate_up_proj)
    down_proj = (weights or {}).get("down_proj", self.down_proj)
    up = gmm(rows, gate_up.transpose(-2, -1), offsets)
    down = gmm(self._apply_gate(up), down_proj.transpose(-2, -1), offsets)
    return _Combine.apply(down, top_k_weights, padded, inverse, hidden_states.dtype)


def _fp8_grouped_mm(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """`_grouped_mm` in FP8: torchao's rowwise-scaled grouped GEMM (torch's
    `_scaled_grouped_mm`, compute capability 9.0) on groups padded to 16 rows; its backward
    computes both gradients in FP8 too. Imported by use_fp8_experts, not while tracing."""
    return _FP8_GMM(x, weight, offsets, torch.bfloat16, pad_token_groups_for_grouped_mm=False)


_FP8_GMM: Any = None


def _torchao_fp8_grouped_mm() -> Any:
    """torchao's differentiable FP8 grouped GEMM, or None where torchao is not installed."""
    try:
        from torchao.prototype.moe_training.fp8_grouped_mm import (
            _to_fp8_rowwise_then_scaled_grouped_mm as fp8_gmm,
        )
    except ImportError:
        return None
    return fp8_gmm


def _sorted_experts_eager(*args: Any) -> torch.Tensor:
    """_sorted_experts outside torch.compile's graphs (sorted_experts_forward says why). use_experts
    puts the wrapped function here before any layer is compiled: torch.compiler.disable imports
    dynamo (~1.6 s a process), which the launcher and the planner never need."""
    _wrap_eager_experts()
    return _sorted_experts_eager(*args)


def _wrap_eager_experts() -> None:
    global _sorted_experts_eager
    _sorted_experts_eager = torch.compiler.disable(_sorted_experts)


def use_experts(
    model: Any, experts: str, fallback: bool = False, device: Any = None, capability: Any = None
) -> str:
    """Route the model's experts through `experts` ("hf": leave them as built); the one in use.
    Where the sorted experts do not apply, `fallback` keeps HF's, else a UsageError says why.
    Their grouped GEMMs are chosen by the GPU they train on (`device`, None: the model's), or
    by `capability` where given (the tests fake a GPU's): :func:`grouped_gemm`."""
    if not getattr(model.config, "n_routed_experts", 0):
        return "hf"
    if experts == "sonicmoe":
        hfkernels.use_sonicmoe(model)
        return "sonicmoe"
    if experts != "sorted":  # "hf", and an undecided "hf-best": HF's default
        return "hf"
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    refusal = _sorted_experts_refusal(model)
    if refusal is not None:
        if fallback:
            return "hf"
        raise UsageError(
            f"train.perf.experts: sorted {refusal}; set train.perf.experts: auto or hf"
        )
    _wrap_eager_experts()
    ALL_EXPERTS_FUNCTIONS.register(SORTED_EXPERTS, sorted_experts_forward)
    model.set_experts_implementation(SORTED_EXPERTS)
    on = torch.device(device or next(model.parameters()).device)
    if capability is None and on.type == "cuda":
        capability = torch.cuda.get_device_capability(on)
    if capability is not None:
        _import_groupgemm()
    for module in model.modules():
        if hasattr(module, "gate_up_proj"):
            setattr(module, GEMM_CAPABILITY, None if capability is None else tuple(capability))
    return "sorted"


def _import_groupgemm() -> None:
    global groupgemm
    from dsflow.model import groupgemm as module

    groupgemm = module


# torch's grouped GEMM has its one fast kernel (CUTLASS) for bf16 on these compute capabilities.
TORCH_GROUPED_GEMM_MAJORS = (9, 10)


def grouped_gemm(dtype: torch.dtype, capability: tuple[int, int] | None) -> str:
    """Whose grouped GEMMs the sorted experts call on a GPU of `capability` (None: CPU):
    torch's where it has its fast kernel, and on CPU; dsflow.model.groupgemm's Triton kernels
    for fp16 and bf16 elsewhere on a GPU, where torch's falls back to a GEMM per expert behind
    a host sync. fp32 keeps torch's (it runs eagerly: sorted_experts_forward)."""
    if capability is None or dtype not in (torch.float16, torch.bfloat16):
        return "torch"
    fast = dtype == torch.bfloat16 and capability[0] in TORCH_GROUPED_GEMM_MAJORS
    return "torch" if fast else "triton"


def _triton_gemm(experts: Any) -> bool:
    """Whether this experts module's grouped GEMMs are the Triton ones (its weights' dtype is
    known only once DeepSpeed has cast them; a constant to torch.compile)."""
    capability = getattr(experts, GEMM_CAPABILITY, None)
    return grouped_gemm(experts.gate_up_proj.dtype, capability) == "triton"


# torchao's FP8 grouped GEMM is written for Hopper; torch refuses or fails on other majors.
FP8_EXPERTS_GPU = "needs torch's FP8 grouped GEMM: a GPU of compute capability 9.x (H100, H200)"
FP8_EXPERTS_TORCHAO = "needs torchao, which is not installed (pip install 'dsflow[fp8]')"


def _fp8_experts_refused(why: str) -> UsageError:
    return UsageError(f"train.perf.fp8_experts: true {why}; set train.perf.fp8_experts: false")


def check_fp8_experts_machine(device: str, gpus: list[dict]) -> None:
    """`train.perf.fp8_experts`'s device, GPUs and torchao, in one line before the launch (the
    model's own conditions are checked where it is built: use_fp8_experts)."""
    why = FP8_EXPERTS_TORCHAO if _torchao_fp8_grouped_mm() is None else ""
    if device != "cuda":
        why = f"{FP8_EXPERTS_GPU}, and this run is on the {device}"
    for gpu in gpus:
        if tuple(gpu.get("capability", (9,)))[:1] != (9,):
            why = f"{FP8_EXPERTS_GPU}, and GPU {gpu['index']} ({gpu['name']}) is not"
    if why:
        raise _fp8_experts_refused(why)


def use_fp8_experts(model: Any, experts: str, device: Any = None) -> None:
    """The routed experts' grouped GEMMs in FP8 (_fp8_grouped_mm), or one line why not: they
    need the sorted experts, torch's FP8 grouped GEMM (CUDA, compute capability 9.x) and
    expert widths that are multiples of 16 (its shape rule)."""
    config = model.config
    on = torch.device(device or next(model.parameters()).device)
    widths = (config.hidden_size, getattr(config, "moe_intermediate_size", 0))
    banks = [m for m in model.modules() if hasattr(m, "gate_up_proj")]
    why = ""
    if not banks:
        why = "needs a model with routed experts (this one is all dense)"
    elif experts != "sorted":
        why = "needs the sorted experts (train.perf.experts: auto on a GPU, or sorted)"
    elif on.type != "cuda" or torch.cuda.get_device_capability(on)[0] != 9:
        why = FP8_EXPERTS_GPU
    elif any(w % FP8_GROUP_ROWS for w in widths):
        why = f"needs hidden_size and moe_intermediate_size in multiples of 16, not {widths}"
    elif (gmm := _torchao_fp8_grouped_mm()) is None:
        why = FP8_EXPERTS_TORCHAO
    if why:
        raise _fp8_experts_refused(why)
    global _FP8_GMM
    _FP8_GMM = gmm
    for module in banks:
        setattr(module, FP8_EXPERTS, True)


# The sorted experts' grouped GEMMs (torch's, or the Triton ones) need this compute capability.
GROUPED_GEMM_CAPABILITY = (8, 0)


def experts_in_graph(experts: str, precision: str, capabilities: list[tuple[int, int]]) -> bool:
    """Whether the routed experts run inside the compiled layers, as the train stage sets them
    up with `experts` resolved (:func:`resolve`) on GPUs of these compute capabilities: the
    sorted experts in bf16 or fp16 (fp32 runs them eagerly between the graphs:
    sorted_experts_forward), on GPUs that have a grouped GEMM (below it `auto` keeps HF's:
    _sorted_experts_refusal)."""
    has_gemm = all(tuple(c) >= GROUPED_GEMM_CAPABILITY for c in capabilities)
    return experts == "sorted" and precision in ("bf16", "fp16") and has_gemm


def _sorted_experts_refusal(model: Any) -> str | None:
    """Why the sorted experts cannot run this model here (the rest of a one-line message), or
    None: they need torch's grouped GEMM (CPU, or a GPU of compute capability 8.0+) and
    DeepseekV3Experts' weight layout (DeepseekV2Experts' is the same)."""
    if torch.cuda.is_available() and torch.cuda.get_device_capability() < GROUPED_GEMM_CAPABILITY:
        return "needs a grouped GEMM (a GPU of compute capability 8.0 or newer)"
    # Other HF experts may carry biases, transposed weights, a post-expert norm or
    # expert-parallel sentinel rows, which this path does not do.
    flags = ("has_bias", "is_transposed", "has_post_expert_norm", "_is_expert_parallel")
    for module in model.modules():
        if hasattr(module, "gate_up_proj") and any(getattr(module, f, False) for f in flags):
            return (
                f"does not support {type(module).__name__}'s layout (biases, transposed "
                "weights, a post-expert norm or expert parallelism)"
            )
    return None


def apply(model: Any, perf: Perf, balancer: Any = None, device: Any = None) -> Perf:
    """Everything in `perf` that acts on the model itself (not the loss or the data); with
    `compile_router_hooks`, the expert balancer's router hooks (dsflow.model.balance) go into the
    compiled graphs, counting on `device` (the training device; None: the model's). Returns
    `perf` as applied: `experts` is HF's where `auto`'s sorted experts did not apply."""
    use_attention(model, perf.attention)
    experts = use_experts(model, perf.experts, perf.experts_fallback, device)
    if perf.liger:
        hfkernels.use_liger(model)
    perf = dataclasses.replace(perf, experts=experts, experts_fallback=False)
    if perf.fp8_experts:
        use_fp8_experts(model, experts, device)
    if perf.fp8 != "off":
        # Before compile, so the float8 casts are traced into the layers' graphs.
        on_gpu = (device or next(model.parameters()).device).type == "cuda"
        count = float8.convert(model, perf.fp8, emulate=not on_gpu)
        perf = dataclasses.replace(perf, fp8_linears=count)
    if perf.activation_checkpointing:
        # Non-reentrant: the recomputation keeps autograd for the balancer's aux loss.
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if perf.compile:
        if perf.hooks_traced and balancer is not None:
            balancer.trace_hooks(device)
        compile_layers(model, perf.compile_mode)
    return perf
