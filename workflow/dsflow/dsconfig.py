"""The DeepSpeed config, generated from params.yaml (and a user's ds_config.json merged on top).

Batch arithmetic is checked here, before any process starts: DeepSpeed itself would only fail
after every rank has loaded the model.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from dsflow import machine
from dsflow.errors import UsageError
from dsflow.params import deep_merge
from dsflow.plan.comm import ONE_RANK_BUCKET


@dataclass(frozen=True)
class Batch:
    micro: int
    accum: int
    world: int

    @property
    def global_batch(self) -> int:
        return self.micro * self.accum * self.world


def resolve_batch(
    micro: int | None, accum: int | None, global_batch: int | None, world: int
) -> Batch:
    """train_batch_size = micro x accum x world: any two given determine the third."""
    if sum(v is not None for v in (micro, accum, global_batch)) < 2:
        raise UsageError(
            "train: give at least two of micro_batch, grad_accum, global_batch "
            f"(got micro_batch={micro}, grad_accum={accum}, global_batch={global_batch})"
        )
    if global_batch is None:
        return Batch(micro, accum, world)
    if micro is not None and accum is not None:
        if micro * accum * world != global_batch:
            fix = global_batch / (micro * world)
            hint = (
                f"set grad_accum: {int(fix)}"
                if fix.is_integer() and fix >= 1
                else (f"set global_batch: {micro * accum * world}")
            )
            raise UsageError(
                f"train: global_batch {global_batch} != micro_batch {micro} x grad_accum {accum} "
                f"x {world} rank(s) = {micro * accum * world}; {hint}, or set one of them to null"
            )
        return Batch(micro, accum, world)
    known_name, known = ("micro_batch", micro) if micro is not None else ("grad_accum", accum)
    per_step = known * world
    if global_batch % per_step:
        raise UsageError(
            f"train.global_batch: {global_batch} is not a multiple of {known_name} {known} x "
            f"{world} rank(s) = {per_step}; use a multiple of {per_step}"
        )
    other = global_batch // per_step
    return Batch(micro or other, accum or other, world)


def total_steps(train: dict, batch: Batch) -> int:
    if train["max_steps"] is not None:
        return train["max_steps"]
    if train["max_tokens"] is None:
        raise UsageError("train: set max_steps or max_tokens")
    return max(1, math.ceil(train["max_tokens"] / (batch.global_batch * train["seq_len"])))


def scheduler(train: dict, steps: int) -> dict:
    opt, sched = train["optimizer"], train["schedule"]
    warmup = min(sched["warmup_steps"], max(steps - 1, 0))
    if sched["kind"] == "warmup":
        return {
            "type": "WarmupLR",
            "params": {
                "warmup_min_lr": 0.0,
                "warmup_max_lr": opt["lr"],
                "warmup_num_steps": max(warmup, 1),
                "warmup_type": "linear",
            },
        }
    return {
        "type": "WarmupCosineLR",
        "params": {
            "total_num_steps": steps,
            "warmup_min_ratio": 0.0,
            "warmup_num_steps": max(warmup, 1),
            "cos_min_ratio": sched["min_lr_ratio"],
            "warmup_type": "linear",
        },
    }


def build(train: dict, batch: Batch, steps: int, device_type: str) -> dict:
    """The DeepSpeed config for these params (before the user's file is merged)."""
    opt = train["optimizer"]
    cfg = {
        "train_batch_size": batch.global_batch,
        "train_micro_batch_size_per_gpu": batch.micro,
        "gradient_accumulation_steps": batch.accum,
        "gradient_clipping": train["grad_clip"],
        "steps_per_print": 10**9,  # dsflow logs itself
        "wall_clock_breakdown": False,
        # DeepSpeed's throughput timer waits for the device at every micro-step's forward and
        # step (to time them); dsflow times whole steps itself, with one wait per step.
        "timers": {"throughput": {"enabled": False}},
        "optimizer": {
            "type": "AdamW",
            "params": {
                "lr": opt["lr"],
                "betas": list(opt["betas"]),
                "eps": opt["eps"],
                "weight_decay": opt["weight_decay"],
                # DeepSpeed's fused/CPU Adam ops need a compiler toolchain per accelerator; the
                # torch implementation is exact and fast enough on CPU.
                **({"torch_adam": True} if device_type == "cpu" else {}),
            },
        },
        "scheduler": scheduler(train, steps),
        "zero_optimization": zero_optimization(train, device_type, batch.world),
    }
    # The train stage resolves `auto` first; the same rule here keeps a direct call right.
    precision = machine.resolve_precision(train["precision"], device_type)
    if precision == "fp16":
        fp16 = train["fp16"]
        cfg["fp16"] = {
            "enabled": True,
            "loss_scale": 0,  # 0 = dynamic
            "initial_scale_power": fp16["initial_scale_power"],
            "loss_scale_window": fp16["loss_scale_window"],
            "hysteresis": fp16["hysteresis"],
            "min_loss_scale": fp16["min_loss_scale"],
        }
    elif precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    return cfg


def for_client_optimizer(cfg: dict, built: dict, source: str | None = None) -> dict:
    """The config for dsflow's fused optimizer (train.perf.optimizer: fused, dsflow.train.masteradam):
    the model is cast to bf16 by dsflow and the optimizer keeps the fp32 masters and clips, so
    DeepSpeed gets no optimizer section, no bf16 wrapper and no clipping of its own (it would
    clip the bf16 gradients in bf16). The scheduler section stays: it drives the client
    optimizer's learning rate. `built` is the config before the user's file (`source`) was
    merged: an optimizer, clipping, bf16 or data_types setting made there would be dropped or
    fail inside DeepSpeed (a gradient accumulation dtype needs its bf16 wrapper), so it is an
    error."""
    for key in ("optimizer", "gradient_clipping", "bf16", "data_types"):
        if cfg.get(key) != built.get(key):
            raise UsageError(
                f"{source or 'train.ds_config'}: {key} is set there, but train.perf.optimizer: "
                "fused brings its own bf16 optimizer (train.optimizer, train.grad_clip); set "
                "those in params.yaml, or use train.perf.optimizer: deepspeed"
            )
    cfg = {k: v for k, v in cfg.items() if k not in ("optimizer", "bf16")}
    cfg["gradient_clipping"] = 0.0
    return cfg


def for_device_step(cfg: dict, built: dict, source: str | None = None) -> dict:
    """The config for train.perf.device_step (dsflow.train.devicestep): dsflow brings torch's
    fused AdamW as the client optimizer, so DeepSpeed gets no optimizer section; bf16,
    clipping and the scheduler stay DeepSpeed's. What the user's file (`source`) sets that
    this step cannot take is an error."""
    # An optimizer section would be dropped; data_types makes DeepSpeed build BF16_Optimizer,
    # compute_grad_norm false a step without the norm the skip is decided from.
    zero = cfg.get("zero_optimization", {})
    for key, bad in (
        ("optimizer", cfg.get("optimizer") != built.get("optimizer")),
        ("data_types", cfg.get("data_types") != built.get("data_types")),
        ("zero_optimization.compute_grad_norm", zero.get("compute_grad_norm", True) is False),
    ):
        if bad:
            raise UsageError(
                f"{source or 'train.ds_config'}: {key} is set there, which "
                "train.perf.device_step cannot take (it brings torch's fused AdamW, "
                "train.optimizer, into DeepSpeed's ZeRO step); remove it, or set "
                "train.perf.device_step: false"
            )
    return {k: v for k, v in cfg.items() if k != "optimizer"}


def check_offload(train: dict, device_type: str) -> None:
    """What DeepSpeed 0.19 accepts, checked before launch (DeepSpeed fails late and obscurely)."""
    stage, off = train["zero_stage"], train["offload"]
    if off["optimizer"] != "none" and stage == 0:
        raise UsageError(
            f"train.offload.optimizer: {off['optimizer']} needs train.zero_stage 1, 2 or 3 "
            "(ZeRO-0 has no optimizer offload)"
        )
    if off["param"] != "none" and stage != 3:
        raise UsageError(
            f"train.offload.param: {off['param']} needs train.zero_stage: 3 (got {stage}); "
            "only ZeRO-3 partitions the parameters"
        )
    nvme = [k for k in ("optimizer", "param") if off[k] == "nvme"]
    if nvme and not off["nvme_path"]:
        raise UsageError(
            f"train.offload.nvme_path: needed when train.offload.{nvme[0]} is nvme (a directory "
            "on a local NVMe disk)"
        )
    if off["optimizer"] == "nvme" and stage != 3:
        raise UsageError(
            f"train.offload.optimizer: nvme needs train.zero_stage: 3 (got {stage}); ZeRO 1-2 "
            "offload the optimizer to cpu only"
        )
    if nvme and device_type != "cuda":
        raise UsageError(
            f"train.offload.{nvme[0]}: nvme needs CUDA (DeepSpeed's async I/O op is not built "
            "for the CPU accelerator); use cpu, or none on a CPU run"
        )


def gradient_hooks(zero: dict, stage: int, world: int, device_type: str) -> tuple[bool, bool]:
    """(overlap_comm, contiguous_gradients) for DeepSpeed from train.zero. `auto` (the default)
    turns both off for one rank at ZeRO-0/1, where nothing is reduced across ranks or
    partitioned: with both off DeepSpeed installs no per-parameter gradient hook, whose Python
    otherwise runs for every parameter in every backward (on one H200, ZeRO-1 without them took
    the dense step 1.14x and the MoE's 1.22x as fast as ZeRO-2). Everywhere else auto is on.
    overlap_comm needs CUDA streams: off on CPU in any case."""
    alone = world == 1 and stage in (0, 1)
    overlap, contiguous = (
        not alone if zero[key] == "auto" else zero[key]
        for key in ("overlap_comm", "contiguous_gradients")
    )
    return overlap and device_type == "cuda", contiguous


def reduce_bucket(zero: dict, device_type: str, world: int) -> int:
    """train.zero.reduce_bucket_size; `auto` must have been decided by the planner where there is
    something to reduce (GPUs, several ranks: dsflow.train.stage.plan_memory), elsewhere it is
    the one-rank size."""
    value = zero["reduce_bucket_size"]
    if value != "auto":
        return value
    if device_type == "cuda" and world > 1:
        raise ValueError(
            "train.zero.reduce_bucket_size: auto reached the DeepSpeed config on several GPUs; "
            "call dsflow.train.stage.plan_memory first"
        )
    return ONE_RANK_BUCKET


def zero_optimization(train: dict, device_type: str, world: int) -> dict:
    """The zero_optimization section: stage, buckets, ZeRO-3 knobs and offload."""
    stage, zero, off = train["zero_stage"], train["zero"], train["offload"]
    if stage == "auto":
        raise ValueError(
            "train.zero_stage: auto reached the DeepSpeed config; call "
            "dsflow.train.stage.plan_memory first"
        )
    check_offload(train, device_type)
    overlap, contiguous = gradient_hooks(zero, stage, world, device_type)
    cfg = {
        "stage": stage,
        "allgather_partitions": zero["allgather_partitions"],
        "allgather_bucket_size": zero["allgather_bucket_size"],
        "reduce_scatter": zero["reduce_scatter"],
        "reduce_bucket_size": reduce_bucket(zero, device_type, world),
        "overlap_comm": overlap,
        "contiguous_gradients": contiguous,
    }
    if stage == 3:
        for key in (
            "stage3_prefetch_bucket_size",
            "stage3_param_persistence_threshold",
            "stage3_max_live_parameters",
            "stage3_max_reuse_distance",
            "stage3_gather_16bit_weights_on_model_save",
        ):
            cfg[key] = zero[key]
    # Page-locked buffers are a CUDA thing; the CPU accelerator has none.
    pin = bool(off["pin_memory"]) and device_type == "cuda"
    for what, key in (("optimizer", "offload_optimizer"), ("param", "offload_param")):
        if off[what] != "none":
            section = {"device": off[what], "pin_memory": pin}
            if off[what] == "nvme":
                section["nvme_path"] = off["nvme_path"]
            cfg[key] = section
    return cfg


def offload_device(zero: dict, what: str) -> str:
    """Where a built (or user-merged) `zero_optimization` section offloads `what` (optimizer or
    param): cpu, nvme or none."""
    return zero.get(f"offload_{what}", {}).get("device", "none")


def layout(train: dict) -> str:
    """ "ZeRO-3 + optimizer offload (cpu)": the memory layout in words, for logs."""
    off = train["offload"]
    parts = [f"ZeRO-{train['zero_stage']}"]
    if off["optimizer"] != "none":
        parts.append(f"optimizer offload ({off['optimizer']})")
    if off["param"] != "none":
        parts.append(f"param offload ({off['param']})")
    return " + ".join(parts)


def _fill_auto(user: dict, cfg: dict) -> None:
    """A user file's "auto" in zero_optimization (HF's convention: "fill this in") takes the
    value dsflow built, which the memory plan counted; DeepSpeed would drop it for its own
    default (a 500M-element reduce bucket where the plan may hold 40M)."""
    built = cfg.get("zero_optimization", {})
    zero = user.get("zero_optimization", {})
    for key, value in list(zero.items()):
        if value == "auto" and key in built:
            zero[key] = built[key]


# Keys whose values dsflow derives from params.yaml: a user file may not silently change them.
DERIVED = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")


# DeepSpeed's precision sections (a user's bfloat16 is read as bf16: read_user).
PRECISIONS = ("fp16", "bf16")


def precision_of(cfg: dict) -> str:
    """The precision DeepSpeed trains in under `cfg`: fp16 or bf16 where enabled, else fp32."""
    return next((key for key in PRECISIONS if cfg.get(key, {}).get("enabled")), "fp32")


def read_user(path: str | Path) -> dict:
    """A user's ds_config.json, its sections checked to be JSON objects; a bad file is one line."""
    path = Path(path)
    try:
        user = json.loads(path.read_bytes().decode("utf-8"))
    except FileNotFoundError:
        raise UsageError(f"train.ds_config: {path} not found") from None
    except IsADirectoryError:
        raise UsageError(f"train.ds_config: {path} is a directory, not a JSON file") from None
    except OSError as e:
        raise UsageError(f"train.ds_config: cannot read {path} ({e.strerror or e})") from None
    except UnicodeDecodeError as e:
        raise UsageError(f"{path}: not valid UTF-8 at byte {e.start}") from None
    except json.JSONDecodeError as e:
        raise UsageError(
            f"{path}: invalid JSON at line {e.lineno}, column {e.colno}: {e.msg}"
        ) from None
    except RecursionError:
        raise UsageError(f"{path}: nested too deeply to read") from None
    if not isinstance(user, dict):
        raise UsageError(f"{path}: expected a JSON object at the top")
    for key in SECTIONS:
        if key in user and not isinstance(user[key], dict):
            raise UsageError(f"{path}: {key} must be a JSON object, got {_show(user[key])}")
    # DeepSpeed reads bf16, and bfloat16 only where bf16 is absent: one name from here on.
    if "bfloat16" in user:
        user.setdefault("bf16", user.pop("bfloat16"))
    return user


def with_user_precision(precision: str, path: str | Path) -> str:
    """The precision a run of `precision` (resolved: fp16, bf16 or fp32) trains in once the
    user's ds_config at `path` is merged: the file may turn fp16 or bf16 on or off."""
    built = {"fp16": {"enabled": precision == "fp16"}, "bf16": {"enabled": precision == "bf16"}}
    user = read_user(path)
    return precision_of(deep_merge(built, {k: user[k] for k in PRECISIONS if k in user}))


def merge_user(cfg: dict, path: str | Path) -> dict:
    """Merge a user's ds_config.json over `cfg`, keeping the batch arithmetic consistent."""
    path = Path(path)
    user = read_user(path)
    check_own_batch(user, cfg, path)
    _fill_auto(user, cfg)
    for key in DERIVED:
        if key in user and user[key] != cfg[key] and user[key] != "auto":
            raise UsageError(
                f"{path}: {key} {_show(user[key])} differs from params.yaml's {cfg[key]} "
                f"(micro_batch {cfg['train_micro_batch_size_per_gpu']} x grad_accum "
                f"{cfg['gradient_accumulation_steps']} x ranks); set it in params.yaml's train "
                "section instead, or remove it from the file"
            )
        user.pop(key, None)
    merged = deep_merge(cfg, user)
    if all(merged.get(key, {}).get("enabled") for key in PRECISIONS):
        raise UsageError(f"{path}: fp16 and bf16 are both enabled; keep one (train.precision)")
    stage = merged.get("zero_optimization", {}).get("stage", 0)
    if isinstance(stage, bool) or stage not in (0, 1, 2, 3):
        raise UsageError(f"{path}: zero_optimization.stage {_show(stage)} is not one of 0, 1, 2, 3")
    return merged


def check_own_batch(user: dict, cfg: dict, path: Path) -> None:
    """Refuse a user's file whose batch keys contradict each other on this many ranks (DeepSpeed
    needs train_batch_size = micro x accumulation x ranks) for that first, then say how
    params.yaml relates: matching params.yaml alone would leave the file wrong."""
    total, micro, accum = (cfg[k] for k in DERIVED)
    world = total // (micro * accum)
    fix = (
        f"params.yaml's train section gives {total} (micro_batch {micro} x grad_accum {accum} x "
        f"{world} rank(s)): set "
        "the batch there and remove these keys from the file"
    )
    given = {k: user[k] for k in DERIVED if type(user.get(k)) is int}
    if "train_batch_size" not in given or len(given) < 2:
        return
    t = given.pop("train_batch_size")
    if len(given) == 2:
        m, a = given.values()
        if m * a * world != t:
            raise UsageError(
                f"{path}: train_batch_size {t} != train_micro_batch_size_per_gpu {m} x "
                f"gradient_accumulation_steps {a} x {world} rank(s) = {m * a * world}, so the "
                f"file contradicts itself; {fix}"
            )
        return
    ((key, value),) = given.items()
    if t % (value * world):
        missing = next(k for k in DERIVED[1:] if k != key)
        raise UsageError(
            f"{path}: train_batch_size {t} is not a multiple of {key} {value} x {world} "
            f"rank(s) = {value * world}, so no {missing} fits; {fix}"
        )


# Sections of a DeepSpeed config that are objects (DeepSpeed fails obscurely on anything else).
SECTIONS = ("fp16", "bf16", "bfloat16", "zero_optimization", "optimizer", "scheduler")


def _show(value) -> str:
    """A user's value in a one-line message."""
    text = json.dumps(value)
    return text if len(text) <= 60 else text[:57] + "..."


# DeepSpeed optimizers that update only the parameters they are given: LoRA hands them the
# adapters alone. The 1-bit and 0/1 optimizers compress every gradient of the model.
LORA_OPTIMIZERS = ("adam", "adamw", "fusedadam", "torch_adam", "cpuadam")


def check_lora_optimizer(ds_config: dict, source: str) -> None:
    """One line when a user's ds_config brings an optimizer that LoRA cannot train with."""
    kind = str(ds_config.get("optimizer", {}).get("type", "adamw"))
    if kind.lower() not in LORA_OPTIMIZERS:
        raise UsageError(
            f"{source}: optimizer {kind} with train.finetune: lora; LoRA trains its adapters with "
            "AdamW (train.optimizer): remove the optimizer section there, or set "
            "train.finetune: full"
        )
