"""Loading what came from outside the process: nothing runs, and damage is caught by its hash.

A checkpoint folder may come from a DVC remote, a shared filesystem or a copied run directory,
so its files are data to check, never code to run. `torch_load` unpickles with
`weights_only=True`: tensors, plain containers and numbers, and the few other types dsflow's
checkpoints hold (`allowed_globals`, found with `torch.serialization.
get_unsafe_globals_in_checkpoint` on real checkpoints of every ZeRO stage, bf16 and LoRA). A
pickle that would call anything else is refused in one line naming the file (`CheckpointError`).
DeepSpeed and its converters call `torch.load(..., weights_only=False)` themselves:
`weights_only()` makes every `torch.load` of the process safe while it is active.

Content hashes (xxh3-128, fast enough to hash a checkpoint as it is written): `HashingWriter`
hashes bytes on their way to a file; `file_hash` hashes a file. An HF model folder such as
models/final carries `RECORD` (dsflow_hashes.json: every file's size and hash), written by `record_folder` before
the folder is renamed into place and checked by `check_folder` before it is loaded.
"""

from __future__ import annotations

import contextlib
import json
import pickle
import re
from pathlib import Path
from typing import Any, BinaryIO

import xxhash

from dsflow.errors import UsageError

HASH = "xxh3_128"
RECORD = "dsflow_hashes.json"  # an HF model folder's file sizes and content hashes
CHUNK = 1 << 22
EXIT_REFUSED = 65  # `python -m dsflow.safeload`: a file was refused or damaged (EX_DATAERR)
_GLOBAL = re.compile(r"GLOBAL ([\w.]+)")
_OBJECT = re.compile(r"Can only build .* but got (<class [^>]*>)")

# The file each `torch_load` read last: what a load that fails after reading names.
last_file: str | None = None
_original_load: Any = None  # torch.load while `weights_only` replaces it


class CheckpointError(UsageError):
    """A file that cannot be loaded: refused (pickled code) or unreadable (damaged)."""

    def __init__(self, path: Any, reason: str, refused: bool = False):
        super().__init__(f"{path}: {reason}")
        self.path, self.reason, self.refused = str(path), reason, refused

    def __reduce__(self):  # rebuilt in a parent process (DeepSpeed's converters use pools)
        return type(self), (self.path, self.reason, self.refused)


def new_hash() -> Any:
    return xxhash.xxh3_128()


def file_hash(path: str | Path) -> str:
    h = new_hash()
    with open(path, "rb") as f:
        while block := f.read(CHUNK):
            h.update(block)
    return h.hexdigest()


class HashingWriter:
    """A binary file that hashes what is written to it (torch.save writes through it)."""

    def __init__(self, raw: BinaryIO):
        self.raw, self.hash, self.size = raw, new_hash(), 0

    def write(self, data) -> int:
        self.hash.update(data)
        n = self.raw.write(data)
        self.size += n
        return n

    def flush(self) -> None:
        self.raw.flush()

    def hexdigest(self) -> str:
        return self.hash.hexdigest()


def allowed_globals() -> list:
    """The types besides tensors and plain data that dsflow's checkpoints hold: numpy arrays
    (the RNG state in the client state), DeepSpeed's loss scaler, ZeRO stage enum and fragment
    addresses (in its optimizer states). None of them runs code when rebuilt."""
    import numpy as np
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    core = getattr(np, "_core", None) or np.core  # numpy 2 / numpy 1
    return [
        core.multiarray._reconstruct,
        np.ndarray,
        np.dtype,
        type(np.dtype(np.uint32)),  # numpy's RNG state is a uint32 array
        LossScaler,
        DynamicLossScaler,  # fp16 (GPUs)
        ZeroStageEnum,
        fragment_address,
    ]


def _name(f: Any) -> str:
    return str(f) if isinstance(f, (str, Path)) else str(getattr(f, "name", f))


