"""What autograd keeps for backward, against the planner's count (CPU, no GPU), and the planner
replayed on the GPU launches whose peaks docs/log.md records.

`saved` (the default): all-dense models of the `medium` preset's shape at each `--widths`
(2 layers, 2 x 256 tokens, bf16, every fast path), eager and compiled, bf16 and each
`--recipes` FP8 recipe (torchao's CPU emulation): the bytes saved_tensors_hooks sees
(parameters left out) beside dsflow.plan.memory.activation_bytes. `--diff` also lists, by size
and dtype, the tensors each run keeps unlike the run before it: how compiled_unsaved and
fp8_unsaved were read off. tests/unit/plan/test_plan.py holds the planner against the same count.

`replay`: the planner's reserved peak (its total without the fixed CUDA context) for the runs of
the planner-accuracy table (docs/log.md's full one; docs/performance.md keeps five of its
rows), as this checkout counts them.

    python bench/saved_activations.py saved --widths 1024,2048,4096 --recipes tensorwise,rowwise
    python bench/saved_activations.py replay
"""

from __future__ import annotations

import argparse
import collections
import copy
import sys

import torch
import train_throughput as tt

from dsflow.model import lora
from dsflow.model.fastpaths import DEFAULT_CE_CHUNK
from dsflow.model.presets import model_config
from dsflow.plan import memory

SEQ, MICRO = 256, 2


def saved_counter(model) -> tuple[dict[int, tuple[int, str]], object]:
    """({storage: (bytes, dtype)}, a saved_tensors_hooks pack function filling it): what
    autograd keeps for backward, the model's parameters left out."""
    own = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, tuple[int, str]] = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in own and storage.data_ptr() != 0:
            saved[storage.data_ptr()] = (storage.nbytes(), str(t.dtype).replace("torch.", ""))
        return t

    return saved, pack


def saved_tensors(
    config,
    compiled: bool,
    *,
    adapters: dict | None = None,
    fp8: str = "off",
    device: str = "cpu",
    dtype: torch.dtype = torch.bfloat16,
    seq: int = SEQ,
) -> dict[int, tuple[int, str]]:
    """{storage: (bytes, dtype)} of what autograd keeps for backward (parameters left out) with
    the train stage's CUDA fast paths (sorted experts, padded flash attention, the fused loss
    in chunks of 37, router hooks traced); `compiled`: every decoder layer through
    torch.compile; `adapters`: train.lora's setting, the base frozen; `fp8`: train.perf.fp8's
    recipe. Counted on the second step (cached graphs)."""
    from dsflow.model import fastpaths
    from dsflow.model.balance import ExpertBalancer
    from dsflow.model.build import build_model
    from dsflow.model.loss import TrainingLM

    torch.manual_seed(0)
    torch._dynamo.reset()
    model = build_model(copy.deepcopy(config), device_type="cpu")
    if adapters:
        model.requires_grad_(False)
        lora.attach(model, adapters)
    model = model.to(device, dtype).train()
    balancer = ExpertBalancer(model, gamma=1e-3, seq_aux_alpha=1e-4)
    perf = fastpaths.Perf(compiled, "flash_padded", 37, False, experts="sorted", fp8=fp8)
    fastpaths.apply(model, perf, balancer)
    trainee = TrainingLM(model, ce_chunk=37)
    saved, pack = saved_counter(model)
    ids = torch.randint(0, config.vocab_size, (MICRO, seq + 1)).to(device)
    for _ in range(2):
        saved.clear()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = trainee(ids[:, :-1], ids[:, 1:]) + balancer.aux_loss()
        loss.backward()
        model.zero_grad(set_to_none=True)
    return dict(saved)


