"""Checks shared by the tracing tests."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TypeVar

import pytest

T = TypeVar("T")


def warns_once(caplog: pytest.LogCaptureFixture, needle: str, make: Callable[[], T]) -> T:
    """`make()`, asserting that this test has logged one warning holding `needle` so far
    (call it again to check that a repeat logs none); its result."""
    with caplog.at_level(logging.WARNING):
        result = make()
    found = [r.getMessage() for r in caplog.records if needle in r.getMessage()]
    assert len(found) == 1, found
    return result
