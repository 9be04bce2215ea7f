"""DeepSpeed's CPU communication op (shm comm), built before the ranks start on CPU.

DeepSpeed compiles it the first time ranks start on CPU (deepspeed.comm.torch.build_shm_op, at
init_distributed with DS_ACCELERATOR=cpu) into torch's extensions cache, and every rank waits on
the compiler without a word. The train stage builds it first, between two lines that say so, and
the ranks then load it from the cache.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path

from dsflow.errors import UsageError
from dsflow.progress import log

NAME = "deepspeed_shm_comm"  # deepspeed.ops.op_builder.cpu.ShareMemCommBuilder.NAME
# What a rank does at init_distributed on CPU, so the cache holds exactly the op the ranks load.
BUILD = [sys.executable, "-c", "from deepspeed.comm.torch import build_shm_op; build_shm_op()"]


def extensions_root(env: Mapping[str, str]) -> Path:
    """torch's JIT extensions cache, as torch.utils.cpp_extension finds it for a build:
    $TORCH_EXTENSIONS_DIR, else ~/.cache/torch_extensions/py<version>_<cpu|cuXY|rocmXY>."""
    if env.get("TORCH_EXTENSIONS_DIR"):
        return Path(env["TORCH_EXTENSIONS_DIR"])
    import torch
    from torch.utils.cpp_extension import get_default_build_root

    if torch.version.hip is not None:
        accelerator = "rocm" + torch.version.hip.replace(".", "")
    elif torch.version.cuda is not None:
        accelerator = "cu" + torch.version.cuda.replace(".", "")
    else:
        accelerator = "cpu"
    python = f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}"
    return Path(get_default_build_root()) / f"{python}_{accelerator}"


def built_path(env: Mapping[str, str]) -> Path:
    """Where torch's JIT build leaves the compiled op."""
    return extensions_root(env) / NAME / f"{NAME}.so"


def prebuilt() -> bool:
    """Whether DeepSpeed was installed with the op compiled in (DS_BUILD_SHM_COMM=1)."""
    return any(any((Path(r) / "ops" / "comm").glob(f"{NAME}_op*.so")) for r in _roots("deepspeed"))


def needs_build(env: Mapping[str, str]) -> bool:
    """Whether starting ranks on CPU would compile the op first: it is in no cache yet, or the
    cached one was built in another environment."""
    return not prebuilt() and (not built_path(env).exists() or built_elsewhere(env))


def built_elsewhere(env: Mapping[str, str]) -> bool:
    """Whether the cached op was built from another DeepSpeed's sources or against another
    torch (another venv of the same Python shares torch's cache): torch's JIT loader then
    compiles it again in the ranks, its build.ninja naming other paths."""
    try:
        ninja = (built_path(env).parent / "build.ninja").read_text()
    except OSError:
        return False
    return not all(any(root in ninja for root in _roots(pkg)) for pkg in ("deepspeed", "torch"))


def _roots(package: str) -> list[str]:
    """The folders `package` imports from, each ending in a slash (as build.ninja names files)."""
    spec = importlib.util.find_spec(package)
    return [str(Path(r)) + "/" for r in (spec.submodule_search_locations or [])] if spec else []


def build(env: Mapping[str, str], output: int | None = None) -> None:
    """Build the op when the ranks would, saying so before and after; nothing when it is built.
    `env`: the ranks' environment; `output`: where the compiler's output goes."""
    if not needs_build(env):
        return
    if built_path(env).exists():
        log.info("building DeepSpeed's CPU op again: its cache holds another environment's build")
    else:
        log.info("building DeepSpeed's CPU op: first run only, about 2 minutes")
    start = time.perf_counter()
    code = subprocess.call(BUILD, env=dict(env), stdout=output, stderr=output)
    if code != 0:
        raise UsageError(
            f"DeepSpeed's CPU op {NAME} did not build (exit {code}, its output is above); it "
            "needs a C++ compiler and ninja (pip install ninja)"
        )
    if built_path(env).exists():
        log.info(
            "built DeepSpeed's CPU op in %.0f s (cached in %s)",
            time.perf_counter() - start,
            built_path(env).parent,
        )
    else:  # DeepSpeed found the op incompatible with this machine: the ranks run without it
        log.info("DeepSpeed's CPU op does not apply to this machine; the ranks run without it")
