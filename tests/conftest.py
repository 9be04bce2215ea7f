"""Shared fixtures: a throwaway copy of the project, the params overlays for fast stage runs,
and the prepared project the stage tests copy."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

# `pytest -n auto`: pytest-xdist's hooks (optional: without it the suite runs in one process).
from xdist_hooks import pytest_xdist_auto_num_workers, pytest_xdist_make_scheduler  # noqa: F401

ROOT = Path(__file__).resolve().parent.parent


def _has_cuda() -> bool:
    # Through NVML: asking the CUDA driver would initialise it in pytest's own process.
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    import torch

    return torch.cuda.is_available()


# CUDA-only behaviour (kernels' dtype support, CUDA graphs): run on the GPU host with -m cuda.
requires_cuda = pytest.mark.skipif(
    not _has_cuda(), reason="needs a CUDA GPU (pytest -m cuda on the GPU host)"
)
needs_cuda = [pytest.mark.cuda, requires_cuda]

# --------------------------------------------------------------------------- params overlays
# The tests' params are built from these, so that a run's shape is read in one place.

# Small enough for a 2-core CI box, big enough for BPE merges and both splits.
SMALL_PARAMS = {
    "download": {"max_docs": 400},
    "tokenizer": {"vocab_size": 384},
    "tokenize": {"num_proc": 1, "batch_size": 100},
    "shard": {"shard_tokens": 4096},
}


def tiny_v2(**extra) -> dict:
    """model_config overrides that make the deepseek-v2-lite preset (the DeepSeek-V2 family)
    the tiny preset's shape: V2's router and balance loss at CPU-test size."""
    from dsflow.model.presets import PRESETS

    skip = ("description", "num_mtp_layers", "norm_topk_prob")
    shape = {k: v for k, v in PRESETS["tiny"].items() if k not in skip}
    return {**shape, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}, **extra}


def tiny_run(gpus: int, steps: int, **train) -> dict:
    """A params overlay for a short fp32 run of the tiny preset on `gpus` CPU ranks, validated
    and checkpointed at the last step; `train` overrides any train key."""
    return {
        "model": {"preset": "tiny"},
        "train": {
            "device": "cpu",
            "gpus": gpus,
            "precision": "fp32",
            "seq_len": 32,
            "micro_batch": 2,
            "max_steps": steps,
            "eval_every": steps,
            "eval_batches": 1,
            "checkpoint_every": steps,
            **train,
        },
    }


# The one trained run the e2e tests share (`trained`): 2 CPU ranks, ZeRO-2, the default launcher,
# checkpoints of steps 2 and 4 kept.
TRAINED = tiny_run(2, 4, zero_stage=2, checkpoint_every=2, eval_every=4, keep_checkpoints=2)


# Where the tree is no git checkout (the GPU host gets a bare copy of it): what is not the
# project's. At the top: outputs, data, carried wheels, environments (as .gitignore says, and
# what is carried to the GPU host); anywhere: caches.
NOT_PROJECT_TOP = {".git", ".whl", ".venv", "shared", "bench-out", ".snakemake", ".locks"}
NOT_PROJECT_TOP |= {".whl-kernels", ".whl-kernels-part0"}
NOT_PROJECT_TOP |= {"checkpoints", "models", "reports", "logs", "runs", "dvclive", "metrics"}
NOT_PROJECT_ANY = {"__pycache__", ".pytest_cache", ".ruff_cache", ".mypy_cache", ".hypothesis"}
# Top folders of which only these files are the project's: the rest are stage outputs, and DVC's
# cache and temporary files.
ONLY_AT_TOP = {"data": (".gitignore",), ".dvc": ("config", ".gitignore")}


# Virtual environments: a folder holding pyvenv.cfg (what `python -m venv` and virtualenv
# write), under any name and anywhere, and the usual names at the top even before pyvenv.cfg
# is there. Never the project's: a venv inside the checkout is gigabytes.
VENV_MARKER = "pyvenv.cfg"
VENV_NAMES = {".venv", "venv", "env"}


def is_venv(path: Path) -> bool:
    return (path / VENV_MARKER).is_file()


def _skipped(child: Path, rel: Path) -> bool:
    """Whether `child` (at `rel` in the project, a file or a folder) is not the project's."""
    name, top = child.name, len(rel.parts) == 1
    if name in NOT_PROJECT_ANY or name.endswith(".egg-info"):
        return True
    if top and name in NOT_PROJECT_TOP:
        return True
    folder = child.is_dir() and not child.is_symlink()
    return folder and ((top and name in VENV_NAMES) or is_venv(child))


