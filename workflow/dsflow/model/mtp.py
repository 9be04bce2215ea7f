"""DeepSeek-V3's multi-token prediction (MTP, the technical report's section 2.2): D sequential
modules after the main model; depth k predicts token t_{i+k+1} from position i.

Depth k (1..D) combines the previous depth's hidden state h^{k-1}_i (h^0: the main model's
output) with the embedding of token t_{i+k}::

    h'_i  = eh_proj([enorm(Emb(t_{i+k})); hnorm(h^{k-1}_i)])      (M_k: Linear(2d -> d))
    h^k_i = TRM_k(h'_i)                                           (one MoE decoder layer)
    P^k   = softmax(head(shared_head.norm(h^k_i)))

The embedding and the output head are the main model's (shared, trained by every depth). The
concatenation order, embedding first, is vLLM's DeepSeekMultiTokenPredictorLayer
(vllm-project/vllm, vllm/model_executor/models/deepseek_mtp.py: ``self.eh_proj(torch.cat(
[inputs_embeds, previous_hidden_states], dim=-1))``), which loads DeepSeek's published
weights; h^0 is the main model's output after its final norm, as vLLM hands it over.

HF's DeepseekV3ForCausalLM has no MTP. dsflow attaches the modules to the HF model as
``hf.mtp`` (``mtp.layers.{L + k - 1}.*``, L = num_hidden_layers), so the HF model's own weights
keep HF's names and ``mtp.`` -> ``model.`` gives the published checkpoint's names
(``model.layers.{L + k - 1}.enorm`` etc., with the decoder layer's weights beside them).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from dsflow.errors import UsageError
from dsflow.model.presets import activated_matmul_params, mtp_layer_is_moe, mtp_matmul_params


def check_depth(depth: int, model_type: str) -> None:
    """MTP is DeepSeek-V3's: a V2-family model with depth > 0 is a one-line UsageError."""
    if depth and model_type != "deepseek_v3":
        raise UsageError(
            f"model.mtp_depth {depth}: multi-token prediction is DeepSeek-V3's; the model is "
            f"{model_type} (use a V3 preset or checkpoint, or set model.mtp_depth: 0)"
        )


class MTPLayer(nn.Module):
    """One depth: the published checkpoint's ``model.layers.{L + k - 1}`` (enorm, hnorm,
    eh_proj, shared_head.norm and a decoder layer's weights, under the same names)."""

    def __init__(self, config: Any, layer_idx: int):
        super().__init__()
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
            DeepseekV3DecoderLayer,
            DeepseekV3RMSNorm,
        )

        H, eps = config.hidden_size, config.rms_norm_eps
        block = DeepseekV3DecoderLayer(config, layer_idx)  # MoE: layer_idx >= first_k_dense
        # The decoder layer's submodules directly under this one: the published names.
        for name, child in block.named_children():
            self.add_module(name, child)
        self.enorm = DeepseekV3RMSNorm(H, eps=eps)
        self.hnorm = DeepseekV3RMSNorm(H, eps=eps)
        self.eh_proj = nn.Linear(2 * H, H, bias=False)
        self.shared_head = nn.Module()
        self.shared_head.norm = DeepseekV3RMSNorm(H, eps=eps)
        # A dense block runs on the whole window (MultiTokenPrediction.states); the planner
        # decides dense or MoE by the same rule.
        depth = layer_idx - config.num_hidden_layers + 1
        self.full_length = not mtp_layer_is_moe(config, depth)

    def forward(self, embeds: torch.Tensor, previous: torch.Tensor, rope) -> torch.Tensor:
        h = self.eh_proj(torch.cat([self.enorm(embeds), self.hnorm(previous)], dim=-1))
        # DeepseekV3DecoderLayer.forward's steps; no mask: SDPA then attends causally.
        attn, _ = self.self_attn(
            hidden_states=self.input_layernorm(h), attention_mask=None, position_embeddings=rope
        )
        h = h + attn
        return h + self.mlp(self.post_attention_layernorm(h))


