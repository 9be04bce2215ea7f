"""`python -m dsflow <stage>`: the one command each Snakemake rule and DVC stage runs.

User mistakes (UsageError), a stage another one holds the paths of (dsflow.lock) and a write the
disk refused (dsflow.errors.disk_error) become one line on stderr and in the stage's log, exit
code 2; bugs still raise.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import importlib
import importlib.util
import json
import sys
import time
import traceback
from pathlib import Path

import yaml

from dsflow import lock
from dsflow import params as params_mod
from dsflow.errors import UsageError, disk_error
from dsflow.launch import log_name
from dsflow.paths import CHECKPOINTS, LOGS
from dsflow.progress import log, logged_prints, setup_logging, to_log

STAGES = {
    "pretrained": "dsflow.pretrained",
    "download": "dsflow.data.download",
    "tokenizer": "dsflow.data.tokenizer",
    "tokenize": "dsflow.data.tokenizing",
    "shard": "dsflow.data.shard",
    "plan": "dsflow.plan.stage",
    "doctor": "dsflow.doctor",
    "train": "dsflow.train.stage",
    "evaluate": "dsflow.evaluate",
    "report": "dsflow.report",
    "export": "dsflow.export",  # not a DAG stage: a checkpoint -> HF model, on demand
}


# Each command's --help: what it reads and writes (None: its module docstring's first line says
# that), then the params sections that drive it (as dvc.yaml lists them).
STAGE_HELP: dict[str, tuple[str | None, str]] = {
    "pretrained": (None, "model.pretrained, model.revision"),
    "download": (None, "seed, download"),
    "tokenizer": (
        "a byte-level BPE trained on data/raw's train split (or model.pretrained's own "
        "tokenizer) -> data/tokenizer/.",
        "seed, tokenizer, model.pretrained",
    ),
    "tokenize": (
        "data/raw + data/tokenizer -> token ids in data/tokens/{split}.parquet.",
        "tokenize",
    ),
    "shard": (
        "data/tokens -> fixed-size binary shards + index.json per split in data/shards/.",
        "shard",
    ),
    "plan": (
        "the model, batch and layout of the run (and data/shards' vocabulary, or "
        "model.pretrained's) -> whether it fits per GPU, printed, and reports/plan.json.",
        "model, train",
    ),
    "doctor": (
        "this machine (GPUs, NCCL, CUDA, disk, host RAM, cores) checked against the run; writes "
        "nothing, exits non-zero on a blocker.",
        "model, train",
    ),
    "train": (
        "data/shards, data/tokenizer and reports/plan.json -> checkpoints/, models/final, "
        "dvclive/ and metrics/train.json (logs/train.log).",
        "seed, model, train",
    ),
    "evaluate": (None, "seed, evaluate, train.seq_len / device / gpus"),
    "report": (
        "metrics/train.json, metrics/eval.json, reports/eval and reports/plan.json -> "
        "reports/report.{html,md} + reports/figures/.",
        "none (it reports the params the run used)",
    ),
    "export": (
        "a checkpoint in checkpoints/ -> an HF model, consolidated, in models/export-<tag>/.",
        "model, train (the run that wrote the checkpoint)",
    ),
    "validate": (
        "params.yaml (+ --profile overlays) validated against the schema; prints the effective "
        "values, writes nothing.",
        "all",
    ),
    "profile": ("a profile overlay printed as `dvc exp run -S key=value` arguments.", "all"),
}


# Stages whose command line takes arguments of their own, defined in their modules.
WITH_ARGUMENTS = ("plan", "export")


def _module_doc(module: str) -> str:
    """`module`'s docstring, read from its source: importing a stage module (torch, for some)
    for its --help text would make every command start a second or more later."""
    source = Path(importlib.util.find_spec(module).origin).read_text()
    return ast.get_docstring(ast.parse(source), clean=False) or ""


def stage_help(name: str) -> str:
    """The --help text of ``python -m dsflow NAME``: reads -> writes, and the params sections."""
    what, sections = STAGE_HELP[name]
    if what is None:
        doc = _module_doc(STAGES[name]).strip()
        what = " ".join(doc.split("\n\n")[0].split()).split(": ", 1)[-1]
    return f"{what} Params: {sections}."


def _profile(args) -> None:
    """Print a profile as `-S key=value` arguments for `dvc exp run`."""
    overlay = params_mod.read_yaml(args.file)
    merged = params_mod.deep_merge(params_mod.read_yaml(args.params), overlay)
    params_mod.validate(merged, source=f"{args.params} + {args.file}")
    flat = params_mod.flatten(overlay)
    print(" ".join(f"-S '{k}={json.dumps(v)}'" for k, v in sorted(flat.items())))


def build_parser(arguments: bool = True) -> argparse.ArgumentParser:
    """The command line; `arguments`: with the arguments of the stages that take their own
    (WITH_ARGUMENTS), which imports their modules."""
    parser = argparse.ArgumentParser(prog="python -m dsflow", description=__doc__)
    parser.add_argument("--params", default="params.yaml", help="params file (default params.yaml)")
    parser.add_argument(
        "--profile",
        action="append",
        default=None,
        metavar="FILE",
        help="overlay file on top of --params (repeatable); also DSFLOW_PROFILES",
    )
    sub = parser.add_subparsers(dest="stage", required=True, metavar="STAGE")
    for name in STAGES:
        stage = sub.add_parser(name, help=f"run the {name} stage", description=stage_help(name))
        if arguments and name in WITH_ARGUMENTS:
            importlib.import_module(STAGES[name]).add_arguments(stage)
    sub.add_parser(
        "validate",
        help="validate the params and print the effective values",
        description=stage_help("validate"),
    )
    prof = sub.add_parser(
        "profile",
        help="print a profile as `dvc exp run -S` arguments",
        description=stage_help("profile"),
    )
    prof.add_argument("file", help="profile overlay, e.g. profiles/rtx4090x3.yaml")
    return parser


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line parsed; the modules of the stages with arguments of their own are
    imported only when that stage (or --help) is asked for."""
    argv = sys.argv[1:] if argv is None else argv
    if not {"-h", "--help"} & set(argv):
        parser = build_parser(arguments=False)
        known, _ = parser.parse_known_args(argv)
        if known.stage not in WITH_ARGUMENTS:
            return parser.parse_args(argv)
    return build_parser().parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    name = args.stage if args.stage in STAGES else None  # the stage's log, logs/<name>.log
    logged = False  # whether that log is set up (not while params fail to load, nor when locked)
    try:
        if args.stage == "profile":
            _profile(args)
            return 0
        params = params_mod.load(args.params, overlays=args.profile)
        if args.stage == "validate":
            print(yaml.safe_dump(params, sort_keys=False), end="")
            return 0
        if args.stage == "train":  # several nodes may share logs/: one log per node
            name = log_name(params["train"])
        start = time.perf_counter()
        with lock.hold(args.stage, params):  # before the log: a holder's log is kept as it is
            setup_logging(name)
            logged = True
            module = importlib.import_module(STAGES[args.stage])
            with logged_prints():
                if args.stage in ("plan", "doctor", "export"):
                    module.run(params, args)
                else:
                    module.run(params)
        log.info("finished, wall_s=%.1f", time.perf_counter() - start)
    except lock.Busy as e:
        line = _run_lock_refusal(args.stage, e) or str(e)
        return _fail(name, logged, f"dsflow {args.stage}: error: {line}", 2, fresh=False)
    except UsageError as e:
        return _fail(name, logged, f"dsflow {args.stage}: error: {e}", getattr(e, "exit_code", 2))
    except KeyboardInterrupt:
        return _fail(name, logged, f"dsflow {args.stage}: interrupted", 130)
    except Exception as e:  # a bug: its traceback goes to the log too, then it raises as before
        if disk_error(e):  # not a bug: a write the disk refused (nothing half-written: atomic)
            return _fail(name, logged, f"dsflow {args.stage}: error: {disk_error(e)}", 2)
        if logged:
            to_log(traceback.format_exc())
        raise
    return 0


def _run_lock_refusal(stage: str, busy: lock.Busy) -> str | None:
    """A second train run is refused with checkpoints/.lock's line, which names the holder's
    launcher too. None when the holder is not a train run that holds it yet."""
    if stage != "train" or all(h["stage"] != "train" for h in busy.holders):
        return None
    from dsflow.train.checkpoint import RunLock

    return RunLock(CHECKPOINTS).holder_line()


def _fail(name: str | None, logged: bool, line: str, code: int, fresh: bool = True) -> int:
    """Print a failed stage's one line, and put it in the stage's log (the one Snakemake points
    the user to). When the params did not load, logs/<stage>.log is set up (emptied) for it;
    when the stage is locked out the line is appended: that log is the holder's too."""
    print(line, file=sys.stderr)
    if name is None:
        return code
    with contextlib.suppress(OSError):  # a log on a full disk must not hide the line
        if not logged and fresh:
            setup_logging(name)
            logged = True
        if not logged:
            LOGS.mkdir(exist_ok=True)
        to_log(line, None if logged else LOGS / f"{name}.log")
    return code


if __name__ == "__main__":
    sys.exit(main())
