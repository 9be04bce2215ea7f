"""One training rank: `python -m dsflow.worker` is what torchrun / the DeepSpeed launcher start.

The train stage (dsflow.train) resolves everything first and writes checkpoints/run.json; every
rank reads that plan, so all ranks agree on batch, steps and config without talking. The loop is
top to bottom here: build, resume, step (micro-batches -> DeepSpeed), balance experts, log,
validate, checkpoint, export.
"""

from __future__ import annotations

import json
import math
import os
import random
import resource
import signal
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from dsflow import checkpoint as ckpt
from dsflow.atomic import atomic_dir, atomic_file
from dsflow.balance import ExpertBalancer
from dsflow.data import ShardReader
from dsflow.flops import flops_per_token, mfu, peak_flops
from dsflow.lm import evaluate_loss, mean_loss, to_batch
from dsflow.model import build_model, model_config, param_counts

SHARDS = Path("data/shards")
TOKENIZER = Path("data/tokenizer")
FINAL = Path("models/final")
METRICS = Path("metrics/train.json")
LIVE_DIR = Path("dvclive")


class Stop:
    """SIGTERM/SIGINT ask the loop to checkpoint and leave at the next step boundary."""

    requested = False

    @classmethod
    def install(cls) -> None:
        def handler(signum, frame):
            cls.requested = True

        signal.signal(signal.SIGTERM, handler)
        signal.signal(signal.SIGINT, handler)


def peak_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def all_mean(value: float, device) -> float:
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return float(t) / dist.get_world_size()


def all_sum(values: list[float], device) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return t.tolist()


def all_gather_int(value: int, device) -> list[int]:
    t = torch.tensor([value], dtype=torch.int64, device=device)
    out = [torch.zeros_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t)
    return [int(x) for x in out]


def rng_state() -> dict:
    return {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
    }


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


class Logger:
    """Rank 0 only: DVCLive metrics (for dvc plots / metrics) and the progress bar."""

    def __init__(self, start: int, steps: int, resumed: bool):
        import dvclive.live
        from dvclive import Live

        from dsflow.progress import bar

        if not os.environ.get("DVC_ROOT"):
            # Outside `dvc repro`, DVCLive would `dvc init` a plain git checkout (and crash on
            # one with no commits); dsflow only wants its files there.
            dvclive.live.get_dvc_repo = lambda: None

        if resumed:
            truncate_live_logs(LIVE_DIR, start)
        self.live = Live(
            str(LIVE_DIR), resume=resumed, save_dvc_exp=False, dvcyaml=None, report=None
        )
        self.bar = bar(desc="train", total=steps, initial=start, unit="step")

    def log(self, step: int, metrics: dict) -> None:
        self.live.step = step
        for name, value in metrics.items():
            if value is not None and math.isfinite(value):
                self.live.log_metric(name, value)
        self.live.next_step()

    def progress(self, loss: float, tokens_per_s: float) -> None:
        self.bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{tokens_per_s:,.0f}", refresh=False)
        self.bar.update(1)

    def close(self) -> None:
        self.bar.close()
        self.live.end()


def truncate_live_logs(root: Path, start: int) -> None:
    """A resumed run re-logs the steps after `start`: drop their old rows (logged before the
    interruption) so each step appears once."""
    for tsv in (root / "plots" / "metrics").rglob("*.tsv"):
        lines = tsv.read_text().splitlines(keepends=True)
        if not lines:
            continue
        header, rows = lines[0], lines[1:]
        step_col = header.rstrip("\n").split("\t").index("step")
        kept = [r for r in rows if int(r.split("\t")[step_col]) <= start]
        tsv.write_text(header + "".join(kept))


def inject_fault(step: int, rank: int) -> None:
    """Fault-injection tests: DSFLOW_FAULT_STEP=s [DSFLOW_FAULT_RANK=r] hard-kills rank r
    right after step s, as a crash or an OOM kill would."""
    at = os.environ.get("DSFLOW_FAULT_STEP")
    if at and int(at) == step and rank == int(os.environ.get("DSFLOW_FAULT_RANK", "0")):
        os.kill(os.getpid(), signal.SIGKILL)


