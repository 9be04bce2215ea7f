"""One training rank: `python -m dsflow.train.loop` is what torchrun / the DeepSpeed launcher start.

The train stage (dsflow.train.stage) resolves the run and writes checkpoints/run.json; every rank
reads it as a RunSpec, builds its engine, resumes, and runs the loop below: steps of micro-batches
through DeepSpeed, each step's numbers read back (at once or one step late), validation and
checkpoints when due, and at the end models/final and metrics/train.json.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import sys
import time

import torch
import torch.distributed as dist

from dsflow import dsconfig, launch
from dsflow.data.shards import BatchLoader, ShardReader
from dsflow.model import fastpaths
from dsflow.model.build import save_hf
from dsflow.model.presets import param_counts
from dsflow.paths import CHECKPOINTS, FINAL, SHARDS, TOKENIZER
from dsflow.train import checkpoint as ckpt
from dsflow.train import engine
from dsflow.train.diagnostics import Hooks
from dsflow.train.health import (
    EXIT_FATAL,
    EXIT_RAISED,
    EXIT_STOPPED,
    StepHealth,
    Stop,
    report_exception,
    report_fatal,
)
from dsflow.train.metrics import (
    WALL_KEY,
    Meter,
    finished_record,
    history_from_live,
    restore_finished,
    summary,
    write_metrics,
)
from dsflow.train.runspec import RunSpec


def main() -> int:
    heartbeat = launch.Heartbeat.from_env()  # first: the stage learns this rank's PID
    device = init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    spec = RunSpec.shared(device)
    if spec is None:
        return EXIT_FATAL
    assert world == spec.world, f"launched {world} ranks, the run spec says {spec.world}"
    Stop.install()
    hooks = Hooks(rank, device.type, heartbeat)
    timeout = launch.collective_timeout_s()
    run = engine.build(spec, rank, device)
    compiled = fastpaths.CompileWatch() if run.perf.compile and rank == 0 else None
    start, health_state = ckpt.resume(run, spec)
    health = StepHealth(spec.max_bad_steps, health_state)
    # The train stage verified every shard's sha256 just before launch.
    verify = not spec.data_verified
    train_data = ShardReader(SHARDS / "train", spec.seq_len, seed=spec.seed, verify=verify)
    val_data = ShardReader(SHARDS / "val", spec.seq_len, seed=spec.seed, verify=verify)
    if start >= spec.steps:  # checkpoints/ holds this run finished: its outputs again
        return finish_again(run, spec, health, health_state, lambda: run.validate(spec, val_data))
    before = float((health_state or {}).get(WALL_KEY, 0.0))
    meter = Meter(run, spec, health, lambda: run.validate(spec, val_data), start, before)
    loader = batches(run, spec, train_data, start)
    run.engine.train()
    last_good = spec.resume.split("/")[0] if spec.resume else None  # newest complete checkpoint
    last_saved = start if start > 0 else None
    for step in range(start + 1, spec.steps + 1):
        hooks.step_begins(step)
        meter.clock.step_begins()
        t0 = time.perf_counter()
        loss_sum, data_wait = train_step(run, loader, step, hooks)
        hooks.mark("sync")
        record = meter.capture(step, loss_sum, data_wait, t0)
        hooks.mark("bookkeeping")
        fatal, stop = meter.settle(step, record)
        if fatal:
            return leave(meter, loader, hooks, fatal_line(fatal, last_good), fatal=True)
        hooks.step_ends(step, meter.clock.aside)
        ckpt.written(run, wait=False)  # a checkpoint written in the background: failed?
        if step == start + 1:  # the ranks have met in a step: from now on a hang is a fault
            collective_timeout(timeout)
            hooks.arm()
            report_compiles(compiled, mark=True)
        # No periodic checkpoint during a run of bad steps: the last good one stays the newest.
        periodic = spec.checkpoint_due(step) and health.streak == 0
        if periodic or step == spec.steps or stop:
            with meter.clock.aside(), patient_collectives(timeout):
                last_good = ckpt.save(run, spec, step, meter.state(), hooks.faults, last_good)
            last_saved = step
        if stop and step < spec.steps:
            line = f"stopped on request after step {step}; checkpoint {last_good} saved"
            return leave(meter, loader, hooks, line, fatal=False)
    loader.close()
    report_compiles(compiled)
    collective_timeout(max(launch.PATIENT_TIMEOUT_S, timeout))  # the last save and the export
    if last_saved != spec.steps and start < spec.steps:
        ckpt.save(run, spec, spec.steps, meter.state(), hooks.faults, last_good)
    return finish_run(run, spec, meter)


def report_compiles(watch: fastpaths.CompileWatch | None, mark: bool = False) -> None:
    """Rank 0 logs torch.compile's graph breaks and recompiles when there are any new ones;
    `mark`: after the first step, from which on a compilation is a recompile."""
    if watch is None:
        return
    if mark:
        watch.mark()
    if line := watch.news():
        print(f"[dsflow train] {line}", file=sys.stderr)


def train_step(run: engine.Run, loader: BatchLoader, step: int, hooks: Hooks):
    """Optimizer step `step` (from 1): its micro-batches forward and backward, then DeepSpeed's
    step after each (DeepSpeed applies the update at the accumulation boundary). Returns the
    summed loss, on the device, and the seconds spent waiting for data. With multi-token
    prediction the sum is a vector: [loss, main loss, each depth's loss]."""
    parts = run.engine.module.mtp is not None
    depth = len(run.engine.module.mtp.layers) if parts else 0
    loss_sum = torch.zeros((2 + depth,) if parts else (), device=run.device, dtype=torch.float64)
    if parts:
        run.engine.module.step_begins(step)
    data_wait = 0.0
    for micro in range(loader.accum):
        hooks.mark("data")
        t = time.perf_counter()
        inputs, targets = loader.get(step - 1, micro)
        hooks.faults.trace(step, loader.last_windows)
        data_wait += time.perf_counter() - t
        hooks.mark("forward")
        if run.cuda_graphs:
            # A new iteration: CUDA graph outputs of the last one may be overwritten.
            torch.compiler.cudagraph_mark_step_begin()
        loss = run.engine(inputs, targets)
        if hooks.faults.nan(step):
            loss = loss * float("nan")
        hooks.mark("backward")
        run.engine.backward(loss + run.balancer.aux_loss())
        hooks.mark("optimizer")
        run.engine.step()
        if parts:
            loss_sum[0] += loss.detach().double()
            loss_sum[1:] += run.engine.module.last_losses.double()
        else:
            loss_sum += loss.detach().double()
        hooks.faults.after_micro(step, micro)
    return loss_sum, data_wait


def init_distributed() -> torch.device:
    """Join the process group (NCCL on GPUs, Gloo on CPUs); this rank's device."""
    # First, before any parallel work: the stage's thread count, not the launcher's.
    launch.set_rank_threads()
    import deepspeed

    device_type = os.environ.get("DSFLOW_DEVICE") or (
        "cuda" if torch.cuda.is_available() else "cpu"
    )
    deepspeed.init_distributed(
        dist_backend="nccl" if device_type == "cuda" else "gloo",
        timeout=datetime.timedelta(
            seconds=max(launch.PATIENT_TIMEOUT_S, launch.collective_timeout_s())
        ),
    )
    if device_type != "cuda":
        return torch.device("cpu")
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local_rank)
    return torch.device("cuda", local_rank)


