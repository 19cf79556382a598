"""One cache folder for everything: $DFLASH_CACHE_DIR, or ~/.cache/dflash-train when
it is unset or empty (tokens and the tiny target alike)."""

from __future__ import annotations

import pytest

from dflash.data import corpus
from dflash.target import tiny
from tests.dflash.app_fixtures import SMALL_LM


@pytest.mark.parametrize("value", [None, ""])
def test_unset_or_empty_means_the_default_everywhere(tmp_path, monkeypatch, value) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    if value is None:
        monkeypatch.delenv("DFLASH_CACHE_DIR", raising=False)
    else:
        monkeypatch.setenv("DFLASH_CACHE_DIR", value)
    default = tmp_path / ".cache" / "dflash-train"
    assert corpus.cache_dir() == default
    # The tiny target goes to the same folder (trained here by a stand-in: seconds).
    monkeypatch.setattr(tiny, "train_tiny_lm", lambda cfg, recipe, seed, log: tiny.TinyLM(cfg))
    monkeypatch.setattr(tiny, "heldout_loss", lambda model, recipe, seed: 1.0)
    prepared = tiny.prepare_builtin_target(cfg=SMALL_LM, log=lambda _: None)
    assert prepared.parent == default / "targets"


def test_a_set_folder_is_used_by_both(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("DFLASH_CACHE_DIR", str(tmp_path / "c"))
    monkeypatch.setattr(tiny, "train_tiny_lm", lambda cfg, recipe, seed, log: tiny.TinyLM(cfg))
    monkeypatch.setattr(tiny, "heldout_loss", lambda model, recipe, seed: 1.0)
    assert corpus.cache_dir() == tmp_path / "c"
    prepared = tiny.prepare_builtin_target(cfg=SMALL_LM, log=lambda _: None)
    assert prepared.parent == tmp_path / "c" / "targets"
