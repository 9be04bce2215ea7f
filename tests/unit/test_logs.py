"""What a stage's log holds: its one-line error when refused, and every line its ranks print, whole
and in order; and the line the train stage says before DeepSpeed builds its CPU op."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import dsflow, update_params
from dsflow import progress
from dsflow.train import cpuop, metrics

STAMP = r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} "


def log_lines(path) -> list[str]:
    """The log's lines without their timestamps (every line must have one)."""
    lines = path.read_text().splitlines()
    assert all(re.match(STAMP, line) for line in lines), lines
    return [re.sub("^" + STAMP, "", line) for line in lines]


@pytest.mark.parametrize("stage", ["plan", "train", "evaluate", "report"])
def test_a_refused_stage_leaves_its_error_line_in_its_log(project, stage):
    log = project / "logs" / f"{stage}.log"
    log.parent.mkdir(exist_ok=True)
    log.write_text("a line of an earlier run\n")
    # plan and train: a batch that does not add up; evaluate: no model; report: no metrics.
    update_params(project, {"train": {"micro_batch": 16, "grad_accum": 4, "global_batch": 64}})
    proc = dsflow(stage, cwd=project, check=False)
    error = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode == 2 and error.startswith(f"dsflow {stage}: error: ")
    assert log_lines(log) == [error]


def test_params_that_do_not_load_are_logged_in_the_stages_log(project):
    update_params(project, {"tokenizer": {"vocab_size": "big"}})
    proc = dsflow("train", cwd=project, check=False)
    assert proc.returncode == 2
    assert log_lines(project / "logs/train.log") == [
        'dsflow train: error: params.yaml: tokenizer.vocab_size: "big" is not allowed '
        "(allowed: integer >= 1 and <= 4294967295)"
    ]
    # Not a stage: no log of its own.
    proc = dsflow("validate", cwd=project, check=False)
    assert proc.returncode == 2 and not (project / "logs/validate.log").exists()


def test_what_a_stage_prints_itself_is_in_its_log(project):
    proc = dsflow("plan", cwd=project)
    table = proc.stdout.strip().splitlines()
    assert any(line.startswith("verdict: ") for line in table)
    lines = log_lines(project / "logs/plan.log")
    assert lines[: len(table)] == table
    assert lines[-1].startswith("[dsflow plan] finished, wall_s=")


RANK = r"""
import sys
rank = int(sys.argv[1])
if rank == 0:
    print("rank 0 on stdout", flush=True)
    sys.stderr.write("evaluate: 10%\revaluate: 50%\revaluate: 100%\r\n")
for i in range(200):
    print(f"[dsflow evaluate] rank {rank} line {i} " + "x" * 300, file=sys.stderr)
"""


def test_child_output_puts_every_line_in_the_log_whole_and_in_order(tmp_path, capfd):
    progress.setup_logging("evaluate", log_dir=tmp_path)
    progress.log.info("before the ranks")
    with progress.child_output() as out:
        ranks = [
            subprocess.Popen(
                [sys.executable, "-c", RANK, str(r)],
                stdout=out,
                stderr=out,
                env=progress.whole_lines({**os.environ, "PYTHONUNBUFFERED": "1"}),
            )
            for r in range(3)
        ]
        assert [r.wait() for r in ranks] == [0, 0, 0]
    progress.log.info("finished, wall_s=1.0")
    lines = log_lines(tmp_path / "evaluate.log")
    assert lines[0] == "[dsflow evaluate] before the ranks"
    assert lines[-1] == "[dsflow evaluate] finished, wall_s=1.0"
    middle = lines[1:-1]
    assert middle.index("rank 0 on stdout") < middle.index("evaluate: 100%")  # the bar's last state
    for r in range(3):  # each rank's lines whole and in its order, whatever the interleaving
        mine = [x for x in middle if x.startswith(f"[dsflow evaluate] rank {r} ")]
        assert mine == [f"[dsflow evaluate] rank {r} line {i} " + "x" * 300 for i in range(200)]
    assert len(middle) == 2 + 3 * 200
    terminal = capfd.readouterr().err  # the terminal gets the output as it came, bars and all
    assert "evaluate: 10%\revaluate: 50%" in terminal and "rank 2 line 199 " in terminal


