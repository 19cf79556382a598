"""--precision: which devices and widths run bf16, the refusal of bf16 where it is not
native, and what stays fp32 under bf16 (master weights, AdamW state, the loss)."""

from __future__ import annotations

import pytest
import torch
from click.testing import CliRunner

from dflash.cli import cli
from dflash.config import devices
from dflash.config.devices import (
    AUTO_BF16_MIN_HIDDEN,
    DeviceError,
    cpu_bf16_flags,
    precision_text,
    resolve_precision,
)
from dflash.target import load as target_load
from dflash.target.tiny import TinyLM, TinyLMConfig
from tests.dflash.app_fixtures import (  # noqa: F401 - fixture
    cpu_run,
    small_cfg,
    tiny_target,
    write_corpus,
)

CPU = torch.device("cpu")
NATIVE, NONE = ("avx512_bf16",), ()


def test_cpu_flags_are_read_from_cpuinfo() -> None:
    info = "processor\t: 0\nflags\t\t: fpu sse avx512f avx512_bf16 amx_tile\n\nflags : amx_bf16\n"
    assert cpu_bf16_flags(info) == ("avx512_bf16", "amx_bf16")
    assert cpu_bf16_flags("flags\t: fpu sse avx2 avx512f\n") == ()
    assert cpu_bf16_flags("") == ()  # no /proc/cpuinfo (macOS): no native bf16


@pytest.mark.parametrize(
    ("option", "flags", "hidden", "expected"),
    [
        ("fp32", NATIVE, 4096, "fp32"),
        ("bf16", NATIVE, 32, "bf16"),  # asked for: whatever the width
        ("auto", NATIVE, AUTO_BF16_MIN_HIDDEN, "bf16"),
        ("auto", NATIVE, AUTO_BF16_MIN_HIDDEN - 1, "fp32"),  # too narrow to pay
        ("auto", NATIVE, None, "fp32"),  # width not known yet
        ("auto", NONE, 4096, "fp32"),  # no native bf16: never under auto
    ],
)
def test_resolve_precision_on_the_cpu(option, flags, hidden, expected) -> None:
    assert resolve_precision(option, CPU, hidden, cpu_flags=flags) == expected


def test_bf16_on_a_cpu_without_it_is_refused_naming_the_device() -> None:
    with pytest.raises(DeviceError, match=r"--precision bf16: device cpu has no native bf16"):
        resolve_precision("bf16", CPU, 4096, cpu_flags=NONE)


def test_the_startup_words_say_what_auto_chose_and_why() -> None:
    text = precision_text("auto", CPU, 576, cpu_flags=NATIVE)
    assert text == (
        "precision: bf16 autocast, fp32 master weights (auto: cpu has avx512_bf16, "
        "hidden size 576 >= 512)"
    )
    assert precision_text("auto", CPU, 128, cpu_flags=NATIVE).startswith("precision: fp32 (")
    assert precision_text("auto", CPU, 4096, cpu_flags=NONE) == (
        "precision: fp32 (auto: no native bf16 on cpu)"
    )
    assert precision_text("fp32", CPU, 4096, cpu_flags=NATIVE) == "precision: fp32"


