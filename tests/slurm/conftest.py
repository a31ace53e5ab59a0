"""The dev Slurm cluster (slurm/dev-cluster/up.sh) for tests that submit real jobs.

Fixtures:
  * `slurm_cluster` (session): a `SlurmCluster` for the running dev cluster. When the cluster cannot be reached
    (no config, `sinfo` fails, a node is not up) the test is skipped, or fails if MOE_SLURM_REQUIRED=1 (CI).
  * `slurm` (function): the same object; jobs the test submitted that are still queued or running when the test ends
    are cancelled, so a failed test leaves no job holding the nodes.

The cluster is found through SLURM_CONF, else `$MOE_SLURM_DIR/env.sh` (default /tmp/moe-slurm), else
/tmp/moe-slurm/slurm.conf. Every Slurm client call is bounded in time.
"""

from __future__ import annotations

import os
import re
import shlex
import socket
import subprocess
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

import pytest

DEFAULT_DIR = "/tmp/moe-slurm"
SKIP_REASON = "no dev Slurm cluster: run `bash slurm/dev-cluster/up.sh`"
NODES = ("node1", "node2")
# A node in one of these states can run jobs (sinfo's short names; "*" = not responding is not among them).
UP_STATES = {"idle", "alloc", "mix", "comp"}
# States a job does not leave by itself (a waiting helper stops there instead of running into its timeout).
FINAL_STATES = {
    "COMPLETED",
    "FAILED",
    "CANCELLED",
    "TIMEOUT",
    "NODE_FAIL",
    "OUT_OF_MEMORY",
    "BOOT_FAIL",
    "DEADLINE",
}
CLIENT_TIMEOUT = 30  # seconds for any one Slurm client command


def find_slurm_conf() -> str | None:
    """SLURM_CONF, else the one `$MOE_SLURM_DIR/env.sh` exports, else the default state directory's slurm.conf."""
    if os.environ.get("SLURM_CONF"):
        return os.environ["SLURM_CONF"]
    state_dir = Path(os.environ.get("MOE_SLURM_DIR", DEFAULT_DIR))
    env_sh = state_dir / "env.sh"
    if env_sh.is_file():
        match = re.search(r"^export SLURM_CONF=(.+)$", env_sh.read_text(), re.MULTILINE)
        if match:
            return shlex.split(match.group(1))[0]
    conf = Path(DEFAULT_DIR) / "slurm.conf"
    return str(conf) if conf.is_file() else None


def controller_address(slurm_conf: str) -> tuple[str, int] | None:
    """Where slurmctld listens (SlurmctldHost's address, SlurmctldPort), when slurm.conf says so plainly."""
    text = Path(slurm_conf).read_text(errors="replace")
    host = re.search(r"^\s*SlurmctldHost=([^\s#]+)", text, re.MULTILINE | re.IGNORECASE)
    port = re.search(r"^\s*SlurmctldPort=(\d+)", text, re.MULTILINE | re.IGNORECASE)
    if host is None:
        return None
    name = host.group(1)
    addr = name[name.index("(") + 1 : name.rindex(")")] if "(" in name and name.endswith(")") else name
    return addr, int(port.group(1)) if port else 6817


def _one_line(text: str, limit: int = 300) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _tail(path: str | Path, lines: int = 20) -> str:
    try:
        return "\n".join(Path(path).read_text(errors="replace").splitlines()[-lines:])
    except OSError as err:
        return f"({err.strerror})"


