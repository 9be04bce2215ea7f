"""Which memory layouts fit: verdicts with their reasons, the ladder of cheaper strategies, the
layout `train.zero_stage: auto` picks, and the memory plan of a request (what reports/plan.json
and the checks before a launch hold)."""

from __future__ import annotations

import copy
import dataclasses
import json
from typing import Any

from dsflow import machine
from dsflow.errors import UsageError
from dsflow.model import presets
from dsflow.paths import PLAN
from dsflow.plan import memory, request

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
            f"(the fp32 logits/cross-entropy peak alone {memory.fmt_gb(acts['logits_peak'])}); "
            "activation checkpointing or a smaller micro batch shrinks them"
        )
    if item == "zero3_gathered":
        p = est["params"]
        return (
            f"ZeRO-3 gathers the largest module whole on every GPU with its gradient: "
            f"{p['largest_module_name']}, {p['largest_module'] / 1e9:.2f}B params"
        )
    if item == "gradients_fp32_step":
        flat = s in (1, 2) and dtype == "16-bit" and not inp["offload_optimizer"]
        copies = "a flat 16-bit copy and its fp32 cast" if flat else "an fp32 copy"
        return f"DeepSpeed's {copies} of this rank's gradients during optimizer.step()"
    return item


_ITEM_NAMES = {
    "weights": "{dtype} weights",
    "gradients": "gradients",
    "optimizer": "optimizer states",
    "activations": "activations",
    "zero3_gathered": "ZeRO-3 gathered module",
    "gradients_fp32_step": "step gradient copies",
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


def _gpu_verdict(estimate: dict, gpu_mem_bytes: int) -> tuple[bool, str]:
    """(fits the GPU, one line with the numbers): what fills the GPU when it does not fit."""
    gpu = estimate["gpu"]
    need = gpu["total"]
    dtype = "fp32" if estimate["inputs"]["precision"] == "fp32" else "16-bit"
    if need <= gpu_mem_bytes:
        return True, (
            f"fits: {memory.fmt_gb(need)} per GPU of {memory.fmt_gb(gpu_mem_bytes)} "
            f"({memory.fmt_gb(gpu_mem_bytes - need)} headroom)"
        )
    item = _blocker(estimate, gpu_mem_bytes)
    name = _ITEM_NAMES[item].format(dtype=dtype)
    alone = " alone" if gpu[item] > gpu_mem_bytes else ""
    others = sorted(
        (k for k in _ITEM_NAMES if k != item and gpu[k] > 0), key=lambda k: (-gpu[k], k)
    )[:3]
    also = ", ".join(
        f"{_ITEM_NAMES[k].format(dtype=dtype)} {memory.fmt_gb(gpu[k])}" for k in others
    )
    return False, (
        f"needs {memory.fmt_gb(need)} per GPU but {memory.fmt_gb(gpu_mem_bytes)} available: "
        f"the {name}{alone} {'is' if item == 'zero3_gathered' else 'are'} "
        f"{memory.fmt_gb(gpu[item])} ({_explain(estimate, item)})"
        + (f"; also {also}" if also else "")
    )


def _disk_verdict(estimate: dict, disk: tuple[int | None, int] | None) -> tuple[bool, str]:
    """(fits the disk, what it needs): ``disk`` = (free bytes or None, checkpoints on disk)."""
    if disk is None or disk[0] is None:
        return True, ""
    free, checkpoints = disk
    need = memory.disk_need(estimate, checkpoints)
    if need <= free:
        return True, f"disk {memory.fmt_gb(need)} of {memory.fmt_gb(free)}"
    inp, P = estimate["inputs"], estimate["params"]["total"]
    ckpt = memory.checkpoint_bytes(P, inp["precision"], inp["zero_stage"], inp["lora_adapter"])
    swap = estimate["nvme"]["node_total"]
    return False, (
        f"needs {memory.fmt_gb(need)} of disk, {memory.fmt_gb(free)} free ({checkpoints} "
        f"checkpoint(s) of {memory.fmt_gb(ckpt)}, the export "
        f"{memory.fmt_gb(memory.bytes_per_element(inp['precision']) * P)}"
        + (f", NVMe swap files {memory.fmt_gb(swap)}" if swap else "")
        + ")"
    )


def verdict(
    estimate: dict,
    gpu_mem_bytes: int,
    host_mem_bytes: int | None = None,
    disk: tuple[int | None, int] | None = None,
) -> tuple[bool, str]:
    """(fits, one-line reason with the numbers). ``host_mem_bytes`` (optional) also checks the
    host RAM the offloaded states and the per-rank fp32 model build need; ``disk`` = (free
    bytes, checkpoints on disk) the checkpoints, the export and NVMe swap files."""
    fits, reason = _gpu_verdict(estimate, gpu_mem_bytes)
    if not fits:
        return fits, reason
    need = estimate["gpu"]["total"]
    host = estimate["host"]
    gpus = f"fits the GPUs ({memory.fmt_gb(need)} of {memory.fmt_gb(gpu_mem_bytes)})"
    if host_mem_bytes is not None and host["node_total"] > host_mem_bytes:
        offloaded = host["optimizer"] + host["gradients"] + host["parameters"]
        return False, (
            f"{gpus} but needs {memory.fmt_gb(host['node_total'])} of host RAM, "
            f"{memory.fmt_gb(host_mem_bytes)} available (per rank: offloaded states "
            f"{memory.fmt_gb(offloaded)}, or the fp32 model every rank builds first "
            f"{memory.fmt_gb(host['init_per_rank'])})"
        )
    disk_fits, disk_line = _disk_verdict(estimate, disk)
    if not disk_fits:
        return False, f"{gpus} but {disk_line}"
    if host_mem_bytes is not None:
        reason += (
            f"; host RAM {memory.fmt_gb(host['node_total'])} of {memory.fmt_gb(host_mem_bytes)}"
        )
    return True, reason + (f"; {disk_line}" if disk_line else "")


def cpu_host_need(estimate: dict) -> int:
    """Host RAM of one node's CPU ranks: each keeps its model states and activations there (or
    the fp32 model it builds first, whichever is larger), plus the process itself."""
    host, inputs = estimate["host"], estimate["inputs"]
    base = host["per_rank"] - host["init_per_rank"]
    ranks = -(-inputs["world"] // inputs.get("nodes", 1))
    return (max(estimate["gpu"]["allocated"], host["init_per_rank"]) + base) * ranks


def cpu_verdict(
    estimate: dict, host_mem_bytes: int | None, disk: tuple[int | None, int] | None = None
) -> tuple[bool | None, str]:
    """(fits, one line) for CPU ranks: their memory against the host's RAM, and the disk."""
    need, world = cpu_host_need(estimate), estimate["inputs"]["world"]
    what = f"{world} CPU rank(s) need {memory.fmt_gb(need)} of host RAM"
    if host_mem_bytes is None:
        return None, f"{what}; host RAM unknown: pass --host-mem GB"
    if need > host_mem_bytes:
        return False, f"{what}, {memory.fmt_gb(host_mem_bytes)} available"
    disk_fits, disk_line = _disk_verdict(estimate, disk)
    if not disk_fits:
        return False, f"{what} of {memory.fmt_gb(host_mem_bytes)}, but {disk_line}"
    line = f"fits: {what} of {memory.fmt_gb(host_mem_bytes)}"
    return True, line + (f"; {disk_line}" if disk_line else "")


# --------------------------------------------------------------------------- strategies


def _strategy_name(
    zero: int,
    opt: bool,
    par: bool,
    ckpt: bool,
    micro: int,
    preset: str | None = None,
    device: str = "cpu",
) -> str:
    parts = [f"preset {preset}"] if preset else []
    parts.append(f"ZeRO-{zero}")
    to = " to NVMe" if device == "nvme" else ""
    if opt and par:
        parts.append(f"optimizer+param offload{to}")
    elif opt:
        parts.append(f"optimizer offload{to}")
    if ckpt:
        parts.append("activation checkpointing")
    parts.append(f"micro {micro}")
    return " + ".join(parts)


Layout = tuple[int, bool, bool, str]  # ZeRO stage, optimizer offload, param offload, device


def _layouts(first: Layout, nvme: bool) -> list[Layout]:
    """Memory layouts in cost order: as configured, ZeRO-3, + optimizer offload, + parameter
    offload (to host RAM), then both offloads to NVMe when an NVMe directory is set (DeepSpeed
    swaps the optimizer to NVMe at ZeRO-3 only)."""
    zero, opt, par, _ = first
    out = [first]
    if zero < 3:
        out.append((3, opt, par, "cpu"))
    if not opt:
        out.append((3, True, par, "cpu"))
    if not par:
        out.append((3, True, True, "cpu"))
    if nvme:
        out += [(3, True, False, "nvme"), (3, True, True, "nvme")]
    return list(dict.fromkeys(out))


def _ladder(first: Layout, ckpt: bool, micro: int, nvme: bool = False) -> list[tuple]:
    """Strategies (zero, opt, par, device, ckpt, micro) in cost order: the memory layouts of
    :func:`_layouts`; within each: as configured, + checkpointing, then halving the micro
    batch down to 1 (grad_accum grows to keep the global batch)."""
    out = []
    for layout in _layouts(first, nvme):
        out.append((*layout, ckpt, micro))
        if not ckpt:
            out.append((*layout, True, micro))
        m = micro // 2
        while m >= 1:
            out.append((*layout, True, m))
            m //= 2
    return list(dict.fromkeys(out))


@dataclasses.dataclass(frozen=True)
class Budget:
    """What a machine offers a plan: GPU memory per GPU, host RAM and free disk (None:
    unknown, not checked), and how many checkpoints the run keeps on disk at once."""

    gpu_mem_bytes: int
    host_mem_bytes: int | None = None
    disk_free_bytes: int | None = None
    checkpoints: int = 3

    def verdict(self, est: dict) -> tuple[bool, str]:
        disk = (self.disk_free_bytes, self.checkpoints)
        return verdict(est, self.gpu_mem_bytes, self.host_mem_bytes, disk)


def _attempt(config: Any, setup: memory.Setup, budget: Budget, preset: str | None, micro: int):
    """One strategy's row."""
    est = memory.estimate(config, setup)
    fits, reason = budget.verdict(est)
    z, o, p = setup.zero_stage, setup.offload_optimizer, setup.offload_params
    c, m, dev = setup.activation_checkpointing, setup.micro_batch, setup.offload_device
    disk = memory.disk_need(est, budget.checkpoints)
    return {
        "strategy": _strategy_name(z, o, p, c, m, preset, dev if (o or p) else "cpu"),
        "preset": preset,
        "zero_stage": z,
        "offload_optimizer": o,
        "offload_params": p,
        "offload_device": dev if (o or p) else "none",
        "activation_checkpointing": c,
        "micro_batch": m,
        "grad_accum_factor": micro // m,
        "gpu_bytes": est["gpu"]["total"],
        "gpu_gb": memory.round_gb(est["gpu"]["total"]),
        "host_bytes": est["host"]["node_total"],
        "host_gb": memory.round_gb(est["host"]["node_total"]),
        "disk_bytes": disk,
        "disk_gb": memory.round_gb(disk),
        "fits": fits,
        "reason": reason,
        "recommended": False,
    }


def _smaller_presets(config: Any, mtp_depth: int = 0) -> list[tuple[str, Any]]:
    """(name, config) of the presets with fewer parameters, largest first; with `mtp_depth`
    only those of the family the train stage trains MTP for (its own depths counted)."""
    own = presets.param_counts(config, mtp_depth)["total"]
    sized = []
    for name in presets.PRESETS:
        if mtp_depth and presets.preset_model_type(name) != "deepseek_v3":
            continue
        cfg = presets.model_config(name, config.vocab_size)
        total = presets.param_counts(cfg, mtp_depth)["total"]
        if total < own:
            sized.append((total, name, cfg))
    return [(name, cfg) for _, name, cfg in sorted(sized, key=lambda t: (-t[0], t[1]))]


def cheapest_fit(
    config: Any,
    setup: memory.Setup,
    *,
    gpu_mem_bytes: int,
    host_mem_bytes: int | None = None,
    smaller_presets: bool = True,
    disk_free_bytes: int | None = None,
    checkpoints: int = 3,
    nvme: bool = False,
) -> list[dict[str, Any]]:
    """Strategies tried in cost order until one fits; the last row is the recommendation when
    its ``fits`` is True (``recommended`` marks it), otherwise nothing fits.

    Order: as configured; activation checkpointing; micro batch halved down to 1; ZeRO-3;
    optimizer offload; parameter offload; with ``nvme`` both offloads to NVMe (each memory
    layout retried with checkpointing and smaller micro batches; no ZeRO-3 layout where the
    setup rules it out, ``no_zero3``); then smaller presets (one row
    each, its cheapest strategy). A strategy fits when the GPU, the host RAM and the disk
    (``disk_free_bytes``, for ``checkpoints`` checkpoints) hold it; None is not checked. Every
    strategy counts the balancer's aux-loss scores (``seq_aux``), whatever ``setup`` says.
    """
    base = dataclasses.replace(setup, seq_aux=True)
    budget = Budget(gpu_mem_bytes, host_mem_bytes, disk_free_bytes, checkpoints)
    micro = setup.micro_batch
    opt, par = setup.offload_optimizer, setup.offload_params
    first = (setup.zero_stage, opt, par, setup.offload_device if opt or par else "cpu")
    ladder = [
        request.rebucketed(
            dataclasses.replace(base.layout(z, o, p, d), activation_checkpointing=c, micro_batch=m)
        )
        for z, o, p, d, c, m in _ladder(first, setup.activation_checkpointing, micro, nvme)
        if not (setup.no_zero3 and z == 3)
    ]
    rows: list[dict[str, Any]] = []
    for s in ladder:
        rows.append(_attempt(config, s, budget, None, micro))
        if rows[-1]["fits"]:
            rows[-1]["recommended"] = True
            return rows
    if not smaller_presets:
        return rows
    for name, cfg in _smaller_presets(config, setup.mtp_depth):
        last = None
        for s in ladder:
            last = _attempt(cfg, s, budget, name, micro)
            if last["fits"]:
                break
        rows.append(last)
        if last["fits"]:
            last["recommended"] = True
            return rows
    return rows


def recommendation(rows: list[dict]) -> dict | None:
    return next((r for r in rows if r["recommended"]), None)


# --------------------------------------------------------------------------- memory plans


def assess(req: request.Request, est: dict | None = None) -> dict[str, Any]:
    """The memory plan of ``req``: its estimate (``est`` when already made), the verdict for
    its GPUs (or CPU ranks), host RAM and disk, the cheapest strategies that fit, the smallest
    machine that would hold the model when nothing fits, and the disk summary. The checks
    before a launch read it; reports/plan.json holds it with the tables."""
    est = est or memory.estimate(req.config, req)
    disk = (req.disk_free_bytes, req.checkpoints)
    rows: list[dict] = []
    if req.device == "cpu":
        fits, reason = cpu_verdict(est, req.host_mem_bytes, disk)
    elif req.gpu_mem_bytes is None:
        fits, reason = None, "GPU memory unknown: pass --gpu-mem GB"
    else:
        fits, reason = verdict(est, req.gpu_mem_bytes, req.host_mem_bytes, disk)
        rows = cheapest_fit(
            req.config,
            req,
            gpu_mem_bytes=req.gpu_mem_bytes,
            host_mem_bytes=req.host_mem_bytes,
            disk_free_bytes=req.disk_free_bytes,
            checkpoints=req.checkpoints,
            nvme=req.nvme_path is not None,
            smaller_presets=not req.pretrained,
        )
    plan = {
        "request": req.record(),
        "estimate": est,
        "verdict": {"fits": fits, "reason": reason},
        "recommendation": recommendation(rows),
        "strategies": rows,
        "summary": req.summary(),
        "smallest_machine": None,
    }
    if model_fits(plan) is False:
        plan["smallest_machine"] = smallest_machine(req, est)
    return plan


def model_fits(plan: dict) -> bool | None:
    """Whether the planned model fits in some layout (a smaller preset does not count); None
    when GPU memory or host RAM is unknown."""
    if plan["verdict"]["fits"] is None:
        return None
    return bool(plan["verdict"]["fits"]) or any(
        r["fits"] and r["preset"] is None for r in plan["strategies"]
    )


# Machines the smallest one is picked from: each size of GPU memory once (the first GPU of
# request.GPU_MEMORY_BYTES that has it), 1, 2, 3, 4 or 8 of them.
MACHINE_GPU_COUNTS = (1, 2, 3, 4, 8)


def _gpu_sizes() -> list[tuple[int, str]]:
    sizes: dict[int, str] = {}
    for name, size in request.GPU_MEMORY_BYTES.items():
        sizes.setdefault(size, name)
    return sorted(sizes.items())


def smallest_machine(req: request.Request, est: dict) -> dict[str, Any]:
    """The smallest machine that would hold ``req``'s model in its cheapest strategy, with the
    host RAM and disk that strategy needs (what the machine must have, not limits here): the
    asked GPUs when host RAM or disk is all they lack, else as many GPUs as asked with the
    smallest memory that holds it, else the least GPU memory in all (1 to 8 GPUs). For CPU
    ranks, the host RAM they need."""
    if req.device == "cpu":
        return {
            "cpu_ranks": req.world,
            "host_bytes": cpu_host_need(est),
            "disk_bytes": memory.disk_need(est, req.checkpoints),
        }
    asked = [(req.world, req.gpu_mem_bytes, "as asked")]
    others = sorted(
        (n != req.world, n * size, n, size, name)
        for n in MACHINE_GPU_COUNTS
        for size, name in _gpu_sizes()
        if size > req.gpu_mem_bytes or n != req.world
    )
    for n, size, name in asked + [m[2:] for m in others]:
        on = req
        if name in request.GPU_CAPABILITY:  # another GPU: its grouped GEMM pads as it does
            align = request.rows_on(req.expert_rows, [request.GPU_CAPABILITY[name]])
            on = dataclasses.replace(req, expert_rows_align=align)
        rows = cheapest_fit(
            req.config,
            request.rebucketed(dataclasses.replace(on, world=n)),
            gpu_mem_bytes=size,
            smaller_presets=False,
            checkpoints=req.checkpoints,
            nvme=req.nvme_path is not None,
        )
        rec = recommendation(rows)
        if rec is not None:
            return {
                "gpus": n,
                "gpu_mem_bytes": size,
                "gpu": name,
                "host_bytes": rec["host_bytes"],
                "disk_bytes": rec["disk_bytes"],
                "strategy": rec["strategy"],
            }
    return {}


def describe_machine(machine_: dict | None) -> str:
    """The smallest machine as one phrase: "1 x A100 with 80 GB (81,920 MiB = 85.9 GB),
    2,700.0 GB of host RAM, ...": a named card comes with the memory it is sold as."""
    if not machine_:
        return "no machine of up to 8 GPUs in the table holds it"
    host = memory.fmt_gb(machine_["host_bytes"])
    disk = memory.fmt_gb(machine_["disk_bytes"])
    if "cpu_ranks" in machine_:
        return f"{machine_['cpu_ranks']} CPU rank(s) with {host} of host RAM, {disk} of disk"
    if machine_["gpu"] in request.GPU_MEMORY_BYTES:
        gpus = request.card(machine_["gpu"])
    else:  # the asked GPUs: their memory as asked, no card named
        gpus = f"{memory.fmt_gb(machine_['gpu_mem_bytes'])} GPU(s) ({machine_['gpu']})"
    return (
        f"{machine_['gpus']} x {gpus}, {host} of host RAM, {disk} of disk: {machine_['strategy']}"
    )


def _gpus_of(record: dict) -> str:
    mem = record.get("gpu_mem_bytes")
    if record.get("device") == "cpu":
        return f"{record.get('world')} CPU rank(s)"
    if mem is None:
        return f"{record.get('world')} rank(s), GPU memory unknown"
    return f"{record.get('world')} GPU(s) of {memory.fmt_gb(mem)} ({record.get('gpu_mem_source')})"


def planned(req: request.Request) -> tuple[dict | None, str]:
    """(reports/plan.json, "") when the plan stage planned exactly ``req`` (the same GPUs,
    settings and model), else (None, a line saying why when its GPUs differ, or "")."""
    try:
        saved = json.loads(PLAN.read_text())
    except (OSError, ValueError):
        return None, ""
    theirs = saved.get("request") if isinstance(saved, dict) else None
    if not theirs:
        return None, ""
    mine = json.loads(json.dumps(req.record()))
    # Free disk changes as runs write: the doctor checks it again before every launch.
    volatile = ("disk_free_bytes", "disk_source")
    same = {k: v for k, v in theirs.items() if k not in volatile} == {
        k: v for k, v in mine.items() if k not in volatile
    }
    if same and saved.get("summary") == json.loads(json.dumps(req.summary())):
        return saved, ""
    keys = ("device", "world", "gpu_mem_bytes", "gpu_mem_source")
    if any(theirs.get(k) != mine.get(k) for k in keys):
        return None, (
            f"{PLAN} was planned for {_gpus_of(theirs)}, this launch has {_gpus_of(mine)}: "
            "planning again"
        )
    return None, ""


def refuse_unless_fits(plan: dict) -> None:
    """Raise UsageError (one line: needed vs available per GPU, and the cheapest strategy that
    would fit) when the memory plan ``plan`` does not fit its GPUs; host RAM is the doctor's."""
    req = plan["request"]
    if req["gpu_mem_bytes"] is None:
        return
    fits, reason = verdict(plan["estimate"], req["gpu_mem_bytes"])
    if fits:
        return
    rec = plan["recommendation"]
    if rec:
        hint = f"cheapest fit: {rec['strategy']} ({rec['gpu_gb']:.1f} GB per GPU)"
    elif req.get("pretrained"):  # the checkpoint is the model: no smaller preset is offered
        hint = "nothing fits, not even ZeRO-3 with offload"
    else:
        hint = "nothing fits, not even smaller presets with ZeRO-3 and offload"
    what = (
        f"{req['preset']} with ZeRO-{req['zero_stage']} {req['precision']} on {req['world']} GPU(s)"
    )
    msg = f"train: {what} {reason}; {hint}; see python -m dsflow plan"
    raise UsageError(" ".join(msg.split()))


def check_fits(params: dict, world: int, device_type: str, gpu_mem_bytes: int | None) -> None:
    """:func:`refuse_unless_fits` for ``params`` on ``world`` GPUs of ``gpu_mem_bytes`` each.
    Nothing to check on CPU."""
    if device_type != "cuda":
        return
    req = request.resolve(
        params,
        None,
        world=world,
        gpu_mem_bytes=gpu_mem_bytes,
        host_mem_bytes=machine.host_memory_bytes(),
    )
    refuse_unless_fits(assess(req))


# --------------------------------------------------------------------------- zero_stage: auto


def with_layout(params: dict, stage: int, offload_optimizer: bool, offload_params: bool) -> dict:
    """A copy of params with train.zero_stage set, and CPU offload where the layout has it."""
    params = copy.deepcopy(params)
    train = params["train"]
    train["zero_stage"] = stage
    if offload_optimizer and train["offload"]["optimizer"] == "none":
        train["offload"]["optimizer"] = "cpu"
    if offload_params and train["offload"]["param"] == "none":
        train["offload"]["param"] = "cpu"
    return params


def _wanted_offload(train: dict) -> tuple[bool, bool]:
    offload = train.get("offload") or {}
    return offload.get("optimizer", "none") != "none", offload.get("param", "none") != "none"


def cpu_layout(train: dict) -> tuple[int, bool, bool, str]:
    """`auto` on CPU: nothing to fit, so ZeRO-2 (the fewest collectives); ZeRO-3 for parameter
    offload, which exists only there."""
    want_opt, want_par = _wanted_offload(train)
    stage = 3 if want_par else 2
    return stage, want_opt, want_par, "a CPU run: no GPU memory to fit, the fewest collectives"


def fit_reason(zero_stage: int, est: dict, gpu_mem_bytes: int) -> str:
    """Why `auto` took this layout, for the train stage's log line."""
    gb = f"{memory.round_gb(est['gpu']['total']):.1f} of "
    gb += f"{memory.round_gb(gpu_mem_bytes):.1f} GB per GPU"
    alone = {
        0: " (ZeRO-0, for dsflow's fused optimizer)",
        1: " (one GPU: ZeRO-1, no gradient hooks)",
    }.get(zero_stage, "")
    return f"the planner's cheapest fit{alone}: {gb}"


def layout_order(req: request.Request) -> list[tuple[int, bool, bool]]:
    """(stage, offload optimizer, offload params) in the order `auto` tries them, from ``req``'s
    first stage (then, where train.offload asks for it, with the optimizer offloaded). Without
    ZeRO-3 where a setting rules it out (``no_zero3``: train.perf.compile: true, or
    train.perf.fp8): then ZeRO-2, and ZeRO-2 with the optimizer offloaded, follow the first
    stage."""
    first = req.zero_stage
    if req.world == 1:
        # ZeRO-3 partitions nothing on one GPU: ZeRO-Offload (ZeRO-2, whose CPU offload is
        # DeepSpeed's classic and tested path) comes first.
        order = [(first, False, False), (2, True, False), (3, True, False), (3, True, True)]
    else:
        order = [(first, False, False), (3, False, False), (3, True, False), (3, True, True)]
    if req.offload_device == "nvme":  # DeepSpeed offloads to NVMe at ZeRO-3 only
        order = [o for o in order if o[0] == 3 or not o[1]]
    elif req.offload_optimizer and first in (1, 2):
        # Asked for in train.offload, the optimizer's offload is tried at the first stage
        # (ZeRO-Offload), the layout the plan stage plans, before any other stage with it.
        order.insert(1, (first, True, False))
    if req.no_zero3:
        order = [o for o in order if o[0] != 3 and o != (2, True, False)]
        order += [(2, False, False), (2, True, False)]
    return list(dict.fromkeys(order))


def first_fit(req: request.Request, host_mem_bytes: int | None) -> tuple[memory.Setup, dict, str]:
    """(setup, estimate, why) of the first layout `auto` tries that fits, in cost order from
    ``req``'s layout (its first stage); a UsageError names the cheapest fit when none does."""
    want_opt, want_par = req.offload_optimizer, req.offload_params
    if req.no_zero3 and (want_par or req.offload_device == "nvme"):
        key, fix = ("param", "none") if want_par else ("optimizer", "cpu")
        raise UsageError(
            f"train.offload.{key}: {req.offload_device} needs ZeRO-3, which {req.no_zero3} "
            f"rules out; change {req.no_zero3.split(':')[0]}, or set train.offload.{key}: {fix}"
        )
    order = layout_order(req)
    reason = ""
    for z, o, p in order:
        if (want_opt and not o) or (want_par and not p):
            continue
        setup = req.layout(z, o, p)
        est = memory.estimate(req.config, setup)
        fits, reason = verdict(est, req.gpu_mem_bytes, host_mem_bytes)
        if fits:
            return setup, est, fit_reason(z, est, req.gpu_mem_bytes)
    rows = cheapest_fit(
        req.config,
        req,
        gpu_mem_bytes=req.gpu_mem_bytes,
        host_mem_bytes=host_mem_bytes,
        smaller_presets=not req.pretrained,
    )
    rec = recommendation(rows)
    nothing = "nothing fits" if req.pretrained else "nothing fits, not even smaller presets"
    hint = f"cheapest fit: {rec['strategy']}" if rec else nothing
    last = "ZeRO-2" if req.no_zero3 else "ZeRO-3"
    msg = (
        f"train.zero_stage: auto: no ZeRO layout fits {req.preset} at micro batch "
        f"{req.micro_batch} on {req.world} GPU(s) ({last} with CPU offload {reason}); {hint}; "
        "see python -m dsflow plan"
    )
    if req.no_zero3:
        msg += f"; {req.no_zero3} rules out ZeRO-3"
    raise UsageError(" ".join(msg.split()))


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
    optimizer; no ZeRO-3 where train.perf.compile is true or train.perf.fp8 on), at the
    configured micro batch (offload asked for in train.offload is kept). One GPU has nothing to partition, so ZeRO-0/1
    hold what ZeRO-2 does, and ZeRO-1 handles its gradients without a hook per parameter in
    every backward: faster on one H200 (docs/performance.md). On CPU there is nothing to fit:
    ZeRO-2 (the fewest collectives).
    When nothing fits, a UsageError names the cheapest strategy that would (smaller micro
    batch, checkpointing, a smaller preset). Host RAM: `host_mem_bytes`, else this machine's."""
    if device_type != "cuda":
        return cpu_layout(params["train"])
    first = request.auto_first_stage(params["train"], world)
    req = request.resolve(
        with_layout(params, first, False, False), None, world=world, gpu_mem_bytes=gpu_mem_bytes
    )
    if req.gpu_mem_bytes is None:
        want_opt, want_par = _wanted_offload(params["train"])
        return first, want_opt, want_par, f"GPU memory unknown: ZeRO-{first}"
    host = host_mem_bytes if host_mem_bytes is not None else machine.host_memory_bytes()
    setup, _, why = first_fit(req, host)
    return setup.zero_stage, setup.offload_optimizer, setup.offload_params, why
