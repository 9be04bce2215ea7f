"""Machine check (dsflow.doctor, dsflow.checks, dsflow.machine): real CPU-only facts, and the
decision logic on faked facts."""

from __future__ import annotations

import copy

import pytest
import torch

from conftest import ROOT
from dsflow import checks, doctor, machine
from dsflow import params as params_mod
from dsflow.errors import UsageError

GB = 10**9
MIB = 2**20


def _params(*profiles: str, **train) -> dict:
    params = params_mod.load(ROOT / "params.yaml", overlays=[str(ROOT / p) for p in profiles])
    params["train"].update(train)
    return params


def _facts(names, memory, *, p2p=True, ib=(), env=None, disk=10_000 * GB, ram=512 * GB):
    n = len(names)
    return {
        "cuda_available": n > 0,
        "gpu_count": n,
        "gpus": [{"index": i, "name": nm, "total_memory": memory} for i, nm in enumerate(names)],
        "p2p": [
            {"a": i, "b": j, "p2p": p2p if isinstance(p2p, bool) else (i, j) not in p2p}
            for i in range(n)
            for j in range(i + 1, n)
        ],
        "torch_version": "2.13.0",
        "cuda_version": "12.8" if n else None,
        "nccl_version": "2.27.3" if n else None,
        "nvidia_smi": "/usr/bin/nvidia-smi" if n else None,
        "driver_version": "570.86" if n else None,
        "infiniband": list(ib),
        "project_dir": "/project",
        "disk_free_bytes": disk,
        "host_ram_bytes": ram,
        "host_ram_available_bytes": ram,
        "cpu_count": 32,
        "cpu_affinity": 32,
        "env": {"NCCL_P2P_DISABLE": None, "NCCL_IB_DISABLE": None, **(env or {})},
    }


RTX4090 = ["NVIDIA GeForce RTX 4090"] * 3
RTX4090_MEM = 24_564 * MIB
H100 = ["NVIDIA H100 80GB HBM3"] * 8
H100_MEM = 81_559 * MIB


def _by_name(checks) -> dict:
    return {c.name: c for c in checks}


