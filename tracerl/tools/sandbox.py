"""Run untrusted Python source in a throwaway bubblewrap sandbox: the code-execution tool.

Each call builds a fresh sandbox with `bwrap`: new user, pid, network, ipc, uts and cgroup
namespaces (no network at all, not even the host's loopback; no view of host processes), a
read-only view of /usr and the interpreter's prefix, a fresh scratch directory as the only
writable place (removed afterwards), and a cleared environment. Inside, a small monitor sets
resource limits (CPU time, address space, process count, file size) on the child that runs
the code and reports how that child ended. Outside, stdout and stderr are read up to a cap
(the rest is read and dropped, never buffered) and the whole sandbox is killed at a
wall-clock deadline (tracerl.tools.capture). `run_python` is the plain function;
tracerl.tools.python_tool exposes it to an agent as the OpenAI tool `python(code)`.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from tracerl.tools.capture import Execution, execute, read_available

__all__ = ["SandboxConfig", "SandboxResult", "SandboxUnavailable", "run_python"]

SCRATCH = "/scratch"
"""Where the scratch directory appears inside the sandbox (the code's working directory)."""

Limit = Literal["wall_time", "cpu_time", "memory", "processes", "file_size"]


def _base_python() -> str:
    """The real interpreter behind this one (a venv's python is a link to it or a copy)."""
    name = f"python{sys.version_info.major}.{sys.version_info.minor}"
    base = Path(sys.base_prefix) / "bin" / name
    return str(base if base.exists() else Path(sys.executable).resolve())


class SandboxConfig(BaseModel):
    """Limits and layout of one sandboxed run; the defaults suit short agent snippets."""

    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)

    cpu_s: int = Field(default=2, ge=1)
    """CPU seconds each process of the code may use (RLIMIT_CPU): SIGXCPU, then SIGKILL 1 s on."""
    memory_mb: int = Field(default=256, ge=32)
    """Address space of each process of the code, in MiB (RLIMIT_AS); Python then raises
    MemoryError."""
    max_processes: int = Field(default=16, ge=4)
    """Processes the code may hold at once (RLIMIT_NPROC). Each sandbox counts apart: as root
    the code runs as a uid of its own; otherwise in a user namespace of its own, where the
    sandbox's init and monitor count too."""
    output_bytes: int = Field(default=64 * 1024, ge=1)
    """Cap on each of stdout and stderr; bytes past it are read and dropped."""
    file_bytes: int = Field(default=1 << 20, ge=0)
    """Largest file the code may write (RLIMIT_FSIZE)."""
    wall_s: float = Field(default=5.0, gt=0)
    """Wall-clock deadline, sandbox start-up included; then every process in it is killed."""
    python: str = Field(default_factory=_base_python)
    """Interpreter run inside (isolated mode, -I); its prefix is bound read-only."""
    ro_paths: tuple[str, ...] = ()
    """Extra host paths bound read-only at the same place (e.g. a directory of packages)."""
    root_uids: tuple[int, int] = (200_000, 265_536)
    """When tracerl runs as root, the code runs as a random host uid in [start, stop) with no
    capability: an unprivileged uid of its own, so RLIMIT_NPROC counts each sandbox apart."""
    scratch_root: str | None = None
    """Host directory the scratch directory is made in (default: the system temp dir)."""
    bwrap: str = "bwrap"
    """The bubblewrap executable: a name looked up on PATH, or a path."""


class SandboxResult(BaseModel):
    """What one run of code in the sandbox did."""

    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)

    stdout: str
    """What the code printed, up to the cap (UTF-8, undecodable bytes replaced)."""
    stderr: str
    """What the code wrote to stderr (tracebacks), up to the cap."""
    exit_code: int | None
    """The code's exit status when it exited by itself; None when a signal ended it."""
    signal: int | None = None
    """The signal that ended the code (e.g. SIGXCPU at the CPU limit), or SIGKILL when the
    wall-clock deadline killed the sandbox."""
    timed_out: bool = False
    """The wall-clock deadline passed and the whole sandbox was killed."""
    limit: Limit | None = None
    """The resource limit that stopped the code, if one did (memory, processes and file size
    are read from the exception Python raised, as Python turns those limits into errors)."""
    stdout_truncated: bool = False
    """stdout went past `output_bytes` and was cut there."""
    stderr_truncated: bool = False
    """stderr went past `output_bytes` and was cut there."""
    wall_s: float
    """Wall-clock seconds of the whole run, sandbox set-up and tear-down included."""
    cpu_s: float | None = None
    """User + system CPU seconds of the code's main process (None when it was not reported)."""

    @property
    def killed(self) -> bool:
        """A signal ended the code, or the deadline killed the sandbox."""
        return self.signal is not None or self.timed_out

    @property
    def ok(self) -> bool:
        """The code exited by itself with status 0."""
        return self.exit_code == 0


