"""DeepSpeed's monitors: tensorboard, csv_monitor, wandb and comet, written on rank 0 with DeepSpeed's event names
and files, so that dashboards built on a DeepSpeed run keep working.

    python -m pytest tests/engine/test_reporting.py -q

Events are (name, value, samples): "Train/Samples/train_loss" (the mean loss of the accumulation), "Train/Samples/lr"
(param group 0's), "Train/Samples/loss_scale" (fp16), and with wall_clock_breakdown the phase times
("Train/Samples/elapsed_time_ms_forward", ..._backward, ..._step), at the optimizer step, against the number of
samples trained so far (global_steps x train_batch_size), as DeepSpeed's engine writes them. A monitor whose package
is missing is a ConfigError naming it, raised when the engine is built.
"""

from __future__ import annotations

import csv
import importlib
import os

from zkern.config import ConfigError, MonitorConfig


def _log_dir(section: dict) -> str:
    return os.path.join(section.get("output_path") or "", section.get("job_name") or "DeepSpeedJobName")


def _require(package: str, section: str):
    try:
        return importlib.import_module(package)
    except ImportError as e:
        raise ConfigError(f"'{section}.enabled' is true, but the package {package!r} does not import ({e}); "
                          f"install it (pip install {package.replace('_', '-')}) or turn the monitor off") from None


class CsvMonitor:
    """One CSV file per event in output_path/job_name: a 'step,<last part of the name>' header, then a row per event."""

    def __init__(self, section: dict):
        self.dir = _log_dir(section)
        os.makedirs(self.dir, exist_ok=True)
        self.started: set[str] = set()

    def write(self, events: list[tuple[str, float, int]]) -> None:
        for name, value, step in events:
            filename = name.replace("/", "_").replace(" ", "_")
            with open(os.path.join(self.dir, f"{filename}.csv"), "a", newline="") as f:
                writer = csv.writer(f)
                if filename not in self.started:
                    self.started.add(filename)
                    writer.writerow(["step", name.rsplit("/", 1)[-1]])
                writer.writerow([step, value])

    def close(self) -> None:
        pass


class TensorBoardMonitor:
    def __init__(self, section: dict):
        _require("tensorboard", "tensorboard")
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=_log_dir(section))

    def write(self, events: list[tuple[str, float, int]]) -> None:
        for name, value, step in events:
            self.writer.add_scalar(name, value, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbMonitor:
    def __init__(self, section: dict):
        self.wandb = _require("wandb", "wandb")
        self.wandb.init(project=section.get("project"), group=section.get("group"), entity=section.get("team"))

    def write(self, events: list[tuple[str, float, int]]) -> None:
        for name, value, step in events:
            self.wandb.log({name: value}, step=step)

    def close(self) -> None:
        pass


class CometMonitor:
    def __init__(self, section: dict):
        comet = _require("comet_ml", "comet")
        options = {k: section.get(k) for k in ("api_key", "project", "workspace", "experiment_key", "online", "mode")
                   if section.get(k) is not None}
        self.experiment = comet.start(**options)
        if section.get("experiment_name"):
            self.experiment.set_name(section["experiment_name"])
        self.every = section.get("samples_log_interval", 100)

    def write(self, events: list[tuple[str, float, int]]) -> None:
        for name, value, step in events:
            if step % self.every == 0:
                self.experiment.log_metric(name, value, step=step)

    def close(self) -> None:
        pass


class Monitors:
    """Every enabled monitor (rank 0 only: the others hold none)."""

    def __init__(self, cfg: MonitorConfig, rank: int):
        kinds = {"tensorboard": TensorBoardMonitor, "csv_monitor": CsvMonitor, "wandb": WandbMonitor,
                 "comet": CometMonitor}
        packages = {"tensorboard": "tensorboard", "wandb": "wandb", "comet": "comet_ml"}
        for name, package in packages.items():  # every rank: a missing package fails the build on all of them
            if getattr(cfg, name):
                _require(package, name)
        self.monitors = [cls(getattr(cfg, name)) for name, cls in kinds.items() if getattr(cfg, name)] \
            if rank == 0 else []

    @property
    def enabled(self) -> bool:
        return bool(self.monitors)

    def write(self, events: list[tuple[str, float, int]]) -> None:
        for monitor in self.monitors:
            monitor.write(events)

    def close(self) -> None:
        for monitor in self.monitors:
            monitor.close()
