"""What only a GPU can check: the train stage's fast paths with CUDA graphs and CUDA kernels.

Skipped without a CUDA GPU (CI); on the GPU host: `python -m pytest -m cuda`. The bare copy of
the tree the GPU host gets has no .git: conftest's project copy works without one (checked
here on every machine)."""

from __future__ import annotations

import json
import math

import pytest
from test_train import trained_copy

import conftest
from conftest import losses, requires_cuda
from dsflow.model import fastpaths

ON_GPU = {
    "train": {
        "device": "cuda",
        "gpus": 1,
        "micro_batch": 4,
        "zero_stage": 2,
    }
}
PLAIN = fastpaths.PLAIN
# Every CUDA fast path at once, the opt-in CUDA graphs included: CUDA graphs around each compiled
# layer, flash attention on padded V, the fused loss (a chunk that does not divide the batch),
# pinned prefetch, fused gradient checks, the sorted experts, router hooks in the graphs.
FAST = {
    "compile": True,
    "compile_mode": "reduce-overhead",
    "attention": "flash_padded",
    "ce_chunk": 37,
    "prefetch": True,
    "fused_grad_checks": True,
    "experts": "sorted",
    "compile_router_hooks": True,
}


def test_project_copy_without_git_holds_the_same_files(monkeypatch):
    with_git = conftest.project_files()

    def no_git(*args, **kwargs):
        raise FileNotFoundError("git")

    monkeypatch.setattr(conftest.subprocess, "run", no_git)
    assert conftest.project_files() == sorted(with_git)


def gpu_run(prepared, repo, precision: str, perf: dict):
    overlay = {"train": {**ON_GPU["train"], "precision": precision, "perf": perf}}
    trained_copy(prepared, repo, overlay)
    return losses(repo)


@pytest.mark.slow
@pytest.mark.cuda
@requires_cuda
def test_cuda_fast_paths_train_the_same_curve(prepared, tmp_path):
    """fp32 on one GPU: compiled layers replayed as CUDA graphs (outputs of one replay are
    overwritten by the next: a loss kept across steps would show it), attention on padded V
    (in fp32 SDPA takes its memory-efficient kernel; the flash one runs in the bf16 test), the
    fused loss and the fused gradient checks give the eager path's losses. Kernels fuse and
    reduce in another order, so the tolerance is rounding over 12 steps, not bit-equality."""
    plain = gpu_run(prepared, tmp_path / "plain", "fp32", PLAIN)
    fast = gpu_run(prepared, tmp_path / "fast", "fp32", FAST)
    assert plain.keys() == fast.keys()
    # Step 1 has the same weights and batch in both: its gradient norm differs by rounding
    # only. (Compiled sorted experts in fp32 once lost their gradients on an H200: the norm was
    # 1.8% off with the loss 8e-8 off, since Adam's per-element normalization hid it from the
    # losses until step 4; see fastpaths.sorted_experts_forward and docs/log.md.)
    norms = [losses(tmp_path / run, "train/grad_norm")[1] for run in ("plain", "fast")]
    assert norms[1] == pytest.approx(norms[0], rel=1e-4), norms
    # Every step's difference in the message: growing step by step is rounding that the MoE
    # routing amplifies, a jump at one step is a bug.
    rel = {step: abs(fast[step] - plain[step]) / abs(plain[step]) for step in plain}
    assert max(rel.values()) <= 1e-3, rel
    # Each step's loss is its own: a stale graph output would repeat the previous one.
    assert len(set(fast.values())) == len(fast)


# One fast path at a time on top of PLAIN (fastpaths.Perf's fields, as train.perf names them).
ALONE = {
    "attention": {"attention": "flash_padded"},
    "ce_chunk": {"ce_chunk": 37},
    "prefetch": {"prefetch": True},
    "fused_grad_checks": {"fused_grad_checks": True},
    "experts": {"experts": "sorted"},
    "compile": {"compile": True, "compile_router_hooks": False},
    "compile_router_hooks": {"compile": True, "compile_router_hooks": True},
}
ALL_BUT_GRAPHS = {**FAST, "compile_mode": "default"}
# The paths that act on the model itself (fastpaths.apply), for one forward and backward.
ON_MODEL = ("attention", "ce_chunk", "experts", "compile", "compile_router_hooks")
MODEL_PATHS = {name: ALONE[name] for name in ON_MODEL} | {"all": ALL_BUT_GRAPHS}


