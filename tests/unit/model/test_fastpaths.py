"""The training fast paths (dsflow.model.fastpaths, dsflow.model.loss, and BatchLoader in
dsflow.data.shards) compute what the plain HF path computes: same logits, losses, gradients, expert counts and batches."""

from __future__ import annotations

import copy
import weakref

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from conftest import tiny_v2
from dsflow.data.shards import BatchLoader, ShardReader
from dsflow.errors import UsageError
from dsflow.model import fastpaths, mtp
from dsflow.model.balance import ExpertBalancer
from dsflow.model.build import build_model
from dsflow.model.loss import IGNORE, TrainingLM, linear_cross_entropy, mean_loss
from dsflow.model.presets import model_config

VOCAB = 300


FAMILIES = ["deepseek_v3", "deepseek_v2"]


def tiny(family="deepseek_v3", **overrides):
    """The tiny preset's shape in either family (DeepSeek-V2's router and balance loss)."""
    torch.manual_seed(0)
    if family == "deepseek_v2":
        config = model_config("deepseek-v2-lite", VOCAB, tiny_v2(**overrides))
    else:
        config = model_config("tiny", VOCAB, overrides)
    return build_model(config, device_type="cpu")


def family_balancer(model, **kwargs):
    """The balancer with the family's aux loss on (V2's alpha as V3's, to compare alike)."""
    return ExpertBalancer(model, gamma=0.0, seq_aux_alpha=0.01, **kwargs)


def batch(seed=1, size=2, seq=33):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, VOCAB, (size, seq), generator=g)
    return x[:, :-1], x[:, 1:]


def test_auto_means_fast_on_cuda_and_plain_on_cpu_but_for_flash_attention():
    auto = {"compile": "auto", "attention": "auto", "ce_chunk": "auto", "prefetch": True}
    fast = fastpaths.Perf(
        True, "flash_padded", 8192, True, False, fused_grad_checks=True, experts="sorted",
        experts_fallback=True, async_metrics=True, device_step=True, lean_grad_hooks=True,
    )  # fmt: skip
    assert fastpaths.resolve(auto, "cuda") == fast
    assert not fastpaths.resolve({**auto, "async_metrics": False}, "cuda").async_metrics
    # Asked for by name, the sorted experts are not swapped for HF's where they do not apply.
    assert not fastpaths.resolve({**auto, "experts": "sorted"}, "cuda").experts_fallback
    # auto keeps HF's experts where the sorted ones are untested: ZeRO-3, and fp32, where they
    # run eagerly between the compiled graphs (unmeasured for speed); fp16 takes them
    # (tests/unit/model/test_groupgemm.py).
    assert fastpaths.resolve(auto, "cuda", precision="fp16").experts == "sorted"
    assert fastpaths.resolve(auto, "cuda", precision="fp32").experts == "hf"
    assert fastpaths.resolve(auto, "cuda", zero_stage=3).experts == "hf"
    # MLA's padded attention takes SDPA's flash kernel for CPU as well (its math kernel else)
    # and the fused loss, which shortens a CPU step too (docs/performance.md)
    assert fastpaths.resolve(auto, "cpu") == fastpaths.Perf(
        False, "flash_padded", 8192, True, False, lean_grad_hooks=True
    )
    assert fastpaths.resolve({**auto, "attention": "sdpa"}, "cpu").attention == "sdpa"
    assert fastpaths.resolve({**auto, "ce_chunk": 512, "compile": True}, "cpu").ce_chunk == 512
    # ZeRO-3 gathers parameters in module hooks: auto turns compile off, true is refused.
    assert fastpaths.resolve(auto, "cuda", zero_stage=3).compile is False
    with pytest.raises(UsageError, match="train.perf.compile"):
        fastpaths.resolve({**auto, "compile": True}, "cuda", zero_stage=3)


