"""Every output path of every command is checked before any work: one `Error:` line (the
line alone) naming it and what it clashes with, and nothing of an earlier run changed."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from dflash import cli as cli_mod
from dflash.cli.options import write_json
from tests.dflash.app_fixtures import small_options, tiny_target  # noqa: F401 - fixture
from tests.dflash.run.test_outputs import make_run

LONG = "x" * 300  # one path component longer than any file system allows


def invoke(args: list[str], env: dict[str, str] | None = None):
    return CliRunner().invoke(cli_mod.cli, [str(a) for a in args], env=env, catch_exceptions=False)


def refused(result) -> str:
    """The one line of a refusal (exit 2, nothing else on the way)."""
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    (line,) = result.output.strip().splitlines()
    assert line.startswith("Error: "), line
    return line


def state(folder: Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def train_args(tmp_path: Path, output_dir: Path, *extra: object) -> list[object]:
    options = small_options(tmp_path, output_dir)
    args: list[object] = ["train"]
    for key, value in options.items():
        args += ["--" + key.replace("_", "-"), value]
    return [*args, *extra]


@pytest.fixture
def run(tmp_path: Path) -> Path:
    return make_run(tmp_path / "done")


def test_eval_json_onto_the_drafters_config_is_refused_and_the_drafter_kept(tmp_path, run) -> None:
    drafter = run / "drafter"
    before = state(run)
    line = refused(invoke(["eval", "--drafter", drafter, "--json", drafter / "config.json"]))
    assert line == (
        f"Error: --json {str(drafter / 'config.json')!r} is inside --drafter {str(drafter)!r}: "
        "an output never writes into an input"
    )
    line = refused(invoke(["eval", "--drafter", drafter, "--json", run / "summary.json"]))
    assert f"is summary.json of the run in {str(run)!r}" in line
    assert state(run) == before


@pytest.mark.usefixtures("tiny_target")
def test_trace_file_and_timeline_onto_run_files_are_refused(tmp_path, run) -> None:
    before = state(run)
    other = train_args(tmp_path, tmp_path / "new", "--trace-file", run / "metrics.jsonl")
    assert f"is metrics.jsonl of the run in {str(run)!r}" in refused(invoke(other))
    other = train_args(tmp_path, tmp_path / "new", "--timeline", run / "timeline.json")
    assert f"is timeline.json of the run in {str(run)!r}" in refused(invoke(other))
    own = train_args(tmp_path, run, "--resume", "latest", "--trace-file", run / "metrics.jsonl")
    assert "is metrics.jsonl of this run's --output-dir" in refused(invoke(own))
    assert state(run) == before
    assert not (tmp_path / "new").exists()


@pytest.mark.usefixtures("tiny_target")
def test_an_output_dir_inside_another_run_is_refused_by_link_too(tmp_path, run) -> None:
    (tmp_path / "link").symlink_to(run / "checkpoints")
    before = state(run)
    for inside in (run / "checkpoints" / "new", tmp_path / "link" / "new"):
        line = refused(invoke(train_args(tmp_path, inside)))
        assert line.startswith(f"Error: --output-dir {str(inside)!r} is inside the run in ")
    assert state(run) == before
    assert not (run / "checkpoints" / "new").exists()


def test_offline_outputs_equal_to_an_input_or_a_run_are_refused(tmp_path, run) -> None:
    data = tmp_path / "corpus.txt"
    data.write_text("def f(x):\n    return x + 1\n")
    line = refused(invoke(["regenerate", "--data", data, "--output", data]))
    assert line == (
        f"Error: --output {str(data)!r} is --data {str(data)!r}: an output never replaces an input"
    )
    assert data.read_text() == "def f(x):\n    return x + 1\n"
    before = state(run)
    line = refused(invoke(["cache-hidden", "--data", data, "--output", run]))
    assert "holds a training run" in line
    drafter = run / "drafter"
    assert "is --drafter" in refused(invoke(["export", "--drafter", drafter, "--output", drafter]))
    inside = drafter / "exported"
    assert "is inside --drafter" in refused(
        invoke(["export", "--drafter", drafter, "--output", inside])
    )
    assert state(run) == before


@pytest.mark.skipif(os.geteuid() != 0, reason="as root, every permission check says yes")
@pytest.mark.usefixtures("tiny_target")
def test_as_root_proc_is_refused_before_any_work_for_every_output(tmp_path, run) -> None:
    data = tmp_path / "corpus.txt"
    data.write_text("text\n")
    cases = [
        (["eval", "--drafter", run / "drafter", "--json", "/proc/e.json"], "--json"),
        (["regenerate", "--data", data, "--output", "/proc/r.jsonl"], "--output"),
        (["cache-hidden", "--data", data, "--output", "/proc/cache"], "--output"),
        (["export", "--drafter", run / "drafter", "--output", "/proc/d"], "--output"),
        (train_args(tmp_path, tmp_path / "new", "--trace-file", "/proc/t.json"), "--trace-file"),
        (train_args(tmp_path, tmp_path / "new", "--output-dir", "/proc/run"), "--output-dir"),
    ]
    for args, flag in cases:
        line = refused(invoke(args))
        assert line.startswith(f"Error: {flag} '/proc/"), line
        assert "No such file or directory" in line, line
    line = refused(invoke(train_args(tmp_path, tmp_path / "new"), {"DFLASH_CACHE_DIR": "/proc/c"}))
    assert line.startswith("Error: DFLASH_CACHE_DIR '/proc/c' cannot be written: /proc takes no")


@pytest.mark.usefixtures("tiny_target")
def test_a_name_over_255_bytes_is_one_line_for_every_output(tmp_path, run) -> None:
    data = tmp_path / "corpus.txt"
    data.write_text("text\n")
    long = tmp_path / LONG / "out.json"
    cases = [
        (["regenerate", "--data", data, "--output", long], "--output"),
        (["eval", "--drafter", run / "drafter", "--json", long], "--json"),
        (train_args(tmp_path, tmp_path / "new", "--trace-file", long), "--trace-file"),
    ]
    for args, flag in cases:
        line = refused(invoke(args))
        assert line == (
            f"Error: {flag} {str(long)!r} cannot be written: a path component is 300 bytes "
            "long, more than the 255 a name may have"
        )


def test_figures_that_cannot_be_written_after_all_go_to_standard_output(tmp_path, capsys) -> None:
    """A full disk after minutes of evaluation: the figures are not lost with the file."""
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    with pytest.raises(click.ClickException) as failed:
        write_json(str(blocker / "figures.json"), {"tau": 3.5})
    assert json.loads(capsys.readouterr().out) == {"tau": 3.5}
    assert failed.value.exit_code == 2
    assert failed.value.message.startswith(f"--json: could not write {blocker / 'figures.json'}")
    write_json(str(tmp_path / "ok.json"), {"tau": 3.5})
    assert json.loads((tmp_path / "ok.json").read_text()) == {"tau": 3.5}


@pytest.fixture
def overwritten_run(tmp_path: Path) -> tuple[Path, Path]:
    """(A, B): A a run started with --overwrite, B another finished run."""
    first, second = tmp_path / "a", tmp_path / "b"
    for folder, *extra in ((first, "--overwrite"), (second,)):
        result = invoke(train_args(tmp_path, folder, *extra))
        assert result.exit_code == 0, result.output
    return first, second


@pytest.mark.usefixtures("tiny_target")
def test_the_config_of_an_overwriting_run_does_not_overwrite_another(overwritten_run) -> None:
    """config.json records the run, not the invocation: reusing it for another folder
    is refused there as a run without --overwrite is, and that folder stays as it was."""
    first, second = overwritten_run
    saved = json.loads((first / "config.json").read_text())
    assert "overwrite" not in saved["run"] and "resume" not in saved["run"]
    before = state(second)
    line = refused(invoke(["train", "--config", first / "config.json", "--output-dir", second]))
    assert line.startswith(f"Error: --output-dir {str(second)!r} holds an earlier run (")
    assert state(second) == before


@pytest.mark.usefixtures("tiny_target")
def test_an_older_config_with_invocation_flags_leaves_them_out_in_one_line(
    tmp_path, overwritten_run
) -> None:
    first, second = overwritten_run
    older = json.loads((first / "config.json").read_text())
    older["run"].update(overwrite=True, resume="latest", debug=True)  # as configs were saved
    config = tmp_path / "older.json"
    config.write_text(json.dumps(older))
    before = state(second)
    result = invoke(["train", "--config", config, "--output-dir", second])
    assert result.exit_code == 2, result.output
    note, error = result.output.strip().splitlines()
    assert note == (
        f"config file {config}: left out --overwrite, --resume, --debug: flags of one "
        "invocation are not read from a file (give them on the command line)"
    )
    assert error.startswith(f"Error: --output-dir {str(second)!r} holds an earlier run (")
    assert state(second) == before
    flat = tmp_path / "flat.yaml"
    flat.write_text(f"overwrite: true\noutput_dir: {second}\n")
    result = invoke(["train", *train_args(tmp_path, second)[1:], "--config", flat])
    assert result.output.splitlines()[0] == (
        f"config file {flat}: left out --overwrite: flags of one invocation are not read "
        "from a file (give them on the command line)"
    )
    assert result.exit_code == 2 and state(second) == before
