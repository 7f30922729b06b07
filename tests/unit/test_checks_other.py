"""Xid, fabric and host checks."""

import os

import pytest

from gpuguard.checks import CheckInput, get_check, param_defaults
from gpuguard.model import (Action, DiskUsage, FabricObservation, FiInfo, GpuInfo, KernelLogObservation,
                            NvmlObservation, Observations, ProbeStatus, RdmaDevice, RdmaPort, Severity,
                            SystemObservation, XidEvent)
from gpuguard.profiles import load_profile
from gpuguard.xid.catalog import load_catalog

P5 = load_profile("p5.48xlarge")
DGX = load_profile("dgx-h100-ib")
CATALOG = load_catalog()

# Real driver lines (NVIDIA forums / GitHub issues, see tests/fixtures/kernel_log/)
XID79 = XidEvent(79, "0000:86:00", "GPU has fallen off the bus.", pid=None,
                 raw="NVRM: Xid (PCI:0000:86:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus.")
XID13 = XidEvent(13, "0000:53:00", "Graphics SM Warp Exception on (GPC 0, TPC 1, SM 0): Out Of Range Address",
                 pid=4242, process_name="python")
XID48 = XidEvent(48, "0000:86:00", "An uncorrectable double bit error (DBE) has been detected on GPU in the framebuffer")


def run(check_id, obs, profile=P5, params=None, job_gpus=None):
    spec = get_check(check_id)
    inp = CheckInput(profile=profile, params={**param_defaults(spec), **(params or {})}, job_gpus=job_gpus,
                     kind="prolog", xid_catalog=CATALOG)
    return spec(obs, inp)


def klog(*events, **kw):
    nvml = NvmlObservation(device_count=8, gpus=[GpuInfo(index=3, pci_bus_id="0000:86:00.0")])
    return Observations(nvml=nvml, kernel_log=KernelLogObservation(source="kmsg:/dev/kmsg", events=list(events), **kw))


def test_fatal_xid_fails_with_catalog_action_and_gpu():
    f = run("gpu.xid", klog(XID79))
    assert len(f) == 1 and f[0].severity is Severity.FAIL
    assert f[0].keyword == "XID79" and f[0].action is Action.REBOOT and f[0].gpu == 3
    assert "GPU 3 0000:86:00" in f[0].message


def test_app_xid_is_recorded_not_fatal():
    f = run("gpu.xid", klog(XID13))
    assert [x.severity for x in f] == [Severity.OK] and f[0].evidence["xids"][0]["code"] == 13


def test_several_xids_on_one_gpu_make_one_finding_with_strongest_action():
    f = run("gpu.xid", klog(XID48, XID79, XID13))
    fails = [x for x in f if x.severity is Severity.FAIL]
    assert len(fails) == 1 and fails[0].action is Action.REBOOT and "also Xid 48" in fails[0].message


def test_forged_lines_warn_but_never_fail():
    f = run("gpu.xid", klog(rejected_non_kernel=2))
    assert [x.severity for x in f] == [Severity.WARN] and "not from the kernel" in f[0].message


def test_unreadable_log_is_incomplete():
    f = run("gpu.xid", klog(status=ProbeStatus(complete=False, error="permission denied")))
    assert f[0].severity is Severity.INCOMPLETE


def test_xid_override_to_fatal():
    cat = load_catalog(overrides={13: {"severity": "fatal", "action": "reset"}})
    spec = get_check("gpu.xid")
    f = spec(klog(XID13), CheckInput(profile=P5, xid_catalog=cat))
    assert f[0].severity is Severity.FAIL and f[0].action is Action.RESET


def efa_obs(n=32, down=(), fi=None):
    devs = [RdmaDevice(f"rdmap{16 + i}s27", "efa", [RdmaPort(1, "DOWN" if i in down else "ACTIVE")]) for i in range(n)]
    return Observations(fabric=FabricObservation(devices=devs, fi_info=fi or FiInfo(ran=True, provider_found=True,
                                                                                        devices=n)))


