"""Gemma tokenizers: sentencepiece `tokenizer.model` or Hugging Face `tokenizer.json`, and Gemma's chat turns.

Both files give the same ids for the same text. BOS is never text: it is one id put in front of a
sequence (a prompt, or a whole chat), and `<bos>` typed by a user stays plain characters. The turn
markers `<start_of_turn>` / `<end_of_turn>` are pieces of the vocabulary that both tokenizers match in text.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass

from trainer.common.config import UsageError

START, END = "<start_of_turn>", "<end_of_turn>"
# Sentencepiece control pieces: ids only, never matched in text (tokenizer.json would match them).
CONTROL = frozenset({"<bos>", "<eos>", "<pad>", "<unk>", "<mask>"})
FILES = ("tokenizer.model", "tokenizer.json")
# Google pads the embedding table past the tokenizer's pieces (Gemma 2 flax: 256000 pieces, 256128 rows).
MAX_VOCAB_PADDING = 256


def _read(path: str) -> bytes:
    if "://" in path:
        import fsspec
        with fsspec.open(path, "rb") as f:
            return f.read()
    with open(path, "rb") as f:
        return f.read()


class GemmaTokenizer:
    def __init__(self, path: str):
        self.path = path
        if path.endswith(".json"):
            import tokenizers
            self._hf = tokenizers.Tokenizer.from_str(_read(path).decode())
            self._sp = None
            self.vocab_size = self._hf.get_vocab_size()
            # Match the added pieces sentencepiece also matches in text (turn markers...) ourselves and
            # encode the text between them with every added token taken as plain text.
            added = [t.content for t in self._hf.get_added_tokens_decoder().values() if t.content not in CONTROL]
            self._markers = {c: self._hf.token_to_id(c) for c in added}
            self._split = re.compile("(" + "|".join(map(re.escape, sorted(added, key=len, reverse=True))) + ")")
            self._hf.encode_special_tokens = True
            pid = self._hf.token_to_id
        else:
            import sentencepiece as spm
            self._sp = spm.SentencePieceProcessor(model_proto=_read(path))
            self._hf = None
            self.vocab_size = self._sp.get_piece_size()
            pid = self._sp.piece_to_id
        self.bos_id, self.eos_id = pid("<bos>"), pid("<eos>")
        self.end_of_turn_id = pid(END)
        if self.bos_id is None or self.end_of_turn_id in (None, 0, pid("<unk>")):
            raise UsageError(f"tokenizer {path}: not a Gemma tokenizer (no <bos> / {END} pieces)")

    def encode(self, text: str, *, bos: bool = True) -> list[int]:
        if self._sp:
            ids = self._sp.encode(text)
        else:
            ids = []
            for i, part in enumerate(self._split.split(text) if self._markers else [text]):
                if i % 2:
                    ids.append(self._markers[part])
                elif part:
                    ids.extend(self._hf.encode(part, add_special_tokens=False).ids)
        return [self.bos_id, *ids] if bos else ids

    def decode(self, ids: list[int]) -> str:
        ids = [int(i) for i in ids]
        return self._sp.decode(ids) if self._sp else self._hf.decode(ids, skip_special_tokens=False)

    @property
    def stop_ids(self) -> tuple[int, ...]:
        return (self.eos_id, self.end_of_turn_id)

    def chat(self, messages: list[dict], *, add_generation_prompt: bool = True) -> list[int]:
        """BOS + chat_text(messages) tokenized."""
        return [self.bos_id, *self.encode(chat_text(messages, add_generation_prompt=add_generation_prompt),
                                          bos=False)]


@dataclass(frozen=True)
class _Turn:
    role: str
    content: str


def chat_text(messages: list[dict], *, add_generation_prompt: bool = True) -> str:
    """Gemma's chat template as text (BOS not included): each turn is
    `<start_of_turn>{user|model}\\n{content}<end_of_turn>\\n`; a system message is folded into the first
    user turn (Gemma has no system role); the generation prompt opens a model turn."""
    turns = [_Turn(m["role"], str(m["content"]).strip()) for m in messages]
    if turns and turns[0].role == "system":
        system, turns = turns[0].content, turns[1:]
        if not turns or turns[0].role != "user":
            raise UsageError("chat: a system message must be followed by a user message")
        turns[0] = _Turn("user", f"{system}\n\n{turns[0].content}")
    out = []
    for i, t in enumerate(turns):
        role = {"user": "user", "assistant": "model", "model": "model"}.get(t.role)
        if role is None:
            raise UsageError(f"chat: unknown role {t.role!r}; use user, assistant (or model), and system first")
        if (role == "user") != (i % 2 == 0):
            raise UsageError("chat: turns must alternate user / model, starting with user")
        out.append(f"{START}{role}\n{t.content}{END}\n")
    if add_generation_prompt:
        out.append(f"{START}model\n")
    return "".join(out)


def find(root: str) -> str | None:
    """The tokenizer file beside a checkpoint: in `root` or its parent (Kaggle's flax params dir sits
    beside tokenizer.model). tokenizer.model first."""
    import fsspec
    fs, p = fsspec.core.url_to_fs(root if "://" in root else os.path.abspath(root))
    proto = root.split("://", 1)[0] + "://" if "://" in root else ""
    for folder in (p.rstrip("/"), p.rstrip("/").rsplit("/", 1)[0]):
        for name in FILES:
            if fs.exists(f"{folder}/{name}"):
                return f"{proto}{folder}/{name}"
    return None


def load(root: str, embed_rows: int | None = None, tokenizer: str | None = None) -> GemmaTokenizer:
    """The tokenizer for the checkpoint at `root` (or the explicit `tokenizer` file), checked against the
    embedding's row count when given."""
    path = tokenizer or find(root)
    if path is None:
        raise UsageError(f"no tokenizer.model or tokenizer.json in {root} or its parent; pass --tokenizer FILE")
    tok = GemmaTokenizer(path)
    if embed_rows is not None and not (tok.vocab_size <= embed_rows <= tok.vocab_size + MAX_VOCAB_PADDING):
        raise UsageError(f"tokenizer {path} has {tok.vocab_size} pieces but the checkpoint's embedding has "
                         f"{embed_rows} rows: they belong to different models; use the tokenizer that came "
                         "with these weights")
    return tok
