"""dsflow.launch: node layout, launcher commands and the SLURM fan-out (no ranks started)."""

from __future__ import annotations

import sys

import pytest
import yaml

from conftest import ROOT, dsflow, update_params
from dsflow import checks, launch
from dsflow import params as params_mod
from dsflow.errors import UsageError
from dsflow.plan import request


def train_params(**overrides) -> dict:
    raw = yaml.safe_load((ROOT / "params.yaml").read_text())
    return params_mod.validate(params_mod.deep_merge(raw, {"train": overrides}))["train"]


def fails(train, env=None, ranks=2) -> str:
    with pytest.raises(UsageError) as exc:
        launch.resolve_nodes(train, ranks, env or {})
    msg = str(exc.value)
    assert "\n" not in msg
    return msg


def test_one_node_is_localhost_and_ignores_the_environment():
    nodes = launch.resolve_nodes(train_params(master_port=29999), 3, {"NODE_RANK": "5"})
    assert (nodes.count, nodes.rank, nodes.master_addr, nodes.master_port) == (
        1,
        0,
        "127.0.0.1",
        29999,
    )
    assert launch.torchrun_command(3, "29999", "dsflow.train.loop")[3:] == [
        "--nnodes",
        "1",
        "--nproc_per_node",
        "3",
        "--master_addr",
        "127.0.0.1",
        "--master_port",
        "29999",
        "-m",
        "dsflow.train.loop",
    ]


THREAD_VARS = (launch.THREADS_ENV, "OMP_NUM_THREADS", "MKL_NUM_THREADS")


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_rank_threads_come_from_params_whatever_the_front_end_sets(monkeypatch, device):
    # Snakemake leaves its job's cores in OMP_NUM_THREADS, torchrun 1: neither decides.
    monkeypatch.setenv("OMP_NUM_THREADS", "7")
    monkeypatch.setenv("MKL_NUM_THREADS", "7")
    train = train_params(threads_per_rank=3)
    env = launch.launch_env({"device": device, "world": 2, "params": {"train": train}})
    assert {k: env[k] for k in THREAD_VARS} == dict.fromkeys(THREAD_VARS, "3")
    assert launch.rank_threads(env) == 3


def test_auto_threads_share_the_cores_among_one_node_ranks(monkeypatch):
    monkeypatch.setattr(launch.os, "sched_getaffinity", lambda pid: set(range(16)))
    monkeypatch.setenv("OMP_NUM_THREADS", "16")
    auto = {"device": "cpu", "params": {"train": train_params()}}
    assert launch.launch_env({**auto, "world": 6, "local_ranks": 3})["OMP_NUM_THREADS"] == "5"
    assert launch.launch_env({**auto, "world": 32})["OMP_NUM_THREADS"] == "1"
    # A rank whose launcher passed no count on (DeepSpeed's pdsh) takes auto's for its node.
    assert launch.rank_threads({"LOCAL_WORLD_SIZE": "4", "OMP_NUM_THREADS": "16"}) == 4


def test_torchrun_nodes_meet_at_a_c10d_rendezvous():
    train = train_params(nodes=2, master_addr="node0", master_port=29500, rdzv_id="run7")
    nodes = launch.resolve_nodes(train, 4, {"NODE_RANK": "1"})
    assert (nodes.count, nodes.rank, nodes.leader) == (2, 1, False)
    cmd = launch.command(train, 4, nodes, "dsflow.train.loop")
    assert cmd[:3] == [sys.executable, "-m", "torch.distributed.run"]
    args = " ".join(cmd[3:])
    assert args == (
        "--nnodes 2 --nproc_per_node 4 --rdzv_backend c10d --rdzv_endpoint node0:29500 "
        "--rdzv_id run7 --rdzv_conf join_timeout=1800 --max_restarts 0 -m dsflow.train.loop"
    )


def test_node_rank_and_rendezvous_come_from_the_environment():
    train = train_params(nodes=3)
    env = {"SLURM_NODEID": "2", "SLURM_JOB_ID": "991", "MASTER_ADDR": "n0", "MASTER_PORT": "4000"}
    nodes = launch.resolve_nodes(train, 8, env)
    assert (nodes.rank, nodes.master_addr, nodes.master_port, nodes.rdzv_id) == (
        2,
        "n0",
        4000,
        "991",
    )
    # NODE_RANK wins over SLURM_NODEID, train.node_rank over both
    assert launch.resolve_nodes(train, 8, {**env, "NODE_RANK": "1"}).rank == 1
    assert launch.resolve_nodes(train_params(nodes=3, node_rank=0), 8, env).leader


