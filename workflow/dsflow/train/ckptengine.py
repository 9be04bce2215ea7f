"""dsflow's checkpoint engines on the DeepSpeed engine: DeepSpeed's own torch.save format, with
every file hashed as it is written and every file loaded without running pickled code
(dsflow.safeload). Imported by the ranks only, after DeepSpeed (`dsflow.train.engine.build`).

`HashingCheckpointEngine` writes while `engine.save_checkpoint` runs. `AsyncCheckpointEngine`
(train.async_checkpoints) only copies each state dict into host memory there, the one thing
that must happen before the next optimizer step changes the tensors, and a writer thread
serializes, hashes and writes the copies while training goes on (the design of torch's async
distributed checkpoint: stage in host memory, write in the background). torch.save writes the
copies as it would the live tensors (storages keep their sharing), except that on a GPU they
are tagged as host tensors, which every load maps back.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

from dsflow import safeload


class HashingCheckpointEngine(TorchCheckpointEngine):
    """TorchCheckpointEngine whose saves record (size, xxh3-128) per file name, for the
    checkpoint's manifest (`take_hashes`), and whose loads are `safeload.torch_load`."""

    def __init__(self, config_params: Any = None):
        super().__init__(config_params)
        self.hashes: dict[str, list] = {}

    def save(self, state_dict: Any, path: str) -> None:
        self.write(state_dict, path)

    def write(self, state_dict: Any, path: str) -> None:
        """torch.save through a hashing writer; records the file's size and hash."""
        with open(path, "wb") as raw:
            out = safeload.HashingWriter(raw)
            torch.save(state_dict, out, _use_new_zipfile_serialization=self.zipfile_serialization)
            out.flush()
        self.hashes[Path(path).name] = [out.size, out.hexdigest()]

    def load(self, path: str, map_location: Any = None) -> Any:
        return safeload.torch_load(path, map_location=map_location)

    def take_hashes(self) -> dict[str, list]:
        """What this rank saved since the last call: {file name: [size, hash]}."""
        hashes, self.hashes = self.hashes, {}
        return hashes


class AsyncCheckpointEngine(HashingCheckpointEngine):
    """`save` stages a host copy; `write_behind` writes what was staged in a thread, then calls
    `done(hashes)` there; `wait` joins it and raises what the writer raised."""

    def __init__(self, config_params: Any = None):
        super().__init__(config_params)
        self.staged: list[tuple[Any, str]] = []
        self.thread: threading.Thread | None = None
        self.error: BaseException | None = None

    def save(self, state_dict: Any, path: str) -> None:
        self.staged.append((to_host(state_dict), path))

    def write_behind(self, done: Callable[[dict], None]) -> None:
        """Write the staged files in a writer thread (one save in flight: `wait` first)."""
        assert self.thread is None, "a checkpoint is still being written: wait() first"
        if torch.cuda.is_initialized():
            torch.cuda.synchronize()  # the copies to host memory were issued non-blocking
        jobs, self.staged = self.staged, []

        def work() -> None:
            try:
                while jobs:  # each host copy goes once written, before the commit
                    state, path = jobs.pop(0)
                    self.write(state, path)
                    del state
                done(self.take_hashes())
            except BaseException as e:  # noqa: BLE001 - handed to the training thread
                self.error = e

        self.thread = threading.Thread(target=work, name="dsflow-checkpoint-writer", daemon=True)
        self.thread.start()

    @property
    def busy(self) -> bool:
        return self.thread is not None and self.thread.is_alive()

    def wait(self) -> None:
        """Until the writer is done; raises what it raised."""
        if self.thread is not None:
            self.thread.join()
            self.thread = None
        error, self.error = self.error, None
        if error is not None:
            raise error


def to_host(obj: Any, memo: dict | None = None) -> Any:
    """A copy of a state dict whose tensors live in fresh host memory (pinned for a GPU's, the
    copies issued non-blocking), storages shared as in the original, so that torch.save writes
    the same bytes. Other objects (a loss scaler) are deep-copied: training changes them too."""
    memo = {} if memo is None else memo
    if isinstance(obj, torch.Tensor):
        return _tensor_to_host(obj, memo)
    if isinstance(obj, dict):
        # Its type, attributes (a module state_dict's _metadata) and a defaultdict's factory.
        host = copy.copy(obj)
        for k, v in obj.items():
            host[k] = to_host(v, memo)
        if extra := getattr(obj, "__dict__", None):
            host.__dict__ = copy.deepcopy(extra)
        return host
    if isinstance(obj, list):
        return [to_host(v, memo) for v in obj]
    if isinstance(obj, tuple):  # torch.Size too: its type stays
        items = [to_host(v, memo) for v in obj]
        return type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
    return copy.deepcopy(obj)


def _tensor_to_host(t: torch.Tensor, memo: dict) -> torch.Tensor:
    storage = t.untyped_storage()
    key = (storage.device, storage.data_ptr(), storage.nbytes())
    if key not in memo:
        src = torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)
        dst = torch.empty(storage.nbytes(), dtype=torch.uint8, pin_memory=src.is_cuda)
        dst.copy_(src, non_blocking=src.is_cuda)
        memo[key] = dst.untyped_storage()
    view = torch.empty(0, dtype=t.dtype).set_(memo[key], t.storage_offset(), t.size(), t.stride())
    if isinstance(t, torch.nn.Parameter):
        view = torch.nn.Parameter(view, requires_grad=t.requires_grad)
    else:
        view.requires_grad_(t.requires_grad)  # saved with the tensor
    if t.__dict__:  # Python attributes are pickled with the tensor too
        view.__dict__.update(copy.deepcopy(t.__dict__))
    return view


def install(engine: Any, background: bool = False) -> None:
    """Replace DeepSpeed's default checkpoint engine (`background`: the asynchronous one); another
    one that a user's ds_config chose stays (its files are hashed when the manifest is written,
    and its loads still go through safeload.weights_only)."""
    if type(engine.checkpoint_engine) is TorchCheckpointEngine:
        kind = AsyncCheckpointEngine if background else HashingCheckpointEngine
        engine.checkpoint_engine = kind(engine._config)
