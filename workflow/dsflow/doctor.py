"""Stage `doctor`: check the machine against the run before launching it.

:func:`gather_facts` reads what the machine has (GPUs, their peer-to-peer access, NCCL, CUDA,
InfiniBand, disk, host RAM, cores, the NCCL env vars); :func:`diagnose` holds the decision logic
(pure: facts and params in, checks out, so it is tested with faked facts); :func:`nccl_env` is
what the train stage should export. ``python -m dsflow doctor`` prints the checks and exits
non-zero (UsageError) when any is a blocker.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dsflow.errors import UsageError

OK, WARN, FAIL = "ok", "warn", "fail"
NCCL_VARS = ("NCCL_P2P_DISABLE", "NCCL_IB_DISABLE")
GB = 10**9


@dataclass(frozen=True)
class Check:
    name: str
    status: str  # ok | warn | fail
    detail: str
    fix: str = ""


# --------------------------------------------------------------------------- facts


def _nvidia_smi() -> dict[str, Any]:
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return {"nvidia_smi": None, "driver_version": None}
    try:
        out = subprocess.run(
            [exe, "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
            check=False,
        ).stdout
        lines = [line.strip() for line in out.splitlines() if line.strip()]
        return {"nvidia_smi": exe, "driver_version": lines[0] if lines else None}
    except (OSError, subprocess.SubprocessError):
        return {"nvidia_smi": exe, "driver_version": None}


def _meminfo() -> dict[str, int]:
    out: dict[str, int] = {}
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            key, _, rest = line.partition(":")
            parts = rest.split()
            if parts and parts[0].isdigit():
                out[key] = int(parts[0]) * 1024  # kB
    except OSError:
        pass
    return out


def gather_facts(project_dir: str | os.PathLike = ".") -> dict[str, Any]:
    """What this machine has; works without CUDA (then ``gpus`` is empty)."""
    import torch

    from dsflow.plan.stage import host_memory_bytes

    gpus: list[dict[str, Any]] = []
    p2p: list[dict[str, Any]] = []
    cuda = False
    try:
        cuda = torch.cuda.is_available()
        if cuda:
            for i in range(torch.cuda.device_count()):
                props = torch.cuda.get_device_properties(i)
                gpus.append(
                    {"index": i, "name": props.name, "total_memory": int(props.total_memory)}
                )
            for i in range(len(gpus)):
                for j in range(i + 1, len(gpus)):
                    ok = bool(
                        torch.cuda.can_device_access_peer(i, j)
                        and torch.cuda.can_device_access_peer(j, i)
                    )
                    p2p.append({"a": i, "b": j, "p2p": ok})
    except Exception:  # noqa: BLE001 - a broken driver: report no usable GPU
        cuda, gpus, p2p = False, [], []
    try:
        nccl = torch.cuda.nccl.version()
        nccl = ".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl)
    except Exception:  # noqa: BLE001 - CPU builds have no NCCL
        nccl = None
    ib_dir = Path("/sys/class/infiniband")
    try:
        ib = sorted(p.name for p in ib_dir.iterdir()) if ib_dir.is_dir() else []
    except OSError:
        ib = []
    project = Path(project_dir).resolve()
    try:
        disk_free = shutil.disk_usage(project).free
    except OSError:
        disk_free = None
    mem = _meminfo()
    try:
        affinity = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        affinity = os.cpu_count()
    return {
        "cuda_available": cuda,
        "gpu_count": len(gpus),
        "gpus": gpus,
        "p2p": p2p,
        "torch_version": torch.__version__,
        "cuda_version": torch.version.cuda,
        "nccl_version": nccl,
        **_nvidia_smi(),
        "infiniband": ib,
        "project_dir": str(project),
        "disk_free_bytes": disk_free,
        "host_ram_bytes": host_memory_bytes(),
        "host_ram_available_bytes": mem.get("MemAvailable"),
        "cpu_count": os.cpu_count(),
        "cpu_affinity": affinity,
        "env": {k: os.environ.get(k) for k in (*NCCL_VARS, "CUDA_VISIBLE_DEVICES")},
    }


# --------------------------------------------------------------------------- decisions


def _pairs_without_p2p(facts: dict, limit: int | None = None) -> list[tuple[int, int]]:
    out = []
    for pair in facts.get("p2p", []):
        if limit is not None and (pair["a"] >= limit or pair["b"] >= limit):
            continue
        if not pair["p2p"]:
            out.append((pair["a"], pair["b"]))
    return out


def nccl_env(facts: dict) -> dict[str, str]:
    """NCCL env vars the train stage should set for this machine; a variable the user set
    (to anything, even empty) is never overridden."""
    if not facts.get("gpu_count"):
        return {}
    env = facts.get("env", {})
    out = {}
    if _pairs_without_p2p(facts) and env.get("NCCL_P2P_DISABLE") is None:
        out["NCCL_P2P_DISABLE"] = "1"
    if not facts.get("infiniband") and env.get("NCCL_IB_DISABLE") is None:
        out["NCCL_IB_DISABLE"] = "1"
    return out


def _gb(n: float) -> str:
    return f"{n / GB:,.1f} GB"


def _device_and_world(facts: dict, train: dict) -> tuple[str, int, list[Check]]:
    visible = int(facts.get("gpu_count") or 0)
    want, gpus = train["device"], train["gpus"]
    checks = []
    if want == "cuda" and visible == 0:
        checks.append(
            Check(
                "device",
                FAIL,
                "train.device: cuda, but no CUDA GPU is visible",
                "check nvidia-smi and CUDA_VISIBLE_DEVICES, or set train.device: cpu",
            )
        )
        return "cuda", (1 if gpus == "auto" else int(gpus)), checks
    device = "cuda" if want == "cuda" or (want == "auto" and visible > 0) else "cpu"
    if device == "cpu":
        world = 1 if gpus == "auto" else int(gpus)
        status = OK if want == "cpu" else WARN
        detail = f"training on CPU with gloo ({world} rank(s), DS_ACCELERATOR=cpu)"
        fix = "" if want == "cpu" else "no GPU visible: set train.device: cpu to make it explicit"
        checks.append(Check("device", status, detail, fix))
        return device, world, checks
    world = visible if gpus == "auto" else int(gpus)
    names = sorted({g["name"] for g in facts.get("gpus", [])})
    checks.append(Check("device", OK, f"CUDA: {visible} GPU(s) visible ({', '.join(names)}), NCCL"))
    if world > visible:
        checks.append(
            Check(
                "gpu count",
                FAIL,
                f"train.gpus: {world} requested but {visible} visible",
                f"set train.gpus: {visible} (or auto) and raise grad_accum to keep the global "
                "batch, or expose more GPUs (CUDA_VISIBLE_DEVICES)",
            )
        )
    else:
        checks.append(Check("gpu count", OK, f"{world} of {visible} visible GPU(s) used"))
    return device, world, checks


def _plan_for(facts: dict, params: dict, world: int) -> dict:
    from dsflow.plan import stage as plan_mod

    gpus = [
        {"name": g["name"], "total_memory": int(g["total_memory"])} for g in facts.get("gpus", [])
    ]
    return plan_mod.report(
        params,
        None,
        world=world,
        gpus=gpus,
        host_mem_bytes=facts.get("host_ram_bytes"),
    )


def diagnose(facts: dict, params: dict, plan: dict | None = None) -> list[Check]:
    """Checks for running ``params`` on the machine ``facts`` describes. ``plan`` is a
    :func:`dsflow.plan.report` dict; computed from ``params`` and ``facts`` when None."""
    device, world, checks = _device_and_world(facts, params["train"])
    env = facts.get("env", {})

    if device == "cuda" and facts.get("gpu_count"):
        used = facts["gpus"][: max(1, min(world, len(facts["gpus"])))]
        names = sorted({g["name"] for g in used})
        if len(names) > 1:
            checks.append(
                Check(
                    "gpu models",
                    WARN,
                    f"mixed GPU models: {', '.join(names)}; the slowest and smallest card sets "
                    "the pace and the memory limit",
                    "use identical cards (CUDA_VISIBLE_DEVICES=...)",
                )
            )
        missing = _pairs_without_p2p(facts, limit=world)
        p2p_env = env.get("NCCL_P2P_DISABLE")
        if world > 1 and missing:
            pairs = ", ".join(f"{a}-{b}" for a, b in missing)
            if p2p_env == "1":
                checks.append(
                    Check(
                        "peer-to-peer",
                        OK,
                        f"no P2P between GPU pairs {pairs}; NCCL_P2P_DISABLE=1 is set",
                    )
                )
            else:
                state = (
                    f"NCCL_P2P_DISABLE={p2p_env} is set explicitly and left alone"
                    if p2p_env is not None
                    else "NCCL_P2P_DISABLE is not set (dsflow train sets it to 1)"
                )
                checks.append(
                    Check(
                        "peer-to-peer",
                        WARN,
                        f"no P2P between GPU pairs {pairs} (consumer cards such as the RTX 4090 "
                        f"have it disabled; NCCL may hang or corrupt without it); {state}",
                        "export NCCL_P2P_DISABLE=1",
                    )
                )
        elif world > 1:
            checks.append(Check("peer-to-peer", OK, f"P2P between all {world} GPUs"))
        if facts.get("infiniband"):
            checks.append(Check("infiniband", OK, f"devices: {', '.join(facts['infiniband'])}"))
        else:
            ib_env = env.get("NCCL_IB_DISABLE")
            state = (
                f"NCCL_IB_DISABLE={ib_env} is set"
                if ib_env is not None
                else "dsflow train sets NCCL_IB_DISABLE=1"
            )
            nodes = params["train"].get("nodes", 1)
            checks.append(
                Check(
                    "infiniband",
                    OK,
                    f"no InfiniBand (single node: NCCL does not need it); {state}",
                    "" if ib_env == "1" else "export NCCL_IB_DISABLE=1",
                )
                if nodes == 1
                else Check(
                    "infiniband",
                    WARN,
                    f"no InfiniBand on this node of {nodes}: NCCL sends every gradient between "
                    f"nodes over TCP sockets, often the bottleneck; {state}",
                    "use nodes with InfiniBand/RoCE, or raise grad_accum to sync less often",
                )
            )
        versions = (
            f"torch {facts.get('torch_version')}, CUDA {facts.get('cuda_version')}, "
            f"NCCL {facts.get('nccl_version')}, driver {facts.get('driver_version')}"
        )
        if facts.get("nccl_version") is None:
            checks.append(
                Check("versions", WARN, versions, "install a CUDA build of torch with NCCL")
            )
        else:
            checks.append(Check("versions", OK, versions))
    else:
        checks.append(Check("versions", OK, f"torch {facts.get('torch_version')} (CPU)"))

    cores = facts.get("cpu_affinity") or facts.get("cpu_count") or 1
    if device == "cpu" and world > cores:
        checks.append(
            Check(
                "cpu cores",
                WARN,
                f"{world} CPU ranks on {cores} core(s): ranks will time-share",
                f"set train.gpus: {cores} or fewer",
            )
        )
    else:
        checks.append(Check("cpu cores", OK, f"{cores} core(s)"))

    if plan is None:
        try:
            # ZeRO partitions over every rank of every node.
            plan = _plan_for(facts, params, world * params["train"].get("nodes", 1))
        except UsageError as e:
            checks.append(Check("plan", FAIL, f"cannot plan the run: {e}", "fix the params"))
            return checks

    checks.extend(_resource_checks(facts, params, plan, device, world))
    return checks


def _resource_checks(facts: dict, params: dict, plan: dict, device: str, world: int) -> list:
    checks = []
    est, summ = plan["estimate"], plan["summary"]
    verdict = plan.get("verdict", {})
    if device == "cuda" and facts.get("gpu_count"):
        if verdict.get("fits") is False:
            rec = plan.get("recommendation")
            fix = (
                f"cheapest fit: {rec['strategy']} ({rec['gpu_gb']:.1f} GB per GPU)"
                if rec
                else "nothing fits these GPUs: see python -m dsflow plan"
            )
            checks.append(Check("gpu memory", FAIL, verdict.get("reason", ""), fix))
        elif verdict.get("fits"):
            checks.append(Check("gpu memory", OK, verdict.get("reason", "")))

    free = facts.get("disk_free_bytes")
    need = summ["disk_bytes"]
    keep = summ["keep_checkpoints"]
    detail = (
        f"{_gb(need)} planned: {keep} + 1 checkpoint(s) of {_gb(summ['checkpoint_bytes'])} "
        f"(the new one is written before old ones are pruned) + export {_gb(summ['export_bytes'])}"
    )
    if free is None:
        checks.append(Check("disk", WARN, f"free space unknown; {detail}"))
    elif free < need:
        checks.append(
            Check(
                "disk",
                FAIL,
                f"{_gb(free)} free at {facts.get('project_dir')}, {detail}",
                f"free {_gb(need - free)} or lower train.keep_checkpoints",
            )
        )
    else:
        checks.append(Check("disk", OK, f"{_gb(free)} free, {detail}"))

    host = facts.get("host_ram_bytes")
    if device == "cpu":
        # CPU ranks keep everything in host RAM: model states + activations per rank (or the
        # fp32 model each rank builds first, whichever is larger).
        base = est["host"]["per_rank"] - est["host"]["init_per_rank"]
        need_ram = (max(est["gpu"]["allocated"], est["host"]["init_per_rank"]) + base) * world
        what = f"{world} CPU rank(s) x (model states + activations)"
    else:
        need_ram = est["host"]["node_total"]
        off = est["host"]["optimizer"] + est["host"]["gradients"] + est["host"]["parameters"]
        what = (
            f"{world} rank(s): offloaded states {_gb(off)} per rank"
            if off
            else f"{world} rank(s) each building the fp32 model ({_gb(est['host']['init_per_rank'])})"
        )
    if host is None:
        checks.append(Check("host ram", WARN, f"host RAM unknown; {_gb(need_ram)} needed ({what})"))
    elif host < need_ram:
        checks.append(
            Check(
                "host ram",
                FAIL,
                f"{_gb(host)} of host RAM, {_gb(need_ram)} needed ({what})",
                "use a machine with more RAM, fewer ranks, or less offload",
            )
        )
    else:
        checks.append(Check("host ram", OK, f"{_gb(host)}, {_gb(need_ram)} needed ({what})"))
    return checks


# --------------------------------------------------------------------------- the stage


def format_checks(checks: list[Check]) -> str:
    from dsflow.plan.stage import format_table

    return format_table(
        ["check", "status", "detail", "fix"], [[c.name, c.status, c.detail, c.fix] for c in checks]
    )


def run(params: dict, args: Any = None) -> None:
    """Print the checks; raise UsageError (non-zero exit) when any is a blocker."""
    facts = gather_facts(".")
    checks = diagnose(facts, params)
    print(format_checks(checks))
    env = nccl_env(facts)
    if env:
        print("NCCL env for train: " + " ".join(f"{k}={v}" for k, v in sorted(env.items())))
    fails = [c for c in checks if c.status == FAIL]
    if fails:
        first = fails[0]
        raise UsageError(
            f"{len(fails)} blocker(s); first: {first.name}: {first.fix or first.detail}"
        )
