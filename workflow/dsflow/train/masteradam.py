"""AdamW for 16-bit weights with fp32 master weights, in one pass over memory.

DeepSpeed's bf16 optimizers (ZeRO-1/2's, and the FP16_Optimizer that wraps ZeRO-0) take a
step in five passes over all parameters: the bf16 gradients are copied into an fp32 flat
buffer, scaled by the clip coefficient, Adam reads and writes the fp32 master weights and
moments, the masters are copied back into the bf16 weights, and those are flattened or
gathered. In backward, ZeRO-1/2 and ZeRO-0's all-reduce copy every gradient into buckets too.
For a MoE model, whose parameters are many times its activated ones, that traffic is a large
part of the step (docs/performance.md gives its share on an H200).

`MasterAdamW` keeps the fp32 master weights, exp_avg and exp_avg_sq itself (flat buffers per
parameter group, one view per parameter) and does the step in one kernel launch per group:
each program reads BLOCK elements of one tensor's bf16 gradient (found through a table of
pointers), scales it, updates master and moments and writes the bf16 weight: 28 bytes per
parameter, the same as fp32 Adam alone. The gradient norm is one multi-tensor launch
(`_foreach_norm`, fp32). It runs under DeepSpeed at ZeRO-0 as a client optimizer, with
DeepSpeed's bf16 wrapper and gradient clipping off (this class clips, from the same norm),
selected by `train.perf.optimizer` (`fused`; `auto` on one GPU: dsflow.model.fastpaths).

One launch per group matters: one launch per tensor (~250 a MoE step) is slower than
DeepSpeed's ZeRO-1 on an H200, one per group faster (docs/performance.md), so `auto` takes it
on one GPU. On the GPU's path the step takes no host sync: the kernel skips a non-finite step
itself and the step count lives on the device (`applied` tells the caller what happened).

The math is DeepSpeed's bf16 ZeRO step: the fp32 gradient is multiplied by 1 / max(1, (norm +
1e-6) / max_norm); a step whose gradient norm is inf/NaN is skipped and leaves master,
moments and step count untouched. On CPU `overflow` says so and the engine reads it (no
scheduler step either); on the GPU `overflow` stays false, so that the engine does not wait for
the norm, and its learning-rate schedule advances over a skipped step.
On CUDA the update is a Triton kernel with FusedAdam's formula (AdamW mode, IEEE division and
square root, bf16 rounded to nearest even); elsewhere it is torch's AdamW (`torch.optim.adam.adam`, decoupled weight decay),
the optimizer DeepSpeed runs on CPU (`torch_adam`), so a CPU run matches DeepSpeed's own.
"""

from __future__ import annotations

import torch

FORMAT = "dsflow.MasterAdamW/1"


