"""Argument types shared by the benchmark's subcommands (``python -m benchmark ...``): each
turns a command-line string into a checked value or an ``argparse`` error that says why."""

from __future__ import annotations

import argparse


def positive_int(s: str) -> int:
    v = int(s)
    if v < 1:
        raise argparse.ArgumentTypeError(f"should be a positive int, but got {s}")
    return v


def non_negative_int(s: str) -> int:
    v = int(s)
    if v < 0:
        raise argparse.ArgumentTypeError(f"should be an int >= 0, but got {s}")
    return v


def fraction(s: str) -> float:
    v = float(s)
    if not 0.0 <= v <= 1.0:
        raise argparse.ArgumentTypeError(f"should be a fraction in [0, 1], but got {s}")
    return v


def non_negative_float(s: str) -> float:
    v = float(s)
    if not v >= 0.0:
        raise argparse.ArgumentTypeError(f"should be a number >= 0, but got {s}")
    return v