@pytest.mark.parametrize(
    "device,stage,precision,offload,on",
    [
        ("cuda", 2, "bf16", False, True),
        ("cuda", 1, "bf16", False, True),
        ("cuda", 2, "fp32", False, True),
        ("cuda", 2, "fp16", False, True),  # loss-scaled: tests/unit/train/test_fusedgrads.py
        ("cuda", 0, "bf16", False, False),  # DeepSpeed's ZeRO-1/2 optimizer only
        ("cuda", 3, "bf16", False, False),
        ("cuda", 2, "bf16", True, False),  # CPU offload keeps its own per-parameter norms
        ("cpu", 2, "bf16", False, False),
    ],
)
def test_fused_grad_checks_auto_is_on_where_it_fits_and_is_tested(
    device, stage, precision, offload, on
):
    assert fastpaths.resolve({}, device, stage, precision, offload).fused_grad_checks is on
    assert not fastpaths.resolve(
        {"fused_grad_checks": False}, device, stage, precision, offload
    ).fused_grad_checks
    fits = stage in (1, 2) and not offload
    if fits:  # true insists, on any device and precision
        perf = fastpaths.resolve({"fused_grad_checks": True}, device, stage, precision, offload)
        assert perf.fused_grad_checks
    else:
        with pytest.raises(UsageError, match="train.perf.fused_grad_checks: true .* auto or false"):
            fastpaths.resolve({"fused_grad_checks": True}, device, stage, precision, offload)


def test_fp16_takes_the_fused_loss_when_asked():
    auto = {"compile": "auto", "attention": "auto", "ce_chunk": "auto", "prefetch": True}
    # fp16: auto keeps full logits (as the planner counts them); a chunk size turns the fused
    # loss on, which forms its gradients at the loss scale (the test below).
    assert fastpaths.resolve(auto, "cuda", precision="fp16").ce_chunk == 0
    assert fastpaths.resolve({**auto, "ce_chunk": 4096}, "cuda", precision="fp16").ce_chunk == 4096


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("overrides", [{}, {"v_head_dim": 64}], ids=["v-narrower", "v-wider"])
def test_padded_attention_gives_the_same_logits(overrides, family):
    model = tiny(family, **overrides)
    inputs, _ = batch()
    with torch.no_grad():
        reference = model(input_ids=inputs).logits
        fastpaths.use_attention(model, "flash_padded")
        assert model.config._attn_implementation == fastpaths.FLASH_PADDED
        padded = model(input_ids=inputs).logits
    torch.testing.assert_close(padded, reference, rtol=1e-5, atol=1e-5)


class _MatmulCount(TorchDispatchMode):
    """Counts the matrix multiplications run inside it."""

    count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.bmm):
            self.count += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("chunk", [1000, 333, 7])
