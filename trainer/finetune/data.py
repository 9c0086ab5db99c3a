"""Instruction data for LoRA fine-tuning: JSONL -> Gemma chat tokens -> packed rows -> global batches.

A line is `{"prompt": ..., "response": ...}` or `{"messages": [{"role": ..., "content": ...}, ...]}`,
formatted with Gemma's chat template (trainer/gemma/tokenizer.py). The loss weight is 1 on the tokens the model
must produce (each model turn's content and its `<end_of_turn>`) and 0 on everything else.

Rows are `seq_len` tokens: inputs, next-token targets, loss weights, segment ids (0 = padding) and
positions that restart at 0 for every example. Packing (the default) fills a row with whole examples in
file order; `packing=False` puts one example per row. The rows are built identically on every process,
and the global batch of step s is the rows chosen by (seed, s) alone, as trainer/pretrain/data.py does for
pretraining: process p takes its contiguous share, so the host count never changes what is trained on.
"""
from __future__ import annotations

import dataclasses
import functools
import json

import numpy as np

from trainer.common.config import UsageError
from trainer.gemma.tokenizer import END, START, GemmaTokenizer

FIELDS = ("inputs", "targets", "weights", "segments", "positions")


@dataclasses.dataclass(frozen=True)
class Example:
    ids: list[int]      # BOS + the whole chat
    loss: list[bool]    # per id: the model must produce it


def read_jsonl(path: str) -> list[dict]:
    """Records of a JSONL file (local or gs://); a broken or unusable line is named with its number."""
    import fsspec
    try:
        with fsspec.open(path, "rt", encoding="utf-8") as f:
            lines = f.read().splitlines()
    except FileNotFoundError:
        raise UsageError(f"--data {path} does not exist; pass a JSONL file of prompt/response or messages") from None
    out = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise UsageError(f"{path} line {n}: not valid JSON ({e.msg} at column {e.colno}); fix or remove "
                             "that line") from None
        out.append(_messages(rec, f"{path} line {n}"))
    if not out:
        raise UsageError(f"{path} holds no examples; each line must be a JSON object with prompt/response "
                         "or messages")
    return out


def _messages(rec, where: str) -> list[dict]:
    if isinstance(rec, dict) and isinstance(rec.get("prompt"), str) and isinstance(rec.get("response"), str):
        return [{"role": "user", "content": rec["prompt"]}, {"role": "model", "content": rec["response"]}]
    msgs = rec.get("messages") if isinstance(rec, dict) else None
    if (isinstance(msgs, list) and msgs and all(isinstance(m, dict) and isinstance(m.get("role"), str)
                                                and isinstance(m.get("content"), str) for m in msgs)):
        if not any(m["role"] in ("assistant", "model") for m in msgs):
            raise UsageError(f"{where}: no assistant/model turn, so nothing to learn; add the reply")
        return msgs
    raise UsageError(f'{where}: expected {{"prompt": str, "response": str}} or {{"messages": [{{"role": str, '
                     f'"content": str}}, ...]}}')


def encode(tok: GemmaTokenizer, messages: list[dict], where: str = "example") -> Example:
    """The ids of the whole chat as sampling would feed them (tok.chat), weighted on the model turns.

    The turn markers are single pieces, so the ids between a <start_of_turn> and its <end_of_turn> are
    exactly one turn's "role\\ncontent"; a model turn learns its content and its <end_of_turn>."""
    try:
        ids = tok.chat(messages, add_generation_prompt=False)
    except UsageError as e:
        raise UsageError(f"{where}: {e}") from None
    roles = [m["role"] in ("assistant", "model") for m in messages if m["role"] != "system"]
    start = tok.encode(START, bos=False)
    if len(start) != 1 or ids.count(start[0]) != len(roles) or ids.count(tok.end_of_turn_id) != len(roles):
        raise UsageError(f"{where}: a message contains {START} or {END} as text; remove the markers (the chat "
                         "template adds them)")
    loss, turn, i = [False] * len(ids), 0, 0
    while i < len(ids):
        if ids[i] != start[0]:
            i += 1
            continue
        end = ids.index(tok.end_of_turn_id, i)
        if roles[turn]:
            body = ids[i + 1:end]
            for j in range(i + 1 + _head_tokens(tok, body, "model\n"), end + 1):
                loss[j] = True
        turn, i = turn + 1, end + 1
    return Example(ids, loss)


def _head_tokens(tok: GemmaTokenizer, ids: list[int], head: str) -> int:
    """How many leading ids spell a prefix of `head` (a token straddling its end counts as content)."""
    k = 0
    while k < len(ids) and head.startswith(tok.decode(ids[:k + 1])):
        k += 1
    return k


