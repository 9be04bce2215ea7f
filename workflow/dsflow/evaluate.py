"""Stage `evaluate`: the exported model on the val shards -> metrics/eval.json + reports/eval/.

Bits per byte = total nats / (ln 2 x UTF-8 bytes of the target tokens), specials counting zero
bytes but their prediction counting in the nats, so runs with different tokenizers compare and
the builtin corpus's entropy floor (which includes where each document ends) is a true lower
bound. Runs on the train stage's ranks on GPUs and in one process on CPU (evaluate.ranks);
per-window results are summed in window order on rank 0, so 1 and N ranks report the same
numbers.
"""

from __future__ import annotations

import json
import math
import os
import subprocess

import numpy as np
import torch
import torch.distributed as dist

from dsflow import machine, safeload
from dsflow import params as params_mod
from dsflow.atomic import atomic_dir, atomic_file
from dsflow.data.shards import ShardReader, load_index
from dsflow.errors import UsageError
from dsflow.launch import (
    check_tensor_shapes,
    check_tokenizer,
    exit_rank,
    free_port,
    launch_env,
    safetensors_files,
    set_rank_threads,
    torchrun_command,
)
from dsflow.model import mtp
from dsflow.model.balance import ExpertBalancer
from dsflow.model.build import attach_stored_mtp
from dsflow.model.loss import logits_nll, to_batch, token_nll
from dsflow.paths import EVAL_DETAILS, EVAL_METRICS, FINAL, MANIFEST, SHARDS
from dsflow.progress import bar, child_output, log, setup_logging, whole_lines

WORKER_ENV = "DSFLOW_EVAL_WORKER"


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table, which byte-level BPE vocabularies use."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    bs += list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs), strict=True))


def token_byte_lengths(tokenizer) -> tuple[np.ndarray, bool]:
    """UTF-8 bytes behind each token id (0 for specials), and whether that is exact.

    Exact for byte-level BPE (every token is a fixed byte string); for other tokenizers the
    decoded length of each token alone, an approximation."""
    special = set(tokenizer.all_special_ids)
    vocab = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    decoder = {c: b for b, c in bytes_to_unicode().items()}
    byte_level = type(tokenizer.backend_tokenizer.pre_tokenizer).__name__ == "ByteLevel"
    lengths = np.zeros(len(tokenizer), dtype=np.int64)
    for i, piece in enumerate(vocab):
        if i in special or piece is None:
            continue
        if byte_level and all(ch in decoder for ch in piece):
            lengths[i] = len(piece)
        else:
            byte_level = False
            lengths[i] = len(tokenizer.decode([i]).encode("utf-8"))
    return lengths, byte_level


def window_scores(model, reader, byte_len, micro, device, rank, world, max_windows, balancer):
    """{window index: (nats, tokens, bytes, top-1 hits)} for this rank's round-robin share;
    hits: of the main head and each MTP depth, [] for a model without MTP (`scored`)."""
    n = reader.num_windows if max_windows is None else min(max_windows, reader.num_windows)
    mine = list(range(rank, n, world))
    scores = {}
    with torch.no_grad(), balancer.collecting():
        progress = bar(desc="evaluate", total=len(mine), unit="seq", disable=rank != 0)
        for start in range(0, len(mine), micro):
            ids = mine[start : start + micro]
            windows = np.stack([reader.tokens(i * reader.seq_len, reader.seq_len + 1) for i in ids])
            inputs, targets = to_batch(windows, device)
            nll, hits = scored(model, inputs, targets)
            nll = nll.double().sum(dim=1).tolist()
            nbytes = byte_len[windows[:, 1:]].sum(axis=1).tolist()
            for i, nats, b, h in zip(ids, nll, nbytes, hits, strict=True):
                scores[i] = (nats, reader.seq_len, int(b), h)
            progress.update(len(ids))
        progress.close()
    return scores