@pytest.fixture(autouse=True)
def _no_data(monkeypatch, tmp_path):
    """Plan from params alone: no shards index in the cwd."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("DSFLOW_PROFILES", raising=False)


# --------------------------------------------------------------------------- this machine


def test_facts_of_this_machine():
    facts = machine.facts(".")
    assert facts["gpu_count"] == len(facts["gpus"])
    assert facts["disk_free_bytes"] > 0 and facts["host_ram_bytes"] > 0
    assert facts["cpu_count"] >= 1
    assert set(facts["env"]) >= {"NCCL_P2P_DISABLE", "NCCL_IB_DISABLE"}
    assert isinstance(facts["infiniband"], list)
    if not torch.cuda.is_available():
        assert facts["gpus"] == [] and facts["p2p"] == [] and not facts["cuda_available"]
        assert machine.nccl_env(facts) == {}  # gloo: no NCCL variables


def test_diagnose_cpu_params_on_this_machine_is_ok():
    facts = machine.facts(".")
    found = checks.diagnose(facts, _params(device="cpu", gpus=1))
    by = _by_name(found)
    assert all(c.status in (checks.OK, checks.WARN, checks.FAIL) for c in found)
    assert [c for c in found if c.status == checks.FAIL] == []
    assert by["device"].status == checks.OK and "CPU with gloo" in by["device"].detail
    assert {"disk", "host ram", "cpu cores"} <= set(by)
    doctor.run(_params(device="cpu", gpus=1))  # no blockers: returns


# --------------------------------------------------------------------------- faked machines


def test_three_4090s_without_p2p_warn_and_disable_p2p():
    facts = _facts(RTX4090, RTX4090_MEM, p2p=False)
    found = checks.diagnose(facts, _params("profiles/rtx4090x3.yaml"))
    by = _by_name(found)
    assert by["peer-to-peer"].status == checks.WARN
    assert "0-1, 0-2, 1-2" in by["peer-to-peer"].detail
    assert "NCCL_P2P_DISABLE=1" in by["peer-to-peer"].fix
    assert "not set" in by["peer-to-peer"].detail
    assert by["gpu memory"].status == checks.OK  # medium ZeRO-2 fits the 24 GB cards
    assert [c for c in found if c.status == checks.FAIL] == []
    assert machine.nccl_env(facts) == {"NCCL_P2P_DISABLE": "1", "NCCL_IB_DISABLE": "1"}


def test_explicit_user_nccl_setting_is_respected():
    facts = _facts(RTX4090, RTX4090_MEM, p2p=False, env={"NCCL_P2P_DISABLE": "0"})
    assert "NCCL_P2P_DISABLE" not in machine.nccl_env(facts)
    check = _by_name(checks.diagnose(facts, _params("profiles/rtx4090x3.yaml")))["peer-to-peer"]
    assert check.status == checks.WARN and "NCCL_P2P_DISABLE=0 is set explicitly" in check.detail
    facts = _facts(RTX4090, RTX4090_MEM, p2p=False, env={"NCCL_P2P_DISABLE": "1"})
    assert machine.nccl_env(facts) == {"NCCL_IB_DISABLE": "1"}
    check = _by_name(checks.diagnose(facts, _params("profiles/rtx4090x3.yaml")))["peer-to-peer"]
    assert check.status == checks.OK


def test_two_visible_for_three_requested_fails_with_fix():
    facts = _facts(RTX4090[:2], RTX4090_MEM, p2p=False)
    found = checks.diagnose(facts, _params("profiles/rtx4090x3.yaml"))
    check = _by_name(found)["gpu count"]
    assert check.status == checks.FAIL
    assert "3 requested but 2 visible" in check.detail and "train.gpus: 2" in check.fix


def test_cuda_requested_without_gpus_fails():
    check = _by_name(checks.diagnose(_facts([], 0), _params(device="cuda")))["device"]
    assert check.status == checks.FAIL and "train.device: cpu" in check.fix


def test_low_disk_fails():
    facts = _facts(RTX4090, RTX4090_MEM, p2p=False, disk=5 * GB)
    check = _by_name(checks.diagnose(facts, _params("profiles/rtx4090x3.yaml")))["disk"]
    assert check.status == checks.FAIL
    assert "keep_checkpoints" in check.fix and "2 + 1 checkpoint(s)" in check.detail


def test_low_host_ram_fails():
    facts = _facts(RTX4090, RTX4090_MEM, p2p=False, ram=8 * GB)
    check = _by_name(checks.diagnose(facts, _params("profiles/rtx4090x3.yaml")))["host ram"]
    assert check.status == checks.FAIL and "fp32 model" in check.detail


def test_h100s_with_p2p_and_ib_need_no_nccl_overrides():
    facts = _facts(H100, H100_MEM, p2p=True, ib=["mlx5_0", "mlx5_1"])
    assert machine.nccl_env(facts) == {}
    found = checks.diagnose(facts, _params(device="cuda", gpus=8, zero_stage=2))
    by = _by_name(found)
    assert by["peer-to-peer"].status == checks.OK and by["infiniband"].status == checks.OK
    assert [c for c in found if c.status == checks.FAIL] == []


def test_mixed_gpu_models_warn():
    facts = _facts(RTX4090, RTX4090_MEM, p2p=False)
    facts["gpus"][2] = {"index": 2, "name": "NVIDIA GeForce RTX 3090", "total_memory": 24 * GB}
    check = _by_name(checks.diagnose(facts, _params("profiles/rtx4090x3.yaml")))["gpu models"]
    assert check.status == checks.WARN and "RTX 3090" in check.detail


def test_model_that_does_not_fit_is_a_blocker():
    params = _params("profiles/rtx4090x3.yaml")
    params["model"]["preset"] = "deepseek-v2"
    facts = _facts(RTX4090, RTX4090_MEM, p2p=False)
    check = _by_name(checks.diagnose(facts, params))["gpu memory"]
    assert check.status == checks.FAIL and "16-bit weights" in check.detail


def test_zero_stage_auto_is_judged_at_the_layout_the_train_stage_launches():
    # medium on 3 x 8 GB: ZeRO-2, auto's first try, does not fit; ZeRO-3 with the optimizer
    # offloaded does, and is what the train stage launches: the doctor passes that layout.
    params = _params(device="cuda", gpus=3, zero_stage="auto", micro_batch=1, seq_len=1024)
    params["model"]["preset"] = "medium"
    params["train"]["zero"]["reduce_bucket_size"] = 200_000_000
    facts = _facts(RTX4090, 8 * GB, p2p=False)
    plan = checks.plan_for(facts, params, 3)
    assert (plan["request"]["zero_stage"], plan["request"]["offload_optimizer"]) == (3, True)
    assert _by_name(checks.diagnose(facts, params))["gpu memory"].status == checks.OK
    # Pinned, ZeRO-2 is judged as it is: it does not fit.
    params["train"]["zero_stage"] = 2
    assert _by_name(checks.diagnose(facts, params))["gpu memory"].status == checks.FAIL
    # Where nothing fits, the first try's plan says why.
    params["train"]["zero_stage"] = "auto"
    params["model"]["preset"] = "deepseek-v3"
    check = _by_name(checks.diagnose(facts, params))["gpu memory"]
    assert check.status == checks.FAIL and "ZeRO-2 keeps a full 16-bit copy" in check.detail


def test_run_raises_one_line_on_blockers(monkeypatch, capsys):
    facts = _facts(RTX4090[:2], RTX4090_MEM, p2p=False, disk=1 * GB)
    monkeypatch.setattr(machine, "facts", lambda project_dir=".": copy.deepcopy(facts))
    with pytest.raises(UsageError) as err:
        doctor.run(_params("profiles/rtx4090x3.yaml"))
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith("2 blocker(s); first: gpu count:")
    out = capsys.readouterr().out
    assert "peer-to-peer" in out and "NCCL_P2P_DISABLE=1" in out


def test_the_machine_is_asked_once_per_process(monkeypatch):
    """GPUs are counted in one place: the doctor's facts, the planner's GPUs and the train
    stage's device come from one torch query; Snakemake's count needs no torch."""
    asked = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: asked.append(1) or False)
    machine.forget()
    try:
        machine.facts(".")
        machine.facts(".")
        assert machine.gpus() == [] and len(asked) == 1
        assert machine.resolve_device({"device": "auto", "gpus": "auto"}) == ("cpu", 1)
        assert len(asked) == 1
    finally:
        machine.forget()
    smi = {"nvidia_smi": "/usr/bin/nvidia-smi", "driver_version": "570.86", "listed": 4}
    monkeypatch.setattr(machine, "nvidia_smi", lambda: smi)
    assert machine.scheduler_gpus({}) == 4
    assert machine.scheduler_gpus({"CUDA_VISIBLE_DEVICES": "0,2"}) == 2
    assert machine.scheduler_gpus({"CUDA_VISIBLE_DEVICES": ""}) == 0


def test_disk_counts_the_checkpoints_the_run_writes():
    """60 steps with a checkpoint every 1000 write one checkpoint (the final save), not
    keep_checkpoints + 1; a run that saves often keeps keep + 1 at the peak."""
    facts = _facts(RTX4090, RTX4090_MEM, p2p=False)
    params = _params("profiles/rtx4090x3.yaml", max_steps=60, checkpoint_every=1000)
    plan = checks.plan_for(facts, params, 3)
    summ = plan["summary"]
    assert summ["checkpoints"] == 1
    assert summ["disk_bytes"] == summ["checkpoint_bytes"] + summ["export_bytes"]
    check = _by_name(checks.diagnose(facts, params, plan))["disk"]
    assert "1 checkpoint(s)" in check.detail and "all the run saves" in check.detail
    # 250 steps every 100: saves at 100, 200 and the end, keep 2 + 1 at the peak.
    params = _params("profiles/rtx4090x3.yaml", max_steps=250, checkpoint_every=100)
    assert checks.plan_for(facts, params, 3)["summary"]["checkpoints"] == 3
    params = _params("profiles/rtx4090x3.yaml", max_steps=200, checkpoint_every=100)
    assert checks.plan_for(facts, params, 3)["summary"]["checkpoints"] == 2
    # Just enough disk for the one checkpoint and the export: no blocker.
    facts = _facts(RTX4090, RTX4090_MEM, p2p=False, disk=summ["disk_bytes"] + GB)
    params = _params("profiles/rtx4090x3.yaml", max_steps=60, checkpoint_every=1000)
    assert _by_name(checks.diagnose(facts, params))["disk"].status == checks.OK


def test_the_doctors_plan_knows_each_gpus_grouped_gemm():
    """The doctor plans on the GPUs' compute capability, as the train stage does: an RTX 4090's
    bf16 sorted experts take dsflow's Triton grouped GEMM, which pads their rows; an H100's
    take torch's and do not."""

    def align(names, memory, capability) -> int:
        facts = _facts(names, memory, p2p=False)
        for gpu in facts["gpus"]:
            gpu["capability"] = list(capability)
        plan = checks.plan_for(facts, _params("profiles/rtx4090x3.yaml"), 3)
        return plan["estimate"]["inputs"]["expert_rows_align"]

    assert align(RTX4090, RTX4090_MEM, (8, 9)) == 64
    assert align(H100[:3], H100_MEM, (9, 0)) == 0
