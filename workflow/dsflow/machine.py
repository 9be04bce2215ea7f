"""What this machine has: its GPUs, host memory, disk, cores and NCCL facts, each asked once.

The GPUs are asked once per process (:func:`gpus`, :func:`cuda`), and so are the host's memory and
``nvidia-smi``; the planner, the doctor, the train stage and the Snakemake GPU resource all take
them from here. A test fakes a machine by monkeypatching :func:`gpus` (or :func:`facts`), or by
faking torch.cuda and calling :func:`forget`.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

from dsflow.errors import UsageError

NCCL_VARS = ("NCCL_P2P_DISABLE", "NCCL_IB_DISABLE")


@functools.cache
def cuda() -> dict[str, Any]:
    """The visible CUDA GPUs as torch sees them (CUDA_VISIBLE_DEVICES applies), their
    peer-to-peer access, and the torch / CUDA / NCCL versions; no GPUs without CUDA."""
    # torch is heavy to import: Snakemake imports this module to count GPUs (nvidia_smi).
    import torch

    gpus: list[dict[str, Any]] = []
    p2p: list[dict[str, Any]] = []
    available = False
    try:
        available = torch.cuda.is_available()
        if available:
            for i in range(torch.cuda.device_count()):
                props = torch.cuda.get_device_properties(i)
                gpus.append(
                    {
                        "index": i,
                        "name": props.name,
                        "total_memory": int(props.total_memory),
                        "capability": [props.major, props.minor],
                    }
                )
            for i in range(len(gpus)):
                for j in range(i + 1, len(gpus)):
                    ok = bool(
                        torch.cuda.can_device_access_peer(i, j)
                        and torch.cuda.can_device_access_peer(j, i)
                    )
                    p2p.append({"a": i, "b": j, "p2p": ok})
    except Exception:  # noqa: BLE001 - a broken driver: report no usable GPU
        available, gpus, p2p = False, [], []
    try:
        nccl = torch.cuda.nccl.version()
        nccl = ".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl)
    except Exception:  # noqa: BLE001 - CPU builds have no NCCL
        nccl = None
    return {
        "cuda_available": available,
        "gpus": gpus,
        "p2p": p2p,
        "torch_version": torch.__version__,
        "cuda_version": torch.version.cuda,
        "nccl_version": nccl,
    }


def gpus() -> list[dict[str, Any]]:
    """[{index, name, total_memory, capability}] of the visible CUDA GPUs ([] without CUDA)."""
    return cuda()["gpus"]


@functools.cache
def nvidia_smi() -> dict[str, Any]:
    """nvidia-smi's path, the driver version and how many GPUs it lists (all of the machine's:
    nvidia-smi ignores CUDA_VISIBLE_DEVICES); None each without nvidia-smi."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return {"nvidia_smi": None, "driver_version": None, "listed": None}
    try:
        out = subprocess.run(
            [exe, "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
            check=False,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return {"nvidia_smi": exe, "driver_version": None, "listed": None}
    lines = [line.strip() for line in out.splitlines() if line.strip()]
    return {"nvidia_smi": exe, "driver_version": lines[0] if lines else None, "listed": len(lines)}


def scheduler_gpus(env: dict[str, str] | None = None) -> int:
    """How many GPUs a job started here may use, without importing torch (Snakemake asks this
    when it reads the workflow): nvidia-smi's count, narrowed by CUDA_VISIBLE_DEVICES."""
    listed = nvidia_smi()["listed"] or 0
    visible = (os.environ if env is None else env).get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return listed
    return min(listed, len([d for d in visible.split(",") if d.strip()]))


@functools.cache
def host_memory_bytes() -> int | None:
    """Physical RAM of this machine, capped by a cgroup (container) memory limit."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        total = None
    for limit_file in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            text = Path(limit_file).read_text().strip()
        except OSError:
            continue
        if text.isdigit() and (total is None or int(text) < total):
            total = int(text)
    return total


def disk_free_bytes(path: str | os.PathLike = ".") -> int | None:
    """Free space of the disk holding ``path`` (its nearest existing parent: an NVMe directory
    may not exist yet); None when it cannot be read."""
    where = Path(path).resolve()
    while not where.exists() and where != where.parent:
        where = where.parent
    try:
        return shutil.disk_usage(where).free
    except OSError:
        return None


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


def _infiniband() -> list[str]:
    ib_dir = Path("/sys/class/infiniband")
    try:
        return sorted(p.name for p in ib_dir.iterdir()) if ib_dir.is_dir() else []
    except OSError:
        return []


def facts(project_dir: str | os.PathLike = ".") -> dict[str, Any]:
    """Everything the checks before a launch look at; works without CUDA (then ``gpus`` is
    empty). The GPUs, host RAM and nvidia-smi come from the per-process answers above; disk
    space, cores and the NCCL variables are read now."""
    gpu = cuda()
    project = Path(project_dir).resolve()
    disk_free = disk_free_bytes(project)
    try:
        affinity = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        affinity = os.cpu_count()
    smi = nvidia_smi()
    return {
        **gpu,
        "gpus": gpus(),
        "gpu_count": len(gpus()),
        "nvidia_smi": smi["nvidia_smi"],
        "driver_version": smi["driver_version"],
        "infiniband": _infiniband(),
        "project_dir": str(project),
        "disk_free_bytes": disk_free,
        "host_ram_bytes": host_memory_bytes(),
        "host_ram_available_bytes": _meminfo().get("MemAvailable"),
        "cpu_count": os.cpu_count(),
        "cpu_affinity": affinity,
        "env": {k: os.environ.get(k) for k in (*NCCL_VARS, "CUDA_VISIBLE_DEVICES")},
    }


def forget() -> None:
    """Ask the machine again on the next call (tests that fake torch.cuda)."""
    for cached in (cuda, nvidia_smi, host_memory_bytes):
        cached.cache_clear()


def resolve_precision(precision: str, device: str) -> str:
    """train.precision `auto`: bf16 on GPUs; fp32 on CPU ranks, where the small matrices of a
    CPU run go faster in fp32 than in bf16, even on CPUs with bf16 instructions (the quickstart's
    `tiny` on 3 ranks: docs/performance.md, CPU benches)."""
    if precision != "auto":
        return precision
    return "bf16" if device == "cuda" else "fp32"


def resolve_device(train: dict) -> tuple[str, int]:
    """(device type, ranks per node); asking for GPUs that do not exist is an error."""
    want, ranks = train["device"], train["gpus"]
    visible = len(gpus())
    if want == "cuda" and visible == 0:
        raise UsageError(
            "train.device: cuda, but no CUDA GPU is visible (check nvidia-smi and "
            "CUDA_VISIBLE_DEVICES, or set train.device: cpu)"
        )
    device = "cuda" if want == "cuda" or (want == "auto" and visible > 0) else "cpu"
    if ranks == "auto":
        return device, (visible if device == "cuda" else 1)
    if device == "cuda" and ranks > visible:
        raise UsageError(
            f"train.gpus: {ranks} GPUs requested but {visible} visible; set train.gpus: "
            f"{visible} (or auto), and adjust grad_accum to keep the global batch"
        )
    return device, ranks


def pairs_without_p2p(facts: dict, limit: int | None = None) -> list[tuple[int, int]]:
    """GPU pairs (among the first `limit`) that cannot reach each other peer to peer."""
    out = []
    for pair in facts.get("p2p", []):
        if limit is not None and (pair["a"] >= limit or pair["b"] >= limit):
            continue
        if not pair["p2p"]:
            out.append((pair["a"], pair["b"]))
    return out


def nccl_env(facts: dict) -> dict[str, str]:
    """NCCL env vars the train stage sets for this machine; a variable the user set (to
    anything, even empty) is never overridden."""
    if not facts.get("gpu_count"):
        return {}
    env = facts.get("env", {})
    out = {}
    if pairs_without_p2p(facts) and env.get("NCCL_P2P_DISABLE") is None:
        out["NCCL_P2P_DISABLE"] = "1"
    if not facts.get("infiniband") and env.get("NCCL_IB_DISABLE") is None:
        out["NCCL_IB_DISABLE"] = "1"
    return out
