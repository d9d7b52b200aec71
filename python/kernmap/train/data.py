"""SFT data for `python -m kernmap align | ablate`, the same as the C++ command's (train/data.cpp,
docs/training.md "Data and batching"): token-id JSONL with every malformed line reported by number, the synthetic
default drawn from std::mt19937_64 (identical examples on every machine and in both languages), and the batch of a
step."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import torch

MASK64 = (1 << 64) - 1


class MT19937_64:
    """std::mt19937_64: its output sequence is fixed by the C++ standard, so the synthetic data is the C++
    command's, token for token."""

    N, M = 312, 156
    MATRIX_A, UPPER, LOWER = 0xB5026F5AA96619E9, 0xFFFFFFFF80000000, 0x7FFFFFFF

    def __init__(self, seed: int):
        self.mt = [seed & MASK64]
        for i in range(1, self.N):
            prev = self.mt[-1]
            self.mt.append((6364136223846793005 * (prev ^ (prev >> 62)) + i) & MASK64)
        self.index = self.N

    def _twist(self) -> None:
        mt, n, m = self.mt, self.N, self.M
        for i in range(n):
            x = (mt[i] & self.UPPER) | (mt[(i + 1) % n] & self.LOWER)
            mt[i] = mt[(i + m) % n] ^ (x >> 1) ^ (self.MATRIX_A if x & 1 else 0)
        self.index = 0

    def __call__(self) -> int:
        if self.index >= self.N:
            self._twist()
        x = self.mt[self.index]
        self.index += 1
        x ^= (x >> 29) & 0x5555555555555555
        x ^= (x << 17) & 0x71D67FFFEB8B0000
        x ^= (x << 37) & 0xFFF7EEE000000000
        x ^= x >> 43
        return x & MASK64


@dataclass
class Example:
    prompt_ids: list[int]
    response_ids: list[int]


@dataclass
class DataIssue:
    line: int
    problem: str


@dataclass
class Dataset:
    source: str
    examples: list[Example]
    skipped: list[DataIssue] = field(default_factory=list)


class DataError(ValueError):
    """Data that cannot be used; the message lists every malformed line with its number."""

    def __init__(self, message: str, issues: list[DataIssue]):
        super().__init__(message)
        self.issues = issues


def _dump(value) -> str:
    return json.dumps(value, separators=(",", ":"))


def _read_ids(obj: dict, key: str, vocab_size: int) -> tuple[list[int], str | None]:
    if key not in obj:
        return [], f'missing "{key}"'
    ids = obj[key]
    if not isinstance(ids, list):
        return [], f'"{key}" must be an array of token ids, got {_dump(ids)}'
    for i, v in enumerate(ids):
        if not isinstance(v, int) or isinstance(v, bool):
            return [], f'"{key}"[{i}] must be an integer, got {_dump(v)}'
        if v < 0 or v >= vocab_size:
            return [], f'"{key}"[{i}] = {v} is outside the vocabulary [0, {vocab_size})'
    return ids, None


def _parse_line(line: str, vocab_size: int) -> tuple[Example | None, str | None]:
    try:
        obj = json.loads(line)
    except ValueError as e:  # the parser's own words follow, as in the C++ command's message
        return None, f"not valid JSON: {e}"
    if not isinstance(obj, dict):
        return None, "not a JSON object"
    prompt, problem = _read_ids(obj, "prompt_ids", vocab_size)
    if problem:
        return None, problem
    response, problem = _read_ids(obj, "response_ids", vocab_size)
    if problem:
        return None, problem
    if not response:
        return None, '"response_ids" is empty (nothing to train on)'
    if len(prompt) + len(response) < 2:
        return None, "fewer than 2 tokens (a single token predicts nothing)"
    return Example(prompt, response), None


def read_jsonl(path: str, vocab_size: int, skip_bad_lines: bool = False) -> Dataset:
    """Lines ``{"prompt_ids": [int...], "response_ids": [int...]}``; other keys ignored, whitespace-only lines are
    not examples. Malformed lines raise DataError listing all of them, unless `skip_bad_lines` (then they are in
    ``Dataset.skipped``)."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().split("\n")
    except OSError as e:
        raise DataError(f"{path}: cannot open ({e.strerror})", []) from e
    if lines and lines[-1] == "":
        lines.pop()
    data = Dataset(source=str(path), examples=[])
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        example, problem = _parse_line(line, vocab_size)
        if problem:
            data.skipped.append(DataIssue(number, problem))
        else:
            data.examples.append(example)
    if data.skipped and not skip_bad_lines:
        n = len(data.skipped)
        listed = "".join(f"\n  line {i.line}: {i.problem}" for i in data.skipped)
        raise DataError(f"{path}: {n} malformed line{'' if n == 1 else 's'} (--skip-bad-lines skips them):{listed}",
                        data.skipped)
    if not data.examples:
        raise DataError(f"{path}: no usable examples", data.skipped)
    return data


def synthetic_dataset(vocab_size: int, num_examples: int, seq_len: int, seed: int = 1234) -> Dataset:
    """The C++ synthetic_dataset: prompts of seq_len / 2 tokens drawn from mt19937_64 (raw output modulo the
    vocabulary), each response the prompt shifted by one token id, so the loss falls as the model learns it."""
    if seq_len < 2 or num_examples < 1 or vocab_size < 2:
        raise ValueError("synthetic data needs seq_len >= 2, num_examples >= 1 and vocab_size >= 2")
    rng = MT19937_64(seed)
    prompt_len = seq_len // 2
    examples = []
    for _ in range(num_examples):
        prompt = [rng() % vocab_size for _ in range(prompt_len)]
        response = [(prompt[i % prompt_len] + 1) % vocab_size for i in range(seq_len - prompt_len)]
        examples.append(Example(prompt, response))
    return Dataset(f"synthetic({num_examples} x {seq_len} tokens, seed {seed})", examples)


@dataclass
class Batch:
    input_ids: torch.Tensor  # [rows, S] int64
    labels: torch.Tensor  # [rows, S] int64: the token on response positions, -100 elsewhere
    tokens: int  # non-padding tokens of these rows


def batch_examples(data: Dataset, step: int, batch_size: int) -> list[Example]:
    """The examples of step `step` (0-based): (step * batch_size + b) mod N, b < batch_size."""
    n = len(data.examples)
    return [data.examples[(step * batch_size + b) % n] for b in range(batch_size)]


def make_batch(examples: list[Example], pad_id: int, length: int | None = None) -> Batch:
    """prompt + response per row, right-padded with pad_id to `length` (default: the longest row). Under causal
    attention right padding changes no real token's logits."""
    longest = max(len(e.prompt_ids) + len(e.response_ids) for e in examples)
    length = longest if length is None else length
    ids = torch.full((len(examples), length), pad_id, dtype=torch.long)
    labels = torch.full((len(examples), length), -100, dtype=torch.long)
    tokens = 0
    for b, e in enumerate(examples):
        p, r = len(e.prompt_ids), len(e.response_ids)
        ids[b, :p + r] = torch.tensor(e.prompt_ids + e.response_ids, dtype=torch.long)
        labels[b, p:p + r] = torch.tensor(e.response_ids, dtype=torch.long)
        tokens += p + r
    return Batch(ids, labels, tokens)
