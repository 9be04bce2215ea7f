"""Where the ranks run: one node or several, started by torchrun or by DeepSpeed's launcher.

World size = train.nodes x ranks per node (train.gpus). The launch engines are the stock ones:

- torchrun, one launcher per node, meeting at a c10d rendezvous (`train.master_addr:master_port`,
  id `train.rdzv_id`). Every node runs the train stage; node 0 (`train.node_rank`, $NODE_RANK or
  $SLURM_NODEID) prepares checkpoints/ and run.json and hands the run spec to every rank over the
  rendezvous; the other nodes only launch their ranks (see dsflow.train.stage).
- DeepSpeed's launcher with a hostfile: only node 0 runs the stage, pdsh/ssh start the others.
- SLURM: started once in an allocation of train.nodes nodes (sbatch, or Snakemake's SLURM
  executor), the stage runs itself once per node with `srun --ntasks-per-node=1`, and each of
  those is a torchrun node as above (rendezvous on the first node, id = $SLURM_JOB_ID).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import logging
import math
import mmap
import os
import signal
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dsflow.errors import UsageError

NODE_TASK_ENV = "DSFLOW_NODE_TASK"  # set on the per-node tasks dsflow starts with srun
# Set by the train stage for its ranks (read by dsflow.train.runspec).
PLAN_SOURCE_ENV = "DSFLOW_PLAN_SOURCE"  # this node wrote checkpoints/run.json
FINGERPRINT_ENV = "DSFLOW_FINGERPRINT"  # this node's run spec, which node 0's must match
THREADS_ENV = "DSFLOW_THREADS"  # each rank's intra-op and inter-op threads (launch_env)
# train.collective_timeout_s, for the ranks (launch_env), which read it before the run spec.
COLLECTIVE_TIMEOUT_ENV = "DSFLOW_COLLECTIVE_TIMEOUT_S"
# The stage's folder where each rank leaves its heartbeat (rankR.beat) and, should it fail, its
# exception (rankR.error: dsflow.train.health.report_exception).
RANKS_DIR_ENV = "DSFLOW_RANKS_DIR"
LOCALHOST = "127.0.0.1"
JOIN_TIMEOUT_S = 1800  # how long a node's launcher waits for the others at the rendezvous
# SLURM variables a nested srun may inherit (the rest describe the parent step, not the job).
SLURM_IDENTITY = {"SLURM_JOB_ID", "SLURM_JOBID", "SLURM_CLUSTER_NAME", "SLURM_SUBMIT_DIR"}


@dataclass(frozen=True)
class Nodes:
    """The node layout of a run, as seen from this machine."""

    count: int
    rank: int
    master_addr: str | None  # None: DeepSpeed's launcher takes the hostfile's first host
    master_port: int
    rdzv_id: str
    hostfile: Path | None = None

    @property
    def leader(self) -> bool:
        """Node 0: prepares checkpoints/ and run.json, holds checkpoints/.lock."""
        return self.rank == 0


def free_port() -> int:
    """A port nothing listens on now, so two runs on one machine do not collide."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env_int(env: Mapping[str, str], name: str) -> int | None:
    value = env.get(name, "")
    if not value:
        return None
    try:
        return int(value)
    except ValueError:
        raise UsageError(f"${name}: {value!r} is not an integer; fix or unset it") from None


def node_rank(train: dict, env: Mapping[str, str] = os.environ) -> int | None:
    """This machine's node rank: train.node_rank, else $NODE_RANK, else $SLURM_NODEID."""
    if train["nodes"] == 1:
        return 0
    if train["node_rank"] is not None:
        return train["node_rank"]
    rank = _env_int(env, "NODE_RANK")
    return rank if rank is not None else _env_int(env, "SLURM_NODEID")


