"""Checkpoints and models are data to check, never code to run (docs/reliability.md).

A planted pickle in any file a stage loads is refused in one line naming the file, and never
runs; a flipped bit in any checkpoint file or in models/final is caught by its content hash; a
checkpoint the ranks cannot load (a zeroed header, another model's shapes) is one line naming
the tag and file, and the rerun resumes from the checkpoint before it instead of failing again.
All on the tests' shared 2-rank ZeRO-2 run (conftest's `trained`, checkpoints of steps 2 and 4),
copied per case.
"""

from __future__ import annotations

import json
import re
import shutil
import zipfile
from pathlib import Path

import pytest
import torch

from conftest import dsflow, tiny_run, update_params
from dsflow import safeload
from dsflow.errors import UsageError
from dsflow.train import checkpoint as ckpt

TIMEOUT = 300
MODEL = ckpt.MODEL_FILE
OPTIM = "zero_pp_rank_1_mp_rank_00_optim_states.pt"
LAST, BEFORE = "step00000004", "step00000002"


class Planted:
    """What a poisoned checkpoint holds: unpickling it runs code (here, writing `marker`)."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return exec, (f"open({self.marker!r}, 'w').write('ran')",)


def copy_run(trained: Path, dest: Path) -> Path:
    shutil.copytree(trained, dest)
    return dest


def rehash(root: Path, tag: str, zero: bool = True, hashes: bool = True) -> None:
    """The manifest rewritten to match the files, as whoever planted them can do (`hashes`
    False: as an older dsflow wrote it, sizes only)."""
    ckpt.write_manifest(root, tag, ckpt.step_of(tag), 2, zero)
    if not hashes:
        info = json.loads((root / tag / ckpt.MANIFEST).read_text())
        del info[ckpt.HASHES]
        (root / tag / ckpt.MANIFEST).write_text(json.dumps(info))


def plant(path: Path, marker: Path) -> None:
    torch.save({"module": Planted(marker), "optimizer_state_dict": Planted(marker)}, path)


def flip_bit(path: Path) -> None:
    """One bit flipped inside the data of the file's largest tensor (torch's zip) or near the
    end of a safetensors file (its tensors follow the header)."""
    data = bytearray(path.read_bytes())
    if zipfile.is_zipfile(path):
        with zipfile.ZipFile(path) as z:
            info = max(z.infolist(), key=lambda i: i.file_size)
        header = data[info.header_offset : info.header_offset + 30]
        start = info.header_offset + 30 + int.from_bytes(header[26:28], "little")
        start += int.from_bytes(header[28:30], "little")
        at = start + info.file_size // 2
    else:
        at = len(data) - 9
    data[at] ^= 0x40
    path.write_bytes(data)


def train(repo: Path):
    return dsflow("train", cwd=repo, check=False, timeout=TIMEOUT)


def last_line(proc) -> str:
    return proc.stderr.strip().splitlines()[-1]


# --------------------------------------------------------------------------- no pickled code


def test_checkpoints_are_hashed_as_written_and_load_weights_only(trained):
    """Every file of a checkpoint saved by the ranks has its content hash in the manifest, and
    every file loads with weights_only (the allow-list holds what real checkpoints need)."""
    root = trained / "checkpoints"
    for tag in (BEFORE, LAST):
        info = json.loads((root / tag / ckpt.MANIFEST).read_text())
        assert set(info[ckpt.HASHES]) == set(info["files"]) >= {MODEL, OPTIM}
        for name, digest in info[ckpt.HASHES].items():
            assert safeload.file_hash(root / tag / name) == digest, name
            assert safeload.torch_load(root / tag / name) is not None
    record = json.loads((trained / "models/final" / safeload.RECORD).read_text())
    assert "model.safetensors" in record["files"]
    assert safeload.check_folder(trained / "models/final") is None


def test_every_loader_refuses_a_planted_pickle_without_running_it(trained, tmp_path):
    """dsflow's loader, DeepSpeed's own checkpoint engine and its zero_to_fp32 (which ask for
    weights_only=False) under safeload.weights_only, and ds_to_universal run through
    `python -m dsflow.safeload`: each refuses, naming the file."""
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    marker = tmp_path / "ran"
    evil = tmp_path / "evil.pt"
    plant(evil, marker)
    loads = [
        lambda: safeload.torch_load(evil),
        lambda: TorchCheckpointEngine().load(str(evil)),
        lambda: torch.load(evil, weights_only=False),
    ]
    for i, load in enumerate(loads):
        with pytest.raises(safeload.CheckpointError) as exc, safeload.weights_only():
            load()
        assert str(exc.value).startswith(f"{evil}: refused: it holds pickled code"), i
    root = copy_run(trained, tmp_path / "run") / "checkpoints"
    plant(root / LAST / OPTIM, marker)
    with pytest.raises(safeload.CheckpointError) as exc, safeload.weights_only():
        get_fp32_state_dict_from_zero_checkpoint(str(root), tag=LAST)
    assert exc.value.path == str(root / LAST / OPTIM) and exc.value.refused
    # The conversion for an elastic resume: refused, and the tag is never picked again.
    with pytest.raises(UsageError) as exc:
        ckpt.to_universal(root, LAST)
    assert str(exc.value).startswith(
        f"cannot load checkpoint {LAST} ({OPTIM}: refused: it holds pickled code (exec)"
    )
    assert ckpt.resume_tag(root, 2, True) == BEFORE
    assert not marker.exists()
    assert torch.load is torch.serialization.load  # the patch lives inside the block only


@pytest.mark.parametrize("name", [MODEL, OPTIM], ids=["model-states", "optimizer-states"])
def test_a_planted_pickle_in_a_checkpoint_is_refused_in_one_line(trained, tmp_path, name):
    """A pickle planted in the model states or a rank's ZeRO optimizer states, the manifest
    rewritten to match: the rank that loads it stops the run with one line naming the tag and
    the file; the code never runs and no rank prints a traceback."""
    repo = copy_run(trained, tmp_path / "run")
    marker = tmp_path / "ran"
    plant(repo / "checkpoints" / LAST / name, marker)
    rehash(repo / "checkpoints", LAST)
    proc = train(repo)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert last_line(proc).startswith(
        f"dsflow train: error: cannot load checkpoint {LAST} ({name}: refused: it holds pickled "
        "code (exec)"
    ), last_line(proc)
    assert f"a rerun resumes from {BEFORE}" in last_line(proc)
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert not marker.exists()


def test_under_zero3_a_planted_pickle_in_one_ranks_model_states_is_one_line(prepared, tmp_path):
    """ZeRO-3 ranks each read their own model states, between DeepSpeed's collectives: the rank
    that meets the pickle names it and leaves at once, the launcher stops its peer (nothing
    hangs, no rank prints a traceback), and the code never runs."""
    repo = tmp_path / "zero3"
    skip = shutil.ignore_patterns("checkpoints", "models", "dvclive", "metrics")
    shutil.copytree(prepared, repo, ignore=skip)
    update_params(repo, tiny_run(2, 2, zero_stage=3))
    dsflow("train", cwd=repo, timeout=TIMEOUT)
    name, marker = "zero_pp_rank_1_mp_rank_00_model_states.pt", tmp_path / "ran"
    plant(repo / "checkpoints" / BEFORE / name, marker)
    rehash(repo / "checkpoints", BEFORE)
    proc = train(repo)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert last_line(proc).startswith(
        f"dsflow train: error: cannot load checkpoint {BEFORE} ({name}: refused: it holds "
        "pickled code (exec)"
    ), last_line(proc)
    assert last_line(proc).endswith("a rerun starts from step 0")
    assert not re.search(r'File ".*/dsflow/', proc.stderr), proc.stderr[-3000:]
    assert not marker.exists()


def test_export_refuses_a_planted_pickle_in_its_source(trained, tmp_path):
    """Export reads a ZeRO checkpoint's optimizer partitions (DeepSpeed's zero_to_fp32), or a
    ZeRO-0 checkpoint's model states: a planted pickle in either is one line naming it."""
    repo = copy_run(trained, tmp_path / "run")
    root, marker = repo / "checkpoints", tmp_path / "ran"
    plant(root / LAST / OPTIM, marker)
    rehash(root, LAST)
    proc = dsflow("export", "--tag", LAST, cwd=repo, check=False, timeout=TIMEOUT)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert last_line(proc).startswith(f"dsflow export: error: checkpoints/{LAST}/{OPTIM}: refused")
    for name in root.glob(f"{BEFORE}/*optim_states.pt"):  # as ZeRO-0 saves it
        name.unlink()
    plant(root / BEFORE / MODEL, marker)
    rehash(root, BEFORE, zero=False)
    proc = dsflow("export", "--tag", BEFORE, cwd=repo, check=False, timeout=TIMEOUT)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert last_line(proc).startswith(
        f"dsflow export: error: checkpoints/{BEFORE}/{MODEL}: refused"
    )
    assert "Traceback" not in proc.stderr
    assert not marker.exists()


