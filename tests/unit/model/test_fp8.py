"""Block-FP8 checkpoints (dsflow.model.fp8): a tiny DeepSeek-V3 written the way DeepSeek publishes
V3/R1 (float8 e4m3 weights, per-expert keys, fp32 128 x 128 block scales, sharded), loaded as a
plain model."""

import json
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import DeepseekV3ForCausalLM

from dsflow.errors import UsageError
from dsflow.model import fp8
from dsflow.model.presets import model_config

BLOCK = 128
VOCAB = 256
# hidden 160 and q 4 x 48 = 192 rows: blocks at the bottom and right edges are partial.
SHAPE = {"hidden_size": 160, "num_hidden_layers": 2, "q_lora_rank": 48}
QUANT_CONFIG = {
    "activation_scheme": "dynamic",
    "fmt": "e4m3",
    "quant_method": "fp8",
    "weight_block_size": [BLOCK, BLOCK],
}
# What DeepSeek quantizes: attention projections, dense MLP, shared and routed experts. Not the
# embeddings, norms, lm_head or the router (mlp.gate.weight).
QUANTIZED = re.compile(
    r"\.(q_a_proj|q_b_proj|kv_a_proj_with_mqa|kv_b_proj|o_proj|gate_proj|up_proj|down_proj)\.weight$"
)