def log_name(train: dict, env: Mapping[str, str] = os.environ) -> str:
    """The train stage's log, logs/<name>.log: one per node when several nodes share logs/
    (node 0 started by hand, and the stage that starts the nodes under SLURM, keep `train`)."""
    rank = node_rank(train, env) if train["nodes"] > 1 else 0
    if rank is None or (rank == 0 and not env.get(NODE_TASK_ENV)):
        return "train"
    return f"train.node{rank}"


def resolve_nodes(train: dict, ranks_per_node: int, env: Mapping[str, str] = os.environ) -> Nodes:
    """The node layout from train.* (falling back on the launcher's environment), or a one-line
    UsageError naming the key to set."""
    count, launcher = train["nodes"], train["launcher"]
    if count == 1:
        return Nodes(1, 0, LOCALHOST, train["master_port"] or free_port(), "dsflow")
    rank = node_rank(train, env)
    if rank is None:
        if launcher == "deepspeed":
            rank = 0
        else:
            raise UsageError(
                f"train.node_rank: not set for this node of {count}; set it (0..{count - 1}) "
                "or NODE_RANK on each node, or run under SLURM"
            )
    if rank >= count:
        raise UsageError(
            f"train.node_rank: {rank}, but train.nodes is {count} (node ranks are 0..{count - 1})"
        )
    addr = train["master_addr"] or env.get("MASTER_ADDR") or None
    port = train["master_port"] or _env_int(env, "MASTER_PORT")
    rdzv_id = train["rdzv_id"] or env.get("SLURM_JOB_ID") or "dsflow"
    if launcher == "deepspeed":
        if rank != 0:
            raise UsageError(
                f"train.node_rank: {rank}: with train.launcher: deepspeed only node 0 runs the "
                "train stage (DeepSpeed's launcher starts the other nodes over pdsh/ssh)"
            )
        hostfile = check_hostfile(train["hostfile"], count, ranks_per_node)
        return Nodes(count, 0, addr, port or 29500, rdzv_id, hostfile)
    if addr is None:
        raise UsageError(
            f"train.master_addr: needed with train.nodes: {count}: the host of the rendezvous, "
            "reachable from every node (e.g. node 0's hostname), or set MASTER_ADDR"
        )
    if port is None:
        raise UsageError(
            f"train.master_port: needed with train.nodes: {count}: every node must use the same "
            "port (e.g. 29500), or set MASTER_PORT"
        )
    return Nodes(count, rank, addr, port, rdzv_id)


def read_hostfile(path: Path) -> list[tuple[str, int]]:
    """DeepSpeed's hostfile: `host slots=N` per line, `#` comments; [(host, slots)]."""
    hosts = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split()
        slots = parts[1].removeprefix("slots=") if len(parts) == 2 else ""
        if not slots.isdigit() or not parts[1].startswith("slots="):
            raise UsageError(
                f"train.hostfile: {path} line {number}: {line!r} is not `host slots=N`"
            )
        hosts.append((parts[0], int(slots)))
    return hosts


def check_hostfile(hostfile: str | None, nodes: int, ranks_per_node: int) -> Path:
    if not hostfile:
        raise UsageError(
            f"train.hostfile: needed with train.launcher: deepspeed and train.nodes: {nodes}: a "
            "file of `host slots=N` lines, one per node (DeepSpeed's hostfile)"
        )
    path = Path(hostfile)
    if not path.is_file():
        raise UsageError(f"train.hostfile: {hostfile} not found")
    hosts = read_hostfile(path)
    if len(hosts) < nodes:
        raise UsageError(
            f"train.hostfile: {hostfile} lists {len(hosts)} host(s), train.nodes is {nodes}"
        )
    for host, slots in hosts[:nodes]:
        if slots < ranks_per_node:
            raise UsageError(
                f"train.hostfile: {host} has slots={slots}, fewer than train.gpus "
                f"({ranks_per_node}); raise its slots or lower train.gpus"
            )
    return path


