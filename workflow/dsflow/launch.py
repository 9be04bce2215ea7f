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
import os
import signal
import socket
import subprocess
import sys
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
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    # Segments that grow in place instead of new blocks per size: ZeRO's buckets and gradient
    # accumulation at a small micro batch otherwise leave gigabytes reserved but unused (the
    # planner plans allocations; torchtitan sets the same). A user's own setting stays.
    env.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    return env


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

    def __enter__(self) -> SignalForwarder:
        for sig in self.SIGNALS:
            self.previous[sig] = signal.signal(sig, self.handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)

    def handle(self, signum, frame) -> None:
        self.received.append(signum)
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


def run_launcher(
    cmd: list[str], env: dict, stop_file: Path, lock: Any = None, output: int | None = None
) -> tuple[int, list]:
    """Start the launcher `cmd` and wait for it, forwarding SIGTERM / SIGINT (SignalForwarder);
    (its exit code, the signals this process received). `lock` (checkpoints/.lock, held by node
    0) is handed to the launcher, which holds it until its ranks are gone. `output`: where the
    launcher and its ranks print (progress.child_output), else this process's stdout and stderr."""
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
        code = wait(proc)
    return code, forwarder.received