def main() -> int:
    plan = json.loads((ckpt.CHECKPOINTS / "run.json").read_text())
    params, train = plan["params"], plan["params"]["train"]
    device_type = plan["device"]

    import deepspeed

    deepspeed.init_distributed(dist_backend="nccl" if device_type == "cuda" else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if device_type == "cuda":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    assert world == plan["world"], f"launched {world} ranks, the plan says {plan['world']}"
    Stop.install()

    seed = params["seed"]
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)

    model_params = params["model"]
    config = model_config(model_params["preset"], plan["vocab_size"], model_params["overrides"])
    model = build_model(config, device_type=device_type, pretrained=model_params["pretrained"])
    config = model.config
    balance = train["balance"]
    balancer = ExpertBalancer(model, gamma=balance["gamma"], seq_aux_alpha=balance["seq_aux_alpha"])

    ds_config = json.loads((ckpt.CHECKPOINTS / "ds_config.json").read_text())
    engine, _, _, _ = deepspeed.initialize(
        model=model,
        model_parameters=[p for p in model.parameters() if p.requires_grad],
        config=ds_config,
    )
    # DeepSpeed broadcasts parameters at start-up, not buffers: give every rank rank 0's biases.
    balancer.sync_bias()

    start = 0
    if ckpt.latest_tag(ckpt.CHECKPOINTS):
        _, client = engine.load_checkpoint(str(ckpt.CHECKPOINTS), load_module_strict=True)
        start = client["step"]
        if len(client["rng"]) == world:
            set_rng_state(client["rng"][rank])
        if rank == 0:
            print(f"[dsflow train] resumed from step {start}", file=sys.stderr)

    micro, accum = plan["batch"]["micro"], plan["batch"]["accum"]
    steps, seq_len = plan["steps"], train["seq_len"]
    global_tokens = micro * accum * world * seq_len
    reader = ShardReader(SHARDS / "train", seq_len, seed=seed)
    val_reader = ShardReader(SHARDS / "val", seq_len, seed=seed)
    val_windows = train["eval_batches"] * micro * world

    fpt = flops_per_token(config, seq_len)
    device_name = torch.cuda.get_device_name(device) if device_type == "cuda" else "cpu"
    peak = peak_flops(device_name, train["precision"], train["peak_tflops"])
    counts = param_counts(config)

    def validate() -> float:
        total, count = evaluate_loss(
            engine.module,
            val_reader,
            micro=micro,
            device=device,
            rank=rank,
            world=world,
            max_windows=val_windows,
        )
        total, count = all_sum([total, count], device)
        return total / count

    def save(step_done: int) -> None:
        # Every rank writes its own optimizer partition; `latest` moves only when all are done.
        # DeepSpeed stores client state from rank 0 only: gather every rank's RNG into it.
        states: list = [None] * world
        dist.all_gather_object(states, rng_state())
        client = {"step": step_done, "rng": states, "fingerprint": plan["fingerprint"]}
        engine.save_checkpoint(
            str(ckpt.CHECKPOINTS), tag=ckpt.tag_for(step_done), client_state=client
        )
        dist.barrier()
        if rank == 0:
            ckpt.prune(ckpt.CHECKPOINTS, train["keep_checkpoints"])

    logger = Logger(start, steps, resumed=start > 0) if rank == 0 else None
    engine.train()
    wall0 = time.perf_counter()
    history: list[dict] = []
    val_loss = None
    step = start
    last_saved = start if start > 0 else None
    loss_value = float("nan")
    while step < steps:
        t0 = time.perf_counter()
        data_wait = 0.0
        loss_sum = torch.zeros((), device=device, dtype=torch.float64)
        for a in range(accum):
            td = time.perf_counter()
            inputs, targets = to_batch(
                reader.micro_batch(step, a, rank, world, micro, accum), device
            )
            data_wait += time.perf_counter() - td
            loss = mean_loss(engine, inputs, targets)
            engine.backward(loss + balancer.aux_loss())
            engine.step()
            loss_sum += loss.detach().double()
        expert = balancer.update()
        step += 1
        if device_type == "cuda":
            torch.cuda.synchronize(device)
        dt = time.perf_counter() - t0
        loss_value = all_mean(float(loss_sum) / accum, device)
        if not math.isfinite(loss_value):
            raise FloatingPointError(f"loss is {loss_value} at step {step}")
        tokens_per_s = global_tokens / dt
        memory = all_gather_int(peak_memory_bytes(device), device)
        reserved = all_gather_int(
            torch.cuda.max_memory_reserved(device) if device_type == "cuda" else 0, device
        )
        if step % train["eval_every"] == 0 or step == steps:
            val_loss = validate()
        if rank == 0:
            grad_norm = engine.get_global_grad_norm()
            metrics = {
                "train/loss": loss_value,
                "train/lr": engine.get_lr()[0],
                "train/grad_norm": float(grad_norm) if grad_norm is not None else None,
                "perf/tokens_per_s": tokens_per_s,
                "perf/mfu": mfu(tokens_per_s / world, fpt, peak),
                "perf/step_s": dt,
                "perf/data_wait_frac": data_wait / dt,
                "memory/peak_gb_max": max(memory) / 1e9,
                "experts/max_over_mean": expert.get("max_over_mean"),
                "experts/entropy_min": expert.get("entropy_min"),
                "tokens": step * global_tokens,
            }
            if val_loss is not None and (step % train["eval_every"] == 0 or step == steps):
                metrics["val/loss"] = val_loss
            if step % train["log_every"] == 0 or step == steps or "val/loss" in metrics:
                logger.log(step, metrics)
            logger.progress(loss_value, tokens_per_s)
            history.append(
                {
                    "step": step,
                    "dt": dt,
                    "memory": memory,
                    "reserved": reserved,
                    "expert": expert,
                    **metrics,
                }
            )
        inject_fault(step, rank)
        stop = bool(all_sum([1.0 if Stop.requested else 0.0], device)[0])
        if step % train["checkpoint_every"] == 0 or step == steps or stop:
            save(step)
            last_saved = step
        if stop:
            if rank == 0:
                logger.close()
                print(
                    f"[dsflow train] stopped by signal after step {step}; checkpoint saved",
                    file=sys.stderr,
                )
            return 143

    if last_saved != steps and start < steps:
        save(steps)
    if val_loss is None:
        val_loss = validate()
    if rank == 0:
        if logger:
            logger.close()
        export(engine.module)
        hardware = {
            "device_name": device_name,
            "zero_stage": ds_config["zero_optimization"]["stage"],
            "precision": train["precision"],
        }
        if device_type == "cuda":
            hardware["gpu_memory_gb"] = torch.cuda.get_device_properties(device).total_memory / 1e9
        write_metrics(
            history, plan, counts, val_loss, loss_value, time.perf_counter() - wall0, hardware
        )
    dist.barrier()
    return 0


