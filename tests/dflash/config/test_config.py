import dataclasses
import json

import pytest

from dflash.config.schema import ConfigError
from dflash.config.settings import (
    SCHEMA_VERSION,
    DataConfig,
    DrafterShapeConfig,
    LossConfig,
    OptimConfig,
    PipelineConfig,
    RunConfig,
    TelemetryConfig,
    TrainConfig,
    config_from_options,
    option_map,
    options,
    read_values,
    values_from_mapping,
)
from dflash.errors import DFlashError
from tests.dflash.app_fixtures import COMPANIONS, NON_DEFAULT, NON_DEFAULT_ALONE

# A valid value other than the default for every option: the round-trip tests use it,
# and `test_every_option_has_a_round_trip_value` fails when a new field is missing here.


@pytest.mark.parametrize(
    ("build", "flag"),
    [
        (lambda: DrafterShapeConfig(block_size=1), "--block-size"),
        (lambda: LossConfig(num_anchors=0), "--num-anchors"),
        (lambda: LossConfig(kl_temperature=0.0), "--kl-temperature"),
        (lambda: LossConfig(kl_temperature=-1.0), "--kl-temperature"),
        (lambda: LossConfig(streak_alpha=1.5), "--streak-alpha"),
        (lambda: LossConfig(streak_alpha=-0.1), "--streak-alpha"),
        (lambda: LossConfig(kl_weight=2.0), "--kl-weight"),
        (lambda: LossConfig(gamma=0.0), "--loss-decay-gamma"),
        (lambda: RunConfig(steps=0), "--steps"),
        (lambda: DataConfig(batch_size=0), "--batch-size"),
        (lambda: LossConfig(loss_chunk_size=0), "--loss-chunk-size"),
        (lambda: OptimConfig(grad_accum=0), "--grad-accum"),
        (lambda: OptimConfig(max_bad_steps=0), "--max-bad-steps"),
        (lambda: DataConfig(heldout_fraction=1.0), "--heldout-fraction"),
        (lambda: PipelineConfig(hs_queue_size=0), "--hs-queue-size"),
        (lambda: PipelineConfig(target_devices=("gpu7",)), "--target-devices"),
        (lambda: TelemetryConfig(trace_level="verbose"), "--trace-level"),
        (lambda: TelemetryConfig(trace_sample_ratio=1.5), "--trace-sample-ratio"),
        (lambda: TelemetryConfig(profile_interval_s=0), "--profile-interval"),
        (lambda: RunConfig(steps=2.5), "--steps"),
        (lambda: DataConfig(source="  "), "--data"),
    ],
)
def test_bad_values_name_the_flag_and_value(build, flag) -> None:
    with pytest.raises(ConfigError) as info:
        build()
    message = str(info.value)
    assert flag in message and "\n" not in message
    assert isinstance(info.value, DFlashError)


@pytest.mark.parametrize("value", [float("inf"), float("-inf"), float("nan")])
@pytest.mark.parametrize("name", [o.name for o in options() if o.kind is float])
def test_every_float_option_refuses_non_finite_numbers(name, value) -> None:
    with pytest.raises(ConfigError, match="finite"):
        config_from_options({name: value})


def test_block_longer_than_a_row_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match=r"--block-size 100000 .*--seq-len 128"):
        config_from_options({"block_size": 100000})


def test_every_option_has_a_round_trip_value() -> None:
    assert set(NON_DEFAULT) | set(NON_DEFAULT_ALONE) == set(option_map())
    for name, value in {**NON_DEFAULT, **NON_DEFAULT_ALONE}.items():
        assert value != option_map()[name].default, name


INVOCATION = sorted(o.name for o in options() if o.spec.invocation)


def without_invocation_flags(cfg: TrainConfig) -> TrainConfig:
    """`cfg` with every flag of one invocation at its default: what config.json records."""
    sections = {}
    for opt in options():
        if opt.spec.invocation:
            sections.setdefault(opt.section, {})[opt.field] = opt.default
    return dataclasses.replace(
        cfg, **{s: dataclasses.replace(getattr(cfg, s), **f) for s, f in sections.items()}
    )


def test_the_invocation_flags_are_these() -> None:
    """config.json records the run, not one invocation: a flag that says what this
    invocation does (replace or continue the run in its folder, allow what would be
    refused, show tracebacks, only estimate) is not in it."""
    assert INVOCATION == [
        "allow_data_change",
        "allow_over_memory",
        "debug",
        "dry_run",
        "overwrite",
        "resume",
    ]


