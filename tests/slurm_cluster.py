"""A real two-node Slurm cluster on this machine, for the launcher tests.

`SlurmCluster` writes slurm.conf and cgroup.conf into a private temporary directory, starts a
private `munged` (as the `munge` user, its own key and socket), `slurmctld`, and two `slurmd`
daemons that act as the nodes `n1` and `n2` (`slurmd -N n1`, both on 127.0.0.1 with their own
ports, `%n` in their spool / pid / log paths), and waits until `sinfo` shows both idle. Clients
(`sbatch`, `squeue`, ...) find it through `SLURM_CONF`. `stop()` cancels the jobs still in the
queue and ends every daemon it started, by PID.

The `slurm_cluster` fixture (session scoped) skips with a visible reason where the Slurm or
munge binaries are missing, and fails instead under `CI=true`: CI installs them (.ci/run).

Run `python -m tests.slurm_cluster` to start one by hand and keep it up until Ctrl-C.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

BINARIES = ("munged", "mungekey", "slurmctld", "slurmd", "sbatch", "srun", "squeue", "scontrol")
NODE_NAMES = ("n1", "n2")
NODE_PORTS = (17001, 17002)
CTLD_PORT = 16817


def missing_binaries() -> list[str]:
    missing = [name for name in BINARIES if _which(name) is None]
    try:
        pwd.getpwnam("munge")
    except KeyError:
        missing.append("the munge user")
    return missing


def _which(name: str) -> str | None:
    # The daemons live in /usr/sbin, which a non-login PATH may lack.
    return shutil.which(name) or shutil.which(name, path="/usr/sbin:/sbin")


def _port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _pick_ports(preferred: tuple[int, ...]) -> list[int]:
    """The preferred ports where free, else free ones the OS hands out."""
    ports = []
    for port in preferred:
        if not _port_free(port):
            with socket.socket() as sock:
                sock.bind(("127.0.0.1", 0))
                port = sock.getsockname()[1]
        ports.append(port)
    return ports


class SlurmCluster:
    """slurmctld + slurmd n1 + slurmd n2 + munged, all private to one temporary directory."""

    def __init__(self, root: Path | None = None) -> None:
        self.root = Path(root or tempfile.mkdtemp(prefix="lmforge-slurm-"))
        # munged refuses to put its socket where a parent is not traversable by everyone.
        self.root.chmod(0o755)
        self.conf = self.root / "slurm.conf"
        self.jobcomp = self.root / "jobcomp.txt"
        self.logs = self.root / "log"
        self.munge_socket = self.root / "munge-run" / "munge.socket"
        self.processes: dict[str, subprocess.Popen] = {}
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}

    # ------------------------------------------------------------------------------- start
    def start(self, timeout: float = 60.0) -> SlurmCluster:
        try:
            self._start_munge()
            self._write_config()
            self._spawn("slurmctld", ["slurmctld", "-D", "-f", str(self.conf)])
            self._wait(self._controller_up, timeout, "slurmctld to answer")
            for name in NODE_NAMES:
                self._spawn(f"slurmd-{name}", ["slurmd", "-D", "-N", name, "-f", str(self.conf)])
            self._wait(self._nodes_idle, timeout, "both nodes to be idle in sinfo")
        except BaseException:
            self.stop()
            raise
        return self

    def _start_munge(self) -> None:
        keys = self.root / "munge"
        run = self.munge_socket.parent
        munge = pwd.getpwnam("munge")
        for directory, mode in ((keys, 0o700), (run, 0o755)):
            directory.mkdir()
            os.chown(directory, munge.pw_uid, munge.pw_gid)
            directory.chmod(mode)
        key = keys / "munge.key"
        subprocess.run(
            [_which("mungekey"), "--create", f"--keyfile={key}"],
            check=True,
            user=munge.pw_uid,
            group=munge.pw_gid,
            extra_groups=[],
            capture_output=True,
        )
        self._spawn(
            "munged",
            [
                "munged",
                "--foreground",
                f"--socket={self.munge_socket}",
                f"--key-file={key}",
                f"--pid-file={run / 'munged.pid'}",
                f"--log-file={keys / 'munged.log'}",
                f"--seed-file={keys / 'munged.seed'}",
            ],
            user=munge.pw_uid,
            group=munge.pw_gid,
            extra_groups=[],
        )
        self._wait(self.munge_socket.exists, 20, "munged's socket")

    def _write_config(self) -> None:
        host = socket.gethostname().split(".")[0]
        cpus = os.cpu_count() or 1
        ctld_port, *node_ports = _pick_ports((CTLD_PORT, *NODE_PORTS))
        for sub in ("state", "spool", "log"):
            (self.root / sub).mkdir(exist_ok=True)
        nodes = "\n".join(
            f"NodeName={name} NodeHostname={host} NodeAddr=127.0.0.1 Port={port} CPUs={cpus} "
            "State=UNKNOWN"
            for name, port in zip(NODE_NAMES, node_ports)
        )
        # cred_expire also sets how long a requeued job waits before it may start again (the
        # default, 120 s, would make the preemption test wait two minutes).
        self.conf.write_text(
            f"""# written by tests/slurm_cluster.py