def export(module) -> None:
    """models/final in HF format: what `AutoModelForCausalLM.from_pretrained` loads."""
    from transformers import AutoTokenizer

    with atomic_dir(FINAL) as tmp:
        module.save_pretrained(tmp, safe_serialization=True)
        AutoTokenizer.from_pretrained(TOKENIZER).save_pretrained(tmp)


def write_metrics(history, plan, counts, val_loss, train_loss, wall_s, hardware) -> None:
    steady = history[min(len(history) - 1, max(1, len(history) // 10)) :] if history else []

    def mean(key):
        vals = [h[key] for h in steady if h.get(key) is not None]
        return sum(vals) / len(vals) if vals else None

    last = history[-1] if history else {}
    metrics = {
        "step": plan["steps"],
        "tokens": plan["steps"]
        * plan["batch"]["micro"]
        * plan["batch"]["accum"]
        * plan["world"]
        * plan["params"]["train"]["seq_len"],
        "train_loss": train_loss,
        "val_loss": val_loss,
        "tokens_per_s": mean("perf/tokens_per_s"),
        "mfu": mean("perf/mfu"),
        "step_s": mean("perf/step_s"),
        "data_wait_frac": mean("perf/data_wait_frac"),
        "peak_memory_gb_per_rank": [m / 1e9 for m in last.get("memory", [])],
        "peak_reserved_gb_per_rank": [m / 1e9 for m in last.get("reserved", [])],
        "experts_max_over_mean": last.get("experts/max_over_mean"),
        "experts_entropy_min": last.get("experts/entropy_min"),
        "world_size": plan["world"],
        "device": plan["device"],
        "params_total": counts["total"],
        "params_activated": counts["activated"],
        "wall_s": wall_s,
        **hardware,
    }
    with atomic_file(METRICS) as f:
        json.dump(metrics, f, indent=2, sort_keys=True)
        f.write("\n")


if __name__ == "__main__":
    sys.exit(main())