def fast_path_gradients(
    device: str,
    path: dict,
    dtype: str = "float32",
    family: str = "deepseek_v3",
    vocab: int = 384,
):
    """One forward and backward of the tiny preset in `dtype` (a batch like the train tests':
    4 x 64 tokens), the family's balance loss included: (loss, aux, {name: fp32 gradient}).
    `path`: fastpaths.Perf's fields over PLAIN's ({} for the plain path); `family`: the tiny
    shape as a DeepSeek-V3 or a DeepSeek-V2 model; `vocab`: its vocabulary."""
    import torch
    import torch._dynamo

    from dsflow.model import fastpaths
    from dsflow.model.balance import ExpertBalancer
    from dsflow.model.build import build_model
    from dsflow.model.loss import TrainingLM
    from dsflow.model.presets import model_config

    torch._dynamo.reset()
    torch.manual_seed(0)
    if family == "deepseek_v2":
        config = model_config("deepseek-v2-lite", vocab, conftest.tiny_v2())
    else:
        config = model_config("tiny", vocab)
    model = build_model(config, device_type=device).to(device).train()
    for p in model.parameters():  # as DeepSpeed casts: parameters, not buffers
        p.data = p.data.to(getattr(torch, dtype))
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, vocab, (4, 65), generator=g).to(device)
    balancer = ExpertBalancer(model, gamma=0.0, seq_aux_alpha=0.01)
    wanted = fastpaths.Perf(**{**PLAIN, **path})
    perf = fastpaths.apply(model, wanted, balancer, torch.device(device))
    assert perf.experts == wanted.experts
    # As the train stage builds it (dsflow.train.engine): the fused loss compiled with the layers.
    trainee = TrainingLM(model, ce_chunk=perf.ce_chunk, hf_loss=perf.liger, compiled=perf.compile)
    for _ in range(2):  # the second call runs the compiled graphs from their cache
        model.zero_grad(set_to_none=True)
        loss = trainee(tokens[:, :-1], tokens[:, 1:])
        aux = balancer.aux_loss()
        (loss + aux).backward()
    grads = {n: p.grad.float() for n, p in model.named_parameters() if p.grad is not None}
    return loss.item(), aux.item(), grads


def gradient_gaps(a: dict, b: dict) -> dict[str, float]:
    """Each parameter's |b - a| / |a| (L2 over the tensor), and the whole gradient's."""
    import torch

    assert a.keys() == b.keys()
    gaps = {n: ((b[n] - a[n]).norm() / a[n].norm().clamp_min(1e-30)).item() for n in a}
    total = torch.stack([g.norm() for g in a.values()]).norm()
    gaps["(all)"] = (torch.stack([(b[n] - a[n]).norm() for n in a]).norm() / total).item()
    return gaps


@pytest.fixture(scope="module")
def plain_gradients():
    """The plain path's, per family, computed once."""
    cache = {}

    def of(family):
        if family not in cache:
            cache[family] = fast_path_gradients("cuda", {}, family=family)
        return cache[family]

    return of


@pytest.mark.cuda
@requires_cuda
@pytest.mark.parametrize("family", ["deepseek_v3", "deepseek_v2"])
@pytest.mark.parametrize("path", MODEL_PATHS)
def test_cuda_each_fast_path_gives_the_plain_paths_gradients(plain_gradients, path, family):
    """fp32 on the GPU, one forward and backward: each fast path's loss and aux loss are the
    plain path's, and so is every parameter's gradient, to fp32 rounding (1e-4 of the
    tensor's norm). The losses of a training run cannot show this: Adam's first steps
    normalize each gradient element, so a wrong gradient scale hides for a few steps (a step-1
    gradient norm 1.8% off can come with a loss 8e-8 off)."""
    loss0, aux0, plain = plain_gradients(family)
    loss, aux, fast = fast_path_gradients("cuda", MODEL_PATHS[path], family=family)
    assert loss == pytest.approx(loss0, rel=1e-5)
    assert aux == pytest.approx(aux0, rel=1e-5)
    gaps = gradient_gaps(plain, fast)
    worst = sorted(gaps.items(), key=lambda kv: -kv[1])[:8]
    assert max(gaps.values()) <= 1e-4, worst


