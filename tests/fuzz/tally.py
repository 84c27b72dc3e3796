"""How many fuzz cases ran, per input: each test body calls ``count`` once per example, so the
total includes explicit examples, generated ones and shrinking (conftest prints the sum)."""

from __future__ import annotations

from collections import Counter

CASES: Counter[str] = Counter()


def count(input_name: str) -> None:
    CASES[input_name] += 1