def _walk_project(path: Path, rel: Path = Path()) -> list[str]:
    files = []
    for child in sorted(path.iterdir()):
        sub = rel / child.name
        if _skipped(child, sub):
            continue
        if child.is_dir() and not child.is_symlink():
            if rel == Path() and child.name in ONLY_AT_TOP:
                only = ONLY_AT_TOP[child.name]
                files += [str(sub / f) for f in only if (child / f).is_file()]
                continue
            files += _walk_project(child, sub)
        elif child.is_file():
            files.append(str(sub))
    return files


def _kept(rel: str, verdicts: dict[Path, bool]) -> bool:
    """Whether a file git lists is the project's by the rules `_walk_project` applies: git
    also lists stage outputs a user committed (metrics/, dvclive/) and files of a venv that
    no .gitignore names. `verdicts` caches each folder's answer."""
    parts = Path(rel).parts
    if parts[0] in ONLY_AT_TOP:
        return len(parts) == 2 and parts[1] in ONLY_AT_TOP[parts[0]]
    for depth in range(1, len(parts) + 1):
        sub = Path(*parts[:depth])
        if sub not in verdicts:
            verdicts[sub] = not _skipped(ROOT / sub, sub)
        if not verdicts[sub]:
            return False
    return True


def project_files() -> list[str]:
    """The project's files, without outputs, caches and virtual environments: git's tracked and
    untracked-but-not-ignored files where the tree is a git checkout, else a walk of it."""
    try:
        out = subprocess.run(
            ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        return sorted(_walk_project(ROOT))
    verdicts: dict[Path, bool] = {}
    return [f for f in out.splitlines() if (ROOT / f).is_file() and _kept(f, verdicts)]


def copy_project(dest: Path) -> Path:
    for rel in project_files():
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / rel, target)
    return dest


def update_params(repo: Path, overlay: dict) -> None:
    from dsflow.params import deep_merge

    path = repo / "params.yaml"
    params = yaml.safe_load(path.read_text())
    path.write_text(yaml.safe_dump(deep_merge(params, overlay), sort_keys=False))


def command_env(extra: dict | None = None) -> dict:
    """The environment the tests run a command in: this one, without progress bars and without
    a DSFLOW_CONFIG of the caller's (it would overlay every stage's params), `extra` on top."""
    env = {**os.environ, "DSFLOW_PROGRESS": "0", **(extra or {})}
    env.pop("DSFLOW_CONFIG", None)
    return env


def run(cmd: list[str], cwd: Path, check: bool = True, **kw) -> subprocess.CompletedProcess:
    env = command_env(kw.pop("env", None))
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, env=env, **kw)
    if check and proc.returncode != 0:
        raise AssertionError(
            f"{' '.join(cmd)} exited {proc.returncode}\nstdout:\n{proc.stdout[-3000:]}\n"
            f"stderr:\n{proc.stderr[-3000:]}"
        )
    return proc