@pytest.mark.cuda
@requires_cuda
def test_cuda_fast_paths_with_a_vocabulary_no_multiple_of_8_give_the_plain_paths_gradients():
    """A small tokenizer's vocabulary (383): the fused loss pads the head's weight to 384 rows
    for cuBLAS's aligned GEMMs and leaves the padding out of its compiled softmax; fp32, every
    fast path but CUDA graphs, against the plain path, as above."""
    loss0, aux0, plain = fast_path_gradients("cuda", {}, vocab=383)
    loss, aux, fast = fast_path_gradients("cuda", ALL_BUT_GRAPHS, vocab=383)
    assert loss == pytest.approx(loss0, rel=1e-5)
    assert aux == pytest.approx(aux0, rel=1e-5)
    gaps = gradient_gaps(plain, fast)
    assert max(gaps.values()) <= 1e-4, sorted(gaps.items(), key=lambda kv: -kv[1])[:8]


@pytest.mark.cuda
@requires_cuda
@pytest.mark.parametrize("family", ["deepseek_v3", "deepseek_v2"])
def test_cuda_default_fast_paths_keep_every_gradient_in_bf16(family):
    """bf16, the GPU's default, one forward and backward with every fast path but CUDA graphs
    against the plain path: each parameter's gradient within bf16's rounding, which also moves
    a few tokens to other experts (a gap of about 0.16 of the worst tensor's norm; a lost
    gradient is a gap of 1)."""
    loss0, aux0, plain = fast_path_gradients("cuda", {}, "bfloat16", family)
    loss, aux, fast = fast_path_gradients("cuda", ALL_BUT_GRAPHS, "bfloat16", family)
    assert loss == pytest.approx(loss0, rel=1e-2)
    assert aux == pytest.approx(aux0, rel=5e-2)
    gaps = gradient_gaps(plain, fast)
    worst = sorted(gaps.items(), key=lambda kv: -kv[1])[:8]
    assert max(gaps.values()) < 0.5, worst


# The maintained kernels a user of HF plugs in (dsflow.model.hfkernels), each for its part:
# HF's sonicmoe experts (the sonic-moe package), Liger Kernel (RMSNorm, SwiGLU MLPs, fused MoE,
# fused lm_head + cross-entropy). Their packages pin other torch versions than the GPU host's
# and are installed without the pins (bench/README.md): these runs are what vouches for them.
MAINTAINED = {"sonicmoe": {"experts": "sonicmoe"}, "liger": {"liger": True}}


def maintained_kernel_ready(path: str, family: str) -> None:
    """Skips where the path's package is not installed; fails, with dsflow's one-line reason,
    where it is installed but cannot run here."""
    import importlib.util

    from dsflow import machine
    from dsflow.model import hfkernels

    package = {"sonicmoe": "sonicmoe", "liger": "liger_kernel"}[path]
    if importlib.util.find_spec(package) is None:
        pytest.skip(f"{package} is not installed (bench/README.md: Maintained kernels)")
    if path == "sonicmoe":
        assert hfkernels.sonicmoe_refusal(machine.gpus()) is None
    else:
        hfkernels.check_liger(family, 0)


@pytest.fixture
def hf_classes_restored(monkeypatch):
    """Liger also swaps the classes of HF's DeepSeek modules (for models built later): put them
    back after the test, so that the other tests build stock HF models."""
    from transformers.models.deepseek_v2 import modeling_deepseek_v2 as v2
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as v3

    for module, prefix in ((v3, "DeepseekV3"), (v2, "DeepseekV2")):
        for name in ("RMSNorm", "MLP", "Experts", "ForCausalLM"):
            monkeypatch.setattr(module, prefix + name, getattr(module, prefix + name))
        causal_lm = getattr(module, prefix + "ForCausalLM")
        monkeypatch.setattr(causal_lm, "forward", causal_lm.forward)


