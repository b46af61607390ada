"""argparse ``type`` functions shared by the command-line tools: a bad value is a usage error naming the option."""

from __future__ import annotations

import argparse
import math

__all__ = ["non_negative_float", "non_negative_int", "positive_float", "positive_int"]


def positive_int(text: str) -> int:
    """Counts that must be >= 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an int >= 1, got {value}")
    return value


def non_negative_int(text: str) -> int:
    """Counts that may be 0."""
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be an int >= 0, got {value}")
    return value


def positive_float(text: str) -> float:
    """Finite values > 0 (speeds, rates, learning rates)."""
    value = float(text)
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {value}")
    return value


def non_negative_float(text: str) -> float:
    """Finite values >= 0 (loss weights)."""
    value = float(text)
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {value}")
    return value