def torchrun_command(ranks_per_node: int, port: str, module: str, nodes: Nodes | None = None):
    """torchrun starting `ranks_per_node` local ranks of `python -m module`; with several
    `nodes`, one launcher of the c10d rendezvous (global ranks are assigned when all joined)."""
    head = [sys.executable, "-m", "torch.distributed.run"]
    if nodes is None or nodes.count == 1:
        return [
            *head,
            "--nnodes",
            "1",
            "--nproc_per_node",
            str(ranks_per_node),
            "--master_addr",
            LOCALHOST,
            "--master_port",
            port,
            "-m",
            module,
        ]
    return [
        *head,
        "--nnodes",
        str(nodes.count),
        "--nproc_per_node",
        str(ranks_per_node),
        "--rdzv_backend",
        "c10d",
        "--rdzv_endpoint",
        f"{nodes.master_addr}:{nodes.master_port}",
        "--rdzv_id",
        nodes.rdzv_id,
        # node 0 checks every shard's sha256 before it joins: give it time on big data
        "--rdzv_conf",
        f"join_timeout={JOIN_TIMEOUT_S}",
        "--max_restarts",
        "0",
        "-m",
        module,
    ]


def deepspeed_command(ranks_per_node: int, nodes: Nodes, module: str) -> list[str]:
    """DeepSpeed's launcher: on one node it forks the ranks; with a hostfile it starts every
    node's ranks over pdsh (or ssh), from node 0."""
    cmd = [sys.executable, "-m", "deepspeed.launcher.runner"]
    if nodes.count > 1:
        cmd += ["--hostfile", str(nodes.hostfile), "--num_nodes", str(nodes.count)]
        if nodes.master_addr:
            cmd += ["--master_addr", nodes.master_addr]
    return [
        *cmd,
        "--num_gpus",
        str(ranks_per_node),
        "--master_port",
        str(nodes.master_port),
        "--module",
        module,
    ]


def command(train: dict, ranks_per_node: int, nodes: Nodes, module: str):
    if train["launcher"] == "deepspeed":
        return deepspeed_command(ranks_per_node, nodes, module)
    return torchrun_command(ranks_per_node, str(nodes.master_port), module, nodes)


def slurm_fanout(train: dict, env: Mapping[str, str] = os.environ) -> bool:
    """Whether this train stage was started once in a SLURM allocation for a multi-node run,
    and so must start itself once per node (srun) instead of launching ranks."""
    nodes = train["nodes"]
    if nodes == 1 or train["launcher"] != "torchrun" or not env.get("SLURM_JOB_ID"):
        return False
    if env.get(NODE_TASK_ENV) or train["node_rank"] is not None or env.get("NODE_RANK"):
        return False
    # Already one task per node (the user's own `srun --ntasks-per-node=1 ...`).
    step = (env.get("SLURM_STEP_NUM_NODES"), env.get("SLURM_STEP_NUM_TASKS"))
    return step != (str(nodes), str(nodes))


def slurm_command(train: dict, ranks_per_node: int, device: str) -> list[str]:
    """srun running the train stage once on each of train.nodes nodes. --overlap: the step
    Snakemake's SLURM executor runs this stage in may hold this node's CPUs and GPUs."""
    nodes = train["nodes"]
    cmd = [
        "srun",
        "--overlap",
        f"--nodes={nodes}",
        f"--ntasks={nodes}",
        "--ntasks-per-node=1",
        "--kill-on-bad-exit=1",
    ]
    if device == "cuda":
        cmd.append(f"--gpus-per-node={ranks_per_node}")
    return [*cmd, sys.executable, "-m", "dsflow", "train"]


