"""Reading shards: `ShardReader` turns a split's shards into fixed-length training sequences.

The split's token stream is cut into windows of `seq_len + 1` tokens (stride `seq_len`, so every
token is a target exactly once per epoch). Windows are visited in a seeded permutation per epoch,
forming one global sequence of samples. Step `s` of a run with global batch B uses samples
[s*B, (s+1)*B); within it, rank r's micro-step a takes the slice starting at (a*world + r)*micro.
So the data a step sees depends only on (seed, step, global batch): 3 ranks x micro m and 1 rank x
micro 3m read the same samples, and a resumed run (or one resumed on another world size) continues
exactly where it stopped.
"""

from __future__ import annotations

import json
import queue
import threading
from pathlib import Path

import numpy as np

from dsflow.atomic import sha256_file
from dsflow.errors import UsageError

MASK64 = np.uint64(2**64 - 1)


def splitmix64(x: np.ndarray) -> np.ndarray:
    """A fixed integer hash: the permutation must not change with numpy's RNG algorithms."""
    with np.errstate(over="ignore"):
        x = (x + np.uint64(0x9E3779B97F4A7C15)) & MASK64
        x = ((x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)) & MASK64
        x = ((x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)) & MASK64
        return x ^ (x >> np.uint64(31))


def permutation(n: int, seed: int, epoch: int) -> np.ndarray:
    key = splitmix64(np.uint64(seed) * np.uint64(1000003) + np.uint64(epoch))
    keys = splitmix64(np.arange(n, dtype=np.uint64) ^ key)
    return np.argsort(keys, kind="stable")


# What the train and evaluate stages and their ranks read of a split's index.json: key -> type.
INDEX_KEYS = {"dtype": str, "vocab_size": int, "shards": list}
SHARD_KEYS = {"file": str, "tokens": int, "sha256": str}
JSON_TYPE = {str: "a string", int: "an integer", list: "a list"}  # as a message names them


def check_index(index, path: Path) -> None:
    """One line naming `path` and the first key index.json lacks or holds a wrong type in (a
    hand-edited or foreign file), instead of a KeyError in every rank."""
    fix = "rerun the shard stage"
    if not isinstance(index, dict):
        raise UsageError(f"{path}: not a JSON object; {fix}")
    entries = [("", index, INDEX_KEYS)]
    shards = index.get("shards")
    if isinstance(shards, list):
        entries += [(f"shards[{i}].", shard, SHARD_KEYS) for i, shard in enumerate(shards)]
    for where, entry, keys in entries:
        if not isinstance(entry, dict):
            raise UsageError(f"{path}: {where.rstrip('.')} is not a JSON object; {fix}")
        for key, kind in keys.items():
            if key not in entry:
                raise UsageError(f"{path}: key {where}{key} is missing; {fix}")
            value = entry[key]
            if not isinstance(value, kind) or isinstance(value, bool):
                raise UsageError(
                    f"{path}: key {where}{key} is {value!r}, not {JSON_TYPE[kind]}; {fix}"
                )
    try:
        np.dtype(index["dtype"])
    except TypeError:
        raise UsageError(f"{path}: key dtype {index['dtype']!r} is no numpy dtype; {fix}") from None


def load_index(split_dir: str | Path, verify: bool = True) -> dict:
    """index.json of a split; checks each shard's size, and its sha256 when `verify`."""
    split_dir = Path(split_dir)
    path = split_dir / "index.json"
    if not path.exists():
        raise UsageError(
            f"{path}: missing; run the shard stage (snakemake shard / dvc repro shard)"
        )
    try:
        index = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise UsageError(f"{path}: not valid JSON; rerun the shard stage") from None
    check_index(index, path)
    itemsize = np.dtype(index["dtype"]).itemsize
    for shard in index["shards"]:
        file = split_dir / shard["file"]
        if not file.exists():
            raise UsageError(f"{file}: missing; rerun the shard stage")
        size = file.stat().st_size
        if size != shard["tokens"] * itemsize:
            raise UsageError(
                f"{file}: {size} bytes, expected {shard['tokens'] * itemsize} (truncated or "
                "overwritten); rerun the shard stage"
            )
        if verify and sha256_file(file) != shard["sha256"]:
            raise UsageError(f"{file}: sha256 mismatch (corrupted); rerun the shard stage")
    return index


