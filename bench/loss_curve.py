"""The default run's loss curve in two checkouts, side by side: equal to a tolerance.

    python bench/loss_curve.py --against ../old-checkout            # 600 steps, 1e-6
    python bench/loss_curve.py --against ../old --steps 100 --tolerance 0

Each checkout trains the embedded default (`dflash-train train`, the command's own
defaults) with the same seed, reading the loss of every step (`--log-every 1`; the
steps compute the same either way) and skipping the final evaluation. The checkout is
put first on PYTHONPATH, so one virtual environment serves both. Prints the largest
difference per step and exits 1 when it exceeds the tolerance.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]


def losses(checkout: Path, steps: int, out: Path) -> list[float]:
    """The per-step losses of the default run in `checkout` (metrics.jsonl)."""
    env = {**os.environ, "PYTHONPATH": str(checkout)}
    cmd = [sys.executable, "-m", "dflash.cli", "train", "--steps", str(steps),
           "--log-every", "1", "--eval-prompts", "0", "--output-dir", str(out)]  # fmt: skip
    subprocess.run(cmd, env=env, cwd=out.parent, check=True, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL)  # fmt: skip
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [row["loss"] for row in rows]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--against", required=True, type=Path, help="the other checkout")
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--tolerance", type=float, default=1e-6)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="dflash-loss-") as tmp:
        ours = losses(HERE, args.steps, Path(tmp) / "ours")
        theirs = losses(args.against.resolve(), args.steps, Path(tmp) / "theirs")
    if len(ours) != len(theirs):
        print(f"different numbers of logged steps: {len(ours)} vs {len(theirs)}")
        return 1
    diffs = [abs(a - b) for a, b in zip(ours, theirs, strict=True)]
    worst = max(range(len(diffs)), key=diffs.__getitem__)
    print(f"{len(diffs)} steps; loss at step 1 {ours[0]:.6f} vs {theirs[0]:.6f}, "
          f"at the end {ours[-1]:.6f} vs {theirs[-1]:.6f}; largest difference "
          f"{diffs[worst]:.3g} at step {worst + 1} (tolerance {args.tolerance:g})")  # fmt: skip
    return 0 if diffs[worst] <= args.tolerance else 1


if __name__ == "__main__":
    sys.exit(main())
