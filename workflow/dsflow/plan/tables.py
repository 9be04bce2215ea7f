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
) -> list[dict[str, Any]]:
    """ZeRO 0-3 x {no offload, optimizer offload, optimizer+param offload (ZeRO-3)} x
    {no checkpointing, checkpointing} at ``setup``'s batch, ranks and precision. ZeRO-0 has no
    offload in DeepSpeed. The rows compare layouts under DeepSpeed's optimizer, with the
    balancer's aux-loss scores counted."""
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
                    fits = layouts.verdict(est, gpu_mem_bytes, host_mem_bytes)[0]
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
    ZeRO-3's gathered module, the fp32 step gradients beyond the activations, overhead)."""
    rows = plan_rows(config, setup, gpu_mem_bytes=gpu_mem_bytes, host_mem_bytes=host_mem_bytes)
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


def format_report(rep: dict) -> str:
    """The plan (what reports/plan.json holds) as the text `python -m dsflow plan` prints."""
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
        + (memory.fmt_gb(gpu_mem) + f" ({req['gpu_mem_source']})" if gpu_mem else "unknown"),
        "per GPU: "
        + ", ".join(
            f"{k} {memory.fmt_gb(g[k])}"
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
        + f" -> peak {memory.fmt_gb(g['total'])} ({est['peak_phase']})",
        f"host RAM: {memory.fmt_gb(est['host']['node_total'])} for {req['world']} rank(s)",
        f"disk: {memory.fmt_gb(summ['checkpoint_bytes'])} per checkpoint x "
        f"{summ['keep_checkpoints']} + 1 while saving + export "
        f"{memory.fmt_gb(summ['export_bytes'])} = {memory.fmt_gb(summ['disk_bytes'])}",
        f"verdict: {rep['verdict']['reason']}",
    ]
    for note in rep["notes"]:
        lines.append(f"note: {note}")
    if rep["strategies"]:
        lines += ["", strategies_table(rep["strategies"])]
    lines += ["", format_plan_rows(rep["table"])]
    return "\n".join(lines)
