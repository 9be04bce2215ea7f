"""The checks before a launch: this machine (:mod:`dsflow.machine`) and the memory plan
(:mod:`dsflow.plan.layouts`) against the params.

:func:`diagnose` holds the decision logic (pure: facts, params and plan in, checks out, so it is
tested with faked facts). The doctor stage prints the checks; the train stage refuses to launch
on the first blocker.
"""

from __future__ import annotations

from dataclasses import dataclass

from dsflow import machine
from dsflow.errors import UsageError
from dsflow.plan import layouts, memory, request, tables

OK, WARN, FAIL = "ok", "warn", "fail"


@dataclass(frozen=True)
class Check:
    name: str
    status: str  # ok | warn | fail
    detail: str
    fix: str = ""


def plan_for(facts: dict, params: dict, world: int) -> dict:
    """The memory plan of ``params`` on ``world`` ranks of the GPUs and host ``facts`` has.
    With `train.zero_stage: auto` on GPUs it is the plan of the layout the train stage will
    launch (:func:`dsflow.plan.layouts.first_fit`), not of the first one auto tries."""
    gpus = [
        {
            "name": g["name"],
            "total_memory": int(g["total_memory"]),
            "capability": g.get("capability"),
        }
        for g in facts.get("gpus", [])
    ]
    req = request.resolve(
        params,
        None,
        world=world,
        gpus=gpus,
        host_mem_bytes=facts.get("host_ram_bytes"),
        disk_free_bytes=facts.get("disk_free_bytes"),
    )
    if params["train"]["zero_stage"] == "auto" and req.device == "cuda" and req.gpu_mem_bytes:
        try:
            setup, est, _ = layouts.first_fit(req, req.host_mem_bytes)
        except UsageError:  # no layout fits: the first one's plan says why
            return layouts.assess(req)
        return layouts.assess(setup, est)
    return layouts.assess(req)


# --------------------------------------------------------------------------- device and GPUs


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


def _gpu_models(facts: dict, world: int) -> list[Check]:
    used = facts["gpus"][: max(1, min(world, len(facts["gpus"])))]
    names = sorted({g["name"] for g in used})
    if len(names) < 2:
        return []
    return [
        Check(
            "gpu models",
            WARN,
            f"mixed GPU models: {', '.join(names)}; the slowest and smallest card sets "
            "the pace and the memory limit",
            "use identical cards (CUDA_VISIBLE_DEVICES=...)",
        )
    ]


def _peer_to_peer(facts: dict, world: int) -> list[Check]:
    missing = machine.pairs_without_p2p(facts, limit=world)
    p2p_env = facts.get("env", {}).get("NCCL_P2P_DISABLE")
    if world <= 1:
        return []
    if not missing:
        return [Check("peer-to-peer", OK, f"P2P between all {world} GPUs")]
    pairs = ", ".join(f"{a}-{b}" for a, b in missing)
    if p2p_env == "1":
        return [
            Check(
                "peer-to-peer", OK, f"no P2P between GPU pairs {pairs}; NCCL_P2P_DISABLE=1 is set"
            )
        ]
    state = (
        f"NCCL_P2P_DISABLE={p2p_env} is set explicitly and left alone"
        if p2p_env is not None
        else "NCCL_P2P_DISABLE is not set (dsflow train sets it to 1)"
    )
    return [
        Check(
            "peer-to-peer",
            WARN,
            f"no P2P between GPU pairs {pairs} (consumer cards such as the RTX 4090 "
            f"have it disabled; NCCL may hang or corrupt without it); {state}",
            "export NCCL_P2P_DISABLE=1",
        )
    ]


def _infiniband(facts: dict, nodes: int) -> Check:
    if facts.get("infiniband"):
        return Check("infiniband", OK, f"devices: {', '.join(facts['infiniband'])}")
    ib_env = facts.get("env", {}).get("NCCL_IB_DISABLE")
    state = (
        f"NCCL_IB_DISABLE={ib_env} is set"
        if ib_env is not None
        else "dsflow train sets NCCL_IB_DISABLE=1"
    )
    if nodes == 1:
        return Check(
            "infiniband",
            OK,
            f"no InfiniBand (single node: NCCL does not need it); {state}",
            "" if ib_env == "1" else "export NCCL_IB_DISABLE=1",
        )
    return Check(
        "infiniband",
        WARN,
        f"no InfiniBand on this node of {nodes}: NCCL sends every gradient between "
        f"nodes over TCP sockets, often the bottleneck; {state}",
        "use nodes with InfiniBand/RoCE, or raise grad_accum to sync less often",
    )


def _versions(facts: dict) -> Check:
    versions = (
        f"torch {facts.get('torch_version')}, CUDA {facts.get('cuda_version')}, "
        f"NCCL {facts.get('nccl_version')}, driver {facts.get('driver_version')}"
    )
    if facts.get("nccl_version") is None:
        return Check("versions", WARN, versions, "install a CUDA build of torch with NCCL")
    return Check("versions", OK, versions)


def _cpu_cores(facts: dict, device: str, world: int) -> Check:
    cores = facts.get("cpu_affinity") or facts.get("cpu_count") or 1
    if device == "cpu" and world > cores:
        return Check(
            "cpu cores",
            WARN,
            f"{world} CPU ranks on {cores} core(s): ranks will time-share",
            f"set train.gpus: {cores} or fewer",
        )
    return Check("cpu cores", OK, f"{cores} core(s)")