@pytest.mark.cuda
@requires_cuda
@pytest.mark.parametrize("family", ["deepseek_v3", "deepseek_v2"])
@pytest.mark.parametrize("path", MAINTAINED)
def test_cuda_maintained_kernels_keep_every_gradient_in_bf16(path, family, hf_classes_restored):
    """bf16, one forward and backward with HF's sonicmoe experts or with Liger Kernel against
    the plain path (HF's grouped_mm, full logits): the losses and each parameter's gradient
    within bf16's rounding, the bound dsflow's own fast paths meet (above)."""
    maintained_kernel_ready(path, family)
    loss0, aux0, plain = fast_path_gradients("cuda", {}, "bfloat16", family)
    loss, aux, fast = fast_path_gradients("cuda", MAINTAINED[path], "bfloat16", family)
    assert loss == pytest.approx(loss0, rel=1e-2)
    assert aux == pytest.approx(aux0, rel=5e-2)
    gaps = gradient_gaps(plain, fast)
    worst = sorted(gaps.items(), key=lambda kv: -kv[1])[:8]
    assert max(gaps.values()) < 0.5, worst


# In the train stage (DeepSpeed ZeRO-2 with its CUDA streams, pinned prefetch, the fused
# checks): each path alone, and every path at ZeRO-1, one rank without DeepSpeed's gradient
# hooks and overlap_comm's side stream (zero_stage is not a perf key: step_one takes it out).
TRAIN_PATHS = {**ALONE, "all-zero1": {**ALL_BUT_GRAPHS, "zero_stage": 1}}
STEP_ONE_METRICS = ("train/loss", "train/grad_norm", "experts/max_over_mean", "experts/entropy_min")


def step_one(prepared, repo, perf: dict) -> dict[str, dict[int, float]]:
    """Steps 1 and 2 of a 2-step fp32 run on one GPU: {metric: {step: value}}. The learning
    rate of step 1 is 0 (warm-up), so step 2 runs step 1's weights too, with the router
    biases that the balancer moved after step 1."""
    perf = dict(perf)
    stage = perf.pop("zero_stage", ON_GPU["train"]["zero_stage"])
    train = {**ON_GPU["train"], "precision": "fp32", "max_steps": 2, "zero_stage": stage}
    train["perf"] = perf
    trained_copy(prepared, repo, {"train": train})
    metrics = {name: losses(repo, name) for name in STEP_ONE_METRICS}
    assert losses(repo, "train/lr")[1] == 0.0
    return metrics


@pytest.fixture(scope="module")
def plain_step_one(prepared, tmp_path_factory):
    return step_one(prepared, tmp_path_factory.mktemp("plain-step-one") / "repo", PLAIN)


@pytest.mark.slow
@pytest.mark.cuda
@requires_cuda
@pytest.mark.parametrize("path", TRAIN_PATHS)
def test_cuda_each_fast_path_keeps_step_ones_gradient_norm(
    prepared, plain_step_one, tmp_path, path
):
    """Steps 1 and 2 run the same weights and batches whatever the path (step 1's learning
    rate is 0): the same losses, gradient norms and expert loads to fp32 rounding, one path
    at a time, and all of them together at ZeRO-1 (all-zero1: no DeepSpeed gradient hooks, no
    overlap_comm side stream), which tells DeepSpeed's machinery from the kernels. Step 2 also
    sees the router biases after the balancer's first update, so a path that counts experts
    differently shows there."""
    fast = step_one(prepared, tmp_path / "repo", {**PLAIN, **TRAIN_PATHS[path]})
    got = {(name, step): fast[name][step] for name in STEP_ONE_METRICS for step in (1, 2)}
    want = {
        (name, step): plain_step_one[name][step] for name in STEP_ONE_METRICS for step in (1, 2)
    }
    rel = {key: abs(got[key] - want[key]) / abs(want[key]) for key in want}
    assert max(rel.values()) <= 1e-4, (path, {k: (got[k], want[k]) for k in want if rel[k] > 1e-4})