def test_efa_healthy_missing_down_provider():
    assert run("fabric.efa", efa_obs())[0].severity is Severity.OK
    # an interface this node had is gone (failed card): drains for an admin: a reboot cannot attach it, and a
    # reboot action would escalate to replace
    lost = efa_obs(31, fi=FiInfo(ran=True, provider_found=True, devices=31))
    lost.previous = {"inventory": {"efa": 32}}
    f = run("fabric.efa", lost)
    assert f[0].keyword == "EFA" and "32 EFA devices expected, 31 found: 1 gone (this node had 32)" in f[0].message
    assert (f[0].severity, f[0].action) == (Severity.FAIL, Action.DRAIN)
    down = run("fabric.efa", efa_obs(down=(5,)))[0]
    assert "rdmap21s27/1:DOWN" in down.message and down.action is Action.REBOOT  # a link down: hardware
    f = run("fabric.efa", efa_obs(fi=FiInfo(ran=True, provider_found=False, error="fi_getinfo: -61")))
    assert f[0].severity is Severity.FAIL and "provider efa not available" in f[0].message
    assert f[0].action is Action.DRAIN  # software on the node, not hardware
    assert run("fabric.efa", efa_obs(fi=FiInfo(ran=False, error="fi_info not found")))[0].severity is Severity.INCOMPLETE
    assert run("fabric.efa", efa_obs(fi=FiInfo(ran=False)), params={"check_provider": False})[0].severity is Severity.OK
    assert run("fabric.efa", efa_obs(), profile=DGX)[0].severity is Severity.SKIP
    # libfabric sees fewer devices than sysfs: software or a device libfabric cannot open, on this node
    f = run("fabric.efa", efa_obs(fi=FiInfo(ran=True, provider_found=True, devices=30)))[0]
    assert (f.severity, f.action) == (Severity.FAIL, Action.DRAIN) and "libfabric sees 30 of the 32" in f.message


@pytest.mark.parametrize("count", [4, 0])
def test_efa_fewer_than_the_profile_on_a_node_that_never_had_more_warns(count):
    """A p5 launched with 4 of its 32 EFA interfaces, or none (single-node work): the launch template's choice, the
    same on every node it launched; draining for it drains the fleet. It warns, once per node as news
    (first_seen), and never counts the missing libfabric provider of a node without EFA against it."""
    fi = FiInfo(ran=True, provider_found=True, devices=count) if count else FiInfo(ran=True, error="fi_getinfo: -61")
    (f,) = run("fabric.efa", efa_obs(count, fi=fi))
    assert (f.severity, f.action, f.evidence["launch_choice"], f.evidence["first_seen"]) == (
        Severity.WARN, Action.NONE, True, True)
    assert f"32 EFA devices expected, {count} found: this node never had more" in f.message
    later = efa_obs(count, fi=fi)
    later.previous = {"inventory": {"efa": count}}
    (f,) = run("fabric.efa", later)
    assert f.severity is Severity.WARN and f.evidence["first_seen"] is False


def test_efa_count_not_judged_when_sysfs_was_not_read():
    obs = efa_obs(0)
    obs.fabric.status = ProbeStatus(complete=False, error="fabric probe timed out after 5s", timed_out=True)
    obs.previous = {"inventory": {"efa": 32}}
    (f,) = run("fabric.efa", obs)
    assert f.severity is Severity.INCOMPLETE and "timed out" in f.message


def ib_obs(names, down=(), rate="400 Gb/sec (4X NDR)"):
    devs = [RdmaDevice(n, "ib", [RdmaPort(1, "DOWN" if n in down else "ACTIVE", rate=rate)]) for n in names]
    return Observations(fabric=FabricObservation(devices=devs))


