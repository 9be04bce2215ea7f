"""The Triton grouped GEMM (dsflow.model.groupgemm) and which GPUs take it: the sorted experts'
GEMMs for fp16 and for GPUs below compute capability 9.0, where torch's grouped GEMM falls back
to a GEMM per expert behind a host sync. The kernels run in Triton's interpreter here
(TRITON_INTERPRET=1), in fp32 and fp16 (the interpreter gets bf16 dot products wrong: bf16
is checked on the GPU, tests/e2e/test_cuda.py)."""

from __future__ import annotations

import copy

import pytest
import torch
from test_fastpaths import batch, tiny
from torch.fx.experimental.proxy_tensor import make_fx

from dsflow.errors import UsageError
from dsflow.model import fastpaths, groupgemm

# Compute capabilities of the GPUs dsflow is for: A100, RTX 3090, RTX 4090 / L40, H100.
CAPABILITIES = [(8, 0), (8, 6), (8, 9), (9, 0)]


@pytest.fixture
def interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def groups(counts: list[int]) -> torch.Tensor:
    return torch.tensor(counts).cumsum(0).to(torch.int32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_triton_grouped_mm_matches_torchs_forward_and_both_gradients(interpret, dtype):
    """Groups of 64, 0, 128 and 64 rows (an empty expert included), widths that are not
    multiples of the tiles, the weight a transposed view (as the experts pass it): the product
    and both gradients equal torch's grouped GEMM in fp32."""
    torch.manual_seed(0)
    ends = groups([64, 0, 128, 64])
    x = torch.randn(256, 48, dtype=dtype, requires_grad=True)
    w = torch.randn(4, 80, 48, dtype=dtype).transpose(1, 2).requires_grad_()
    out = groupgemm.grouped_mm(x, w, ends)
    grad = torch.randn_like(out)
    out.backward(grad)
    x32, w32 = x.detach().float().requires_grad_(), w.detach().float().requires_grad_()
    ref = torch._grouped_mm(x32, w32, offs=ends)
    ref.backward(grad.float())
    tol = dict(rtol=1e-5, atol=1e-4) if dtype == torch.float32 else dict(rtol=1e-2, atol=3e-2)
    torch.testing.assert_close(out.float(), ref, **tol)
    torch.testing.assert_close(x.grad.float(), x32.grad, **tol)
    torch.testing.assert_close(w.grad.float(), w32.grad, **tol)
    assert w.grad[1].abs().sum() == 0  # the empty expert gets no gradient


def test_the_triton_ops_trace_forward_and_backward_without_running():
    """torch.compile sees each GEMM as one op (a triton_op): traced on fake tensors, forward and
    backward hold the three GEMMs and nothing falls out of the graph (the kernels never run,
    so this holds on CPU for the real, compiled kernels)."""
    ends = groups([64, 64])
    x = torch.randn(128, 32, dtype=torch.float16, requires_grad=True)
    w = torch.randn(2, 32, 16, dtype=torch.float16, requires_grad=True)

    def step(x, w, ends):
        loss = groupgemm.grouped_mm(x, w, ends).float().square().sum()
        return torch.autograd.grad(loss, (x, w))

    graph = make_fx(step, tracing_mode="fake")(x, w, ends)
    ops = [str(n.target) for n in graph.graph.nodes if n.op == "call_function"]
    assert ops.count("dsflow.grouped_mm.default") == 2  # forward, input gradient
    assert ops.count("dsflow.grouped_mm_weight_grad.default") == 1


@pytest.mark.parametrize("capability", CAPABILITIES)
def test_each_gpu_takes_a_grouped_gemm_without_a_host_sync(capability):
    """torch's grouped GEMM only where it has its CUTLASS kernel (bf16 on 9.x), the Triton one
    everywhere else on a GPU: no GPU below 9.0 reaches torch's per-expert fallback or a
    Hopper-only kernel; the experts run inside the compiled layers in bf16 and fp16."""
    hopper = capability[0] == 9
    assert fastpaths.grouped_gemm(torch.bfloat16, capability) == ("torch" if hopper else "triton")
    assert fastpaths.grouped_gemm(torch.float16, capability) == "triton"
    assert fastpaths.grouped_gemm(torch.float32, capability) == "torch"  # eager, exact
    assert fastpaths.grouped_gemm(torch.float16, None) == "torch"  # CPU
    for precision in ("bf16", "fp16"):
        assert fastpaths.experts_in_graph("sorted", precision, [capability, capability])
        assert fastpaths.resolve({}, "cuda", zero_stage=2, precision=precision).experts == "sorted"
    assert not fastpaths.experts_in_graph("sorted", "fp32", [capability])
    assert not fastpaths.experts_in_graph("sorted", "fp16", [capability, (7, 5)])
    gpus = [{"index": 0, "name": "GPU", "capability": capability}]
    if hopper:
        with pytest.raises(UsageError, match="torchao"):  # the GPU passes; torchao decides
            if fastpaths._torchao_fp8_grouped_mm() is None:
                fastpaths.check_fp8_experts_machine("cuda", gpus)
            raise UsageError("torchao is installed")
    else:
        with pytest.raises(UsageError, match=r"compute capability 9\.x.*GPU 0 \(GPU\) is not"):
            fastpaths.check_fp8_experts_machine("cuda", gpus)


def test_sorted_experts_below_hopper_take_the_triton_gemm_in_fp16_and_bf16():
    """use_experts records the GPU's capability on every experts module; the Triton GEMM is
    what a module of each dtype then calls."""
    model = tiny(moe_intermediate_size=16)
    fastpaths.use_experts(model, "sorted", capability=(8, 9))
    banks = [m for m in model.modules() if hasattr(m, "gate_up_proj")]
    assert banks and all(getattr(m, fastpaths.GEMM_CAPABILITY) == (8, 9) for m in banks)
    for dtype, triton in ((torch.float16, True), (torch.bfloat16, True), (torch.float32, False)):
        assert fastpaths._triton_gemm(banks[0].to(dtype)) is triton
    fastpaths.use_experts(model, "sorted", capability=(9, 0))
    assert not fastpaths._triton_gemm(banks[0].to(torch.bfloat16))


def test_fp16_sorted_experts_on_a_consumer_gpu_train_like_hfs_with_the_loss_scale(
    interpret, monkeypatch
):
    """The tiny MoE in fp16 with the sorted experts on the Triton GEMM (an RTX 4090's 8.9,
    faked) against HF's experts in fp32: the loss times DeepSpeed's initial scale (2^16, above
    fp16's largest value) backpropagated in fp16, then unscaled, gives every parameter's
    gradient of the fp32 model within fp16's rounding, none of them inf or zero."""
    reference = tiny(moe_intermediate_size=16)
    ours = copy.deepcopy(reference).half()
    fastpaths.use_experts(ours, "sorted", capability=(8, 9))
    calls = []
    real = groupgemm.grouped_mm

    def counted(x, w, ends):
        calls.append(x.shape[0] % groupgemm.BLOCK_M)
        return real(x, w, ends)

    monkeypatch.setattr(groupgemm, "grouped_mm", counted)
    inputs, targets = batch(size=3)
    scale = 2.0**16
    from dsflow.model.loss import TrainingLM

    loss32 = TrainingLM(reference)(inputs, targets)
    loss32.backward()
    loss16 = TrainingLM(ours)(inputs, targets)
    (loss16.float() * scale).backward()
    assert calls and set(calls) == {0}  # every expert GEMM on the Triton kernel, tiles whole
    torch.testing.assert_close(loss16.float(), loss32, rtol=2e-3, atol=2e-3)
    for (name, p), q in zip(reference.named_parameters(), ours.parameters(), strict=True):
        grad = q.grad.float() / scale
        assert torch.isfinite(grad).all() and grad.abs().sum() > 0, name
        torch.testing.assert_close(grad, p.grad, rtol=5e-2, atol=2e-3, msg=name)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_triton_grouped_mm_matches_torchs_and_compiles_in_one_graph(dtype):
    """On the GPU, compiled kernels: the product and both gradients against torch's grouped GEMM
    in fp32, at the medium MoE's widths (hidden 768, expert width 256) with 128 experts, and
    one graph under torch.compile (no break, no host sync)."""
    torch.manual_seed(0)
    counts = (torch.randint(0, 4, (128,)) * groupgemm.BLOCK_M).tolist()
    counts[3] = groupgemm.BLOCK_M  # at least one row
    ends = groups(counts).cuda()
    x = torch.randn(int(ends[-1]), 768, device="cuda", dtype=dtype, requires_grad=True)
    w = (0.05 * torch.randn(128, 512, 768, device="cuda", dtype=dtype)).transpose(1, 2)
    w.requires_grad_()

    # A sum, not a mean: the mean's gradients (~1e-7) would be below fp16's normal range,
    # which is what the loss scale is for.
    def loss(x, w):
        return groupgemm.grouped_mm(x, w, ends).float().square().sum() * 1e-3

    torch._dynamo.reset()
    explained = torch._dynamo.explain(loss)(x, w)
    assert explained.graph_break_count == 0 and explained.graph_count == 1
    value = torch.compile(loss)(x, w)
    value.backward()
    x32, w32 = x.detach().float().requires_grad_(), w.detach().float().requires_grad_()
    ref = torch._grouped_mm(x32, w32, offs=ends).square().sum() * 1e-3
    ref.backward()
    torch.testing.assert_close(value, ref, rtol=1e-2, atol=1e-5)
    for ours, theirs in ((x.grad, x32.grad), (w.grad, w32.grad)):
        err = (ours.float() - theirs).norm() / theirs.norm()
        assert err < 1e-2, err
