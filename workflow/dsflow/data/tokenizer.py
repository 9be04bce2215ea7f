"""Stage `tokenizer`: a byte-level BPE trained on the train split -> data/tokenizer/.

Saved as a transformers fast tokenizer, so `AutoTokenizer.from_pretrained("data/tokenizer")` loads
it. Or `tokenizer.pretrained` names an existing tokenizer (a path or Hub id) to copy instead, and
with `model.pretrained` set and no `tokenizer.pretrained` the checkpoint's own tokenizer is copied
(from the folder the pretrained stage resolved). A tokenizer for a checkpoint must fit it: every
token id below the checkpoint's vocab_size.

The BPE trains on a sample of about `tokenizer.sample_bytes` bytes of the train split, read
through `dsflow.data.raw` whichever way data/raw stores it: document i is in it when a hash of
(seed, i) falls below sample_bytes / the split's bytes. So the same seed and data give the same
sample, its memory does not grow with the corpus, and a split smaller than sample_bytes trains on
every document.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from dsflow.atomic import atomic_dir
from dsflow.data import raw
from dsflow.data.shards import splitmix64
from dsflow.errors import UsageError
from dsflow.model import source
from dsflow.paths import TOKENIZER
from dsflow.progress import bar, log

BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|pad|>"
SPECIALS = [BOS, EOS, PAD]
N_BYTES = 256
MIN_VOCAB = len(SPECIALS) + N_BYTES


SAMPLE_SALT = 0x746F6B656E697A65  # keeps the sample apart from other uses of the seed


class Sample:
    """Batches of the sampled texts of the train split; counts what it gave."""

    def __init__(self, fraction: float, seed: int, batch_size: int = 1024):
        self.batch_size = batch_size
        self.fraction = fraction
        self.key = splitmix64(np.uint64(seed) ^ np.uint64(SAMPLE_SALT))
        self.docs = self.bytes = 0

    def __iter__(self):
        # Compared in [0, 2**64): every document when the fraction is 1.
        threshold = np.uint64(min(int(self.fraction * 2**64), 2**64 - 1))

        def rows(numbers: np.ndarray) -> np.ndarray:
            return splitmix64(numbers ^ self.key) < threshold

        for texts, sizes in raw.batches(
            "train", self.batch_size, rows if self.fraction < 1 else None
        ):
            self.docs += len(texts)
            self.bytes += int(sizes.sum())
            yield texts


def check_vocab_size(vocab_size: int) -> None:
    if vocab_size < MIN_VOCAB:
        raise UsageError(
            f"tokenizer.vocab_size: {vocab_size} is too small: a byte-level BPE needs "
            f"{N_BYTES} byte tokens + {len(SPECIALS)} specials = {MIN_VOCAB}; use at least that"
        )


def train_bpe(texts_batches, n_docs: int, vocab_size: int, min_frequency: int):
    from transformers import PreTrainedTokenizerFast

    check_vocab_size(vocab_size)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )

    def texts():
        for batch in bar(texts_batches, desc="tokenizer: reading", unit="batch"):
            yield from batch

    tok.train_from_iterator(texts(), trainer, length=n_docs)
    # Every document starts with BOS, as DeepSeek's tokenizers add it: a plain `tokenizer(text)`
    # then gives what the model saw in training (the tokenize stage encodes with the specials).
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, tok.token_to_id(BOS))]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        clean_up_tokenization_spaces=False,
    )


def load_pretrained(name: str, key: str = "tokenizer.pretrained"):
    """The tokenizer at `name` (a folder or Hub id), with BOS and EOS added as its own
    tokenizer_config.json says; `key` is the parameter named when it cannot be used."""
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(name, **special_token_flags(name))
    except Exception as e:
        reason = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
        fix = (
            "give a local directory or a reachable Hub id"
            if key == "tokenizer.pretrained"
            else "set tokenizer.pretrained to the tokenizer it was trained with"
        )
        raise UsageError(
            f"{key}: cannot load the tokenizer of {name!r} ({reason}); {fix}"
        ) from None
    if tok.eos_token_id is None:
        raise UsageError(f"{key}: {name!r} has no EOS token; dsflow needs one")
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    # How it was loaded (HF_HUB_OFFLINE) is no part of the tokenizer: the same bytes either way.
    tok.init_kwargs.pop("local_files_only", None)
    return tok


def special_token_flags(name: str) -> dict:
    """add_bos_token / add_eos_token as a tokenizer's tokenizer_config.json sets them (a folder,
    or a Hub id's file in the cache).
    DeepSeek's set add_bos_token: true, which transformers 5 ignores for a byte-level
    tokenizer.json unless it is passed again; passed, the saved tokenizer.json adds BOS itself,
    so the tokenize stage and a plain `tokenizer(text)` start every document with it."""
    path = Path(name) / "tokenizer_config.json"
    if not Path(name).is_dir():  # a Hub id: the file AutoTokenizer just put in the cache
        from huggingface_hub import try_to_load_from_cache

        found = try_to_load_from_cache(name, "tokenizer_config.json")
        path = Path(found) if isinstance(found, str) else path
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(config, dict):
        return {}
    return {
        k: config[k] for k in ("add_bos_token", "add_eos_token") if isinstance(config.get(k), bool)
    }


def check_fits_checkpoint(tok, model: dict) -> None:
    """Every token id must index the checkpoint's embeddings, which may be padded past the
    tokenizer (DeepSeek-V2: about 100k tokens for vocab_size 102400)."""
    from dsflow.model.build import load_checkpoint_config

    vocab = load_checkpoint_config(str(source.folder(model))).vocab_size
    top = max(tok.get_vocab().values())
    if top >= vocab:
        raise UsageError(
            f"tokenizer.pretrained / model.pretrained: the tokenizer has token ids up to {top} "
            f"but {model['pretrained']} has vocab_size {vocab}; use the checkpoint's own "
            "tokenizer (tokenizer.pretrained: null) or one whose ids are below that"
        )


def train_on_sample(cfg: dict, seed: int, split: dict):
    """A BPE trained on a sample of the train split, whose manifest entry is `split`."""
    check_vocab_size(cfg["vocab_size"])
    limit = cfg["sample_bytes"]
    fraction = 1.0 if limit is None or limit >= split["bytes"] else limit / split["bytes"]
    sample = Sample(fraction, seed)
    log.info(
        "training byte-level BPE, vocab %d, on %s of %d documents (%.1f MB; "
        "tokenizer.sample_bytes %s, seed %d)",
        cfg["vocab_size"],
        "all" if fraction == 1 else f"a {fraction:.2%} sample",
        split["docs"],
        split["bytes"] / 1e6,
        limit,
        seed,
    )
    expect = round(split["docs"] * fraction)
    tok = train_bpe(sample, expect, cfg["vocab_size"], cfg["min_frequency"])
    log.info("trained on %d documents, %d bytes", sample.docs, sample.bytes)
    return tok


def run(params: dict) -> None:
    cfg = params["tokenizer"]
    meta = raw.manifest()
    raw.pieces(meta, "train")  # says what is missing before any work
    model = params["model"]
    if cfg["pretrained"]:
        tok = load_pretrained(cfg["pretrained"])
    elif model["pretrained"]:
        log.info("the tokenizer of model.pretrained %s", model["pretrained"])
        tok = load_pretrained(str(source.folder(model)), key="model.pretrained")
    else:
        tok = train_on_sample(cfg, params["seed"], meta["splits"]["train"])
    if model["pretrained"]:
        check_fits_checkpoint(tok, model)
    with atomic_dir(TOKENIZER) as tmp:
        tok.save_pretrained(tmp)
    log.info("tokenizer with %d tokens -> %s", len(tok), TOKENIZER)