def test_each_node_but_the_first_logs_to_its_own_file():
    assert launch.log_name(train_params(), {"NODE_RANK": "1"}) == "train"
    two = train_params(nodes=2)
    assert launch.log_name(two, {"NODE_RANK": "0"}) == "train"
    assert launch.log_name(two, {"NODE_RANK": "1"}) == "train.node1"
    assert launch.log_name(two, {"SLURM_JOB_ID": "5"}) == "train"  # starts the nodes with srun
    task = {"SLURM_NODEID": "0", launch.NODE_TASK_ENV: "1"}
    assert launch.log_name(two, task) == "train.node0"


@pytest.mark.parametrize(
    "overrides, env, key, fix",
    [
        ({"nodes": 2}, {"MASTER_ADDR": "a", "MASTER_PORT": "1"}, "train.node_rank", "NODE_RANK"),
        ({"nodes": 2, "node_rank": 2}, {}, "train.node_rank", "0..1"),
        (
            {"nodes": 2, "node_rank": 0, "master_port": 29500},
            {},
            "train.master_addr",
            "MASTER_ADDR",
        ),
        ({"nodes": 2, "node_rank": 0, "master_addr": "n0"}, {}, "train.master_port", "29500"),
        ({"nodes": 2}, {"NODE_RANK": "x"}, "$NODE_RANK", "not an integer"),
    ],
)
def test_incomplete_multi_node_settings_name_the_key(overrides, env, key, fix):
    msg = fails(train_params(**overrides), env)
    assert msg.startswith(key) and fix in msg


def test_deepspeed_launcher_uses_a_hostfile_from_node_0(tmp_path):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("# the cluster\nnode-a slots=8\nnode-b slots=8\n")
    train = train_params(launcher="deepspeed", nodes=2, master_port=29400, hostfile=str(hostfile))
    nodes = launch.resolve_nodes(train, 8, {})
    assert nodes.rank == 0 and nodes.master_addr is None  # DeepSpeed: the hostfile's first host
    assert launch.command(train, 8, nodes, "dsflow.train.loop")[1:] == [
        "-m",
        "deepspeed.launcher.runner",
        "--hostfile",
        str(hostfile),
        "--num_nodes",
        "2",
        "--num_gpus",
        "8",
        "--master_port",
        "29400",
        "--module",
        "dsflow.train.loop",
    ]
    named = launch.resolve_nodes({**train, "master_addr": "10.0.0.1"}, 8, {})
    cmd = launch.command(train, 8, named, "dsflow.train.loop")
    assert cmd[cmd.index("--master_addr") + 1] == "10.0.0.1"
    # one node: DeepSpeed forks the local ranks, no hostfile
    one = train_params(launcher="deepspeed", master_port=29400)
    assert "--hostfile" not in launch.command(
        one, 3, launch.resolve_nodes(one, 3, {}), "dsflow.train.loop"
    )


def test_bad_hostfiles_are_one_line_naming_train_hostfile(tmp_path):
    hostfile = tmp_path / "hostfile"
    base = {"launcher": "deepspeed", "nodes": 2, "hostfile": str(hostfile)}
    assert "not found" in fails(train_params(**base))
    hostfile.write_text("node-a slots=8\n")
    assert "lists 1 host(s), train.nodes is 2" in fails(train_params(**base), ranks=8)
    hostfile.write_text("node-a slots=8\nnode-b slots=4\n")
    assert "node-b has slots=4, fewer than train.gpus (8)" in fails(train_params(**base), ranks=8)
    hostfile.write_text("node-a slots=8\nnode-b 8\n")
    assert "line 2" in fails(train_params(**base), ranks=8)
    msg = fails(train_params(launcher="deepspeed", nodes=2))
    assert msg.startswith("train.hostfile: needed")
    msg = fails(train_params(**base, node_rank=1), ranks=8)
    assert msg.startswith("train.node_rank: 1") and "only node 0" in msg


def test_slurm_runs_the_stage_once_per_node():
    train = train_params(nodes=2)
    batch = {"SLURM_JOB_ID": "77", "SLURM_STEP_NUM_NODES": "1", "SLURM_STEP_NUM_TASKS": "1"}
    assert launch.slurm_fanout(train, batch)
    assert not launch.slurm_fanout(train_params(), batch)  # one node
    assert not launch.slurm_fanout(train, {})  # not in SLURM
    assert not launch.slurm_fanout(train, {**batch, launch.NODE_TASK_ENV: "1"})  # a node's task
    # the user's own `srun --nodes 2 --ntasks-per-node 1 python -m dsflow train`
    assert not launch.slurm_fanout(
        train, {**batch, "SLURM_STEP_NUM_NODES": "2", "SLURM_STEP_NUM_TASKS": "2"}
    )
    assert launch.slurm_command(train, 4, "cuda") == [
        "srun",
        "--overlap",
        "--nodes=2",
        "--ntasks=2",
        "--ntasks-per-node=1",
        "--kill-on-bad-exit=1",
        "--gpus-per-node=4",
        sys.executable,
        "-m",
        "dsflow",
        "train",
    ]
    env = launch.slurm_env(
        train, "{}", {**batch, "SLURM_GPUS": "4", "SRUN_CPUS_PER_TASK": "8", "PATH": "/bin"}
    )
    assert env["SLURM_JOB_ID"] == "77" and env["PATH"] == "/bin"
    assert not {"SLURM_GPUS", "SLURM_STEP_NUM_NODES", "SRUN_CPUS_PER_TASK"} & set(env)
    assert env[launch.NODE_TASK_ENV] == "1" and env["DSFLOW_CONFIG"] == "{}"
    assert env["MASTER_ADDR"] and 1024 <= int(env["MASTER_PORT"]) <= 65535


