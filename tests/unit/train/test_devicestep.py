"""dsflow.train.devicestep: DeepSpeed's ZeRO-1/2 bf16 step with its decisions on the device, on 3
CPU ranks whose partitions split parameters. The same updates as DeepSpeed's own step, a
non-finite gradient on one rank skipped on every rank, no host sync in the step, and a
checkpoint of either step resumed by the other."""

from __future__ import annotations

import textwrap

import pytest
import torch

from conftest import needs_cuda, rank_script
from dsflow.errors import UsageError
from dsflow.model import fastpaths
from dsflow.train import devicestep

# Each rank: a tiny bf16 model with odd sizes (partitions cut through tensors), trained by
# DeepSpeed's own step and by the device step from the same start on the same batches.
RANK_SCRIPT = textwrap.dedent(
    """
    import json, os, sys
    import torch
    import deepspeed
    from dsflow.train import devicestep

    device, stage, ckpt, out = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
    deepspeed.init_distributed(dist_backend="gloo" if device == "cpu" else "nccl")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    OPT = {"lr": 1e-2, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1}

    def engine(device_step):
        torch.manual_seed(0)
        model = torch.nn.Sequential(
            torch.nn.Linear(37, 53), torch.nn.GELU(), torch.nn.Linear(53, 29),
            torch.nn.Linear(29, 11),
        )
        config = {
            "train_batch_size": 2 * world, "train_micro_batch_size_per_gpu": 2,
            "gradient_accumulation_steps": 1, "gradient_clipping": 0.5,
            "bf16": {"enabled": True},
            # as dsflow's config has it: the throughput timer synchronizes in every forward
            "timers": {"throughput": {"enabled": False}},
            "zero_optimization": {"stage": stage, "reduce_bucket_size": 500,
                                  "overlap_comm": True, "contiguous_gradients": True},
        }
        client = None
        if device_step:
            client = devicestep.optimizer(list(model.parameters()), OPT)
        else:
            params = {**OPT, **({"torch_adam": True} if device == "cpu" else {})}
            config["optimizer"] = {"type": "AdamW", "params": params}
        eng, opt, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                              optimizer=client, config=config)
        if device_step:
            devicestep.install(opt)
        return eng

    def step(eng, i, poison=None):
        torch.manual_seed(100 * i + rank)
        x = torch.randn(2, 37, dtype=torch.bfloat16).to(eng.device)
        loss = eng(x).float().pow(2).mean() * 100
        eng.backward(loss)
        if poison is not None and rank == 1 % world:
            grads = eng.optimizer.averaged_gradients[0]
            grads[0].view(-1)[0] = float(poison)
        eng.step()

    def state(eng):
        opt = eng.optimizer
        flat = [g.detach().float().clone() for g in opt.single_partition_of_fp32_groups]
        inner = opt.optimizer.state[opt.single_partition_of_fp32_groups[0]]
        return flat, inner["exp_avg"].clone(), float(inner["step"])

    syncs = []
    def counting(name):
        real = getattr(torch.Tensor, name)
        def wrapper(self, *a, **k):
            syncs.append(name)
            return real(self, *a, **k)
        return real, wrapper

    accelerator = type(deepspeed.get_accelerator())
    real_sync = accelerator.synchronize
    def counted_sync(self, *a, **k):
        syncs.append("synchronize")
        return real_sync(self, *a, **k)

    def counted(eng, i):
        reals = {}
        for name in ("item", "__bool__", "tolist", "__float__", "__int__"):
            reals[name], wrapper = counting(name)
            setattr(torch.Tensor, name, wrapper)
        accelerator.synchronize = counted_sync
        try:
            step(eng, i)
        finally:
            for name, real in reals.items():
                setattr(torch.Tensor, name, real)
            accelerator.synchronize = real_sync
        found = list(syncs)
        syncs.clear()
        return found

    results = {"plain_syncs": [], "syncs": []}
    plain, fast = engine(False), engine(True)
    for i in range(3):
        results["plain_syncs"] += counted(plain, i)
        results["syncs"] += counted(fast, i)
    a, b = state(plain), state(fast)
    results["max_diff"] = max(float((x - y).abs().max()) for x, y in zip(a[0], b[0]))
    results["moment_diff"] = float((a[1] - b[1]).abs().max())
    results["steps"] = [a[2], b[2]]
    results["applied"] = bool(devicestep.applied(fast.optimizer))
    # One rank's gradient turns inf, then NaN: every rank skips the step on the device.
    for poison in ("inf", "nan"):
        before = state(fast)
        step(fast, 10, poison)
        after = state(fast)
        results[poison] = {
            "applied": bool(devicestep.applied(fast.optimizer)),
            "weights_kept": all(torch.equal(x, y) for x, y in zip(before[0], after[0])),
            "moments_kept": bool(torch.equal(before[1], after[1])),
            "step_kept": before[2] == after[2],
        }
    step(fast, 11)
    results["applied_again"] = bool(devicestep.applied(fast.optimizer))
    # A checkpoint of DeepSpeed's own step, resumed by the device step: it trains on as the
    # plain step does.
    plain.save_checkpoint(ckpt, tag="t")
    resumed = engine(True)
    resumed.load_checkpoint(ckpt, tag="t")
    devicestep.after_load(resumed.optimizer)
    step(plain, 20)
    step(resumed, 20)
    a, b = state(plain), state(resumed)
    results["resumed_diff"] = max(float((x - y).abs().max()) for x, y in zip(a[0], b[0]))
    results["resumed_steps"] = [a[2], b[2]]
    # ... and the other way: a checkpoint of the device step, resumed by DeepSpeed's own step
    # (its optimizer's own settings, not the fused ones the checkpoint's groups carry).
    resumed.save_checkpoint(ckpt, tag="u")
    back = engine(False)
    back.load_checkpoint(ckpt, tag="u")
    devicestep.after_load(back.optimizer)
    # (torch's AdamW runs the kernel its group names; DeepSpeed's FusedAdam, on a GPU, has one)
    inner = back.optimizer.optimizer
    results["back_fused"] = isinstance(inner, torch.optim.AdamW) and bool(
        inner.param_groups[0].get("fused")
    )
    step(resumed, 21)
    step(back, 21)
    a, b = state(resumed), state(back)
    results["back_diff"] = max(float((x - y).abs().max()) for x, y in zip(a[0], b[0]))
    results["back_steps"] = [a[2], b[2]]
    results["epilogue_swapped"] = (
        fast.optimizer.independent_gradient_partition_epilogue.__func__
        is devicestep._epilogue_with_a_stream_wait
    )
    if rank == 0:
        with open(out, "w") as f:
            json.dump(results, f)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    """
)