class MultiTokenPrediction(nn.Module):
    """The D depths, keyed by their published layer index (``layers.{L + k - 1}``)."""

    def __init__(self, config: Any, depth: int):
        super().__init__()
        first = config.num_hidden_layers
        self.layers = nn.ModuleDict(
            {str(first + k): MTPLayer(config, first + k) for k in range(depth)}
        )

    def states(
        self, hf: Any, input_ids: torch.Tensor, hidden: torch.Tensor, embeds=None
    ) -> list[torch.Tensor]:
        """Each depth's h^k from the main model's output `hidden` ([batch, T, H]) for the
        inputs `input_ids` ([batch, T]; `embeds`: their embeddings, where the caller has them).

        Depth k predicts for the first T - k positions. A depth with a dense block runs on all
        T ([batch, T, H]): its embeddings are the inputs' shifted by k, the tail filled with the
        first k (whatever is there: attention is causal and the rest works token by token, so
        the tail changes no earlier position, and its targets are IGNORE). Its GEMMs keep the
        main layers' row counts and no state is sliced or copied. An MoE block runs on the
        T - k positions ([batch, T - k, H]): tail tokens would count in its router's balance."""
        if embeds is None:
            embeds = hf.model.embed_tokens(input_ids)
        T = input_ids.shape[1]
        if T <= len(self.layers):
            raise ValueError(
                f"train.seq_len {T} leaves no tokens at depth {T} (model.mtp_depth "
                f"{len(self.layers)})"
            )
        # One rotary table for every depth: position i's is the same at any length.
        positions = torch.arange(T, device=input_ids.device)[None]
        cos, sin = hf.model.rotary_emb(embeds, positions)
        out = []
        for k, layer in enumerate(self.layers.values(), start=1):
            n = T if layer.full_length else T - k
            shifted = torch.roll(embeds, -k, dims=1) if layer.full_length else embeds[:, k:]
            hidden = layer(shifted, hidden[:, :n], (cos[:, :n], sin[:, :n]))
            out.append(hidden)
        return out

    def hidden_states(self, hf: Any, input_ids: torch.Tensor, hidden: torch.Tensor):
        """Each depth's h^k ([batch, T - k, H]: the positions it predicts for)."""
        states = self.states(hf, input_ids, hidden)
        return [h[:, : input_ids.shape[1] - k] for k, h in enumerate(states, start=1)]

    def losses(
        self,
        hf: Any,
        input_ids: torch.Tensor,
        targets: torch.Tensor,
        hidden: torch.Tensor,
        head_loss: Callable[..., torch.Tensor],
        embeds: torch.Tensor | None = None,
        *,
        ignore: int,
    ) -> list[torch.Tensor]:
        """L_k for k = 1..D: the mean NLL of t_{i+k+1} (``targets[:, k:]``), each through
        `head_loss(normed hidden [N, H], targets [N], count)`, the main loss's own head; a
        full-length depth's tail targets are `ignore` (the head's value for a target that does
        not count: dsflow.model.loss.IGNORE) and not counted."""
        layers = list(self.layers.values())
        out = []
        for k, h in enumerate(self.states(hf, input_ids, hidden, embeds), start=1):
            normed = layers[k - 1].shared_head.norm(h)
            wanted = targets[:, k:]
            count = wanted.numel()
            if h.shape[1] > wanted.shape[1]:
                wanted = F.pad(wanted, (0, k), value=ignore)
            out.append(head_loss(normed.flatten(0, 1), wanted.flatten(), count))
        return out


def attach(hf: Any, depth: int) -> MultiTokenPrediction | None:
    """``hf.mtp`` with `depth` modules, initialised as HF initialises its layers (the router's
    bias zero, in fp32); None for depth 0."""
    if not depth:
        return None
    check_depth(depth, hf.config.model_type)
    param = next(hf.parameters())
    mtp = MultiTokenPrediction(hf.config, depth).to(dtype=param.dtype)
    for module in mtp.modules():
        hf._init_weights(module)
    for name, buf in mtp.named_buffers():
        if name.endswith("e_score_correction_bias"):
            buf.data = buf.data.float()
    hf.mtp = mtp
    return mtp


# ------------------------------------------------------------------ the published layout


