"""Launchers: run pipeline stages locally (subprocesses / torchrun), on Slurm or on Kubernetes.

The interface is in `lmforge.launch.base` (StageJob, LauncherSection, Launcher, JobHandle).
"""
