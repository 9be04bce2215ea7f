"""Stage `tokenizer`: a byte-level BPE trained on the train split -> data/tokenizer/.

Saved as a transformers fast tokenizer, so `AutoTokenizer.from_pretrained("data/tokenizer")` loads
it. Or `tokenizer.pretrained` names an existing tokenizer (a path or Hub id) to copy instead.
"""

from __future__ import annotations

from pathlib import Path

import pyarrow.parquet as pq
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from dsflow.atomic import atomic_dir
from dsflow.errors import UsageError
from dsflow.paths import RAW, TOKENIZER
from dsflow.progress import bar, log

BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|pad|>"
SPECIALS = [BOS, EOS, PAD]
N_BYTES = 256
MIN_VOCAB = len(SPECIALS) + N_BYTES


def iter_texts(path: Path, batch_size: int = 4096):
    for batch in pq.ParquetFile(path).iter_batches(batch_size=batch_size, columns=["text"]):
        yield batch.column(0).to_pylist()


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
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        clean_up_tokenization_spaces=False,
    )


def load_pretrained(name: str):
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(name)
    except Exception as e:
        reason = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
        raise UsageError(
            f"tokenizer.pretrained: cannot load {name!r} ({reason}); give a local directory "
            "or a reachable Hub id"
        ) from None
    if tok.eos_token_id is None:
        raise UsageError(f"tokenizer.pretrained: {name!r} has no EOS token; dsflow needs one")
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok


def run(params: dict) -> None:
    cfg = params["tokenizer"]
    train_path = RAW / "train.parquet"
    if not train_path.exists():
        raise UsageError(f"{train_path}: missing; run the download stage first")
    if cfg["pretrained"]:
        tok = load_pretrained(cfg["pretrained"])
    else:
        check_vocab_size(cfg["vocab_size"])
        n_docs = pq.ParquetFile(train_path).metadata.num_rows
        log.info("training byte-level BPE, vocab %d, on %d documents", cfg["vocab_size"], n_docs)
        tok = train_bpe(iter_texts(train_path), n_docs, cfg["vocab_size"], cfg["min_frequency"])
    with atomic_dir(TOKENIZER) as tmp:
        tok.save_pretrained(tmp)
    log.info("tokenizer with %d tokens -> %s", len(tok), TOKENIZER)
