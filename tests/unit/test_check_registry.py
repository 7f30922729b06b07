"""A check has one home (issue 14): its CheckSpec. Every registered check declares its keywords, priority, scope,
probe and runbook section, and has a failing fixture here; the tables other modules used to keep by hand (node
scope, priority, the reset-only checks, the reason keywords) are derived from the registry; a check that emits a
keyword it did not declare can never make `policy.decide` raise at the first real fault (the hook would fail open)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import Callable

import pytest

from gpuguard import checks
from gpuguard.checks import registered
from gpuguard.pipeline import policy
from gpuguard.slurm import reason
from gpuguard.checks import (ALL_KINDS, CheckInput, CheckSpec, cleared_only_by_reset, get_check, is_hardware_evidence,
                             node_scope, param_defaults, probe_options, registry, run_check)
from gpuguard.checks.gpu.memory_errors import RECOVERY_ACTIONS
from gpuguard.siteconfig import parse_config
from gpuguard.model import (Action, DiskUsage, FabricObservation, FiInfo, Finding, GpuProcess, JobCleanup,
                            KernelLogObservation, NvmlObservation, Observations, ProbeStatus, RdmaDevice, RdmaPort,
                            Severity, SystemObservation, XidEvent)
from gpuguard.nccl.parse import parse_nccl
from gpuguard.nccl.probe import NcclObservation
from gpuguard.probes.dcgm import parse_dcgm_diag
from gpuguard.probes.efa_counters import EfaCounterObservation, EfaPortCounters
from gpuguard.profiles import Profile, load_profile
from gpuguard.xid.catalog import load_catalog
from h100 import bad_gpu, h100, node

ROOT = Path(__file__).resolve().parents[2]
FIX = ROOT / "tests" / "fixtures"
P5 = load_profile("p5.48xlarge")
DGX = load_profile("dgx-h100-ib")
# A check id and keyword no real check or documented example uses: the tests' stand-ins for "not registered"
UNREGISTERED_ID, UNREGISTERED_KEYWORD = "testonly.unregistered", "TESTONLY"


def with_previous(obs: Observations, **previous) -> Observations:
    obs.previous = previous
    return obs


def efa(n: int = 32, down: tuple[int, ...] = ()) -> FabricObservation:
    devs = [RdmaDevice(f"rdmap{16 + i}s27", "efa", [RdmaPort(1, "DOWN" if i in down else "ACTIVE")]) for i in range(n)]
    return FabricObservation(devices=devs, fi_info=FiInfo(ran=True, provider_found=True, devices=n))


def xid_log(code: int, pci: str = "0000:86:00") -> KernelLogObservation:
    return KernelLogObservation(source="kmsg", events=[XidEvent(code, pci, "GPU has fallen off the bus.")])


def nccl_result(name: str) -> NcclObservation:
    return NcclObservation(ran=True, exit_code=0, result=parse_nccl((FIX / "nccl" / name).read_text()))


def dcgm_hardware_failure() -> Observations:
    """The recorded DCGM 4.x run (its 2-line banner dropped) with the memory test failing on GPU 3 (a DBE)."""
    import json

    doc = json.loads((FIX / "dcgm" / "dcgm4_gb10_level2_plugins_allowed.json").read_text().split("\n", 2)[2])
    mem = doc["DCGM Diagnostic"]["test_categories"][1]["tests"][0]
    mem["results"][0].update(entity_id=3, status="Fail", warnings=[{
        "error_category": 0, "error_id": 16, "error_severity": 6,
        "warning": "Pending page retirements together with a DBE were detected on GPU 3."}])
    mem["test_summary"]["status"] = "Fail"
    return Observations(dcgm=parse_dcgm_diag(json.dumps(doc)))


def sys_obs(**kw) -> Observations:
    base = dict(cpus_online=192, mem_total_mib=2_000_000, mem_available_mib=1_900_000, disks=[])
    base.update(kw)
    return Observations(system=SystemObservation(**base))


def _todo(what: str) -> Observations:
    """A scaffolded check's failing fixture, still to write (devtools/newcheck.py puts it in FAILING)."""
    raise NotImplementedError(what)


