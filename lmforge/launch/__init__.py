"""Launchers: run pipeline stages locally (subprocesses / torchrun), on Slurm or on Kubernetes.

The interface is in `lmforge.launch.base` (StageJob, LauncherSection, Launcher, JobHandle);
`make_launcher` picks one by the name a pipeline run or a stage's manifest gives.
"""

from __future__ import annotations

from typing import Any

from lmforge.errors import ConfigError
from lmforge.launch.base import Launcher
from lmforge.launch.k8s import K8sLauncher
from lmforge.launch.local import LocalLauncher
from lmforge.launch.slurm import SlurmLauncher

LAUNCHERS: dict[str, type[Launcher]] = {
    "local": LocalLauncher,
    "slurm": SlurmLauncher,
    "k8s": K8sLauncher,
}


def make_launcher(name: str, **options: Any) -> Launcher:
    """The launcher called `name` (local, slurm, k8s), built with keyword `options`."""
    if name not in LAUNCHERS:
        raise ConfigError(f"unknown launcher {name!r}; expected one of {', '.join(LAUNCHERS)}")
    return LAUNCHERS[name](**options)


__all__ = ["LAUNCHERS", "make_launcher"]
