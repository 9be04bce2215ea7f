"""Stage `doctor`: check the machine against the run before launching it.

It prints the checks of :mod:`dsflow.checks` on this machine's facts (:mod:`dsflow.machine`:
GPUs, their peer-to-peer access, NCCL, CUDA, InfiniBand, disk, host RAM, cores, the NCCL env
vars) and the NCCL settings the train stage exports, and exits non-zero (UsageError) when any
check is a blocker.
"""

from __future__ import annotations

from typing import Any

from dsflow import checks, machine
from dsflow.errors import UsageError


def run(params: dict, args: Any = None) -> None:
    """Print the checks; raise UsageError (non-zero exit) when any is a blocker."""
    facts = machine.facts(".")
    found = checks.diagnose(facts, params)
    print(checks.format_checks(found))
    env = machine.nccl_env(facts)
    if env:
        print("NCCL env for train: " + " ".join(f"{k}={v}" for k, v in sorted(env.items())))
    fails = checks.blockers(found)
    if fails:
        first = fails[0]
        raise UsageError(
            f"{len(fails)} blocker(s); first: {first.name}: {first.fix or first.detail}"
        )
