"""A throwaway PostgreSQL server for the tests (and anyone trying `gpuguard fleet` on one machine): Debian's
postgresql binaries, data directory and unix socket in a temp dir, a free TCP port on 127.0.0.1.

initdb refuses to run as root, so as root the server runs as the `postgres` system user (`runuser -u postgres`);
its temp dir is created outside pytest's private (0700) tmp tree so that user can reach it. Local connections are
trusted for the `postgres` superuser over the unix socket; TCP connections need a password (scram-sha-256), so a
test can check that a password really travels and is never shown.
"""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Optional


def pg_bindir() -> Optional[Path]:
    """The newest /usr/lib/postgresql/<major>/bin with initdb and pg_ctl (Debian's layout), else PATH."""
    cands = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=lambda p: int(p.split("/")[4]) if
                   p.split("/")[4].isdigit() else 0)
    if cands:
        return Path(cands[-1]).parent
    found = shutil.which("initdb")
    return Path(found).parent if found else None


def missing_requirements() -> list[str]:
    missing = []
    if pg_bindir() is None:
        missing.append("PostgreSQL server binaries (apt-get install postgresql)")
    if os.geteuid() == 0:
        try:
            pwd.getpwnam("postgres")
        except KeyError:
            missing.append("a `postgres` system user to run the server as (initdb refuses root)")
        if not shutil.which("runuser"):
            missing.append("runuser (util-linux)")
    import importlib.util

    if importlib.util.find_spec("psycopg") is None:
        missing.append("psycopg 3 (pip install 'psycopg[binary]')")
    return missing


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class DevPostgres:
    """start() -> a server with role `gpuguard` (password `password`) owning database `gpuguard`."""

    def __init__(self, password: str = "gg-Secret-3141", user: str = "gpuguard", dbname: str = "gpuguard",
                 settings: Optional[dict[str, str]] = None) -> None:
        self.bindir = pg_bindir()
        if self.bindir is None:
            raise RuntimeError("; ".join(missing_requirements()))
        self.dir = Path(tempfile.mkdtemp(prefix="gg-pg-", dir="/tmp"))
        self.data = self.dir / "data"
        self.port = free_port()
        self.user, self.password, self.dbname = user, password, dbname
        # server settings (-c name=value); the defaults suit a test, the fleet benchmark raises shared_buffers
        self.settings = {"fsync": "off", "synchronous_commit": "off", "full_page_writes": "off",
                         "max_connections": "50", "shared_buffers": "32MB", **(settings or {})}
        self._as_root = os.geteuid() == 0
        if self._as_root:
            pw = pwd.getpwnam("postgres")
            os.chown(self.dir, pw.pw_uid, pw.pw_gid)
        os.chmod(self.dir, 0o700)

    # ------------------------------------------------------------------ helpers
    def _run(self, *argv: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        cmd = [str(self.bindir / argv[0]), *argv[1:]]
        if self._as_root:
            cmd = ["runuser", "-u", "postgres", "--", *cmd]
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=str(self.dir))
        if p.returncode != 0:
            raise RuntimeError(f"{' '.join(argv[:2])} failed ({p.returncode}): {p.stderr.strip() or p.stdout.strip()}"
                               + f"\n{self.log_tail()}")
        return p

    def log_tail(self, n: int = 20) -> str:
        try:
            return "\n".join((self.dir / "server.log").read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    @property
    def url(self) -> str:
        return f"postgresql://{self.user}:{self.password}@127.0.0.1:{self.port}/{self.dbname}"

    @property
    def url_without_password(self) -> str:
        return f"postgresql://{self.user}@127.0.0.1:{self.port}/{self.dbname}"

    @property
    def admin_url(self) -> str:
        """The superuser over the unix socket (trusted)."""
        return f"postgresql://postgres@/postgres?host={self.dir}&port={self.port}"

    # ------------------------------------------------------------------ lifecycle
    def init(self) -> "DevPostgres":
        self._run("initdb", "-D", str(self.data), "-U", "postgres", "--auth-local=trust",
                  "--auth-host=scram-sha-256", "-E", "UTF8", "--no-sync", "--locale=C")
        return self

    def start(self) -> "DevPostgres":
        if not (self.data / "PG_VERSION").exists():
            self.init()
            self._start()
            self._bootstrap()
        else:
            self._start()
        return self

    def _start(self) -> None:
        opts = f"-p {self.port} -k {self.dir} -c listen_addresses=127.0.0.1 " + " ".join(
            f"-c {k}={v}" for k, v in self.settings.items())
        self._run("pg_ctl", "-D", str(self.data), "-o", opts, "-l", str(self.dir / "server.log"), "-w", "-t", "60",
                  "start", timeout=90)

    def _bootstrap(self) -> None:
        import psycopg
        from psycopg import sql

        with psycopg.connect(self.admin_url, autocommit=True, connect_timeout=10) as c:
            c.execute(sql.SQL("CREATE ROLE {} LOGIN PASSWORD {}").format(sql.Identifier(self.user),
                                                                         sql.Literal(self.password)))
            c.execute(sql.SQL("CREATE DATABASE {} OWNER {}").format(sql.Identifier(self.dbname),
                                                                   sql.Identifier(self.user)))

    def stop(self) -> None:
        if (self.data / "postmaster.pid").exists():
            self._run("pg_ctl", "-D", str(self.data), "-m", "immediate", "-w", "-t", "30", "stop", timeout=60)
            deadline = time.monotonic() + 10
            while (self.data / "postmaster.pid").exists() and time.monotonic() < deadline:
                time.sleep(0.05)

    def destroy(self) -> None:
        try:
            self.stop()
        finally:
            shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> "DevPostgres":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.destroy()
