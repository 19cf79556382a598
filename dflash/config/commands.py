"""The settings of the commands besides `train` that no library component owns.

Declared as the training run's are (`setting`), so each option has its flag, its
`DFLASH_<OPTION>` variable, its config-file key and its range from one line. The
sections of `eval` and `regenerate` that their components read live with them
(dflash.eval.config, dflash.offline.config); a command's options are the sections it
names plus the run's options it shares (dflash.cli).
"""

from __future__ import annotations

from dataclasses import dataclass

from dflash.config import checks
from dflash.config.schema import Section, setting


@dataclass(frozen=True)
class ServerConfig(Section):
    """An OpenAI-compatible server that runs the target (`eval --server`,
    `regenerate --server`); requests in flight are each command's own (--concurrency)."""

    server: str | None = setting(
        None,
        "An OpenAI-compatible server (vLLM, SGLang, llama.cpp's llama-server) that serves the "
        "target, e.g. http://localhost:8000.",
        check=checks.http_url,
    )
    request_timeout: float = setting(
        600.0, "With --server: seconds a request may take before it is retried.", gt=0.0
    )
    retries: int = setting(
        5, "With --server: retries of a failed request (waits 1 s, doubling).", min=0
    )
    server_model: str | None = setting(
        None, "With --server: the served model to use (unset: the only one served)."
    )


@dataclass(frozen=True)
class DeviceConfig(Section):
    """The one device of a command that runs its models outside the training pipeline."""

    device: str = setting(
        "auto",
        "Device of the models (cpu, cuda:0, ...); auto picks cuda:0 when present, else cpu.",
        check=checks.one_device,
    )


@dataclass(frozen=True)
class InspectDataConfig(Section):
    """What `dflash-train inspect-data` shows of the training rows."""

    rows: int = setting(3, "Training rows to print.", min=0)
    json: str | None = setting(
        None,
        'Also write every training document as a JSON list of {"text", "tokens", "loss_mask"}.',
        check=checks.not_blank,
    )


@dataclass(frozen=True)
class ExportConfig(Section):
    """`dflash-train export`: an older run's drafter into the standard DFlash format."""

    drafter: str = setting(
        None,
        "Drafter directory in the first dflash-train layout (runs before the DFlash format).",
        check=checks.existing_folder,
    )
    output: str = setting(
        None,
        "Directory for the standard DFlash checkpoint (config.json, model.safetensors).",
        check=checks.not_blank,
    )
    num_target_layers: int | None = setting(
        None,
        "Decoder layers of the drafter's target; unset loads the target (CPU) to count them.",
        min=1,
    )
