"""Shared by the central-history tests (test_fleet_pg.py, test_fleet_pg_scale.py): the ways an admin drives gpuguard
(the CLI, the health check as slurmd runs it) and what the tests read back. The PostgreSQL server (booted once per
test module) and the fresh database per test are the `pg` and `db` fixtures of conftest.py."""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml
from clirun import gpuguard

from devtools.devpg import DevPostgres
from gpuguard.simulate.build import build_fake_nvml

ROOT = Path(__file__).resolve().parents[2]
SCENARIOS = ROOT / "examples" / "scenarios"


def q(url: str, sql: str, *args: Any) -> list[tuple[Any, ...]]:
    import psycopg

    with psycopg.connect(url) as c:
        return c.execute(sql, args).fetchall()


def write_cfg(tmp_path: Path, url: str, **extra: Any) -> Path:
    data: dict[str, Any] = {
        "store": {"path": str(tmp_path / "state" / "{node}.db"), "url": url},
        "simulation": {"scenario_dir": str(tmp_path / "scenarios"), "workdir": str(tmp_path / "sim"),
                       "fake_nvml": str(build_fake_nvml())},
        "logging": {"syslog": False, "file": str(tmp_path / "gpuguard.log")},
        "slurm": {"scontrol": "/bin/false"}}  # no cluster here: a drain is attempted and recorded as failed
    for k, v in extra.items():
        data.setdefault(k, {}).update(v)
    (tmp_path / "scenarios").mkdir(parents=True, exist_ok=True)
    cfg = tmp_path / "config.yaml"
    cfg.write_text(yaml.safe_dump(data))
    return cfg


def gg(cfg: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """`gpuguard ARGS --config CFG` as an admin runs it (tests/clirun.py: the real entry point, in this process)."""
    return gpuguard(*args, "--config", str(cfg), env={**os.environ, **env} if env else None)


def gpuguard_env() -> dict[str, str]:
    """What gpuguard.env gives slurmd's hooks on a node: here the test's private state and runtime directories."""
    return {k: os.environ[k] for k in ("GPUGUARD_STATE_DIR", "GPUGUARD_RUNTIME_DIR") if k in os.environ}


def healthcheck(cfg: Path, node: str) -> tuple[int, float]:
    """What slurmd runs (HealthCheckProgram gets only SLURMD_NODENAME); returns (exit code, seconds)."""
    rc, took, _ = healthcheck_timed(cfg, node)
    return rc, took


def healthcheck_timed(cfg: Path, node: str) -> tuple[int, float, float]:
    """healthcheck(), also returning the CPU seconds (user + system) the health check's process used."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "-m", "gpuguard", "healthcheck", "--config", str(cfg)], capture_output=True,
                       text=True, timeout=60, env={"SLURMD_NODENAME": node, "PATH": "/usr/bin:/bin", **gpuguard_env()})
    took = time.monotonic() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return p.returncode, took, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def sessions(pg: DevPostgres, url: str, application: str) -> int:
    """Connections the server accepted for this database and application so far (log_connections)."""
    dbname = url.rsplit("/", 1)[1].split("?")[0]
    text = (pg.dir / "server.log").read_text(errors="replace")
    return sum(1 for line in text.splitlines() if "connection authorized" in line and f"database={dbname}" in line
               and f"application_name={application}" in line)


def new_db(pg: DevPostgres, name: str) -> str:
    """Another fresh database on the same server (for comparing two ways of shipping)."""
    import psycopg
    from psycopg import sql

    with psycopg.connect(pg.admin_url, autocommit=True) as c:
        c.execute(sql.SQL("DROP DATABASE IF EXISTS {}").format(sql.Identifier(name)))
        c.execute(sql.SQL("CREATE DATABASE {} OWNER {}").format(sql.Identifier(name), sql.Identifier(pg.user)))
    return f"postgresql://{pg.user}:{pg.password}@127.0.0.1:{pg.port}/{name}"
