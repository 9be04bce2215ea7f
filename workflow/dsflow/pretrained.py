"""Stage `pretrained`: model.pretrained (and model.revision) resolved once -> data/pretrained.json.

A Hub id is fetched into huggingface_hub's cache (its configs, tokenizer and safetensors; a warm
cache works offline) and recorded by its commit and files; a local folder by a content hash of its
files; null as null. The record is the same bytes whenever it names the same checkpoint, so the
stages that read the checkpoint (tokenizer, plan, train) rerun only when it changed. See
dsflow.model.source.
"""

from __future__ import annotations

from dsflow.atomic import write_json
from dsflow.model import source
from dsflow.paths import PRETRAINED
from dsflow.progress import log


def run(params: dict) -> None:
    record = source.resolve(params["model"], download=True)
    write_json(PRETRAINED, record)
    log.info("%s -> %s", source.describe(record), PRETRAINED)
