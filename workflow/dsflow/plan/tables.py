"""The planner's text: aligned plain-text tables (GB = 1e9 bytes) and the report
`python -m dsflow plan` prints."""

from __future__ import annotations

import dataclasses
from typing import Any

from dsflow.plan import layouts, memory


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


def plan_rows(
    config: Any,
    setup: memory.Setup,
    *,
    gpu_mem_bytes: int | None = None,
    host_mem_bytes: int | None = None,
    disk: tuple[int | None, int] | None = None,
) -> list[dict[str, Any]]:
    """ZeRO 0-3 x {no offload, optimizer offload, optimizer+param offload (ZeRO-3)} x
    {no checkpointing, checkpointing} at ``setup``'s batch, ranks and precision. ZeRO-0 has no
    offload in DeepSpeed. The rows compare layouts under DeepSpeed's optimizer, with the
    balancer's aux-loss scores counted. ``disk``: (free bytes, checkpoints on disk), as
    :func:`layouts.verdict` takes it."""
    base = dataclasses.replace(setup, seq_aux=True, fused_optimizer=False)
    rows = []
    for zero in (0, 1, 2, 3):
        offloads = [(False, False)]
        if zero >= 1:
            offloads.append((True, False))
        if zero == 3:
            offloads.append((True, True))
        for opt, par in offloads:
            for ckpt in (False, True):
                layout = base.layout(zero, opt, par)
                est = memory.estimate(
                    config, dataclasses.replace(layout, activation_checkpointing=ckpt)
                )
                fits = None
                if gpu_mem_bytes is not None:
                    fits = layouts.verdict(est, gpu_mem_bytes, host_mem_bytes, disk)[0]
                rows.append(_plan_row(est, zero, opt, par, ckpt, fits))
    return rows


def _plan_row(est: dict, zero: int, opt: bool, par: bool, ckpt: bool, fits: bool | None) -> dict:
    g, gb = est["gpu"], memory.round_gb
    other = g["total"] - g["weights"] - g["gradients"] - g["optimizer"] - g["activations"]
    return {
        "zero_stage": zero,
        "offload": "opt+param" if par else ("optimizer" if opt else "none"),
        "activation_checkpointing": ckpt,
        "weights_gb": gb(g["weights"]),
        "gradients_gb": gb(g["gradients"]),
        "optimizer_gb": gb(g["optimizer"]),
        "activations_gb": gb(g["activations"]),
        "other_gb": gb(other),
        "gpu_gb": gb(g["total"]),
        "host_gb": gb(est["host"]["node_total"]),
        "fits": fits,
    }


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
    setup: memory.Setup,
    *,
    gpu_mem_bytes: int | None = None,
    host_mem_bytes: int | None = None,
) -> str:
    """:func:`plan_rows` as an aligned plain-text table (GB = 1e9 bytes; "other" = buckets,
    ZeRO-3's gathered module, the step's gradient copies beyond the activations, overhead)."""
    rows = plan_rows(config, setup, gpu_mem_bytes=gpu_mem_bytes, host_mem_bytes=host_mem_bytes)
    return format_plan_rows(rows)


def strategies_table(rows: list[dict]) -> str:
    body = [
        [
            r["strategy"] + ("  <- recommended" if r["recommended"] else ""),
            f"{r['gpu_gb']:.1f}",
            f"{r['host_gb']:.1f}",
            f"{r['disk_gb']:.1f}" if "disk_gb" in r else "?",
            _yes(r["fits"]),
        ]
        for r in rows
    ]
    return format_table(["strategy", "per-GPU GB", "host GB", "disk GB", "fits"], body)


def _source(n: int | None, source: str, flag: str) -> str:
    if n is None:
        return f"unknown (pass {flag} GB)"
    if source == "this machine":
        return f"{memory.fmt_gb(n)} (this machine's; {flag} GB to plan another)"
    return f"{memory.fmt_gb(n)} ({source})"


def _gpu_line(req: dict) -> str:
    if req.get("device") == "cpu":
        return f"CPU ranks: {req['world']}, sharing the host's RAM (no GPU memory to fit)"
    return "GPU memory: " + _source(req["gpu_mem_bytes"], req["gpu_mem_source"], "--gpu-mem")