class MasterAdamW(torch.optim.Optimizer):
    def __init__(
        self,
        params,
        lr: float,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        max_grad_norm: float = 0.0,
        kernel: str = "auto",
    ):
        """`kernel`: "triton" (one launch per parameter group, FusedAdam's formula), "torch"
        (torch's AdamW), "auto" = triton on CUDA, torch elsewhere."""
        defaults = {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay}
        super().__init__(params, defaults)
        self.max_grad_norm = max_grad_norm
        if kernel not in ("auto", "triton", "torch"):
            raise ValueError(f"MasterAdamW kernel: auto, triton or torch, not {kernel!r}")
        self.kernel = kernel
        self.overflow = False
        self.applied: torch.Tensor | None = None  # bool on the device: was the last step taken
        self._global_grad_norm = None
        # Built at first use: DeepSpeed moves the model to its device after this constructor.
        self._flat: list[dict] = []

    @torch.no_grad()
    def _state(self) -> list[dict]:
        """The flat fp32 masters and moments per group, on the parameters' device, the masters
        from the weights as they are at first use."""
        if self._flat:
            return self._flat
        for group in self.param_groups:
            ps = group["params"]
            dtypes = {p.dtype for p in ps}
            if len(dtypes) > 1 or not dtypes <= {torch.bfloat16, torch.float32}:
                raise ValueError(
                    f"MasterAdamW needs one dtype per parameter group, bf16 or fp32 (got {dtypes})"
                )
            # Each tensor's state starts at a multiple of ALIGN elements, so that the kernel's
            # loads and stores can be vectorized (it tells Triton so).
            starts = []
            offset = 0
            triton = self._triton(ps[0].device)
            for p in ps:
                if triton and (not p.is_contiguous() or p.data_ptr() % 16):
                    raise ValueError(
                        "MasterAdamW needs contiguous, 16-byte aligned parameters; one has "
                        f"strides {p.stride()}, address {p.data_ptr():#x}"
                    )
                starts.append(offset)
                offset += -(-p.numel() // ALIGN) * ALIGN
            master = torch.zeros(offset, dtype=torch.float32, device=ps[0].device)
            views = []
            for p, start in zip(ps, starts, strict=True):
                views.append((start, p.numel()))
                master[start : start + p.numel()].copy_(p.detach().reshape(-1))
            self._flat.append(
                {
                    "step": torch.zeros((), dtype=torch.int64, device=ps[0].device),
                    "master": master,
                    "exp_avg": torch.zeros_like(master),
                    "exp_avg_sq": torch.zeros_like(master),
                    "views": views,
                }
            )
        return self._flat

    def _triton(self, device: torch.device) -> bool:
        return self.kernel == "triton" or (self.kernel == "auto" and device.type == "cuda")

    def _view(self, gi: int, key: str, i: int) -> torch.Tensor:
        flat = self._state()[gi]
        offset, n = flat["views"][i]
        return flat[key][offset : offset + n].view(self.param_groups[gi]["params"][i].shape)

    def _grads(self) -> list[list[torch.Tensor]]:
        return [
            [p.grad if p.grad is not None else torch.zeros_like(p) for p in group["params"]]
            for group in self.param_groups
        ]

    @torch.no_grad()
    def step(self, closure=None):
        assert closure is None, "MasterAdamW takes no closure"
        grads = self._grads()
        flat_grads = [g for gs in grads for g in gs]
        norms = torch._foreach_norm(flat_grads, 2, dtype=torch.float32)
        total = torch.linalg.vector_norm(torch.stack(norms))
        self._global_grad_norm = total
        finite = torch.isfinite(total)
        self.applied = finite
        # DeepSpeed's unscale_and_clip_grads (loss scale 1 in bf16), in fp32 on the device.
        combined = torch.ones((), dtype=torch.float32, device=total.device)
        if self.max_grad_norm > 0:
            clip = (total + 1e-6) / self.max_grad_norm
            combined = torch.where(clip > 1, clip, combined)
        scale = 1.0 / combined
        if all(self._triton(g["params"][0].device) for g in self.param_groups):
            # No host sync: the kernel itself skips a non-finite step (its `ok` flag), and the
            # step count lives on the device. The engine is told nothing overflowed (it cannot
            # wait for the answer without stalling the host; the one effect: its learning-rate
            # schedule advances on a skipped step too); `applied` says what happened.
            self.overflow = False
            scale = torch.where(finite, scale, torch.zeros_like(scale))
            for gi, group in enumerate(self.param_groups):
                flat = self._state()[gi]
                flat["step"] += finite
                self._step_triton(gi, group, grads[gi], scale, finite)
            return None
        self.overflow = not bool(finite)
        if self.overflow:
            return None
        for gi, group in enumerate(self.param_groups):
            flat = self._state()[gi]
            flat["step"] += 1
            self._step_torch(gi, group, grads[gi], scale)
        return None

    def _step_torch(self, gi, group, grads, scale) -> None:
        from torch.optim.adam import adam

        ps = group["params"]
        masters = [self._view(gi, "master", i) for i in range(len(ps))]
        exp_avgs = [self._view(gi, "exp_avg", i) for i in range(len(ps))]
        exp_avg_sqs = [self._view(gi, "exp_avg_sq", i) for i in range(len(ps))]
        g32 = [g.float() * scale for g in grads]  # a new tensor: p.grad stays as it is
        # torch's Adam advances each tensor's step count itself: from the last one.
        steps = [torch.tensor(float(self._flat[gi]["step"]) - 1.0) for _ in ps]
        beta1, beta2 = group["betas"]
        adam(
            masters,
            g32,
            exp_avgs,
            exp_avg_sqs,
            [],
            steps,
            foreach=None,
            decoupled_weight_decay=True,
            amsgrad=False,
            beta1=beta1,
            beta2=beta2,
            lr=group["lr"],
            weight_decay=group["weight_decay"],
            eps=group["eps"],
            maximize=False,
        )
        for p, w in zip(ps, masters, strict=True):
            p.copy_(w)

    def _step_triton(self, gi, group, grads, scale, finite) -> None:
        """One launch for the whole group: each program takes BLOCK elements of one tensor,
        found through tables of chunk -> tensor and tensor -> pointers, sizes, offsets."""
        kernel = _triton_kernel()
        flat = self._state()[gi]
        ps = group["params"]
        chunk_t, chunk_s, n_tab, off_tab = self._chunks(gi)
        # The kernel walks both as flat, 16-byte aligned memory of the weights' dtype (the
        # weights are checked when the state is built); a gradient in another layout is copied.
        grads = [
            g
            if g.is_contiguous() and g.data_ptr() % 16 == 0
            else g.clone(memory_format=torch.contiguous_format)
            for g in grads
        ]
        if any(g.dtype != p.dtype for g, p in zip(grads, ps, strict=True)):
            raise ValueError("MasterAdamW: a gradient's dtype differs from its parameter's")
        device = ps[0].device
        cuda = device.type == "cuda"
        # Pinned and asynchronous: a copy from pageable memory would wait for the device.
        pointers = torch.tensor(
            [[p.data_ptr() for p in ps], [g.data_ptr() for g in grads]],
            dtype=torch.int64,
            pin_memory=cuda,
        ).to(device, non_blocking=cuda)
        beta1, beta2 = group["betas"]
        # FusedAdam's bias corrections, from the step count on the device: 1 - beta**step in
        # fp64, then fp32 (what a Python float argument becomes in the kernel).
        step = flat["step"].double()
        scalars = torch.stack(
            [scale, finite.float(), (1.0 - beta1**step).float(), (1.0 - beta2**step).float()]
        )
        kernel[(chunk_t.numel(),)](
            chunk_t,
            chunk_s,
            n_tab,
            off_tab,
            pointers[0],
            pointers[1],
            flat["master"],
            flat["exp_avg"],
            flat["exp_avg_sq"],
            scalars,
            group["lr"],
            beta1,
            beta2,
            group["eps"],
            group["weight_decay"],
            BLOCK=BLOCK,
            BF16=ps[0].dtype == torch.bfloat16,
            ALIGN=ALIGN,
        )

    def _chunks(self, gi: int) -> tuple[torch.Tensor, ...]:
        """The launch tables of group `gi`, built once: per chunk its tensor and first element,
        per tensor its size and offset in the flat state."""
        flat = self._state()[gi]
        if "chunks" not in flat:
            device = flat["master"].device
            sizes = torch.tensor([n for _, n in flat["views"]], dtype=torch.int64)
            offsets = torch.tensor([o for o, _ in flat["views"]], dtype=torch.int64)
            counts = (sizes + BLOCK - 1) // BLOCK
            chunk_t = torch.repeat_interleave(torch.arange(len(sizes)), counts)
            first = torch.cumsum(counts, 0) - counts  # each tensor's first chunk
            chunk_s = (torch.arange(int(counts.sum())) - first[chunk_t]) * BLOCK
            flat["chunks"] = tuple(
                t.to(device) for t in (chunk_t.to(torch.int32), chunk_s, sizes, offsets)
            )
        return flat["chunks"]

    def state_dict(self) -> dict:
        groups = [{k: v for k, v in g.items() if k != "params"} for g in self.param_groups]
        state = [
            {"step": int(flat["step"]), **{k: flat[k] for k in ("master", "exp_avg", "exp_avg_sq")}}
            for flat in self._state()
        ]
        return {"format": FORMAT, "param_groups": groups, "state": state}

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict) -> None:
        if state_dict.get("format") != FORMAT:
            raise ValueError(
                "this checkpoint's optimizer state is not MasterAdamW's (train.perf.optimizer "
                "differs from the run that saved it)"
            )
        if len(state_dict["state"]) != len(self._state()):
            raise ValueError("MasterAdamW state: the number of parameter groups differs")
        for gi, (flat, saved) in enumerate(zip(self._flat, state_dict["state"], strict=True)):
            if saved["master"].numel() != flat["master"].numel():
                raise ValueError(f"MasterAdamW state: parameter group {gi} has another size")
            for key in ("master", "exp_avg", "exp_avg_sq"):
                flat[key].copy_(saved[key])
            flat["step"].fill_(int(saved["step"]))
            self.param_groups[gi].update(state_dict["param_groups"][gi])
            # The 16-bit weights are the masters rounded: what they were when saved.
            for i, p in enumerate(self.param_groups[gi]["params"]):
                p.copy_(self._view(gi, "master", i))


