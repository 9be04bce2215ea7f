"""What only a GPU can check: the train stage's fast paths with CUDA graphs and CUDA kernels.

Skipped without a CUDA GPU (CI); on the GPU host: `python -m pytest -m cuda`. The bare copy of
the tree the GPU host gets has no .git: conftest's project copy works without one (checked
here on every machine)."""

from __future__ import annotations

import json
import math

import pytest
from test_train import losses, trained_copy

import conftest
from conftest import requires_cuda

ON_GPU = {
    "train": {
        "device": "cuda",
        "gpus": 1,
        "micro_batch": 4,
        "zero_stage": 2,
    }
}
PLAIN = {
    "compile": False,
    "attention": "sdpa",
    "ce_chunk": 0,
    "prefetch": False,
    "fused_grad_checks": False,
    "experts": "hf",
}
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
    # Every step's difference in the message: growing step by step is rounding that the MoE
    # routing amplifies, a jump at one step is a bug (on one H200, sixth session, step 11 of 12
    # was 1.2e-3 off with everything before it inside).
    rel = {step: abs(fast[step] - plain[step]) / abs(plain[step]) for step in plain}
    assert max(rel.values()) <= 1e-3, rel
    # Each step's loss is its own: a stale graph output would repeat the previous one.
    assert len(set(fast.values())) == len(fast)


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

    from dsflow.balance import ExpertBalancer
    from dsflow.model import build_model, model_config

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
