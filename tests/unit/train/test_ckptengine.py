"""dsflow.train.ckptengine: checkpoint files hashed as written, in the background when asked."""

from __future__ import annotations

import collections
import io

import pytest
import torch
from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler

from dsflow import safeload
from dsflow.train.ckptengine import AsyncCheckpointEngine, HashingCheckpointEngine, to_host


def state() -> dict:
    """What DeepSpeed's state dicts hold: views sharing one flat buffer, a Parameter, plain data,
    bf16, and an object (a loss scaler's kind)."""
    flat = torch.arange(24, dtype=torch.float32)
    module = torch.nn.Linear(2, 2).state_dict()  # an OrderedDict with _metadata
    tagged = torch.ones(2)
    tagged.ds_id = 5  # a Python attribute, pickled with the tensor
    return {
        "tagged": tagged,
        "module": module,
        "master": torch.zeros(3, requires_grad=True),
        "flat": flat,
        "views": [flat[:12].view(3, 4), flat[12:].view(4, 3).t()],
        "param": torch.nn.Parameter(torch.randn(3, 4), requires_grad=True),
        "half": torch.ones(5, dtype=torch.bfloat16),
        "plain": (1, 2.5, "x", None, torch.Size([3, 4])),
        "scaler": DynamicLossScaler(2.0**16, 1000, 1.0, 2, False),
    }


def zipped(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def engines(*kinds):
    made = [kind() for kind in kinds]
    for e in made:
        e.zipfile_serialization = True  # DeepSpeed's default with a config (the ranks' case)
    return made


def test_a_host_copy_saves_to_the_same_bytes_and_keeps_storages_shared():
    sd = state()
    sd["groups"] = collections.defaultdict(list, {"a": [sd["flat"][:2]]})  # not in checkpoints
    host = to_host(sd)
    assert zipped(host) == zipped(sd)
    views = host["views"]
    assert views[0].untyped_storage().data_ptr() == host["flat"].untyped_storage().data_ptr()
    assert views[1].untyped_storage().data_ptr() == host["flat"].untyped_storage().data_ptr()
    assert isinstance(host["param"], torch.nn.Parameter) and host["param"].requires_grad
    assert host["tagged"].ds_id == 5 and host["groups"].default_factory is list
    # A copy: training's in-place updates after the save do not reach it.
    sd["flat"].add_(100)
    sd["param"].data.zero_()
    assert host["views"][0][0, 0].item() == 0.0 and host["param"].abs().sum() > 0
    sd["scaler"].cur_scale = 1.0  # a skipped step halves it, after the save
    assert host["scaler"].cur_scale == 2.0**16


def test_the_background_writer_writes_the_state_as_it_was_at_the_save(tmp_path):
    background, direct = engines(AsyncCheckpointEngine, HashingCheckpointEngine)
    sd = state()
    direct.save(sd, str(tmp_path / "direct.pt"))
    background.save(sd, str(tmp_path / "background.pt"))
    assert not (tmp_path / "background.pt").exists()  # staged only: nothing written yet
    sd["flat"].add_(1)  # the next optimizer step
    got: list = []
    background.write_behind(got.append)
    background.wait()
    [hashes] = got
    assert hashes["background.pt"] == direct.take_hashes()["direct.pt"]
    size, digest = hashes["background.pt"]
    assert (tmp_path / "background.pt").stat().st_size == size
    assert safeload.file_hash(tmp_path / "background.pt") == digest
    loaded = safeload.torch_load(tmp_path / "background.pt")
    assert torch.equal(loaded["views"][0], torch.arange(12.0).view(3, 4))


def test_a_failed_background_write_is_raised_by_wait_not_lost(tmp_path):
    [background] = engines(AsyncCheckpointEngine)
    background.save(state(), str(tmp_path / "missing" / "file.pt"))
    done: list = []
    background.write_behind(done.append)
    background.thread.join()
    assert not background.busy and isinstance(background.error, FileNotFoundError)
    with pytest.raises(FileNotFoundError):
        background.wait()
    assert done == [] and background.thread is None
    background.wait()  # raised once: the next save starts clean


def test_one_save_in_flight_at_a_time(tmp_path):
    [background] = engines(AsyncCheckpointEngine)
    background.save(state(), str(tmp_path / "a.pt"))
    background.write_behind(lambda hashes: None)
    with pytest.raises(AssertionError, match="wait"):
        background.write_behind(lambda hashes: None)
    background.wait()
