"""ZeRO-3, offload and elastic resume: the DeepSpeed config and its checks, checkpoint layouts,
and training on 3 CPU ranks (tiny preset) compared with ZeRO-2."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
from test_train import exported_val_loss, trained_copy

from conftest import ROOT, dsflow, losses, rewound_copy
from dsflow import dsconfig
from dsflow import params as params_mod
from dsflow.errors import UsageError
from dsflow.launch import free_port
from dsflow.model.loss import evaluate_loss
from dsflow.plan import layouts, request
from dsflow.report import zero_layout
from dsflow.train import checkpoint as ckpt
from dsflow.train import stage as train

# Global batch 12 = micro 2 x accum 2 x 3 ranks = micro 2 x accum 3 x 2 ranks.
BATCH = {"train": {"micro_batch": 2, "grad_accum": 2, "keep_checkpoints": 3}}

# fp32 on CPU: ZeRO-2 and ZeRO-3 (and offload) do the same arithmetic in a different order
# (bucketed reduce-scatter vs. all-reduce, grad norm over partitions), so per-step losses differ
# by rounding only: measured at most 3e-8 relative over 12 steps. 1e-6 is ~30x that and still
# far below what any real difference (a skipped bias update, a wrong shard) moves: >= 1e-5.
RTOL = 1e-6


def params(**train) -> dict:
    import yaml

    raw = yaml.safe_load((ROOT / "params.yaml").read_text())
    return params_mod.validate(params_mod.deep_merge(raw, {"train": train}))


# --------------------------------------------------------------------------- DeepSpeed config


def test_zero3_config_has_the_stage3_knobs_and_offload_sections():
    bucket = {"reduce_bucket_size": 40_000_000}  # as the planner decides auto on GPUs
    t = params(zero_stage=3, offload={"optimizer": "cpu", "param": "cpu"}, zero=bucket)["train"]
    z = dsconfig.zero_optimization(t, "cuda", 3)
    assert z["reduce_bucket_size"] == 40_000_000
    assert z["stage"] == 3
    assert z["stage3_prefetch_bucket_size"] == t["zero"]["stage3_prefetch_bucket_size"]
    assert z["stage3_gather_16bit_weights_on_model_save"] is True
    assert z["offload_optimizer"] == {"device": "cpu", "pin_memory": True}
    assert z["offload_param"] == {"device": "cpu", "pin_memory": True}
    # No pinned memory on the CPU accelerator; no stage3_* keys below stage 3.
    assert dsconfig.zero_optimization(t, "cpu", 3)["offload_param"]["pin_memory"] is False
    z2 = dsconfig.zero_optimization(params(zero_stage=2, zero=bucket)["train"], "cuda", 3)
    assert not any(k.startswith("stage3_") or k.startswith("offload") for k in z2)
    nvme = params(zero_stage=3, offload={"optimizer": "nvme", "nvme_path": "/nvme"}, zero=bucket)[
        "train"
    ]
    assert dsconfig.zero_optimization(nvme, "cuda", 3)["offload_optimizer"]["nvme_path"] == "/nvme"
    assert dsconfig.layout(t) == "ZeRO-3 + optimizer offload (cpu) + param offload (cpu)"


@pytest.mark.parametrize(
    "train, device, key, says",
    [
        ({"zero_stage": 2, "offload": {"param": "cpu"}}, "cuda", "train.offload.param", "3"),
        ({"zero_stage": 0, "offload": {"optimizer": "cpu"}}, "cuda", "offload.optimizer", "1, 2"),
        ({"zero_stage": 3, "offload": {"optimizer": "nvme"}}, "cuda", "nvme_path", "NVMe"),
        (
            {"zero_stage": 2, "offload": {"optimizer": "nvme", "nvme_path": "/x"}},
            "cuda",
            "train.offload.optimizer",
            "zero_stage: 3",
        ),
        (
            {"zero_stage": 3, "offload": {"param": "nvme", "nvme_path": "/x"}},
            "cpu",
            "train.offload.param",
            "CUDA",
        ),
    ],
)
def test_offload_mistakes_fail_in_one_line_naming_the_key(train, device, key, says):
    with pytest.raises(UsageError) as exc:
        dsconfig.zero_optimization(params(**train)["train"], device, 3)
    msg = str(exc.value)
    assert "\n" not in msg and key in msg and says in msg


def test_schema_names_the_key_of_a_bad_offload_or_stage():
    for bad, key in (
        ({"offload": {"optimizer": "disk"}}, "train.offload.optimizer"),
        ({"zero_stage": 4}, "train.zero_stage"),
    ):
        with pytest.raises(UsageError) as exc:
            params(**bad)
        assert key in str(exc.value) and "\n" not in str(exc.value)


def test_auto_picks_the_cheapest_layout_that_fits():
    auto = params(zero_stage="auto", micro_batch=1, seq_len=1024)
    # CPU: nothing to fit, the fewest collectives.
    assert layouts.auto_layout(auto, 3, "cpu")[:3] == (2, False, False)
    # Buckets as DeepSpeed's 200M (auto's smaller ones on these GPUs would move the 4 GB line).
    medium = params_mod.deep_merge(
        auto,
        {"model": {"preset": "medium"}, "train": {"zero": {"reduce_bucket_size": 200_000_000}}},
    )
    gb, host = 10**9, 1000 * 10**9
    picks = {mem: layouts.auto_layout(medium, 3, "cuda", mem * gb, host)[:3] for mem in (80, 8, 4)}
    # Less GPU memory, a costlier layout: ZeRO-2, then ZeRO-3 + optimizer offload (ZeRO-3 alone
    # does not fit 8 GB), then parameter offload too.
    assert picks == {80: (2, False, False), 8: (3, True, False), 4: (3, True, True)}
    # One GPU: ZeRO-0 with dsflow's fused optimizer (bf16: the default there); ZeRO-1 with
    # DeepSpeed's (it holds what ZeRO-2 does there, without DeepSpeed's gradient hooks); where
    # that does not fit, the same costlier layouts. ZeRO-3 partitions nothing there, so ZeRO-2
    # with optimizer offload is next.
    alone = {mem: layouts.auto_layout(medium, 1, "cuda", mem * gb, host) for mem in (80, 8)}
    assert alone[80][:3] == (0, False, False) and "ZeRO-0, for dsflow's fused" in alone[80][3]
    assert alone[8][:3] == (2, True, False)
    ds = params_mod.deep_merge(medium, {"train": {"perf": {"optimizer": "deepspeed"}}})
    zero1 = layouts.auto_layout(ds, 1, "cuda", 80 * gb, host)
    assert zero1[:3] == (1, False, False) and "one GPU: ZeRO-1" in zero1[3]
    # With a DeepSpeed config file of the user's, auto keeps DeepSpeed's optimizer.
    user = params_mod.deep_merge(medium, {"train": {"ds_config": "my_ds.json"}})
    assert layouts.auto_layout(user, 1, "cuda", 80 * gb, host)[:3] == (1, False, False)
    fused = params_mod.deep_merge(medium, {"train": {"perf": {"optimizer": "fused"}}})
    fp32 = params_mod.deep_merge(fused, {"train": {"precision": "fp32"}})
    assert layouts.auto_layout(fp32, 1, "cuda", 80 * gb, host)[:3] == (1, False, False)
    # The fused optimizer runs at ZeRO-0 only: asked for, auto tries it first on several GPUs
    # too; auto alone keeps DeepSpeed's there (ZeRO-2, above).
    assert layouts.auto_layout(fused, 3, "cuda", 80 * gb, host)[:3] == (0, False, False)
    # Parameter offload exists at ZeRO-3 only: asked for, auto plans there.
    par = params_mod.deep_merge(medium, {"train": {"offload": {"param": "cpu"}}})
    for world in (1, 3):
        assert layouts.auto_layout(par, world, "cuda", 80 * gb, host)[:3] == (3, True, True)
    assert layouts.auto_layout(par, 1, "cuda", None, host)[:3] == (3, False, True)
    # Offload asked for in train.offload is kept, at auto's first stage (ZeRO-Offload) where it
    # fits, the layout the plan stage plans; ZeRO-3 with it where that does not fit.
    kept = params_mod.deep_merge(medium, {"train": {"offload": {"optimizer": "cpu"}}})
    assert layouts.auto_layout(kept, 3, "cuda", 80 * gb, host)[:3] == (2, True, False)
    assert layouts.auto_layout(kept, 3, "cuda", 4 * gb, host)[:3] == (3, True, True)
    assert layouts.auto_layout(kept, 1, "cuda", 80 * gb, host)[:3] == (2, True, False)
    # NVMe offload exists at ZeRO-3 only: asked for, auto plans there, on any number of GPUs.
    nvme = {"train": {"offload": {"optimizer": "nvme", "nvme_path": "/nvme"}}}
    nvme = params_mod.deep_merge(medium, nvme)
    for world in (1, 3):
        assert layouts.auto_layout(nvme, world, "cuda", 80 * gb, host)[:3] == (3, True, False)
    nvme_compiled = params_mod.deep_merge(nvme, {"train": {"perf": {"compile": True}}})
    with pytest.raises(UsageError, match="train.offload.optimizer: nvme needs ZeRO-3"):
        layouts.auto_layout(nvme_compiled, 3, "cuda", 80 * gb, host)
    # train.perf.compile: true cannot run at ZeRO-3, so auto never picks it: ZeRO-2 with the
    # optimizer offloaded instead, and where even that does not fit, the message says why.
    compiled = params_mod.deep_merge(medium, {"train": {"perf": {"compile": True}}})
    assert layouts.auto_layout(compiled, 3, "cuda", 8 * gb, host)[:3] == (2, True, False)
    both = params_mod.deep_merge(compiled, {"train": {"perf": {"optimizer": "fused"}}})
    # From ZeRO-0, plain ZeRO-2 comes before offloading (on one GPU it holds what ZeRO-0 does).
    assert layouts.auto_layout(both, 3, "cuda", 16 * gb, host)[:3] == (2, False, False)
    assert layouts.auto_layout(both, 1, "cuda", 16 * gb, host)[:3] == (2, True, False)
    with pytest.raises(UsageError) as exc:
        layouts.auto_layout(compiled, 3, "cuda", 4 * gb, host)
    msg = str(exc.value)
    assert "train.perf.compile: true rules out ZeRO-3" in msg and "cheapest fit: ZeRO-3" not in msg
    # train.perf.fp8 is refused at ZeRO-3 too: the same ladder, the message names it.
    fp8 = params_mod.deep_merge(medium, {"train": {"perf": {"fp8": "tensorwise"}}})
    assert layouts.auto_layout(fp8, 3, "cuda", 8 * gb, host)[:3] == (2, True, False)
    with pytest.raises(UsageError, match="train.perf.fp8: tensorwise rules out ZeRO-3"):
        layouts.auto_layout(fp8, 3, "cuda", 4 * gb, host)
    par_compiled = params_mod.deep_merge(par, {"train": {"perf": {"compile": True}}})
    with pytest.raises(UsageError, match="train.offload.param: cpu needs ZeRO-3"):
        layouts.auto_layout(par_compiled, 3, "cuda", 80 * gb, host)
    with pytest.raises(UsageError) as exc:
        layouts.auto_layout(medium, 3, "cuda", 2 * gb, host)
    msg = str(exc.value)
    assert "\n" not in msg and "train.zero_stage: auto" in msg and "cheapest fit:" in msg


def test_one_rank_at_zero_1_gets_no_gradient_hooks_by_default():
    """overlap_comm / contiguous_gradients: auto are off only for one rank at ZeRO-0/1 (where
    they make DeepSpeed hook every parameter's gradient for nothing); what is set stays set."""
    hooks = dsconfig.gradient_hooks
    auto = params()["train"]["zero"]
    assert (auto["overlap_comm"], auto["contiguous_gradients"]) == ("auto", "auto")
    assert hooks(auto, 1, 1, "cuda") == (False, False)
    assert hooks(auto, 0, 1, "cuda") == (False, False)
    assert hooks(auto, 2, 1, "cuda") == (True, True)
    assert hooks(auto, 1, 3, "cuda") == (True, True)
    assert hooks(auto, 2, 3, "cpu") == (False, True)  # no streams to overlap on the CPU
    on = {"overlap_comm": True, "contiguous_gradients": True}
    assert hooks(on, 1, 1, "cuda") == (True, True)
    z = dsconfig.build(params(zero_stage=1)["train"], dsconfig.Batch(2, 1, 1), 10, "cuda")
    assert not z["zero_optimization"]["overlap_comm"]
    assert not z["zero_optimization"]["contiguous_gradients"]
    with pytest.raises(UsageError) as exc:
        params(zero={"overlap_comm": "yes"})
    assert "train.zero.overlap_comm" in str(exc.value)
    # The planner counts the reduce buckets DeepSpeed will double-buffer, or not.
    assert not request.resolve(params(zero_stage=1), None, world=1).overlap_comm
    assert request.resolve(params(zero_stage=2), None, world=1).overlap_comm


def one_rank(script: str, arg, cwd: Path):
    """Run `script` as a 1-rank gloo world on DeepSpeed's CPU accelerator, with `arg` as JSON in
    argv[1]; the JSON its last output line prints."""

    env = {
        **os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1",
        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "RANK": "0",
        "LOCAL_RANK": "0", "WORLD_SIZE": "1",
    }  # fmt: skip
    proc = subprocess.run(
        [sys.executable, "-c", script, json.dumps(arg)],
        env=env, capture_output=True, text=True, timeout=300, cwd=cwd,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


# One rank, two micro-steps per step: how often the engine waits for the device in 5 steps,
# with DeepSpeed's default timers and with dsflow's config.
SYNC_SCRIPT = """
import json, os, sys
import torch, deepspeed
from deepspeed.accelerator import get_accelerator
cfg = json.loads(sys.argv[1])
deepspeed.init_distributed(dist_backend="gloo")
accel = type(get_accelerator())
waits = {}
for name, config in (("default", {k: v for k, v in cfg.items() if k != "timers"}), ("dsflow", cfg)):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1))
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                      config=config)
    count, plain = [0], accel.synchronize
    def counting(self, device_index=None):
        count[0] += 1
        return plain(self, device_index)
    accel.synchronize = counting
    for _ in range(5 * 2):
        x = torch.randn(2, 8, dtype=next(engine.module.parameters()).dtype)
        engine.backward(engine(x).float().pow(2).mean())
        engine.step()
    accel.synchronize = plain
    waits[name] = count[0]
print(json.dumps(waits))
torch.distributed.destroy_process_group()
"""


def test_the_engine_does_not_wait_for_the_device_at_each_micro_step(tmp_path):
    """DeepSpeed's throughput timer synchronizes the device at every micro-step's forward and
    step; after each the GPU idles until the host queues work again. dsflow's config turns it
    off (the train stage times whole steps itself)."""
    cfg = dsconfig.build(params(zero_stage=2)["train"], dsconfig.Batch(2, 2, 1), 10, "cpu")
    waits = one_rank(SYNC_SCRIPT, cfg, tmp_path)
    # The timer starts at step 3: 3 timed steps x 2 micro-steps x (forward + step).
    assert waits == {"default": 12, "dsflow": 0}


# One rank: DeepSpeed's gradient hooks under dsflow's config at ZeRO-1 and ZeRO-2, and the
# losses of the same 6 bf16 steps with each.
HOOKS_SCRIPT = """
import json, sys
import torch, deepspeed
deepspeed.init_distributed(dist_backend="gloo")
out = {}
for stage, config in json.loads(sys.argv[1]).items():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 1))
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                      config=config)
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(6):
        x = torch.randn(4, 16, generator=g).to(torch.bfloat16)
        loss = engine(x).float().pow(2).mean()
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    out[stage] = {"hooks": len(engine.optimizer._grad_acc_hooks), "losses": losses}
print(json.dumps(out))
torch.distributed.destroy_process_group()
"""


def test_zero_1_on_one_rank_trains_like_zero_2_without_gradient_hooks(tmp_path):
    """ZeRO-1 on one rank, with train.zero's defaults, installs no per-parameter gradient hook
    and takes the same steps as ZeRO-2 does."""
    cfgs = {
        stage: dsconfig.build(
            params(zero_stage=stage, precision="bf16")["train"], dsconfig.Batch(4, 1, 1), 6, "cpu"
        )
        for stage in (1, 2)
    }
    runs = one_rank(HOOKS_SCRIPT, cfgs, tmp_path)
    assert runs["1"]["hooks"] == 0 and runs["2"]["hooks"] == 4  # one per parameter tensor
    assert runs["1"]["losses"] == runs["2"]["losses"]
    assert len(set(runs["1"]["losses"])) == 6  # it trained


# --------------------------------------------------------------------------- checkpoints


def _tag(root: Path, tag: str, world: int, zero3: bool) -> None:
    path = root / tag
    path.mkdir(parents=True)
    names = [f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in range(world)]
    if zero3:
        names += [f"zero_pp_rank_{r}_mp_rank_00_model_states.pt" for r in range(world)]
    else:
        names.append(ckpt.MODEL_FILE)
    for name in names:
        (path / name).write_bytes(b"x" * 10)
    ckpt.write_manifest(root, tag, ckpt.step_of(tag), world, True)


def test_zero3_layout_validates_and_a_tag_of_another_world_size_is_resumable(tmp_path):
    _tag(tmp_path, "step00000005", 3, zero3=True)
    assert ckpt.validate_tag(tmp_path, "step00000005", 3, True) is None
    (tmp_path / "step00000005" / "zero_pp_rank_1_mp_rank_00_model_states.pt").unlink()
    problem = ckpt.validate_tag(tmp_path, "step00000005", 3, True)
    assert problem == "zero_pp_rank_1_mp_rank_00_model_states.pt missing"  # the manifest's
    (tmp_path / "step00000005" / ckpt.MANIFEST).unlink()  # the layout alone
    problem = ckpt.validate_tag(tmp_path, "step00000005", 3, True)
    assert problem == "model states of rank(s) 1 missing"
    _tag(tmp_path, "step00000010", 3, zero3=False)
    # Strict check: another world size is named; resume (elastic) takes it anyway.
    assert "saved by 3 rank(s)" in ckpt.validate_tag(tmp_path, "step00000010", 2, True)
    assert ckpt.resume_tag(tmp_path, 2, True) == "step00000010"
    assert ckpt.saved_world(tmp_path, "step00000010") == 3


def test_fingerprint_ignores_how_the_global_batch_is_split():
    a = params(gpus=3, micro_batch=2, grad_accum=2)
    b = params(gpus=2, micro_batch=2, grad_accum=3, global_batch=12)
    assert ckpt.fingerprint(a, 12, "d") == ckpt.fingerprint(b, 12, "d")
    assert ckpt.fingerprint(a, 12, "d") != ckpt.fingerprint(a, 8, "d")
    assert ckpt.fingerprint(a, 12, "d") != ckpt.fingerprint(params(zero_stage=3), 12, "d")
    # Where the ranks run and the speed-only ZeRO/offload knobs do not change the math either.
    c = params(gpus=3, micro_batch=2, grad_accum=2, nodes=2)
    c["train"]["zero"]["reduce_bucket_size"] = 1000
    c["train"]["offload"]["pin_memory"] = not c["train"]["offload"]["pin_memory"]
    assert ckpt.fingerprint(c, 12, "d") == ckpt.fingerprint(a, 12, "d")
    cpu_opt = params(gpus=3, micro_batch=2, grad_accum=2, offload={"optimizer": "cpu"})
    assert ckpt.fingerprint(cpu_opt, 12, "d") != ckpt.fingerprint(a, 12, "d")
    # The fast paths do not count, except FP8 (its matmuls round otherwise), and only when on.
    fast = params(gpus=3, micro_batch=2, grad_accum=2, perf={"compile": False, "fp8": False})
    assert ckpt.fingerprint(fast, 12, "d") == ckpt.fingerprint(a, 12, "d")
    fp8 = params(gpus=3, micro_batch=2, grad_accum=2, perf={"fp8": "tensorwise"})
    assert ckpt.fingerprint(fp8, 12, "d") != ckpt.fingerprint(a, 12, "d")


@pytest.mark.parametrize(
    "world, micro, says",
    [
        (2, 2, "set train.global_batch: 12 and grad_accum: null (micro_batch 2 x grad_accum 3"),
        (2, 4, "a micro_batch that divides 6"),
        (5, 2, "resume on a number of ranks that divides 12"),
    ],
    ids=["grad-accum", "micro-batch", "world"],
)
def test_another_world_size_with_another_global_batch_says_how_to_keep_it(
    tmp_path, world, micro, says
):
    old = params(gpus=3, micro_batch=2, grad_accum=2)
    (tmp_path / "run.json").write_text(
        json.dumps(
            {
                "world": 3,
                "batch": {"micro": 2, "accum": 2, "global": 12},
                "fingerprint": ckpt.fingerprint(old, 12, "d"),
            }
        )
    )
    new = params(gpus=world, micro_batch=micro, grad_accum=1)
    plan = {
        "world": world,
        "params": new,
        "data_sha": "d",
        "batch": {"micro": micro, "accum": 1, "global": micro * world},
    }
    with pytest.raises(UsageError) as exc:
        train.check_elastic_batch(tmp_path, plan)
    msg = str(exc.value)
    assert "\n" not in msg and "global batch 12 (2 x 2 x 3 ranks)" in msg and says in msg
    # Another change of the math (lr) is another run: no message (the stage starts fresh).
    plan["params"] = params_mod.deep_merge(new, {"train": {"optimizer": {"lr": 0.1}}})
    train.check_elastic_batch(tmp_path, plan)


def test_another_zero_layout_is_refused_rather_than_started_over(tmp_path):
    """Universal checkpoints do not load across ZeRO stages: a layout change (e.g. zero_stage
    auto on other GPUs) names the settings the checkpoints need instead of deleting them."""
    old = params(zero_stage=2, offload={"optimizer": "cpu"})
    (tmp_path / "run.json").write_text(
        json.dumps(
            {
                "params": old,
                "batch": {"micro": 8, "accum": 1, "global": 24},
                "fingerprint": ckpt.fingerprint(old, 24, "d"),
            }
        )
    )
    new = params(zero_stage=3)
    plan = {"params": new, "data_sha": "d", "batch": {"global": 24}}
    with pytest.raises(UsageError) as exc:
        train.check_layout(tmp_path, plan)
    msg = str(exc.value)
    assert "\n" not in msg
    assert "saved with ZeRO-2 + optimizer offload (cpu), this launch uses ZeRO-3" in msg
    assert "set train.zero_stage: 2, train.offload.optimizer: cpu to resume" in msg
    plan["params"] = params_mod.deep_merge(new, {"train": {"optimizer": {"lr": 0.1}}})
    train.check_layout(tmp_path, plan)  # another run: no message


def test_auto_keeps_the_layout_this_run_was_saved_in(prepared, tmp_path, monkeypatch):
    """zero_stage: auto picks by the GPUs at hand (ZeRO-1 on one, ZeRO-2 on several or on
    CPU), and a run cannot resume across stages: with this run in checkpoints/ saved at
    another stage, the train stage keeps that stage instead of refusing to resume."""
    import shutil

    from test_train import TRAIN

    repo = tmp_path / "repo"
    shutil.copytree(prepared, repo, ignore=shutil.ignore_patterns("checkpoints", "models"))
    monkeypatch.chdir(repo)
    auto = params_mod.validate(
        params_mod.deep_merge(
            params_mod.load(), {**TRAIN, "train": {**TRAIN["train"], "zero_stage": "auto"}}
        )
    )
    launched = []
    monkeypatch.setattr(train, "preflight", lambda params, plan, memory_plan: {})
    monkeypatch.setattr(train, "_run_locked", lambda plan, *rest: launched.append(plan))
    # Nothing saved: auto on CPU is ZeRO-2.
    train.run(auto)
    assert launched[-1]["ds_config"]["zero_optimization"]["stage"] == 2
    # This run saved at ZeRO-1 (e.g. on one GPU): kept.
    saved = train.resolve_run(params_mod.deep_merge(auto, {"train": {"zero_stage": 1}}))
    ckpt.CHECKPOINTS.mkdir(exist_ok=True)
    (ckpt.CHECKPOINTS / "run.json").write_text(json.dumps(saved))
    train.run(auto)
    assert launched[-1]["ds_config"]["zero_optimization"]["stage"] == 1
    assert launched[-1]["fingerprint"] == saved["fingerprint"]
    # Another run in checkpoints/ (another learning rate): auto picks afresh.
    other = params_mod.deep_merge(auto, {"train": {"optimizer": {"lr": 0.1}}})
    train.run(other)
    assert launched[-1]["ds_config"]["zero_optimization"]["stage"] == 2


def test_lockstep_validation_runs_as_many_forwards_on_every_rank():
    """ZeRO-3 hangs when one rank runs a forward the others do not: with 7 windows over 3 ranks
    (3, 2, 2) and micro 2, every rank runs 2 forwards, and the padding counts no loss."""
    import numpy as np
    import torch

    class Reader:
        seq_len, num_windows = 4, 7

        def tokens(self, start, length):
            return np.arange(start, start + length) % 5

        def sequential(self, rank, world, max_windows):
            for i in range(rank, min(max_windows, self.num_windows), world):
                yield self.tokens(i * self.seq_len, self.seq_len + 1)

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.calls = 0

        def forward(self, input_ids, use_cache=False):
            self.calls += 1
            logits = torch.zeros(*input_ids.shape, 5)

            class Out:
                pass

            out = Out()
            out.logits = logits
            return out

    counts, tokens = [], 0
    for rank in range(3):
        model = Model()
        _, n = evaluate_loss(
            model, Reader(), micro=2, device="cpu", rank=rank, world=3, max_windows=99,
            lockstep=True,
        )  # fmt: skip
        counts.append(model.calls)
        tokens += n
    assert counts == [2, 2, 2] and tokens == 7 * 4


# --------------------------------------------------------------------------- training


@pytest.fixture(scope="module")
def zero2(prepared, tmp_path_factory):
    """The reference: ZeRO-2, 3 ranks, global batch 12, uninterrupted, data traced."""
    repo = tmp_path_factory.mktemp("zero2") / "repo"
    trained_copy(prepared, repo, BATCH, env={"DSFLOW_DATA_TRACE": str(repo.parent / "trace")})
    return repo


def trace(path: Path) -> dict[int, Counter]:
    """step -> the windows (sha1) all ranks read in it."""
    out: dict[int, Counter] = {}
    for file in path.parent.glob(path.name + ".rank*"):
        for line in file.read_text().splitlines():
            row = json.loads(line)
            out.setdefault(row["step"], Counter()).update(row["windows"])
    return out


def assert_same_curve(a: dict, b: dict, rel: float = RTOL) -> None:
    assert sorted(a) == sorted(b) == list(range(1, 13))
    for step in a:
        assert b[step] == pytest.approx(a[step], rel=rel, abs=0), step


@pytest.mark.slow
@pytest.mark.parametrize(
    "stage, fused",
    [(0, False), (1, False), (1, True)],
    ids=["zero0", "zero1-deepspeed-checks", "zero1-fused-checks"],
)
def test_zero0_and_zero1_give_zero2s_loss_curve(prepared, zero2, tmp_path, stage, fused):
    """The bench's `zero0` and `zero1` levers (one GPU has nothing to partition: plain data
    parallelism, or no gradient partitioning) train the same curve; ZeRO-1 with DeepSpeed's
    gradient checks or the fused ones."""
    repo = tmp_path / f"zero{stage}"
    perf = {"fused_grad_checks": fused}
    proc = trained_copy(
        prepared, repo, {"train": {**BATCH["train"], "zero_stage": stage, "perf": perf}}
    )
    assert "not applicable" not in proc.stdout + proc.stderr  # fused checks, when asked, installed
    ds = json.loads((repo / "checkpoints/ds_config.json").read_text())
    assert ds["zero_optimization"]["stage"] == stage
    assert_same_curve(losses(zero2), losses(repo))


@pytest.fixture(scope="module")
def zero3(prepared, zero2, tmp_path_factory):
    repo = tmp_path_factory.mktemp("zero3") / "repo"
    trained_copy(prepared, repo, {**BATCH, "train": {**BATCH["train"], "zero_stage": 3}})
    return repo


@pytest.mark.slow
def test_zero3_gives_zero2s_loss_curve_and_exports_a_loadable_model(zero2, zero3):
    repo = zero3
    ds = json.loads((repo / "checkpoints/ds_config.json").read_text())
    assert ds["zero_optimization"]["stage"] == 3
    assert_same_curve(losses(zero2), losses(repo))
    metrics = json.loads((repo / "metrics/train.json").read_text())
    ref = json.loads((zero2 / "metrics/train.json").read_text())
    assert metrics["zero_stage"] == 3 and metrics["val_loss"] == pytest.approx(
        ref["val_loss"], rel=RTOL
    )
    # ZeRO-3 checkpoints: one model-states file per rank.
    tag = repo / "checkpoints" / "step00000012"
    assert sorted(p.name for p in tag.glob("zero_pp_rank_*_model_states.pt")) == [
        f"zero_pp_rank_{r}_mp_rank_00_model_states.pt" for r in range(3)
    ]
    # The export (gathered from the 3 partitions) reloads in HF and gives the same val loss
    # as the ZeRO-2 run's export.
    assert (repo / "models/final/model.safetensors").exists()
    assert exported_val_loss(repo) == pytest.approx(exported_val_loss(zero2), rel=RTOL)


@pytest.mark.slow
def test_export_consolidates_a_zero3_checkpoint_in_fp32_or_bf16(zero3):
    """`dsflow export`: the fp32 master weights of a ZeRO-3 checkpoint, gathered from every
    rank's partition, as an HF model (fp32 training: the weights of models/final); and bf16."""
    repo = zero3
    final = exported_val_loss(repo)
    dsflow("export", "--tag", "step00000012", "--out", "models/fp32", cwd=repo)
    assert exported_val_loss(repo, "models/fp32") == pytest.approx(final, rel=RTOL)
    dsflow("export", "--dtype", "bf16", "--out", "models/bf16", cwd=repo)
    assert exported_val_loss(repo, "models/bf16") == pytest.approx(final, rel=1e-2)
    from safetensors import safe_open

    with safe_open(repo / "models/bf16/model.safetensors", "pt") as f:
        dtypes = {k: str(f.get_tensor(k).dtype) for k in f.keys()}
    bias = {d for k, d in dtypes.items() if "e_score_correction_bias" in k}
    assert bias == {"torch.float32"}  # the routing bias stays fp32 (balance.py)
    assert {d for k, d in dtypes.items() if "e_score_correction_bias" not in k} == {
        "torch.bfloat16"
    }


@pytest.mark.slow
def test_zero3_with_cpu_optimizer_offload_gives_the_same_curve(prepared, zero2, tmp_path):
    repo = tmp_path / "offload"
    overlay = {"train": {**BATCH["train"], "zero_stage": 3, "offload": {"optimizer": "cpu"}}}
    trained_copy(prepared, repo, overlay)
    ds = json.loads((repo / "checkpoints/ds_config.json").read_text())
    assert ds["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    assert ds["optimizer"]["params"]["torch_adam"] is True  # DeepSpeedCPUAdam needs a build
    metrics = json.loads((repo / "metrics/train.json").read_text())
    assert (metrics["offload_optimizer"], metrics["offload_param"]) == ("cpu", "none")

    assert zero_layout(metrics) == "3 + optimizer offload (cpu)"
    assert_same_curve(losses(zero2), losses(repo))


@pytest.mark.slow
def test_zero3_with_the_fused_cross_entropy_gives_the_same_curve(prepared, zero2, tmp_path):
    """The fused loss reads lm_head.weight without calling lm_head: ZeRO-3 must still gather it
    (DeepSpeed's external-parameter gathering inside the engine's forward)."""
    repo = tmp_path / "fused"
    perf = {"ce_chunk": 37, "attention": "flash_padded"}
    trained_copy(prepared, repo, {"train": {**BATCH["train"], "zero_stage": 3, "perf": perf}})
    assert_same_curve(losses(zero2), losses(repo))


@pytest.mark.slow
@pytest.mark.parametrize("stage", [2, 3])
def test_elastic_resume_on_fewer_ranks_continues_the_same_run(
    prepared, zero2, tmp_path, request, stage
):
    """The uninterrupted 3-rank run at this ZeRO stage, rewound to its checkpoint of step 5 (as
    a run killed after step 7 leaves it), resumed on 2: the same global batch, the same windows
    per step, the same losses as the uninterrupted 3-rank run."""
    source = zero2 if stage == 2 else request.getfixturevalue("zero3")
    repo = rewound_copy(source, tmp_path / "elastic", 5)
    overlay = {"train": {**BATCH["train"], "zero_stage": stage}}

    # 2 ranks with the old micro/accum would change the global batch: refused, nothing lost.
    two = {"train": {**overlay["train"], "gpus": 2}}
    proc = trained_copy(prepared, repo, two, check=False)
    assert proc.returncode == 2
    assert "train.global_batch: 12" in proc.stderr and len(proc.stderr.strip().splitlines()) <= 3
    assert ckpt.tags(repo / "checkpoints") == ["step00000005"]

    two["train"].update(global_batch=12, grad_accum=None)
    data = repo.parent / "trace"
    proc = trained_copy(prepared, repo, two, env={"DSFLOW_DATA_TRACE": str(data)})
    assert "saved by 3 rank(s), this run has 2" in proc.stderr
    assert "resumed from step 5" in proc.stderr
    ds = json.loads((repo / "checkpoints/ds_config.json").read_text())
    assert ds["gradient_accumulation_steps"] == 3 and ds["train_batch_size"] == 12
    assert json.loads((repo / "metrics/train.json").read_text())["world_size"] == 2

    resumed, reference = trace(data), trace(zero2.parent / "trace")
    assert sorted(resumed) == list(range(6, 13))
    for step in resumed:
        assert resumed[step] == reference[step], step
    assert_same_curve(losses(zero2), losses(repo))
    assert exported_val_loss(repo) == pytest.approx(exported_val_loss(zero2), rel=RTOL)


@pytest.mark.slow
def test_zero3_skips_non_finite_updates_and_stops_after_max_bad_steps(prepared, tmp_path):
    """ZeRO-3's overflow check skips a NaN step's update like ZeRO 1/2 (StepHealth then stops
    the run after train.max_bad_steps, keeping the last good checkpoint)."""
    repo = tmp_path / "nan"
    overlay = {"train": {"zero_stage": 3, "max_bad_steps": 2}}
    proc = trained_copy(
        prepared, repo, overlay, env={"DSFLOW_FAULT_NAN_FROM_STEP": "8"}, check=False
    )
    assert proc.returncode == 2
    assert "for 2 consecutive step(s) (steps 8-9" in proc.stderr
    assert "their updates were skipped" in proc.stderr
    assert ckpt.tags(repo / "checkpoints") == ["step00000005"]