# --------------------------------------------------------------------------- flipped bits


@pytest.mark.parametrize("name", [MODEL, "zero_pp_rank_0_mp_rank_00_optim_states.pt", OPTIM])
def test_a_flipped_bit_in_any_checkpoint_file_is_caught_before_resuming(trained, tmp_path, name):
    root = tmp_path / "checkpoints"
    shutil.copytree(trained / "checkpoints", root)
    flip_bit(root / LAST / name)
    assert ckpt.validate_tag(root, LAST, 2, True) is None  # the sizes still match
    notes: list[str] = []
    assert ckpt.resume_tag(root, 2, True, notes.append, content=True) == BEFORE
    assert notes == [
        f"checkpoints/latest names {LAST}, which is damaged ({name} is corrupted (its content "
        f"hash differs from the manifest's)): resuming from {BEFORE}"
    ]
    # A manifest of an older dsflow has no hashes: checked by size, as before.
    rehash(root, LAST, hashes=False)
    assert ckpt.validate_tag(root, LAST, 2, True, content=True) is None


def test_a_run_with_a_flipped_bit_resumes_from_the_intact_checkpoint(trained, tmp_path):
    """The train stage names the damaged tag and resumes from the one before, which retrains
    the same steps: models/final is bit for bit the undamaged run's."""
    repo = copy_run(trained, tmp_path / "run")
    flip_bit(repo / "checkpoints" / LAST / OPTIM)
    proc = train(repo)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"{OPTIM} is corrupted" in proc.stderr and f"resuming from {BEFORE}" in proc.stderr
    assert "resumed from step 2" in proc.stderr
    final = "models/final/model.safetensors"
    assert (repo / final).read_bytes() == (trained / final).read_bytes()


