"""The run spec: what the train stage resolved (checkpoints/run.json and ds_config.json), as a
frozen dataclass that every rank reads as attributes.

One rank of node 0 reads the two files and broadcasts them (`RunSpec.shared`), so every rank on
every node trains the same run, and another node never reads a stale run.json.
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
from typing import Any

import torch
import torch.distributed as dist

from dsflow import launch
from dsflow.paths import CHECKPOINTS
from dsflow.train.health import report_fatal
from dsflow.train.metrics import all_gather_int, all_sum


@dataclasses.dataclass(frozen=True)
class RunSpec:
    fingerprint: str
    device: str  # "cuda" | "cpu"
    world: int
    steps: int
    micro: int
    accum: int
    seq_len: int
    seed: int
    vocab_size: int
    resume: str | None  # the checkpoint tag to resume from (validated by the train stage)
    data_verified: bool  # the train stage checked every shard's sha256 just before launch
    model: dict  # params.yaml's model section: preset, overrides, pretrained
    finetune: str  # train.finetune: "full" | "lora"
    lora: dict  # train.lora: rank, alpha, dropout, targets
    optimizer: dict  # train.optimizer: lr, betas, eps, weight_decay
    balance: dict  # train.balance: gamma, seq_aux_alpha
    mtp: dict  # train.mtp: weight (model.mtp_depth > 0)
    perf: dict  # the fast paths, resolved by the train stage (model.fastpaths.Perf fields)
    grad_clip: float
    precision: str
    peak_tflops: float | None
    planned_reserved_bytes: int | None  # the planner's reserved peak per GPU (None on CPU)
    max_bad_steps: int
    log_every: int
    eval_every: int
    eval_batches: int
    checkpoint_every: int
    keep_checkpoints: int
    async_checkpoints: bool
    ds_config: dict

    @classmethod
    def from_files(cls, run: dict[str, Any], ds_config: dict) -> RunSpec:
        """From run.json's and ds_config.json's contents."""
        params, train = run["params"], run["params"]["train"]
        return cls(
            fingerprint=run["fingerprint"],
            device=run["device"],
            world=run["world"],
            steps=run["steps"],
            micro=run["batch"]["micro"],
            accum=run["batch"]["accum"],
            seq_len=train["seq_len"],
            seed=params["seed"],
            vocab_size=run["vocab_size"],
            resume=run.get("resume"),
            data_verified=run.get("data_verified", False),
            model=params["model"],
            finetune=train.get("finetune", "full"),
            lora=train.get("lora", {}),
            optimizer=train["optimizer"],
            balance=train["balance"],
            mtp=train.get("mtp", {}),
            perf=run["perf"],
            grad_clip=train["grad_clip"],
            precision=train["precision"],
            peak_tflops=train["peak_tflops"],
            planned_reserved_bytes=run.get("planned_reserved_bytes"),
            max_bad_steps=train.get("max_bad_steps", 10),
            log_every=train["log_every"],
            eval_every=train["eval_every"],
            eval_batches=train["eval_batches"],
            checkpoint_every=train["checkpoint_every"],
            keep_checkpoints=train["keep_checkpoints"],
            async_checkpoints=train["async_checkpoints"],
            ds_config=ds_config,
        )

    @classmethod
    def shared(cls, device: torch.device) -> RunSpec | None:
        """The run as node 0's train stage wrote it, on every rank; None (after reporting why)
        when a rank's own stage planned a different run."""
        box = shared_files(device)
        return None if box is None else cls.from_files(*box)

    @property
    def lora_on(self) -> bool:
        return self.finetune == "lora"

    @property
    def zero3(self) -> bool:
        return self.ds_config["zero_optimization"].get("stage", 0) == 3

    @property
    def global_tokens(self) -> int:
        """Tokens per optimizer step, over every rank."""
        return self.micro * self.accum * self.world * self.seq_len

    def eval_due(self, step: int) -> bool:
        return step % self.eval_every == 0 or step == self.steps

    def checkpoint_due(self, step: int) -> bool:
        return step % self.checkpoint_every == 0


def shared_files(device: torch.device) -> tuple[dict, dict] | None:
    """(run.json, ds_config.json) as node 0's train stage wrote them, on every rank.

    The first rank launched by node 0's stage (PLAN_SOURCE_ENV; rank 0 when no rank says so,
    e.g. under DeepSpeed's pdsh launcher) reads them and broadcasts. A rank whose own stage
    planned differently (FINGERPRINT_ENV: other params or data on that node) makes every rank
    stop: None, after reporting why.
    """
    sources = all_gather_int(1 if os.environ.get(launch.PLAN_SOURCE_ENV) else 0, device)
    source = sources.index(1) if 1 in sources else 0
    box: list = [None, None]
    if dist.get_rank() == source:
        box = [
            json.loads((CHECKPOINTS / "run.json").read_text()),
            json.loads((CHECKPOINTS / "ds_config.json").read_text()),
        ]
    dist.broadcast_object_list(box, src=source)
    mine = os.environ.get(launch.FINGERPRINT_ENV)
    differs = bool(mine) and mine != box[0]["fingerprint"]
    if all_sum([1.0 if differs else 0.0], device)[0]:
        who = f"node {socket.gethostname()} (run {mine})" if differs else "another node"
        report_fatal(
            f"{who} planned a different run than node 0 (run {box[0]['fingerprint']}): every "
            "node needs the same params and data shards"
        )
        return None
    return box[0], box[1]