# check id -> failing fixtures: (observations, profile, params, job GPUs). Real-world shapes: NVML values as a real
# H100 SXM reports them, a real Xid 79 line, recorded nccl-tests and dcgmi outputs (tests/fixtures/).
Case = tuple[Callable[[], Observations], Profile, dict, "tuple[int, ...] | None"]
FAILING: dict[str, list[Case]] = {
    "gpu.nvml": [
        (lambda: Observations(nvml=NvmlObservation(status=ProbeStatus(complete=False), init_error="DRIVER_NOT_LOADED")),
         P5, {}, None),
        (lambda: Observations(nvml=NvmlObservation(status=ProbeStatus(complete=False, timed_out=True),
                                                   init_error="TIMEOUT")), P5, {}, None),
        (lambda: bad_gpu(3, fatal_error="GPU_IS_LOST"), P5, {}, None),
    ],
    "gpu.count": [(lambda: Observations(nvml=NvmlObservation(device_count=7, gpus=[h100(i) for i in range(7)])),
                   P5, {}, None)],
    "gpu.model": [(lambda: bad_gpu(1, name="NVIDIA A100-SXM4-80GB"), P5, {"severity": "fail"}, None)],
    "gpu.memory": [(lambda: bad_gpu(1, memory_total_mib=40_000), P5, {}, None)],
    "gpu.ecc": [(lambda: bad_gpu(5, ecc_volatile_uncorrected=2), P5, {}, None),
                (lambda: bad_gpu(5, ecc_volatile_uncorrected=None, errors={"ecc_volatile_uncorrected": "UNKNOWN"}),
                 P5, {}, None)],
    "gpu.retired_pages": [(lambda: Observations(nvml=NvmlObservation(device_count=1, gpus=[h100(
        0, retired_pages_pending=True, retired_pages_sbe=2, retired_pages_dbe=1)])), P5, {}, None)],
    "gpu.row_remap": [(lambda: bad_gpu(2, remapped_rows_failure=True), P5, {}, None),
                      (lambda: bad_gpu(2, remapped_rows_pending=True), P5, {}, None)],
    "gpu.recovery_action": [(lambda: bad_gpu(2, recovery_action=code), P5, {}, None) for code in RECOVERY_ACTIONS]
    + [(lambda: bad_gpu(2, recovery_action=None), P5, {}, None)],
    "gpu.xid": [(lambda: Observations(kernel_log=xid_log(79), nvml=node().nvml), P5, {}, None),
                (lambda: Observations(kernel_log=KernelLogObservation(source="kmsg", rejected_non_kernel=2)), P5, {},
                 None)],  # forged NVRM lines (logger): warned, never drained
    "gpu.temperature": [(lambda: bad_gpu(6, temperature_c=91), P5, {}, None)],
    "gpu.throttle": [(lambda: bad_gpu(6, clock_event_reasons=0x48), P5, {}, None)],
    "gpu.pcie": [(lambda: with_previous(bad_gpu(6, pcie_width_current=8, clock_event_reasons=0, utilization_gpu_pct=99),
                                        inventory={"pcie": {"GPU-6": [5, 16]}}), P5, {}, None)],
    "gpu.nvlink": [(lambda: bad_gpu(2, nvlink_active=[True] * 3 + [False] + [True] * 14), P5, {}, None),
                   (lambda: with_previous(bad_gpu(2, nvlink_active=[True] * 12), inventory={"nvlinks": {"GPU-2": 18}}),
                    P5, {}, None)],
    "gpu.fabric": [(lambda: bad_gpu(2, fabric_state=1), P5, {}, None),
                   (lambda: bad_gpu(2, fabric_health_mask=0x1), P5, {}, None)],
    "gpu.processes": [(lambda: bad_gpu(1, processes=[GpuProcess(4242, 30_000, "python")]), P5, {}, (0, 1))],
    "gpu.leftovers": [(lambda: Observations(cleanup=JobCleanup(survivors=[GpuProcess(77)])), P5, {}, (0,))],
    "gpu.memory_released": [(lambda: bad_gpu(0, memory_used_mib=8000), P5, {}, (0,))],
    "fabric.efa": [(lambda: Observations(fabric=efa(down=(5,))), P5, {}, None),
                   (lambda: with_previous(Observations(fabric=efa(28)), inventory={"efa": 32}), P5, {}, None)],
    "fabric.ib": [(lambda: with_previous(Observations(fabric=FabricObservation(devices=[
        RdmaDevice(n, "ib", [RdmaPort(1, "ACTIVE", rate="400 Gb/sec (4X NDR)")]) for n in DGX.ib_compute_devices[1:]])),
        inventory={"ib": len(DGX.ib_compute_devices)}), DGX, {}, None)],
    "fabric.efa_counters": [(lambda: Observations(efa_counters=EfaCounterObservation(
        ports=[EfaPortCounters("rdmap16s27", 1, {"rx_drops": 900})], deltas={"rdmap16s27/1": {"rx_drops": 900}},
        interval_s=300.0)), P5, {"max_rx_drops": 10}, None)],
    "nccl.busbw": [(lambda: Observations(nccl=nccl_result("p5_2node_srun_label.txt")), P5,
                    {"min_busbw_gbps": 10_000}, None)],
    "dcgm.diag": [(dcgm_hardware_failure, P5, {}, None)],
    "sys.memory": [(lambda: sys_obs(mem_available_mib=10_000), P5, {"min_available_gib": 64}, None)],
    "sys.disk": [(lambda: sys_obs(disks=[DiskUsage("/var/lib/slurm", 100_000, 100, owner_uid=0, world_writable=False)]),
                  P5, {"paths": [{"path": "/var/lib/slurm", "min_free_gib": 1, "root_owned": True}]}, None),
                 (lambda: sys_obs(disks=[DiskUsage("/tmp", 100_000, 100, owner_uid=0, world_writable=True)]),
                  P5, {"paths": [{"path": "/tmp", "min_free_gib": 1}]}, None)],
    "sys.cpu": [(lambda: sys_obs(cpus_online=96), P5, {"severity": "fail"}, None)],
}