def _reason(exc: BaseException) -> tuple[str, bool]:
    """(one line saying why a load failed, whether the file was refused as pickled code)."""
    text = " ".join(str(exc).split())
    # torch's weights-only message: its own advice around the unpickler's reason
    text = text.split("from a trusted source.")[-1].split("Check the documentation")[0].strip()
    text = text.split("WeightsUnpickler error:")[-1].strip()
    found = _GLOBAL.search(text)
    if found:
        what = f"pickled code ({found.group(1)})"
    elif found := _OBJECT.search(text):
        what = f"a pickled object ({found.group(1)})"
    else:
        return f"unreadable, damaged ({type(exc).__name__}: {text[:200]})", False
    return f"refused: it holds {what}, which dsflow never loads (only tensors and plain data)", True


def _load(torch_load: Any, f: Any, args: tuple, kwargs: dict) -> Any:
    import torch

    global last_file
    last_file = _name(f)
    kwargs["weights_only"] = True
    try:
        with torch.serialization.safe_globals(allowed_globals()):
            return torch_load(f, *args, **kwargs)
    except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError, KeyError) as exc:
        if isinstance(exc, torch.OutOfMemoryError):
            raise
        reason, refused = _reason(exc)
        raise CheckpointError(last_file, reason, refused) from None


def torch_load(f: Any, map_location: Any = "cpu", **kwargs: Any) -> Any:
    """`torch.load(f, weights_only=True)` with dsflow's allow-list; a refused or damaged file
    is a one-line CheckpointError naming it."""
    import torch

    return _load(_original_load or torch.load, f, (), {"map_location": map_location, **kwargs})


@contextlib.contextmanager
def weights_only():
    """Every `torch.load` in this process is `torch_load` while active, whatever its caller
    asks for (DeepSpeed passes weights_only=False)."""
    import torch

    global _original_load
    if _original_load is not None:  # already active
        yield
        return
    _original_load = torch.load

    def safe(f, *args, **kwargs):
        return _load(_original_load, f, args, kwargs)

    torch.load = safe
    try:
        yield
    finally:
        torch.load, _original_load = _original_load, None


def record_folder(folder: str | Path) -> None:
    """Write `folder`/RECORD: every file's size and content hash (sub-folders included)."""
    root = Path(folder)
    files = {}
    for path in sorted(root.rglob("*")):
        name = path.relative_to(root).as_posix()
        if path.is_file() and name != RECORD:
            files[name] = [path.stat().st_size, file_hash(path)]
    (root / RECORD).write_text(json.dumps({"hash": HASH, "files": files}, indent=1) + "\n")


def check_folder(folder: str | Path) -> str | None:
    """None when every file `folder`/RECORD lists is there with its size and content hash
    (or the folder has no record: written before dsflow kept one), else what is wrong, naming
    the file."""
    root = Path(folder)
    try:
        record = json.loads((root / RECORD).read_text())
        files, algorithm = dict(record["files"]), record["hash"]
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError):
        return f"{root / RECORD} is unreadable"
    if algorithm != HASH:
        return f"{root / RECORD}: unknown hash {algorithm!r}"
    for name, (size, digest) in sorted(files.items()):
        path = root / name
        try:
            actual = path.stat().st_size
        except OSError:
            return f"{path} is missing"
        if actual != size:
            return f"{path} is {actual} bytes, {RECORD} says {size} (truncated or replaced)"
        if file_hash(path) != digest:
            return f"{path} is corrupted (its content hash differs from {RECORD})"
    return None


def check_model_folder(folder: str | Path, fix: str) -> None:
    """`check_folder` as a one-line UsageError ending in `fix`."""
    problem = check_folder(folder)
    if problem:
        raise UsageError(f"{problem}; {fix}")


def main(argv: list[str]) -> int:
    """`python -m dsflow.safeload MODULE ARGS...`: run MODULE as `python -m` would, with every
    torch.load safe (DeepSpeed's checkpoint converters load with weights_only=False)."""
    import runpy
    import sys

    sys.argv = list(argv)
    try:
        with weights_only():
            runpy.run_module(argv[0], run_name="__main__", alter_sys=True)
    except CheckpointError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_REFUSED
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main(sys.argv[1:]))