class SandboxUnavailable(RuntimeError):
    """The sandbox could not be built: bwrap is missing, or the kernel refused it."""


# Runs inside the sandbox as `python -I -S -c MONITOR status_fd limits`. It forks the code's
# process, limits it, and reports how it ended on status_fd, which the code never inherits
# (close-on-exec): the exit status bwrap passes on cannot tell exit(137) from SIGKILL.
MONITOR = r"""
import json, os, resource, sys
fd, limits, uid = int(sys.argv[1]), json.loads(sys.argv[2]), int(sys.argv[3])
os.set_inheritable(fd, False)
os.write(fd, b'{"started": true}\n')
pid = os.fork()
if pid == 0:
    try:
        for name, soft, hard in limits:
            resource.setrlimit(getattr(resource, name), (soft, hard))
        if uid >= 0:
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
        os.execv(sys.executable, [sys.executable, "-I", "main.py"])
    finally:
        os._exit(127)
_, status, usage = os.wait4(pid, 0)
code = os.waitstatus_to_exitcode(status)
os.write(fd, json.dumps({"code": code, "cpu_s": usage.ru_utime + usage.ru_stime}).encode())
"""


def _limits(cfg: SandboxConfig) -> list[tuple[str, int, int]]:
    """(RLIMIT name, soft, hard) for the code's process."""
    memory = cfg.memory_mb << 20
    return [
        ("RLIMIT_CPU", cfg.cpu_s, cfg.cpu_s + 1),  # soft: SIGXCPU; hard: SIGKILL
        ("RLIMIT_AS", memory, memory),
        ("RLIMIT_NPROC", cfg.max_processes, cfg.max_processes),
        ("RLIMIT_FSIZE", cfg.file_bytes, cfg.file_bytes),
        ("RLIMIT_CORE", 0, 0),  # a crash must not write a core file into scratch
    ]


def _system_binds(cfg: SandboxConfig) -> list[str]:
    """bwrap arguments for the read-only system view: /usr, the top-level links into it
    (merged /usr), the loader cache, the interpreter's prefix and any extra paths."""
    args: list[str] = ["--ro-bind", "/usr", "/usr"]
    for top in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
        if Path(top).is_symlink():
            args += ["--symlink", os.readlink(top), top]
        elif Path(top).is_dir():
            args += ["--ro-bind", top, top]
    for piece in ("/etc/ld.so.cache", "/etc/localtime"):
        args += ["--ro-bind-try", piece, piece]
    bound = [Path("/usr")]
    for path in (Path(os.path.realpath(cfg.python)).parents[1], *map(Path, cfg.ro_paths)):
        if any(path.is_relative_to(b) for b in bound):
            continue
        # Parents bwrap would make are 0700 when it runs as root; the code's uid must
        # pass through them.
        for parent in reversed(path.parents[:-1]):
            if not any(parent.is_relative_to(b) for b in bound):
                args += ["--perms", "0755", "--dir", str(parent)]
        args += ["--ro-bind", str(path), str(path)]
        bound.append(path)
    return args