class ShardReader:
    """Fixed-length sequences of one split, deterministic per (seed, sample number)."""

    def __init__(self, split_dir: str | Path, seq_len: int, seed: int = 0, verify: bool = True):
        self.split_dir = Path(split_dir)
        self.index = load_index(self.split_dir, verify=verify)
        self.seq_len = seq_len
        self.seed = seed
        dtype = np.dtype(self.index["dtype"])
        self.shards = [
            np.memmap(self.split_dir / s["file"], dtype=dtype, mode="r")
            for s in self.index["shards"]
        ]
        self.starts = np.cumsum([0] + [len(s) for s in self.shards])
        self.total_tokens = int(self.starts[-1])
        self.num_windows = (self.total_tokens - 1) // seq_len
        if self.num_windows < 1:
            raise UsageError(
                f"{self.split_dir}: {self.total_tokens} tokens are fewer than one sequence of "
                f"{seq_len + 1}; use more data or a shorter train.seq_len"
            )
        self._epoch, self._perm = -1, None

    def tokens(self, start: int, length: int) -> np.ndarray:
        """`length` tokens of the split's stream from `start`, across shard boundaries."""
        out = np.empty(length, dtype=np.int64)
        pos, filled = start, 0
        while filled < length:
            k = int(np.searchsorted(self.starts, pos, side="right")) - 1
            offset = pos - int(self.starts[k])
            take = min(length - filled, len(self.shards[k]) - offset)
            out[filled : filled + take] = self.shards[k][offset : offset + take]
            filled += take
            pos += take
        return out

    def _perm_for(self, epoch: int) -> np.ndarray:
        if epoch != self._epoch:
            self._epoch, self._perm = epoch, permutation(self.num_windows, self.seed, epoch)
        return self._perm

    def window(self, sample: int) -> np.ndarray:
        """Global sample number -> its window of seq_len + 1 tokens."""
        epoch, i = divmod(sample, self.num_windows)
        return self.tokens(int(self._perm_for(epoch)[i]) * self.seq_len, self.seq_len + 1)

    def samples(self, start: int, count: int) -> np.ndarray:
        """[count, seq_len + 1] int64 array of samples start .. start + count - 1."""
        return np.stack([self.window(s) for s in range(start, start + count)])

    def micro_batch(
        self, step: int, micro_step: int, rank: int, world: int, micro: int, accum: int
    ) -> np.ndarray:
        """Rank `rank`'s micro-batch number `micro_step` of optimizer step `step`."""
        global_batch = micro * accum * world
        start = step * global_batch + (micro_step * world + rank) * micro
        return self.samples(start, micro)

    def sequential(self, rank: int = 0, world: int = 1, max_windows: int | None = None):
        """Unshuffled windows for evaluation, split round-robin over ranks: each once."""
        n = self.num_windows if max_windows is None else min(max_windows, self.num_windows)
        for i in range(rank, n, world):
            yield self.tokens(i * self.seq_len, self.seq_len + 1)


class BatchLoader:
    """A rank's micro-batches for steps `start`, `start + 1`, ... in order, read ahead.

    A background thread reads the next `depth` micro-batches (`ShardReader.micro_batch`, so
    exactly the same data as reading them inline) while the GPU works; with `pin`, into
    page-locked memory, so the host-to-device copy is asynchronous. `get` returns
    (inputs, targets) on `device` and checks that it is asked for the batches in order.
    """

    def __init__(
        self,
        reader: ShardReader,
        *,
        start: int,
        rank: int,
        world: int,
        micro: int,
        accum: int,
        device,
        depth: int = 2,
        pin: bool = False,
    ):
        self.reader, self.rank, self.world = reader, rank, world
        self.micro, self.accum, self.device, self.pin = micro, accum, device, pin
        self.next = (start, 0)
        self.depth = depth
        if depth > 0:
            self._queue: queue.Queue = queue.Queue(maxsize=depth)
            self._stop = threading.Event()
            self._thread = threading.Thread(
                target=self._fill, args=(start,), name="dsflow-batches", daemon=True
            )
            self._thread.start()

    def _read(self, step: int, micro_step: int):
        import torch  # only batches need it: the train stage reads indexes without loading torch

        windows = self.reader.micro_batch(
            step, micro_step, self.rank, self.world, self.micro, self.accum
        )
        batch = torch.from_numpy(windows)
        return batch.pin_memory() if self.pin else batch

    def _fill(self, step: int) -> None:
        try:
            while not self._stop.is_set():
                for a in range(self.accum):
                    item = ((step, a), self._read(step, a))
                    while not self._stop.is_set():
                        try:
                            self._queue.put(item, timeout=0.1)
                            break
                        except queue.Full:
                            continue
                step += 1
        except BaseException as exc:  # noqa: BLE001 - re-raised in the training thread
            self._queue.put((None, exc))

    def get(self, step: int, micro_step: int):
        """(inputs, targets) of `micro_step` of optimizer step `step`, on the device."""
        if (step, micro_step) != self.next:
            raise RuntimeError(f"batches asked out of order: {(step, micro_step)} != {self.next}")
        self.next = (step, micro_step + 1) if micro_step + 1 < self.accum else (step + 1, 0)
        if self.depth > 0:
            key, batch = self._queue.get()
            if key is None:
                raise batch
        else:
            batch = self._read(step, micro_step)
        self.last_windows = batch.numpy()  # host copy, for the data trace of the tests
        batch = batch.to(self.device, non_blocking=self.pin)
        return batch[:, :-1], batch[:, 1:]

    def close(self) -> None:
        if self.depth > 0:
            self._stop.set()
            self._thread.join(timeout=5)