def slurm_env(train: dict, params_json: str, env: Mapping[str, str] = os.environ) -> dict:
    """The environment of the per-node tasks: the params this stage validated, the rendezvous
    on this (the first) node, and no SLURM settings of the step this stage runs in."""
    out = {
        k: v
        for k, v in env.items()
        if not (k.startswith(("SLURM_", "SRUN_", "SBATCH_")) and k not in SLURM_IDENTITY)
    }
    out[NODE_TASK_ENV] = "1"
    out["DSFLOW_CONFIG"] = params_json
    out["MASTER_ADDR"] = train["master_addr"] or env.get("MASTER_ADDR") or socket.gethostname()
    out["MASTER_PORT"] = str(train["master_port"] or env.get("MASTER_PORT") or free_port())
    return out


def threads_per_rank(train: dict, local_ranks: int) -> int:
    """train.threads_per_rank; auto: this process's cores shared evenly by the node's ranks
    (more threads than cores would make every rank slower)."""
    setting = train.get("threads_per_rank", "auto")
    if setting != "auto":
        return setting
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    return max(1, cores // local_ranks)


def rank_threads(env: Mapping[str, str] = os.environ, train: dict | None = None) -> int:
    """In a rank: the thread count its stage chose (launch_env). DeepSpeed's pdsh launcher
    passes on only some variables, so a rank it started elsewhere takes `train`'s setting (auto
    when None) for its node; so does a stage that evaluates in its own process."""
    value = env.get(THREADS_ENV)
    local = int(env.get("LOCAL_WORLD_SIZE", 1))
    return int(value) if value else threads_per_rank(train or {}, local)


def exit_rank(code: int) -> None:
    """A rank's exit. Once it is done (0), without the interpreter's teardown: its outputs are
    written and closed, its process group destroyed and its checkpoint writes waited for, and
    tearing down torch, DeepSpeed and transformers took 2.4 s of three CPU ranks on two cores
    at the end of every stage. Any other code leaves as usual."""
    if code != 0:
        sys.exit(code)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).fflush(None)  # what C libraries printed (DeepSpeed's ops) too
    os._exit(0)


def set_rank_threads(train: dict | None = None) -> int:
    """In a rank, before any parallel work: torch's intra-op and inter-op threads from
    rank_threads. Inter-op threads can be set once per process, before inter-op work starts:
    a second call (an evaluation run twice in one process) leaves them as they are."""
    import torch  # only ranks call this; the stages import this module without torch

    threads = rank_threads(train=train)
    torch.set_num_threads(threads)
    if torch.get_num_interop_threads() != threads:
        with contextlib.suppress(RuntimeError):
            torch.set_num_interop_threads(threads)
    return threads


