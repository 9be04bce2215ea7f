"""dsflow.train.fusedgrads gives DeepSpeed's own overflow verdict and gradient norm, on 3 CPU ranks
whose ZeRO partitions split parameters, for ZeRO-1 and ZeRO-2, bf16 and fp32."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from conftest import needs_cuda, rank_script

pytestmark = pytest.mark.slow  # several processes each

# Each rank: a tiny bf16/fp32 model whose odd sizes make the partitions cut through tensors;
# one backward, then DeepSpeed's methods and the fused ones on the same gradients.
RANK_SCRIPT = textwrap.dedent(
    """
    import json, os, sys
    import torch
    import deepspeed
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer
    from dsflow.train import fusedgrads

    device, stage, precision, out = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
    assert deepspeed.get_accelerator().device_name() == device, "DS_ACCELERATOR disagrees"
    deepspeed.init_distributed(dist_backend="gloo" if device == "cpu" else "nccl")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(37, 53), torch.nn.GELU(), torch.nn.Linear(53, 29), torch.nn.Linear(29, 11)
    )
    config = {
        "train_batch_size": 2 * world, "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 500},
    }
    if precision == "bf16":
        config["bf16"] = {"enabled": True}
    engine, opt, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                             config=config)
    torch.manual_seed(1 + rank)
    x = torch.randn(2, 37, dtype=next(engine.module.parameters()).dtype).to(engine.device)
    engine.backward(engine(x).float().pow(2).mean() * 100)

    def verdicts():
        return bool(opt.has_overflow()), float(opt.scaled_global_norm())

    plain = verdicts()
    assert fusedgrads.install(opt)
    launches = []
    foreach_norm = torch._foreach_norm
    def counted(*args, **kwargs):
        launches.append(1)
        return foreach_norm(*args, **kwargs)
    torch._foreach_norm = counted
    fused = verdicts()
    torch._foreach_norm = foreach_norm
    # An inf on rank 1 only (every rank must see it), then a NaN on rank 2 only.
    results = {"plain": plain, "fused": fused, "bad": {}, "stale": {},
               "launches": len(launches), "groups": len(opt.bit16_groups)}
    for value, bad_rank in (("inf", 1 % world), ("nan", 2 % world)):
        grads = opt.averaged_gradients[0]  # this rank's share of each gradient, in order
        if rank == bad_rank:
            keep = grads[0].flatten()[0].clone()
            grads[0].flatten()[0] = float(value)
        results["bad"][value] = [bool(opt.has_overflow()), float(opt.scaled_global_norm())]
        for name in ("has_overflow_partitioned_grads_serial", "get_grad_norm_direct"):
            setattr(opt, name, getattr(DeepSpeedZeroOptimizer, name).__get__(opt))
        results["bad"][value] += [bool(opt.has_overflow()), float(opt.scaled_global_norm())]
        fusedgrads.install(opt)
        if rank == bad_rank:
            grads[0].flatten()[0] = keep
        # A gradient written after the check: the norm must not come from the check's norms.
        opt.has_overflow()
        if rank == bad_rank:
            grads[0].flatten()[0] = float(value)
        results["stale"][value] = float(opt.scaled_global_norm())
        if rank == bad_rank:
            grads[0].flatten()[0] = keep
    results["after"] = verdicts()
    if rank == 0:
        with open(out, "w") as f:
            json.dump(results, f)
    # A clean teardown: gloo's threads abort the process if they outlive the interpreter.
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    """
)


@pytest.mark.parametrize(
    "stage,precision,device",
    [
        (2, "bf16", "cpu"),
        (1, "bf16", "cpu"),
        (2, "fp32", "cpu"),
        # CUDA kernels have their own dtype gaps (GradScaler's unscale kernel has no bf16 one):
        # the same checks on one GPU, where there is one.
        pytest.param(2, "bf16", "cuda", marks=needs_cuda),
        pytest.param(1, "bf16", "cuda", marks=needs_cuda),
        pytest.param(2, "fp32", "cuda", marks=needs_cuda),
    ],
    ids=[
        "zero2-bf16",
        "zero1-bf16",
        "zero2-fp32",
        "cuda-zero2-bf16",
        "cuda-zero1-bf16",
        "cuda-zero2-fp32",
    ],
)
def test_fused_checks_match_deepspeed(stage, precision, device, tmp_path):
    r = rank_script(tmp_path, RANK_SCRIPT, device, str(stage), precision)
    assert r["plain"][0] is False and r["fused"][0] is False
    assert r["fused"][1] == pytest.approx(r["plain"][1], rel=1e-6)
    assert r["plain"][1] > 0
    # Both find the inf and the NaN that one rank holds, on every rank, and both report the
    # global norm as invalid (DeepSpeed's -1 per group, inf combined; fused first, then its own).
    inf = float("inf")
    assert r["bad"] == {"inf": [True, inf, True, inf], "nan": [True, inf, True, inf]}
    # The norm reuses the check's per-tensor norms (one launch per group a step, not two)...
    assert r["launches"] == r["groups"]
    # ... but not once a gradient has changed since the check.
    assert r["stale"] == {"inf": inf, "nan": inf}
    # The checks leave the gradients as they were.
    assert r["after"] == [False, pytest.approx(r["plain"][1], rel=1e-6)]


def test_fused_checks_dispatch_fewer_ops_per_step(tmp_path):
    """What the lever is for: the optimizer step of the medium preset's structure dispatches
    far fewer ops (each a kernel launch on a GPU), and forward/backward are untouched."""
    from conftest import ROOT

    out = tmp_path / "host.json"
    cmd = [
        sys.executable, str(ROOT / "bench/host_overhead.py"), "--configs", "dense",
        "--variants", "deepspeed,fused-checks", "--steps", "1", "--json", str(out),
    ]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    r = json.loads(out.read_text())["dense"]
    plain, fused = r["deepspeed"]["ops"], r["fused-checks"]["ops"]
    assert fused["forward"] == plain["forward"] and fused["backward"] == plain["backward"]
    assert fused["step"] < 0.6 * plain["step"], (plain, fused)


@pytest.mark.parametrize(
    "case", ["finite", "near the fp16 maximum", "one inf", "one nan", "squares past fp16"]
)
def test_fp16_loss_scaled_gradients_get_deepspeeds_overflow_verdict_and_norms(case):
    """fp16 with dynamic loss scaling (DeepSpeed's CPU accelerator has no fp16, so in-process on
    one partition): gradients at the scale 2^16 brings, 16-bit, get DeepSpeed's own overflow
    verdict from the fused check, and per-tensor norms within fp32 rounding of fp64 ones."""
    from types import SimpleNamespace

    import torch
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    from dsflow.train import fusedgrads

    torch.manual_seed(0)
    grads = [(torch.randn(n) * 1e-3 * 2.0**16).half() for n in (37 * 53, 53, 29 * 11)]
    if case == "near the fp16 maximum":
        grads[0][5] = 65000.0
    elif case == "one inf":
        grads[1][3] = float("inf")
    elif case == "one nan":
        grads[2][0] = float("nan")
    elif case == "squares past fp16":
        grads[0][:100] = 300.0  # 300^2 is past fp16's range, far inside fp32's
    opt = SimpleNamespace(
        bit16_groups=[[None] * len(grads)],
        averaged_gradients=[grads],
        _has_inf_or_nan=DeepSpeedZeroOptimizer._has_inf_or_nan,
        _dsflow_norms=fusedgrads._NormCache(),
    )
    theirs = bool(DeepSpeedZeroOptimizer.has_overflow_partitioned_grads_serial(opt))
    assert bool(fusedgrads._has_overflow(opt)) is theirs is (case in ("one inf", "one nan"))
    if not theirs:
        norms = torch.stack(fusedgrads._norms(grads)).double()
        exact = torch.stack([g.double().norm() for g in grads])
        torch.testing.assert_close(norms, exact, rtol=1e-6, atol=0)