def _run(spec: CheckSpec, case: Case) -> list[Finding]:
    make, profile, params, job = case
    inp = CheckInput(profile=profile, params={**param_defaults(spec), **params}, job_gpus=job, kind="healthcheck",
                     xid_catalog=load_catalog())
    return spec(make(), inp)


def test_every_registered_check_has_a_failing_fixture():
    assert set(FAILING) == {s.id for s in registry()}


@pytest.mark.parametrize("check_id", sorted(FAILING))
def test_checks_emit_only_keywords_their_spec_declares(check_id):
    """Run over its failing fixtures, a check finds something, and every keyword it emits is one it declares (so
    reason.format_reason, which only takes declared keywords, never raises at the first real fault)."""
    spec = get_check(check_id)
    for case in FAILING[check_id]:
        found = _run(spec, case)
        bad = [f for f in found if f.severity not in (Severity.OK, Severity.SKIP)]
        assert bad, (check_id, found)
        for f in bad:
            assert f.check_id == check_id and f.keyword and spec.declares(f.keyword), (f.keyword, spec.keywords)
            assert reason.valid_keyword(f.keyword)
            policy.decide([f], "healthcheck")  # never raises


@pytest.mark.parametrize("spec", registry(), ids=lambda s: s.id)
def test_every_check_is_described_in_one_place(spec):
    runbooks = (ROOT / "docs" / "runbooks.md").read_text()
    assert f'<a id="{spec.runbook_anchor}"></a>' in runbooks, f"docs/runbooks.md has no section for {spec.id}"
    section = runbooks.split(f'<a id="{spec.runbook_anchor}"></a>', 1)[1].split("\n<a id=", 1)[0].split("\n## ")[0]
    assert "TODO" not in section, section  # written, not the scaffold's placeholder
    assert spec.keywords and all(re.fullmatch(r"[A-Z]+", k) for k in spec.keywords)
    assert spec.scope in ("node", "job") and spec.needs in {
        "nvml", "kernel_log", "fabric", "system", "nccl", "dcgm", "efa_counters"}
    assert spec.kinds and spec.kinds <= ALL_KINDS | {"epilog_deep", "tier"} and spec.description
    assert re.fullmatch(r"[a-z]+\.[a-z_]+", spec.id)


