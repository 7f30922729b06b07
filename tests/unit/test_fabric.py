"""Fabric probe: fi_info parsing on recorded outputs, fi_info runner, and sysfs trees built like the kernel's."""

from __future__ import annotations

import os
import stat
import time
from pathlib import Path

import pytest


from gpuguard.probes.fabric import (  # noqa: E402
    classify_rdma_device,
    device_of_domain,
    parse_fi_info,
    parse_sysfs_state,
    read_fabric,
    read_rdma_devices,
    run_fi_info,
)
from gpuguard.simulate.sysfs import write_fake_infiniband  # noqa: E402

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "efa"


def fixture(name: str) -> str:
    return (FIXTURES / name).read_text(encoding="utf-8")


# --------------------------------------------------------------------------- parse_fi_info on recorded outputs


@pytest.mark.parametrize(
    "name,devices,domains",
    [
        ("fi_info_legacy_2020.txt", 1, ["efa_0"]),
        ("fi_info_modern_p4de_4dev.txt", 4, ["rdmap16s27", "rdmap32s27", "rdmap144s27", "rdmap160s27"]),
        ("fi_info_modern_hpc6a_1dev.txt", 1, ["rdmap0s31"]),
        ("fi_info_libfabric2_efa_direct.txt", 1, ["rdmap47s0"]),
    ],
)
def test_fixture_device_counts(name: str, devices: int, domains: list[str]) -> None:
    info = parse_fi_info(fixture(name))
    assert info.ran
    assert info.provider_found
    assert info.devices == devices
    assert info.domains == domains
    assert info.error is None


def test_every_fixture_has_a_source_note() -> None:
    for path in sorted(FIXTURES.glob("fi_info_*.txt")):
        first = path.read_text(encoding="utf-8").splitlines()[0]
        assert first.startswith("# source: https://"), path.name


def test_no_provider_error_output() -> None:
    info = parse_fi_info(fixture("fi_info_no_provider.txt"))
    assert info.provider_found is False
    assert info.devices == 0
    assert info.domains == []
    assert info.error == "fi_getinfo: -61 (No data available)"


def test_empty_output() -> None:
    info = parse_fi_info("")
    assert (info.provider_found, info.devices, info.error) == (False, 0, None)


def _entry(fabric: str, domain: str, ep_type: str = "FI_EP_RDM", provider: str = "efa") -> str:
    return (
        f"provider: {provider}\n    fabric: {fabric}\n    domain: {domain}\n    version: 201.0\n"
        f"    type: {ep_type}\n    protocol: FI_PROTO_EFA\n"
    )


def test_libfabric2_multi_device_counts_each_device_once() -> None:
    # Synthetic, built from the recorded 2.x layout (fixture above) for a p5en-like 16-EFA node:
    # efa-direct rdm, efa rdm and efa dgrm entries for every device.
    names = [f"rdmap{bus}s0" for bus in range(79, 79 + 16)]
    text = "".join(_entry("efa-direct", f"{n}-rdm") for n in names)
    text += "".join(_entry("efa", f"{n}-rdm") + _entry("efa", f"{n}-dgrm", "FI_EP_DGRAM") for n in names)
    info = parse_fi_info(text)
    assert info.devices == 16
    assert info.domains == names


def test_transitional_form_per_device_fabric_with_rdmap_domains() -> None:
    # libfabric ~1.11-1.13 on p4d printed one EFA-fe80::... fabric per device with rdmap* domains
    text = "".join(
        _entry(f"EFA-fe80::10d8:baff:fec9:{i:x}", f"rdmap{bus}s27-rdm") for i, bus in enumerate((16, 32, 144, 160))
    )
    assert parse_fi_info(text).devices == 4


def test_launcher_prefixes_are_stripped_and_ranks_deduplicated() -> None:
    body = fixture("fi_info_modern_hpc6a_1dev.txt")
    lines = [ln for ln in body.splitlines() if not ln.startswith("#")]
    text = "\n".join(f"[1,0]<stdout>:{ln}" for ln in lines) + "\n" + "\n".join(f"0: {ln}" for ln in lines)
    info = parse_fi_info(text)
    assert info.devices == 1


def test_other_providers_are_ignored() -> None:
    text = _entry("TCP-IP", "eth0", provider="tcp;ofi_rxm") + _entry("efa", "rdmap0s6-rdm")
    info = parse_fi_info(text)
    assert (info.provider_found, info.devices) == (True, 1)
    assert parse_fi_info(_entry("TCP-IP", "eth0", provider="tcp")).provider_found is False


def test_layered_provider_counts_as_efa() -> None:
    info = parse_fi_info(_entry("EFA-fe80::1", "efa_0-dgrm", provider="efa;ofi_rxd"))
    assert (info.provider_found, info.devices) == (True, 1)


@pytest.mark.parametrize(
    "domain,device",
    [("rdmap16s27-rdm", "rdmap16s27"), ("rdmap16s27-dgrm", "rdmap16s27"), ("efa_0-rdm", "efa_0"), ("mlx5_0", "mlx5_0")],
)
def test_device_of_domain(domain: str, device: str) -> None:
    assert device_of_domain(domain) == device