@dataclasses.dataclass(frozen=True)
class Rows:
    inputs: np.ndarray     # int32 [N, T]
    targets: np.ndarray    # int32 [N, T]
    weights: np.ndarray    # float32 [N, T]: 1 where the target is a token the model must produce
    segments: np.ndarray   # int32 [N, T]: example number within the row, from 1; 0 = padding
    positions: np.ndarray  # int32 [N, T]: restart at 0 per example
    truncated: int = 0
    dropped: int = 0

    def __len__(self) -> int:
        return len(self.inputs)

    def take(self, idx) -> dict[str, np.ndarray]:
        return {f: getattr(self, f)[idx] for f in FIELDS}


def build_rows(examples: list[Example], seq_len: int, *, packing: bool = True, long: str = "truncate") -> Rows:
    """Examples (ids, loss mask) -> rows of seq_len next-token pairs; an example needs len(ids) - 1 slots.
    long: 'truncate' keeps the first seq_len + 1 ids of a longer example, 'drop' leaves it out."""
    if long not in ("truncate", "drop"):
        raise UsageError(f"--long {long}: choose truncate or drop")
    rows: list[list[tuple[np.ndarray, np.ndarray]]] = []
    used = seq_len  # slots used in the current row (full: start a new one)
    truncated = dropped = 0
    for ex in examples:
        ids, w = np.asarray(ex.ids, np.int32), np.asarray(ex.loss, np.float32)
        if len(ids) - 1 > seq_len:
            if long == "drop":
                dropped += 1
                continue
            ids, w = ids[:seq_len + 1], w[:seq_len + 1]
            truncated += 1
        n = len(ids) - 1
        if n < 1:
            continue
        if not packing or used + n > seq_len:
            rows.append([])
            used = 0
        rows[-1].append((ids, w))
        used += n
    if not rows:
        raise UsageError(f"no example is left (all {dropped} are longer than --seq-len {seq_len}); raise "
                         "--seq-len or use --long truncate")
    shape = (len(rows), seq_len)
    out = {f: np.zeros(shape, np.float32 if f == "weights" else np.int32) for f in FIELDS}
    for r, row in enumerate(rows):
        at = 0
        for s, (ids, w) in enumerate(row, 1):
            n = len(ids) - 1
            sl = slice(at, at + n)
            out["inputs"][r, sl], out["targets"][r, sl], out["weights"][r, sl] = ids[:-1], ids[1:], w[1:]
            out["segments"][r, sl], out["positions"][r, sl] = s, np.arange(n)
            at += n
    return Rows(**out, truncated=truncated, dropped=dropped)


def split(records: list, val_fraction: float, seed: int) -> tuple[list, list]:
    """(train, val): a seeded choice of round(val_fraction * n) records (at least 1 when the fraction > 0)."""
    if not 0.0 <= val_fraction < 1.0:
        raise UsageError(f"--val-fraction {val_fraction}: must be in [0, 1)")
    n_val = 0 if val_fraction == 0 else max(1, round(val_fraction * len(records)))
    if n_val >= len(records):
        raise UsageError(f"--val-fraction {val_fraction} leaves no training example out of {len(records)}; "
                         "lower it or pass --val-data")
    pick = set(np.random.default_rng([seed, 7]).permutation(len(records))[:n_val].tolist())
    return ([r for i, r in enumerate(records) if i not in pick], [r for i, r in enumerate(records) if i in pick])


class Batches:
    """Global batch of step s (from 1) = rows perm_e[g mod n] for g = (s-1)*B + j, e = g div n: a fresh
    seeded permutation per epoch, so any step is produced directly (exact resume, any host count)."""

    def __init__(self, rows: Rows, global_batch: int, seed: int, process_index: int = 0, process_count: int = 1):
        if global_batch % process_count:
            raise UsageError(f"--batch-size {global_batch} is not divisible by the {process_count} processes")
        self.rows, self.global_batch, self.seed = rows, global_batch, seed
        self.local_size = global_batch // process_count
        self.offset = process_index * self.local_size

    def steps_per_epoch(self) -> int:
        return -(-len(self.rows) // self.global_batch)

    @functools.lru_cache(maxsize=4)
    def _perm(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(len(self.rows))

    def row_ids(self, step: int) -> np.ndarray:
        g = (step - 1) * self.global_batch + self.offset + np.arange(self.local_size, dtype=np.int64)
        epoch, pos = np.divmod(g, len(self.rows))
        return np.array([self._perm(int(e))[p] for e, p in zip(epoch, pos)], np.int64)

    def local_batch(self, step: int) -> dict[str, np.ndarray]:
        return self.rows.take(self.row_ids(step))


def eval_batches(rows: Rows, global_batch: int, process_index: int = 0, process_count: int = 1):
    """Every row once, in order, the last batch filled with all-padding rows (weight 0): local shares."""
    n = -(-len(rows) // global_batch) * global_batch
    local = global_batch // process_count
    for start in range(0, n, global_batch):
        idx = np.arange(start + process_index * local, start + (process_index + 1) * local)
        real = idx < len(rows)
        b = rows.take(np.where(real, idx, 0))
        b["weights"] = b["weights"] * real[:, None]
        yield b
