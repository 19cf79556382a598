"""The one base class of the user errors every dflash module raises.

A `DFlashError` means "the input is wrong": a flag, a file, a device, a checkpoint.
Its message is one line naming the value; the command line prints that line and
exits with status 2 (`--debug` shows the traceback instead).
"""

from __future__ import annotations


class DFlashError(ValueError):
    """Bad user input; the message is one line naming the value and what to change."""


def first_line(error: BaseException) -> str:
    """The first non-empty line of an error's message, else its type name."""
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__