def collective_timeout(seconds: float) -> None:
    """From now on a collective of any process group (DeepSpeed makes its own) fails after
    `seconds` without its peers, instead of waiting for a hung rank forever."""
    from torch.distributed import distributed_c10d as c10d

    for group in list(c10d._world.pg_map):
        with contextlib.suppress(ValueError, AssertionError, RuntimeError):
            c10d._set_pg_timeout(datetime.timedelta(seconds=seconds), group)


@contextlib.contextmanager
def patient_collectives(timeout: float):
    """A checkpoint save: rank 0 writes the model's states the others do not."""
    collective_timeout(max(launch.PATIENT_TIMEOUT_S, timeout))
    try:
        yield
    finally:
        collective_timeout(timeout)


def batches(run: engine.Run, spec: RunSpec, reader: ShardReader, start: int) -> BatchLoader:
    """Training batches by (seed, step, global batch): a resumed run reads what an uninterrupted
    one would have, on any world size."""
    return BatchLoader(
        reader,
        start=start,
        rank=run.rank,
        world=spec.world,
        micro=spec.micro,
        accum=spec.accum,
        device=run.device,
        depth=2 if run.perf.prefetch else 0,
        pin=run.perf.prefetch and run.cuda,
    )


def fatal_line(reason: str, last_good: str | None) -> str:
    kept = (
        f"the last good checkpoint {last_good} is kept and a rerun resumes from it"
        if last_good
        else "there is no good checkpoint yet (a rerun starts from step 0)"
    )
    advice = "lower train.optimizer.lr, or check the data, before rerunning"
    return f"{reason}; stopped: {kept} ({advice})"