@pytest.mark.slow
@pytest.mark.cuda
@requires_cuda
def test_cuda_fast_paths_train_in_bf16(prepared, tmp_path):
    """bf16 on one GPU, where the fused checks met a dtype gap before: the run completes, no
    step is skipped as an overflow, and the loss falls."""
    repo = tmp_path / "bf16"
    fast = gpu_run(prepared, repo, "bf16", FAST)
    metrics = json.loads((repo / "metrics/train.json").read_text())
    assert metrics["skipped_steps"] == 0
    assert all(math.isfinite(v) for v in fast.values())
    first, last = fast[min(fast)], fast[max(fast)]
    assert last < first - 0.5, (first, last)


@pytest.mark.cuda
@requires_cuda
def test_expert_counting_and_update_do_not_sync_the_gpu_in_forward():
    """The balancer's router hook runs inside every MoE layer's forward: a device sync there
    (torch.bincount reads its input's max back to size its output) would idle the GPU once
    per layer. Under CUDA's sync debug mode a synchronizing call raises."""
    import torch

    from dsflow.model.balance import ExpertBalancer
    from dsflow.model.build import build_model
    from dsflow.model.presets import model_config

    torch.manual_seed(0)
    model = build_model(model_config("tiny", 256), device_type="cuda").cuda().train()
    bal = ExpertBalancer(model, gamma=1e-3, seq_aux_alpha=1e-4)
    _, router = bal.routers[0]
    tokens, k = 64, model.config.num_experts_per_tok
    hidden = torch.randn(2, tokens // 2, model.config.hidden_size, device="cuda")
    logits = torch.randn(tokens, bal.n_experts, device="cuda", requires_grad=True)
    topk = torch.randint(0, bal.n_experts, (tokens, k), device="cuda")
    bal._buffer("_counts", topk.device)  # allocated once, outside the loop
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        bal._on_route(0, router, (hidden,), {}, (logits, None, topk))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert (
        bal.counts()[0].tolist() == torch.bincount(topk.flatten(), minlength=bal.n_experts).tolist()
    )
    assert len(bal._aux) == 1  # stashed for the sequence-wise aux loss


@pytest.mark.cuda
@requires_cuda
def test_fused_optimizer_kernel_takes_fusedadams_step():
    """train.perf.optimizer: fused on a GPU: the Triton kernel against what DeepSpeed runs there
    (its bf16 wrapper's fp32 gradients, clipped, then FusedAdam on the fp32 masters). The same
    formula in fp32; the compilers may contract multiply-adds differently, so the masters
    agree to a few ulp and the bf16 weights are the masters' rounding."""
    import torch
    from deepspeed.ops.adam import FusedAdam

    from dsflow.train.masteradam import MasterAdamW

    torch.manual_seed(0)
    # Sizes around the kernel's block (2048), one odd, one much larger.
    shapes = [(3,), (2048,), (2049,), (37, 91), (64, 320, 129)]
    weights = [torch.randn(s, device="cuda") for s in shapes]
    params = [torch.nn.Parameter(w.to(torch.bfloat16)) for w in weights]
    masters = [torch.nn.Parameter(p.detach().float()) for p in params]
    hyper = {"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
    opt = MasterAdamW(params, max_grad_norm=1.0, **hyper)
    ref = FusedAdam(masters, adam_w_mode=True, **hyper)
    for _ in range(5):
        grads = [torch.randn_like(p) * 0.05 for p in params]
        for p, g in zip(params, grads, strict=True):
            p.grad = g
        norm = torch.linalg.vector_norm(
            torch.stack(torch._foreach_norm(grads, 2, dtype=torch.float32))
        )
        combined = (norm + 1e-6) / 1.0
        assert combined > 1  # clipping is active
        for q, g in zip(masters, grads, strict=True):
            q.grad = g.float().mul_(1.0 / combined)
        ref.step()
        opt.step()
        assert not opt.overflow
    for i, (p, q) in enumerate(zip(params, masters, strict=True)):
        mine = opt._view(0, "master", i)
        torch.testing.assert_close(mine, q.detach(), rtol=1e-6, atol=1e-7)
        assert torch.equal(p, mine.to(torch.bfloat16))
        assert (p.float() - q.detach()).abs().max() <= q.detach().abs().max() * 2**-7


# One GPU, bf16, zero_stage auto and every train.perf default: the fused optimizer at ZeRO-0
# and each step's numbers read one step late.
ONE_GPU = {"train": {**ON_GPU["train"], "precision": "bf16", "zero_stage": "auto"}}


@pytest.fixture(scope="module")
def gpu_defaults(prepared, tmp_path_factory):
    """A run with one GPU's defaults, shared by the tests below (each run compiles for about
    a minute and a half on the H200)."""
    repo = tmp_path_factory.mktemp("gpu-defaults") / "repo"
    proc = trained_copy(prepared, repo, ONE_GPU)
    return repo, proc


@pytest.mark.slow
@pytest.mark.cuda
@requires_cuda
def test_cuda_fused_optimizer_trains_like_deepspeeds(prepared, gpu_defaults, tmp_path):
    """One GPU's defaults (optimizer auto = the fused one, at ZeRO-0) against DeepSpeed's
    ZeRO-1 optimizer: the same curve within bf16 rounding, no step skipped."""
    fused, proc = gpu_defaults
    assert "optimizer fused AdamW" in proc.stderr
    config = json.loads((fused / "checkpoints/ds_config.json").read_text())
    assert config["zero_optimization"]["stage"] == 0 and "bf16" not in config
    ds = tmp_path / "deepspeed"
    train = {**ONE_GPU["train"], "perf": {"optimizer": "deepspeed"}}
    trained_copy(prepared, ds, {"train": train})
    a, b = losses(ds), losses(fused)
    assert json.loads((fused / "metrics/train.json").read_text())["skipped_steps"] == 0
    rel = {step: abs(b[step] - a[step]) / abs(a[step]) for step in a}
    assert max(rel.values()) <= 2e-2, rel
    assert b[max(b)] < b[min(b)] - 0.5


@pytest.mark.slow
@pytest.mark.cuda
@requires_cuda
def test_cuda_numbers_read_one_step_late_are_the_numbers_read_at_once(
    prepared, gpu_defaults, tmp_path
):
    """train.perf.async_metrics on a GPU (pinned copies, CUDA events), with the fused
    optimizer, whose `applied` stays on the device: one GPU's defaults (read late) and the
    same run read at once log the same losses and gradient norms (the same kernels: at most
    the run-to-run noise of atomics), a positive time for every step, and step times that add
    up to no more than the run's wall time."""
    late, proc = gpu_defaults
    assert "step metrics read one step late" in proc.stderr
    now = tmp_path / "now"
    trained_copy(prepared, now, {"train": {**ONE_GPU["train"], "perf": {"async_metrics": False}}})
    for name in ("train/loss", "train/grad_norm"):
        a, b = losses(now, name), losses(late, name)
        assert a.keys() == b.keys()
        for step in a:
            assert b[step] == pytest.approx(a[step], rel=1e-2), (name, step)
    step_s = losses(late, "perf/step_s")
    assert sorted(step_s) == sorted(losses(late)) and min(step_s.values()) > 0
    metrics = json.loads((late / "metrics/train.json").read_text())
    assert sum(step_s.values()) <= metrics["wall_s"]


@requires_cuda
@pytest.mark.cuda
def test_memory_by_stream_names_each_streams_pool():
    """The profiler's memory table: memory allocated on a side stream is its own pool."""
    import torch

    from dsflow.train.diagnostics import memory_by_stream

    side = torch.cuda.Stream()
    main = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
    with torch.cuda.stream(side):
        other = torch.empty(32 << 20, dtype=torch.uint8, device="cuda")
    table = memory_by_stream().splitlines()
    streams = [line.split()[0] for line in table[1:] if line.split()[0].isdigit()]
    assert len(set(streams)) >= 2, table
    assert any(line.startswith("reserved_bytes: now") for line in table)
    assert main.numel() and other.numel()
