"""The OTLP commands the README, the compose file and the docs show, read from them.

`otlp_mentions` finds every `--otlp-endpoint URL` of those files with the protocol its
command chooses; `runnable_commands` the complete `dflash-train train ...` tracing
commands a new user would paste (tests/integration/test_doc_commands.py runs each one,
literally, against the real Collector); `compose_trainer_command` the trainer service's.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

import yaml

REPO = Path(__file__).resolve().parents[1]
DOCS = (
    "README.md",
    "docker-compose.yml",
    *sorted(f"docs/{p.name}" for p in (REPO / "docs").glob("*.md")),
)
ENDPOINT = re.compile(r"--otlp-endpoint[ =]+(?P<url>https?://[^\s`'\")]+)")
PROTOCOL = re.compile(r"--otlp-protocol[ =]+(?P<protocol>[a-z/]+)")
RUNNABLE = re.compile(
    r"dflash-train train --otlp-endpoint http://localhost:\d+(?: --otlp-protocol [a-z/]+)?"
    r"(?=\s*(?:$|#|`))",
    re.M,
)


@dataclass(frozen=True)
class Mention:
    path: str
    line: int
    url: str
    protocol: str | None  # as the command gives it; None: the default

    @property
    def port(self) -> int | None:
        return urlparse(self.url).port


def _commands(text: str) -> list[tuple[int, str]]:
    """(line number, the command) for each line, continuation lines joined to theirs."""
    out, joined, first = [], "", 0
    for number, line in enumerate(text.splitlines(), 1):
        if not joined:
            first = number
        if line.rstrip().endswith("\\"):
            joined += line.rstrip()[:-1] + " "
            continue
        out.append((first, joined + line))
        joined = ""
    return out


def otlp_mentions() -> list[Mention]:
    found = []
    for path in DOCS:
        text = (REPO / path).read_text()
        for number, command in _commands(text):
            for match in ENDPOINT.finditer(command):
                rest = command[match.end() :].split("`")[0].split("#")[0]
                protocol = PROTOCOL.search(rest)
                found.append(
                    Mention(path, number, match["url"], protocol["protocol"] if protocol else None)
                )
    trainer = compose_trainer_command()
    url = trainer[trainer.index("--otlp-endpoint") + 1]
    protocol = (
        trainer[trainer.index("--otlp-protocol") + 1] if "--otlp-protocol" in trainer else None
    )
    found.append(Mention("docker-compose.yml (trainer)", 0, url, protocol))
    return found


def runnable_commands() -> dict[str, list[str]]:
    """{command: the files that show it} for the complete tracing commands."""
    commands: dict[str, list[str]] = {}
    for path in DOCS:
        for match in RUNNABLE.finditer((REPO / path).read_text()):
            commands.setdefault(match.group(0), []).append(path)
    return commands


def compose_trainer_command() -> list[str]:
    """The trainer service's command, `dflash-train` included."""
    compose = yaml.safe_load((REPO / "docker-compose.yml").read_text())
    return ["dflash-train", *[str(arg) for arg in compose["services"]["trainer"]["command"]]]
