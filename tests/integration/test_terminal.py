"""`dflash-train train` in a real pseudo-terminal of 120 columns: the progress bar stays
on its own line while interval tables and log lines print above it.

The command's output is replayed on a small screen model (carriage return, newline,
backspace, erase-line and cursor-up, which is what tqdm writes) and no screen line may
hold both the bar and a table line.
"""

from __future__ import annotations

import fcntl
import os
import pty
import re
import select
import struct
import subprocess
import termios
import time
from pathlib import Path

import pytest
from test_e2e_dflash import FAST_FLAGS, checkout_env, dflash_train

pytestmark = pytest.mark.slow

COLUMNS, ROWS = 120, 40
RUN_TIMEOUT_S = 300
CSI = re.compile(r"\x1b\[(\d*)([A-Za-z])")


def screen_lines(output: str) -> list[str]:
    """The lines a terminal shows (scrollback included) after `output`."""
    lines: list[list[str]] = [[]]
    row = col = 0
    i = 0
    while i < len(output):
        char = output[i]
        match = CSI.match(output, i) if char == "\x1b" else None
        if match:
            count, op = int(match[1] or 1), match[2]
            if op == "A":
                row = max(0, row - count)
            elif op == "K":
                del lines[row][col:]
            i = match.end()
            continue
        if char == "\r":
            col = 0
        elif char == "\n":
            row += 1
            col = 0
            if row == len(lines):
                lines.append([])
        elif char == "\b":
            col = max(0, col - 1)
        elif char >= " ":
            if col >= COLUMNS:  # autowrap
                row, col = row + 1, 0
                if row == len(lines):
                    lines.append([])
            line = lines[row]
            line.extend(" " * (col - len(line) + 1) if col >= len(line) else "")
            line[col] = char
            col += 1
        i += 1
    return ["".join(line).rstrip() for line in lines]


def run_in_pty(args: list[str], cwd: Path) -> str:
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", ROWS, COLUMNS, 0, 0))
    env = checkout_env(COLUMNS=str(COLUMNS), LINES=str(ROWS), TERM="xterm")
    terminal = dict(stdin=slave, stdout=slave, stderr=slave)
    process = subprocess.Popen(args, **terminal, cwd=cwd, env=env, close_fds=True)
    os.close(slave)
    chunks: list[bytes] = []
    deadline = time.monotonic() + RUN_TIMEOUT_S
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 0.5)
            if ready:
                try:
                    data = os.read(master, 65536)
                except OSError:  # the child closed the terminal
                    break
                if not data:
                    break
                chunks.append(data)
            elif process.poll() is not None:
                break
    finally:
        if process.poll() is None:
            process.kill()
        process.wait(timeout=30)
        os.close(master)
    text = b"".join(chunks).decode("utf-8", errors="replace")
    assert process.returncode == 0, text[-4000:]
    return text


BAR = re.compile(r"train: +\d+%\|")
TABLE = re.compile(r"^(interval: |phase +count|throughput: |verdict: )")


def test_interval_tables_never_share_a_line_with_the_bar(tmp_path: Path) -> None:
    run = ["--output-dir", str(tmp_path / "run"), "--profile-interval", "1"]
    args = [*dflash_train(), "train", "--steps", "400", *run, *FAST_FLAGS]
    lines = screen_lines(run_in_pty(args, tmp_path))
    tables = [line for line in lines if TABLE.search(line)]
    assert sum(line.startswith("interval: last") for line in tables) >= 2, "\n".join(lines)
    assert any(BAR.search(line) for line in lines), "\n".join(lines[-20:])
    for line in lines:
        if BAR.search(line):  # the bar alone on its line
            assert line.startswith("train:") and not TABLE.search(line), line
        if "nterval: " in line:  # a table line from its first column
            assert line.startswith("interval: "), line