@pytest.mark.usefixtures("tiny_target")
def test_cli_refuses_bf16_on_a_cpu_without_it_before_any_model_loads(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(devices, "cpu_bf16_flags", lambda cpuinfo=None: NONE)

    def no_load(*args, **kwargs):
        raise AssertionError("a model loaded before the precision was checked")

    monkeypatch.setattr(target_load, "load_target", no_load)
    out = tmp_path / "run"
    result = CliRunner().invoke(
        cli, ["train", "--precision", "bf16", "--output-dir", str(out), "--steps", "1"]
    )
    assert result.exit_code == 2, result.output
    errors = [line for line in result.output.splitlines() if line.startswith("Error:")]
    assert errors == [
        "Error: --precision bf16: device cpu has no native bf16 (its /proc/cpuinfo flags "
        "name neither avx512_bf16 or amx_bf16); use fp32 or auto"
    ], result.output
    assert not (out / "config.json").exists()


def test_cli_refuses_an_unknown_precision() -> None:
    result = CliRunner().invoke(cli, ["train", "--precision", "fp16"])
    assert result.exit_code == 2 and "--precision" in result.output


def test_target_dtype_follows_the_precision() -> None:
    assert target_load.target_dtype(CPU) == torch.float32  # the commands without the option
    assert target_load.target_dtype(CPU, "fp32") == torch.float32
    assert target_load.target_dtype(CPU, "auto") == torch.float32  # its width decides, later


@pytest.mark.parametrize(("hidden", "expected"), [(512, torch.bfloat16), (64, torch.float32)])
def test_a_loaded_target_wide_enough_runs_bf16_under_auto(monkeypatch, hidden, expected) -> None:
    monkeypatch.setattr(devices, "cpu_bf16_flags", lambda cpuinfo=None: NATIVE)
    shape = TinyLMConfig(hidden_size=hidden, num_layers=1, num_heads=8, intermediate_size=64)
    target = target_load.wrap_tiny(TinyLM(shape))
    target_load.run_precision(target, "auto", CPU)
    assert {p.dtype for p in target.parameters()} == {expected}


@pytest.mark.usefixtures("tiny_target")
def test_under_bf16_the_forward_autocasts_and_weights_and_adamw_stay_fp32(
    tmp_path, monkeypatch
) -> None:
    monkeypatch.setattr(devices, "cpu_bf16_flags", lambda cpuinfo=None: NATIVE)
    run = cpu_run(small_cfg(tmp_path, precision="bf16"))
    trainer, drafter = run.trainer, run.drafter
    assert trainer.autocast_dtype == torch.bfloat16
    assert {p.dtype for p in run.target.parameters()} == {torch.bfloat16}
    seen: list[torch.dtype] = []
    layer = next(m for m in drafter.layers.modules() if isinstance(m, torch.nn.Linear))
    layer.register_forward_hook(lambda mod, args, out: seen.append(out.dtype))
    batch = run.train_data.batch(0)
    with torch.no_grad():
        out = run.target.capture(batch.input_ids, run.layer_ids, with_logits=False)
    assert out.hidden.dtype == torch.bfloat16  # the target's states, as on CUDA
    result = trainer.step(batch, out)
    assert seen == [torch.bfloat16]  # the drafter's matmuls ran in bf16
    assert result.loss.dtype == torch.float32 and torch.isfinite(result.loss)
    trained = [p for p in drafter.parameters() if p.requires_grad]
    assert trained and {p.dtype for p in trained} == {torch.float32}  # master weights
    moments = [t for s in trainer.optimizer.state.values() for t in s.values() if t.ndim]
    assert moments and {t.dtype for t in moments} == {torch.float32}  # AdamW's state


def train_losses(run, steps: int = 3) -> list[float]:
    losses = []
    for i in range(steps):
        batch = run.train_data.batch(i)
        with torch.no_grad():
            out = run.target.capture(batch.input_ids, run.layer_ids, with_logits=False)
        losses.append(float(run.trainer.step(batch, out).loss))
    return losses


@pytest.mark.usefixtures("tiny_target")
def test_fp32_and_a_narrow_auto_run_train_exactly_as_fp32(tmp_path, monkeypatch) -> None:
    """`auto` below AUTO_BF16_MIN_HIDDEN (every test's model, the default run's) and
    `fp32` run the same fp32 step: no autocast, the same losses."""
    monkeypatch.setattr(devices, "cpu_bf16_flags", lambda cpuinfo=None: NATIVE)
    losses = {}
    for option in ("fp32", "auto"):
        run = cpu_run(small_cfg(tmp_path, tmp_path / option, precision=option))
        assert run.trainer.autocast_dtype is None
        assert {p.dtype for p in run.target.parameters()} == {torch.float32}
        losses[option] = train_losses(run)
    assert losses["fp32"] == losses["auto"]


@pytest.mark.usefixtures("tiny_target")
def test_regenerate_refuses_bf16_on_a_cpu_without_it_before_the_target_loads(
    tmp_path, monkeypatch
) -> None:
    monkeypatch.setattr(devices, "cpu_bf16_flags", lambda cpuinfo=None: NONE)
    monkeypatch.setattr(target_load, "load_target", lambda *a, **k: pytest.fail("loaded"))
    corpus = write_corpus(tmp_path)
    args = ["regenerate", "--data", str(corpus), "--output", str(tmp_path / "out.jsonl")]
    result = CliRunner().invoke(cli, [*args, "--precision", "bf16", "--device", "cpu"])
    assert result.exit_code == 2, result.output
    errors = [line for line in result.output.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and "--precision bf16: device cpu has no native bf16" in errors[0]


@pytest.mark.usefixtures("tiny_target")
def test_a_bf16_hidden_cache_trains_a_bf16_run(tmp_path, monkeypatch) -> None:
    """cache-hidden and train given the same --precision agree on the states' dtype."""
    from dflash.run.offline import write_run_cache

    monkeypatch.setattr(devices, "cpu_bf16_flags", lambda cpuinfo=None: NATIVE)
    cache = tmp_path / "cache"
    write_run_cache(small_cfg(tmp_path, precision="bf16"), cache, num_batches=2, log=print)
    cfg = small_cfg(tmp_path, tmp_path / "run", precision="bf16", hidden_cache=str(cache))
    run = cpu_run(cfg)
    assert run.trainer.autocast_dtype == torch.bfloat16
    (forward,) = [f for _, f in run.features.forwards(run.target, run.layer_ids, run.train_data,
                                                       run.placement, (0, 1))]  # fmt: skip
    batch = run.train_data.batch(0)
    out = forward(batch)
    assert out.hidden.dtype == torch.bfloat16
    assert torch.isfinite(run.trainer.step(batch, out).loss)


def test_the_cast_leaves_buffers_as_a_bf16_load_does(monkeypatch) -> None:
    """Weights to bf16; RoPE's inverse frequencies stay fp32, as from_pretrained in bf16
    keeps them."""
    pytest.importorskip("transformers")
    from dflash.target.synthetic import TINY_QWEN3, random_qwen3_target

    monkeypatch.setattr(devices, "cpu_bf16_flags", lambda cpuinfo=None: NATIVE)
    target = target_load.run_precision(random_qwen3_target(TINY_QWEN3), "bf16", CPU)
    assert {p.dtype for p in target.parameters()} == {torch.bfloat16}
    assert {b.dtype for b in target.buffers() if b.is_floating_point()} == {torch.float32}