BLOCK = 2048
ALIGN = 64  # elements: 256 bytes of fp32 state
_KERNEL = None


def _triton_kernel():
    """The Triton kernel, built on first use (Triton comes with CUDA builds of torch; on CPU
    the tests run it in Triton's interpreter, TRITON_INTERPRET=1)."""
    global _KERNEL
    if _KERNEL is not None:
        return _KERNEL
    import triton
    import triton.language as tl

    @triton.jit
    def adamw_master(
        chunk_t,
        chunk_s,
        n_tab,
        off_tab,
        p_tab,
        g_tab,
        w_ptr,
        m_ptr,
        v_ptr,
        scalars,
        lr,
        beta1,
        beta2,
        eps,
        decay,
        BLOCK: tl.constexpr,
        BF16: tl.constexpr,
        ALIGN: tl.constexpr,
    ):
        c = tl.program_id(0)
        t = tl.load(chunk_t + c)
        n = tl.load(n_tab + t)
        # Alignment the host guarantees (ALIGN-element state offsets, 16-byte addresses,
        # BLOCK-element chunks) and Triton cannot see in values read from memory.
        base = tl.multiple_of(tl.load(off_tab + t), ALIGN)
        p_addr = tl.multiple_of(tl.load(p_tab + t), 16)
        g_addr = tl.multiple_of(tl.load(g_tab + t), 16)
        if BF16:
            p_ptr = p_addr.to(tl.pointer_type(tl.uint16))
            g_ptr = g_addr.to(tl.pointer_type(tl.bfloat16))
        else:
            p_ptr = p_addr.to(tl.pointer_type(tl.float32))
            g_ptr = g_addr.to(tl.pointer_type(tl.float32))
        offs = tl.multiple_of(tl.load(chunk_s + c), BLOCK) + tl.arange(0, BLOCK)
        # scale, ok (0: a non-finite gradient norm, the step is skipped), bias corrections
        scale = tl.load(scalars)
        ok = tl.load(scalars + 1)
        bc1 = tl.load(scalars + 2)
        bc2 = tl.load(scalars + 3)
        mask = offs < tl.where(ok != 0.0, n, 0)
        g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32) * scale
        w = tl.load(w_ptr + base + offs, mask=mask, other=0.0)
        m = tl.load(m_ptr + base + offs, mask=mask, other=0.0)
        v = tl.load(v_ptr + base + offs, mask=mask, other=0.0)
        # DeepSpeed's multi_tensor_adam.cu, ADAM_MODE_1 (AdamW), in fp32.
        m = beta1 * m + (1.0 - beta1) * g
        v = beta2 * v + (1.0 - beta2) * g * g
        denom = tl.sqrt_rn(tl.div_rn(v, bc2)) + eps
        update = tl.div_rn(tl.div_rn(m, bc1), denom) + decay * w
        w = w - lr * update
        tl.store(w_ptr + base + offs, w, mask=mask)
        tl.store(m_ptr + base + offs, m, mask=mask)
        tl.store(v_ptr + base + offs, v, mask=mask)
        if BF16:
            # bf16 = the top half of fp32's bits, rounded to nearest even (NaN stays NaN), as
            # torch rounds; by hand, since Triton's interpreter (the CPU tests) truncates.
            bits = w.to(tl.uint32, bitcast=True)
            bits = tl.where(w != w, 0x7FC00000, bits)
            bits = bits + 0x7FFF + ((bits >> 16) & 1)
            tl.store(p_ptr + offs, (bits >> 16).to(tl.uint16), mask=mask)
        else:
            tl.store(p_ptr + offs, w, mask=mask)

    _KERNEL = adamw_master
    return _KERNEL