def leave(meter: Meter, loader: BatchLoader, hooks: Hooks, line: str, fatal: bool) -> int:
    """Every early exit: rank 0 closes the logs and says why; every rank stops its data thread
    (it must not run into the interpreter's teardown). Under the train stage (which reports the
    reason, or asked for the stop through checkpoints/.stop) the exit is clean; run by hand, a
    failure is EXIT_FATAL and a signal the conventional 128 + SIGTERM."""
    # The line may name it: a checkpoint still being written, complete.
    ckpt.written(meter.run, why=line if fatal else None)
    if meter.run.rank == 0:
        meter.close()
        if fatal:
            report_fatal(line)
        else:
            print(f"[dsflow train] {line}", file=sys.stderr)
    hooks.mark(None)
    loader.close()
    if fatal:
        return 0 if os.environ.get("DSFLOW_STATUS_FILE") else EXIT_FATAL
    return EXIT_STOPPED if Stop.requested else 0


def finish_run(run: engine.Run, spec: RunSpec, meter: Meter) -> int:
    """The last validation, models/final and metrics/train.json (rank 0), which the run also
    keeps with dvclive/ in its last checkpoint tag (metrics.write_metrics)."""
    assert meter.pending is None, "the last step is always read at once"
    ckpt.written(run)  # the last checkpoint complete, before its tag gets the run's record
    if meter.val_loss is None:
        meter.val_loss = meter.validate()
    wall_s = meter.wall_s()
    if run.rank == 0:
        meter.close()
    save_final_model(run, spec)
    if run.rank == 0:
        health = meter.health
        counts = param_counts(run.model.config, spec.model["mtp_depth"])
        metrics = summary(
            spec,
            meter.history,
            counts,
            meter.val_loss,
            meter.loss,
            wall_s,
            outcome(run, spec, meter.device_name, health),
        )
        write_metrics(metrics, record=CHECKPOINTS / ckpt.tag_for(spec.steps))
    dist.barrier()
    return 0


def finish_again(run: engine.Run, spec: RunSpec, health, state: dict | None, validate) -> int:
    """A train stage started on a run that checkpoints/ holds finished (its last tag at or past
    the run's steps; Snakemake ran it, then `dvc repro` runs the stage again): the outputs it
    wrote at its end, again, instead of a "resumed" run of no step with no loss to report.
    models/final from the loaded weights; metrics/train.json and dvclive/ from the record the
    run kept in that tag, or, where it kept none, rebuilt from dvclive/ and a validation."""
    tag = spec.resume.split("/")[0]
    kept = [run.rank == 0 and finished_record(CHECKPOINTS / tag) is not None]
    dist.broadcast_object_list(kept, src=0)
    val_loss = None if kept[0] else validate()  # every rank takes part
    save_final_model(run, spec)
    if run.rank == 0:
        print(
            f"[dsflow train] {tag}: this run is finished; models/final written again from it, "
            f"metrics/train.json {'as it recorded them' if kept[0] else 'rebuilt from dvclive/'}",
            file=sys.stderr,
        )
    if run.rank == 0 and kept[0]:
        restore_finished(CHECKPOINTS / tag)
    elif run.rank == 0:
        rebuild_metrics(run, spec, ckpt.step_of(tag), health, state, val_loss)
    dist.barrier()
    return 0


