import pytest

from dflash.config import (
    OPTION_FIELDS,
    ConfigError,
    DataConfig,
    DrafterSettings,
    ObjectiveConfig,
    PipelineConfig,
    RunConfig,
    TelemetryConfig,
    TrainConfig,
    config_from_options,
)


@pytest.mark.parametrize(
    ("build", "flag"),
    [
        (lambda: DrafterSettings(block_size=1), "--block-size"),
        (lambda: ObjectiveConfig(num_anchors=0), "--num-anchors"),
        (lambda: ObjectiveConfig(kl_temperature=0.0), "--kl-temperature"),
        (lambda: ObjectiveConfig(kl_temperature=-1.0), "--kl-temperature"),
        (lambda: ObjectiveConfig(streak_alpha=1.5), "--streak-alpha"),
        (lambda: ObjectiveConfig(streak_alpha=-0.1), "--streak-alpha"),
        (lambda: ObjectiveConfig(kl_weight=2.0), "--kl-weight"),
        (lambda: RunConfig(steps=0), "--steps"),
        (lambda: DataConfig(batch_size=0), "--batch-size"),
        (lambda: PipelineConfig(hs_queue_size=0), "--hs-queue-size"),
        (lambda: PipelineConfig(target_devices=("gpu7",)), "--target-devices"),
        (lambda: TelemetryConfig(trace_level="verbose"), "--trace-level"),
        (lambda: TelemetryConfig(trace_sample_ratio=1.5), "--trace-sample-ratio"),
        (lambda: TelemetryConfig(profile_interval_s=0), "--profile-interval"),
    ],
)
def test_bad_values_name_the_flag_and_value(build, flag) -> None:
    with pytest.raises(ConfigError) as info:
        build()
    message = str(info.value)
    assert flag in message and "\n" not in message


def test_round_trip_through_dict() -> None:
    cfg = config_from_options(
        {"steps": 7, "target_layers": [1, 3], "drafter_devices": ["cpu", "cpu"], "kl_weight": 0.3}
    )
    data = cfg.to_dict()
    assert data["target"]["layer_ids"] == [1, 3]
    back = TrainConfig.from_dict(data)
    assert back == cfg and back.run.steps == 7 and back.pipeline.drafter_devices == ("cpu", "cpu")


def test_from_dict_rejects_unknown_keys() -> None:
    with pytest.raises(ConfigError, match="bogus"):
        TrainConfig.from_dict({"run": {"bogus": 1}})


def test_every_option_maps_to_a_real_field() -> None:
    cfg = TrainConfig()
    for section, name in OPTION_FIELDS.values():
        assert hasattr(getattr(cfg, section), name)


def test_gamma_defaults_follow_the_paper() -> None:
    assert config_from_options({"block_size": 16}).gamma == pytest.approx(7.0)
    assert config_from_options({"block_size": 8}).gamma == pytest.approx(4.0)
    assert config_from_options({"loss_decay_gamma": 2.5}).gamma == 2.5


def test_config_is_frozen() -> None:
    cfg = TrainConfig()
    with pytest.raises(AttributeError):
        cfg.run.steps = 3  # type: ignore[misc]
