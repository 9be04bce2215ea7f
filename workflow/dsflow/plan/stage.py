"""Stage `plan`: will this model fit, per GPU, before hours are spent finding out?

It resolves the request (:mod:`dsflow.plan.request`: params, the ad-hoc flags below, this
machine's GPUs), estimates its memory (:mod:`dsflow.plan.memory`), judges the layouts
(:mod:`dsflow.plan.layouts`), prints the tables (:mod:`dsflow.plan.tables`) and writes
reports/plan.json, which the train stage reads when it launches the same request.

Only the stage writes reports/plan.json: `python -m dsflow plan` as dvc.yaml and the Snakefile
run it, with no flag. An ad-hoc question (any of the flags below: --model, --gpus, --gpu-mem,
--host-mem, ...) prints its answer and leaves reports/plan.json alone, since that file is a DVC
output the train stage plans its launch from; ``--out PATH`` writes the answer's JSON to PATH.

Sizes print in GB = 10^9 bytes. ``--gpu-mem 24`` means 24e9 bytes: a "24 GB" RTX 4090 reports
24564 MiB (25.76e9 bytes), so the flag is slightly conservative. Host RAM and free disk are this
machine's unless ``--host-mem`` / ``--disk`` say otherwise. The command exits 1 (after writing
its plan) when no layout of the model fits, unless train.force is set.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path
from typing import Any

from dsflow.atomic import atomic_file
from dsflow.errors import UsageError
from dsflow.model import presets
from dsflow.paths import PLAN
from dsflow.plan import batch, comm, layouts, memory, request, tables
from dsflow.progress import log


def add_arguments(parser: Any) -> None:
    """Optional flags of `python -m dsflow plan` that override params for an ad-hoc query."""
    parser.add_argument(
        "--model", choices=list(presets.PRESETS), metavar="PRESET", help="model preset"
    )
    parser.add_argument("--gpus", type=int, metavar="N", help="GPUs (data-parallel ranks)")
    parser.add_argument("--gpu-mem", type=float, metavar="GB", help="memory per GPU, GB (1e9)")
    parser.add_argument(
        "--host-mem", type=float, metavar="GB", help="host RAM, GB (1e9); default: this machine's"
    )
    parser.add_argument(
        "--disk",
        type=float,
        metavar="GB",
        help="free disk for checkpoints, the export and NVMe swap, GB (1e9); default: this "
        "machine's",
    )
    parser.add_argument(
        "--nvme", metavar="PATH", help="NVMe offload directory: adds NVMe offload to the ladder"
    )
    parser.add_argument("--vocab", type=int, metavar="N", help="vocabulary size")
    parser.add_argument("--seq-len", type=int, metavar="N")
    parser.add_argument("--micro-batch", type=int, metavar="N")
    parser.add_argument("--zero", type=int, choices=[0, 1, 2, 3])
    parser.add_argument("--precision", choices=["bf16", "fp16", "fp32"])
    parser.add_argument("--offload-optimizer", action="store_true", default=None)
    parser.add_argument("--offload-params", action="store_true", default=None)
    parser.add_argument("--activation-checkpointing", action="store_true", default=None)
    parser.add_argument(
        "--finetune", choices=["full", "lora"], help="full or LoRA (train.lora's adapters)"
    )
    parser.add_argument(
        "--out",
        metavar="PATH",
        help=f"write the plan's JSON here (default: {PLAN} for the stage, nothing for an "
        "ad-hoc question)",
    )


def ad_hoc(args: Any) -> list[str]:
    """The flags of `args` that ask about another run than params.yaml's (empty: the stage).
    Only this module's flags count: the command line's namespace holds --params and the rest."""
    parser = argparse.ArgumentParser(add_help=False)
    add_arguments(parser)
    questions = set(vars(parser.parse_args([]))) - {"out"}
    given = vars(args) if args is not None else {}
    return sorted(f"--{k.replace('_', '-')}" for k in questions if given.get(k) is not None)


def destination(args: Any) -> Path | None:
    """Where the plan's JSON goes: --out, else reports/plan.json for the stage, else nowhere.
    An ad-hoc plan never replaces the stage's output (DVC tracks it, the train stage reads it)."""
    out = getattr(args, "out", None)
    flags = ad_hoc(args)
    if out is None:
        return None if flags else PLAN
    out = Path(out)
    if flags and out.resolve() == PLAN.resolve():
        raise UsageError(
            f"--out {out}: that is the plan stage's output, which DVC tracks and the train stage "
            f"plans its launch from, and {', '.join(flags)} plan another run; write the answer "
            f"elsewhere, or run `python -m dsflow plan` without flags to plan params.yaml's run"
        )
    return out