def test_ib_uses_compute_hcas_only():
    compute = list(DGX.ib_compute_devices)
    storage_down = ib_obs(compute + ["mlx5_1", "mlx5_2"], down=("mlx5_1", "mlx5_2"))
    assert run("fabric.ib", storage_down, profile=DGX)[0].severity is Severity.OK
    f = run("fabric.ib", ib_obs(compute[1:]), profile=DGX)[0]
    assert f.severity is Severity.WARN and "missing mlx5_0" in f.message  # never seen with it: a cabling choice
    lost = ib_obs(compute[1:])
    lost.previous = {"inventory": {"ib": len(compute)}}
    f = run("fabric.ib", lost, profile=DGX)[0]
    assert (f.severity, f.action) == (Severity.FAIL, Action.DRAIN) and "missing mlx5_0" in f.message
    assert "mlx5_4/1:DOWN" in run("fabric.ib", ib_obs(compute, down=("mlx5_4",)), profile=DGX)[0].message
    f = run("fabric.ib", ib_obs(compute, rate="200 Gb/sec (4X HDR)"), profile=DGX)[0]
    assert f.severity is Severity.FAIL and "below 400 Gb/s" in f.message


def sysobs(**kw):
    base = dict(cpus_online=192, mem_total_mib=2_000_000, mem_available_mib=1_900_000,
                disks=[DiskUsage("/", 100_000, 50_000), DiskUsage("/tmp", 100_000, 50_000)])
    base.update(kw)
    return Observations(system=SystemObservation(**base))


def test_system_checks():
    assert run("sys.memory", sysobs())[0].severity is Severity.OK
    # less memory than the profile: a failed DIMM or a profile that does not fit; warns (drains when asked),
    # never replace (which would also escalate)
    f = run("sys.memory", sysobs(mem_total_mib=1_500_000))[0]
    assert (f.severity, f.action) == (Severity.WARN, Action.NONE)
    f = run("sys.memory", sysobs(mem_total_mib=1_500_000), params={"total_severity": "fail"})[0]
    assert (f.severity, f.action) == (Severity.FAIL, Action.DRAIN)
    f = run("sys.memory", sysobs(mem_available_mib=10_000), params={"min_available_gib": 64})[0]
    assert f.keyword == "MEM" and "need 64 GiB" in f.message
    assert run("sys.cpu", sysobs(cpus_online=96))[0].keyword == "CPU"
    assert run("sys.cpu", sysobs(cpus_online=96))[0].severity is Severity.WARN
    # a full /tmp (any user can fill it) warns: users must not be able to drain the node their job ran on
    tmp = DiskUsage("/tmp", 100_000, 500, owner_uid=0, world_writable=True)
    f = run("sys.disk", sysobs(disks=[DiskUsage("/", 100_000, 50_000), tmp]))[0]
    assert (f.severity, f.action) == (Severity.WARN, Action.NONE) and "/tmp has 0.5 GiB free" in f.message
    assert f.evidence["user_writable"] is True
    f = run("sys.disk", sysobs(disks=[DiskUsage("/", error="Stale file handle")]), params={"paths": [{"path": "/", "min_free_gib": 1}]})
    assert f[0].severity is Severity.FAIL and "Stale file handle" in f[0].message
    assert run("sys.memory", sysobs(), profile=load_profile("generic"))[0].severity is Severity.SKIP


ROOT_OWNED = {"paths": [{"path": "/var/lib/slurm", "min_free_gib": 1, "root_owned": True}]}


@pytest.mark.parametrize("owner, world, severity, says", [
    (0, False, Severity.FAIL, "need 1"),  # what the site says: only root writes there -> a full disk drains
    (0, True, Severity.WARN, "marked root_owned but world-writable"),  # the claim does not hold: warn, say so
    (1000, False, Severity.WARN, "marked root_owned but owned by uid 1000"),
    (None, None, Severity.FAIL, "need 1"),  # ownership unknown: the site's word stands
])
def test_disk_drains_only_for_root_owned_paths(owner, world, severity, says):
    disk = DiskUsage("/var/lib/slurm", 100_000, 100, owner_uid=owner, world_writable=world)
    (f,) = run("sys.disk", sysobs(disks=[disk]), params=ROOT_OWNED)
    assert f.severity is severity and says in f.message
    (f,) = run("sys.disk", sysobs(disks=[disk]), params={"paths": [{"path": "/var/lib/slurm", "min_free_gib": 1}]})
    assert f.severity is Severity.WARN and "root_owned paths drain" in f.message


