"""dsflow's checkpoint engine on the DeepSpeed engine: DeepSpeed's own torch.save format, with
every file hashed as it is written and every file loaded without running pickled code
(dsflow.safeload). Imported by the ranks only, after DeepSpeed (`dsflow.train.engine.build`)."""

from __future__ import annotations

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


def install(engine: Any) -> None:
    """Replace DeepSpeed's default checkpoint engine; another one that a user's ds_config
    chose stays (its files are hashed when the manifest is written, and its loads still go
    through safeload.weights_only)."""
    if type(engine.checkpoint_engine) is TorchCheckpointEngine:
        engine.checkpoint_engine = HashingCheckpointEngine(engine._config)