def _expert_split(name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
    """HF's fused expert banks as the published per-expert weights (what save_pretrained
    writes for the main layers too): gate_up_proj [E, 2I, H] -> experts.e.{gate,up}_proj,
    down_proj [E, H, I] -> experts.e.down_proj."""
    prefix, which = name.rsplit(".", 1)
    out = {}
    for e in range(tensor.shape[0]):
        if which == "gate_up_proj":
            gate, up = tensor[e].chunk(2, dim=0)
            out[f"{prefix}.{e}.gate_proj.weight"] = gate.contiguous()
            out[f"{prefix}.{e}.up_proj.weight"] = up.contiguous()
        else:
            out[f"{prefix}.{e}.down_proj.weight"] = tensor[e].contiguous()
    return out


def published_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The MTP weights of `state`, a state dict of the HF model with ``hf.mtp`` (names
    ``mtp.layers.N.*``), under the published checkpoint's names (``model.layers.N.*``,
    per-expert weights), with each depth's copy of the shared embedding and head (the
    state's ``model.embed_tokens.weight`` and ``lm_head.weight``)."""
    out: dict[str, torch.Tensor] = {}
    layers = set()
    for name, tensor in state.items():
        match = re.match(r"mtp\.layers\.(\d+)\.(.*)", name)
        if not match:
            continue
        layers.add(match.group(1))
        key = f"model.layers.{match.group(1)}.{match.group(2)}"
        if re.search(r"mlp\.experts\.(gate_up_proj|down_proj)$", key):
            out.update(_expert_split(key, tensor))
        else:
            out[key] = tensor
    for n in sorted(layers, key=int):
        out[f"model.layers.{n}.embed_tokens.weight"] = state["model.embed_tokens.weight"]
        head = state.get("lm_head.weight", state["model.embed_tokens.weight"])
        out[f"model.layers.{n}.shared_head.head.weight"] = head
    return out


def wanted_keys(mtp: MultiTokenPrediction) -> dict[str, tuple[str, ...]]:
    """Each MTP parameter or buffer name (``layers.N.*``) and the published names it is
    read from (one, or an expert bank's per-expert weights)."""
    out = {}
    for name, tensor in [*mtp.named_parameters(), *mtp.named_buffers()]:
        key = f"model.{name}"
        if re.search(r"mlp\.experts\.(gate_up_proj|down_proj)$", key):
            out[name] = tuple(_expert_split(key, tensor.detach()))
        else:
            out[name] = (key,)
    return out


def load_published(mtp: MultiTokenPrediction, read: Callable[[str], torch.Tensor]) -> None:
    """Copies each MTP weight in from `read(published name)` (per-expert weights fused back
    into HF's banks); a missing or misshapen tensor is a one-line UsageError."""
    tensors = dict([*mtp.named_parameters(), *mtp.named_buffers()])
    for name, keys in wanted_keys(mtp).items():
        target = tensors[name]
        if len(keys) == 1:
            value = read(keys[0])
        elif name.endswith("gate_up_proj"):
            pairs = zip(keys[0::2], keys[1::2], strict=True)
            value = torch.stack([torch.cat([read(g), read(u)], 0) for g, u in pairs])
        else:
            value = torch.stack([read(k) for k in keys])
        if tuple(value.shape) != tuple(target.shape):
            raise UsageError(
                f"MTP weight {keys[0]} is {tuple(value.shape)}, the config makes "
                f"{tuple(target.shape)} (model.mtp_depth)"
            )
        with torch.no_grad():
            target.copy_(value.to(target.dtype))


# ------------------------------------------------------------------ evaluation


@torch.no_grad()
def drafts(hf: Any, input_ids: torch.Tensor, hidden: torch.Tensor) -> list[torch.Tensor]:
    """Each depth's top-1 token at each position ([batch, T - k] for depth k): depth k's at
    position i is its guess of token i + k + 1. `hidden`: the main model's output for
    `input_ids` (after its final norm)."""
    layers = list(hf.mtp.layers.values())
    states = hf.mtp.hidden_states(hf, input_ids, hidden)
    return [
        hf.lm_head(layer.shared_head.norm(h)).argmax(-1)
        for layer, h in zip(layers, states, strict=True)
    ]


