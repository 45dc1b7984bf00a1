"""The simulated answers' sampled ids (`sim.answers`), each drawn from its request's id, so a run is deterministic.

A multi-turn client appends each answer's TEXT (ByteTokenizer.decode: specials dropped, invalid UTF-8 as U+FFFD) to
the next prompt, and the server re-encodes it; the radix cache holds the ids as sampled, so the next turn's hit
stops at the first answer token whose re-encoding differs, and the next prompt is as long as the text's bytes.

- `printable` (servelab's default): printable ASCII bytes, one byte per token, never an EOS: every answer re-encodes
  to itself, so a conversation's cache hit runs through its answers (more hits than the real tiny model gets).
- `measured`: each answer is one of the real engine's answers measured by experiments/calibrate/answers.py
  (data/calibration/answers.json: the tiny model's greedy answers, per weight seed, each as often as measured),
  its first n ids; an answer longer than the measured ones continues with further measured answers. Its text, and
  where its re-encoding diverges, are a real answer's.
"""
from __future__ import annotations

import bisect
import enum
import functools
import itertools
import json
import random
from pathlib import Path

from framework.core.paths import REPO_ROOT
from framework.model.tokenizer import ByteTokenizer

DEFAULT_PATH = "data/calibration/answers.json"


class SimAnswers(enum.Enum):
    """sim.answers: the simulated answers' sampled ids."""
    printable = "printable"   # printable ASCII, a byte a token: every answer re-encodes to itself (servelab's)
    measured = "measured"     # the real engine's measured answers (data/calibration/answers.json)


_PRINTABLE = bytes(32 + b % 95 for b in range(256))
_BYTES = ByteTokenizer()


def printable_answer(seed: int, rid: str, n: int) -> list[int]:
    """The deterministic answer of request `rid`: n printable byte tokens."""
    return list(random.Random(f"{seed}/{rid}").randbytes(n).translate(_PRINTABLE))


def divergence(ids: list[int]) -> int:
    """The first answer token whose decoded-and-re-encoded text differs from it (len(ids): none does)."""
    again = _BYTES.encode(_BYTES.decode(ids))
    return next((i for i, (a, b) in enumerate(zip(ids, again)) if a != b), min(len(ids), len(again)))


class MeasuredAnswers:
    """The real engine's answers for one model and weight seed, each as often as it was measured."""

    def __init__(self, bank: list[list]):
        """bank: [times measured, ids] per distinct answer (data/calibration/answers.json)."""
        self.answers = [ids for _, ids in bank]
        self.cumulative = list(itertools.accumulate(n for n, _ in bank))

    def __call__(self, seed: int, rid: str, n: int) -> list[int]:
        rng, ids = random.Random(f"{seed}/{rid}"), []
        while len(ids) < n:
            ids += self.answers[bisect.bisect_right(self.cumulative, rng.randrange(self.cumulative[-1]))]
        return ids[:n]


@functools.lru_cache(maxsize=4)
def load(path: str) -> dict:
    """The measured answers file, checked: ValueError naming the file and what is wrong."""
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ValueError(f"sim.answers=measured: {path} is missing; measure it with "
                         f"`python experiments/calibrate/answers.py`") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"sim.answers=measured: {path} is not JSON ({e})") from None
    missing = [k for k in ("model", "vocab_size", "temperature", "answers") if k not in data]
    if missing:
        raise ValueError(f"sim.answers=measured: {path} lacks {missing}")
    vocab = data["vocab_size"]
    if not isinstance(vocab, int) or vocab < 259:
        raise ValueError(f"sim.answers=measured: {path}: vocab_size must be an integer >= 259, got {vocab!r}")
    if not isinstance(data["temperature"], (int, float)) or data["temperature"] < 0:
        raise ValueError(f"sim.answers=measured: {path}: temperature must be a number >= 0, "
                         f"got {data['temperature']!r}")
    if not isinstance(data["answers"], dict) or not data["answers"]:
        raise ValueError(f"sim.answers=measured: {path}: answers must map weight seeds to lists of answers")
    for seed, bank in data["answers"].items():
        if not isinstance(bank, list) or not bank:
            raise ValueError(f"sim.answers=measured: {path}: the answers of seed {seed} must be a non-empty list")
        for entry in bank:
            if not (isinstance(entry, list) and len(entry) == 2 and type(entry[0]) is int and entry[0] >= 1
                    and isinstance(entry[1], list) and entry[1]):
                raise ValueError(f"sim.answers=measured: {path}: seed {seed}: each answer must be [times measured "
                                 f">= 1, non-empty ids], got {str(entry)[:80]}")
            bad = next((i for i in entry[1] if type(i) is not int or not 0 <= i < vocab), None)
            if bad is not None:
                raise ValueError(f"sim.answers=measured: {path}: seed {seed} has id {bad!r}, not a token id in "
                                 f"[0, {vocab})")
    return data


def answer_source(cfg):
    """The run's answers: f(seed, rid, n) -> n ids. ValueError when `measured` has nothing measured for this run
    (its model, its weight seed, its sampling temperature)."""
    if cfg.sim.answers is SimAnswers.printable:
        return printable_answer
    path = str(REPO_ROOT / DEFAULT_PATH)           # an absolute DEFAULT_PATH stays itself
    data = load(path)
    if data["model"] != cfg.model.name or data["vocab_size"] != cfg.model.vocab_size:
        raise ValueError(f"sim.answers=measured: {path} holds {data['model']}'s answers (vocab {data['vocab_size']}), "
                         f"not {cfg.model.name}'s (vocab {cfg.model.vocab_size})")
    if data["temperature"] != cfg.workload.temperature:
        raise ValueError(f"sim.answers=measured: {path} holds answers sampled at temperature {data['temperature']}, "
                         f"the workload samples at {cfg.workload.temperature}")
    bank = data["answers"].get(str(cfg.seed))
    if bank is None:
        raise ValueError(f"sim.answers=measured: {path} has no answers of weight seed {cfg.seed} (it has "
                         f"{sorted(data['answers'])}); measure them with `python experiments/calibrate/answers.py "
                         f"--weight-seeds {cfg.seed}`")
    return MeasuredAnswers(bank)