def dense_at(width: int):
    """The `medium` preset's dense layers at hidden `width` (2 layers), as measured here."""
    overrides = {"hidden_size": width, "intermediate_size": width * 11 // 4 // 16 * 16}
    overrides.update(num_hidden_layers=2, first_k_dense_replace=2, v_head_dim=96)
    if width >= 2048:
        overrides.update(q_lora_rank=768 if width == 2048 else 1536, kv_lora_rank=512)
    if width >= 4096:
        overrides["num_attention_heads"] = 32
    return model_config("medium", 1000, overrides)


def difference(before: dict, after: dict) -> str:
    """The tensors (bytes, dtype: count) `after` no longer keeps, and those it keeps instead."""
    a, b = collections.Counter(before.values()), collections.Counter(after.values())
    return f"not kept {sorted((a - b).items())}; kept instead {sorted((b - a).items())}"


def run_saved(args: argparse.Namespace) -> None:
    print("width  run                    saved MB   plan MB   plan/saved")
    for width in map(int, args.widths.split(",")):
        config = dense_at(width)
        previous = None
        for compiled in (False, True):
            for recipe in ("off", *args.recipes.split(",")):
                saved = saved_tensors(config, compiled, fp8=recipe)
                plan = memory.activation_bytes(
                    config, seq_len=SEQ, micro_batch=MICRO, precision="bf16", ce_chunk=37,
                    compiled=compiled, fp8=recipe,
                )["saved_no_checkpointing"]  # fmt: skip
                got = sum(b for b, _ in saved.values())
                name = f"{'compiled' if compiled else 'eager'} {recipe}"
                print(
                    f"{width:5d}  {name:20s} {got / 1e6:9.3f} {plan / 1e6:9.3f}   {plan / got:.3f}"
                )
                if args.diff and previous is not None:
                    print(f"         against the run above: {difference(previous, saved)}")
                previous = saved


# The runs of the planner-accuracy table (docs/log.md): (row, preset, overrides, vocabulary,
# seq, micro, ZeRO stage, train.lora targets or None); the bench's configs where they ran there.
DENSE = {"first_k_dense_replace": 16}
LORA = ["attention", "dense_mlp", "shared_experts"]
LAUNCHES = [
    ("`small` MoE", "small", {}, 3489, 1024, 16, 0, None),
    ("`medium` MoE", "medium", {}, 3489, 1024, 16, 0, None),
    ("`medium` all dense", "medium", DENSE, 3489, 1024, 16, 0, None),
    ("`medium` MoE, ZeRO-2", "medium", {}, 3489, 1024, 8, 2, None),
    ("V2-Lite widths, 4 layers", *tt.CONFIGS["v2lite4"].values(), 3488, 1024, 16, 0, None),
    ("`profiles/h200.yaml`", "moonlight-16b-a3b", {"num_hidden_layers": 8}, 3488, 2048, 16, 0, None),
    ("H100: `small` MoE, ZeRO-2", "small", {}, 3488, 1024, 16, 2, None),
    ("H100: `medium` all dense, ZeRO-2", "medium", DENSE, 3488, 1024, 8, 2, None),
    ("H100: V2-Lite widths, LoRA", *tt.CONFIGS["v2lite4"].values(), 3488, 1024, 16, 0, LORA),
    ("H100: Moonlight widths, 4 layers", *tt.CONFIGS["moonlight4"].values(), 3488, 1024, 16, 0, None),
    ("H100: hidden 4096, 4 dense layers", *tt.CONFIGS["dense4096"].values(), 3488, 1024, 16, 0, None),
]  # fmt: skip


def run_replay(_args: argparse.Namespace) -> None:
    """The planner on each launch as the train stage set it up: one GPU, bf16, every fast path
    (compiled layers with the sorted experts inside, the fused loss), dsflow's fused optimizer
    at ZeRO-0, DeepSpeed's at ZeRO-2."""
    for row, preset, overrides, vocab, seq, micro, zero, targets in LAUNCHES:
        config = model_config(preset, vocab, overrides)
        extra = {}
        if targets:
            setting = {"rank": 16, "alpha": 32, "dropout": 0.0, "targets": targets}
            sizes = lora.counts(config, setting)
            extra = {
                "lora_adapter": sizes["adapter"], "lora_merged": sizes["merged"],
                "lora_merged_layer": sizes["merged_layer"],
                "lora_rank_outputs": sizes["rank_outputs"],
                "lora_rank_outputs_layer": sizes["rank_outputs_layer"], "frozen_experts": True,
            }  # fmt: skip
        setup = memory.Setup(
            seq_len=seq, micro_batch=micro, world=1, zero_stage=zero, precision="bf16",
            fused_optimizer=zero == 0, ce_chunk=DEFAULT_CE_CHUNK, compiled=True,
            experts_in_graph=True, **extra,
        )  # fmt: skip
        total = memory.estimate(config, setup)["gpu"]["total"]
        print(f"{row:36s} {(total - memory.FRAMEWORK_OVERHEAD.gpu_fixed_bytes) / 1e9:7.2f} GB")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", nargs="?", default="saved", choices=("saved", "replay"))
    ap.add_argument("--widths", default="1024,2048")
    ap.add_argument("--recipes", default="tensorwise")
    ap.add_argument("--diff", action="store_true", help="list the tensors each run keeps apart")
    args = ap.parse_args()
    (run_saved if args.what == "saved" else run_replay)(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