# --------------------------------------------------------------------------- run_fi_info (tool stubs)


def _stub(tmp_path: Path, name: str, body: str) -> str:
    path = tmp_path / name
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


def test_run_fi_info_parses_tool_output(tmp_path: Path) -> None:
    fx = FIXTURES / "fi_info_modern_p4de_4dev.txt"
    tool = _stub(tmp_path, "fi_info", f'[ "$1" = "-p" ] && [ "$2" = "efa" ] || exit 9\ncat "{fx}"\n')
    info = run_fi_info(tool)
    assert (info.ran, info.provider_found, info.devices) == (True, True, 4)


def test_run_fi_info_error_on_stderr_and_nonzero_exit(tmp_path: Path) -> None:
    tool = _stub(tmp_path, "fi_info", 'echo "fi_getinfo: -61 (No data available)" >&2\nexit 1\n')
    info = run_fi_info(tool)
    assert info.ran is True
    assert info.provider_found is False
    assert info.error == "fi_getinfo: -61 (No data available)"


def test_run_fi_info_missing_binary(tmp_path: Path) -> None:
    info = run_fi_info(str(tmp_path / "nope" / "fi_info"))
    assert info.ran is False
    assert info.error == "fi_info not found"
    assert run_fi_info("fi_info-definitely-not-installed-xyz").error == "fi_info-definitely-not-installed-xyz not found"


def test_run_fi_info_timeout_kills_the_tool(tmp_path: Path) -> None:
    pidfile = tmp_path / "pid"
    # the stub and its child must both die: a hung fi_info must not outlive the prolog
    tool = _stub(tmp_path, "fi_info", f'sleep 30 &\necho $! > "{pidfile}"\nwait\n')
    t0 = time.monotonic()
    info = run_fi_info(tool, timeout_s=0.5)
    assert time.monotonic() - t0 < 3.0
    assert info.ran is False
    assert info.error is not None and "timed out" in info.error
    child = int(pidfile.read_text())
    deadline = time.monotonic() + 2.0
    while time.monotonic() < deadline:
        if not _alive(child):
            break
        time.sleep(0.05)
    else:
        pytest.fail("fi_info's child process survived the timeout")