def launch_env(spec: dict) -> dict:
    """The ranks' environment for run spec `spec` (device, world, local_ranks, params)."""
    env = dict(os.environ)
    local = spec.get("local_ranks", spec["world"])
    env["DSFLOW_DEVICE"] = spec["device"]
    if spec["device"] == "cpu":
        env["DS_ACCELERATOR"] = "cpu"
        env["CUDA_VISIBLE_DEVICES"] = ""
    # Set, not defaulted: front-ends leave their own counts (Snakemake its job's cores, torchrun
    # 1), and a reduction split over other thread counts sums in another order: another model.
    threads = str(threads_per_rank(spec["params"]["train"], local))
    env.update({THREADS_ENV: threads, "OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads})
    timeout = spec["params"]["train"].get("collective_timeout_s")
    if timeout is not None:
        env[COLLECTIVE_TIMEOUT_ENV] = str(timeout)
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    # Segments that grow in place instead of new blocks per size: ZeRO's buckets and gradient
    # accumulation at a small micro batch otherwise leave gigabytes reserved but unused (the
    # planner plans allocations; torchtitan sets the same). A user's own setting stays.
    env.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    return env


# --------------------------------------------------------------------------- what the ranks read

# Bytes per element of safetensors' dtypes (a dtype not listed is not size-checked).
SAFETENSORS_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "U64": 8, "I32": 4}
SAFETENSORS_BYTES |= {"U32": 4, "I16": 2, "U16": 2, "I8": 1, "U8": 1, "BOOL": 1}
SAFETENSORS_BYTES |= {"F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1}
SAFETENSORS_MAX_HEADER = 100_000_000  # safetensors' own limit


def check_tokenizer(folder: Path, fix: str) -> None:
    """The tokenizer the ranks load (AutoTokenizer.from_pretrained(folder)) is there and loads;
    else one line naming the folder or its missing tokenizer.json, and `fix`."""
    if not (folder / "tokenizer.json").is_file():
        raise UsageError(f"{folder}/tokenizer.json: missing; {fix}")
    from transformers import AutoTokenizer

    try:
        AutoTokenizer.from_pretrained(folder)
    except Exception as exc:  # noqa: BLE001 - bad JSON, a missing vocabulary, ...
        detail = " ".join(str(exc).split())[:300]
        raise UsageError(
            f"{folder}: the tokenizer does not load ({type(exc).__name__}: {detail}); {fix}"
        ) from None


def safetensors_header(path: Path, fix: str) -> dict[str, list[int]]:
    """{tensor: shape} from a safetensors file's header (its first 8 + N bytes: no tensor is
    read). One line naming the file when the header does not parse, a tensor's byte range does
    not match its shape, or the file is not as long as the header says (truncated, e.g. an
    interrupted download)."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        length = int.from_bytes(head, "little") if len(head) == 8 else -1
        if not 0 < length <= min(size - 8, SAFETENSORS_MAX_HEADER):
            raise UsageError(f"{path}: {size} bytes, too short for its header (truncated); {fix}")
        try:
            header = json.loads(f.read(length))
        except (ValueError, UnicodeDecodeError):
            header = None
    if not isinstance(header, dict):
        raise UsageError(f"{path}: its header is not a safetensors header (damaged); {fix}")
    end, shapes = 0, {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            start, stop = (int(x) for x in entry["data_offsets"])
            shape = [int(d) for d in entry["shape"]]
            width = SAFETENSORS_BYTES.get(entry["dtype"])
        except (KeyError, TypeError, ValueError):
            raise UsageError(f"{path}: tensor {name}: malformed header entry; {fix}") from None
        if width is not None and stop - start != width * math.prod(shape):
            raise UsageError(
                f"{path}: tensor {name}: {stop - start} bytes for shape {tuple(shape)} of "
                f"{entry['dtype']} (damaged); {fix}"
            )
        end, shapes[name] = max(end, stop), shape
    if size != 8 + length + end:
        what = "truncated" if size < 8 + length + end else "trailing bytes"
        raise UsageError(
            f"{path}: {size} bytes, its header describes {8 + length + end} ({what}); {fix}"
        )
    return shapes


def checkpoint_names(name: str, shape: tuple) -> dict[str, tuple]:
    """The tensors (name -> shape) a checkpoint may hold for model tensor `name`: itself, and
    for transformers 5's fused routed experts (experts.gate_up_proj [E, 2I, H], experts.down_proj
    [E, H, I]) the per-expert weights save_pretrained writes (experts.e.gate_proj.weight [I, H],
    up_proj [I, H], down_proj [H, I])."""
    names = {name: tuple(shape)}
    base, _, last = name.rpartition(".")
    if base.endswith(".experts") and len(shape) == 3:
        experts, rows, cols = shape
        if last == "gate_up_proj":
            for e in range(experts):
                for part in ("gate_proj", "up_proj"):
                    names[f"{base}.{e}.{part}.weight"] = (rows // 2, cols)
        elif last == "down_proj":
            names |= {f"{base}.{e}.down_proj.weight": (rows, cols) for e in range(experts)}
    return names


def safetensors_files(folder: Path) -> list[str]:
    """The safetensors files from_pretrained reads in `folder`: the index's shards, else
    model.safetensors."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            return sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            raise UsageError(
                f"{index}: not a safetensors index (damaged); download or write that folder again"
            ) from None
    return ["model.safetensors"] if (folder / "model.safetensors").is_file() else []