def _command(
    bwrap: str, cfg: SandboxConfig, scratch: str, fds: tuple[int, int], uid: int
) -> list[str]:
    """The bwrap command line: namespaces, file system, environment, then the monitor; bwrap
    reports on fds[0], the monitor on fds[1]."""
    isolation = ["--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts"]
    isolation += ["--unshare-cgroup-try", "--hostname", "sandbox"]
    isolation += ["--die-with-parent", "--new-session", "--json-status-fd", str(fds[0])]
    if uid >= 0:
        # As root: no user namespace, and the monitor keeps only the right to drop the code
        # to `uid`; RLIMIT_NPROC is never enforced on host root, even inside a namespace.
        isolation += ["--cap-drop", "ALL", "--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
    else:
        # Unprivileged: everything runs as uid 65534 of a user namespace of its own, where
        # RLIMIT_NPROC counts this sandbox's processes alone.
        isolation += ["--unshare-user", "--uid", "65534", "--gid", "65534"]
    files = [*_system_binds(cfg), "--proc", "/proc", "--dev", "/dev"]
    files += ["--bind", scratch, SCRATCH, "--chdir", SCRATCH, "--remount-ro", "/"]
    env = ["--clearenv", "--setenv", "PATH", "/usr/bin:/bin", "--setenv", "HOME", SCRATCH]
    env += ["--setenv", "TMPDIR", SCRATCH, "--setenv", "LANG", "C.UTF-8"]
    limits = json.dumps(_limits(cfg))
    monitor = [cfg.python, "-I", "-S", "-c", MONITOR, str(fds[1]), limits, str(uid)]
    return [bwrap, *isolation, *files, *env, "--", *monitor]


def _find_bwrap(name: str) -> str:
    """The bwrap executable's path, or a SandboxUnavailable saying how to install it."""
    found = shutil.which(name)
    if found is None:
        raise SandboxUnavailable(
            f"bubblewrap ({name!r}) is not installed; the python tool needs it to sandbox "
            "code (Debian/Ubuntu: apt-get install -y bubblewrap)"
        )
    return found


def _which_limit(
    cfg: SandboxConfig, sig: int | None, cpu_s: float | None, tail: bytes
) -> Limit | None:
    """The limit that stopped the code, from its signal or the last line of its stderr."""
    if sig == signal.SIGXCPU or (sig == signal.SIGKILL and (cpu_s or 0) >= cfg.cpu_s):
        return "cpu_time"
    lines = tail.decode(errors="replace").strip().splitlines()
    last = lines[-1] if lines else ""
    if sig == signal.SIGXFSZ or "[Errno 27] File too large" in last:
        return "file_size"
    if last.startswith("MemoryError"):
        return "memory"
    if last.startswith("BlockingIOError: [Errno 11]"):  # fork() refused at RLIMIT_NPROC
        return "processes"
    return None


def _monitor_report(data: bytes) -> tuple[bool, dict[str, float] | None]:
    """(the monitor started, its final report) from what it wrote to its pipe."""
    lines = data.decode(errors="replace").splitlines()
    started = bool(lines) and lines[0] == '{"started": true}'
    try:
        report = json.loads(lines[1]) if len(lines) > 1 else None
    except json.JSONDecodeError:
        report = None
    return started, report


def _run(bwrap: str, cfg: SandboxConfig, scratch: str, uid: int) -> tuple[Execution, bytes]:
    """Run the sandbox with its two status pipes; (the execution, what the monitor wrote)."""
    bwrap_r, bwrap_w = os.pipe()
    monitor_r, monitor_w = os.pipe()
    try:
        command = _command(bwrap, cfg, scratch, (bwrap_w, monitor_w), uid)
        run = execute(command, (bwrap_w, monitor_w), bwrap_r, cfg.wall_s, cfg.output_bytes)
        return run, read_available(monitor_r)
    finally:
        for fd in (bwrap_r, bwrap_w, monitor_r, monitor_w):
            os.close(fd)


def run_python(code: str, cfg: SandboxConfig | None = None) -> SandboxResult:
    """Run `code` as a Python program in a fresh sandbox and say what happened.

    Whatever the code does (crash, loop, fork, allocate) comes back as a result; only a
    sandbox that cannot be built raises SandboxUnavailable.
    """
    cfg = cfg or SandboxConfig()
    bwrap = _find_bwrap(cfg.bwrap)
    # A seeded global RNG (training code seeds it) would hand concurrent sandboxes one uid.
    uid = random.SystemRandom().randrange(*cfg.root_uids) if os.geteuid() == 0 else -1
    start = time.monotonic()
    if cfg.scratch_root is not None:
        Path(cfg.scratch_root).mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(
        prefix="tracerl-sandbox-", dir=cfg.scratch_root, ignore_cleanup_errors=True
    ) as scratch:
        Path(scratch, "main.py").write_text(code)
        if uid >= 0:
            os.chown(scratch, uid, uid)
            os.chmod(scratch, 0o711)  # bwrap enters it as root without DAC capabilities
        run, monitor = _run(bwrap, cfg, scratch, uid)
    started, report = _monitor_report(monitor)
    if not started and not run.timed_out:
        raise SandboxUnavailable(f"bwrap could not build the sandbox: {run.stderr.text().strip()}")
    return _result(cfg, run, report, time.monotonic() - start)


def _result(
    cfg: SandboxConfig, run: Execution, report: dict[str, float] | None, wall_s: float
) -> SandboxResult:
    """The result record from the execution and the monitor's report."""
    code = int(report["code"]) if report is not None and not run.timed_out else None
    cpu_s = report["cpu_s"] if report is not None else None
    sig = -code if code is not None and code < 0 else None
    if code is None:
        # Killed from outside at the deadline, or the monitor itself was killed.
        sig = signal.SIGKILL
    limit = "wall_time" if run.timed_out else _which_limit(cfg, sig, cpu_s, run.stderr.tail)
    return SandboxResult(
        stdout=run.stdout.text(),
        stderr=run.stderr.text(),
        exit_code=code if sig is None else None,
        signal=sig,
        timed_out=run.timed_out,
        limit=limit,
        stdout_truncated=run.stdout.truncated,
        stderr_truncated=run.stderr.truncated,
        wall_s=wall_s,
        cpu_s=cpu_s,
    )
