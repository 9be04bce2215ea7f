"""dsflow.train.gradhooks: ZeRO-1/2's per-parameter gradient copies in fewer launches, on 3 CPU
ranks whose partitions cut through tensors: the same weights bit for bit as DeepSpeed's own
hooks, with gradient accumulation, bucket flushes and a parameter larger than a bucket, and
fewer dispatches in the backward."""

from __future__ import annotations

import textwrap

import pytest

from conftest import needs_cuda, rank_script
from dsflow.errors import UsageError
from dsflow.model import fastpaths

# Each rank: a tiny model with odd sizes (the first linear's weight is larger than a bucket),
# trained with DeepSpeed's hooks and with the lean ones from the same start on the same batches.
RANK_SCRIPT = textwrap.dedent(
    """
    import json, os, sys
    import torch
    import deepspeed
    from torch.utils._python_dispatch import TorchDispatchMode
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer
    from dsflow.train import gradhooks

    device, stage, precision, shape, out = sys.argv[1], int(sys.argv[2]), *sys.argv[3:6]
    deepspeed.init_distributed(dist_backend="gloo" if device == "cpu" else "nccl")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    ACCUM, DTYPE = 3, {"bf16": torch.bfloat16, "fp32": torch.float32}[precision]
    WIDTH = 2 if shape == "small" else 37

    def engine(lean):
        torch.manual_seed(0)
        model = torch.nn.Sequential(
            torch.nn.Linear(37, 53), torch.nn.GELU(), torch.nn.Linear(53, 9),
            torch.nn.Linear(9, 7), torch.nn.LayerNorm(7), torch.nn.Linear(7, 5),
        )
        if shape == "small":  # 4 elements, padded to 6: the third rank's share is padding only
            model = torch.nn.Sequential(torch.nn.Linear(WIDTH, 2, bias=False))
        config = {
            "train_batch_size": 2 * ACCUM * world, "train_micro_batch_size_per_gpu": 2,
            "gradient_accumulation_steps": ACCUM, "gradient_clipping": 0.5,
            "bf16": {"enabled": precision == "bf16"},
            "timers": {"throughput": {"enabled": False}},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": device == "cpu"}},
            "zero_optimization": {"stage": stage, "reduce_bucket_size": 500,
                                  "overlap_comm": True, "contiguous_gradients": True},
        }
        eng, opt, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                              config=config)
        assert type(opt) is DeepSpeedZeroOptimizer
        return eng, gradhooks.install(opt) if lean else False

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = 0
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops += 1
            return func(*args, **(kwargs or {}))

    deepspeeds = {"hook": 0}
    real_hook = DeepSpeedZeroOptimizer.reduce_independent_p_g_buckets_and_remove_grads
    def counted_hook(self, *a, **k):
        deepspeeds["hook"] += 1
        return real_hook(self, *a, **k)
    DeepSpeedZeroOptimizer.reduce_independent_p_g_buckets_and_remove_grads = counted_hook

    def train(eng):
        ops = []
        for step in range(4):
            for micro in range(ACCUM):
                torch.manual_seed(1000 * step + 10 * micro + rank)
                x = torch.randn(2, WIDTH, dtype=DTYPE).to(eng.device)
                loss = eng(x).float().pow(2).mean() * 100
                with Count() as count:
                    eng.backward(loss)
                ops.append(count.ops)
                eng.step()
        return ops

    results = {}
    for name, lean in (("deepspeed", False), ("lean", True)):
        deepspeeds["hook"] = 0
        eng, installed = engine(lean)
        ops = train(eng)
        opt = eng.optimizer
        results[name] = {
            "installed": installed,
            "ops": sum(ops),
            "deepspeed_hooks": deepspeeds["hook"],
            "hooks": ACCUM * 4 * sum(1 for p in eng.module.parameters()),
            "masters": [g.detach().float().tolist() for g in opt.single_partition_of_fp32_groups],
            "weights": [p.detach().float().tolist() for p in eng.module.parameters()],
        }
    results["same_masters"] = results["deepspeed"].pop("masters") == results["lean"].pop("masters")
    results["same_weights"] = results["deepspeed"].pop("weights") == results["lean"].pop("weights")
    if rank == 0:
        with open(out, "w") as f:
            json.dump(results, f)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    """
)


@pytest.mark.slow
@pytest.mark.parametrize(
    "stage,device,precision",
    [
        (2, "cpu", "bf16"),
        (2, "cpu", "fp32"),
        (1, "cpu", "bf16"),
        pytest.param(2, "cuda", "bf16", marks=needs_cuda),
    ],
    ids=["zero2-bf16", "zero2-fp32", "zero1-bf16", "cuda-zero2"],
)
def test_lean_gradient_hooks_train_as_deepspeeds_bit_for_bit_with_fewer_dispatches(
    stage, device, precision, tmp_path
):
    r = rank_script(tmp_path, RANK_SCRIPT, device, str(stage), precision, "odd")
    assert r["lean"]["installed"] is True and r["deepspeed"]["installed"] is False
    assert r["same_masters"] and r["same_weights"], r
    plain, lean = r["deepspeed"], r["lean"]
    # DeepSpeed's hook ran for every gradient it reduced; the lean one hands it only the
    # parameter larger than a bucket and the gradients that flush a bucket.
    assert 0 < lean["deepspeed_hooks"] < plain["deepspeed_hooks"] / 3, r
    # Fewer dispatches in the backwards: at least 3 fewer per gradient the lean hook took (one
    # view for narrow, view, .data and view_as), and the copies out of each reduced bucket in
    # one launch.
    lean_reduced = plain["deepspeed_hooks"] - lean["deepspeed_hooks"]
    assert plain["ops"] - lean["ops"] >= 3 * lean_reduced, r


@pytest.mark.slow
def test_a_rank_whose_partition_holds_no_tensor_accumulates_as_deepspeeds(tmp_path):
    """One weight of 4 elements on 3 ranks, ZeRO-2 with accumulation: DeepSpeed pads the
    partitions, and a rank whose share is padding only holds no gradient to accumulate."""
    r = rank_script(tmp_path, RANK_SCRIPT, "cpu", "2", "bf16", "small")
    assert r["lean"]["installed"] is True
    assert r["same_masters"] and r["same_weights"], r


@pytest.mark.parametrize(
    "stage,offload,value,on",
    [
        (2, False, "auto", True),
        (1, False, "auto", True),  # DeepSpeed hooks ZeRO-1's gradients with overlap_comm only
        (0, False, "auto", False),
        (3, False, "auto", False),
        (2, True, "auto", False),  # offload: DeepSpeed's CPU-side accumulation
        (2, False, False, False),
    ],
)
def test_lean_grad_hooks_auto_is_on_at_zero_1_and_2_without_offload(stage, offload, value, on):
    for device in ("cuda", "cpu"):  # the same bits: CPU ranks take it too
        perf = fastpaths.resolve({"lean_grad_hooks": value}, device, stage, "bf16", offload)
        assert perf.lean_grad_hooks is on
        assert ("lean gradient hooks" in perf.describe()) is on


def test_lean_grad_hooks_true_where_it_does_not_apply_is_one_line_naming_the_key():
    with pytest.raises(UsageError, match=r"train.perf.lean_grad_hooks: true needs .*zero_stage 3"):
        fastpaths.resolve({"lean_grad_hooks": True}, "cuda", 3, "bf16")
    with pytest.raises(UsageError, match=r"\(this run has train.offload.optimizer\)"):
        fastpaths.resolve({"lean_grad_hooks": True}, "cuda", 2, "bf16", optimizer_offload=True)