ALONE = {**NON_DEFAULT, **NON_DEFAULT_ALONE}


@pytest.mark.parametrize("name", sorted(set(ALONE) - set(INVOCATION)))
def test_every_field_round_trips_through_config_json(name) -> None:
    cfg = config_from_options({name: ALONE[name], **COMPANIONS.get(name, {})})
    text = json.dumps(cfg.to_dict())  # what OUTPUT_DIR/config.json holds
    back = TrainConfig.from_dict(json.loads(text), "config.json")
    assert back == cfg
    opt = option_map()[name]
    assert getattr(getattr(back, opt.section), opt.field) == ALONE[name]


@pytest.mark.parametrize("name", INVOCATION)
def test_invocation_flags_are_not_saved_nor_read_back(name) -> None:
    opt = option_map()[name]
    saved = config_from_options({name: NON_DEFAULT[name]}).to_dict()
    assert opt.field not in saved[opt.section]
    older = {"schema_version": SCHEMA_VERSION, opt.section: {opt.field: NON_DEFAULT[name]}}
    assert TrainConfig.from_dict(older) == TrainConfig()  # an older config.json holds them
    found = read_values({name: NON_DEFAULT[name], "seed": 3}, "f.yaml")
    assert (found.values, found.left_out) == ({"seed": 3}, (name,))


def test_all_fields_at_once_round_trip() -> None:
    cfg = config_from_options(NON_DEFAULT)
    back = TrainConfig.from_dict(json.loads(json.dumps(cfg.to_dict())))
    assert back == without_invocation_flags(cfg) != TrainConfig()
    assert cfg.to_dict()["schema_version"] == SCHEMA_VERSION


def test_flat_and_sectioned_keys_mix() -> None:
    values = values_from_mapping(
        {"seq-len": 64, "loss": {"kl_weight": 0.3}, "target_layers": "1,2"}, "f.yaml"
    )
    cfg = config_from_options(values)
    assert cfg.data.seq_len == 64 and cfg.loss.kl_weight == 0.3
    assert cfg.target.layer_ids == (1, 2)


@pytest.mark.parametrize(
    ("raw", "fragments"),
    [
        ({"run": {"bogus": 1}}, ["f.json", "run.bogus"]),
        ({"objective": {"kl_weight": 0.5}}, ["f.json", "unknown section objective"]),
        ({"stepz": 3}, ["f.json", "unknown key stepz"]),
        ({"schema_version": 99, "run": {}}, ["f.json", "schema_version", "99"]),
        ({"steps": 1.5}, ["f.json", "'steps'", "1.5"]),
        ({"data": {"seq_len": True}}, ["f.json", "'seq_len'", "True"]),
        ({"target_layers": "1,x"}, ["f.json", "'target_layers'"]),
    ],
)
def test_bad_config_mappings_name_the_key_and_the_file(raw, fragments) -> None:
    with pytest.raises(ConfigError) as info:
        values_from_mapping(raw, "f.json")
    for fragment in fragments:
        assert fragment in str(info.value)


def test_gamma_defaults_follow_the_paper() -> None:
    assert config_from_options({"block_size": 16}).gamma == pytest.approx(7.0)
    assert config_from_options({"block_size": 8}).gamma == pytest.approx(4.0)
    assert config_from_options({"block_size": 10}).gamma == pytest.approx(5.0)
    assert config_from_options({"loss_decay_gamma": 2.5}).gamma == 2.5


def test_option_names_flags_and_variables_are_derived() -> None:
    opt = option_map()["profile_interval"]
    assert (opt.section, opt.field) == ("telemetry", "profile_interval_s")
    assert (opt.flag, opt.envvar) == ("--profile-interval", "DFLASH_PROFILE_INTERVAL")
    assert option_map()["trace_level"].choices == ("off", "step", "phase")
    assert all(o.spec.help.strip() for o in options())


def test_config_is_frozen() -> None:
    cfg = TrainConfig()
    with pytest.raises(AttributeError):
        cfg.run.steps = 3  # type: ignore[misc]


@pytest.mark.parametrize("name", ["output_dir", "data", "target"])
def test_a_path_that_is_not_utf8_text_is_refused(name) -> None:
    """A name with a byte that is not UTF-8 (as bash's $'\\xff' gives) would train, then
    fail writing the summary and report that quote it."""
    with pytest.raises(ConfigError, match="must be UTF-8 text"):
        config_from_options({name: "runs/ab\udcffc"})