def _quantize(weight):
    """DeepSeek's scheme: per block, scale = amax / 448 (e4m3's largest), weight / scale in e4m3."""
    rows, cols = weight.shape
    q = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    scale = torch.empty(-(-rows // BLOCK), -(-cols // BLOCK))
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            block = weight[i * BLOCK : (i + 1) * BLOCK, j * BLOCK : (j + 1) * BLOCK]
            scale[i, j] = block.abs().max() / 448
            q[i * BLOCK : (i + 1) * BLOCK, j * BLOCK : (j + 1) * BLOCK] = block / scale[i, j]
    return q, scale


def _dequantize(q, scale):
    """The reference: each block's fp8 values times that block's scale, block by block."""
    out = torch.empty(q.shape)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            rows, cols = slice(i * BLOCK, (i + 1) * BLOCK), slice(j * BLOCK, (j + 1) * BLOCK)
            out[rows, cols] = q[rows, cols].float() * scale[i, j]
    return out


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """(original model, its folder, the FP8 folder, the FP8 tensors by name)."""
    root = tmp_path_factory.mktemp("fp8")
    torch.manual_seed(0)
    model = DeepseekV3ForCausalLM(model_config("tiny", VOCAB, SHAPE)).eval()
    model.save_pretrained(root / "plain")  # per-expert keys, as DeepSeek publishes them
    tensors = {}
    for key, value in load_file(root / "plain" / "model.safetensors").items():
        if QUANTIZED.search(key):
            tensors[key], tensors[key + "_scale_inv"] = _quantize(value)
        elif key.endswith("e_score_correction_bias"):
            tensors[key] = value
        else:
            tensors[key] = value.to(torch.bfloat16)
    quantized = root / "fp8"
    shutil.copytree(root / "plain", quantized)
    (quantized / "model.safetensors").unlink()
    # Two shards, scales in the other shard than their weights.
    shards = {"model-00001-of-00002.safetensors": {}, "model-00002-of-00002.safetensors": {}}
    for key, value in tensors.items():
        shards[sorted(shards)[key.endswith("_scale_inv")]][key] = value
    for name, part in shards.items():
        save_file(part, quantized / name, metadata={"format": "pt"})
    weight_map = {key: name for name, part in shards.items() for key in part}
    (quantized / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    config = json.loads((quantized / "config.json").read_text())
    (quantized / "config.json").write_text(
        json.dumps({**config, "quantization_config": QUANT_CONFIG})
    )
    return model, root / "plain", quantized, tensors


def _load(folder, dtype=torch.float32):
    return fp8.from_pretrained(
        DeepseekV3ForCausalLM, folder, dtype=dtype, experts_implementation="eager"
    )


def _loaded_weight(state, key):
    """The model's tensor for a checkpoint key: HF fuses routed experts (gate_up_proj is
    [experts, 2 x moe_intermediate, hidden], gate rows first)."""
    expert = re.match(r"(.+\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$", key)
    if not expert:
        return state[key]
    prefix, index, proj = expert[1], int(expert[2]), expert[3]
    if proj == "down":
        return state[f"{prefix}.down_proj"][index]
    fused = state[f"{prefix}.gate_up_proj"][index]
    half = fused.shape[0] // 2
    return fused[:half] if proj == "gate" else fused[half:]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_weights_are_the_fp8_values_times_their_block_scales(checkpoints, dtype):
    _, plain, quantized, tensors = checkpoints
    assert fp8.block_size(quantized) == (BLOCK, BLOCK)
    model = _load(quantized, dtype)
    state = model.state_dict()
    weights = [key for key in tensors if QUANTIZED.search(key)]
    assert any(".experts.3.up_proj." in key for key in weights)
    assert any(tensors[key].shape[0] % BLOCK for key in weights)  # edge blocks exercised
    for key in weights:
        expected = _dequantize(tensors[key], tensors[key + "_scale_inv"]).to(dtype)
        assert torch.equal(_loaded_weight(state, key), expected), key
    # The unquantized tensors arrive as stored, every dtype as from an unquantized checkpoint
    # (the router's weight and bias in fp32).
    assert torch.equal(
        state["model.embed_tokens.weight"], tensors["model.embed_tokens.weight"].to(dtype)
    )
    unquantized = DeepseekV3ForCausalLM.from_pretrained(plain, dtype=dtype).state_dict()
    assert {k: v.dtype for k, v in state.items()} == {k: v.dtype for k, v in unquantized.items()}
    assert state["model.layers.1.mlp.gate.e_score_correction_bias"].dtype == torch.float32


def test_model_is_the_plain_class_and_its_export_loads_unquantized(checkpoints, tmp_path):
    _, _, quantized, _ = checkpoints
    model, info = fp8.from_pretrained(  # as the model builder loads: with the loading report
        DeepseekV3ForCausalLM, quantized, dtype=torch.float32, output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    linears = [m for m in model.modules() if "Linear" in type(m).__name__]
    assert linears and all(type(m) is torch.nn.Linear for m in linears)
    assert not any("fp8" in type(m).__name__.lower() for m in model.modules())
    assert not hasattr(model.config, "quantization_config")
    assert (
        not getattr(model, "is_quantized", False) and getattr(model, "hf_quantizer", None) is None
    )
    model.save_pretrained(tmp_path)
    assert "quantization_config" not in json.loads((tmp_path / "config.json").read_text())
    assert {v.dtype for v in load_file(tmp_path / "model.safetensors").values()} == {torch.float32}
    reloaded = DeepseekV3ForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    assert getattr(reloaded, "hf_quantizer", None) is None
    want = reloaded.state_dict()
    assert model.state_dict().keys() == want.keys()
    for name, value in model.state_dict().items():
        assert torch.equal(value, want[name]), name


def test_logits_match_the_unquantized_model_within_fp8_error(checkpoints):
    original, plain, quantized, _ = checkpoints
    tokens = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = original(tokens).logits
        got = _load(quantized)(tokens).logits
        same = fp8.from_pretrained(DeepseekV3ForCausalLM, plain, dtype=torch.float32)(tokens)
    assert fp8.block_size(plain) is None
    assert torch.equal(same.logits, want)  # an unquantized checkpoint goes straight through
    error = ((got - want).norm() / want.norm()).item()
    # e4m3 keeps 3 mantissa bits: each quantized weight is off by ~2.6% rms here, and the
    # matmuls on a token's path add up in quadrature (0.055 measured).
    assert 0.01 < error < 0.1, error


@pytest.mark.parametrize("method", ["bitsandbytes", "gptq", "awq", "compressed-tensors", None])
def test_other_quantization_is_refused_in_one_line(tmp_path, method):
    quant = {"quant_method": method, "bits": 4} if method else "fp8"
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": quant}))
    with pytest.raises(UsageError) as err:
        fp8.from_pretrained(DeepseekV3ForCausalLM, tmp_path)
    message = str(err.value)
    assert "\n" not in message and "model.pretrained" in message and "bf16 release" in message
    assert repr(method) in message


@pytest.mark.parametrize("block", [[128], [128, "128"], [0, 128], None])
def test_unusable_block_size_is_refused_in_one_line(tmp_path, block):
    config = {"quantization_config": {**QUANT_CONFIG, "weight_block_size": block}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        UsageError, match=r"^model\.pretrained: .*weight_block_size is .*bf16 release$"
    ):
        fp8.block_size(tmp_path)


def _copy(folder, tmp_path):
    shutil.copytree(folder, tmp_path / "ck")
    return tmp_path / "ck"


def test_scales_for_another_block_size_are_refused_in_one_line(checkpoints, tmp_path):
    # Scales made for 128 x 128 blocks are not spread over 64 x 64 ones.
    folder = _copy(checkpoints[2], tmp_path)
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"]["weight_block_size"] = [64, 64]
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(UsageError) as err:
        _load(folder)
    assert "\n" not in str(err.value)
    assert re.search(
        r"float8 weight \S+\.weight \[\d+, \d+\] needs a \S+_scale_inv of shape \[\d+, \d+\] \(weight_block_size \[64, 64\]\), found shape \[\d+, \d+\]",
        str(err.value),
    )


@pytest.mark.parametrize(
    "change, message",
    [
        (
            "drop",
            r"o_proj\.weight \[160, 128\] needs a .* found none: the checkpoint is incomplete",
        ),
        ("uint8", r"o_proj\.weight_scale_inv is U8; dsflow reads float scales .*bf16 release$"),
    ],
)
def test_a_missing_or_integer_scale_is_refused_in_one_line(checkpoints, tmp_path, change, message):
    folder = _copy(checkpoints[2], tmp_path)
    shard = folder / "model-00002-of-00002.safetensors"
    tensors = load_file(shard)
    key = "model.layers.1.self_attn.o_proj.weight_scale_inv"
    if change == "drop":
        del tensors[key]
    else:
        tensors[key] = tensors[key].to(torch.uint8)
    save_file(tensors, shard, metadata={"format": "pt"})
    with pytest.raises(UsageError, match=message):
        _load(folder)


def test_the_model_builder_loads_an_fp8_checkpoint_dequantized(checkpoints):
    """model.pretrained pointing at a block-FP8 checkpoint: dsflow's builder (what train and
    the planner use) gives the plain model with the dequantized weights, config unquantized."""
    from dsflow.model.build import build_model, load_checkpoint_config

    _, _, quantized, _ = checkpoints
    config = load_checkpoint_config(str(quantized))
    assert not hasattr(config, "quantization_config")
    built = build_model(config, device_type="cpu", pretrained=str(quantized))
    direct = _load(quantized).state_dict()
    for name, tensor in built.state_dict().items():
        torch.testing.assert_close(tensor, direct[name], rtol=0, atol=0, msg=name)