def _alive(pid: int) -> bool:
    """Running, not merely a zombie waiting for whatever PID 1 is in this container to reap it."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
    except OSError:  # no procfs: fall back to signal 0
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True


# --------------------------------------------------------------------------- sysfs


def test_parse_sysfs_state() -> None:
    assert parse_sysfs_state("4: ACTIVE\n") == "ACTIVE"
    assert parse_sysfs_state("5: LinkUp") == "LinkUp"
    assert parse_sysfs_state("3: Disabled") == "Disabled"
    assert parse_sysfs_state("ACTIVE") == "ACTIVE"
    assert parse_sysfs_state("") is None
    assert parse_sysfs_state(None) is None


def test_missing_infiniband_dir_is_empty(tmp_path: Path) -> None:
    assert read_rdma_devices(str(tmp_path)) == []


def test_fake_tree_has_kernel_layout(tmp_path: Path) -> None:
    write_fake_infiniband(tmp_path, [{"name": "rdmap16s27", "kind": "efa"}])
    dev = tmp_path / "class" / "infiniband" / "rdmap16s27"
    assert dev.is_symlink()
    assert (dev / "ports" / "1" / "state").read_text() == "4: ACTIVE\n"
    assert (dev / "ports" / "1" / "phys_state").read_text() == "5: LinkUp\n"
    assert os.path.basename(os.readlink(dev / "device" / "driver")) == "efa"


def test_efa_tree_with_a_port_down(tmp_path: Path) -> None:
    names = ["rdmap16s27", "rdmap32s27", "rdmap144s27", "rdmap160s27"]
    devices = [
        {
            "name": n,
            "kind": "efa",
            "ports": [{"port": 1, "state": "ACTIVE", "phys_state": "LinkUp", "rate": "100 Gb/sec (4X EDR)",
                       "link_layer": "Unspecified"}],
        }
        for n in names
    ]
    devices[2]["ports"] = [{"port": 1, "state": "DOWN", "phys_state": "Disabled", "link_layer": "Unspecified"}]
    write_fake_infiniband(tmp_path, devices)
    got = read_rdma_devices(str(tmp_path))
    assert [d.name for d in got] == ["rdmap16s27", "rdmap32s27", "rdmap144s27", "rdmap160s27"]
    assert {d.kind for d in got} == {"efa"}
    states = {d.name: (d.ports[0].state, d.ports[0].phys_state) for d in got}
    assert states["rdmap144s27"] == ("DOWN", "Disabled")
    assert states["rdmap16s27"] == ("ACTIVE", "LinkUp")
    assert got[0].ports[0].rate == "100 Gb/sec (4X EDR)"
    assert got[0].ports[0].link_layer == "Unspecified"


def test_ib_tree_like_an_h100_node(tmp_path: Path) -> None:
    # shaped after gpud's ibstat testdata of an 8x H100 node: eight CX-7 IB HCAs with gaps in the
    # numbering, one of them down, plus an Ethernet bond (RoCE) that is not part of the IB fabric
    ib = ["mlx5_0", "mlx5_1", "mlx5_4", "mlx5_5", "mlx5_6", "mlx5_7", "mlx5_8", "mlx5_9"]
    devices: list[dict] = [{"name": n, "kind": "ib"} for n in ib]
    devices[5]["ports"] = [{"port": 1, "state": "DOWN", "phys_state": "Polling"}]
    devices.append({"name": "mlx5_bond_0", "kind": "roce", "ports": [{"port": 1, "rate": "200 Gb/sec (2X NDR)"}]})
    write_fake_infiniband(tmp_path, devices)
    got = {d.name: d for d in read_rdma_devices(str(tmp_path))}
    assert list(got)[:3] == ["mlx5_0", "mlx5_1", "mlx5_4"]  # natural order
    assert [n for n, d in got.items() if d.kind == "ib"] == ib
    assert got["mlx5_bond_0"].kind == "roce"
    assert got["mlx5_7"].ports[0].state == "DOWN"
    assert got["mlx5_7"].ports[0].phys_state == "Polling"
    assert got["mlx5_0"].ports[0].rate == "400 Gb/sec (4X NDR)"
    assert got["mlx5_0"].ports[0].link_layer == "InfiniBand"


def test_multi_port_device_and_missing_files(tmp_path: Path) -> None:
    write_fake_infiniband(
        tmp_path,
        [{"name": "mlx5_2", "kind": "ib", "ports": [{"port": 1}, {"port": 2, "state": "INIT", "rate": None}]}],
    )
    (dev,) = read_rdma_devices(str(tmp_path))
    assert [p.port for p in dev.ports] == [1, 2]
    assert dev.ports[1].state == "INIT"
    assert dev.ports[1].rate is None  # the file is absent


def test_kind_without_driver_link_falls_back_to_name(tmp_path: Path) -> None:
    write_fake_infiniband(
        tmp_path,
        [
            {"name": "efa_0", "kind": "efa", "driver": ""},
            {"name": "mlx5_3", "kind": "roce", "driver": ""},
            {"name": "irdma0", "kind": "other", "driver": "irdma"},
        ],
    )
    got = {d.name: d.kind for d in read_rdma_devices(str(tmp_path))}
    assert got == {"efa_0": "efa", "irdma0": "other", "mlx5_3": "roce"}


@pytest.mark.parametrize(
    "name,driver,layers,kind",
    [
        ("rdmap16s27", "efa", ["Unspecified"], "efa"),
        ("weird0", "efa", [None], "efa"),
        ("efa_0", None, [], "efa"),
        ("mlx5_0", "mlx5_core", ["InfiniBand"], "ib"),
        ("mlx5_0", None, [], "ib"),
        ("mlx5_1", "mlx5_core", ["Ethernet"], "roce"),
        ("ibp24s0", "mlx5_core", ["InfiniBand"], "ib"),
        ("bnxt_re0", "bnxt_en", ["Ethernet"], "other"),
    ],
)
def test_classify(name: str, driver: str | None, layers: list[str | None], kind: str) -> None:
    assert classify_rdma_device(name, driver, layers) == kind


# --------------------------------------------------------------------------- read_fabric


def test_read_fabric_sysfs_only(tmp_path: Path) -> None:
    write_fake_infiniband(tmp_path, [{"name": "rdmap0s6", "kind": "efa"}])
    obs = read_fabric(str(tmp_path))
    assert obs.status.complete
    assert [d.name for d in obs.devices] == ["rdmap0s6"]
    assert obs.fi_info is None


def test_read_fabric_with_fi_info(tmp_path: Path) -> None:
    write_fake_infiniband(tmp_path / "sys", [{"name": f"rdmap{b}s27", "kind": "efa"} for b in (16, 32, 144, 160)])
    fx = FIXTURES / "fi_info_modern_p4de_4dev.txt"
    tool = _stub(tmp_path, "fi_info", f'cat "{fx}"\n')
    obs = read_fabric(str(tmp_path / "sys"), fi_info=tool)
    assert obs.status.complete
    assert obs.fi_info is not None and obs.fi_info.devices == 4
    assert sorted(d.name for d in obs.devices) == sorted(obs.fi_info.domains)


def test_read_fabric_missing_tool_is_incomplete_not_raised(tmp_path: Path) -> None:
    obs = read_fabric(str(tmp_path), fi_info=str(tmp_path / "no-fi_info"))
    assert obs.devices == []
    assert obs.status.complete is False
    assert obs.status.error == "fi_info: no-fi_info not found"


def test_read_fabric_timeout_marks_status(tmp_path: Path) -> None:
    tool = _stub(tmp_path, "fi_info", "exec sleep 30\n")
    obs = read_fabric(str(tmp_path), fi_info=tool, timeout_s=0.3)
    assert obs.status.complete is False
    assert obs.status.timed_out is True
    assert obs.status.duration_s < 3.0
