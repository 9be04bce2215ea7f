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
        also = ", ".join(
            f"{_ITEM_NAMES[k].format(dtype=dtype)} {memory.fmt_gb(gpu[k])}" for k in others
        )
        return False, (
            f"needs {memory.fmt_gb(need)} per GPU but {memory.fmt_gb(gpu_mem_bytes)} available: "
            f"the {name}{alone} {'is' if item == 'zero3_gathered' else 'are'} "
            f"{memory.fmt_gb(gpu[item])} ({_explain(estimate, item)})"
            + (f"; also {also}" if also else "")
        )
    host = estimate["host"]
    if host_mem_bytes is not None and host["node_total"] > host_mem_bytes:
        offloaded = host["optimizer"] + host["gradients"] + host["parameters"]
        return False, (
            f"fits the GPUs ({memory.fmt_gb(need)} of {memory.fmt_gb(gpu_mem_bytes)}) but needs "
            f"{memory.fmt_gb(host['node_total'])} of host RAM, "
            f"{memory.fmt_gb(host_mem_bytes)} available (per rank: offloaded states "
            f"{memory.fmt_gb(offloaded)}, or the fp32 model every rank builds first "
            f"{memory.fmt_gb(host['init_per_rank'])})"
        )
    return True, (
        f"fits: {memory.fmt_gb(need)} per GPU of {memory.fmt_gb(gpu_mem_bytes)} "
        f"({memory.fmt_gb(gpu_mem_bytes - need)} headroom)"
    )


# --------------------------------------------------------------------------- strategies


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


def _attempt(config: Any, setup: memory.Setup, fit: tuple, preset: str | None, micro: int) -> dict:
    """One strategy's row: ``fit`` = (GPU bytes, host bytes or None)."""
    est = memory.estimate(config, setup)
    fits, reason = verdict(est, *fit)
    z, o, p = setup.zero_stage, setup.offload_optimizer, setup.offload_params
    c, m = setup.activation_checkpointing, setup.micro_batch
    return {
        "strategy": _strategy_name(z, o, p, c, m, preset),
        "preset": preset,
        "zero_stage": z,
        "offload_optimizer": o,
        "offload_params": p,
        "activation_checkpointing": c,
        "micro_batch": m,
        "grad_accum_factor": micro // m,
        "gpu_bytes": est["gpu"]["total"],
        "gpu_gb": memory.round_gb(est["gpu"]["total"]),
        "host_bytes": est["host"]["node_total"],
        "host_gb": memory.round_gb(est["host"]["node_total"]),
        "fits": fits,
        "reason": reason,
        "recommended": False,
    }


def _smaller_presets(config: Any) -> list[tuple[str, Any]]:
    """(name, config) of the presets with fewer parameters, largest first."""
    own = presets.param_counts(config)["total"]
    sized = []
    for name in presets.PRESETS:
        cfg = presets.model_config(name, config.vocab_size)
        total = presets.param_counts(cfg)["total"]
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
) -> list[dict[str, Any]]:
    """Strategies tried in cost order until one fits; the last row is the recommendation when
    its ``fits`` is True (``recommended`` marks it), otherwise nothing fits.

    Order: as configured; activation checkpointing; micro batch halved down to 1; ZeRO-3;
    optimizer offload; parameter offload (each memory layout retried with checkpointing and
    smaller micro batches); then smaller presets (one row each, its cheapest strategy). Every
    strategy counts the balancer's aux-loss scores (``seq_aux``), whatever ``setup`` says.
    """
    base = dataclasses.replace(setup, seq_aux=True)
    fit, micro = (gpu_mem_bytes, host_mem_bytes), setup.micro_batch
    ladder = [
        dataclasses.replace(base.layout(z, o, p), activation_checkpointing=c, micro_batch=m)
        for z, o, p, c, m in _ladder(
            setup.zero_stage,
            setup.offload_optimizer,
            setup.offload_params,
            setup.activation_checkpointing,
            micro,
        )
    ]
    rows: list[dict[str, Any]] = []
    for s in ladder:
        rows.append(_attempt(config, s, fit, None, micro))
        if rows[-1]["fits"]:
            rows[-1]["recommended"] = True
            return rows
    if not smaller_presets:
        return rows
    for name, cfg in _smaller_presets(config):
        last = None
        for s in ladder:
            last = _attempt(cfg, s, fit, name, micro)
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
    its GPUs and host, the cheapest strategies that fit, and the disk summary. The checks before
    a launch read it; reports/plan.json holds it with the tables."""
    est = est or memory.estimate(req.config, req)
    fits, reason, rows = None, "GPU memory unknown: pass --gpu-mem GB", []
    if req.gpu_mem_bytes is not None:
        fits, reason = verdict(est, req.gpu_mem_bytes, req.host_mem_bytes)
        rows = cheapest_fit(
            req.config, req, gpu_mem_bytes=req.gpu_mem_bytes, host_mem_bytes=req.host_mem_bytes
        )
    return {
        "request": req.record(),
        "estimate": est,
        "verdict": {"fits": fits, "reason": reason},
        "recommendation": recommendation(rows),
        "strategies": rows,
        "summary": req.summary(),
    }


def _gpus_of(record: dict) -> str:
    mem = record.get("gpu_mem_bytes")
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
    if theirs == mine and saved.get("summary") == json.loads(json.dumps(req.summary())):
        return saved, ""
    keys = ("world", "gpu_mem_bytes", "gpu_mem_source")
    if any(theirs.get(k) != mine[k] for k in keys):
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


def first_fit(req: request.Request, host_mem_bytes: int | None) -> tuple[memory.Setup, dict, str]:
    """(setup, estimate, why) of the first layout `auto` tries that fits, in cost order from
    ``req``'s layout (its first stage); a UsageError names the cheapest fit when none does."""
    first = req.zero_stage
    want_opt, want_par = req.offload_optimizer, req.offload_params
    if req.world == 1:
        # ZeRO-3 partitions nothing on one GPU: ZeRO-Offload (ZeRO-2, whose CPU offload is
        # DeepSpeed's classic and tested path) comes first.
        order = [(first, False, False), (2, True, False), (3, True, False), (3, True, True)]
    else:
        order = [(first, False, False), (3, False, False), (3, True, False), (3, True, True)]
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
        req.config, req, gpu_mem_bytes=req.gpu_mem_bytes, host_mem_bytes=host_mem_bytes
    )
    rec = recommendation(rows)
    hint = f"cheapest fit: {rec['strategy']}" if rec else "nothing fits, not even smaller presets"
    msg = (
        f"train.zero_stage: auto: no ZeRO layout fits {req.preset} at micro batch "
        f"{req.micro_batch} on {req.world} GPU(s) (ZeRO-3 with CPU offload {reason}); {hint}; "
        "see python -m dsflow plan"
    )
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
    optimizer), at the configured micro batch (offload asked for in train.offload is kept). One
    GPU has nothing to partition, so ZeRO-0/1 hold what ZeRO-2 does, and ZeRO-1 handles its
    gradients without a hook per parameter in every backward: faster on one H200
    (docs/performance.md). On CPU there is nothing to fit: ZeRO-2 (the fewest collectives).
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
