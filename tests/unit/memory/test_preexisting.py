"""What the blocks from before a snapshot's recording most likely are (memory/preexisting.py)."""

from __future__ import annotations

import pytest

from zdiag.analyzers.memory.preexisting import infer_preexisting

MIB = 2**20


@pytest.mark.parametrize(
    ("multiple", "meaning"),
    [
        (1.0, "the parameters ("),
        (2.05, "the parameters and their gradients ("),
        (2.95, "two optimizer moments each (Adam/AdamW) ("),
        (4.0, "the parameters, their gradients and two optimizer moments"),
    ],
)
def test_multiples_of_the_parameters_are_named(multiple: float, meaning: str) -> None:
    said = infer_preexisting({"PREEXISTING": int(multiple * 100 * MIB)}, 100 * MIB)
    assert said.startswith("most likely ") and meaning in said
    assert "inferred" in said


@pytest.mark.parametrize(
    ("before", "params"),
    [
        (150 * MIB, 100 * MIB),
        (0, 100 * MIB),
        (100 * MIB, None),
        (100 * MIB, 0),
        (5 * MIB, 100 * MIB),
    ],
)
def test_anything_else_is_left_unnamed(before: int, params: int | None) -> None:
    assert infer_preexisting({"PREEXISTING": before}, params) == ""