def scored(model, inputs, targets) -> tuple[torch.Tensor, list[list[int]]]:
    """Per-token NLL [batch, seq] and, per window, how many tokens each head got right as its
    top-1: the main head's token t+1 and MTP depth k's token t+1+k (empty without MTP)."""
    if getattr(model, "mtp", None) is None:
        return token_nll(model, inputs, targets), [[] for _ in range(len(inputs))]
    hidden = model.model(input_ids=inputs, use_cache=False).last_hidden_state
    logits = model.lm_head(hidden)
    heads = [logits.argmax(-1), *mtp.drafts(model, inputs, hidden)]
    hits = torch.stack([(g == targets[:, k:]).sum(1) for k, g in enumerate(heads)], 1)
    return logits_nll(logits, targets), hits.tolist()


def speculative_share(model, reader, cfg: dict, device, rank: int, world: int) -> list[dict]:
    """With MTP layers: this rank's round-robin share of greedy self-speculative decoding
    (mtp.speculative) of the first `speculative_prompts` val windows' first halves,
    `speculative_tokens` tokens each, `micro_batch` prompts at a time."""
    if getattr(model, "mtp", None) is None:
        return []
    seq = reader.seq_len
    mine = list(range(rank, min(cfg["speculative_prompts"], reader.num_windows), world))
    walks = []
    for start in range(0, len(mine), cfg["micro_batch"]):
        ids = mine[start : start + cfg["micro_batch"]]
        half = np.stack([reader.tokens(i * seq, seq // 2) for i in ids])
        prompts = torch.as_tensor(half.astype(np.int64), device=device)
        walks.append(mtp.speculative(model, prompts, cfg["speculative_tokens"]))
    return walks


def mtp_metrics(model, seq: int, scores: dict, walks: list[dict]) -> dict:
    """With MTP layers: each head's top-1 accuracy over the scored windows, and the
    speculative decoding of every rank's share as one walk."""
    if getattr(model, "mtp", None) is None:
        return {}
    n = len(scores)
    hits = [sum(col) for col in zip(*(scores[i][3] for i in sorted(scores)), strict=True)]
    out = {"top1_accuracy": hits[0] / (n * seq)}
    for k, h in enumerate(hits[1:], start=1):
        out[f"mtp_top1_accuracy_{k}"] = h / (n * (seq - k))
    if walks:
        walk = mtp.merged(walks)
        out["speculative_tokens_per_step"] = walk["tokens_per_step"]
        out["speculative_speedup"] = mtp.speedup(walk, model.config, len(model.mtp.layers))
        for k, rate in enumerate(walk["acceptance"], start=1):
            out[f"speculative_acceptance_{k}"] = rate
    return out


def generate_samples(model, tokenizer, cfg, device) -> list[dict]:
    """Greedy and seeded-sampling continuations of the fixed prompts."""
    samples = []
    eos = tokenizer.eos_token_id
    for prompt in cfg["prompts"]:
        # As a plain HF client encodes it: BOS first, as every training document starts.
        ids = tokenizer(prompt)["input_ids"]
        inputs = torch.tensor([ids], device=device)
        out = {"prompt": prompt}
        for mode in ("greedy", "sampled"):
            torch.manual_seed(cfg["sample_seed"])
            kw = (
                {"do_sample": False}
                if mode == "greedy"
                else {"do_sample": True, "temperature": cfg["temperature"], "top_k": cfg["top_k"]}
            )
            gen = model.generate(
                inputs,
                attention_mask=torch.ones_like(inputs),
                max_new_tokens=cfg["max_new_tokens"],
                eos_token_id=eos,
                pad_token_id=tokenizer.pad_token_id,
                **kw,
            )
            out[mode] = tokenizer.decode(gen[0, len(ids) :], skip_special_tokens=True)
        samples.append(out)
    return samples


def lm_eval_results(tasks: list[str]) -> dict:
    if not tasks:
        return {}
    try:
        import lm_eval
    except ImportError:
        raise UsageError(
            "evaluate.lm_eval_tasks: lm-evaluation-harness is not installed "
            "(pip install lm-eval), or set evaluate.lm_eval_tasks: []"
        ) from None
    try:
        results = lm_eval.simple_evaluate(model="hf", model_args=f"pretrained={FINAL}", tasks=tasks)
    except Exception as e:  # the harness raises many types for missing task data
        raise UsageError(f"evaluate.lm_eval_tasks: {tasks} failed: {str(e)[:200]}") from None
    return results.get("results", {})


def evaluate_rank(params: dict, device_type: str) -> None:
    """One rank's share of the windows; rank 0 gathers every share and writes the results."""
    # First, before any parallel work: dsflow's thread count, not the front-end's (as training).
    set_rank_threads(params["train"])
    from transformers import AutoModelForCausalLM, AutoTokenizer

    distributed = "RANK" in os.environ
    if distributed:
        dist.init_process_group("nccl" if device_type == "cuda" else "gloo")
    rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    local = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device("cuda", local) if device_type == "cuda" else torch.device("cpu")
    if device_type == "cuda":
        torch.cuda.set_device(device)
    cfg = params["evaluate"]
    tokenizer = AutoTokenizer.from_pretrained(FINAL)
    # safetensors only: a pickled pytorch_model.bin could run code when loaded
    model = AutoModelForCausalLM.from_pretrained(FINAL, use_safetensors=True)
    balancer = ExpertBalancer(model, gamma=0.0)  # the main model's experts (not MTP's)
    attach_stored_mtp(model, str(FINAL))  # plain transformers leaves the MTP layers out
    model = model.to(device).eval()
    reader = ShardReader(SHARDS / "val", params["train"]["seq_len"], seed=params["seed"])
    byte_len, exact = token_byte_lengths(tokenizer)
    scores = window_scores(
        model,
        reader,
        byte_len,
        cfg["micro_batch"],
        device,
        rank,
        world,
        cfg["max_windows"],
        balancer,
    )
    expert = balancer.eval_stats()  # all-reduced over ranks
    walks = speculative_share(model, reader, cfg, device, rank, world)
    if distributed:
        gathered: list = [None] * world
        dist.all_gather_object(gathered, (scores, walks))
        scores = {k: v for part, _ in gathered for k, v in part.items()}
        walks = [w for _, part in gathered for w in part]
    if rank == 0:
        extra = mtp_metrics(model, reader.seq_len, scores, walks)
        write_results(params, model, tokenizer, scores, expert, exact, world, device, extra)
    if distributed:
        dist.barrier()
        dist.destroy_process_group()


def write_results(params, model, tokenizer, scores, expert, exact, world, device, extra) -> None:
    nats = tokens = nbytes = 0
    for i in sorted(scores):  # fixed order: the same sum for any number of ranks
        n, t, b, _ = scores[i]
        nats, tokens, nbytes = nats + n, tokens + t, nbytes + b
    bpb = nats / (math.log(2) * nbytes)
    metrics = {
        "val_loss": nats / tokens,
        "perplexity": math.exp(nats / tokens),
        "bits_per_byte": bpb,
        "bytes_exact": exact,
        "tokens": tokens,
        "bytes": nbytes,
        "world_size": world,
        "experts_max_over_mean": expert.get("max_over_mean"),
        "experts_entropy_min": expert.get("entropy_min"),
        **extra,
    }
    manifest = json.loads(MANIFEST.read_text()) if MANIFEST.exists() else {}
    floor = manifest.get("splits", {}).get("val", {}).get("entropy_bits_per_byte")
    if floor is not None:
        metrics.update(entropy_floor_bpb=floor, gap_bpb=bpb - floor, ratio_to_floor=bpb / floor)
    lm_eval = lm_eval_results(params["evaluate"]["lm_eval_tasks"])
    if lm_eval:
        metrics["lm_eval"] = lm_eval
    samples = generate_samples(model, tokenizer, params["evaluate"], device)
    layers = {str(k): v for k, v in expert.get("layers", {}).items()}
    with atomic_dir(EVAL_DETAILS) as tmp:
        (tmp / "samples.json").write_text(json.dumps(samples, indent=2, sort_keys=True) + "\n")
        (tmp / "expert_load.json").write_text(json.dumps(layers, indent=2, sort_keys=True) + "\n")
    with atomic_file(EVAL_METRICS) as f:
        f.write(json.dumps(metrics, indent=2, sort_keys=True) + "\n")
    log.info(
        "val loss %.4f, %.4f bits/byte%s",
        metrics["val_loss"],
        bpb,
        f" (floor {floor:.4f}, gap {bpb - floor:.4f})" if floor is not None else "",
    )


def check_inputs() -> None:
    """What every rank reads, checked once before any starts (one line naming the file): the
    exported model's tokenizer, its safetensors (headers whole, files as long as they say,
    shapes as its config.json makes them) and the val shards (sizes and sha256)."""
    from transformers import AutoConfig

    fix = "rerun the train stage"
    check_tokenizer(FINAL, fix)
    try:
        config = AutoConfig.from_pretrained(FINAL)
    except Exception as exc:  # noqa: BLE001 - bad JSON, an unknown model_type, ...
        detail = " ".join(str(exc).split())[:300]
        raise UsageError(f"{FINAL}/config.json: does not load ({detail}); {fix}") from None
    files = safetensors_files(FINAL)
    if not files:
        raise UsageError(f"{FINAL}: no *.safetensors weights; {fix}")
    check_tensor_shapes(FINAL, files, config, fix)
    load_index(SHARDS / "val")


def ranks(params: dict) -> tuple[str, int]:
    """(device type, processes) of the stage: evaluate.ranks; auto = the train stage's ranks
    per node on GPUs, one process on CPU, where ranks would share the same cores: it starts
    once, where each rank would import torch and transformers on those cores."""
    device, train_ranks = machine.resolve_device(params["train"])
    want = params["evaluate"].get("ranks", "auto")
    if want == "auto":
        return device, 1 if device == "cpu" else train_ranks
    visible = len(machine.gpus())
    if device == "cuda" and want > visible:
        raise UsageError(
            f"evaluate.ranks: {want} ranks but {visible} GPUs visible; set "
            "evaluate.ranks: auto (the train stage's ranks) or a number up to the GPUs"
        )
    return device, want


def run(params: dict) -> None:
    if not (FINAL / "config.json").exists():
        raise UsageError(f"{FINAL}: no exported model; run the train stage first")
    if not any(FINAL.glob("*.safetensors")):
        raise UsageError(
            f"{FINAL} holds no *.safetensors weights; dsflow loads safetensors only (pickled "
            "weights can run code): rerun the train stage"
        )
    check_inputs()
    # Checked once here, so that damage is one line naming the file, not a wrong score.
    safeload.check_model_folder(
        FINAL,
        "rerun the train stage, which writes it again from its last checkpoint "
        "(dvc repro -f -s train, or snakemake -f train)",
    )
    device, world = ranks(params)
    if world == 1:
        evaluate_rank(params, device)
        return
    # Ranks get exactly these params (overlays included), not a fresh read of params.yaml.
    env = {
        **launch_env({"device": device, "world": world, "params": params}),
        WORKER_ENV: device,
        params_mod.CONFIG_ENV: json.dumps(params),
    }
    cmd = torchrun_command(world, str(free_port()), "dsflow.evaluate")
    with child_output() as out:  # the ranks' lines go to logs/evaluate.log too
        code = subprocess.call(cmd, env=whole_lines(env), stdout=out, stderr=out)
    if code != 0:
        raise UsageError(f"evaluation failed (launcher exit {code}); see the rank output above")


if __name__ == "__main__":
    if os.environ.get("RANK", "0") == "0":
        setup_logging("evaluate", to_file=False)  # the stage puts rank 0's stderr in the log
    evaluate_rank(params_mod.load(), os.environ[WORKER_ENV])
    exit_rank(0)
