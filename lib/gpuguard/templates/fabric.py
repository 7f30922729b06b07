"""Fabric sanity at job start: which network NCCL actually loaded on every rank.

The torchrun template (EFA/InfiniBand presets, `fabric_check: true`) runs NCCL with NCCL_DEBUG=INFO,
NCCL_DEBUG_SUBSYS=INIT,NET and NCCL_DEBUG_FILE=<attempt dir>/nccl/%h.%p.log: one file per rank (NCCL docs,
docs.nvidia.com/deeplearning/nccl/user-guide/docs/env.html and troubleshooting/logging.html). Those INFO lines say
which network plugin NCCL loaded:

    ip-10-1-2-3:6831:6840 [0] NCCL INFO NET/OFI Initializing aws-ofi-nccl 1.13.2-aws
    ip-10-1-2-3:6831:6840 [0] NCCL INFO NET/OFI Selected Provider is efa (found 16 nics)
    ip-10-1-2-3:6831:6840 [0] NCCL INFO Using network Libfabric          (older plugins: "AWS Libfabric")
    dgx01:1234:1300 [0] NCCL INFO NET/IB : Using [0]mlx5_0:1/IB [1]mlx5_3:1/IB ...
    dgx01:1234:1300 [0] NCCL INFO Using network IB                       (NVIDIA's SHARP plugin: "IBext_v8")
    node3:880:887 [0] NCCL INFO NET/Socket : Using [0]eth0:172.17.0.2<0>
    node3:880:887 [0] NCCL INFO Using network Socket                     <- the silent TCP fallback

(examples from NVIDIA/nccl#1597, aws/aws-ofi-nccl#715 and #889; the socket fallback is the failure this check
exists for: the job runs, an order of magnitude slower). `parse_nccl_log` and `judge` are pure; `read_attempt` and
`run_check` do the I/O, bounded in bytes, files and time.
"""

from __future__ import annotations

import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

READ_BYTES = 64 * 1024     # INIT and NET lines come first; warnings later in the file stay there for a human
MAX_FILES = 20000
SUMMARY_FILES = 512        # the end-of-attempt summary reads at most this many files

# "host:pid:tid [dev] NCCL INFO msg"; warnings carry the source location: "[0] ofi_init:1134 NCCL WARN msg"
_LINE = re.compile(r"^(?P<host>[^:\s]+):(?P<pid>\d+):(?P<tid>\d+) \[[^\]]*\] (?:\S+:\d+ )?NCCL (?P<level>INFO|WARN) "
                   r"(?P<msg>.*)$")
_NETWORK = re.compile(r"^Using network (.+?)\s*$")
_OFI_VERSION = re.compile(r"NET/OFI Initializing aws-ofi-nccl (\S+)")
_OFI_PROVIDER = re.compile(r"NET/OFI Selected [Pp]rovider is (\w[\w-]*)")
_IB_DEVICES = re.compile(r"^NET/IB ?: Using (.+)$")
_SOCKET_DEVICES = re.compile(r"^NET/Socket ?: Using (.+)$")
_NCCL_VERSION = re.compile(r"NCCL version (\S+)")


@dataclass
class NcclInit:
    """What one rank's NCCL debug file says about its network."""
    source: str                       # the file
    host: Optional[str] = None
    network: Optional[str] = None     # "Libfabric", "AWS Libfabric", "IB", "IBext_v8", "Socket", ...
    ofi_version: Optional[str] = None
    provider: Optional[str] = None
    ib_devices: Optional[str] = None
    socket_devices: Optional[str] = None
    nccl_version: Optional[str] = None
    warnings: list[str] = field(default_factory=list)

    @property
    def kind(self) -> Optional[str]:
        """efa | ib | socket | other, from the network NCCL says it uses."""
        if not self.network:
            return None
        n = self.network.lower()
        if "libfabric" in n or n.startswith("ofi"):
            return "efa"
        if n.startswith("ib"):
            return "ib"
        if n.startswith("socket"):
            return "socket"
        return "other"


def parse_nccl_log(text: str, source: str = "") -> NcclInit:
    out = NcclInit(source=source)
    for line in text.splitlines():
        m = _LINE.match(line)
        if not m:
            v = _NCCL_VERSION.search(line)
            if v and not out.nccl_version:
                out.nccl_version = v.group(1).split("+")[0]
            continue
        out.host = out.host or m.group("host")
        msg = m.group("msg")
        if m.group("level") == "WARN":
            if len(out.warnings) < 20:
                out.warnings.append(msg.strip()[:300])
            continue
        for rx, attr in ((_NETWORK, "network"), (_OFI_VERSION, "ofi_version"), (_OFI_PROVIDER, "provider"),
                         (_IB_DEVICES, "ib_devices"), (_SOCKET_DEVICES, "socket_devices"),
                         (_NCCL_VERSION, "nccl_version")):
            mm = rx.search(msg)
            if mm and getattr(out, attr) is None:
                value = mm.group(1).strip()
                setattr(out, attr, value.split("+")[0] if attr == "nccl_version" else value)
    return out