def test_disk_probe_reads_owner_and_mode(tmp_path):
    from gpuguard.probes.system import read_disk

    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o1777)
    d = read_disk(str(shared))
    assert d.world_writable is True and d.owner_uid == os.getuid() and d.free_mib is not None
    shared.chmod(0o755)
    assert read_disk(str(shared)).world_writable is False
    gone = read_disk(str(tmp_path / "absent"))
    assert gone.error and gone.free_mib is None and gone.owner_uid is None


MEMINFO_P5 = """MemTotal:       2113399188 kB
MemFree:        2064023544 kB
MemAvailable:   2080231456 kB
Buffers:           12964 kB
Cached:          24561408 kB
HugePages_Total:       0
Hugepagesize:       2048 kB
"""  # shape of /proc/meminfo on a p5.48xlarge (2 TiB), values as the kernel prints them


def test_system_probe_reads_a_procfs_root(tmp_path):
    from gpuguard.probes.system import parse_meminfo, read_system

    assert parse_meminfo(MEMINFO_P5)["MemAvailable"] == 2080231456
    (tmp_path / "proc").mkdir()
    (tmp_path / "proc" / "meminfo").write_text(MEMINFO_P5)
    (tmp_path / "sys/devices/system/cpu").mkdir(parents=True)
    (tmp_path / "sys/devices/system/cpu/online").write_text("0-95,128-191\n")
    obs = read_system(["/", "/nonexistent-gpuguard"], procfs_root=str(tmp_path / "proc"),
                      sysfs_root=str(tmp_path / "sys"))
    assert obs.mem_total_mib == 2113399188 // 1024 and obs.cpus_online == 160
    assert obs.disks[0].free_mib and obs.disks[1].error
    broken = read_system([], procfs_root=str(tmp_path / "nothing"))
    assert not broken.status.complete and broken.mem_total_mib is None


# --------------------------------------------------------------------------- CPUs: SMT off is not a fault


@pytest.mark.parametrize("online,smt_active,control,offline,expected", [
    (192, True, "on", "", Severity.OK),
    (96, False, "off", "", Severity.OK),            # SMT off in BIOS / nosmt: one thread per core
    (96, False, "notsupported", "", Severity.OK),   # EC2 CpuOptions ThreadsPerCore=1: the guest sees no SMT
    (96, True, "on", "96-191", Severity.WARN),      # half the CPUs taken offline by hand: tell, do not drain
    (180, True, "on", "180-191", Severity.WARN),
    (128, None, None, None, Severity.WARN),          # a different node type than the profile says
])
def test_cpu_count_accepts_one_thread_per_core(online, smt_active, control, offline, expected):
    f = run("sys.cpu", sysobs(cpus_online=online, smt_active=smt_active, smt_control=control,
                              cpus_offline=offline))[0]
    assert f.severity is expected, f.message
    assert f.action in (Action.NONE, Action.DRAIN)  # a count is a configuration fact: never reboot or replace
    if expected is Severity.WARN and offline:
        assert f"offline: {offline}" in f.message
    f = run("sys.cpu", sysobs(cpus_online=96, smt_active=True, smt_control="on"), params={"severity": "fail"})[0]
    assert (f.severity, f.action) == (Severity.FAIL, Action.DRAIN)


def test_smt_probe_reads_sysfs(tmp_path):
    from gpuguard.probes.system import read_system

    cpu = tmp_path / "devices/system/cpu"
    (cpu / "smt").mkdir(parents=True)
    (cpu / "online").write_text("0-95\n")
    (cpu / "offline").write_text("\n")
    (cpu / "smt" / "active").write_text("0\n")
    (cpu / "smt" / "control").write_text("notsupported\n")  # what a 16-vCPU Firecracker VM with an H100 shows
    obs = read_system(sysfs_root=str(tmp_path), procfs_root=str(tmp_path))
    assert (obs.cpus_online, obs.smt_active, obs.smt_control, obs.cpus_offline) == (96, False, "notsupported", "")