def build_plan(
    params: dict,
    args: Any = None,
    *,
    req: request.Request | None = None,
    **resolve_kwargs: Any,
) -> dict[str, Any]:
    """The whole plan as a JSON-able dict (what reports/plan.json holds): the memory plan of
    the request (:func:`layouts.assess`) with the layout table, notes and overhead constants."""
    req = req or request.resolve(params, args, **resolve_kwargs)
    plan = layouts.assess(req)
    notes = list(req.notes)
    rec = plan["recommendation"]
    if rec and (rec["activation_checkpointing"] or rec["offload_optimizer"]):
        notes.append(
            "in params.yaml: train.perf.activation_checkpointing: true; "
            "train.offload.optimizer / train.offload.param: cpu (params need ZeRO-3)"
        )
    extra = (comm.note(req), _micro_note(req, plan), _async_note(params, req, plan))
    notes += [line for line in extra if line]
    table = tables.plan_rows(
        req.config,
        req,
        gpu_mem_bytes=req.gpu_mem_bytes,
        host_mem_bytes=req.host_mem_bytes,
        disk=(req.disk_free_bytes, req.checkpoints),
    )
    return {
        **plan,
        "table": table,
        "notes": notes,
        "overhead": dataclasses.asdict(memory.FRAMEWORK_OVERHEAD),
    }


def _async_note(params: dict, req: request.Request, plan: dict) -> str | None:
    """train.async_checkpoints: what a save holds in each node's host memory while written."""
    if not params["train"]["async_checkpoints"]:
        return None
    per_node = memory.checkpoint_bytes_of(plan["estimate"]) * req.ranks_per_node / req.world
    return (
        f"train.async_checkpoints: each save holds {per_node / 1e9:.1f} GB of pinned host memory "
        "per node (its ranks' share of the checkpoint) until it is written"
    )


def _micro_note(req: request.Request, plan: dict) -> str | None:
    """Where the request fits as asked: a larger micro batch that still fits, at the same global
    batch (dsflow.plan.batch)."""
    if req.device != "cuda" or not plan["verdict"]["fits"]:
        return None

    def fits(est: dict) -> bool:
        disk = (req.disk_free_bytes, req.checkpoints)
        return layouts.verdict(est, req.gpu_mem_bytes, req.host_mem_bytes, disk)[0]

    return batch.note(req.config, req, fits)


class NothingFits(UsageError):
    """No layout of the model fits the machine: exit status 1 (2 is a usage mistake)."""

    exit_code = 1


def run(params: dict, args: Any = None) -> None:
    """Print the plan and write it where `destination` says (sorted keys: same inputs, same
    bytes); raise NothingFits when no layout of the model fits, unless train.force is set."""
    out = destination(args)
    plan = build_plan(params, args)
    print(tables.format_report(plan))
    if out is not None:
        with atomic_file(out) as f:
            json.dump(plan, f, indent=2, sort_keys=True)
            f.write("\n")
    else:
        log.info(
            "a plan for %s: %s is the stage's and stays as it is (--out PATH writes this one)",
            " ".join(ad_hoc(args)),
            PLAN,
        )
    if layouts.model_fits(plan) is False and not params["train"].get("force"):
        req = plan["request"]
        where = (
            f"{req['world']} CPU rank(s)"
            if req["device"] == "cpu"
            else f"{req['world']} x {memory.fmt_gb(req['gpu_mem_bytes'])} GPU(s)"
        )
        host = req["host_mem_bytes"]
        host = memory.fmt_gb(host) if host is not None else "unknown"
        raise NothingFits(
            f"nothing fits {req['preset']} on {where} with {host} of host RAM; smallest "
            f"machine that would: {layouts.describe_machine(plan['smallest_machine'])} "
            "(train.force: true plans anyway)"
        )