def _run_line(req: dict) -> str:
    ranks = (
        f"{req['world']} CPU rank(s)" if req.get("device") == "cpu" else f"{req['world']} GPU(s)"
    )
    to = " to NVMe" if req.get("offload_device") == "nvme" else ""
    return (
        f"run: {ranks}, ZeRO-{req['zero_stage']}, {req['precision']}, "
        f"seq {req['seq_len']} x micro {req['micro_batch']} x accum {req['grad_accum']}"
        + (", dsflow's fused optimizer" if req.get("fused_optimizer") else "")
        + (f", optimizer offload{to}" if req["offload_optimizer"] else "")
        + (f", param offload{to}" if req["offload_params"] else "")
        + (", activation checkpointing" if req["activation_checkpointing"] else "")
    )


def _memory_line(rep: dict) -> str:
    req, est = rep["request"], rep["estimate"]
    g = est["gpu"]
    keys = ("weights", "gradients", "optimizer", "gradients_fp32_step", "activations")
    keys += ("buckets", "grad_transient", "zero3_gathered")
    if req.get("device") == "cpu":
        parts = ", ".join(f"{k} {memory.fmt_gb(g[k])}" for k in keys if g[k])
        return f"per rank: {parts} -> {memory.fmt_gb(g['allocated'])} allocated"
    shown = (*keys, "overhead", "step_not_reused")
    parts = ", ".join(f"{k} {memory.fmt_gb(g[k])}" for k in shown if g.get(k))
    return f"per GPU: {parts} -> peak {memory.fmt_gb(g['total'])} ({est['peak_phase']})"


def _host_line(rep: dict) -> str:
    req, est = rep["request"], rep["estimate"]
    have = _source(req["host_mem_bytes"], req["host_mem_source"], "--host-mem")
    if req.get("device") == "cpu":
        need = layouts.cpu_host_need(est)
        return f"host RAM: {memory.fmt_gb(need)} for {req['world']} CPU rank(s); have {have}"
    line = f"host RAM: {memory.fmt_gb(est['host']['node_total'])} for {req['world']} rank(s)"
    return line + f"; have {have}"


def _disk_line(rep: dict) -> str:
    req, summ, est = rep["request"], rep["summary"], rep["estimate"]
    n, keep = summ.get("checkpoints", summ["keep_checkpoints"] + 1), summ["keep_checkpoints"]
    why = f"keep {keep} + 1 while saving" if n == keep + 1 else "all the run saves"
    swap = est.get("nvme", {}).get("node_total")
    have = _source(req.get("disk_free_bytes"), req.get("disk_source", ""), "--disk")
    return (
        f"disk: {memory.fmt_gb(summ['checkpoint_bytes'])} per checkpoint x {n} ({why}) "
        f"+ export {memory.fmt_gb(summ['export_bytes'])}"
        + (f" + NVMe swap files {memory.fmt_gb(swap)}" if swap else "")
        + f" = {memory.fmt_gb(summ['disk_bytes'] + (swap or 0))}; free {have}"
    )


def format_report(rep: dict) -> str:
    """The plan (what reports/plan.json holds) as the text `python -m dsflow plan` prints."""
    req, summ = rep["request"], rep["summary"]
    mtp = f", MTP depth {req['mtp_depth']}" if req.get("mtp_depth") else ""
    lines = [
        f"model {req['preset']} (vocab {req['vocab_size']}, {req['vocab_source']}{mtp}): "
        f"{summ['params_total'] / 1e9:.3f}B params, {summ['params_activated'] / 1e9:.3f}B "
        f"activated, {summ['flops_per_token'] / 1e9:.2f} GFLOP/token",
        _run_line(req),
        _gpu_line(req),
        _memory_line(rep),
        _host_line(rep),
        _disk_line(rep),
        f"verdict: {rep['verdict']['reason']}",
    ]
    if layouts.model_fits(rep) is False:
        lines.append(
            f"nothing fits {req['preset']} here; smallest machine that would: "
            + layouts.describe_machine(rep.get("smallest_machine"))
        )
    if req.get("nvme_path"):
        lines.append(f"note: NVMe offload directory {req['nvme_path']}: in the ladder")
    for note in rep["notes"]:
        lines.append(f"note: {note}")
    if rep["strategies"]:
        lines += ["", strategies_table(rep["strategies"])]
    if req.get("device") != "cpu":
        lines += ["", format_plan_rows(rep["table"])]
    return "\n".join(lines)
