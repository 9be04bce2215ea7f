"""What a plan is asked: the model, batch, ranks, memory layout and GPUs of a run, resolved from
params, the ad-hoc flags of `python -m dsflow plan` and this machine (:mod:`dsflow.machine`)."""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from dsflow import dsconfig, machine
from dsflow.errors import UsageError
from dsflow.model import lora, mtp, presets, source
from dsflow.model.build import load_checkpoint_config
from dsflow.params import fp8_on
from dsflow.paths import shard_index
from dsflow.plan import comm, memory

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
# The memory each of those GPUs is sold as ("a 24 GB RTX 4090"): binary gigabytes, rounded as
# the maker rounds them, so it differs from the GB = 1e9 bytes the plan counts in (24,564 MiB =
# 25.8e9 bytes). A card is named with this figure (`card`), never with the plan's.
GPU_NOMINAL_GB: dict[str, int] = {
    "B200": 180,
    "H200 SXM": 141,
    "H200 NVL": 141,
    "H100 SXM": 80,
    "H100 NVL": 94,
    "H100 PCIe": 80,
    "A100": 80,
    "L40S": 48,
    "L40": 48,
    "L4": 24,
    "A10": 24,
    "A10G": 24,
    "RTX 4090": 24,
    "RTX 3090": 24,
}
# The compute capability of those GPUs (the sorted experts' grouped GEMM depends on it).
GPU_CAPABILITY: dict[str, tuple[int, int]] = {
    "B200": (10, 0),
    "H200 SXM": (9, 0),
    "H200 NVL": (9, 0),
    "H100 SXM": (9, 0),
    "H100 NVL": (9, 0),
    "H100 PCIe": (9, 0),
    "A100": (8, 0),
    "L40S": (8, 9),
    "L40": (8, 9),
    "L4": (8, 9),
    "A10": (8, 6),
    "A10G": (8, 6),
    "RTX 4090": (8, 9),
    "RTX 3090": (8, 6),
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


def card(name: str) -> str:
    """A GPU of GPU_MEMORY_BYTES with the memory it is sold as, then the bytes a plan counts:
    "RTX 4090 with 24 GB (24,564 MiB = 25.8 GB)"."""
    size = GPU_MEMORY_BYTES[name]
    return f"{name} with {GPU_NOMINAL_GB[name]} GB ({size // 2**20:,} MiB = {memory.fmt_gb(size)})"


@dataclass(frozen=True, kw_only=True)
class Request(memory.Setup):
    """Everything a plan depends on, resolved from params (+ ad-hoc flags): the memory setup,
    plus the model and where each number came from."""

    config: Any
    preset: str
    vocab_size: int
    vocab_source: str
    grad_accum: int
    keep_checkpoints: int
    checkpoints: int
    device: str
    gpu_mem_bytes: int | None
    gpu_mem_source: str
    host_mem_bytes: int | None
    host_mem_source: str
    disk_free_bytes: int | None = None
    disk_source: str = "unknown"
    nvme_path: str | None = None
    # model.pretrained: the checkpoint is the model, so no smaller preset is an alternative.
    pretrained: str | None = None
    # What decides the sorted experts' padding on another GPU (rows_on): "", "fp8" or the
    # precision of their grouped GEMM.
    expert_rows: str = ""
    notes: list[str] = dataclasses.field(default_factory=list)
    # train.zero.reduce_bucket_size: auto: the bucket follows the micro batch and the ranks.
    bucket_auto: bool = False

    def record(self) -> dict[str, Any]:
        """The request as reports/plan.json holds it (JSON types)."""
        return {
            "preset": self.preset,
            "vocab_size": self.vocab_size,
            "vocab_source": self.vocab_source,
            "grad_accum": self.grad_accum,
            "device": self.device,
            "gpu_mem_bytes": self.gpu_mem_bytes,
            "gpu_mem_source": self.gpu_mem_source,
            "host_mem_bytes": self.host_mem_bytes,
            "host_mem_source": self.host_mem_source,
            "disk_free_bytes": self.disk_free_bytes,
            "disk_source": self.disk_source,
            "nvme_path": self.nvme_path,
            "pretrained": self.pretrained,
            **memory.inputs(self.config, self),
        }

    def summary(self) -> dict[str, Any]:
        """Parameter counts, FLOPs and disk sizes of this run (:func:`memory.summary`)."""
        return memory.summary(
            self.config,
            seq_len=self.seq_len,
            tokens_per_step=self.micro_batch * self.grad_accum * self.world * self.seq_len,
            precision=self.precision,
            zero_stage=self.zero_stage,
            keep_checkpoints=self.keep_checkpoints,
            checkpoints=self.checkpoints,
            trainable=self.lora_adapter,
            mtp_depth=self.mtp_depth,
        )


def fused_optimizer_wanted(train: dict, world: int) -> bool:
    """train.perf.optimizer asks for dsflow's fused optimizer (dsflow.train.masteradam) where it can
    run: `fused` on any number of GPUs, `auto` on one GPU (where it is faster than DeepSpeed's:
    docs/performance.md) unless a DeepSpeed config file of the user's is merged
    (train.ds_config: its settings are for DeepSpeed's optimizer); bf16, the optimizer on the
    GPU. It runs at ZeRO-0."""
    value = (train.get("perf") or {}).get("optimizer", "auto")
    offload = (train.get("offload") or {}).get("optimizer", "none") != "none"
    wanted = value == "fused" or (value == "auto" and world == 1 and not train.get("ds_config"))
    precision = machine.resolve_precision(train.get("precision", "bf16"), "cuda")
    return wanted and precision == "bf16" and not offload


def auto_first_stage(train: dict, world: int) -> int:
    """The first ZeRO stage `train.zero_stage: auto` tries on GPUs: ZeRO-2; on one GPU, where
    there is nothing to partition, ZeRO-1 (no per-parameter gradient hooks); ZeRO-0 where
    dsflow's fused optimizer is wanted (`fused_optimizer_wanted`: on one GPU by default), the
    one stage it runs at; ZeRO-3 with parameter offload or NVMe offload (they exist only there);
    ZeRO-2 on one GPU with CPU optimizer offload (ZeRO-Offload: DeepSpeed hooks every gradient
    at ZeRO-1 too then)."""
    offload = train.get("offload") or {}
    if offload.get("param", "none") != "none" or offload.get("optimizer") == "nvme":
        return 3
    if fused_optimizer_wanted(train, world):
        return 0
    if offload.get("optimizer", "none") != "none":
        return 2
    return 1 if world == 1 else 2


# --------------------------------------------------------------------------- resolving


def _arg(args: Any, name: str) -> Any:
    return getattr(args, name, None) if args is not None else None


def _index_vocab() -> int | None:
    path = shard_index("train")
    try:
        return int(json.loads(path.read_text())["vocab_size"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _profile_gpu(args: Any) -> str | None:
    names = list(_arg(args, "profile") or [])
    names += [p for p in os.environ.get("DSFLOW_PROFILES", "").split(os.pathsep) if p]
    for name in names:
        stem = Path(str(name)).stem.lower()
        for needle, key in PROFILE_GPUS:
            if needle in stem:
                return key
    return None


def _model(params: dict, args: Any, notes: list[str]) -> tuple[str, dict, str | None]:
    """(preset, overrides, pretrained): ``--model`` replaces params' model."""
    model = params["model"]
    preset, overrides, pretrained = model["preset"], model.get("overrides") or {}, None
    if _arg(args, "model"):
        if _arg(args, "model") != preset and (overrides or model.get("pretrained")):
            notes.append("--model given: params' model.overrides / model.pretrained ignored")
        preset, overrides = _arg(args, "model"), {}
    else:
        pretrained = model.get("pretrained")
    if preset not in presets.PRESETS:
        raise UsageError(
            f"unknown model preset {preset!r}; choose one of: {', '.join(presets.PRESETS)}"
        )
    return preset, overrides, pretrained


def _mtp_depth(params: dict, args: Any, config: Any, seq_len: int, notes: list[str]) -> int:
    """model.mtp_depth, as the train stage takes it: a V2-family model or a window of no more
    tokens than depths is a one-line UsageError. ``--model`` keeps it for a V3 preset only."""
    depth = int(params["model"]["mtp_depth"])
    if depth and _arg(args, "model") and config.model_type != "deepseek_v3":
        notes.append(f"--model given: model.mtp_depth {depth} ignored ({config.model_type})")
        return 0
    mtp.check_depth(depth, config.model_type)
    if depth >= seq_len:
        raise UsageError(
            f"model.mtp_depth {depth}: train.seq_len {seq_len} leaves depth {seq_len} and "
            "deeper no tokens to predict; set model.mtp_depth below train.seq_len"
        )
    return depth


def _world(train: dict, args: Any, world: int | None, gpus: list[dict]) -> int:
    if world is None:
        world = _arg(args, "gpus") or train["gpus"]
        if world == "auto":
            world = len(gpus) or 1
        if not _arg(args, "gpus"):  # train.gpus is per node
            world = int(world) * train.get("nodes", 1)
    world = int(world)
    if world < 1:
        raise UsageError(f"--gpus must be >= 1, got {world}")
    return world


def _config(
    params: dict, args: Any, model: tuple[str, dict, str | None], notes: list[str]
) -> tuple[Any, str]:
    """(model config, where its vocabulary size came from)."""
    preset, overrides, pretrained = model
    vocab, vocab_source = _arg(args, "vocab"), "--vocab"
    published = presets.PRESETS[preset].get("published_vocab_size")
    if vocab is None and pretrained:
        try:  # a folder, or a Hub id in the cache (the pretrained stage fetched it)
            folder = source.folder(params["model"])
        except UsageError as e:
            notes.append(f"{e}: planned the preset")
        else:
            return load_checkpoint_config(str(folder)), f"model.pretrained {pretrained}"
        if published:
            # The train stage builds the checkpoint's embedding (its config's vocab_size), not
            # one of the local tokenizer's size: the preset's published vocabulary stands in.
            vocab, vocab_source = published, f"{preset}'s published vocabulary, as model.pretrained"
    tok = params.get("tokenizer", {})
    if vocab is None and published and _arg(args, "model") and not tok.get("pretrained"):
        # An ad-hoc question about a published model: its own vocabulary, not the local
        # tokenizer's (a tokenizer.pretrained or --vocab says otherwise).
        vocab, vocab_source = published, f"{preset}'s published vocabulary"
    if vocab is None:
        vocab, vocab_source = _index_vocab(), str(shard_index("train"))
    if vocab is None and not _arg(args, "model") and not tok.get("pretrained"):
        # No shards yet: the tokenizer stage will train this many tokens (at most).
        vocab, vocab_source = tok.get("vocab_size"), "tokenizer.vocab_size"
    if vocab is None:
        vocab, vocab_source = published, f"{preset}'s published vocabulary"
    if vocab is None:
        vocab, vocab_source = DEFAULT_VOCAB, "default"
    return presets.model_config(preset, int(vocab), overrides), vocab_source


def _batch(train: dict, args: Any, world: int) -> tuple[int, int]:
    """(micro batch, grad_accum)."""
    micro = _arg(args, "micro_batch")
    if micro is not None:
        return int(micro), int(train["grad_accum"] or 1)
    batch = dsconfig.resolve_batch(
        train["micro_batch"], train["grad_accum"], train["global_batch"], world
    )
    return int(batch.micro), int(batch.accum)


def _layout(
    train: dict, args: Any, world: int, device: str, notes: list[str]
) -> tuple[int, bool, bool]:
    """(ZeRO stage, optimizer offload, parameter offload); `auto` plans its first stage. Where
    offloaded states go is :func:`_offload_device`'s."""
    zero = _arg(args, "zero")
    if zero is None and train["zero_stage"] == "auto" and device == "cpu":
        # As layouts.cpu_layout: nothing to fit, the fewest collectives.
        offload = train.get("offload") or {}
        zero = 3 if offload.get("param", "none") != "none" else 2
        notes.append(f"train.zero_stage: auto: ZeRO-{zero} on CPU ranks")
    elif zero is None and train["zero_stage"] == "auto":
        zero = auto_first_stage(train, world)
        notes.append(
            f"train.zero_stage: auto: planned as ZeRO-{zero}; the train stage picks the "
            "cheapest layout that fits (see cheapest fit)"
        )
    zero = int(train["zero_stage"] if zero is None else zero)
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
    return zero, offload_opt, offload_par


def _offload_device(train: dict, args: Any) -> tuple[str, str | None]:
    """(where offloaded states go, the NVMe directory): nvme where train.offload asks for it
    (unless --zero replaces params' layout) or --nvme is given, else cpu."""
    offload = train.get("offload") or {}
    path = _arg(args, "nvme") or offload.get("nvme_path")
    asked = _arg(args, "zero") is None and "nvme" in (
        offload.get("optimizer"),
        offload.get("param"),
    )
    return ("nvme" if asked or _arg(args, "nvme") else "cpu"), path


def _device(train: dict, args: Any, gpus: list[dict], given: int | None) -> str:
    """cuda or cpu: GPUs when GPU flags or memory are given, train.device says cuda, GPUs are
    visible or a profile names one; CPU ranks when train.device says cpu or nothing else does."""
    if given is not None or _arg(args, "gpu_mem") is not None or _arg(args, "gpus"):
        return "cuda"
    want = train.get("device", "auto")
    if want == "cpu":
        return "cpu"
    if want == "cuda" or gpus or _profile_gpu(args) is not None:
        return "cuda"
    return "cpu"


def _gpu_memory(
    args: Any, gpus: list[dict], world: int, given: int | None
) -> tuple[int | None, str]:
    """(bytes per GPU, where that came from)."""
    if given is not None:
        return given, "given"
    if _arg(args, "gpu_mem") is not None:
        return int(float(_arg(args, "gpu_mem")) * memory.GB), "--gpu-mem"
    if gpus:
        used = gpus[: max(1, min(world, len(gpus)))]
        smallest = min(used, key=lambda g: g["total_memory"])
        return smallest["total_memory"], f"visible GPU {smallest['name']}"
    if (key := _profile_gpu(args)) is not None:
        mib = GPU_MEMORY_BYTES[key] // 2**20
        return GPU_MEMORY_BYTES[key], f"profile: {key} with {GPU_NOMINAL_GB[key]} GB = {mib:,} MiB"
    return None, "unknown"


def _host_memory(
    args: Any, given: int | None, gpu_source: str, device: str
) -> tuple[int | None, str]:
    """(host RAM bytes, where that came from): this machine's when its GPUs or CPU ranks are
    planned for, or on the command line (`python -m dsflow plan`) unless --host-mem says."""
    if given is not None:
        return given, "given"
    if _arg(args, "host_mem") is not None:
        return int(float(_arg(args, "host_mem")) * memory.GB), "--host-mem"
    if args is not None or device == "cpu" or gpu_source.startswith("visible"):
        return machine.host_memory_bytes(), "this machine"
    return None, "unknown"


def _disk(args: Any, given: int | None) -> tuple[int | None, str]:
    """(free disk bytes, where that came from): --disk, else this machine's free space here,
    rounded down to whole GB so the plan stays the same while a run writes small files."""
    if given is not None:
        return given, "given"
    if _arg(args, "disk") is not None:
        return int(float(_arg(args, "disk")) * memory.GB), "--disk"
    free = machine.disk_free_bytes(".")
    if free is None:
        return None, "unknown"
    return free // memory.GB * memory.GB, "this machine"


def _resources(
    train: dict, args: Any, gpus: list[dict], world: int, given: tuple
) -> dict[str, Any]:
    """The machine's fields of a Request: device, GPU memory, host RAM and free disk, each with
    where it came from. ``given`` = (GPU memory, host RAM, free disk) bytes or None each."""
    gpu_mem_bytes, host_mem_bytes, disk_free_bytes = given
    device = _device(train, args, gpus, gpu_mem_bytes)
    gpu_mem, gpu_source = (
        (None, "CPU ranks") if device == "cpu" else _gpu_memory(args, gpus, world, gpu_mem_bytes)
    )
    host_mem, host_source = _host_memory(args, host_mem_bytes, gpu_source, device)
    disk, disk_source = _disk(args, disk_free_bytes)
    return {
        "device": device,
        "gpu_mem_bytes": gpu_mem,
        "gpu_mem_source": gpu_source,
        "host_mem_bytes": host_mem,
        "host_mem_source": host_source,
        "disk_free_bytes": disk,
        "disk_source": disk_source,
    }


def _perf(
    train: dict, args: Any, world: int, device: str, precision: str, gpus: list[dict]
) -> dict[str, Any]:
    """The memory setup's fast paths as the train stage resolves train.perf
    (dsflow.model.fastpaths): the fused loss (`auto`: on CUDA, not in fp16; a chunk size
    anywhere), compiled layers (`auto`: on CUDA; never at ZeRO-3, which :func:`memory.estimate`
    applies per layout), whether the routed experts run inside them (the sorted experts, in
    bf16 and fp16, on GPUs with a grouped GEMM: below compute capability 8.0 the train stage
    keeps HF's), how their rows are padded (:func:`rows_on`) and the FP8 linears' recipe."""
    from dsflow.model import fastpaths

    asked = train.get("perf") or {}
    perf = {k: v for k, v in asked.items() if k in ("ce_chunk", "compile", "experts")}
    chosen = fastpaths.resolve(perf, device, precision=precision)
    fp8 = fp8_on(asked)
    capabilities = _capabilities(args, gpus, world)
    # The train stage refuses ZeRO-3 with these (dsflow.model.fastpaths): no plan offers it.
    no_zero3 = f"train.perf.{fp8[0][0]}: {fp8[0][1]}" if fp8 else ""
    if perf.get("compile") is True:
        no_zero3 = "train.perf.compile: true"
    in_graph = fastpaths.experts_in_graph(chosen.experts, precision, capabilities)
    # Liger Kernel replaces the experts with its own (fastpaths._liger_experts): no padding.
    sorted_on_gpu = device == "cuda" and in_graph and not asked.get("liger")
    rows = ("fp8" if asked.get("fp8_experts") else precision) if sorted_on_gpu else ""
    return {
        "ce_chunk": chosen.ce_chunk,
        "compiled": chosen.compile,
        "experts_in_graph": in_graph,
        "expert_rows": rows,
        "experts_named": asked.get("experts", "auto") != "auto",
        "expert_rows_align": rows_on(rows, capabilities),
        "fp8": asked.get("fp8") or "off",  # as fastpaths.fp8_choice reads it
        "no_zero3": no_zero3,
    }


def _capabilities(args: Any, gpus: list[dict], world: int) -> list[tuple[int, int]]:
    """The compute capabilities of the GPUs the run uses: the visible ones it takes, else the
    profile's GPU's; one not known (--gpu-mem) counts as compute capability 8.0, the least
    with a grouped GEMM (so an unknown GPU pads the sorted experts' rows in bf16 too)."""
    from dsflow.model import fastpaths

    used = gpus[: max(1, min(world, len(gpus)))]
    known = [tuple(g["capability"]) for g in used if g.get("capability")]
    if not known and not gpus and (named := _profile_gpu(args)) is not None:
        known = [GPU_CAPABILITY[named]]
    return known or [fastpaths.GROUPED_GEMM_CAPABILITY]


def rows_on(rows: str, capabilities: list[tuple[int, int]]) -> int:
    """The multiple the sorted experts pad each expert's rows to (memory.expert_padding_rows)
    on GPUs of these capabilities: `rows` is "" (no sorted experts on a GPU in 16-bit: 0),
    "fp8" (the FP8 experts: 16) or the precision whose grouped GEMM decides (the Triton one pads
    to its tile: fp16, and bf16 outside compute capability 9.x/10.x: fastpaths.grouped_gemm)."""
    import torch

    from dsflow.model import fastpaths

    if rows == "fp8":
        return fastpaths.FP8_GROUP_ROWS
    if not rows:
        return 0
    dtype = torch.float16 if rows == "fp16" else torch.bfloat16
    kernels = {fastpaths.grouped_gemm(dtype, c) for c in capabilities}
    return fastpaths.TRITON_GEMM_ROWS if "triton" in kernels else 0


def _balance_loss(balance: dict, config: Any) -> bool:
    """Whether the balancer's aux loss runs (its scores stay alive until backward): V3's
    train.balance.seq_aux_alpha; V2's aux_loss_alpha, auto = the model config's (unset: on, as
    DeepSeek-V2 trained, dsflow.model.balance)."""
    if getattr(config, "model_type", None) != "deepseek_v2":
        return float(balance.get("seq_aux_alpha", 0.0)) > 0
    alpha = balance.get("aux_loss_alpha", "auto")
    if alpha == "auto":
        alpha = getattr(config, "aux_loss_alpha", None)
    return alpha is None or float(alpha) > 0


def _lora(
    train: dict, args: Any, config: Any, mtp_depth: int, notes: list[str]
) -> dict[str, int | bool]:
    """The memory setup's LoRA sizes (``--finetune`` / train.finetune with train.lora), the
    MTP modules' adapters among them."""
    if (_arg(args, "finetune") or train.get("finetune", "full")) != "lora":
        return {}
    setting = train["lora"]
    sizes = lora.counts(config, setting, mtp_depth)
    notes.append(
        f"LoRA rank {setting['rank']} on {', '.join(setting['targets'])}: "
        f"{sizes['adapter']:,} trainable parameters, the rest frozen"
    )
    return {
        "lora_adapter": sizes["adapter"],
        "lora_merged": sizes["merged"],
        "lora_merged_layer": sizes["merged_layer"],
        "lora_rank_outputs": sizes["rank_outputs"],
        "lora_rank_outputs_layer": sizes["rank_outputs_layer"],
        "frozen_experts": "experts" not in setting["targets"],
    }


def _checkpoints(train: dict, batch: dsconfig.Batch) -> dict[str, int]:
    """keep_checkpoints, and how many checkpoints exist at once at the peak of this run."""
    keep = int(train.get("keep_checkpoints", 2))
    steps = dsconfig.total_steps(train, batch)
    every = int(train["checkpoint_every"])
    return {"keep_checkpoints": keep, "checkpoints": memory.checkpoints_on_disk(keep, steps, every)}


def _zero_buffers(zcfg: dict, zero: int, world: int) -> dict[str, Any]:
    """train.zero's bucket sizes, and whether DeepSpeed overlaps its gradient communication
    (its reduce buckets then double), as the train stage resolves `auto` on GPUs. A reduce
    bucket of `auto` is decided once the request is whole (:func:`_reduce_bucket`)."""
    hooks = {"overlap_comm": "auto", "contiguous_gradients": "auto", **zcfg}
    reduce = zcfg.get("reduce_bucket_size", memory.DEFAULT_BUCKETS[0])
    return {
        "bucket_sizes": (
            memory.DEFAULT_BUCKETS[0] if reduce == "auto" else int(reduce),
            int(zcfg.get("allgather_bucket_size", memory.DEFAULT_BUCKETS[1])),
        ),
        "overlap_comm": dsconfig.gradient_hooks(hooks, zero, world, "cuda")[0],
        # as given: `auto` is decided for each stage and world the planner walks (memory.Setup)
        "contiguous_gradients": hooks["contiguous_gradients"],
    }


def _reduce_bucket(req: Request, zcfg: dict) -> Request:
    """`train.zero.reduce_bucket_size: auto`: the bucket the communication estimate chooses for
    this model, batch and GPU (dsflow.plan.comm.bucket_for)."""
    if zcfg.get("reduce_bucket_size") != "auto":
        return req
    return rebucketed(replace(req, bucket_auto=True))


def rebucketed(setup: Any) -> Any:
    """`setup` with its reduce bucket chosen again where it is `auto` (a Request whose micro
    batch, ranks or layout the planner varies); any other setup as it is."""
    if not getattr(setup, "bucket_auto", False):
        return setup
    return replace(setup, bucket_sizes=(comm.bucket_for(setup), setup.bucket_sizes[1]))


def resolve(
    params: dict,
    args: Any = None,
    *,
    world: int | None = None,
    gpus: list[dict[str, Any]] | None = None,
    gpu_mem_bytes: int | None = None,
    host_mem_bytes: int | None = None,
    disk_free_bytes: int | None = None,
) -> Request:
    """The plan's inputs from params, the ad-hoc flags in ``args`` and the machine.

    - model: ``--model`` (then params' overrides / pretrained are ignored), else
      ``model.preset`` + ``model.overrides``, or a ``model.pretrained`` checkpoint's config (a
      folder, or a Hub id in the cache).
    - vocabulary: ``--vocab``; the pretrained checkpoint's; ``data/shards/train/index.json``
      (what train uses); without shards ``tokenizer.vocab_size`` (what the tokenizer stage will
      train, unless ``tokenizer.pretrained`` or ``--model``); the preset's
      ``published_vocab_size``; 32000.
    - world: ``world`` / ``--gpus`` / ``train.gpus`` x ``train.nodes`` (auto: the visible GPUs,
      else 1).
    - device: GPUs when GPU flags or memory are given, or train.device, the visible GPUs or a
      profile say so; else CPU ranks, which have no GPU memory and share the host's RAM.
    - GPU memory: ``gpu_mem_bytes`` / ``--gpu-mem``; the smallest of the visible GPUs used
      (``torch.cuda.get_device_properties``); a GPU named by a profile file (rtx4090x3.yaml);
      else unknown. Host RAM: ``host_mem_bytes`` / ``--host-mem``; this machine's for the
      command line, CPU ranks or its own GPUs; else unknown (not checked). Disk: ``--disk``,
      else this machine's free space.
    - checkpoints on disk: keep + 1 at most, never more than the run saves.

    ``gpus`` (the visible GPUs as :func:`dsflow.machine.gpus` returns them),
    ``host_mem_bytes`` and ``disk_free_bytes`` replace what this machine reports (the
    pre-launch checks pass theirs).
    """
    train = params["train"]
    notes: list[str] = []
    model = _model(params, args, notes)
    if gpus is None:
        gpus = machine.gpus()
    world = _world(train, args, world, gpus)
    config, vocab_source = _config(params, args, model, notes)
    micro, accum = _batch(train, args, world)
    where = _resources(train, args, gpus, world, (gpu_mem_bytes, host_mem_bytes, disk_free_bytes))
    train = {**train, "precision": machine.resolve_precision(train["precision"], where["device"])}
    zero, offload_opt, offload_par = _layout(train, args, world, where["device"], notes)
    offload_device, nvme_path = _offload_device(train, args)
    seq_len = int(_arg(args, "seq_len") or train["seq_len"])
    mtp_depth = _mtp_depth(params, args, config, seq_len, notes)
    req = Request(
        config=config,
        preset=model[0],
        vocab_size=int(config.vocab_size),
        vocab_source=vocab_source,
        seq_len=seq_len,
        mtp_depth=mtp_depth,
        micro_batch=micro,
        grad_accum=accum,
        world=world,
        zero_stage=zero,
        precision=_arg(args, "precision") or train["precision"],
        offload_optimizer=offload_opt,
        offload_params=offload_par,
        activation_checkpointing=bool(
            _arg(args, "activation_checkpointing")
            or (train.get("perf") or {}).get("activation_checkpointing", False)
        ),
        **_zero_buffers(train.get("zero", {}), zero, world),
        seq_aux=_balance_loss(train.get("balance", {}), config),
        fused_optimizer=fused_optimizer_wanted(train, world),
        offload_device=offload_device,
        # --gpus plans one machine; params plan train.nodes machines of train.gpus ranks each.
        nodes=1 if _arg(args, "gpus") else int(train.get("nodes", 1)),
        **_perf(
            train, args, world, where["device"], _arg(args, "precision") or train["precision"], gpus
        ),
        **_lora(train, args, config, mtp_depth, notes),
        **_checkpoints(train, dsconfig.Batch(micro, accum, world)),
        **where,
        nvme_path=nvme_path,
        pretrained=model[2],
        notes=notes,
    )
    return _reduce_bucket(req, train.get("zero", {}))