def test_without_a_log_children_print_where_the_stage_prints(tmp_path):
    progress.setup_logging("evaluate", log_dir=tmp_path, to_file=False)
    with progress.child_output() as out:
        assert out is None
    assert not (tmp_path / "evaluate.log").exists()


def fake_built_op(root):
    built = root / cpuop.NAME / f"{cpuop.NAME}.so"
    built.parent.mkdir(parents=True)
    built.write_bytes(b"\x7fELF")
    return built


def test_the_cpu_op_is_missing_until_its_library_is_in_torchs_cache(tmp_path, monkeypatch):
    monkeypatch.setattr(cpuop, "prebuilt", lambda: False)
    env = {"TORCH_EXTENSIONS_DIR": str(tmp_path)}
    assert cpuop.needs_build(env)
    (tmp_path / cpuop.NAME).mkdir()  # a build that never finished leaves the folder only
    assert cpuop.needs_build(env)
    built = tmp_path / cpuop.NAME / f"{cpuop.NAME}.so"
    built.write_bytes(b"\x7fELF")
    assert not cpuop.needs_build(env) and cpuop.built_path(env) == built
    # Without TORCH_EXTENSIONS_DIR: torch's default, ~/.cache/torch_extensions/py<ver>_<accel>.
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    version = f"py{sys.version_info.major}{sys.version_info.minor}"
    root = cpuop.extensions_root({})
    assert root.parent == tmp_path / "cache" / "torch_extensions"
    assert root.name.startswith(version + "_")
    assert cpuop.needs_build({})
    fake_built_op(root)
    assert not cpuop.needs_build({})


def build_with(fake: str, env: dict, tmp_path, monkeypatch) -> list[str]:
    """The train stage's log lines of cpuop.build with `fake` (Python code) as DeepSpeed's build."""
    monkeypatch.setattr(cpuop, "BUILD", [sys.executable, "-c", fake])
    progress.setup_logging("train", log_dir=tmp_path / "logs")
    cpuop.build(env)
    return log_lines(tmp_path / "logs/train.log")


def test_a_cpu_op_built_in_another_environment_is_built_again(tmp_path, monkeypatch):
    """Two venvs of one Python share torch's cache: torch rebuilds an op whose build.ninja names
    another DeepSpeed or torch, so the stage builds (and says) it before the ranks start."""
    import deepspeed
    import torch

    monkeypatch.setattr(cpuop, "prebuilt", lambda: False)
    env = {"TORCH_EXTENSIONS_DIR": str(tmp_path)}
    folder = tmp_path / cpuop.NAME
    folder.mkdir()
    (folder / f"{cpuop.NAME}.so").write_bytes(b"\x7fELF")
    ours = Path(deepspeed.__file__).parent, Path(torch.__file__).parent
    ninja = "cflags = -I{}/ops/csrc/cpu/includes -isystem {}/include\n"
    (folder / "build.ninja").write_text(ninja.format(*ours))
    assert not cpuop.needs_build(env)
    (folder / "build.ninja").write_text(ninja.format("/other/venv/deepspeed", ours[1]))
    assert cpuop.needs_build(env)
    (folder / "build.ninja").write_text(ninja.format(ours[0], "/other/venv/torch"))
    assert cpuop.needs_build(env)
    # Stands in for DeepSpeed's build: writes this environment's build.ninja.
    fake = f"import pathlib; pathlib.Path({str(folder / 'build.ninja')!r})"
    fake += f".write_text({ninja.format(*ours)!r})"
    lines = build_with(fake, env, tmp_path, monkeypatch)
    assert lines[0] == (
        "[dsflow train] building DeepSpeed's CPU op again: its cache holds another "
        "environment's build"
    )
    assert not cpuop.needs_build(env)


