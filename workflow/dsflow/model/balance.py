"""Expert load balancing for HF ``DeepseekV3ForCausalLM`` and ``DeepseekV2ForCausalLM``
training, as each family was trained.

Hugging Face ships both routers without their training-time balancing. DeepSeek-V3's
(``DeepseekV3TopkRouter``, sigmoid scores) has the ``e_score_correction_bias`` buffer used for
routing but never updated, and no auxiliary loss. :class:`ExpertBalancer` adds DeepSeek-V3's
balancing (paper section 2.1.2):

- auxiliary-loss-free balancing: after every optimizer step, each router's bias moves by
  ``gamma * sign(mean_load - load)`` -- up for underloaded experts, down for overloaded
  ones -- from the step's token counts summed over all micro-batches and data-parallel
  ranks (so the update is identical everywhere);
- optionally the complementary sequence-wise auxiliary loss (eqs. 17-20), ``seq_aux_alpha``.

DeepSeek-V2's router (``DeepseekV2TopkRouter``, softmax scores) has no bias: the balancer adds
DeepSeek-V2's expert-level balance loss (paper section 2.2.4, ``MoEGate`` of DeepSeek's code),
weighted by the config's ``aux_loss_alpha``, per sequence (``seq_aux``) or over the micro-batch.
Both keep the token counts and their statistics. :func:`from_params` picks the family's.

Dtypes: the bias must stay fp32 (small ``gamma`` steps vanish in bf16). HF keeps it fp32 in
``from_pretrained`` (``_keep_in_fp32_modules_strict``) but ``from_config(dtype=bf16)`` and
``model.to(bf16)`` cast it; the balancer upcasts it back when attached. DeepSpeed 0.19's
bf16/fp16 engines cast parameters only: buffers keep their dtype unless ``buffer_dtype`` is
configured, and even then ``_keep_in_fp32_modules_strict`` buffers stay fp32
(``deepspeed/runtime/keep_in_fp32.py``). DeepSpeed broadcasts parameters, not buffers, at
start-up: ranks start with equal biases only when they load the same weights (fresh init
zeros them); :meth:`ExpertBalancer.sync_bias` broadcasts them explicitly.
"""

from __future__ import annotations

import math
import re
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist


def _in_backward() -> bool:
    """True while the autograd engine runs a backward pass: then a forward is an activation-
    checkpointing recomputation and must not be counted twice."""
    graph_task_id = getattr(torch._C, "_current_graph_task_id", None)
    return graph_task_id is not None and graph_task_id() != -1


def load_stats(load: Any) -> dict[str, Any]:
    """Balance statistics of one layer's per-expert token counts.

    ``max_over_mean``: max load / mean load (1.0 = perfectly even, ``n_experts`` = all tokens on
    one expert). ``entropy``: entropy of the load distribution / log(n_experts) (1.0 = even,
    0.0 = one expert). ``load``: the counts. Both ratios are None when no token was counted.
    """
    counts = torch.as_tensor(load, dtype=torch.float64).flatten().cpu()
    n = counts.numel()
    total = float(counts.sum())
    stats: dict[str, Any] = {
        "tokens": int(round(total)),
        "load": [int(c) if float(c).is_integer() else float(c) for c in counts.tolist()],
    }
    if total <= 0 or n == 0:
        stats.update(max_over_mean=None, entropy=None)
        return stats
    p = counts / total
    nz = p[p > 0]
    entropy = float(-(nz * nz.log()).sum())
    stats["max_over_mean"] = float(counts.max() / (total / n))
    stats["entropy"] = entropy / math.log(n) if n > 1 else 1.0
    return stats