def test_a_damaged_models_final_fails_evaluate_in_one_line(trained, tmp_path):
    """A flipped bit in models/final/model.safetensors: evaluate names the file (no score is
    written), and a pickle-only models/final is refused before anything loads it."""
    repo = copy_run(trained, tmp_path / "run")
    weights = repo / "models/final/model.safetensors"
    flip_bit(weights)
    proc = dsflow("evaluate", cwd=repo, check=False, timeout=TIMEOUT)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert last_line(proc) == (
        "dsflow evaluate: error: models/final/model.safetensors is corrupted (its content hash "
        f"differs from {safeload.RECORD}); rerun the train stage, which writes it again from its "
        "last checkpoint (dvc repro -f -s train, or snakemake -f train)"
    )
    assert not (repo / "metrics/eval.json").exists()
    # Pickled weights only, as an older folder without a hash record: refused, never loaded.
    marker = tmp_path / "ran"
    weights.unlink()
    (repo / "models/final" / safeload.RECORD).unlink()
    plant(repo / "models/final/pytorch_model.bin", marker)
    proc = dsflow("evaluate", cwd=repo, check=False, timeout=TIMEOUT)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert last_line(proc).startswith(
        "dsflow evaluate: error: models/final holds no *.safetensors weights"
    )
    assert not marker.exists()


# --------------------------------------------------------------------------- unloadable


def test_an_unloadable_checkpoint_is_one_line_and_the_rerun_falls_back(trained, tmp_path):
    """A zeroed zip header in a checkpoint whose manifest has no hashes (an older dsflow): the
    ranks fail to load it, the stage says so in one line naming the tag and file, the tag is
    marked, and the rerun resumes from the checkpoint before it (and does not fail again)."""
    repo = copy_run(trained, tmp_path / "run")
    root = repo / "checkpoints"
    data = bytearray((root / LAST / MODEL).read_bytes())
    data[:64] = bytes(64)
    (root / LAST / MODEL).write_bytes(data)
    rehash(root, LAST, hashes=False)
    proc = train(repo)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert last_line(proc).startswith(
        f"dsflow train: error: cannot load checkpoint {LAST} ({MODEL}: unreadable, damaged"
    ), last_line(proc)
    assert last_line(proc).endswith(
        f"it is marked unloadable (checkpoints/{LAST}/{ckpt.UNLOADABLE}) and a rerun resumes "
        f"from {BEFORE}"
    )
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    proc = train(repo)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"checkpoints/latest names {LAST}, which is damaged" in proc.stderr
    assert "resumed from step 2" in proc.stderr
    assert ckpt.latest_tag(root) == LAST and ckpt.validate_tag(root, LAST, 2, True) is None


def test_a_checkpoint_of_another_model_is_one_line_naming_the_tag_and_file(trained, tmp_path):
    """A tag whose weights have other shapes (another run's, copied in with its manifest):
    one line naming the tag and the file, and the tag is never picked again."""
    repo = copy_run(trained, tmp_path / "run")
    root = repo / "checkpoints"
    state = safeload.torch_load(root / LAST / MODEL)
    name = next(k for k in state["module"] if k.endswith("embed_tokens.weight"))
    state["module"][name] = torch.zeros(7, 3)
    torch.save(state, root / LAST / MODEL)
    rehash(root, LAST)
    proc = train(repo)
    assert proc.returncode == 2, proc.stderr[-3000:]
    line = last_line(proc)
    assert line.startswith(f"dsflow train: error: cannot load checkpoint {LAST} ({MODEL}: "), line
    assert "size mismatch" in line and f"a rerun resumes from {BEFORE}" in line
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "could not load it before" in ckpt.validate_tag(root, LAST, 2, True)
    assert ckpt.resume_tag(root, 2, True, content=True) == BEFORE