def check_tensor_shapes(folder: Path, files: list[str], config: Any, fix: str) -> None:
    """Every tensor of the checkpoint in `folder` (safetensors `files`) that the model `config`
    makes has the shape the model wants (the model built on the meta device: no memory, no
    weight read); a checkpoint of the bare model (no `model.` prefix) counts too. A tensor the
    checkpoint lacks is left to the load, which names it."""
    import torch
    from transformers import AutoModelForCausalLM

    held: dict[str, tuple[str, list[int]]] = {}
    for file in files:
        for name, shape in safetensors_header(folder / file, fix).items():
            held[name] = (file, shape)
    with torch.device("meta"):
        net = AutoModelForCausalLM.from_config(config)
    for key, tensor in net.state_dict().items():
        for name, want in checkpoint_names(key, tuple(tensor.shape)).items():
            found = held.get(name) or held.get(name.removeprefix("model."))
            if found and tuple(found[1]) != want:
                raise UsageError(
                    f"{folder / found[0]}: tensor {name} has shape {tuple(found[1])}, but the "
                    f"config.json beside it makes {want}; {fix}"
                )


# --------------------------------------------------------------------------- hung ranks

# A rank's heartbeat: when it last moved, its PID, its step, how many of the loop's marks it
# passed in that step (the same sequence on every rank), and whether the watchdog may judge it.
BEAT = struct.Struct("<dqqqq")
STOP_GRACE_S = 10  # after SIGTERM to a job the stage stops, how long before SIGKILL


# Start-up, checkpoint saves and the final export may keep the ranks apart for long (one rank
# loads or writes what the others do not): there a rank waits this long for its peers.
PATIENT_TIMEOUT_S = 1800


def collective_timeout_s(env: Mapping[str, str] = os.environ) -> float:
    """In a rank: train.collective_timeout_s as its stage passed it (300 s when not told)."""
    return float(env.get(COLLECTIVE_TIMEOUT_ENV) or 300)


class Heartbeat:
    """A rank's progress, for the stage's Watchdog: rankR.beat in $DSFLOW_RANKS_DIR, a few
    bytes rewritten in place through mmap at every mark of the training loop (no system call).
    Written from the rank's start (its PID is how the stage stops it), judged once `armed`
    (after the run's first step: before that, start-up may keep ranks apart for long)."""

    def __init__(self, path: Path):
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.ftruncate(fd, BEAT.size)
            self.map = mmap.mmap(fd, BEAT.size)
        finally:
            os.close(fd)
        self.pid, self.step, self.marks, self.armed = os.getpid(), 0, 0, False
        self.beat()

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> Heartbeat | None:
        folder = env.get(RANKS_DIR_ENV)
        if not folder or not Path(folder).is_dir():
            return None
        return cls(Path(folder) / f"rank{int(env.get('RANK', 0))}.beat")

    def step_begins(self, step: int) -> None:
        self.step, self.marks = step, 0
        self.beat()

    def arm(self) -> None:
        self.armed = True
        self.beat()

    def beat(self) -> None:
        self.marks += 1
        BEAT.pack_into(self.map, 0, time.time(), self.pid, self.step, self.marks, self.armed)


@dataclass(frozen=True)
class RankBeat:
    rank: int
    time: float
    pid: int
    step: int
    marks: int
    armed: bool

    @property
    def progress(self) -> tuple[int, int]:
        return self.step, self.marks


def read_beats(folder: Path) -> dict[int, RankBeat]:
    """The ranks' last heartbeats in `folder` (a torn read, read twice and different, is
    skipped: the next poll reads it)."""
    beats = {}
    for path in folder.glob("rank*.beat"):
        try:
            first, again = path.read_bytes(), path.read_bytes()
            rank = int(path.stem.removeprefix("rank"))
        except (OSError, ValueError):
            continue
        if first == again and len(first) == BEAT.size:
            t, pid, step, marks, armed = BEAT.unpack(first)
            beats[rank] = RankBeat(rank, t, pid, step, marks, bool(armed))
    return beats