def accepted(main: torch.Tensor, guesses: list[torch.Tensor]) -> torch.Tensor:
    """[batch, T]: at each position i, how many drafts in a row the main model confirms in
    greedy self-speculative decoding. `main` [batch, T] is the main head's top-1 token at each
    position (its pick for token i + 1); depth k's draft of token i + k + 1 (`guesses[k - 1]`)
    is accepted when the main head picks it at position i + k and every shallower draft was."""
    streak = torch.ones_like(main, dtype=torch.bool)
    count = torch.zeros_like(main)
    for k, guess in enumerate(guesses, start=1):
        n = guess.shape[1]
        ok = torch.zeros_like(streak)
        ok[:, :n] = guess == main[:, k : k + n]
        streak &= ok
        count += streak
    return count


def speculative_walk(accepted_at: torch.Tensor, start: int, depth: int) -> dict[str, Any]:
    """Greedy self-speculative decoding of each row from position `start` (the prompt's last
    token) to its end: a step at position i emits the main head's token and the `accepted_at[i]`
    drafts it confirms, and the next step starts after them. Returns the tokens emitted per step
    and, per depth, the share of its drafts accepted (depth k drafts when depths < k were)."""
    tokens = steps = 0
    tried, taken = [0] * depth, [0] * depth
    for row in accepted_at.tolist():
        i, end = start, len(row) - 1  # a step at i < end emits token i + 1, inside the row
        while i < end:
            room = end - i - 1  # drafts whose tokens are still inside the row
            got = min(row[i], room)
            for k in range(min(got + 1, depth, room)):
                tried[k] += 1
                taken[k] += k < got
            tokens, steps, i = tokens + 1 + got, steps + 1, i + 1 + got
    return rates({"tokens": tokens, "steps": steps, "tried": tried, "taken": taken})


def rates(counts: dict[str, Any]) -> dict[str, Any]:
    """A walk's counts with its tokens per step and each depth's acceptance added."""
    tokens, steps = counts["tokens"], counts["steps"]
    pairs = zip(counts["taken"], counts["tried"], strict=True)
    return {
        **counts,
        "tokens_per_step": tokens / steps if steps else None,
        "acceptance": [a / t if t else None for a, t in pairs],
    }


def merged(walks: list[dict[str, Any]]) -> dict[str, Any]:
    """The walks of several batches of prompts (or ranks) as one."""
    return rates(
        {
            "tokens": sum(w["tokens"] for w in walks),
            "steps": sum(w["steps"] for w in walks),
            "tried": [sum(x) for x in zip(*(w["tried"] for w in walks), strict=True)],
            "taken": [sum(x) for x in zip(*(w["taken"] for w in walks), strict=True)],
        }
    )


def speedup(walk: dict[str, Any], config: Any, depth: int) -> float | None:
    """Tokens per step over a step's cost in weights read, the bound of memory-bound decoding:
    the main model's activated matmul weights plus each depth's."""
    cost = 1 + depth * mtp_matmul_params(config) / activated_matmul_params(config)
    return walk["tokens_per_step"] / cost if walk["tokens_per_step"] else None


@torch.no_grad()
def greedy(hf: Any, prompts: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """The prompts ([batch, P]) followed by the main model's `new_tokens` greedy tokens."""
    seq = prompts
    for _ in range(new_tokens):
        logits = hf(input_ids=seq, use_cache=False).logits[:, -1]
        seq = torch.cat([seq, logits.argmax(-1, keepdim=True)], dim=1)
    return seq


@torch.no_grad()
def speculative(hf: Any, prompts: torch.Tensor, new_tokens: int) -> dict[str, Any]:
    """Greedy self-speculative decoding of `new_tokens` after each prompt, the MTP depths
    drafting and the main model verifying: `speculative_walk` over the main model's greedy
    continuation (what such decoding emits, since the main model confirms every token), with
    its `speedup`."""
    seq = greedy(hf, prompts, new_tokens)
    hidden = hf.model(input_ids=seq, use_cache=False).last_hidden_state
    main = hf.lm_head(hidden).argmax(-1)
    depth = len(hf.mtp.layers)
    walk = speculative_walk(accepted(main, drafts(hf, seq, hidden)), prompts.shape[1] - 1, depth)
    return {**walk, "speedup": speedup(walk, hf.config, depth)}