def test_priorities_are_unique_and_root_causes_come_first():
    prio = [s.priority for s in registry()]
    assert len(set(prio)) == len(prio)
    order = checks.check_priority()
    assert order[:3] == ["gpu.xid", "gpu.nvml", "gpu.count"]
    # a reason names unambiguous hardware evidence before any configuration or environment check
    assert max(s.priority for s in registry() if s.hardware_evidence) < min(
        s.priority for s in registry() if not s.hardware_evidence)
    assert policy.CHECK_PRIORITY == order  # the name policy used to define by hand, now derived


def _readme_check_table() -> list[list[str]]:
    """README's table under "What the prolog checks": its rows' cells."""
    section = (ROOT / "README.md").read_text().split("## What the prolog checks", 1)[1].split("\n## ", 1)[0]
    table = section[section.index("\n| check | keyword |"):].split("\n\n", 1)[0].strip().splitlines()[2:]
    return [[c.strip() for c in line.strip().strip("|").split("|")] for line in table]


def test_readme_lists_the_checks_the_registry_has():
    """README's check table has a row for every registered check a prolog runs, with the keywords it declares
    (XID<code> is XID) and no TODO the scaffold left; its list of drain keywords is the vocabulary. A check added
    without its row fails here."""
    rows = [(re.findall(r"[a-z]+\.[a-z_]+", r[0]), set(re.findall(r"[A-Z]+", r[1])), r) for r in _readme_check_table()]
    listed = [i for ids, _, _ in rows for i in ids]
    assert sorted(listed) == sorted(s.id for s in registry() if "prolog" in s.kinds)
    for ids, kws, cells in rows:
        assert kws == {k for i in ids for k in get_check(i).keywords}, ids
        assert not any("TODO" in c for c in cells), cells
    drain = (ROOT / "README.md").read_text().split("## Drain reasons", 1)[1]
    listed_kws = drain[drain.index("Keywords: ") + len("Keywords: "):drain.index("(each check declares")]
    assert set(re.findall(r"[A-Z]+", listed_kws)) == reason.keywords()


def test_each_check_modules_docstring_names_its_checks():
    """The first paragraph of a check module's docstring names exactly the checks whose functions it holds."""
    ids = {s.id for s in registry()}
    held: dict[str, set[str]] = {}
    for s in registry():
        held.setdefault(s.func.__module__, set()).add(s.id)
    for module, own in held.items():
        first = (sys.modules[module].__doc__ or "").split("\n\n", 1)[0]
        assert set(re.findall(r"[a-z]+\.[a-z_]+", first)) & ids == own, module


def test_derived_tables():
    assert reason.keywords() == reason.BASE_KEYWORDS | {k for s in registry() for k in s.keywords}
    assert reason.KEYWORDS == reason.keywords()
    assert checks.NODE_SCOPE == node_scope()
    assert {"gpu.xid", "gpu.ecc", "gpu.row_remap", "gpu.nvlink"} <= node_scope()
    assert not {"gpu.temperature", "gpu.throttle", "gpu.processes", "gpu.pcie"} & node_scope()
    assert set(cleared_only_by_reset()) == {"gpu.recovery_action", "gpu.ecc", "gpu.row_remap", "gpu.retired_pages"}
    assert {s.id for s in registry() if s.hardware_evidence} == {
        "gpu.xid", "gpu.nvml", "gpu.count", "gpu.ecc", "gpu.retired_pages", "gpu.row_remap", "gpu.recovery_action"}


def test_importing_reason_does_not_load_the_checks():
    code = "import sys, gpuguard.slurm.reason; assert 'gpuguard.checks' not in sys.modules, sorted(sys.modules)"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_hardware_evidence_is_a_failure_of_such_a_check_never_a_mismatch():
    ecc = get_check("gpu.ecc")
    dbe = _run(ecc, FAILING["gpu.ecc"][0])[0]
    assert is_hardware_evidence(dbe)
    disabled = _run(ecc, (lambda: bad_gpu(1, ecc_enabled=False), P5, {"require_enabled": True}, None))[0]
    assert disabled.severity is Severity.FAIL and not is_hardware_evidence(disabled)  # a setting, not a fault
    assert not is_hardware_evidence(_run(get_check("sys.disk"), FAILING["sys.disk"][0])[0])


