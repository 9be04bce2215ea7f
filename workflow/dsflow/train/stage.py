"""Stage `train`: resolve the run, write its DeepSpeed config, launch one process per rank, wait.

Everything that can be wrong with the request (batch arithmetic, GPUs that are not there, a
vocabulary that does not match a pretrained model, a bad ds_config.json, a corrupted shard, a
model that does not fit the GPUs) fails here, in one line, before any rank starts. The memory
plan is the plan stage's (reports/plan.json) when it planned this very launch, else it is made
here, once; `train.zero_stage: auto` takes its layout from it.

While the ranks run, the stage holds checkpoints/.lock (a second run in the same directory fails
at once), forwards SIGTERM / SIGINT as a request to checkpoint at the next step boundary (a second
signal stops the launcher at once), and turns a rank's failure into one line. See
docs/reliability.md.

Several nodes (dsflow.launch): every node runs this stage. Node 0 does all of the above; the
others check the same things, then only launch their ranks: they take no lock and write nothing
in checkpoints/ (on a shared filesystem the leader's run.json reaches every rank over the
rendezvous, and a node whose run spec differs from node 0's is refused by the ranks).

The resolved run, the run spec, is the dict written to checkpoints/run.json (and
ds_config.json) and read by every rank as a dsflow.train.runspec.RunSpec.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import shutil
import signal
import subprocess
import tempfile
from pathlib import Path

from dsflow import checks, dsconfig, launch, machine
from dsflow.atomic import write_json
from dsflow.data.shards import load_index
from dsflow.errors import UsageError
from dsflow.model import fastpaths, float8, hfkernels, lora, presets, source
from dsflow.model.build import check_mtp, check_vocab_fits, load_checkpoint_config
from dsflow.params import deep_merge, one_line
from dsflow.paths import CHECKPOINTS, SHARDS, TOKENIZER
from dsflow.plan import layouts, memory, request
from dsflow.progress import child_output, log, to_log, whole_lines
from dsflow.train import checkpoint as ckpt
from dsflow.train import cpuop
from dsflow.train.health import rank_errors

# What each rank runs (torchrun -m / the DeepSpeed launcher --module).
RANK_MODULE = "dsflow.train.loop"


class Interrupted(UsageError):
    """The run was stopped by a signal (one line, exit code 128 + signal number)."""

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code


def vocab_size() -> int:
    index = load_index(SHARDS / "train", verify=False)
    return index["vocab_size"]


def check_pretrained_vocab(model: dict, vocab: int) -> None:
    """The tokenizer's `vocab` tokens must index a checkpoint's embeddings (`model` resolved by
    dsflow.model.source), which may pad past them (DeepSeek-V2: 100,015 in 102,400 rows)."""
    if model["pretrained"]:
        config = load_checkpoint_config(model["pretrained"])
        check_vocab_fits(model["source"]["pretrained"], config.vocab_size, vocab)


def check_lora(model: dict, setting: dict) -> None:
    """train.lora against the checkpoint's own shape, before any rank loads its weights: the
    model is built on the meta device (no memory), and dsflow.model.lora says what it cannot
    take, in one line."""
    import torch
    from transformers import AutoModelForCausalLM

    config = load_checkpoint_config(model["pretrained"])
    with torch.device("meta"):
        net = AutoModelForCausalLM.from_config(config)
    lora.check(net, setting)


def run_fingerprint(params: dict, global_batch: int, data_sha: str) -> str:
    """The fingerprint (ckpt.fingerprint) of a run spec's params: a pretrained checkpoint counts
    by what it is (org/name@commit, or a folder's content hash), not by the folder this machine
    keeps it in, nor by the revision name that led to the commit."""
    model = dict(params["model"])
    pinned = model.pop("source", None)
    if pinned:
        model.update(pretrained=source.identity(pinned), revision=None)
    return ckpt.fingerprint({**params, "model": model}, global_batch, data_sha)


def with_file_precision(params: dict, device: str) -> dict:
    """params with train.precision as the run trains in: auto resolved for `device`, then as a
    train.ds_config file leaves it (it may turn fp16 or bf16 on or off). The planner plans it;
    the ranks, run.json, the metrics and the fingerprint record it."""
    train = params["train"]
    precision = machine.resolve_precision(train["precision"], device)
    if train["ds_config"]:
        precision = dsconfig.with_user_precision(precision, train["ds_config"])
        if device == "cpu" and precision == "fp16":
            raise UsageError(
                f"{train['ds_config']}: fp16 is enabled, but DeepSpeed's CPU accelerator has "
                "no fp16; use bf16 or remove the fp16 section"
            )
    return {**params, "train": {**train, "precision": precision}}


def resolve_run(params: dict) -> dict:
    device, local_ranks = machine.resolve_device(params["train"])
    params = with_file_precision(params, device)
    train = params["train"]
    world = local_ranks * train["nodes"]
    batch = dsconfig.resolve_batch(
        train["micro_batch"], train["grad_accum"], train["global_batch"], world
    )
    steps = dsconfig.total_steps(train, batch)
    vocab = vocab_size()
    config = presets.model_config(params["model"]["preset"], vocab, params["model"]["overrides"])
    # The ranks build the model from the spec's model section: the checkpoint's local folder.
    params = {**params, "model": source.resolved(params["model"])}
    check_pretrained_vocab(params["model"], vocab)
    if params["model"]["pretrained"]:
        config = load_checkpoint_config(params["model"]["pretrained"])
    check_mtp(params["model"], config)
    if train["finetune"] == "lora":
        check_lora(params["model"], train["lora"])
    if device == "cpu" and train["precision"] == "fp16":
        raise UsageError(
            "train.precision: fp16 needs a GPU (DeepSpeed's CPU accelerator has no fp16); "
            "use bf16 or fp32 on CPU"
        )
    ds_config = built = dsconfig.build(train, batch, steps, device)
    if train["ds_config"]:
        ds_config = dsconfig.merge_user(ds_config, train["ds_config"])
        if train["finetune"] == "lora":
            dsconfig.check_lora_optimizer(ds_config, f"train.ds_config {train['ds_config']}")
    # Decided once, here (impossible settings fail in one line); the ranks read it from run.json.
    perf = fastpaths.resolve(
        train.get("perf", {}),
        device,
        ds_config["zero_optimization"].get("stage", 0),
        precision=train["precision"],
        optimizer_offload=dsconfig.offload_device(ds_config["zero_optimization"], "optimizer")
        != "none",
        world=world,
        user_config=bool(train["ds_config"]),
    )
    if perf.experts == "hf-best":
        perf = hfkernels.pick_experts(perf, machine.gpus() if device == "cuda" else [])
        log.info(hfkernels.experts_line(perf, device))
    if perf.liger:
        hfkernels.check_liger(
            config.model_type, params["model"].get("mtp_depth", 0), train["precision"]
        )
    if perf.fp8 != "off" and device == "cuda":
        float8.check_gpus(perf.fp8, machine.gpus())
    if perf.fp8_experts:
        fastpaths.check_fp8_experts_machine(device, machine.gpus() if device == "cuda" else [])
    if perf.optimizer == "fused":
        ds_config = dsconfig.for_client_optimizer(ds_config, built, train["ds_config"])
    if perf.device_step:
        ds_config = dsconfig.for_device_step(ds_config, built, train["ds_config"])
    # Every shard's sha256 is checked here, once, so a corrupted shard is one line naming the
    # file, not a traceback from every rank (the ranks then skip the check).
    shards = ":".join(
        s["sha256"] for split in ("train", "val") for s in load_index(SHARDS / split)["shards"]
    )
    data_sha = hashlib.sha256(shards.encode()).hexdigest()
    return {
        "params": params,
        "device": device,
        "world": world,
        "nodes": train["nodes"],
        "local_ranks": local_ranks,
        "batch": {"micro": batch.micro, "accum": batch.accum, "global": batch.global_batch},
        "steps": steps,
        "vocab_size": vocab,
        "fingerprint": run_fingerprint(params, batch.global_batch, data_sha),
        "data_sha": data_sha,
        "data_verified": True,
        "perf": dataclasses.asdict(perf),
        "ds_config": ds_config,
    }


def launch_command(spec: dict, nodes: launch.Nodes) -> list[str]:
    return launch.command(spec["params"]["train"], spec["local_ranks"], nodes, RANK_MODULE)


def _run_json(root: Path) -> dict:
    """The run spec node 0 wrote for the current (or last) run; {} when unreadable."""
    try:
        run = json.loads((root / "run.json").read_text())
    except (OSError, ValueError):
        return {}
    return run if isinstance(run, dict) else {}


def _previous_fingerprint(root: Path) -> str | None:
    return _run_json(root).get("fingerprint")


def zero_partitioned(spec: dict) -> bool | None:
    """Whether every rank saves an optimizer partition (None: not known for sure)."""
    return True if spec["ds_config"].get("zero_optimization", {}).get("stage", 0) else None


def prepare_run_dir(spec: dict) -> None:
    """Pick the checkpoint to resume (spec["resume"]) and make checkpoints/ hold this run.

    What can refuse is decided first, reading only. Then the stage cleans up after interrupted
    saves, moves a run of other params aside into checkpoints/previous/ (never deletes it,
    unless train.keep_previous_runs is 0) or brings this run back from there, and writes
    run.json."""
    root = CHECKPOINTS
    root.mkdir(parents=True, exist_ok=True)
    for name in ckpt.finish_moves(root):
        log.info("finished moving run %s, left half moved by an interrupted train stage", name)
    source, resume = _pick_resume(root, spec)
    for name in ckpt.remove_temp_tags(root):
        log.info("removed %s/%s, left by an interrupted checkpoint save", root, name)
    (root / ckpt.STOP_FILE).unlink(missing_ok=True)
    if source != root:
        _replace_run(root, spec, source)
    if resume:
        resume = _ready_to_resume(root, spec, resume)
    spec["resume"] = resume
    write_json(root / "ds_config.json", spec["ds_config"])
    write_json(root / "run.json", {k: v for k, v in spec.items() if k != "ds_config"})


def _pick_resume(root: Path, spec: dict) -> tuple[Path | None, str | None]:
    """(where this run's checkpoints are: `root`, a moved-aside run in previous/, or None to
    start fresh; the tag to resume there). Reads only; refuses in one line."""
    zero = zero_partitioned(spec)
    same = _previous_fingerprint(root) == spec["fingerprint"]
    # Every file's content hash is checked here, before launch: a damaged tag never reaches
    # the ranks, and the newest intact one is resumed instead. Another run's tags are only
    # moved aside: their hashes wait until they are resumed.
    resume = ckpt.resume_tag(root, spec["world"], zero, note=log.info, content=same)
    if resume and same:
        check_optimizer(root, spec)
        return root, resume
    if resume:
        # This run in another batch split or memory layout: say how to resume it instead.
        check_elastic_batch(root, spec)
        check_layout(root, spec)
    name = ckpt.kept_run(root, spec["fingerprint"])
    kept = root / ckpt.PREVIOUS / name if name else None
    resume = ckpt.resume_tag(kept, spec["world"], zero, content=True) if kept else None
    if not resume:
        return None, None
    check_optimizer(kept, spec)
    return kept, resume


def keep_previous_runs(spec: dict) -> int:
    """train.keep_previous_runs (1 for a spec written before it existed)."""
    return spec.get("params", {}).get("train", {}).get("keep_previous_runs", 1)


def _replace_run(root: Path, spec: dict, kept: Path | None) -> None:
    """Make room for this run: the run in `root` goes to previous/ (train.keep_previous_runs: 0
    deletes it), and `kept`, this run moved aside earlier, comes back."""
    keep = keep_previous_runs(spec)
    old = _previous_fingerprint(root) or "unknown"
    try:
        if keep == 0 and ckpt.tags(root):
            log.info(
                "deleting checkpoints/ of run %s (%s): train.keep_previous_runs is 0",
                old,
                ", ".join(ckpt.tags(root)),
            )
            ckpt.clear(root)
        moved = ckpt.move_aside(root, old)
        if kept is not None:
            ckpt.bring_back(root, kept.name)
    except OSError as e:
        why = one_line(f"{e.strerror or e}{f': {e.filename}' if e.filename else ''}")
        raise UsageError(
            f"train: cannot move the run in checkpoints/ aside into checkpoints/{ckpt.PREVIOUS}/ "
            f"({why}); move its step* folders out of "
            "checkpoints/ yourself, or set train.keep_previous_runs: 0 to delete them and start "
            "fresh"
        ) from None
    if moved:
        log.info(
            "checkpoints/ held another run (params changed): moved it to checkpoints/%s/; "
            "to resume it, restore its params (the train stage moves it back), or move what "
            "that folder holds back into checkpoints/",
            moved,
        )
    else:
        (root / "latest").unlink(missing_ok=True)  # naming no checkpoint of this run
    if kept is not None:
        log.info("checkpoints/%s/%s holds this run: moved it back", ckpt.PREVIOUS, kept.name)
    for name in ckpt.drop_previous(root, keep):
        log.info(
            "removed checkpoints/%s/%s, the oldest moved-aside run (train.keep_previous_runs: %d)",
            ckpt.PREVIOUS,
            name,
            keep,
        )


def _ready_to_resume(root: Path, spec: dict, resume: str) -> str:
    """`latest` on the tag to resume; a tag saved by another world size converted to a
    universal checkpoint (returns the tag to load)."""
    if ckpt.latest_tag(root) != resume:
        ckpt.set_latest(root, resume)
    saved = ckpt.saved_world(root, resume)
    # ZeRO-0 saves the whole optimizer state in one file, which any world size loads.
    if saved is not None and saved != spec["world"] and zero_partitioned(spec):
        log.info(
            "%s was saved by %d rank(s), this run has %d: converting it to a universal "
            "checkpoint (deepspeed.checkpoint.ds_to_universal) to resume from",
            resume,
            saved,
            spec["world"],
        )
        resume = ckpt.to_universal(root, resume)
        spec["ds_config"] = {**spec["ds_config"], "checkpoint": {"load_universal": True}}
    return resume


def check_elastic_batch(root: Path, spec: dict) -> None:
    """A run resumed on another number of ranks must keep its global batch: when that is the
    only difference from the run in checkpoints/, say how to keep it (rather than start over)."""
    try:
        previous = json.loads((root / "run.json").read_text())
        old_world, old_batch = previous["world"], previous["batch"]
    except (OSError, ValueError, KeyError, TypeError):
        return
    new_batch = spec["batch"]
    if old_world == spec["world"] or old_batch["global"] == new_batch["global"]:
        return
    same = run_fingerprint(spec["params"], old_batch["global"], spec.get("data_sha", ""))
    if same != previous.get("fingerprint"):
        return
    old, world, micro = old_batch["global"], spec["world"], new_batch["micro"]
    if old % world:
        fix = f"resume on a number of ranks that divides {old}"
    elif old % (micro * world) == 0:
        fix = (
            f"set train.global_batch: {old} and grad_accum: null (micro_batch {micro} x "
            f"grad_accum {old // (micro * world)} x {world} ranks) to resume"
        )
    else:
        fix = (
            f"set train.global_batch: {old}, grad_accum: null and a micro_batch that divides "
            f"{old // world}"
        )
    raise UsageError(
        f"train: checkpoints/ holds this run at global batch {old} ({old_batch['micro']} x "
        f"{old_batch['accum']} x {old_world} ranks) but micro_batch {micro} x grad_accum "
        f"{new_batch['accum']} x {world} rank(s) = {new_batch['global']}; {fix}, or remove "
        "checkpoints/ to start over"
    )


def _layout_of(train: dict) -> dict:
    """What fixes a checkpoint's layout: the ZeRO stage and where optimizer/params live."""
    offload = train["offload"]
    return {
        "zero_stage": train["zero_stage"],
        "offload": {"optimizer": offload["optimizer"], "param": offload["param"]},
    }


def saved_layout(root: Path, spec: dict) -> dict | None:
    """The run spec's params in the memory layout of the run in checkpoints/, when that run is this
    one saved in another layout (ZeRO stage, offload); else None."""
    try:
        previous = json.loads((root / "run.json").read_text())
        old = _layout_of(previous["params"]["train"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    params = copy.deepcopy(spec["params"])
    if old == _layout_of(params["train"]):
        return None
    params["train"]["zero_stage"] = old["zero_stage"]
    params["train"]["offload"].update(old["offload"])
    batch = previous.get("batch", {}).get("global", spec["batch"]["global"])
    if run_fingerprint(params, batch, spec.get("data_sha", "")) != previous.get("fingerprint"):
        return None
    return params


def check_optimizer(root: Path, spec: dict) -> None:
    """train.perf.optimizer is no part of the fingerprint (it does not change the math), but
    DeepSpeed's and dsflow's fused optimizer save different states: a resume needs the one
    that saved them."""
    old = _run_json(root).get("perf", {}).get("optimizer", "deepspeed")
    new = spec.get("perf", {}).get("optimizer", "deepspeed")
    if old != new:
        raise UsageError(
            f"train.perf.optimizer: checkpoints/ holds this run saved with the {old} optimizer, "
            f"this launch uses {new}, and their states do not load into each other: set "
            f"train.perf.optimizer: {old} (and its ZeRO stage) to resume, or remove "
            "checkpoints/ to start over"
        )


def check_layout(root: Path, spec: dict) -> None:
    """Resuming across ZeRO stages or offload settings is not supported (DeepSpeed's universal
    checkpoints do not load across stages): when the memory layout is the only difference from
    the run in checkpoints/, say so instead of starting over (`zero_stage: auto` keeps the saved
    layout instead: see run)."""
    params = saved_layout(root, spec)
    if params is None:
        return
    old, new = _layout_of(params["train"]), _layout_of(spec["params"]["train"])
    then, now = dsconfig.layout(params["train"]), dsconfig.layout(spec["params"]["train"])
    fix = [f"train.zero_stage: {old['zero_stage']}"]
    for key in ("optimizer", "param"):
        if old["offload"][key] != new["offload"][key]:
            fix.append(f"train.offload.{key}: {old['offload'][key]}")
    raise UsageError(
        f"train: checkpoints/ holds this run saved with {then}, this launch uses {now}; a run "
        f"cannot resume across ZeRO stages or offload settings: set {', '.join(fix)} to "
        "resume, or remove checkpoints/ to start over"
    )


# --------------------------------------------------------------------------- memory plan


def _auto_layout(
    params: dict, req: request.Request, planned: dict | None
) -> tuple[dict, dict | None]:
    """`train.zero_stage: auto` on GPUs: (params with the layout that fits, its estimate when
    made). ``req`` is the request at auto's first stage; ``planned`` reports/plan.json when the
    plan stage planned that very request."""
    if planned is not None and planned["verdict"]["fits"]:
        setup, est = req, planned["estimate"]
        why = layouts.fit_reason(req.zero_stage, est, req.gpu_mem_bytes)
    elif req.gpu_mem_bytes is None:
        setup, est, why = req, None, f"GPU memory unknown: ZeRO-{req.zero_stage}"
    else:
        setup, est, why = layouts.first_fit(req, req.host_mem_bytes)
    params = layouts.with_layout(
        params, setup.zero_stage, setup.offload_optimizer, setup.offload_params
    )
    log.info("train.zero_stage: auto -> %s (%s)", dsconfig.layout(params["train"]), why)
    return params, est


def plan_memory(params: dict, world: int, device: str) -> tuple[dict, dict]:
    """(params with `train.zero_stage: auto` decided, the memory plan of that layout on this
    machine's GPUs). The plan is reports/plan.json when the plan stage planned this very launch
    (one line says so when it planned other GPUs), else it is made here, once.

    `auto` picks the cheapest memory layout the planner says fits (layouts.first_fit: ZeRO-2,
    or ZeRO-1 / ZeRO-0 on one GPU, then ZeRO-3 unless train.perf.compile is true, then CPU
    offload of the optimizer, then of the parameters); on CPU ZeRO-2, with nothing to fit."""
    auto = params["train"]["zero_stage"] == "auto"
    if auto and device != "cuda":
        stage, opt, par, why = layouts.cpu_layout(params["train"])
        params = layouts.with_layout(params, stage, opt, par)
        # On CPU auto is always ZeRO-2: nothing worth a line on every run.
        log.debug("train.zero_stage: auto -> %s (%s)", dsconfig.layout(params["train"]), why)
        auto = False
    # Resolved as the plan stage resolves it (`auto`: its first stage), to compare with its plan.
    req = request.resolve(params, None, world=world)
    planned, why = layouts.planned(req)
    if why:
        log.info("%s", why)
    if not auto:
        return params, planned or layouts.assess(req)
    params, est = _auto_layout(params, req, planned)
    chosen = request.resolve(params, None, world=world)
    if planned is not None and chosen.record() == req.record():
        return params, planned
    same = est is not None and est["inputs"] == memory.inputs(chosen.config, chosen)
    return params, layouts.assess(chosen, est if same else None)


def with_planned_bucket(params: dict, memory_plan: dict) -> dict:
    """params with `train.zero.reduce_bucket_size: auto` replaced by the bucket the memory plan
    was made with (dsflow.plan.comm.bucket_for: its model, batch and GPUs)."""
    if params["train"]["zero"]["reduce_bucket_size"] != "auto":
        return params
    bucket = memory_plan["estimate"]["inputs"]["bucket_sizes"][0]
    return deep_merge(params, {"train": {"zero": {"reduce_bucket_size": int(bucket)}}})


def planned_reserved_bytes(memory_plan: dict | None, device: str) -> int | None:
    """The planner's peak per GPU for this launch as torch.cuda.max_memory_reserved sees it (its
    total without the fixed CUDA context and workspaces, which the caching allocator does not
    hold), for metrics/train.json to put beside the measured peak; None on CPU."""
    if device != "cuda" or not memory_plan or not memory_plan.get("estimate"):
        return None
    total = memory_plan["estimate"]["gpu"]["total"]
    return int(total - memory.FRAMEWORK_OVERHEAD.gpu_fixed_bytes)


def preflight(params: dict, spec: dict, memory_plan: dict | None = None) -> dict:
    """The doctor's blockers and the planner's verdict, before any rank starts; returns the
    NCCL settings the machine needs (e.g. NCCL_P2P_DISABLE=1 on cards without peer access).
    ``memory_plan``: the launch's (:func:`plan_memory`); made here when None."""
    facts = machine.facts(".")
    if memory_plan is None:
        memory_plan = checks.plan_for(facts, params, spec["world"])
    fails = checks.blockers(checks.diagnose(facts, params, memory_plan))
    if fails:
        first = fails[0]
        raise UsageError(f"doctor: {first.name}: {first.detail}; {first.fix}".rstrip("; "))
    if spec["device"] == "cuda" and not params["train"]["force"]:
        layouts.refuse_unless_fits(memory_plan)
    return machine.nccl_env(facts) if spec["device"] == "cuda" else {}


def check_rank_inputs(spec: dict) -> None:
    """What every rank reads besides the shards (checked in resolve_run), checked before launch,
    so that a missing or damaged file is one line naming it now rather than a traceback from
    every rank, at the end of the run for the tokenizer: data/tokenizer (models/final gets it),
    and model.pretrained's safetensors (headers whole, the file as long as they say, tensors of
    the shapes its config.json makes; no weight is read)."""
    launch.check_tokenizer(TOKENIZER, "rerun the tokenizer stage (python -m dsflow tokenizer)")
    folder = source.folder(spec["params"]["model"])
    if folder is None:
        return
    fix = "download the checkpoint again (or save it again)"
    config = load_checkpoint_config(str(folder))
    launch.check_tensor_shapes(folder, source.weight_files(str(folder), folder), config, fix)


def run(params: dict) -> None:
    device, local_ranks = machine.resolve_device(params["train"])
    params = with_file_precision(params, device)
    auto = params["train"]["zero_stage"] == "auto"
    world = local_ranks * params["train"]["nodes"]
    params, memory_plan = plan_memory(params, world, device)
    spec = resolve_run(with_planned_bucket(params, memory_plan))
    saved = saved_layout(CHECKPOINTS, spec) if auto else None
    if saved is not None:
        # A run cannot resume across ZeRO stages or offload settings, and auto picks by the
        # GPUs at hand (ZeRO-1 on one, ZeRO-2 on several): it keeps the run's layout instead.
        log.info(
            "train.zero_stage: auto keeps %s, the layout checkpoints/ holds this run in",
            dsconfig.layout(saved["train"]),
        )
        params, memory_plan = plan_memory(saved, world, device)
        spec = resolve_run(with_planned_bucket(params, memory_plan))
    if launch.slurm_fanout(params["train"]):
        _run_on_slurm_nodes(params, spec)
        return
    nodes = launch.resolve_nodes(params["train"], spec["local_ranks"])
    check_rank_inputs(spec)
    nccl = preflight(params, spec, memory_plan)
    spec["planned_reserved_bytes"] = planned_reserved_bytes(memory_plan, spec["device"])
    for key, value in nccl.items():
        log.info("setting %s=%s for this machine (see python -m dsflow doctor)", key, value)
    if nodes.leader:
        with ckpt.RunLock(CHECKPOINTS) as lock:
            _run_locked(spec, nccl, nodes, lock)
        log.info("done: models/final, metrics/train.json")
    else:
        _run_locked(spec, nccl, nodes, None)
        log.info("done: node %d of %d", nodes.rank, nodes.count)


def _run_on_slurm_nodes(params: dict, spec: dict) -> None:
    """In a SLURM allocation, started once: run this stage on every node (srun), and wait."""
    train = params["train"]
    cmd = launch.slurm_command(train, spec["local_ranks"], spec["device"])
    env = launch.slurm_env(train, json.dumps(params, sort_keys=True))
    log.info(
        "SLURM job %s: the train stage on %d nodes, rendezvous %s:%s: %s",
        env.get("SLURM_JOB_ID"),
        train["nodes"],
        env["MASTER_ADDR"],
        env["MASTER_PORT"],
        " ".join(cmd[:6]),
    )
    try:
        proc = subprocess.Popen(cmd, env=env)
    except FileNotFoundError:
        raise UsageError(
            "train.nodes: SLURM_JOB_ID is set but srun is not on PATH; load SLURM's tools, or "
            "set train.node_rank on each node to launch them yourself"
        ) from None
    code = launch.wait(proc)  # srun forwards a SIGTERM to every node's stage
    if code != 0:
        raise UsageError(
            f"training failed on the SLURM nodes (srun exit {code}); see the node output above; "
            "rerun to resume from the last checkpoint"
        )
    log.info("done: models/final, metrics/train.json")


def _log_launch(spec: dict, nodes: launch.Nodes) -> None:
    batch = spec["batch"]
    log.info(
        "%d rank(s) on %s%s, micro %d x accum %d x %d = batch %d, %d steps, resume: %s",
        spec["world"],
        spec["device"],
        f" ({nodes.count} nodes, this is node {nodes.rank})" if nodes.count > 1 else "",
        batch["micro"],
        batch["accum"],
        spec["world"],
        batch["global"],
        spec["steps"],
        spec.get("resume", "decided by node 0") or "none",
    )


def _run_locked(spec: dict, nccl: dict, nodes: launch.Nodes, lock: ckpt.RunLock | None) -> None:
    """Launch this node's ranks and wait. The leader (node 0, holding `lock`) prepares
    checkpoints/ first and cleans up after; the other nodes leave checkpoints/ alone."""
    root = CHECKPOINTS
    cmd = launch_command(spec, nodes)  # what can still refuse, before checkpoints/ changes
    if nodes.leader:
        prepare_run_dir(spec)
    _log_launch(spec, nodes)
    status_dir = Path(tempfile.mkdtemp(prefix="dsflow-train-"))
    status_file = status_dir / "status"
    env = {**launch.launch_env(spec), **nccl, "DSFLOW_STATUS_FILE": str(status_file)}
    # Each rank's heartbeat and, should it fail, its exception (dsflow.launch.Watchdog).
    env[launch.RANKS_DIR_ENV] = str(status_dir)
    watch = launch.Watchdog(status_dir, launch.collective_timeout_s(env), RANK_MODULE)
    # Node 0's ranks hand run.json to every rank; the others check it against their own spec
    # (dsflow.train.runspec).
    if nodes.leader:
        env[launch.PLAN_SOURCE_ENV] = "1"
    else:
        env[launch.FINGERPRINT_ENV] = spec["fingerprint"]
    try:
        with child_output() as out:  # what the ranks print goes to the stage's log too
            if spec["device"] == "cpu":
                cpuop.build(env, out)
            ranks_env = whole_lines(env)
            code, received, stopped = launch.run_launcher(
                cmd, ranks_env, root / ckpt.STOP_FILE, lock, out, watch
            )
        status = status_file.read_text().strip() if status_file.exists() else ""
        errors, beats = rank_errors(status_dir), launch.read_beats(status_dir)
    finally:
        shutil.rmtree(status_dir, ignore_errors=True)
        if nodes.leader:
            (root / ckpt.STOP_FILE).unlink(missing_ok=True)
            # Every rank is gone: what an interrupted save left behind only takes space.
            for name in ckpt.remove_temp_tags(root):
                log.info("removed %s/%s, left by an interrupted checkpoint save", root, name)
    for error in errors:  # the terminal gets one line (below), the log every traceback
        to_log(f"rank {error['rank']} (PID {error['pid']}): {error['traceback']}")
    if status and not stopped:  # a rank's one-line reason (the ranks may have exited cleanly)
        raise UsageError(status.splitlines()[0])
    _explain_exit(spec, nodes, code, received, stopped, rank_failure(errors, beats))


def rank_failure(errors: list[dict], beats: dict) -> str | None:
    """The ranks' failure in one line: the first exception that is not a lost peer; else the
    rank(s) that died without one (a signal: the OOM killer, a crash) while their peers lost
    them; else the first exception. None when no rank raised."""
    if not errors:
        return None
    first = next((e for e in errors if not e["peer_lost"]), None)
    if first is not None and first["type"] == "UsageError":  # already one line for people
        return f"rank {first['rank']}: {first['message'][:400]}"
    if first is not None:
        return f"rank {first['rank']} raised {first['type']}: {first['message'][:400]}"
    raised = {e["rank"] for e in errors}
    silent = [b for rank, b in sorted(beats.items()) if rank not in raised]
    lost = f"rank {errors[0]['rank']}: {errors[0]['type']}: {errors[0]['message'][:200]}"
    if not silent:
        return lost
    who = ", ".join(f"rank {b.rank} (PID {b.pid})" for b in silent)
    return (
        f"{who} ended without a Python exception (killed by a signal: the OOM killer, a crash "
        f"or a kill) and the others lost it ({lost})"
    )


def _explain_exit(
    spec: dict,
    nodes: launch.Nodes,
    code: int,
    received: list[int],
    stopped: str | None = None,
    failure: str | None = None,
) -> None:
    """Return when the run finished; else raise one line: what stopped it, and how to go on.
    `stopped`: why this stage stopped the launcher (a hung rank, an unheeded stop request);
    `failure`: the ranks' failure (rank_failure)."""
    root = CHECKPOINTS
    last = ckpt.resume_tag(root, spec["world"], zero_partitioned(spec))
    resume = (
        f"rerun to resume from {last}" if last else "no checkpoint was saved: rerun to start over"
    )
    if stopped and received:
        name = signal.Signals(received[0]).name
        raise Interrupted(
            f"interrupted by {name}: {stopped}: stopped the job; {resume}", 128 + received[0]
        )
    if stopped:
        raise UsageError(f"{stopped}: stopped the job; {resume}")
    finished = code == 0 and last and ckpt.step_of(last) >= spec["steps"]
    # A clean exit before the last step: the ranks were asked to stop (checkpoints/.stop), by
    # this stage's signal handler or, with several nodes, by another node's.
    if (received or code == 0) and not finished:
        resumed_from = spec["resume"] if nodes.leader else _run_json(root).get("resume")
        resumed_from = (resumed_from or "").split("/")[0]  # "stepN/universal" is stepN
        if last and last != resumed_from:
            what = f"checkpoint {last} saved; rerun to resume from it"
        elif last:
            what = f"stopped before a new checkpoint was saved; rerun to resume from {last}"
        else:
            what = "stopped before any checkpoint was saved; rerun to start over"
        if not received:
            raise UsageError(f"the ranks stopped on request (checkpoints/.stop): {what}")
        name = signal.Signals(received[0]).name
        raise Interrupted(f"interrupted by {name}: {what}", 128 + received[0])
    if code == 0:
        return
    if failure:
        raise UsageError(f"training failed: {failure}; {resume}")
    raise UsageError(f"training failed (launcher exit {code}); see the rank output above; {resume}")
