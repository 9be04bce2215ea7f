"""From a run spec to a DeepSpeed engine: the model (fresh or pretrained), the expert balancer,
the fast paths, the optimizer, and DeepSpeed around them."""

from __future__ import annotations

import contextlib
import dataclasses
import random
import sys
from typing import Any

import numpy as np
import torch

from dsflow.data.shards import ShardReader
from dsflow.model import balance, fastpaths, source
from dsflow.model.balance import ExpertBalancer
from dsflow.model.build import build_model
from dsflow.model.loss import TrainingLM, evaluate_loss
from dsflow.model.presets import model_config
from dsflow.train import devicestep, fusedgrads, gradhooks
from dsflow.train.masteradam import MasterAdamW
from dsflow.train.metrics import all_sum
from dsflow.train.runspec import RunSpec


@dataclasses.dataclass
class Run:
    """What one rank trains with."""

    engine: Any  # deepspeed.DeepSpeedEngine around TrainingLM(model)
    model: Any  # the HF model (engine.module.model)
    balancer: ExpertBalancer
    perf: fastpaths.Perf
    optimizer: MasterAdamW | None  # dsflow's fused optimizer; None: DeepSpeed's own
    device: torch.device
    rank: int
    world: int
    adapter: Any = None  # train.finetune lora: the PEFT model around `model` (its adapters)

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    @property
    def cuda_graphs(self) -> bool:
        return self.perf.compile and self.perf.compile_mode in ("reduce-overhead", "max-autotune")

    @property
    def applied_on_device(self) -> bool:
        """The fused optimizer's kernel path, or DeepSpeed's step with train.perf.device_step,
        decides on the device whether it took a step (no host sync); the engine is not told."""
        if self.perf.device_step:
            return True
        return self.optimizer is not None and self.optimizer._triton(self.device)

    def applied(self) -> torch.Tensor | None:
        """With applied_on_device: whether the last step was taken, a bool on the device."""
        if self.perf.device_step:
            return devicestep.applied(self.engine.optimizer)
        return self.optimizer.applied

    def validate(self, spec: RunSpec, reader: ShardReader) -> float:
        """Mean validation loss over every rank's share of train.eval_batches batches."""
        # Validation is a small share of the run: eager, instead of compiling a no-grad graph.
        stance = (
            torch.compiler.set_stance("force_eager")
            if self.perf.compile
            else contextlib.nullcontext()
        )
        with stance:
            total, count = evaluate_loss(
                self.engine.module,  # through DeepSpeed's module: ZeRO-3 hooks gather weights
                reader,
                micro=spec.micro,
                device=self.device,
                rank=self.rank,
                world=self.world,
                max_windows=spec.eval_batches * spec.micro * self.world,
                # ZeRO-3 gathers parameters inside every forward: all ranks must run as many.
                lockstep=spec.zero3,
            )
        total, count = all_sum([total, count], self.device)
        return total / count


def build(spec: RunSpec, rank: int, device: torch.device) -> Run:
    """The model, its fast paths and optimizer, wrapped by DeepSpeed; seeded from params.seed."""
    import deepspeed

    random.seed(spec.seed)
    np.random.seed(spec.seed)
    torch.manual_seed(spec.seed)
    model = _model(spec, device.type)
    adapter = _adapter(model, spec, rank)
    balancer, balancing = balance.from_params(model, spec.balance)
    perf = fastpaths.apply(model, fastpaths.Perf(**spec.perf), balancer, device)
    if rank == 0:
        print(f"[dsflow train] fast paths: {perf.describe()}", file=sys.stderr)
        print(f"[dsflow train] balancing: {balancing}", file=sys.stderr)
    if spec.zero3 and balancer.routers:
        _gather_moe_blocks_whole(model)
    mtp_weight = spec.mtp.get("weight", 0.3)
    trainee = TrainingLM(
        model,
        ce_chunk=perf.ce_chunk,
        mtp_weight=mtp_weight,
        steps=spec.steps,
        hf_loss=perf.liger,
        compiled=perf.compile,
    )
    trainee = _universal(trainee)
    if spec.zero3 and perf.ce_chunk:
        # The fused loss reads lm_head.weight without calling lm_head: ZeRO-3 gathers it for
        # the whole forward (and its backward) only as an external parameter of the trainee.
        deepspeed.zero.register_external_parameter(trainee, trainee.lm_head.weight)
    trainable = [p for p in trainee.parameters() if p.requires_grad]
    optimizer = _fused_optimizer(trainee, trainable, spec) if perf.optimizer == "fused" else None
    client = devicestep.optimizer(trainable, spec.optimizer) if perf.device_step else optimizer
    engine, _, _, _ = deepspeed.initialize(
        model=trainee, model_parameters=trainable, optimizer=client, config=spec.ds_config
    )
    if perf.device_step:
        devicestep.install(engine.optimizer)
    if engine.fp16_enabled():
        # The fused loss forms its gradients at the scale of the coming backward (a float on
        # the host: no sync).
        trainee.loss_scale = lambda: float(engine.optimizer.loss_scale)
    # Checkpoint files hashed as they are written (in the background with
    # train.async_checkpoints), and loaded without running pickled code.
    from dsflow.train import ckptengine

    ckptengine.install(engine, background=spec.async_checkpoints)
    if optimizer is not None and spec.world == 1:
        # ZeRO-0's all-reduce of one rank would only copy every gradient into buckets and back.
        engine.enable_backward_allreduce = False
    _install_fused_grad_checks(engine, perf, rank)
    if perf.lean_grad_hooks:
        _install_lean_grad_hooks(engine, rank)
    # DeepSpeed broadcasts parameters at start-up, not buffers: give every rank rank 0's biases.
    balancer.sync_bias()
    return Run(engine, model, balancer, perf, optimizer, device, rank, spec.world, adapter)


