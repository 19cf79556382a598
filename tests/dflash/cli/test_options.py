"""Every command's options come from `setting` declarations: a DFLASH_* variable per
option, --config files, ranges and their one-line errors, one default per concept."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import click
import pytest
from click.testing import CliRunner

from dflash import cli as cli_mod
from dflash.cli.data import REGENERATE
from dflash.cli.results import EVAL
from dflash.config.settings import RunConfig, TrainConfig, option_map
from dflash.eval.config import EvalConfig
from dflash.offline.config import RegenerateConfig
from dflash.summary import EvalRecord
from tests.dflash.test_summary import SERVED


def invoke(args: list[Any], env: dict[str, str] | None = None):
    return CliRunner().invoke(cli_mod.cli, [str(a) for a in args], env=env)


def one_error(result) -> str:
    """The one `Error:` line of a refusal (exit 2, no traceback)."""
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output, result.output
    (line,) = [line for line in result.output.splitlines() if line.startswith("Error:")]
    return line


@pytest.fixture
def calls(monkeypatch) -> list[tuple[str, tuple, dict]]:
    """The work of eval and regenerate replaced by a record of its arguments; a model
    that loads fails the test."""
    seen: list[tuple[str, tuple, dict]] = []

    def record(name: str, result: Any):
        def call(*args: Any, **kwargs: Any) -> Any:
            seen.append((name, args, kwargs))
            return result

        return call

    def no_model(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("a model loaded")

    nothing_skipped = SimpleNamespace(lines=lambda _: [])
    report = SimpleNamespace(
        skipped=nothing_skipped, resumed_from_line=0, new_tokens=0, wall_s=0.0, lines=0, output="o"
    )
    monkeypatch.setattr("dflash.target.load.load_target", no_model)
    monkeypatch.setattr("dflash.eval.evaluate.evaluate_drafter_dir", record("eval", EvalRecord()))
    monkeypatch.setattr("dflash.eval.evaluate.evaluate_server", record("server", SERVED))
    monkeypatch.setattr("dflash.run.offline.regenerate_data", record("regenerate", report))
    return seen


def eval_args(tmp_path: Path, *extra: Any) -> list[Any]:
    return ["eval", "--drafter", tmp_path, *extra]


def regenerate_args(tmp_path: Path, *extra: Any) -> list[Any]:
    return ["regenerate", "--output", tmp_path / "out.jsonl", *extra]


COMMANDS = {"eval": eval_args, "regenerate": regenerate_args}

# (command, option, a bad value as a config file holds it, why it is bad)
BAD = [
    ("eval", "max_new_tokens", 0, "must be at least 1"),
    ("eval", "temperature", -0.5, "must be at least 0"),
    ("eval", "timing_repeats", 0, "must be at least 1"),
    ("eval", "concurrency", 0, "must be at least 1"),
    ("eval", "request_timeout", 0.0, "must be > 0"),
    ("eval", "retries", -1, "must be at least 0"),
    ("eval", "eval_prompts", -1, "must be at least 0"),
    ("eval", "eval_data", "missing.jsonl", "no such file"),
    ("eval", "device", "gpu7", "expected auto, cpu"),
    ("eval", "server", "localhost:8000", "http:// or https://"),
    ("regenerate", "max_new_tokens", 0, "must be at least 1"),
    ("regenerate", "temperature", -1.0, "must be at least 0"),
    ("regenerate", "batch_size", 0, "must be at least 1"),
    ("regenerate", "chunk_lines", 0, "must be at least 1"),
    ("regenerate", "prefix_tokens", 0, "must be at least 1"),
    ("regenerate", "windows_per_document", 0, "must be at least 1"),
    ("regenerate", "stop_token_ids", [-3], "ids must be >= 0"),
    ("regenerate", "heldout_fraction", 1.5, "must be < 1"),
    ("regenerate", "concurrency", 0, "must be at least 1"),
]


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def text(value: Any) -> str:
    return ",".join(map(str, value)) if isinstance(value, list) else str(value)


@pytest.mark.parametrize(("command", "name", "value", "reason"), BAD)
def test_a_bad_variable_is_one_line_naming_it_before_any_model_loads(
    tmp_path, calls, command, name, value, reason
) -> None:
    variable = "DFLASH_" + name.upper()
    line = one_error(invoke(COMMANDS[command](tmp_path), env={variable: text(value)}))
    assert line.startswith(f"Error: {flag(name)} ") and f"(from {variable}) is invalid" in line
    assert text(value) in line and reason in line
    assert calls == []


@pytest.mark.parametrize("sectioned", [False, True], ids=["flat", "sectioned"])
@pytest.mark.parametrize(("command", "name", "value", "reason"), BAD)
def test_a_bad_config_key_is_one_line_naming_it_before_any_model_loads(
    tmp_path, calls, command, name, value, reason, sectioned
) -> None:
    own = {"eval": EVAL, "regenerate": REGENERATE}[command].own.by_name
    opt = own.get(name) or option_map()[name]  # the command's own, or one of the run's
    config = tmp_path / "c.json"
    written = {opt.section: {opt.field: value}} if sectioned else {name: value}
    config.write_text(json.dumps(written))
    line = one_error(invoke([*COMMANDS[command](tmp_path), "--config", config]))
    key = f"{opt.section}.{opt.field}" if sectioned else name
    assert line.startswith(f"Error: {flag(name)} ")
    assert f"(from config file {config}, key {key!r}) is invalid" in line and reason in line
    assert calls == []


@pytest.mark.parametrize(
    ("command", "content", "fragments"),
    [
        ("eval", "max_new_tokens: many\n", ["key 'max_new_tokens'", "expected integer"]),
        ("eval", "eval:\n  max_tokens: 3\n", ["unknown key eval.max_tokens"]),
        ("eval", "maxnewtokens: 3\n", ["unknown key maxnewtokens"]),
        ("regenerate", "stop_token_ids: [1, x]\n", ["'stop_token_ids'", "list of integer"]),
        ("regenerate", "concurrency: 2\nconcurrency-: 3\n", ["unknown key concurrency-"]),
        ("regenerate", "batch_size: 2\nregenerate:\n  batch_size: 3\n", ["set twice"]),
    ],
)
def test_bad_config_files_of_eval_and_regenerate(tmp_path, calls, command, content, fragments):
    config = tmp_path / "c.yaml"
    config.write_text(content)
    line = one_error(invoke([*COMMANDS[command](tmp_path), "--config", config]))
    assert str(config) in line and all(f in line for f in fragments), line
    assert calls == []


def test_a_bad_variable_of_another_type_is_clicks_one_line(tmp_path, calls) -> None:
    line = one_error(invoke(eval_args(tmp_path), env={"DFLASH_MAX_NEW_TOKENS": "many"}))
    assert "'--max-new-tokens' (env var: 'DFLASH_MAX_NEW_TOKENS')" in line and "many" in line
    line = one_error(invoke(regenerate_args(tmp_path), env={"DFLASH_BATCH_SIZE": "x"}))
    assert "DFLASH_BATCH_SIZE" in line
    assert calls == []


def _decoding(calls: list) -> EvalConfig:
    ((_, args, _),) = calls
    return args[2]


def test_eval_precedence_flag_over_variable_over_file_over_default(tmp_path, calls) -> None:
    config = tmp_path / "c.yaml"
    config.write_text("max_new_tokens: 11\ntemperature: 0.5\neval:\n  timing_repeats: 3\nseed: 4\n")
    env = {"DFLASH_MAX_NEW_TOKENS": "22", "DFLASH_TEMPERATURE": "0.25"}
    args = eval_args(tmp_path, "--config", config, "--max-new-tokens", 33)
    assert invoke(args, env=env).exit_code == 0
    decoding = _decoding(calls)
    assert decoding.max_new_tokens == 33  # flag
    assert decoding.temperature == 0.25  # variable over file
    assert decoding.timing_repeats == 3 and decoding.seed == 4  # file over default
    assert decoding.draft_sampling == EvalConfig().draft_sampling


def test_eval_measures_as_many_tokens_as_a_run_ends_with_by_default(tmp_path, calls) -> None:
    """One default for one concept: `eval` of a run's drafter, left at its defaults,
    decodes the prompts as the run's own final evaluation did (its summary.json's τ)."""
    assert invoke(eval_args(tmp_path)).exit_code == 0
    decoding, run = _decoding(calls), TrainConfig().run
    assert decoding.max_new_tokens == run.eval_new_tokens == RunConfig.eval_new_tokens
    assert (decoding.num_prompts, decoding.prompt_tokens) == (run.eval_prompts, 64)
    help_text = invoke(["eval", "--help"]).output
    assert "DFLASH_MAX_NEW_TOKENS" in help_text and "--config" in help_text


def test_eval_reads_a_runs_config_json(tmp_path, calls) -> None:
    """A run's config.json gives eval its prompts (data, count, length, seed); its other
    keys are checked and not used, its invocation flags left out with one line."""
    cfg = TrainConfig.from_dict({"data": "corpus.txt", "eval_prompts": 3, "seed": 9, "lr": 0.1})
    saved = {**cfg.to_dict(), "run": {**cfg.to_dict()["run"], "overwrite": True}}
    config = tmp_path / "config.json"
    config.write_text(json.dumps(saved))
    result = invoke(eval_args(tmp_path, "--config", config))
    assert result.exit_code == 0, result.output
    assert f"config file {config}: left out --overwrite: flags of one invocation" in result.output
    decoding = _decoding(calls)
    assert (decoding.data, decoding.num_prompts, decoding.seed) == ("corpus.txt", 3, 9)


def test_regenerate_settings_from_flags_variables_and_file(tmp_path, calls) -> None:
    """regenerate's --batch-size is its own (prompts decoded together); the run's
    `data: {batch_size: ...}` of a train config is not it."""
    config = tmp_path / "c.yaml"
    config.write_text(
        "data:\n  batch_size: 99\n  heldout_fraction: 0.2\nchunk_lines: 8\n"
        "regenerate:\n  prefix_tokens: 5\nserver_model: m\n"
    )
    env = {"DFLASH_BATCH_SIZE": "3", "DFLASH_STOP_TOKEN_IDS": "1,2"}
    args = regenerate_args(tmp_path, "--config", config, "--seed", 7, "--server", "http://h:1")
    result = invoke(args, env=env)
    assert result.exit_code == 0, result.output
    ((_, args_, kwargs),) = calls
    settings: RegenerateConfig = args_[4]
    assert (settings.batch_size, settings.stop_token_ids, settings.chunk_lines) == (3, (1, 2), 8)
    assert (settings.prefix_tokens, settings.seed, settings.heldout_fraction) == (5, 7, 0.2)
    assert settings.max_new_tokens == RegenerateConfig().max_new_tokens
    server = kwargs["server"]
    assert (server.url, server.model, server.concurrency) == ("http://h:1", "m", 8)


def test_a_required_option_may_come_from_a_file_or_a_variable(tmp_path, calls) -> None:
    config = tmp_path / "c.yaml"
    config.write_text(f"output: {tmp_path / 'from-file.jsonl'}\n")
    assert invoke(["regenerate", "--config", config]).exit_code == 0
    env = {"DFLASH_OUTPUT": str(tmp_path / "from-env.jsonl")}
    assert invoke(["regenerate"], env=env).exit_code == 0
    outputs = [args[3] for _, args, _ in calls]
    assert outputs == [str(tmp_path / "from-file.jsonl"), str(tmp_path / "from-env.jsonl")]
    result = invoke(["regenerate"])
    assert result.exit_code == 2 and "Missing option '--output'" in result.output


def test_every_option_of_every_command_is_a_declared_setting() -> None:
    """Each command's options, --config aside: a flag, a DFLASH_* variable shown in
    --help, and help text that gives the default (or says the option is required)."""
    group = cli_mod.cli
    assert isinstance(group, click.Group)
    for name, command in group.commands.items():
        params = [p for p in command.params if isinstance(p, click.Option)]
        declared = [p for p in params if p.name not in ("config_file", "help")]
        assert declared, name
        for param in declared:
            assert param.envvar == "DFLASH_" + str(param.name).upper(), (name, param.name)
            assert param.show_envvar and param.help, (name, param.name)
            assert "(default: " in param.help or "(required)" in param.help, (name, param.name)
        if name != "report":  # its one input is an argument
            assert "config_file" in {p.name for p in params}, name
        result = invoke([name, "--help"])
        assert result.exit_code == 0 and "Traceback" not in result.output, name


@pytest.mark.parametrize("command", ["eval", "regenerate"])
def test_an_output_onto_the_config_file_is_refused(tmp_path, calls, command) -> None:
    config = tmp_path / "c.yaml"
    config.write_text("seed: 1\n")
    if command == "eval":
        args = eval_args(tmp_path, "--json", config)
    else:
        args = ["regenerate", "--output", config]
    line = one_error(invoke([*args, "--config", config]))
    assert f"is --config {str(config)!r}: an output never replaces an input" in line
    assert config.read_text() == "seed: 1\n" and calls == []