def aggregate_stats(per_layer: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """Per-layer stats plus aggregates over the layers that saw tokens: ``max_over_mean``
    (mean over layers), ``max_over_mean_worst`` (max), ``entropy_min`` and ``entropy_mean``."""
    seen = [s for s in per_layer.values() if s["max_over_mean"] is not None]
    out: dict[str, Any] = {"layers": per_layer}
    if seen:
        out["max_over_mean"] = sum(s["max_over_mean"] for s in seen) / len(seen)
        out["max_over_mean_worst"] = max(s["max_over_mean"] for s in seen)
        out["entropy_min"] = min(s["entropy"] for s in seen)
        out["entropy_mean"] = sum(s["entropy"] for s in seen) / len(seen)
    else:
        out.update(
            max_over_mean=None, max_over_mean_worst=None, entropy_min=None, entropy_mean=None
        )
    return out


def moe_block_classes() -> tuple[type, ...]:
    """The MoE block of each family: ``DeepseekV3MoE``, ``DeepseekV2Moe``."""
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2Moe
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

    return DeepseekV3MoE, DeepseekV2Moe


def find_routers(model: torch.nn.Module) -> list[tuple[int, torch.nn.Module]]:
    """``(decoder layer index, router)`` of every MoE block of either family, in layer order."""
    blocks = moe_block_classes()
    found = []
    for name, module in model.named_modules():
        if isinstance(module, blocks):
            match = re.search(r"layers\.(\d+)\.", name + ".")
            layer = int(match.group(1)) if match else len(found)
            found.append((layer, module.gate))
    return found


# DeepSeek's own DeepseekV2Config defaults, for a DeepSeek-V2 config without the keys.
V2_DEFAULTS = {"aux_loss_alpha": 0.001, "seq_aux": True}


def from_params(model: torch.nn.Module, balance: dict[str, Any]) -> tuple[ExpertBalancer, str]:
    """The balancer ``train.balance`` asks for, as the model's family was trained, and one
    line saying which balancing that is. DeepSeek-V3: the routing bias (``gamma``) and the
    sequence-wise aux loss (``seq_aux_alpha``). DeepSeek-V2: its balance loss, weighted by
    ``aux_loss_alpha`` (``auto``: the model config's) in the config's ``seq_aux`` form."""
    config = model.config
    if not find_routers(model):
        return ExpertBalancer(model, gamma=0.0), "none (no MoE layers)"
    if config.model_type != "deepseek_v2":
        gamma, alpha = balance["gamma"], balance["seq_aux_alpha"]
        line = (
            f"deepseek_v3: aux-loss-free routing bias, gamma {gamma:g} (train.balance.gamma), "
            f"and the sequence-wise aux loss, alpha {alpha:g} (train.balance.seq_aux_alpha)"
        )
        return ExpertBalancer(model, gamma=gamma, seq_aux_alpha=alpha), line
    alpha, source = balance.get("aux_loss_alpha", "auto"), "train.balance.aux_loss_alpha"
    if alpha == "auto":
        alpha = getattr(config, "aux_loss_alpha", None)
        source = "the model config's aux_loss_alpha"
        if alpha is None:
            alpha, source = V2_DEFAULTS["aux_loss_alpha"], "DeepSeek-V2's default aux_loss_alpha"
    seq_aux = getattr(config, "seq_aux", V2_DEFAULTS["seq_aux"])
    line = (
        f"deepseek_v2: DeepSeek-V2's {'sequence' if seq_aux else 'batch'}-wise balance loss, "
        f"alpha {alpha:g} ({source}); no routing bias (train.balance.gamma and seq_aux_alpha "
        "are deepseek_v3's)"
    )
    return ExpertBalancer(model, gamma=0.0, seq_aux_alpha=alpha, seq_aux=seq_aux), line


class ExpertBalancer:
    """Expert balancing of either family through forward hooks on its routers: DeepSeek-V3's
    auxiliary-loss-free bias (+ optional sequence-wise aux loss), or DeepSeek-V2's balance
    loss (routers without a bias: nothing to update, the counts still give the stats).

    Per training step::

        for micro_batch in step:
            loss = model(**micro_batch).loss + balancer.aux_loss()
            loss.backward()
        optimizer.step()
        stats = balancer.update()   # all-reduce counts, move biases, reset

    Counting happens in training mode only (``router.training``), never during the
    backward-time recomputation of activation checkpointing. To gather statistics in
    eval/generation, wrap it in :meth:`collecting` and read :meth:`eval_stats`.

    ``gamma``: bias update speed (DeepSeek-V3 used 0.001, then 0.0 for the last 500B tokens);
    0 keeps the biases fixed but still reports stats; no effect on routers without a bias.
    ``seq_aux_alpha``: weight of the balance loss (DeepSeek-V3: 0.0001, DeepSeek-V2: its
    config's ``aux_loss_alpha``); 0 disables it. ``seq_aux``: the loss per sequence, averaged
    over the micro-batch's sequences (True), or over all the micro-batch's tokens as one
    sequence (False, DeepSeek-V2's ``seq_aux: false``). The scores are the family's: V3's
    sigmoid scores normalised over the experts (eq. 19), V2's softmax.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        gamma: float = 1e-3,
        seq_aux_alpha: float = 0.0,
        seq_aux: bool = True,
    ):
        if gamma < 0 or seq_aux_alpha < 0:
            raise ValueError("gamma and seq_aux_alpha must be >= 0")
        self.gamma = float(gamma)
        self.seq_aux_alpha = float(seq_aux_alpha)
        self.seq_aux = bool(seq_aux)
        self.routers = find_routers(model)
        self.layers = [layer for layer, _ in self.routers]
        self.n_experts = self.routers[0][1].num_experts if self.routers else 0
        self._counts: torch.Tensor | None = None  # [n_moe_layers, n_experts] int64, training
        self._eval_counts: torch.Tensor | None = None  # same, while collecting()
        self._collecting = False
        self._aux: list[tuple[torch.Tensor, torch.Tensor, int]] = []  # (logits, top-k, batch)
        self._warned_no_grad = False
        self._traced = False
        self.softmax = bool(self.routers) and not self.biases  # DeepSeek-V2's routers
        for bias in self.biases:
            if bias.dtype != torch.float32:
                bias.data = bias.data.float()
        self._handles = [
            router.register_forward_hook(self._make_hook(i), with_kwargs=True)
            for i, (_, router) in enumerate(self.routers)
        ]

    @property
    def biases(self) -> list[torch.Tensor]:
        """Every router's bias, in layer order: DeepSeek-V3's routers carry one, V2's none.
        Looked up each time: moving the model to a device replaces its buffers."""
        found = [getattr(r, "e_score_correction_bias", None) for _, r in self.routers]
        return [bias for bias in found if bias is not None]

    # ------------------------------------------------------------------ hooks
    def _make_hook(self, index: int):
        # Runs eagerly, between the compiled graphs (train.perf.compile): it asks the autograd
        # engine whether this forward is a recomputation, which torch.compile cannot trace.
        @torch.compiler.disable
        def hook(module, args, kwargs, output):
            self._on_route(index, module, args, kwargs, output)

        return hook

    def trace_hooks(self, device: torch.device | str | None = None) -> None:
        """Let torch.compile trace the router hooks into the compiled layers: an eager hook
        splits every MoE layer into several graphs, each with its own host overhead in forward
        and backward. Only where no forward is recomputed in a backward pass (no activation
        checkpointing): a traced hook cannot tell a recomputation apart. Training counts live
        on `device` (the training device; None: the routers') from now on, so tracing never
        allocates them."""
        if not self.routers:
            return  # a dense model: no hooks
        self._traced = True
        self._buffer("_counts", torch.device(device) if device is not None else self._device())
        for handle in self._handles:
            handle.remove()

        # One hook object for every router, and each router's counts row a tensor attribute
        # of its own: no per-layer Python constant, so the MoE layers share one compiled graph.
        def hook(module, args, kwargs, output):
            router_logits, _, topk_indices = output
            if self._collecting:
                self._on_route(module._dsflow_index, module, args, kwargs, output)
                return
            if module.training:
                with torch.no_grad():
                    # A compare-and-sum, which compiles into one reduction; an integer
                    # index_add_ would fall back to a sort-based scatter kernel.
                    chosen = topk_indices.reshape(-1, 1)
                    experts = torch.arange(self.n_experts, device=chosen.device)
                    module._dsflow_counts.add_((chosen == experts).sum(0))
            self._stash_aux(module, args, kwargs, router_logits, topk_indices)

        for i, (_, router) in enumerate(self.routers):
            router._dsflow_index = i
            router._dsflow_aux = []
        self._point_rows()
        self._handles = [
            router.register_forward_hook(hook, with_kwargs=True) for _, router in self.routers
        ]

    def _point_rows(self) -> None:
        if self._traced:
            for i, (_, router) in enumerate(self.routers):
                router._dsflow_counts = self._counts[i]

    def _buffer(self, which: str, device: torch.device) -> torch.Tensor:
        buf = getattr(self, which)
        if buf is None or buf.device != device:
            new = torch.zeros(len(self.routers), self.n_experts, dtype=torch.int64, device=device)
            if buf is not None:
                new += buf.to(device)
            setattr(self, which, new)
            buf = new
            if which == "_counts":
                self._point_rows()  # traced hooks add into views of the counts
        return buf

    def _on_route(self, index, module, args, kwargs, output) -> None:
        if _in_backward():
            return
        router_logits, _, topk_indices = output
        if self._collecting or module.training:
            which = "_eval_counts" if self._collecting else "_counts"
            with torch.no_grad():
                # Not torch.bincount: on CUDA it reads the indices' min and max back to the
                # host to size its output, two device syncs in every MoE layer's forward that
                # leave the GPU idle while the host catches up. Integer adds are exact in any
                # order, so the atomics give bincount's counts.
                chosen = topk_indices.reshape(-1)
                row = self._buffer(which, chosen.device)[index]
                row.index_add_(0, chosen, torch.ones_like(chosen, dtype=row.dtype))
        self._stash_aux(module, args, kwargs, router_logits, topk_indices)

    def _stash_aux(self, module, args, kwargs, router_logits, topk_indices) -> None:
        if self.seq_aux_alpha > 0 and module.training:
            if not (torch.is_grad_enabled() and router_logits.requires_grad):
                if self._warned_no_grad:
                    return
                self._warned_no_grad = True
                warnings.warn(
                    "ExpertBalancer: training-mode forward without autograd (torch.no_grad, or "
                    "reentrant activation checkpointing): no sequence-wise aux loss for it; use "
                    "non-reentrant checkpointing (use_reentrant=False) with seq_aux_alpha > 0",
                    stacklevel=2,
                )
                return
            hidden = args[0] if args else kwargs["hidden_states"]
            batch = hidden.shape[0] if hidden.dim() == 3 else 1
            # Only stash: computing the loss here, inside an activation-checkpointed region,
            # would save tensors that the (skipped) recomputation does not, and the
            # non-reentrant checkpoint checks that the two match.
            # Traced hooks stash per router: a list shared by the layers would have another
            # length in each, and torch.compile would compile every layer separately.
            stash = module._dsflow_aux if self._traced else self._aux
            stash.append((router_logits, topk_indices, batch))

    def _balance_loss(self, logits: torch.Tensor, topk: torch.Tensor, batch: int) -> torch.Tensor:
        """sum_i f_i P_i averaged over the batch's sequences, for one layer: DeepSeek-V3's
        eqs. 18-20 (sigmoid scores normalised over the experts), or DeepSeek-V2's expert-level
        balance loss (softmax scores); with ``seq_aux`` False the micro-batch is one sequence."""
        n_exp, k = self.n_experts, topk.shape[-1]
        seqs = batch if self.seq_aux else 1
        if self.softmax:
            scores = logits.float().softmax(-1).view(seqs, -1, n_exp)  # s_{i,t}, with grad
        else:
            scores = logits.float().sigmoid().view(seqs, -1, n_exp)
            scores = scores / scores.sum(-1, keepdim=True)
        seq_len = scores.shape[1]
        p = scores.mean(1)  # P_i per sequence, [seqs, E]
        with torch.no_grad():
            hits = torch.zeros(seqs, n_exp, dtype=scores.dtype, device=scores.device)
            idx = topk.reshape(seqs, seq_len * k)
            hits.scatter_add_(1, idx, torch.ones_like(idx, dtype=scores.dtype))
            f = hits * (n_exp / (k * seq_len))  # f_i per sequence, [seqs, E]
        return (f * p).sum(-1).mean()

    # ------------------------------------------------------------------ aux loss
    def aux_loss(self) -> torch.Tensor:
        """``seq_aux_alpha * sum over MoE layers of the balance loss`` of the forwards since
        the last call (one micro-batch); a 0 tensor when disabled or empty.
        Clears the stash: call once per micro-batch, before backward."""
        if self._traced:
            for _, router in self.routers:
                self._aux.extend(router._dsflow_aux)
                router._dsflow_aux.clear()
        if not self._aux:
            device = self.routers[0][1].weight.device if self.routers else "cpu"
            return torch.zeros((), device=device)
        total = torch.stack([self._balance_loss(*item) for item in self._aux]).sum()
        self._aux = []
        return total * self.seq_aux_alpha

    # ------------------------------------------------------------------ bias updates
    def _device(self) -> torch.device:
        return self.routers[0][1].weight.device

    def _reduced(self, which: str, group: Any) -> torch.Tensor:
        counts = self._buffer(which, self._device())
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(counts, op=dist.ReduceOp.SUM, group=group)
        return counts

    def _stats(self, counts: torch.Tensor) -> dict[str, Any]:
        host = counts.detach().to("cpu", torch.float64)
        return aggregate_stats({layer: load_stats(host[i]) for i, layer in enumerate(self.layers)})

    def update(self, group: Any = None) -> dict[str, Any]:
        """End of an optimizer step: all-reduce (SUM) the step's counts over ``group`` when
        torch.distributed is initialized (every rank must call it), move each router's bias
        by ``gamma * sign(mean_load - load)`` in place, reset the counts, return the stats
        (see :func:`aggregate_stats`; ``bias_abs_max`` is the largest |bias| after the update)."""
        return self.stats_of(self.update_async(group))

    def update_async(self, group: Any = None, applied: Any = True) -> dict[str, Any]:
        """:meth:`update` without reading anything back from the device: returns the step's
        reduced counts and the largest |bias| as device tensors, for :meth:`stats_of` once they
        are on the host (dsflow.train.metrics). ``applied``: a bool, or a bool tensor on the device
        (a fused optimizer that decides on the device whether it took the step); where it is
        false the biases stay."""
        if not self.routers:
            return {}
        counts = self._reduced("_counts", group)
        snapshot = {"counts": counts.clone()}
        counts.zero_()
        biases = self.biases
        if not biases:  # DeepSeek-V2's routers: nothing to move
            return snapshot
        if self.gamma > 0 and applied is not False:
            load = snapshot["counts"].to(torch.float64)
            step = torch.sign(load.mean(-1, keepdim=True) - load) * self.gamma
            if isinstance(applied, torch.Tensor):
                step = step * applied.to(device=step.device, dtype=step.dtype)
            step = step.to(device=biases[0].device, dtype=biases[0].dtype)
            with torch.no_grad():
                torch._foreach_add_(biases, list(step.unbind(0)))
        norms = torch._foreach_norm([b.detach() for b in biases], float("inf"))
        snapshot["bias_abs_max"] = torch.stack(norms).max()
        return snapshot

    def stats_of(self, snapshot: dict[str, Any]) -> dict[str, Any]:
        """The stats of :meth:`update` from what :meth:`update_async` returned (its tensors
        on the device or read back: `counts` a tensor, `bias_abs_max` a tensor or float)."""
        if not snapshot:
            return aggregate_stats({})
        stats = self._stats(snapshot["counts"])
        if "bias_abs_max" in snapshot:
            stats["bias_abs_max"] = float(snapshot["bias_abs_max"])
        return stats

    def sync_bias(self, group: Any = None) -> None:
        """Broadcast every router bias from the group's first rank (DeepSpeed broadcasts
        parameters at start-up, not buffers). No-op without torch.distributed."""
        if not (dist.is_available() and dist.is_initialized()) or not self.biases:
            return
        src = dist.get_global_rank(group, 0) if group is not None else 0
        for bias in self.biases:
            dist.broadcast(bias, src=src, group=group)

    def bias_state(self) -> list[torch.Tensor]:
        """Every router's bias (CPU copies, layer order), e.g. for a checkpoint's client state;
        empty for routers without one (DeepSeek-V2's)."""
        return [bias.detach().cpu().clone() for bias in self.biases]

    def load_bias_state(self, biases: list[torch.Tensor]) -> None:
        """Restore what :meth:`bias_state` returned (the same model shape)."""
        if len(biases) != len(self.biases):
            raise ValueError(f"{len(biases)} router biases for {len(self.biases)} routers")
        with torch.no_grad():
            for mine, bias in zip(self.biases, biases, strict=True):
                mine.copy_(bias)

    # ------------------------------------------------------------------ eval statistics
    @contextmanager
    def collecting(self) -> Iterator[ExpertBalancer]:
        """Count routing in any mode (eval, generation, no_grad) into a separate buffer, for
        :meth:`eval_stats`; training counts are untouched meanwhile."""
        previous, self._collecting = self._collecting, True
        try:
            yield self
        finally:
            self._collecting = previous

    def eval_stats(self, group: Any = None, reset: bool = True) -> dict[str, Any]:
        """Stats of what :meth:`collecting` counted (all-reduced like :meth:`update`), no bias
        change."""
        if not self.routers:
            return aggregate_stats({})
        counts = self._reduced("_eval_counts", group)
        stats = self._stats(counts)
        if reset:
            counts.zero_()
        return stats

    # ------------------------------------------------------------------ misc
    def counts(self) -> torch.Tensor:
        """The current (local, not yet reduced) training counts, [n_moe_layers, n_experts]."""
        if not self.routers:
            return torch.zeros(0, 0, dtype=torch.int64)
        return self._buffer("_counts", self._device()).clone()

    def reset(self) -> None:
        for buf in (self._counts, self._eval_counts):
            if buf is not None:
                buf.zero_()
        self._clear_aux()

    def _clear_aux(self) -> None:
        self._aux = []
        for _, router in self.routers:
            if hasattr(router, "_dsflow_aux"):
                router._dsflow_aux.clear()

    def remove(self) -> None:
        """Detach the hooks."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._clear_aux()
