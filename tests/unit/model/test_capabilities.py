"""A consumer GPU takes the fast paths: every compute-capability gate, on CPU, with the GPUs of
compute capability 8.0 (A100), 8.6 (RTX 3090), 8.9 (RTX 4090) and 9.0 (H100) faked. Each gate
is asked as the train stage asks it, and no Hopper-only kernel (torch's CUTLASS grouped GEMM in
bf16, torch's FP8 grouped GEMM, SonicMoE) is chosen below 9.0."""

from __future__ import annotations

import pytest
import torch

from dsflow.errors import UsageError
from dsflow.model import fastpaths, float8, hfkernels

GPUS = {
    (8, 0): "NVIDIA A100-SXM4-80GB",
    (8, 6): "NVIDIA GeForce RTX 3090",
    (8, 9): "NVIDIA GeForce RTX 4090",
    (9, 0): "NVIDIA H100 80GB HBM3",
}


def _gpus(capability: tuple[int, int], n: int = 3) -> list[dict]:
    return [
        {"index": i, "name": GPUS[capability], "capability": list(capability)} for i in range(n)
    ]


@pytest.mark.parametrize("capability", list(GPUS))
def test_every_gate_opens_what_the_gpu_has_and_nothing_hopper_only_below_9(capability, monkeypatch):
    hopper = capability[0] == 9
    gpus = _gpus(capability)
    # The routed experts' grouped GEMM: CUTLASS's (torch) in bf16 on Hopper only; dsflow's
    # Triton GEMM for fp16 everywhere and bf16 below 9.0; in both precisions inside the
    # compiled layers (no host sync), on every one of these GPUs.
    assert fastpaths.grouped_gemm(torch.bfloat16, capability) == ("torch" if hopper else "triton")
    assert fastpaths.grouped_gemm(torch.float16, capability) == "triton"
    for precision in ("bf16", "fp16"):
        assert fastpaths.experts_in_graph("sorted", precision, [capability] * 3)
    # FP8 linears (torchao): tensor cores for FP8 from 8.9 (Ada) on.
    if capability >= float8.MIN_CAPABILITY:
        float8.check_gpus("tensorwise", gpus)
    else:
        with pytest.raises(UsageError, match=r"train\.perf\.fp8: tensorwise needs FP8"):
            float8.check_gpus("tensorwise", gpus)
    # FP8 routed experts: torch's FP8 grouped GEMM is Hopper's alone.
    monkeypatch.setattr(fastpaths, "_torchao_fp8_grouped_mm", lambda: object())
    if hopper:
        fastpaths.check_fp8_experts_machine("cuda", gpus)
    else:
        with pytest.raises(UsageError, match=r"train\.perf\.fp8_experts: true needs torch's FP8"):
            fastpaths.check_fp8_experts_machine("cuda", gpus)
    # HF's SonicMoE experts (experts: hf-best), with the package faked as installed: Hopper's
    # only; below 9.0 HF's grouped_mm, and the line says why.
    monkeypatch.setattr(hfkernels, "sonicmoe_missing", lambda: None)
    perf = fastpaths.resolve({"experts": "hf-best"}, "cuda", 2, "bf16")
    picked = hfkernels.pick_experts(perf, gpus)
    assert picked.experts == ("sonicmoe" if hopper else "hf")
    if not hopper:
        assert f"is {capability[0]}.{capability[1]}" in picked.experts_why
        assert "grouped_mm" in hfkernels.experts_line(picked, "cuda")


def test_a_gpu_without_a_grouped_gemm_keeps_hfs_experts_out_of_the_compiled_layers():
    """Below 8.0 (a V100, a T4) neither GEMM runs: the planner and the train stage keep HF's
    experts eager, and one such GPU among others decides for the run."""
    assert not fastpaths.experts_in_graph("sorted", "bf16", [(7, 0)])
    assert not fastpaths.experts_in_graph("sorted", "fp16", [(8, 9), (7, 5)])