def test_the_cpu_op_build_is_announced_only_when_it_happens(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(cpuop, "prebuilt", lambda: False)
    env = {"TORCH_EXTENSIONS_DIR": str(tmp_path)}
    # Stands in for DeepSpeed's build: writes the library where torch's build would.
    fake = f"import pathlib; p = pathlib.Path({str(tmp_path)!r}, {cpuop.NAME!r}); "
    fake += f"p.mkdir(); (p / '{cpuop.NAME}.so').write_bytes(b'')"
    lines = build_with(fake, env, tmp_path, monkeypatch)
    assert lines[0] == "[dsflow train] building DeepSpeed's CPU op: first run only, about 2 minutes"
    assert re.fullmatch(
        rf"\[dsflow train\] built DeepSpeed's CPU op in \d+ s \(cached in {tmp_path}/{cpuop.NAME}\)",
        lines[1],
    )
    assert len(lines) == 2
    cpuop.build(env)  # built now: not a word, and no build
    assert len(log_lines(tmp_path / "logs/train.log")) == 2
    monkeypatch.setattr(cpuop, "BUILD", [sys.executable, "-c", "raise SystemExit(1)"])
    with pytest.raises(cpuop.UsageError, match="did not build .*C\\+\\+ compiler and ninja"):
        cpuop.build({"TORCH_EXTENSIONS_DIR": str(tmp_path / "empty")})


def test_a_progress_bar_keeps_only_its_last_redraw():
    """A bar redraws its line with \\r and never ends it: what is held back stays one redraw."""
    from dsflow.progress import unfinished

    held = b"".join(f"{i}%\r".encode() for i in range(1000)) + b"99"
    assert unfinished(held) == b"99"
    assert unfinished(b"no bar") == b"no bar"
    assert unfinished(b"done\r") == b"done\r"  # the next redraw still overwrites it


def test_a_line_reaches_the_log_past_an_earlier_stages_closed_handlers(tmp_path, monkeypatch):
    """A stage refused before it sets up its logging (its paths are locked) appends its line to
    the log while the logger still holds an earlier in-process stage's handlers, whose stream
    may be closed by now."""
    import io
    import sys

    from dsflow import progress

    stream = io.TextIOWrapper(io.BytesIO())
    monkeypatch.setattr(sys, "stderr", stream)
    progress.setup_logging("shard", log_dir=tmp_path, to_file=False)
    stream.close()
    path = tmp_path / "train.log"
    progress.to_log("dsflow train: error: refused", path)
    assert path.read_text().rstrip().endswith("dsflow train: error: refused")


def test_the_train_bar_tells_the_time_left_at_the_runs_average_rate(tmp_path, monkeypatch):
    """Every 50th step validates (1.6 s more than a 0.64 s step): drawn right after one, as the
    log keeps it, the bar gives the time the 200 steps left take at the run's average since its
    first step (40 s: the compilation and warm-up)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("DSFLOW_PROGRESS", raising=False)
    logger = metrics.Logger(start=0, steps=300, resumed=False)
    clock = [0.0]
    logger.bar._time = lambda: clock[0]
    logger.bar.start_t = logger.bar.last_print_t = 0.0
    for step in range(1, 101):
        clock[0] += 40.0 if step == 1 else 0.64 + (1.6 if step % 50 == 0 else 0.0)
        logger.progress(2.0, 9000.0)
    minutes, seconds = re.search(r"<(\d\d):(\d\d)", str(logger.bar)).groups()
    average = (clock[0] - 40.0) / 99  # 0.672 s a step
    assert 60 * int(minutes) + int(seconds) == pytest.approx(200 * average, abs=2)
    logger.close()
