"""A throwaway PostgreSQL server for tests: one per test session, a fresh database per test.

`pg_server` runs initdb in a temporary directory and starts the server on 127.0.0.1 at a
free port (its socket in the same directory, so nothing lands in /var/run); `pg_url` creates
an empty database for one test and drops it afterwards. Tests import both fixtures:

    from tests.pg import pg_server, pg_url  # noqa: F401

initdb and pg_ctl refuse to run as root, so as root they run as the `postgres` user, which
then owns the directory. Without the binaries (or that user) every test asking for a
server is skipped, saying why.
"""

from __future__ import annotations

import itertools
import os
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.needs import missing

BIN_DIRS = [Path(p) for p in os.environ.get("TRACERL_PG_BIN", "").split(os.pathsep) if p] + [
    Path(f"/usr/lib/postgresql/{v}/bin") for v in (17, 16, 15, 14)
]
"""Where to look for initdb and pg_ctl: $TRACERL_PG_BIN first, then Debian's layout."""
_names = itertools.count()


@dataclass(frozen=True)
class PgServer:
    """A running throwaway server."""

    host: str
    """Loopback address it listens on."""
    port: int
    """Its TCP port."""
    user: str
    """The superuser (trust authentication: no password)."""

    def url(self, database: str = "postgres") -> str:
        """A postgresql:// URL for one of its databases."""
        return f"postgresql://{self.user}@{self.host}:{self.port}/{database}"


def find_bin() -> Path | None:
    """The directory holding initdb and pg_ctl, or None."""
    for d in BIN_DIRS:
        if (d / "initdb").exists() and (d / "pg_ctl").exists():
            return d
    found = shutil.which("initdb")
    return Path(found).parent if found and shutil.which("pg_ctl") else None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _as_owner(cmd: list[str]) -> list[str]:
    # The server refuses to run as root; as anyone else it runs as that user.
    return ["runuser", "-u", "postgres", "--", *cmd] if os.geteuid() == 0 else cmd


def _skip_reason(bindir: Path | None) -> str | None:
    if bindir is None:
        return "PostgreSQL binaries (initdb, pg_ctl) not found; set TRACERL_PG_BIN"
    if os.geteuid() == 0 and shutil.which("runuser") is None:
        return "running as root without runuser, so initdb cannot run as postgres"
    if os.geteuid() == 0:
        try:
            import pwd

            pwd.getpwnam("postgres")
        except KeyError:
            return "running as root and there is no `postgres` user to run the server as"
    return None


def _user() -> str:
    import pwd

    return "postgres" if os.geteuid() == 0 else pwd.getpwuid(os.geteuid()).pw_name


def start(root: Path, bindir: Path) -> PgServer:
    """initdb `root/data` and start a server on a free loopback port; returns once it accepts
    connections. fsync is off: a test server's data need not survive a power cut."""
    root.mkdir(parents=True, exist_ok=True)
    if os.geteuid() == 0:
        shutil.chown(root, "postgres")
    data, port = root / "data", _free_port()
    run = {"check": True, "capture_output": True, "timeout": 60}
    subprocess.run(
        _as_owner([str(bindir / "initdb"), "-D", str(data), "-A", "trust", "--no-sync",
                   "-U", _user(), "-E", "UTF8", "--locale", "C"]),
        **run,
    )  # fmt: skip
    options = f"-c listen_addresses=127.0.0.1 -p {port} -k {root} -c fsync=off"
    options += " -c synchronous_commit=off -c full_page_writes=off -c max_connections=200"
    subprocess.run(
        _as_owner([str(bindir / "pg_ctl"), "-D", str(data), "-o", options,
                   "-l", str(root / "log"), "-w", "-t", "30", "start"]),
        **run,
    )  # fmt: skip
    return PgServer("127.0.0.1", port, _user())


def stop(root: Path, bindir: Path) -> None:
    """Stop at once (nothing in it is worth a clean shutdown) and remove the directory."""
    subprocess.run(
        _as_owner([str(bindir / "pg_ctl"), "-D", str(root / "data"), "-m", "immediate", "stop"]),
        capture_output=True,
        timeout=60,
    )
    shutil.rmtree(root, ignore_errors=True)


def create_database(server: PgServer) -> str:
    """A new empty database on the server; its URL."""
    import psycopg

    name = f"t{os.getpid()}_{next(_names)}"
    with psycopg.connect(server.url(), autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {name}")
    return server.url(name)


def drop_database(server: PgServer, url: str) -> None:
    """Drop a database made by create_database, closing whatever still uses it."""
    import psycopg

    name = url.rsplit("/", 1)[1]
    with psycopg.connect(server.url(), autocommit=True) as conn:
        conn.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


@pytest.fixture(scope="session")
def pg_server() -> Iterator[PgServer]:
    """One throwaway server for the whole session (skips when it cannot run here)."""
    bindir = find_bin()
    if reason := _skip_reason(bindir):
        missing("postgres", reason)
    assert bindir is not None
    try:
        import psycopg  # noqa: F401
    except ImportError:
        missing("postgres", "psycopg is not installed (pip install -e .[dev])")
    root = Path(tempfile.mkdtemp(prefix="tracerl-pg-"))
    try:
        server = start(root, bindir)
    except subprocess.CalledProcessError as e:
        shutil.rmtree(root, ignore_errors=True)
        raise RuntimeError(f"the test server did not start: {e.stderr.decode()}") from e
    try:
        yield server
    finally:
        stop(root, bindir)


@pytest.fixture
def pg_url(pg_server: PgServer) -> Iterator[str]:
    """The URL of an empty database of its own for one test."""
    url = create_database(pg_server)
    yield url
    drop_database(pg_server, url)