def wait_for(predicate, timeout: float, what: str):
    """`predicate()`'s first true value, polled until `timeout` seconds have passed."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


def rank_script(tmp_path: Path, script: str, device: str, *args: str) -> dict:
    """`script` (one rank's code) on 3 gloo ranks on CPU, or one rank on a GPU, through
    torch.distributed.run; its argv: the device's name and `args`, then the path rank 0 writes
    its JSON to, returned."""
    from dsflow.launch import free_port

    path, out = tmp_path / "rank.py", tmp_path / "out.json"
    path.write_text(script)
    env = command_env({"OMP_NUM_THREADS": "1", "DS_ACCELERATOR": device})
    ranks = "3" if device == "cpu" else "1"
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", ranks,
        "--master-port", str(free_port()), str(path), device, *args, str(out),
    ]  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())


def dsflow(*args: str, cwd: Path, check: bool = True, **kw) -> subprocess.CompletedProcess:
    return run([sys.executable, "-m", "dsflow", *args], cwd=cwd, check=check, **kw)


def start(cmd: list[str], cwd: Path, env: dict | None = None, **kw) -> subprocess.Popen:
    """`cmd` started in the background in `cwd` (the environment `run` gives, `env` on top);
    `kw` goes to Popen (where its output goes, stdin, ...)."""
    return subprocess.Popen(cmd, cwd=cwd, env=command_env(env), **kw)


def start_stage(*args: str, cwd: Path, env: dict | None = None, **kw) -> subprocess.Popen:
    """`python -m dsflow *args` started in the background (see `start`)."""
    return start([sys.executable, "-m", "dsflow", *args], cwd=cwd, env=env, **kw)


def losses(repo: Path, name: str = "train/loss") -> dict[int, float]:
    """step -> the value dvclive logged for metric `name` (train/loss, val/loss, ...)."""
    rows = (repo / f"dvclive/plots/metrics/{name}.tsv").read_text().splitlines()[1:]
    return {int(r.split("\t")[0]): float(r.split("\t")[1]) for r in rows}


def rewound_copy(run_dir: Path, dest: Path, step: int) -> Path:
    """A copy of the finished train run in `run_dir` as a run stopped after its checkpoint of
    `step` leaves it: the later checkpoints gone, `latest` on that one, the train/ TSVs cut after
    `step`, no models/final or metrics/train.json, so that what a resume there logs and writes
    comes from the resumed run. Costs no launch, where killing a run would cost one."""
    from dsflow.train.checkpoint import tag_for

    shutil.copytree(run_dir, dest)
    root, tag = dest / "checkpoints", tag_for(step)
    assert (root / tag).is_dir(), f"{run_dir} kept no checkpoint of step {step}"
    for later in (p for p in root.glob("step*") if p.name > tag):
        shutil.rmtree(later)
    (root / "latest").write_text(f"{tag}\n")
    shutil.rmtree(dest / "models/final")
    (dest / "metrics/train.json").unlink()
    # Every train/ curve (the loss, each MTP depth's loss, ...), so that all of them are relogged.
    for tsv in (dest / "dvclive/plots/metrics/train").glob("*.tsv"):
        header, *rows = tsv.read_text().splitlines(keepends=True)
        tsv.write_text(header + "".join(r for r in rows if int(r.split("\t")[0]) <= step))
    return dest


@pytest.fixture
def project(tmp_path) -> Path:
    """A copy of the project with small data params, not a git repo."""
    repo = copy_project(tmp_path / "repo")
    update_params(repo, SMALL_PARAMS)
    return repo


@pytest.fixture(scope="session")
def prepared(tmp_path_factory) -> Path:
    """A project copy whose data stages have all run once (read-only use, please)."""
    repo = copy_project(tmp_path_factory.mktemp("prepared") / "repo")
    update_params(repo, SMALL_PARAMS)
    for stage in ("pretrained", "download", "tokenizer", "tokenize", "shard"):
        dsflow(stage, cwd=repo)
    return repo


@pytest.fixture(scope="session")
def trained(prepared, tmp_path_factory) -> Path:
    """`prepared` trained with TRAINED (read-only use, please: tests copy it to change it)."""
    repo = tmp_path_factory.mktemp("trained") / "repo"
    shutil.copytree(prepared, repo)
    update_params(repo, TRAINED)
    dsflow("train", cwd=repo, timeout=900)
    return repo


# --------------------------------------------------------------------------- front-end clones

# The run the front-end tests have Snakemake and DVC train from a clean checkout.
FRONT_END_RUN = tiny_run(2, 3, seq_len=64)


def commit_all(repo: Path, message: str) -> None:
    run(["git", "add", "-A"], cwd=repo)
    run(["git", "commit", "-qm", message], cwd=repo)


def git_repo(path: Path) -> Path:
    """`path` as a git repository with everything in it committed."""
    run(["git", "init", "-q"], cwd=path)
    run(["git", "config", "user.email", "ci@dsflow"], cwd=path)
    run(["git", "config", "user.name", "ci"], cwd=path)
    commit_all(path, "init")
    return path


def git_dvc_repo(path: Path) -> Path:
    """What `git clone` gives a user (with small data params): a DVC project as it is, with no
    `dvc init`."""
    origin = copy_project(path.with_name(f"{path.name}-origin"))
    update_params(origin, SMALL_PARAMS)
    git_repo(origin)
    run(["git", "clone", "-q", str(origin), str(path)], cwd=origin.parent)
    run(["git", "config", "user.email", "ci@dsflow"], cwd=path)
    run(["git", "config", "user.name", "ci"], cwd=path)
    return path


@pytest.fixture(scope="session")
def dvc_trained(tmp_path_factory) -> SimpleNamespace:
    """A fresh clone in which `dvc repro train` ran every stage up to train (FRONT_END_RUN),
    OMP_NUM_THREADS unset as in a user's shell: `repo`, and `stdout`, what DVC printed.
    Read-only use, please: tests copy it to change it."""
    repo = git_dvc_repo(tmp_path_factory.mktemp("dvc") / "repo")
    update_params(repo, FRONT_END_RUN)
    unset = ["env", "-u", "OMP_NUM_THREADS", "-u", "MKL_NUM_THREADS"]
    out = run([*unset, "dvc", "repro", "train"], cwd=repo)
    return SimpleNamespace(repo=repo, stdout=out.stdout)


@pytest.fixture(scope="session")
def snakemake_trained(tmp_path_factory) -> Path:
    """The project as a committed git checkout (small data params, FRONT_END_RUN) in which
    `snakemake --cores all train` ran every stage up to train. Read-only use, please."""
    repo = copy_project(tmp_path_factory.mktemp("snakemake") / "repo")
    update_params(repo, SMALL_PARAMS)
    update_params(repo, FRONT_END_RUN)
    git_repo(repo)
    run(["snakemake", "--cores", "all", "train"], cwd=repo)
    return repo