def process_state(pid: int) -> str | None:
    """The kernel's one-letter state of `pid` (T: stopped, R, S, D, Z), None when gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[-1].split()[0]


def is_rank(pid: int, module: str) -> bool:
    """Whether `pid` still runs `python -m module` (a PID the heartbeat named may be reused)."""
    try:
        return module in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    except OSError:
        return False


class Watchdog:
    """The stage's view of its ranks' heartbeats (Heartbeat). A rank is hung when, in training
    (some rank armed), it has not moved for `timeout_s` and either its peers got further (they
    then wait for it in a collective) or its process is stopped (SIGSTOP, a debugger)."""

    def __init__(self, folder: Path, timeout_s: float, module: str):
        self.folder, self.timeout_s, self.module = folder, timeout_s, module

    def pids(self) -> list[int]:
        return [b.pid for b in read_beats(self.folder).values()]

    def hung(self, now: float | None = None) -> str | None:
        """One line naming the hung rank(s) and what the others did; None when none is."""
        now = time.time() if now is None else now
        beats = read_beats(self.folder)
        if not any(b.armed for b in beats.values()):
            return None
        ahead = max(b.progress for b in beats.values())
        stuck = [
            b
            for b in sorted(beats.values(), key=lambda b: b.rank)
            if now - b.time > self.timeout_s
            and (b.progress < ahead or process_state(b.pid) in ("T", "t"))
        ]
        if not stuck:
            return None
        b = stuck[0]
        state = " (its process is stopped)" if process_state(b.pid) in ("T", "t") else ""
        others = [o for o in beats.values() if o.rank != b.rank]
        peers = f"; the other rank(s) reached step {max(o.step for o in others)}" if others else ""
        more = f" (and rank(s) {', '.join(str(o.rank) for o in stuck[1:])})" if stuck[1:] else ""
        return (
            f"rank {b.rank} (PID {b.pid}){more} made no progress for {now - b.time:.0f} s in "
            f"step {b.step}{state}{peers} (train.collective_timeout_s: {self.timeout_s:g})"
        )

    def unheeded(self, since: float, now: float | None = None) -> str | None:
        """Once a stop was requested at `since`: one line when no rank has moved for
        `timeout_s` since (the ranks cannot reach the step boundary to checkpoint)."""
        now = time.time() if now is None else now
        beats = read_beats(self.folder)
        moved = max([since, *(b.time for b in beats.values())])
        if now - moved <= self.timeout_s:
            return None
        last = min(beats.values(), key=lambda b: (b.progress, b.rank), default=None)
        where = (
            f" (rank {last.rank}, PID {last.pid}, last moved in step {last.step})" if last else ""
        )
        return (
            f"the ranks did not reach a step boundary within {self.timeout_s:g} s of the stop "
            f"request{where}"
        )


def stop_job(proc: subprocess.Popen, pids: list[int], module: str) -> None:
    """Stop the launcher `proc` and its ranks (`pids`, in process groups of their own: setsid):
    SIGTERM to the launcher's process group, SIGKILL to it and every rank still there after
    STOP_GRACE_S. Checkpoints are atomic: the last complete one stays."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=STOP_GRACE_S)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    for pid in pids:
        if is_rank(pid, module):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
    proc.wait()


# --------------------------------------------------------------------------- running the launcher


def die_with_parent():
    """preexec_fn for the launcher: SIGTERM it when this process dies, even by SIGKILL (Linux),
    so a killed stage never leaves ranks running (they checkpoint and stop)."""
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    parent = os.getpid()

    def setup():
        prctl(1, signal.SIGTERM, 0, 0, 0)  # PR_SET_PDEATHSIG
        if os.getppid() != parent:
            os.kill(os.getpid(), signal.SIGTERM)

    return setup