def test_fused_cross_entropy_equals_the_full_one(chunk):
    torch.manual_seed(chunk)
    hidden = torch.randn(1000, 64, dtype=torch.float64, requires_grad=True)
    weight = (0.1 * torch.randn(VOCAB, 64, dtype=torch.float64)).requires_grad_()
    targets = torch.randint(0, VOCAB, (1000,))
    reference = F.cross_entropy(hidden @ weight.t(), targets)
    grads = torch.autograd.grad(3 * reference, (hidden, weight))
    fused = linear_cross_entropy(hidden, weight, targets, chunk)
    fused_grads = torch.autograd.grad(3 * fused, (hidden, weight))
    torch.testing.assert_close(fused, reference, rtol=1e-12, atol=1e-12)
    for got, want in zip(fused_grads, grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    with torch.no_grad(), _MatmulCount() as matmuls:  # validation: no gradient work
        value = linear_cross_entropy(hidden, weight, targets, chunk)
    torch.testing.assert_close(value, reference)
    assert matmuls.count == -(-1000 // chunk)  # the logits' matmul per chunk, nothing else
    with pytest.raises(ValueError):
        linear_cross_entropy(hidden, weight, targets, 0)
    # A frozen lm_head (LoRA): the same hidden gradient, and no weight gradient made or kept.
    frozen = weight.detach()
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        fused = linear_cross_entropy(hidden, frozen, targets, chunk)
    assert [tuple(t.shape) for t in saved] == [tuple(hidden.shape)]
    (grad_hidden,) = torch.autograd.grad(3 * fused, (hidden,))
    torch.testing.assert_close(grad_hidden, grads[0], rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("chunk", [1000, 7])
def test_fused_cross_entropy_leaves_ignored_targets_out_of_the_loss_and_its_gradients(chunk):
    # A multi-token prediction depth's tail: the targets that are IGNORE, as F.cross_entropy's
    # ignore_index: no loss, no gradient, the mean over the rest (the count the caller gives).
    torch.manual_seed(chunk)
    hidden = torch.randn(1000, 64, dtype=torch.float64, requires_grad=True)
    weight = (0.1 * torch.randn(VOCAB, 64, dtype=torch.float64)).requires_grad_()
    targets = torch.randint(0, VOCAB, (1000,))
    targets[torch.randperm(1000)[:300]] = IGNORE
    reference = F.cross_entropy(hidden @ weight.t(), targets, ignore_index=IGNORE)
    grads = torch.autograd.grad(3 * reference, (hidden, weight))
    fused = linear_cross_entropy(hidden, weight, targets, chunk, scale=8.0, count=700)
    fused_grads = torch.autograd.grad(3 * fused, (hidden, weight))
    torch.testing.assert_close(fused, reference, rtol=1e-12, atol=1e-12)
    for got, want in zip(fused_grads, grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    assert fused_grads[0][targets == IGNORE].abs().max() == 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_fused_losss_softmax_gradient_compiles_whole_and_a_new_scale_is_no_new_graph(dtype):
    # On CUDA the chunk's softmax gradient runs compiled (loss._softmax_grad): one graph, no
    # break, the eager values, and the loss scale a tensor input rather than a constant.
    from torch._dynamo.testing import CompileCounterWithBackend

    from dsflow.model.loss import _softmax_grad_eager

    torch.manual_seed(0)
    h = torch.randn(64, 32).to(dtype)
    weight = F.pad(0.5 * torch.randn(VOCAB, 32), (0, 0, 0, 4)).to(dtype)  # 4 rows of padding
    targets = torch.randint(0, VOCAB, (64,))
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(_softmax_grad_eager, backend=counter, fullgraph=True, dynamic=False)
    for scale in (2.0**16 / 64, 2.0**15 / 64):
        factor = torch.tensor(scale, dtype=torch.float32)
        want = _softmax_grad_eager(h, weight, targets, factor, VOCAB)
        got = compiled(h, weight, targets, factor, VOCAB)
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w)
    assert float(got[1][:, VOCAB:].abs().max()) == 0.0  # the padding: no gradient
    logits = (h @ weight.t())[:, :VOCAB].float()
    torch.testing.assert_close(got[0], F.cross_entropy(logits, targets, reduction="none"))
    assert counter.frame_count == 1


class _PeakBytes(TorchDispatchMode):
    """The most bytes that tensors made inside the mode held at once (views share theirs;
    `inputs` and their views are not counted)."""

    def __init__(self, inputs: list[torch.Tensor]):
        super().__init__()
        self.live = self.peak = 0
        self.seen = {t.untyped_storage().data_ptr() for t in inputs}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, tuple | list) else [out]:
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                key = storage.data_ptr()
                if key not in self.seen and storage.nbytes():
                    self.seen.add(key)
                    self.live += storage.nbytes()
                    self.peak = max(self.peak, self.live)
                    weakref.finalize(storage, self._freed, key, storage.nbytes())
        return out

    def _freed(self, key: int, nbytes: int) -> None:
        self.seen.discard(key)
        self.live -= nbytes


def test_the_fused_losss_eager_softmax_gradient_holds_one_wide_copy_of_the_logits():
    # Eagerly (CPU, or train.perf.compile off) the chunk's logits are widened once and worked
    # on in place: at most one fp32 and one 16-bit copy of them at a time, as the plan counts.
    from dsflow.model.loss import _softmax_grad_eager

    rows, vocab = 64, 4000
    h = torch.randn(rows, 32).to(torch.bfloat16)
    weight = torch.randn(vocab, 32).to(torch.bfloat16)
    targets = torch.randint(0, vocab, (rows,))
    factor = torch.tensor(1 / rows)
    with _PeakBytes([h, weight, targets, factor]) as peak:
        _softmax_grad_eager(h, weight, targets, factor, vocab)
    assert (4 + 2) * rows * vocab <= peak.peak <= (4 + 2) * rows * vocab + 64 * rows


def test_fused_cross_entropy_takes_a_loss_scale_beyond_the_16_bit_range():
    """DeepSpeed's dynamic loss scale starts at 2^16, above fp16's largest value: the backward
    scales in fp32 before casting, so it never turns into inf."""
    torch.manual_seed(0)
    hidden = torch.randn(64, 16, dtype=torch.float16, requires_grad=True)
    weight = (0.1 * torch.randn(VOCAB, 16)).half().requires_grad_()
    targets = torch.randint(0, VOCAB, (64,))
    (linear_cross_entropy(hidden, weight, targets, 32) * 2.0**16).backward()
    assert torch.isfinite(hidden.grad).all() and torch.isfinite(weight.grad).all()


def test_fused_cross_entropy_in_fp16_forms_its_gradients_at_the_loss_scale():
    """fp16 with DeepSpeed's loss scale (2^16): the fused loss told the scale gives the plain
    path's gradients (full fp16 logits, the scaled loss backpropagated), both within fp16's
    rounding of fp32's; formed at scale 1 instead, the small logit gradients (~1e-7 for 4096
    tokens over 300 classes) fall below fp16's normal range and lose their digits."""
    torch.manual_seed(0)
    n, scale = 4096, 2.0**16
    hidden32 = torch.randn(n, 16)
    weight32 = 0.1 * torch.randn(VOCAB, 16)
    targets = torch.randint(0, VOCAB, (n,))

    def grads(loss_of, dtype):
        hidden = hidden32.to(dtype).detach().requires_grad_()
        weight = weight32.to(dtype).detach().requires_grad_()
        loss = loss_of(hidden, weight)
        (loss.float() * (scale if dtype == torch.float16 else 1.0)).backward()
        unscale = scale if dtype == torch.float16 else 1.0
        return hidden.grad.float() / unscale, weight.grad.float() / unscale

    def plain(hidden, weight):
        return F.cross_entropy((hidden @ weight.t()).float(), targets)

    exact = grads(plain, torch.float32)

    def errors(loss_of):
        ours = grads(loss_of, torch.float16)
        return [float((a - b).norm() / b.norm()) for a, b in zip(ours, exact, strict=True)], ours

    plain_err, _ = errors(plain)
    fused_err, _ = errors(lambda h, w: linear_cross_entropy(h, w, targets, 1024, scale=scale))
    assert all(f < 1.5 * p and f < 1e-3 for f, p in zip(fused_err, plain_err, strict=True))
    # Formed at scale 1: several times the error, and some hidden gradients flushed to zero.
    unscaled_err, unscaled = errors(lambda h, w: linear_cross_entropy(h, w, targets, 1024))
    assert unscaled_err[0] > 3 * fused_err[0] and (unscaled[0] == 0).any()


def test_experts_auto_keeps_hfs_where_sorted_does_not_apply():
    """`experts: auto` on a layout the sorted experts do not handle keeps HF's experts; asked
    for by name, the same layout is a one-line UsageError naming the key."""
    model = tiny(moe_intermediate_size=16)
    assert fastpaths.use_experts(model, "sorted", fallback=True) == "sorted"
    odd = tiny(moe_intermediate_size=16)
    next(m for m in odd.modules() if hasattr(m, "gate_up_proj")).has_bias = True
    before = odd.config._experts_implementation
    assert fastpaths.use_experts(odd, "sorted", fallback=True) == "hf"
    assert odd.config._experts_implementation == before
    with pytest.raises(UsageError, match="train.perf.experts: sorted does not support"):
        fastpaths.use_experts(odd, "sorted")
    # The train stage logs what apply returns: the experts that run.
    perf = fastpaths.Perf(False, "sdpa", 0, False, experts="sorted", experts_fallback=True)
    assert fastpaths.apply(odd, perf).experts == "hf"
    assert fastpaths.apply(tiny(moe_intermediate_size=16), perf).experts == "sorted"


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sorted_experts_match_hf_grouped_mm(dtype, family):
    """The sorted experts (gather-only permutation backward) against HF's grouped_mm experts,
    eager, bf16 as on the GPU and fp32: the same loss, and gradients for every parameter (the
    routers' through the routing weights, the embeddings' through the dispatch)."""
    hf = tiny(family, moe_intermediate_size=16).to(dtype)  # grouped_mm wants 16-byte strides
    hf.set_experts_implementation("grouped_mm")
    ours = copy.deepcopy(hf)
    fastpaths.use_experts(ours, "sorted")
    assert ours.config._experts_implementation == fastpaths.SORTED_EXPERTS
    tol = dict(rtol=1e-5, atol=1e-7) if dtype == torch.float32 else dict(rtol=2e-2, atol=1e-4)
    assert_trains_alike(hf, ours, **tol)


def test_padded_expert_groups_keep_every_slot_and_give_empty_experts_16_zero_rows():
    """_pad_groups on a routing where expert 0 gets no token, 1 gets 17 and 2 gets 3: groups of
    16, 32 and the rest (3 + padding to the fixed size); each slot keeps its row, the rest hold
    the sentinel."""
    experts = torch.tensor([1] * 17 + [2] * 3)
    order = torch.randperm(20, generator=torch.Generator().manual_seed(0))
    offsets = torch.tensor([0, 17, 20], dtype=torch.int32)
    padded, where, ends = fastpaths._pad_groups(experts, order, offsets, 16)
    size = -(-(20 + 3 * 16) // 16) * 16
    assert ends.tolist() == [16, 48, size] and padded.numel() == size
    assert where.tolist() == list(range(16, 33)) + [48, 49, 50]
    assert torch.equal(padded[where], order)
    assert (padded[torch.ones(size, dtype=torch.bool).index_fill_(0, where, False)] == 20).all()


def assert_trains_alike(reference, other, **tol) -> torch.Tensor:
    """One forward and backward of each model on one batch (returned): the same loss, and every
    parameter's gradient nonzero and within `tol` of the reference's."""
    inputs, targets = batch(size=3)
    losses = []
    for model in (reference, other):
        loss = TrainingLM(model)(inputs, targets)
        loss.backward()
        losses.append(loss.detach())
    torch.testing.assert_close(losses[1], losses[0], rtol=0, atol=0)  # same forward
    for (name, p), q in zip(reference.named_parameters(), other.parameters(), strict=True):
        assert q.grad is not None and q.grad.abs().sum() > 0, name
        torch.testing.assert_close(q.grad.float(), p.grad.float(), **tol, msg=name)
    return inputs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_experts_pad_each_experts_rows_to_16_and_change_nothing_else(dtype, monkeypatch):
    """The FP8 experts' grouped GEMMs get every expert's rows padded to a multiple of 16, at
    least 16 (zero rows; the last group runs to the end), of one size whatever the routing.
    With the FP8 GEMM replaced by the plain one (FP8 needs an SM90 GPU), loss and gradients are
    the unpadded sorted experts' (padding rows add exact zeros)."""
    plain = tiny(moe_intermediate_size=16).to(dtype)
    fastpaths.use_experts(plain, "sorted")
    padded = copy.deepcopy(plain)
    experts = [m for m in padded.modules() if hasattr(m, "gate_up_proj")]
    for module in experts:
        setattr(module, fastpaths.FP8_EXPERTS, True)
    calls = []

    def grouped_mm(x, weight, offsets):
        sizes = torch.diff(offsets.long(), prepend=offsets.new_zeros(1).long())
        assert offsets[-1] == x.shape[0] and (sizes % 16 == 0).all() and sizes.min() >= 16
        calls.append(x.shape[0])
        return fastpaths._grouped_mm(x, weight, offsets)

    monkeypatch.setattr(fastpaths, "_fp8_grouped_mm", grouped_mm)
    inputs = assert_trains_alike(plain, padded, rtol=1e-6, atol=1e-7)
    top_k, n_experts = plain.config.num_experts_per_tok, plain.config.n_routed_experts
    rows = -(-(inputs.numel() * top_k + n_experts * 16) // 16) * 16
    assert calls == [rows] * (2 * len(experts))


@pytest.mark.parametrize("family", FAMILIES)
def test_training_module_is_the_hf_model_with_a_loss_forward(family):
    model = tiny(family)
    inputs, targets = batch()
    plain, fused = TrainingLM(model), TrainingLM(model, ce_chunk=17)
    # DeepSpeed checkpoints and the HF export see the same names and the same tensors.
    assert list(plain.state_dict()) == list(model.state_dict())
    for name, p in plain.named_parameters():
        assert p is model.get_parameter(name)
    assert plain.hf is model and "hf" not in dict(plain.named_children())
    expected = mean_loss(model, inputs, targets)
    torch.testing.assert_close(plain(inputs, targets), expected, rtol=0, atol=0)
    torch.testing.assert_close(fused(inputs, targets), expected, rtol=1e-6, atol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize(
    "family,dtype,depth",
    [
        ("deepseek_v3", torch.bfloat16, 0),
        ("deepseek_v3", torch.float32, 0),
        ("deepseek_v2", torch.bfloat16, 0),
        ("deepseek_v2", torch.float32, 0),
        ("deepseek_v3", torch.bfloat16, 1),
    ],
    ids=["v3-bf16", "v3-fp32", "v2-bf16", "v2-fp32", "v3-bf16-mtp1"],
)
def test_compiled_layers_train_like_eager_layers(family, dtype, depth):
    """torch.compile of every decoder layer, the balancer's router hook traced into it and the
    sorted experts: same loss, gradients, expert counts and sequence-wise aux loss as eager
    with HF's experts. In bf16 (the GPU's default) one graph per layer, no graph break; in
    other dtypes the sorted experts run eagerly between the graphs, and only they (dynamo in
    torch 2.11 on an H200 zeroed their fp32 gradients; see fastpaths.sorted_experts_forward).
    A multi-token prediction depth compiles as one more graph, its MoE layer's router balanced
    as the others."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    eager = tiny(family, moe_intermediate_size=16).to(dtype)  # grouped_mm: 16-byte strides
    if depth:
        mtp.attach(eager, depth)
        eager.to(dtype)
    eager.set_experts_implementation("grouped_mm")  # the reference on the GPU
    compiled = copy.deepcopy(eager)
    inputs, targets = batch()
    runs = []
    torch._dynamo.reset()
    counters.clear()
    for model, perf in (
        (eager, fastpaths.Perf(False, "sdpa", 0, False)),
        (
            compiled,
            fastpaths.Perf(
                True, "flash_padded", 16, False, experts="sorted", compile_router_hooks=True
            ),
        ),
    ):
        balancer = family_balancer(model)
        fastpaths.apply(model, perf, balancer)
        trainee = TrainingLM(model, ce_chunk=perf.ce_chunk)
        if depth:
            assert model.mtp is not None and len(balancer.routers) == 4  # 3 MoE layers + MTP's
        for _ in range(2):  # the second call runs the cached graphs
            model.zero_grad(set_to_none=True)
            aux = None
            loss = trainee(inputs, targets)
            aux = balancer.aux_loss()
            (loss + aux).backward()
        runs.append((loss.detach(), aux.detach(), balancer.counts(), model))
    breaks = dict(counters["graph_break"])
    if dtype == torch.bfloat16:
        assert not breaks, breaks
        # One graph per layer kind, shared by its layers (the tiny preset: 1 dense + 3 MoE),
        # and the final norm's: a per-layer constant in the hooks would compile each MoE
        # layer anew. An MTP depth is a layer kind of its own.
        assert counters["stats"]["unique_graphs"] == 3 + depth
    else:
        assert breaks and all("_sorted_experts" in reason for reason in breaks), breaks
    assert compiled.config._experts_implementation == fastpaths.SORTED_EXPERTS
    (loss_e, aux_e, counts_e, _), (loss_c, aux_c, counts_c, _) = runs
    assert counts_e.sum() > 0 and torch.equal(counts_c.sum(1), counts_e.sum(1))
    if dtype == torch.float32:
        assert torch.equal(counts_c, counts_e)
        torch.testing.assert_close(loss_c, loss_e, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(aux_c, aux_e, rtol=1e-5, atol=1e-7)
        for (name, p_e), p_c in zip(eager.named_parameters(), compiled.parameters(), strict=True):
            assert p_c.grad is not None, name
            torch.testing.assert_close(p_c.grad, p_e.grad, rtol=1e-4, atol=1e-6, msg=name)
        return
    # bf16 rounds in another order and a few tokens change experts (seen here: each
    # gradient within 0.22 of eager's, relative L2); a lost gradient (zero, as in fp32 under
    # dynamo on the GPU) is 1.
    torch.testing.assert_close(loss_c, loss_e, rtol=1e-2, atol=0)
    torch.testing.assert_close(aux_c, aux_e, rtol=5e-2, atol=0)
    for (name, p_e), p_c in zip(eager.named_parameters(), compiled.parameters(), strict=True):
        assert p_c.grad is not None, name
        want = p_e.grad.float()
        gap = (p_c.grad.float() - want).norm() / want.norm().clamp_min(1e-30)
        assert gap < 0.5, (name, gap.item())


@pytest.mark.parametrize("depth", [0, 2])
def test_batch_loader_reads_what_the_reader_reads(prepared, depth):
    reader = ShardReader(prepared / "data/shards/train", 16, seed=7)
    loader = BatchLoader(
        reader, start=3, rank=1, world=2, micro=2, accum=2, device="cpu", depth=depth
    )
    try:
        for step in range(3, 7):
            for a in range(2):
                inputs, targets = loader.get(step, a)
                want = reader.micro_batch(step, a, 1, 2, 2, 2)
                assert np.array_equal(inputs.numpy(), want[:, :-1])
                assert np.array_equal(targets.numpy(), want[:, 1:])
        with pytest.raises(RuntimeError, match="out of order"):
            loader.get(9, 0)
    finally:
        loader.close()


@pytest.mark.parametrize("family", FAMILIES)
def test_activation_checkpointing_recomputes_the_same_gradients(family):
    """Recomputed layers give the same loss and gradients, and the balancer does not count the
    recomputation's routing twice."""
    plain = tiny(family)
    checkpointed = copy.deepcopy(plain)
    inputs, targets = batch()
    results = []
    for model, on in ((plain, False), (checkpointed, True)):
        model.train()
        balancer = family_balancer(model)
        fastpaths.apply(model, fastpaths.Perf(False, "sdpa", 0, False, activation_checkpointing=on))
        loss = TrainingLM(model)(inputs, targets) + balancer.aux_loss()
        loss.backward()
        results.append((loss.detach(), balancer.counts()))
    assert checkpointed.model.gradient_checkpointing and not plain.model.gradient_checkpointing
    torch.testing.assert_close(results[1][0], results[0][0], rtol=0, atol=0)
    assert torch.equal(results[1][1], results[0][1])
    for (name, p), q in zip(plain.named_parameters(), checkpointed.parameters(), strict=True):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-5, atol=1e-7, msg=name)


def test_device_idle_counts_only_gaps_inside_each_phase():
    """The profiler's idle arithmetic: kernels that overlap, straddle a phase's edges or run
    past it; idle is the phase's time with no kernel running."""
    from dsflow.train.diagnostics import device_idle

    kernels = [(0, 4), (2, 6), (9, 12), (15, 15), (20, 30)]  # busy 0-6, 9-12, 20-30
    assert device_idle([(0, 10)], kernels) == (10, 3)  # idle 6-9
    assert device_idle([(5, 25)], kernels) == (20, 20 - 1 - 3 - 5)
    assert device_idle([(0, 10), (10, 20)], kernels) == (20, 3 + 8)
    assert device_idle([(13, 19)], kernels) == (6, 6)  # the empty kernel counts for nothing
    assert device_idle([], kernels) == (0, 0)


def test_sync_calls_are_counted_in_the_phase_they_start_in():
    from dsflow.train.diagnostics import count_within

    syncs = [1.0, 5.0, 9.99, 10.0, 30.0]
    assert count_within([(0, 10)], syncs) == 3
    assert count_within([(0, 10), (10, 20)], syncs) == 4
    assert count_within([(20, 29)], syncs) == 0
    assert count_within([], syncs) == 0


def test_step_profiler_writes_the_phase_table_and_trace(tmp_path):
    """DSFLOW_PROFILE's table: host time and device idle time per phase of the step, plus a
    chrome trace holding the phases (on CPU no device runs, so idle is the whole phase)."""
    import gzip
    import json

    from dsflow.train.diagnostics import StepProfiler

    path = tmp_path / "logs" / "profile.txt"
    prof = StepProfiler(2, 3, str(path), "cpu")
    a = torch.randn(64, 64)
    for step in range(1, 5):
        prof.step_begins(step)
        for phase in ("data", "forward", "backward", "optimizer", "sync", "bookkeeping"):
            prof.mark(phase)
            a = (a @ a).tanh()
        prof.step_ends(step)
    text = path.read_text()
    assert text.startswith("steps 2-3: wall")
    rows = {line.split()[0]: line.split()[1:] for line in text.splitlines()[-6:]}
    assert list(rows) == ["data", "forward", "backward", "optimizer", "sync", "bookkeeping"]
    for host, idle, syncs in rows.values():
        assert float(host) >= 0 and float(idle) == pytest.approx(float(host), abs=0.11)
        assert float(syncs) == 0  # no CUDA runtime on CPU
    trace = json.loads(gzip.open(f"{path}.trace.json.gz").read())
    names = {e.get("name") for e in trace["traceEvents"]}
    assert {"dsflow/forward", "dsflow/bookkeeping"} <= names
    assert prof.prof is None and prof.open is None


def test_the_profile_sums_kernel_time_by_kind():
    """The profile table's kernel kinds, on kernel names from an H100 trace of the MoE step:
    the experts' CUTLASS grouped GEMM is not counted as a GEMM, cuDNN attention's inductor
    helper is attention, the optimizer is its own kind, and unknown kernels are "other"."""
    from dsflow.train.diagnostics import kernel_kinds

    grouped = "_ZN7cutlass13device_kernelIN2at4cuda6detail25enable_3x_kernel_for_sm9xINS_4gemm6"
    grouped += "kernel13GemmUniversalINS5_17GroupProblemShapeIN4cute5tupleIJiiiEEEEE"
    kernels = [
        (grouped, 4010.0),
        ("void at::cuda::detail::prepare_grouped_gemm_data<cutlass::bfloat16_t>", 30.0),
        ("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT", 3000.0),
        ("sm80_xmma_gemm_f32f32_f32f32_f32_nn_n_tilesize64x128x8_stage3", 200.0),
        ("cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_26", 1200.0),
        ("triton_poi_fused__scaled_dot_product_cudnn_attention_backward_slice_backward", 60.0),
        ("triton_red_fused__to_copy__unsafe_view_add_div_expand_index_select_mul_pow", 2400.0),
        ("adamw_master", 2000.0),
        ("void at::native::multi_tensor_apply_kernel<TensorListMetadata<1>>", 200.0),
        ("void at::native::sbtopk::gatherTopK<float, unsigned int, 2, false>", 300.0),
        ("void at_cuda_detail::cub::DeviceRadixSortOnesweepKernel<Policy>", 100.0),
        ("Memset (Device)", 20.0),
    ]
    text = kernel_kinds(kernels, steps=2)
    rows = {line[:18].strip(): line[18:].split() for line in text.splitlines()[1:]}
    ms = {kind: float(cols[0]) for kind, cols in rows.items()}
    assert ms == {
        "grouped GEMM": 2.02, "GEMM": 1.6, "fused (inductor)": 1.2, "optimizer": 1.1,
        "attention": 0.63, "sort / top-k": 0.2, "other": 0.01,
    }  # fmt: skip
    assert list(ms) == sorted(ms, key=lambda kind: -ms[kind])  # largest first
    assert rows["grouped GEMM"][1] == f"{100 * 4040 / 13520:.1f}%"


@pytest.mark.parametrize("ce_chunk", [0, 17])
def test_the_training_forward_reads_nothing_back_from_the_device(ce_chunk):
    """A host read in the forward (HF's packed-sequence check of the position ids) is a host
    sync on the GPU: the training forward has none (a dense model: HF's eager experts read
    their token counts, the sorted experts of the GPU do not), and the loss is the same."""
    from torch.utils._python_dispatch import TorchDispatchMode

    reads = []

    class HostReads(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func in (
                torch.ops.aten._local_scalar_dense.default,
                torch.ops.aten.is_nonzero.default,
            ):
                reads.append(func)
            return func(*args, **(kwargs or {}))

    model = tiny(first_k_dense_replace=4)
    inputs, targets = batch()
    with HostReads():
        loss = TrainingLM(model, ce_chunk=ce_chunk)(inputs, targets)
    assert reads == []
    expected = mean_loss(model, inputs, targets)
    torch.testing.assert_close(loss, expected, rtol=1e-6, atol=1e-6)


def test_compile_watch_counts_graph_breaks_and_the_recompiles_after_the_first_step():
    """The train stage's torch.compile line: nothing while nothing broke; a graph break is
    reported once; after the mark, a new input shape's compilation counts as a recompile,
    a call that hits the cache does not."""
    import torch._dynamo

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    watch = fastpaths.CompileWatch()
    smooth = torch.compile(lambda x: (x * 2).sum(), backend="eager", dynamic=False)
    smooth(torch.randn(3))
    assert watch.news() is None and watch.counts() == (0, 0)

    def broken(x):
        y = x * 2
        torch._dynamo.graph_break()
        return y.sum()

    torch.compile(broken, backend="eager", dynamic=False)(torch.randn(3))
    line = watch.news()
    assert line.startswith("torch.compile: 1 graph break(s) in 1 place(s), 0 recompile(s)"), line
    assert watch.news() is None  # said once
    watch.mark()
    smooth(torch.randn(3))  # cached
    assert watch.counts() == (1, 0)
    smooth(torch.randn(5))  # a guard fails on the new shape
    assert watch.counts() == (1, 1)
    assert "1 recompile(s) after the first step" in watch.news()