def test_train_stage_refuses_an_incomplete_multi_node_run(prepared, tmp_path):
    import shutil

    repo = tmp_path / "repo"
    shutil.copytree(prepared, repo)
    update_params(repo, {"train": {"device": "cpu", "gpus": 2, "nodes": 2, "node_rank": 1}})
    proc = dsflow("train", cwd=repo, check=False)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == (
        "dsflow train: error: train.master_addr: needed with train.nodes: 2: the host of the "
        "rendezvous, reachable from every node (e.g. node 0's hostname), or set MASTER_ADDR"
    )
    assert not (repo / "checkpoints").exists()


def test_plan_and_doctor_count_the_ranks_of_every_node(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    params = params_mod.validate(
        params_mod.deep_merge(
            yaml.safe_load((ROOT / "params.yaml").read_text()),
            {"train": {"device": "cuda", "gpus": 4, "nodes": 2}},
        )
    )
    h100 = {"name": "NVIDIA H100 80GB HBM3", "total_memory": 80 * 10**9}
    req = request.resolve(params, None, gpus=[h100] * 4)
    assert req.world == 8  # ZeRO partitions over 2 nodes x 4 GPUs
    assert request.resolve(params, None, world=3, gpus=[h100] * 4).world == 3
    seen = []
    monkeypatch.setattr(checks, "plan_for", lambda facts, p, world: seen.append(world) or {})
    monkeypatch.setattr(checks, "_resource_checks", lambda *a: [])
    facts = {"gpu_count": 4, "gpus": [{**h100, "index": i} for i in range(4)], "env": {}}
    found = {c.name: c for c in checks.diagnose(facts, params)}
    assert seen == [8]
    assert found["infiniband"].status == checks.WARN and "TCP" in found["infiniband"].detail


def test_evaluate_runs_in_one_process_on_cpu_and_on_the_train_ranks_on_gpus(monkeypatch):
    """evaluate.ranks auto: CPU ranks would share the same cores, each paying the imports, so
    the stage evaluates in its own process there; on GPUs it takes the train stage's ranks."""
    from dsflow import evaluate, machine

    raw = yaml.safe_load((ROOT / "params.yaml").read_text())

    def ranks(train: dict, evaluate_: dict) -> tuple[str, int]:
        merged = params_mod.deep_merge(raw, {"train": train, "evaluate": evaluate_})
        return evaluate.ranks(params_mod.validate(merged))

    monkeypatch.setattr(machine, "gpus", lambda: [])
    assert ranks({"gpus": 3}, {}) == ("cpu", 1)
    assert ranks({"gpus": 3}, {"ranks": 2}) == ("cpu", 2)
    monkeypatch.setattr(machine, "gpus", lambda: [{"index": i} for i in range(3)])
    assert ranks({"gpus": 2}, {}) == ("cuda", 2)
    assert ranks({"gpus": "auto"}, {"ranks": "auto"}) == ("cuda", 3)
    assert ranks({"gpus": 1}, {"ranks": 3}) == ("cuda", 3)
    with pytest.raises(UsageError) as exc:
        ranks({"gpus": 3}, {"ranks": 4})
    assert str(exc.value).startswith("evaluate.ranks: 4 ranks but 3 GPUs visible; set")


@pytest.mark.parametrize("code", [0, 3])
def test_a_finished_rank_exits_without_the_interpreters_teardown(tmp_path, code):
    """exit_rank(0): what the rank printed and logged arrives, the teardown (here an atexit
    handler) does not run; another code exits as usual, teardown included."""
    import subprocess

    script = (
        "import atexit, logging, pathlib, sys\n"
        "from dsflow import launch\n"
        f"atexit.register(lambda: pathlib.Path({str(tmp_path / 'torn')!r}).touch())\n"
        f"logging.basicConfig(filename={str(tmp_path / 'log')!r})\n"
        "logging.warning('logged')\n"
        "print('printed', end='')\n"
        "import ctypes; ctypes.CDLL(None).printf(b'from C')\n"
        f"launch.exit_rank({code})\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert (proc.returncode, proc.stdout) == (code, "printedfrom C")
    assert "logged" in (tmp_path / "log").read_text()
    assert (tmp_path / "torn").exists() == (code != 0)