class SignalForwarder:
    """While the ranks run: the first SIGTERM / SIGINT asks them (`stop_file`, checkpoints/.stop)
    to save a checkpoint at the next step boundary and stop; a second one stops the launcher at
    once."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self, stop_file: Path):
        self.stop_file = stop_file
        self.received: list[int] = []
        self.proc: subprocess.Popen | None = None
        self.previous: dict = {}
        self.first_at: float | None = None  # when the first signal came

    def __enter__(self) -> SignalForwarder:
        for sig in self.SIGNALS:
            self.previous[sig] = signal.signal(sig, self.handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)

    def handle(self, signum, frame) -> None:
        self.received.append(signum)
        self.first_at = self.first_at or time.time()
        name = signal.Signals(signum).name
        if len(self.received) == 1:
            with contextlib.suppress(OSError):
                self.stop_file.touch()
            print(
                f"[dsflow train] {name}: the ranks checkpoint at the next step boundary and stop "
                "(send it again to stop at once)",
                file=sys.stderr,
                flush=True,
            )
        elif self.proc is not None and self.proc.poll() is None:
            print(
                f"[dsflow train] {name} again: stopping the launcher", file=sys.stderr, flush=True
            )
            self.proc.send_signal(signal.SIGTERM)


def wait(proc: subprocess.Popen) -> int:
    """proc's exit code; when this process is interrupted meanwhile, SIGTERM it first."""
    try:
        return proc.wait()
    except BaseException:
        proc.send_signal(signal.SIGTERM)
        proc.wait()
        raise


POLL_S = 1.0  # how often the stage looks at its ranks' heartbeats


def supervise(proc: subprocess.Popen, forwarder: SignalForwarder, watch: Watchdog) -> str | None:
    """Wait for the launcher `proc`; stop the job when the watchdog finds a hung rank, or when
    a stop request (the first signal) finds no rank moving for the timeout. None when the
    launcher exited by itself, else why it was stopped (one line)."""
    while True:
        try:
            proc.wait(timeout=POLL_S)
            return None
        except subprocess.TimeoutExpired:
            pass
        reason = watch.hung()
        if reason is None and forwarder.first_at is not None:
            reason = watch.unheeded(forwarder.first_at)
        if reason:
            stop_job(proc, watch.pids(), watch.module)
            return reason


def run_launcher(
    cmd: list[str],
    env: dict,
    stop_file: Path,
    lock: Any = None,
    output: int | None = None,
    watch: Watchdog | None = None,
) -> tuple[int, list, str | None]:
    """Start the launcher `cmd` and wait for it, forwarding SIGTERM / SIGINT (SignalForwarder);
    (its exit code, the signals this process received, why this process stopped it: a hung rank
    or an unheeded stop request, else None). `lock` (checkpoints/.lock, held by node 0) is
    handed to the launcher, which holds it until its ranks are gone. `output`: where the
    launcher and its ranks print (progress.child_output), else this process's stdout and stderr.
    `watch`: the ranks' heartbeats (Watchdog); without it no hang is looked for."""
    with SignalForwarder(stop_file) as forwarder:
        # A new process group: a terminal's Ctrl-C reaches this process only, which turns it into
        # a checkpoint-and-stop request instead of the launcher's 30 s kill timer.
        proc = subprocess.Popen(
            cmd,
            env=env,
            start_new_session=True,
            preexec_fn=die_with_parent(),
            pass_fds=(lock.fd,) if lock else (),
            stdout=output,
            stderr=output,
        )
        forwarder.proc = proc
        if lock:
            lock.write_holder(f"{os.getpid()}, launcher {proc.pid}")
        stopped = None
        if watch is None:
            code = wait(proc)
        else:
            try:
                stopped = supervise(proc, forwarder, watch)
            except BaseException:
                proc.send_signal(signal.SIGTERM)
                proc.wait()
                raise
            code = proc.returncode
    return code, forwarder.received, stopped