def _model(spec: RunSpec, device_type: str) -> Any:
    config = model_config(spec.model["preset"], spec.vocab_size, spec.model["overrides"])
    # LoRA's base stays frozen, so it needs no fp32 copy: load it as DeepSpeed will hold it.
    dtype = spec.precision if spec.lora_on else None
    return build_model(
        config,
        device_type=device_type,
        pretrained=base_folder(spec),
        dtype=dtype,
        mtp_depth=spec.model.get("mtp_depth", 0),
    )


def base_folder(spec: RunSpec) -> str | None:
    """This node's folder of model.pretrained: node 0's when it has it, else the same commit in
    this node's cache (run.json carries node 0's path)."""
    folder = source.folder(spec.model)
    return None if folder is None else str(folder)


def _adapter(model: Any, spec: RunSpec, rank: int) -> Any:
    """train.finetune lora: PEFT adapters injected into `model` in place (the model object,
    its forward and the fast paths stay the same); None for a full fine-tune."""
    if not spec.lora_on:
        return None
    from dsflow.model import lora

    adapter = lora.attach(model, spec.lora)
    if rank == 0:
        print(f"[dsflow train] LoRA: {lora.trainable_summary(model)}", file=sys.stderr)
    return adapter


def _gather_moe_blocks_whole(model: Any) -> None:
    """ZeRO-3 gathers a module's parameters when its forward starts, following the order it
    traced; routed experts run in a data-dependent order (or not at all), so the ranks fetch
    different parameters (DeepSpeed: "Detected a disagreement on list length between rank0 and
    rank1", or a hang). As a leaf, the whole MoE block is gathered at once."""
    from deepspeed.utils import set_z3_leaf_modules

    set_z3_leaf_modules(model, list(balance.moe_block_classes()))


def _universal(trainee: TrainingLM) -> TrainingLM:
    """Marks the checkpoints as plain data parallel (no tensor/pipeline slicing), which is what
    deepspeed.checkpoint.ds_to_universal needs to convert them for an elastic resume."""
    from deepspeed.checkpoint import constants as ds_ckpt

    setattr(
        trainee,
        ds_ckpt.UNIVERSAL_CHECKPOINT_INFO,
        {ds_ckpt.UNIVERSAL_CHECKPOINT_VERSION_KEY: ds_ckpt.UNIVERSAL_CHECKPOINT_VERSION_VALUE},
    )
    return trainee


def _fused_optimizer(trainee: TrainingLM, trainable: list, spec: RunSpec) -> MasterAdamW:
    # DeepSpeed's bf16 mode would cast the parameters (not the buffers) and wrap its own
    # optimizer; here dsflow casts them the same way and brings the optimizer.
    for p in trainee.parameters():
        p.data = p.data.to(torch.bfloat16)
    opt = spec.optimizer
    return MasterAdamW(
        trainable,
        lr=opt["lr"],
        betas=tuple(opt["betas"]),
        eps=opt["eps"],
        weight_decay=opt["weight_decay"],
        max_grad_norm=spec.grad_clip,
    )


def _install_lean_grad_hooks(engine: Any, rank: int) -> None:
    # Silent where DeepSpeed hooks no gradient (ZeRO-1 without overlap_comm): nothing to do.
    if not gradhooks.install(engine.optimizer) and gradhooks.hooked(engine.optimizer):
        if rank == 0:
            print(
                "[dsflow train] train.perf.lean_grad_hooks: not applicable to this layout "
                "(see dsflow.train.gradhooks.install); DeepSpeed's own hooks run",
                file=sys.stderr,
            )


def _install_fused_grad_checks(engine: Any, perf: fastpaths.Perf, rank: int) -> None:
    if perf.fused_grad_checks and not fusedgrads.install(engine.optimizer) and rank == 0:
        print(
            "[dsflow train] train.perf.fused_grad_checks: not applicable to this layout "
            f"({type(engine.optimizer).__name__}); DeepSpeed's own checks run",
            file=sys.stderr,
        )