# --------------------------------------------------------------------------- item 6: decide never raises


@pytest.mark.parametrize("check_id, keyword, expected", [
    ("gpu.ecc", UNREGISTERED_KEYWORD, "ECC"),  # a keyword missing from the vocabulary: the check's default
    ("gpu.ecc", "XID79", "ECC"),  # a real keyword, but not one gpu.ecc declares
    ("gpu.nvml", "TIMEOUT", "TIMEOUT"),  # declared: kept
    ("gpu.xid", "XID79", "XID79"),
    (UNREGISTERED_ID, UNREGISTERED_KEYWORD, "INTERNAL"),  # not even a registered check
    ("gpu.ecc", "", "ECC"),
])
def test_decide_never_raises_for_an_undeclared_keyword(check_id, keyword, expected):
    f = Finding(check_id, Severity.FAIL, "something is off on GPU 3", keyword=keyword, action=Action.DRAIN)
    v = policy.decide([f], "prolog")
    assert v.outcome == "drain" and v.reason.startswith(f"gpuguard: {expected} {check_id}: ")


def test_a_new_check_is_one_registry_entry(monkeypatch):
    """What adding a check takes: the function and one CheckSpec (here under an id no real check uses). Its keyword
    reaches the reason vocabulary and its priority the decision without touching reason.py or policy.py."""
    from gpuguard.checks._util import fail, ok, spec_of

    def check_widget(obs: Observations, inp: CheckInput) -> list[Finding]:
        s = spec_of(inp)
        off = [g.index for g in obs.nvml.gpus if g.persistence_mode is False]
        return [fail(s, f"persistence mode off on GPU {off}", "nvidia-smi -pm 1")] if off else [ok(s, "on")]

    assert UNREGISTERED_ID not in {s.id for s in registry()} and not reason.valid_keyword(UNREGISTERED_KEYWORD)
    spec = CheckSpec(UNREGISTERED_ID, (UNREGISTERED_KEYWORD,), "nvml", check_widget, ALL_KINDS, {},
                     "persistence mode is on", priority=5)
    monkeypatch.setattr(registered, "_REGISTRY", registry() + [spec])
    monkeypatch.setattr(reason, "_keywords", None)
    found = run_check(spec, bad_gpu(3, persistence_mode=False), CheckInput(profile=P5))
    v = policy.decide(found + _run(get_check("sys.disk"), FAILING["sys.disk"][0]), "prolog")  # both drain
    assert v.reason.startswith(f"gpuguard: {UNREGISTERED_KEYWORD} {UNREGISTERED_ID}: persistence mode off on GPU 3 "
                               "+1 more")


# --------------------------------------------------------------------------- what a check asks of its probe


def _cfg(checks_section: dict | None = None):
    import yaml

    return parse_config(yaml.safe_dump({"checks": checks_section or {}}), source="test")


def test_probe_options_come_from_the_planned_checks():
    cfg = _cfg({"sys.disk": {"paths": [{"path": "/", "min_free_gib": 1}, {"path": "/scratch", "root_owned": True}]}})
    prolog = [s for s in registry() if "prolog" in s.kinds]
    opts = probe_options(prolog, cfg, P5)
    assert opts["nvml"] == {"with_processes": True}  # gpu.processes is a prolog check
    assert opts["fabric"] == {"fi_info": True}  # fabric.efa on a profile with a libfabric provider
    assert opts["system"] == {"disk_paths": ["/", "/scratch"]}
    hc = [s for s in registry() if "healthcheck" in s.kinds]
    assert probe_options(hc, cfg, P5)["nvml"] == {}  # nobody there asks for the process list
    off = probe_options(prolog, _cfg({"fabric.efa": {"check_provider": False}}), P5)
    assert off["fabric"] == {"fi_info": False}
    assert probe_options(prolog, cfg, DGX)["fabric"] == {"fi_info": False}  # no libfabric provider in that profile