# --------------------------------------------------------------------------- resources


def _gpu_memory(plan: dict) -> list[Check]:
    verdict = plan.get("verdict", {})
    req = plan.get("request", {})
    if verdict.get("fits") is False and req.get("gpu_mem_bytes") is not None:
        # Short of disk only: the disk check says so, with this machine's free space now.
        fits, reason = layouts.verdict(
            plan["estimate"], req["gpu_mem_bytes"], req.get("host_mem_bytes")
        )
        if fits:
            return [Check("gpu memory", OK, reason)]
    if verdict.get("fits") is False:
        rec = plan.get("recommendation")
        fix = (
            f"cheapest fit: {rec['strategy']} ({rec['gpu_gb']:.1f} GB per GPU)"
            if rec
            else "nothing fits these GPUs: see python -m dsflow plan"
        )
        return [Check("gpu memory", FAIL, verdict.get("reason", ""), fix)]
    if verdict.get("fits"):
        return [Check("gpu memory", OK, verdict.get("reason", ""))]
    return []


def _disk(facts: dict, summ: dict) -> Check:
    free = facts.get("disk_free_bytes")
    need, n, keep = summ["disk_bytes"], summ["checkpoints"], summ["keep_checkpoints"]
    size = memory.fmt_gb(summ["checkpoint_bytes"])
    if n == keep + 1:
        ckpts = f"{keep} + 1 checkpoint(s) of {size} (the new one is written before old ones are pruned)"
    else:
        ckpts = f"{n} checkpoint(s) of {size} (all the run saves: fewer than keep_checkpoints + 1)"
    detail = (
        f"{memory.fmt_gb(need)} planned: {ckpts} + export {memory.fmt_gb(summ['export_bytes'])}"
    )
    if free is None:
        return Check("disk", WARN, f"free space unknown; {detail}")
    if free < need:
        return Check(
            "disk",
            FAIL,
            f"{memory.fmt_gb(free)} free at {facts.get('project_dir')}, {detail}",
            f"free {memory.fmt_gb(need - free)} or lower train.keep_checkpoints",
        )
    return Check("disk", OK, f"{memory.fmt_gb(free)} free, {detail}")


def _host_ram(facts: dict, est: dict, device: str, world: int) -> Check:
    """This node's RAM against what its `world` ranks need."""
    host = facts.get("host_ram_bytes")
    if device == "cpu":
        need = layouts.cpu_host_need(est)
        what = f"{world} CPU rank(s) x (model states + activations)"
    else:
        need = est["host"]["node_total"]
        off = est["host"]["optimizer"] + est["host"]["gradients"] + est["host"]["parameters"]
        init = est["host"]["init_per_rank"]
        what = (
            f"{world} rank(s): offloaded states {memory.fmt_gb(off)} per rank"
            if off
            else f"{world} rank(s) each building the fp32 model ({memory.fmt_gb(init)})"
        )
    if host is None:
        return Check("host ram", WARN, f"host RAM unknown; {memory.fmt_gb(need)} needed ({what})")
    if host < need:
        return Check(
            "host ram",
            FAIL,
            f"{memory.fmt_gb(host)} of host RAM, {memory.fmt_gb(need)} needed ({what})",
            "use a machine with more RAM, fewer ranks, or less offload",
        )
    return Check("host ram", OK, f"{memory.fmt_gb(host)}, {memory.fmt_gb(need)} needed ({what})")


def _resource_checks(facts: dict, plan: dict, device: str, world: int) -> list[Check]:
    checks = _gpu_memory(plan) if device == "cuda" and facts.get("gpu_count") else []
    checks.append(_disk(facts, plan["summary"]))
    checks.append(_host_ram(facts, plan["estimate"], device, world))
    return checks


# --------------------------------------------------------------------------- all of them


def diagnose(facts: dict, params: dict, plan: dict | None = None) -> list[Check]:
    """Checks for running ``params`` on the machine ``facts`` describes. ``plan`` is the memory
    plan (:func:`dsflow.plan.layouts.assess`); made from ``params`` and ``facts`` when None."""
    device, world, checks = _device_and_world(facts, params["train"])
    if device == "cuda" and facts.get("gpu_count"):
        checks += _gpu_models(facts, world)
        checks += _peer_to_peer(facts, world)
        checks.append(_infiniband(facts, params["train"].get("nodes", 1)))
        checks.append(_versions(facts))
    else:
        checks.append(Check("versions", OK, f"torch {facts.get('torch_version')} (CPU)"))
    checks.append(_cpu_cores(facts, device, world))
    if plan is None:
        try:
            # ZeRO partitions over every rank of every node.
            plan = plan_for(facts, params, world * params["train"].get("nodes", 1))
        except UsageError as e:
            checks.append(Check("plan", FAIL, f"cannot plan the run: {e}", "fix the params"))
            return checks
    checks.extend(_resource_checks(facts, plan, device, world))
    return checks


def blockers(checks: list[Check]) -> list[Check]:
    return [c for c in checks if c.status == FAIL]


def format_checks(checks: list[Check]) -> str:
    return tables.format_table(
        ["check", "status", "detail", "fix"], [[c.name, c.status, c.detail, c.fix] for c in checks]
    )
