"""The per-sample (speculators' layout) hidden-state reader: tokens/s against the online
target forward side by side, and its memory bound.

Usage: python bench/sample_cache_read.py [--batches N] [--big-mib M] [train flags KEY=VALUE ...]
1. On the default config (built-in target), writes the training rows' samples with
   `cache-hidden --format speculators`'s writer, then times the target forward and the
   reader on the same batches, alternating: tokens/s of each and their ratio.
2. In a child process whose address space is capped (RLIMIT_AS) at 256 MiB above what
   it uses once torch is imported, reads every batch of a synthetic cache of M MiB
   (default 1,024: four times the cap): peak RSS and whether it finished.
Prints one JSON line per part.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_throughput import parse_overrides  # noqa: E402

from dflash.config.settings import config_from_options  # noqa: E402
from dflash.offline.sample_cache import open_sample_cache, sample_datasets  # noqa: E402
from dflash.offline.sample_reader import SampleCacheReader  # noqa: E402
from dflash.offline.sample_writer import write_sample_cache  # noqa: E402
from dflash.run.rows import training_rows  # noqa: E402
from dflash.run.target_features import resolve_layer_ids  # noqa: E402
from dflash.target import load as target_load  # noqa: E402


def throughput(overrides: dict[str, object], batches: int, workdir: Path) -> dict[str, object]:
    cfg = config_from_options(overrides)
    target = target_load.load_target(cfg.target.spec, "cpu", torch.float32, log=lambda _: None)
    layer_ids = resolve_layer_ids(cfg, target.num_layers)
    train, heldout = training_rows(cfg, target, log=lambda _: None)
    out = write_sample_cache(target, train, heldout, workdir / "cache", layer_ids=layer_ids,
                             with_last_layer=True)  # fmt: skip
    cache = open_sample_cache(out, target=target, layer_ids=layer_ids, soft_labels=False)
    rows = cfg.data.batch_size * cfg.optim.grad_accum
    data, _, segments = sample_datasets(
        cache, seq_len=cfg.data.seq_len, batch_size=rows, seed=cfg.run.seed,
        heldout_fraction=cfg.data.heldout_fraction, pad_id=0, log=lambda _: None,
    )  # fmt: skip
    reader = SampleCacheReader(cache, data, segments, None)
    seconds = {"online": 0.0, "reader": 0.0}
    tokens = 0
    for i in range(batches + 1):
        batch = data.batch(i)
        for name in ("online", "reader") if i % 2 else ("reader", "online"):
            start_s = time.perf_counter()
            if name == "online":
                target.capture(batch.input_ids, layer_ids, with_logits=False,
                               doc_ids=batch.doc_ids)  # fmt: skip
            else:
                reader.read(batch)
            if i:  # batch 0 warms both up
                seconds[name] += time.perf_counter() - start_s
        tokens += batch.num_tokens if i else 0
    online, read = tokens / seconds["online"], tokens / seconds["reader"]
    return {"online_tokens_per_s": round(online), "reader_tokens_per_s": round(read),
            "ratio": round(read / online, 2), "batches": batches, "samples": len(cache.samples),
            "read_mib_per_s": round(reader.bytes_read / 2**20 / seconds["reader"], 1)}  # fmt: skip


CHILD = r"""
import json, resource, sys, time
import torch
from dflash.offline.sample_cache import open_sample_cache, sample_datasets
from dflash.offline.sample_reader import SampleCacheReader
from dflash.target.load import wrap_tiny
from dflash.target.tiny import TinyLM, TinyLMConfig
cache_dir, cap_mib = sys.argv[1], int(sys.argv[2])
target = wrap_tiny(TinyLM(TinyLMConfig(hidden_size=512, num_layers=4, num_heads=8,
                                       intermediate_size=64)))
with open("/proc/self/status") as f:
    vm = next(int(l.split()[1]) for l in f if l.startswith("VmSize")) * 1024
limit = vm + cap_mib * 2**20
resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
cache = open_sample_cache(cache_dir, target=target, layer_ids=[1, 2], soft_labels=False)
data, _, rows = sample_datasets(cache, seq_len=512, batch_size=4, seed=0,
                                heldout_fraction=0.01, pad_id=0, log=lambda _: None)
reader = SampleCacheReader(cache, data, rows, None)
batches = -(-len(data) // 4)
start = time.perf_counter()
for i in range(batches):
    reader.read(data.batch(i))
print(json.dumps({"cap_mib": cap_mib, "read_mib": round(reader.bytes_read / 2**20),
                  "batches": batches, "seconds": round(time.perf_counter() - start, 1),
                  "peak_rss_mib": round(
                      resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)}))
"""


def bounded(big_mib: int, workdir: Path) -> dict[str, object]:
    """A synthetic cache of `big_mib` MiB: [512, 3, 512] fp32 samples (3 MiB each)."""
    from safetensors.torch import save_file

    where = workdir / "big" / "hidden_states"
    where.mkdir(parents=True)
    count = max(1, big_mib // 3)
    hidden = torch.randn(512, 3, 512)
    for i in range(count):
        save_file({"token_ids": torch.randint(0, 250, (512,)), "hidden_states": hidden,
                   "loss_mask": torch.ones(512, dtype=torch.bool)},
                  str(where / f"hs_{i}.safetensors"))  # fmt: skip
    cap = 256
    child = subprocess.run([sys.executable, "-c", CHILD, str(where.parent), str(cap)],
                           capture_output=True, text=True)  # fmt: skip
    size = sum(p.stat().st_size for p in where.iterdir()) / 2**20
    if child.returncode != 0:
        return {"cache_mib": round(size), "cap_mib": cap, "failed": child.stderr[-400:]}
    return {"cache_mib": round(size), **json.loads(child.stdout.strip().splitlines()[-1])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, default=20)
    parser.add_argument("--big-mib", type=int, default=1024)
    parser.add_argument("overrides", nargs="*", help="train options as KEY=VALUE")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="sample-cache-") as tmp:
        work = Path(tmp)
        print(json.dumps({"throughput": throughput(parse_overrides(args.overrides),
                                                   args.batches, work)}), flush=True)  # fmt: skip
        print(json.dumps({"bounded": bounded(args.big_mib, work)}))


if __name__ == "__main__":
    main()
