"""Argument value types of the ``flexgroup`` command lines (torch-free: ``--help`` answers at once).

Each takes the text of one argument and returns its value, or raises ``argparse.ArgumentTypeError``
naming the expected form and the text given (argparse turns it into the one-line usage error).
"""

from __future__ import annotations

import argparse

__all__ = ["positive_int", "nonnegative_float", "int_list", "group_layout"]


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def nonnegative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text}")
    return value


def int_list(text: str) -> list[int]:
    """``"5,12,1"`` -> ``[5, 12, 1]`` (positive integers)."""
    parts = [p.strip() for p in text.split(",") if p.strip()]
    if not parts:
        raise argparse.ArgumentTypeError(f"expected comma-separated positive integers like 5,12,3, got {text!r}")
    return [positive_int(p) for p in parts]


def group_layout(text: str) -> list[tuple[int, list[int]]]:
    """``"24:5,12,1;6:3,3"`` -> ``[(24, [5, 12, 1]), (6, [3, 3])]``: groups as PREFIX:RESPONSE_LENS."""
    groups = []
    for part in (p.strip() for p in text.split(";")):
        prefix, sep, rest = part.partition(":")
        if not sep:
            raise argparse.ArgumentTypeError(
                f"expected groups like 24:5,12,1;6:3,3 (prefix length : response lengths), got {part!r}")
        groups.append((positive_int(prefix.strip()), int_list(rest)))
    return groups