def rebuild_metrics(run: engine.Run, spec: RunSpec, step: int, health, state, val_loss) -> None:
    """metrics/train.json of a finished run that kept no record of it: the steps' numbers from
    dvclive/, the last step's loss among them, and the training seconds its checkpoint kept."""
    history = history_from_live()
    mine = [h for h in history if h["step"] == step]
    train_loss = mine[0].get("train/loss") if mine else None
    wall_s = (state or {}).get(WALL_KEY)
    device_name = torch.cuda.get_device_name(run.device) if run.cuda else "cpu"
    counts = param_counts(run.model.config, spec.model["mtp_depth"])
    hw = outcome(run, spec, device_name, health)
    write_metrics(summary(spec, history, counts, val_loss, train_loss, wall_s, hw))


def outcome(run: engine.Run, spec: RunSpec, device_name: str, health) -> dict:
    """metrics/train.json's hardware and health entries."""
    return {
        **hardware(run, spec, device_name),
        "skipped_steps": health.skipped,
        "bad_steps": health.bad,
        "grad_norm_spikes": health.spikes,
    }


def save_final_model(run: engine.Run, spec: RunSpec) -> None:
    """models/final. ZeRO-3: every rank takes part in gathering the full weights, rank 0 keeps
    them; LoRA: the merged model and its adapter."""
    if run.adapter is not None:
        _save_lora(run, spec)
        return
    weights = run.engine._zero3_consolidated_16bit_state_dict() if spec.zero3 else None
    if run.rank == 0:
        save_hf(run.model, FINAL, TOKENIZER, weights)


def _save_lora(run: engine.Run, spec: RunSpec) -> None:
    """models/final merged, and its adapter; ZeRO-3 gathers the adapters on every rank."""
    from dsflow.model import lora

    trained = [p for p in run.model.parameters() if p.requires_grad]
    gathered = contextlib.nullcontext()
    if spec.zero3:
        import deepspeed

        gathered = deepspeed.zero.GatheredParameters(trained)
    with gathered:
        if run.rank == 0:
            # The adapter names its base as the user did (a Hub id, not this machine's cache).
            name = (spec.model.get("source") or spec.model)["pretrained"]
            base = engine.base_folder(spec)
            lora.save_final(run.adapter, base, FINAL, TOKENIZER, spec.precision, name)


def hardware(run: engine.Run, spec: RunSpec, device_name: str) -> dict:
    zero = spec.ds_config["zero_optimization"]
    out = {
        "device_name": device_name,
        "zero_stage": zero["stage"],
        "offload_optimizer": dsconfig.offload_device(zero, "optimizer"),
        "offload_param": dsconfig.offload_device(zero, "param"),
        "precision": spec.precision,
    }
    if run.cuda:
        out["gpu_memory_gb"] = torch.cuda.get_device_properties(run.device).total_memory / 1e9
    return out


def shutdown(code: int) -> int:
    """Destroy the process group before the interpreter's teardown. Left to teardown, Gloo's
    worker threads can still hold work objects, and freeing them there aborts the process
    ("terminate called without an active exception", pytorch#190489): a finished run exiting
    -6. No collective here: a rank that returns early does not wait for the others."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    return code


def run_rank() -> int:
    """main(); an exception is recorded for the train stage (health.report_exception), which
    prints one line for the run, and the rank leaves at once (os._exit: no teardown that could
    wait on a broken process group). Run by hand, the traceback shows as usual."""
    try:
        return shutdown(main())
    except Exception as exc:
        if not report_exception(exc):
            raise
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(EXIT_RAISED)


if __name__ == "__main__":
    launch.exit_rank(run_rank())