@pytest.mark.slow
@pytest.mark.parametrize(
    "stage,device",
    [(2, "cpu"), (1, "cpu"), pytest.param(2, "cuda", marks=needs_cuda)],
    ids=["zero2", "zero1", "cuda-zero2"],
)
def test_device_step_trains_as_deepspeed_and_skips_bad_steps_without_a_host_sync(
    stage, device, tmp_path
):
    r = rank_script(tmp_path, RANK_SCRIPT, device, str(stage), str(tmp_path / "ckpt"))
    # The same AdamW with the same clipping: equal fp32 masters up to the fused kernel's
    # rounding, and the same step count.
    assert r["max_diff"] < 1e-6 and r["moment_diff"] < 1e-6, r
    assert r["steps"] == [3.0, 3.0] and r["applied"] is True
    # Nothing in the step read a tensor on the host; DeepSpeed's own step does, each step.
    assert r["syncs"] == []
    assert r["plain_syncs"].count("item") >= 3 and "__bool__" in r["plain_syncs"]
    for poison in ("inf", "nan"):
        assert r[poison] == {
            "applied": False, "weights_kept": True, "moments_kept": True, "step_kept": True
        }, poison  # fmt: skip
    assert r["applied_again"] is True
    assert r["resumed_diff"] < 1e-6 and r["resumed_steps"][0] == r["resumed_steps"][1]
    assert r["back_diff"] < 1e-6 and r["back_steps"][0] == r["back_steps"][1]
    assert r["back_fused"] is False
    # With overlap_comm the epilogue waits on the reduction stream instead of the device
    # (DeepSpeed's CPU accelerator has no reduction stream: nothing to replace there).
    assert r["epilogue_swapped"] is (device == "cuda")


