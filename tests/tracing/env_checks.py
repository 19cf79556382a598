"""Checks shared by the tracing tests."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TypeVar

import pytest

T = TypeVar("T")


def read_warns_once(caplog: pytest.LogCaptureFixture, variable: str, value: str,
                    read: Callable[[], T]) -> T:  # fmt: skip
    """Reads a config twice with `variable` malformed; asserts one warning that quotes
    `value`, and returns what the first read gave (the fallback)."""
    with caplog.at_level(logging.WARNING, logger="tracing"):
        cfg = read()
        read()
    warnings = [r.getMessage() for r in caplog.records if variable in r.getMessage()]
    assert len(warnings) == 1, warnings
    assert repr(value) in warnings[0]
    return cfg