class SlurmCluster:
    """Slurm clients bound to one cluster config, with job helpers for tests."""

    def __init__(self, slurm_conf: str) -> None:
        self.slurm_conf = slurm_conf
        # The environment to run Slurm clients (and, through sbatch's default --export=ALL, jobs) with.
        self.env = {**os.environ, "SLURM_CONF": slurm_conf}
        self.submitted: list[str] = []
        self._outputs: dict[str, tuple[str, ...]] = {}  # job id -> its stdout/stderr paths, known at submit time

    # ------------------------------------------------------------------------------------------------ clients
    def run(
        self, *cmd: str, check: bool = True, timeout: float = CLIENT_TIMEOUT, **kwargs
    ) -> subprocess.CompletedProcess:
        """Runs a Slurm client command with the cluster's environment; fails the test when it fails (check)."""
        env = kwargs.pop("env", None) or self.env
        try:
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, **kwargs)
        except subprocess.TimeoutExpired:
            pytest.fail(f"`{shlex.join(cmd)}` did not return within {timeout} s", pytrace=False)
        if check and proc.returncode != 0:
            pytest.fail(
                f"`{shlex.join(cmd)}` exited {proc.returncode}: {_one_line(proc.stderr or proc.stdout)}", pytrace=False
            )
        return proc

    def probe(self) -> str | None:
        """None when both nodes are up, else why not (one line)."""
        if not Path(self.slurm_conf).is_file():
            return f"SLURM_CONF={self.slurm_conf} does not exist"
        # sinfo retries for ~9 s when slurmctld is down; a refused connection says so at once.
        address = controller_address(self.slurm_conf)
        if address is not None:
            try:
                socket.create_connection(address, timeout=5).close()
            except OSError as err:
                return f"slurmctld does not answer on {address[0]}:{address[1]} ({err.strerror or err})"
        try:
            proc = subprocess.run(
                ["sinfo", "-h", "-N", "-o", "%N %t"], env=self.env, capture_output=True, text=True, timeout=30
            )
        except FileNotFoundError:
            return "sinfo is not installed"
        except subprocess.TimeoutExpired:
            return "sinfo did not answer within 30 s"
        if proc.returncode != 0:
            return f"sinfo failed: {_one_line(proc.stderr or proc.stdout)}"
        states = dict(line.split(None, 1) for line in proc.stdout.splitlines() if " " in line)
        bad = {node: states.get(node, "not listed") for node in NODES if states.get(node) not in UP_STATES}
        if bad:
            return "node(s) not up: " + ", ".join(f"{node} {state}" for node, state in bad.items())
        return None

    # ------------------------------------------------------------------------------------------------ jobs
    def submit(
        self,
        script_path: str | Path,
        *sbatch_args: str,
        env: dict[str, str] | None = None,
        cwd: str | Path | None = None,
    ) -> str:
        """`sbatch --parsable [sbatch_args] script_path`; returns the job id. The job's working directory (and so
        where relative --output paths and the default slurm-<id>.out land) is `cwd`, by default the script's
        directory. `env` adds variables to the submitting environment, which the job inherits."""
        script_path = Path(script_path).resolve()
        run_env = {**self.env, **(env or {})}
        proc = self.run(
            "sbatch", "--parsable", *sbatch_args, str(script_path), env=run_env, cwd=str(cwd or script_path.parent)
        )
        job_id = proc.stdout.strip().split(";")[0]
        assert job_id.isdigit(), f"sbatch printed {proc.stdout!r}"
        self.submitted.append(job_id)
        info = self._scontrol_job(job_id)
        if info:
            self._outputs[job_id] = tuple(dict.fromkeys(p for p in (info.get("StdOut"), info.get("StdErr")) if p))
        return job_id

    def _scontrol_job(self, job_id: str) -> dict[str, str] | None:
        """`scontrol show job -o` as a dict, or None once the job has left slurmctld's memory (MinJobAge)."""
        proc = self.run("scontrol", "show", "job", "-o", job_id, check=False)
        if proc.returncode != 0 or "JobId=" not in proc.stdout:
            return None
        fields: dict[str, str] = {}
        key = None
        for token in proc.stdout.strip().split(" "):
            name, sep, value = token.partition("=")
            if sep and re.fullmatch(r"[A-Za-z][A-Za-z0-9_:/]*", name):
                key = name
                fields[key] = value
            elif key is not None:  # a value with blanks in it
                fields[key] += " " + token
        return fields

    def sacct_state(self, job_id: str) -> str:
        """The job's state in accounting (`sacct -j <id> -X -n -P --format=State`): e.g. "COMPLETED",
        "CANCELLED by 0" (the canceller's uid), "" while slurmdbd has no record of it yet."""
        proc = self.run("sacct", "-j", job_id, "-X", "-n", "-P", "--format=State")
        lines = proc.stdout.strip().splitlines()
        return lines[-1].strip() if lines else ""

    def job_state(self, job_id: str) -> str:
        """The job's state: slurmctld's (scontrol) while it knows the job, then accounting's (sacct), first word
        only ("CANCELLED", not "CANCELLED by 0"); "UNKNOWN" when neither knows it yet."""
        info = self._scontrol_job(job_id)
        state = info.get("JobState", "") if info else self.sacct_state(job_id)
        return state.split()[0] if state else "UNKNOWN"

    def job_info(self, job_id: str) -> dict:
        """What Slurm knows about the job. Always: state, restarts (int, None from sacct), nodes (list), exit_code
        ("0:0"), source ("scontrol" or "sacct"); plus scontrol's or sacct's raw fields."""
        info = self._scontrol_job(job_id)
        if info is not None:
            nodelist = info.get("NodeList", "")
            nodes = []
            if nodelist and nodelist != "(null)":
                nodes = self.run("scontrol", "show", "hostnames", nodelist).stdout.split()
            return {
                **info,
                "state": info.get("JobState", "UNKNOWN"),
                "restarts": int(info.get("Restarts", "0")),
                "nodes": nodes,
                "exit_code": info.get("ExitCode", ""),
                "source": "scontrol",
            }
        fmt = ["JobID", "State", "ExitCode", "NodeList", "Start", "End", "Elapsed"]
        proc = self.run("sacct", "-j", job_id, "-X", "-n", "-P", "--format=" + ",".join(fmt))
        lines = proc.stdout.strip().splitlines()
        row = dict(zip(fmt, lines[-1].split("|"), strict=False)) if lines else {}
        nodelist = row.get("NodeList", "")
        nodes = []
        if nodelist and nodelist != "None assigned":
            nodes = self.run("scontrol", "show", "hostnames", nodelist).stdout.split()
        state = row.get("State", "")
        return {
            **row,
            "state": state.split()[0] if state else "UNKNOWN",
            "restarts": None,
            "nodes": nodes,
            "exit_code": row.get("ExitCode", ""),
            "source": "sacct",
        }

    def wait_for_state(self, job_id: str, states: str | Iterable[str], timeout: float) -> str:
        """Polls until the job is in one of `states` and returns that state. Fails the test, with the job's state
        and the tail of its output files, on timeout or when the job ends in a final state not in `states`."""
        wanted = {states} if isinstance(states, str) else set(states)
        deadline = time.monotonic() + timeout
        while True:
            state = self.job_state(job_id)
            if state in wanted:
                return state
            if state in FINAL_STATES:
                self._fail(job_id, f"ended {state}, not {'/'.join(sorted(wanted))}")
            if time.monotonic() >= deadline:
                self._fail(job_id, f"still {state} after {timeout:g} s (waiting for {'/'.join(sorted(wanted))})")
            time.sleep(0.2)

    def output_tail(self, job_id: str, lines: int = 20) -> str:
        paths = self._outputs.get(job_id, ())
        return "\n".join(f"--- {path} (last {lines} lines):\n{_tail(path, lines)}" for path in paths) or "(no output)"

    def _fail(self, job_id: str, what: str) -> None:
        info = self.job_info(job_id)
        details = ", ".join(f"{k}={info.get(k)}" for k in ("Reason", "nodes", "restarts", "exit_code") if k in info)
        pytest.fail(f"Slurm job {job_id} {what} ({details})\n{self.output_tail(job_id)}", pytrace=False)

    def cancel_active(self, job_ids: Iterable[str]) -> None:
        """Cancels those of the jobs that are still queued or running."""
        active = [j for j in job_ids if self.job_state(j) not in FINAL_STATES | {"UNKNOWN"}]
        if active:
            self.run("scancel", *active, check=False)


@pytest.fixture(scope="session")
def slurm_cluster() -> Iterator[SlurmCluster]:
    conf = find_slurm_conf()
    why = "no SLURM_CONF, no $MOE_SLURM_DIR/env.sh, no /tmp/moe-slurm/slurm.conf" if conf is None else None
    cluster = SlurmCluster(conf) if conf else None
    if cluster is not None:
        why = cluster.probe()
    if why is not None:
        if os.environ.get("MOE_SLURM_REQUIRED") == "1":
            pytest.fail(f"MOE_SLURM_REQUIRED=1 but the dev Slurm cluster is not reachable: {why}", pytrace=False)
        pytest.skip(f"{SKIP_REASON} ({why})")
    assert cluster is not None
    yield cluster
    cluster.cancel_active(cluster.submitted)


@pytest.fixture
def slurm(slurm_cluster: SlurmCluster) -> Iterator[SlurmCluster]:
    """`slurm_cluster`, cancelling on teardown the jobs this test submitted that are still queued or running."""
    first = len(slurm_cluster.submitted)
    yield slurm_cluster
    slurm_cluster.cancel_active(slurm_cluster.submitted[first:])