def judge(inits: Sequence[NcclInit], expect: str, ranks: Optional[int] = None) -> tuple[list[str], list[str]]:
    """(warnings, notes) for the ranks' NCCL inits against the fabric the preset expects (efa | ib). Pure."""
    warnings: list[str] = []
    notes: list[str] = []
    ready = [i for i in inits if i.network]
    socket = [i for i in ready if i.kind == "socket"]
    wrong = [i for i in ready if i.kind not in ("socket", expect)]
    good = [i for i in ready if i.kind == expect]
    want = {"efa": "EFA through aws-ofi-nccl ('Using network Libfabric')",
            "ib": "InfiniBand ('Using network IB')"}.get(expect, expect)
    if socket:
        hosts = sorted({i.host or "?" for i in socket})
        devs = next((i.socket_devices for i in socket if i.socket_devices), None)
        warnings.append(
            f"{len(socket)} rank(s) on {', '.join(hosts[:8])}{' ...' if len(hosts) > 8 else ''} fell back to TCP "
            f"sockets (NCCL 'Using network Socket'{', ' + devs if devs else ''}), expected {want}: inter-node "
            "traffic runs at a fraction of the fabric's bandwidth. "
            + ("Check that aws-ofi-nccl is on LD_LIBRARY_PATH (or NCCL_NET_PLUGIN=ofi) and that fi_info -p efa "
               "lists the EFA devices" if expect == "efa" else
               "Check the HCAs (ibstat), NCCL_IB_HCA and that NCCL_IB_DISABLE is not set"))
    if wrong:
        nets = sorted({i.network or "?" for i in wrong})
        warnings.append(f"{len(wrong)} rank(s) use network {', '.join(nets)}, expected {want}")
    if good:
        versions = sorted({i.ofi_version for i in good if i.ofi_version})
        providers = sorted({i.provider for i in good if i.provider})
        nets = sorted({i.network or "" for i in good})
        notes.append(f"{len(good)} rank(s) use {', '.join(nets)}"
                     + (f" (aws-ofi-nccl {', '.join(versions)}" if versions else "")
                     + (f", provider {', '.join(providers)}" if providers else "")
                     + (")" if versions else ""))
    if ranks and len(ready) < ranks:
        notes.append(f"{len(ready)} of {ranks} rank(s) had initialised NCCL")
    nwarn = sum(len(i.warnings) for i in inits)
    if nwarn:
        first = next(w for i in inits for w in i.warnings)
        notes.append(f"{nwarn} NCCL warning(s) in the ranks' debug files, e.g.: {first}")
    return warnings, notes


def summary(inits: Sequence[NcclInit]) -> dict[str, Any]:
    nets: dict[str, int] = {}
    for i in inits:
        if i.network:
            nets[i.network] = nets.get(i.network, 0) + 1
    return {"files": len(inits), "networks": nets,
            "socket_hosts": sorted({i.host or "?" for i in inits if i.kind == "socket"}),
            "aws_ofi_nccl": sorted({i.ofi_version for i in inits if i.ofi_version}),
            "nccl": sorted({i.nccl_version for i in inits if i.nccl_version}),
            "nccl_warnings": sum(len(i.warnings) for i in inits)}


def _read(path: Path) -> str:
    try:
        with open(path, "rb") as fh:
            return fh.read(READ_BYTES).decode("utf-8", errors="replace")
    except OSError:
        return ""


def read_attempt(nccl_dir: Path, limit: int = SUMMARY_FILES) -> list[NcclInit]:
    try:
        files = sorted(p for p in nccl_dir.iterdir() if p.name.endswith(".log"))[:limit]
    except OSError:
        return []
    return [parse_nccl_log(_read(p), p.name) for p in files]


def run_check(nccl_dir: Path, expect: str, ranks: int, wait_s: float, poll_s: float = 5.0,
              out: Any = sys.stderr) -> int:
    """Wait (at most `wait_s`) until `ranks` ranks have chosen their network, then report on `out`. Returns the
    number of warnings."""
    deadline = time.monotonic() + wait_s
    done: dict[str, NcclInit] = {}
    while True:
        try:
            names = sorted(p.name for p in nccl_dir.iterdir() if p.name.endswith(".log"))[:MAX_FILES]
        except OSError:
            names = []
        for name in names:
            if name not in done:
                init = parse_nccl_log(_read(nccl_dir / name), name)
                if init.network:
                    done[name] = init
        if len(done) >= ranks or time.monotonic() >= deadline:
            break
        time.sleep(min(poll_s, max(0.0, deadline - time.monotonic())))
    inits = list(done.values())
    if not inits:
        print(f"gpuguard: fabric: no rank initialised NCCL within {wait_s:.0f} s (no NCCL, or NCCL_DEBUG_FILE was "
              "overridden): not checked", file=out, flush=True)
        return 0
    warnings, notes = judge(inits, expect, ranks)
    for w in warnings:
        print(f"gpuguard: WARNING fabric: {w}", file=out, flush=True)
    for n in notes:
        print(f"gpuguard: fabric: {n}", file=out, flush=True)
    return len(warnings)