def test_after_load_gives_each_optimizer_its_own_step_type():
    """A checkpoint's step count as the loading optimizer keeps it: an int (DeepSpeed's
    FusedAdam) becomes a tensor for torch's fused AdamW, whose group is fused again after
    torch's load_state_dict took the saved group's settings; a tensor becomes an int for an
    optimizer that counts in ints."""
    p = torch.nn.Parameter(torch.zeros(4))
    fused = devicestep.optimizer(
        [p], {"lr": 1e-3, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0}
    )
    fused.state[p] = {"step": 7, "exp_avg": torch.zeros(4), "exp_avg_sq": torch.zeros(4)}
    fused.param_groups[0]["fused"] = None
    zero = type("Zero", (), {"optimizer": fused})()
    devicestep.after_load(zero)
    step = fused.state[p]["step"]
    assert torch.is_tensor(step) and step.dtype == torch.float32 and float(step) == 7.0
    assert fused.param_groups[0]["fused"] is True
    p.grad = torch.ones(4)
    fused.step()
    assert float(fused.state[p]["step"]) == 8.0

    class FusedAdamLike(torch.optim.Optimizer):
        """DeepSpeed's FusedAdam as far as loading goes: an int step, bias_correction in its
        groups (torch's AdamW groups lack it)."""

        def __init__(self, params):
            super().__init__(params, {"lr": 1e-3, "bias_correction": True})

    saved = fused.state_dict()
    other = FusedAdamLike([p])
    other.load_state_dict(saved)
    assert "bias_correction" not in other.param_groups[0]  # torch took the saved group
    devicestep.after_load(type("Zero", (), {"optimizer": other})())
    assert other.param_groups[0]["bias_correction"] is True
    assert other.state[p]["step"] == 8 and isinstance(other.state[p]["step"], int)


@pytest.mark.parametrize(
    "device,stage,precision,optimizer,offload,user,on",
    [
        ("cuda", 2, "bf16", {}, False, False, True),
        ("cuda", 1, "bf16", {}, False, False, True),
        ("cuda", 0, "bf16", {}, False, False, False),  # ZeRO-0: the fused optimizer's
        ("cuda", 2, "fp16", {}, False, False, False),  # a loss scale to adjust on the host
        ("cuda", 2, "bf16", {}, True, False, False),  # offload: DeepSpeed's CPU Adam
        ("cuda", 2, "bf16", {}, False, True, False),  # a user's ds_config: DeepSpeed's step
        ("cpu", 2, "bf16", {}, False, False, False),
    ],
)
def test_device_step_auto_is_on_for_cuda_where_it_applies(
    device, stage, precision, optimizer, offload, user, on
):
    perf = fastpaths.resolve(optimizer, device, stage, precision, offload, user_config=user)
    assert perf.device_step is on
    assert ("its step on the device" in perf.describe()) is on


def test_device_step_true_where_it_does_not_apply_is_one_line_naming_the_key():
    assert fastpaths.resolve({"device_step": True}, "cpu", 2, "bf16").device_step is True
    with pytest.raises(
        UsageError, match=r"train.perf.device_step: true needs .* \(this run has ZeRO-2, fp16"
    ):
        fastpaths.resolve({"device_step": True}, "cuda", 2, "fp16")
    with pytest.raises(UsageError, match="optimizer offload"):
        fastpaths.resolve({"device_step": True}, "cuda", 1, "bf16", optimizer_offload=True)


def test_a_user_ds_config_optimizer_is_refused_with_the_device_step():
    from dsflow import dsconfig

    built = {"optimizer": {"type": "AdamW"}, "bf16": {"enabled": True}, "gradient_clipping": 1.0}
    assert dsconfig.for_device_step(dict(built), built) == {
        "bf16": {"enabled": True}, "gradient_clipping": 1.0
    }  # fmt: skip
    user = {**built, "optimizer": {"type": "Lamb"}}
    with pytest.raises(UsageError, match="ds.json: optimizer is set there.*device_step: false"):
        dsconfig.for_device_step(user, built, "ds.json")
    # Settings that make DeepSpeed build another step, or one without a norm to skip on.
    fp32_accum = {**built, "data_types": {"grad_accum_dtype": "fp32"}}
    with pytest.raises(UsageError, match="ds.json: data_types is set there"):
        dsconfig.for_device_step(fp32_accum, built, "ds.json")
    no_norm = {**built, "zero_optimization": {"stage": 2, "compute_grad_norm": False}}
    with pytest.raises(UsageError, match="zero_optimization.compute_grad_norm is set there"):
        dsconfig.for_device_step(no_norm, built, "ds.json")