ClusterName=lmforge-test
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={self.munge_socket},cred_expire=10
CredType=cred/munge
StateSaveLocation={self.root}/state
SlurmdSpoolDir={self.root}/spool/%n
SlurmctldPidFile={self.root}/slurmctld.pid
SlurmdPidFile={self.root}/slurmd-%n.pid
SlurmctldLogFile={self.logs}/slurmctld.log
SlurmdLogFile={self.logs}/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
JobCompType=jobcomp/filetxt
JobCompLoc={self.jobcomp}
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MpiDefault=none
ReturnToService=2
SchedulerType=sched/builtin
SchedulerParameters=sched_interval=2
KillWait=30
MinJobAge=600
InactiveLimit=0
SlurmctldTimeout=30
SlurmdTimeout=60
{nodes}
PartitionName=debug Nodes={",".join(NODE_NAMES)} Default=YES MaxTime=INFINITE State=UP
"""
        )
        (self.root / "cgroup.conf").write_text("# no cgroups: proctrack/linuxproc, task/none\n")

    def _spawn(self, name: str, argv: list[str], **popen) -> None:
        log = (self.root / f"{name}.out").open("wb")
        argv = [_which(argv[0]) or argv[0], *argv[1:]]
        self.processes[name] = subprocess.Popen(
            argv,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=self.env,
            start_new_session=True,
            **popen,
        )
        log.close()

    def _wait(self, ready, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for name, proc in self.processes.items():
                if proc.poll() is not None:
                    raise RuntimeError(
                        f"{name} exited with {proc.returncode} while waiting for {what}:\n"
                        + self.diagnostics()
                    )
            if ready():
                return
            time.sleep(0.25)
        raise RuntimeError(
            f"timed out after {timeout:.0f} s waiting for {what}:\n" + self.diagnostics()
        )

    def _controller_up(self) -> bool:
        return self.run("scontrol", "ping", check=False).returncode == 0

    def _nodes_idle(self) -> bool:
        out = self.run("sinfo", "-h", "-N", "-o", "%N %t", check=False).stdout.split()
        states = dict(zip(out[::2], out[1::2]))
        return all(states.get(name) == "idle" for name in NODE_NAMES)

    # ----------------------------------------------------------------------------- helpers
    def run(self, *argv: str, check: bool = True) -> subprocess.CompletedProcess:
        """A Slurm client command against this cluster."""
        return subprocess.run(
            [_which(argv[0]) or argv[0], *argv[1:]],
            env=self.env,
            capture_output=True,
            text=True,
            check=check,
            timeout=60,
        )

    def diagnostics(self) -> str:
        """The tail of every daemon's log, for failure messages."""
        parts = []
        for path in sorted([*self.logs.glob("*.log"), *self.root.glob("*.out")]):
            lines = path.read_text(errors="replace").splitlines()[-15:]
            parts.append(f"--- {path.name}\n" + "\n".join(lines))
        return "\n".join(parts)

    # -------------------------------------------------------------------------------- stop
    def stop(self) -> None:
        """Cancel queued jobs, then end each daemon this object started (slurmd first)."""
        if "slurmctld" in self.processes and self.processes["slurmctld"].poll() is None:
            jobs = self.run("squeue", "-h", "-o", "%i", check=False).stdout.split()
            if jobs:
                self.run("scancel", *jobs, check=False)
                deadline = time.monotonic() + 40
                while (
                    time.monotonic() < deadline
                    and self.run("squeue", "-h", "-o", "%i", check=False).stdout.split()
                ):
                    time.sleep(0.5)
        order = [n for n in self.processes if n.startswith("slurmd")] + ["slurmctld", "munged"]
        for name in order:
            proc = self.processes.pop(name, None)
            if proc is None or proc.poll() is not None:
                continue
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def __enter__(self) -> SlurmCluster:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


@pytest.fixture(scope="session")
def slurm_cluster():
    """A started `SlurmCluster`; `SLURM_CONF` points at it for the whole session."""
    missing = missing_binaries()
    if missing or os.geteuid() != 0:
        reason = (
            f"Slurm test cluster not available: missing {', '.join(missing)} "
            "(apt-get install slurmctld slurmd slurm-client munge)"
            if missing
            else "Slurm test cluster not available: starting munged as the munge user needs root"
        )
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(reason + " — CI must install them (.ci/run)", pytrace=False)
        pytest.skip(reason)
    cluster = SlurmCluster()
    previous = os.environ.get("SLURM_CONF")
    with cluster:
        os.environ["SLURM_CONF"] = str(cluster.conf)
        try:
            yield cluster
        finally:
            if previous is None:
                os.environ.pop("SLURM_CONF", None)
            else:
                os.environ["SLURM_CONF"] = previous
    shutil.rmtree(cluster.root, ignore_errors=True)


if __name__ == "__main__":
    with SlurmCluster() as up:
        print(f"export SLURM_CONF={up.conf}\n(Ctrl-C stops it)", flush=True)
        with contextlib.suppress(KeyboardInterrupt):
            signal.pause()
    shutil.rmtree(up.root, ignore_errors=True)
