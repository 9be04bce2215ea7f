"""`python -m dsflow <stage>`: the one command each Snakemake rule and DVC stage runs.

User mistakes (UsageError) become one line on stderr and exit code 2; bugs still raise.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import time
import traceback

import yaml

from dsflow import params as params_mod
from dsflow.errors import UsageError
from dsflow.launch import log_name
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


def _profile(args) -> None:
    """Print a profile as `-S key=value` arguments for `dvc exp run`."""
    overlay = params_mod.read_yaml(args.file)
    merged = params_mod.deep_merge(params_mod.read_yaml(args.params), overlay)
    params_mod.validate(merged, source=f"{args.params} + {args.file}")
    flat = params_mod.flatten(overlay)
    print(" ".join(f"-S '{k}={json.dumps(v)}'" for k, v in sorted(flat.items())))


def build_parser() -> argparse.ArgumentParser:
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
        stage = sub.add_parser(name, help=f"run the {name} stage")
        if name in ("plan", "export"):
            importlib.import_module(STAGES[name]).add_arguments(stage)
    sub.add_parser("validate", help="validate the params and print the effective values")
    prof = sub.add_parser("profile", help="print a profile as `dvc exp run -S` arguments")
    prof.add_argument("file", help="profile overlay, e.g. profiles/rtx4090x3.yaml")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logged = False  # whether this stage's log is set up (it is not while params fail to load)
    try:
        if args.stage == "profile":
            _profile(args)
            return 0
        params = params_mod.load(args.params, overlays=args.profile)
        if args.stage == "validate":
            print(yaml.safe_dump(params, sort_keys=False), end="")
            return 0
        if args.stage == "train":  # several nodes may share logs/: one log per node
            setup_logging(log_name(params["train"]))
        else:
            setup_logging(args.stage)
        logged = True
        start = time.perf_counter()
        module = importlib.import_module(STAGES[args.stage])
        with logged_prints():
            if args.stage in ("plan", "doctor", "export"):
                module.run(params, args)
            else:
                module.run(params)
        log.info("finished, wall_s=%.1f", time.perf_counter() - start)
    except UsageError as e:
        return _fail(
            args.stage, logged, f"dsflow {args.stage}: error: {e}", getattr(e, "exit_code", 2)
        )
    except KeyboardInterrupt:
        return _fail(args.stage, logged, f"dsflow {args.stage}: interrupted", 130)
    except Exception:  # a bug: its traceback goes to the log too, then it raises as before
        if logged:
            to_log(traceback.format_exc())
        raise
    return 0


def _fail(stage: str, logged: bool, line: str, code: int) -> int:
    """Print a failed stage's one line, and put it in the stage's log (the one Snakemake points
    the user to); the log is logs/<stage>.log when the params did not load."""
    print(line, file=sys.stderr)
    if stage in STAGES:
        if not logged:
            setup_logging(stage)
        to_log(line)
    return code


if __name__ == "__main__":
    sys.exit(main())
