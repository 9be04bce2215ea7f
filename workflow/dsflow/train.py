"""Stage `train`: resolve the run, write its DeepSpeed config, launch one process per rank, wait.

Everything that can be wrong with the request (batch arithmetic, GPUs that are not there, a
vocabulary that does not match a pretrained model, a bad ds_config.json) fails here, in one line,
before any rank starts.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

from dsflow import checkpoint as ckpt
from dsflow import dsconfig
from dsflow.atomic import write_json
from dsflow.data import load_index
from dsflow.errors import UsageError
from dsflow.progress import log

SHARDS = Path("data/shards")


def resolve_device(train: dict) -> tuple[str, int]:
    """(device type, ranks per node); asking for GPUs that do not exist is an error."""
    import torch

    want, gpus = train["device"], train["gpus"]
    visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if want == "cuda" and visible == 0:
        raise UsageError(
            "train.device: cuda, but no CUDA GPU is visible (check nvidia-smi and "
            "CUDA_VISIBLE_DEVICES, or set train.device: cpu)"
        )
    device = "cuda" if want == "cuda" or (want == "auto" and visible > 0) else "cpu"
    if gpus == "auto":
        return device, (visible if device == "cuda" else 1)
    if device == "cuda" and gpus > visible:
        raise UsageError(
            f"train.gpus: {gpus} GPUs requested but {visible} visible; set train.gpus: {visible} "
            "(or auto), and adjust grad_accum to keep the global batch"
        )
    return device, gpus


def vocab_size() -> int:
    index = load_index(SHARDS / "train", verify=False)
    return index["vocab_size"]


def check_pretrained_vocab(pretrained: str | None, vocab: int) -> None:
    if not pretrained:
        return
    from dsflow.model import _load_checkpoint_config

    config = _load_checkpoint_config(pretrained)
    if config.vocab_size != vocab:
        raise UsageError(
            f"model.pretrained: {pretrained} has vocab_size {config.vocab_size} but the "
            f"tokenizer has {vocab}; set tokenizer.pretrained to that model's tokenizer"
        )


def plan_run(params: dict) -> dict:
    train = params["train"]
    device, world = resolve_device(train)
    batch = dsconfig.resolve_batch(
        train["micro_batch"], train["grad_accum"], train["global_batch"], world
    )
    steps = dsconfig.total_steps(train, batch)
    vocab = vocab_size()
    from dsflow.model import model_config

    model_config(params["model"]["preset"], vocab, params["model"]["overrides"])
    check_pretrained_vocab(params["model"]["pretrained"], vocab)
    if device == "cpu" and train["precision"] == "fp16":
        raise UsageError(
            "train.precision: fp16 needs a GPU (DeepSpeed's CPU accelerator has no fp16); "
            "use bf16 or fp32 on CPU"
        )
    ds_config = dsconfig.build(train, batch, steps, device)
    if train["ds_config"]:
        ds_config = dsconfig.merge_user(ds_config, train["ds_config"])
    data_sha = ":".join(
        s["sha256"]
        for split in ("train", "val")
        for s in load_index(SHARDS / split, False)["shards"]
    )
    return {
        "params": params,
        "device": device,
        "world": world,
        "batch": {"micro": batch.micro, "accum": batch.accum, "global": batch.global_batch},
        "steps": steps,
        "vocab_size": vocab,
        "fingerprint": ckpt.fingerprint(params, world, data_sha),
        "ds_config": ds_config,
    }


def free_port() -> int:
    """A port nothing listens on now, so two runs on one machine do not collide."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_command(plan: dict) -> list[str]:
    train = plan["params"]["train"]
    world, port = plan["world"], str(train["master_port"] or free_port())
    if train["launcher"] == "deepspeed":
        return [
            sys.executable,
            "-m",
            "deepspeed.launcher.runner",
            "--num_gpus",
            str(world),
            "--master_port",
            port,
            "--module",
            "dsflow.worker",
        ]
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        "1",
        "--nproc_per_node",
        str(world),
        "--master_addr",
        "127.0.0.1",
        "--master_port",
        port,
        "-m",
        "dsflow.worker",
    ]


def launch_env(plan: dict) -> dict:
    env = dict(os.environ)
    if plan["device"] == "cpu":
        env["DS_ACCELERATOR"] = "cpu"
        env["CUDA_VISIBLE_DEVICES"] = ""
        # Ranks share the cores: more threads than cores would make every rank slower.
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // plan["world"])))
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    return env


def prepare_run_dir(plan: dict) -> None:
    root = ckpt.CHECKPOINTS
    root.mkdir(parents=True, exist_ok=True)
    previous = root / "run.json"
    if ckpt.latest_tag(root) and previous.exists():
        old = json.loads(previous.read_text()).get("fingerprint")
        if old != plan["fingerprint"]:
            log.info("checkpoints/ holds a different run (params changed): starting fresh")
            ckpt.clear(root)
    elif not ckpt.latest_tag(root):
        ckpt.clear(root)
    write_json(root / "ds_config.json", plan["ds_config"])
    write_json(root / "run.json", {k: v for k, v in plan.items() if k != "ds_config"})


def preflight(params: dict, plan: dict) -> dict:
    """The doctor's blockers and the planner's verdict, before any rank starts; returns the
    NCCL settings the machine needs (e.g. NCCL_P2P_DISABLE=1 on cards without peer access)."""
    from dsflow import doctor
    from dsflow import plan as planner

    facts = doctor.gather_facts(".")
    fails = [c for c in doctor.diagnose(facts, params) if c.status == doctor.FAIL]
    if fails:
        first = fails[0]
        raise UsageError(f"doctor: {first.name}: {first.detail}; {first.fix}".rstrip("; "))
    if plan["device"] == "cuda" and not params["train"]["force"]:
        mem = min(g["total_memory"] for g in facts["gpus"][: plan["world"]])
        planner.check_fits(params, plan["world"], plan["device"], mem)
    return doctor.nccl_env(facts) if plan["device"] == "cuda" else {}


def run(params: dict) -> None:
    if params["train"]["zero_stage"] == 3:
        raise UsageError(
            "train.zero_stage: 3 is not supported by the train stage yet (export of partitioned "
            "weights and MoE leaf modules are missing); use 0, 1 or 2"
        )
    plan = plan_run(params)
    nccl = preflight(params, plan)
    for key, value in nccl.items():
        log.info("setting %s=%s for this machine (see python -m dsflow doctor)", key, value)
    prepare_run_dir(plan)
    batch = plan["batch"]
    log.info(
        "%d rank(s) on %s, micro %d x accum %d x %d = batch %d, %d steps, resume: %s",
        plan["world"],
        plan["device"],
        batch["micro"],
        batch["accum"],
        plan["world"],
        batch["global"],
        plan["steps"],
        ckpt.latest_tag(ckpt.CHECKPOINTS) or "none",
    )
    proc = subprocess.Popen(launch_command(plan), env={**launch_env(plan), **nccl})
    try:
        code = proc.wait()
    except KeyboardInterrupt:
        # Forward to the launcher: ranks checkpoint at the next step boundary and exit.
        proc.send_signal(signal.SIGTERM)
        code = proc.wait()
    if code != 0:
        raise UsageError(
            f"training failed (launcher exit {code}); see the rank output above. "
            "Rerun to resume from the last checkpoint"
        )
    log.info("done: models/final, metrics/train.json")
