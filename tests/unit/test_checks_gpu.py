"""GPU checks over NVML observations of a p5.48xlarge's eight H100 80GB HBM3 (tests/unit/h100.py: 81559 MiB
framebuffer, PCIe Gen5 x16, 18 NVLinks, idle at ~30C with the GPU-idle clock reason set, persistence mode on)."""

from dataclasses import replace

import pytest

from gpuguard.checks import CheckInput, get_check, param_defaults
from gpuguard.model import Action, GpuInfo, GpuProcess, NvmlObservation, Observations, ProbeStatus, Severity
from gpuguard.profiles import load_profile
from h100 import bad_gpu, h100, node

P5 = load_profile("p5.48xlarge")


def run(check_id: str, obs: Observations, job_gpus=None, params=None, profile=P5):
    spec = get_check(check_id)
    p = {**param_defaults(spec), **(params or {})}
    return spec(obs, CheckInput(profile=profile, params=p, job_gpus=job_gpus, kind="prolog"))


def sev(findings):
    return {f.severity for f in findings}


ALL_NVML_CHECKS = ["gpu.nvml", "gpu.count", "gpu.model", "gpu.memory", "gpu.ecc", "gpu.row_remap",
                   "gpu.recovery_action", "gpu.temperature", "gpu.throttle", "gpu.pcie", "gpu.nvlink", "gpu.processes"]


@pytest.mark.parametrize("check_id", ALL_NVML_CHECKS)
def test_healthy_p5_passes_every_check(check_id):
    assert sev(run(check_id, node(), job_gpus=tuple(range(8)))) == {Severity.OK}


def test_nvml_init_failure_fails_closed():
    obs = Observations(nvml=NvmlObservation(status=ProbeStatus(complete=False), init_error="DRIVER_NOT_LOADED"))
    f = run("gpu.nvml", obs)
    assert f[0].severity is Severity.FAIL and f[0].keyword == "NVML" and f[0].action is Action.REBOOT
    # the other checks report incomplete instead of piling up failures
    assert run("gpu.ecc", obs)[0].severity is Severity.INCOMPLETE


def test_nvml_timeout_drains_with_timeout_keyword():
    obs = Observations(nvml=NvmlObservation(status=ProbeStatus(complete=False, timed_out=True, error="nvml probe timed out"),
                                            init_error="TIMEOUT"))
    f = run("gpu.nvml", obs)[0]
    assert f.severity is Severity.FAIL and f.keyword == "TIMEOUT"


def test_nvml_that_could_not_be_read_is_never_ok():
    """Seen on a machine whose interpreter lacked nvidia-ml-py: gpu.nvml said "NVML answers (driver None, None
    GPUs)". A probe that stopped before it counted the GPUs, or part-way through, is unknown, not clear."""
    for status, count in ((ProbeStatus(complete=False, error="nvidia-ml-py (pynvml) is not installed"), None),
                          (ProbeStatus(complete=False, error="nvmlDeviceGetCount: UNKNOWN"), None),
                          (ProbeStatus(complete=False, error="TypeError: boom"), 8)):
        f = run("gpu.nvml", Observations(nvml=NvmlObservation(status=status, device_count=count)))
        assert [x.severity for x in f] == [Severity.INCOMPLETE], status
        assert status.error in f[0].message and "answers" not in f[0].message


def test_no_driver_on_cpu_profile_is_skipped():
    obs = Observations(nvml=NvmlObservation(status=ProbeStatus(complete=False), init_error="LIBRARY_NOT_FOUND"))
    assert run("gpu.nvml", obs, profile=load_profile("generic"))[0].severity is Severity.SKIP


def test_gpu_lost_is_fatal_with_reboot():
    obs = bad_gpu(3, fatal_error="GPU_IS_LOST")
    f = [x for x in run("gpu.nvml", obs) if x.severity is Severity.FAIL]
    assert len(f) == 1 and f[0].gpu == 3 and f[0].action is Action.REBOOT and "GPU_IS_LOST" in f[0].message


def test_missing_gpu():
    f = run("gpu.count", node(*[h100(i) for i in range(7)]))
    assert f[0].severity is Severity.FAIL and f[0].keyword == "GPUCOUNT" and "8 GPUs expected, NVML sees 7" in f[0].message


def test_slurm_gpu_id_that_matches_no_gpu_warns():
    spec = get_check("gpu.count")
    f = spec(node(), CheckInput(profile=P5, params={}, kind="prolog", unmapped_gpus=("12",),
                                     gpu_map_notes=("GPU id 12 is a MIG GRES index (MIG is on): not mapped to a GPU",)))
    assert [x.severity for x in f] == [Severity.WARN] and "Slurm GPU id 12 matches no GPU" in f[0].message
    assert "MIG GRES index" in f[0].message


def test_wrong_model_and_memory_warn_by_default():
    """A profile that does not fit the node is a configuration mismatch: applied to a fleet at once it must not
    drain every node. It warns, and drains (never reboots) only where the site asks for it."""
    f = run("gpu.model", bad_gpu(0, name="NVIDIA A100-SXM4-40GB"))[0]
    assert (f.keyword, f.severity, f.action) == ("GPUMODEL", Severity.WARN, Action.NONE)
    assert run("gpu.memory", bad_gpu(0, memory_total_mib=40960))[0].severity is Severity.WARN
    f = run("gpu.memory", bad_gpu(0, memory_total_mib=40960), params={"severity": "fail"})[0]
    assert (f.severity, f.action) == (Severity.FAIL, Action.DRAIN)
    f = run("gpu.model", bad_gpu(0, name="NVIDIA A100-SXM4-40GB"), params={"severity": "fail"})[0]
    assert (f.severity, f.action) == (Severity.FAIL, Action.DRAIN)
    assert run("gpu.memory", bad_gpu(0, memory_total_mib=81000))[0].severity is Severity.OK  # within 2%


def test_ecc_dbe_needs_reset():
    f = run("gpu.ecc", bad_gpu(5, ecc_volatile_uncorrected=2))
    assert f[0].severity is Severity.FAIL and f[0].gpu == 5 and f[0].action is Action.RESET
    assert "2 uncorrectable ECC errors" in f[0].message


def test_ecc_disabled_and_aggregate_limit():
    # ECC off is a mode someone set: a reboot does not change it, so it never reboot-drains (nor escalates)
    f = run("gpu.ecc", bad_gpu(1, ecc_enabled=False))[0]
    assert (f.severity, f.action) == (Severity.WARN, Action.NONE)
    f = run("gpu.ecc", bad_gpu(1, ecc_enabled=False), params={"require_enabled": True})[0]
    assert (f.severity, f.action) == (Severity.FAIL, Action.DRAIN)
    f = run("gpu.ecc", bad_gpu(1, ecc_aggregate_uncorrected=12), params={"max_aggregate_uncorrected": 10})
    assert f[0].action is Action.REPLACE
    assert sev(run("gpu.ecc", bad_gpu(1, ecc_aggregate_uncorrected=12))) == {Severity.OK}  # no limit configured


def test_only_job_gpus_are_judged():
    obs = bad_gpu(5, ecc_volatile_uncorrected=2)
    assert sev(run("gpu.ecc", obs, job_gpus=(0, 1))) == {Severity.OK}
    assert Severity.FAIL in sev(run("gpu.ecc", obs, job_gpus=(5,)))


def test_row_remap_pending_and_failure():
    f = run("gpu.row_remap", bad_gpu(2, remapped_rows_pending=True, remapped_rows_uncorrectable=1))
    assert f[0].keyword == "ROWREMAP" and f[0].action is Action.RESET and "pending" in f[0].message
    f = run("gpu.row_remap", bad_gpu(2, remapped_rows_failure=True))
    assert f[0].action is Action.REPLACE and "failed" in f[0].message


def test_retired_pages_on_older_gpus():
    def v100(**kw):
        base = dict(remapped_rows_pending=None, remapped_rows_failure=None, retired_pages_sbe=1,
                    retired_pages_dbe=0, retired_pages_pending=False)
        return h100(0, **{**base, **kw})

    assert sev(run("gpu.retired_pages", node(v100()))) == {Severity.OK}
    assert run("gpu.retired_pages", node(v100(retired_pages_pending=True)))[0].action is Action.RESET
    assert run("gpu.retired_pages", node(h100(0)))[0].severity is Severity.SKIP  # H100: row remapping instead
    # 60 retired pages (1 SBE + 59 DBE) are still in service: DCGM's limit is 63 (DCGM_LIMIT_MAX_RETIRED_PAGES,
    # raised from 60 "to match the field diag")
    assert sev(run("gpu.retired_pages", node(replace(v100(), retired_pages_dbe=59)))) == {Severity.OK}
    f = run("gpu.retired_pages", node(replace(v100(), retired_pages_dbe=62)))
    assert f[0].action is Action.REPLACE and "63 retired pages (limit 63)" in f[0].message


@pytest.mark.parametrize("value,action", [(1, Action.RESET), (2, Action.REBOOT), (4, Action.RESET), (3, Action.DRAIN)])
def test_recovery_action(value, action):
    f = run("gpu.recovery_action", bad_gpu(0, recovery_action=value))
    assert f[0].severity is Severity.FAIL and f[0].action is action and f[0].keyword == "RECOVERY"


def test_recovery_action_not_reported_by_old_driver_is_skipped():
    obs = node(*[h100(i, recovery_action=None) for i in range(8)])
    assert run("gpu.recovery_action", obs)[0].severity is Severity.SKIP


# --------------------------------------------------------------------------- unknown is never clear (issue 14)


@pytest.mark.parametrize("check_id, fields, attrs", [
    ("gpu.ecc", {"errors": {"ecc_volatile_uncorrected": "UNKNOWN"}}, {"ecc_volatile_uncorrected": None}),
    ("gpu.recovery_action", {"errors": {"recovery_action": "UNKNOWN"}}, {"recovery_action": None}),
    ("gpu.row_remap", {"errors": {"remapped_rows": "TIMEOUT"}},
     {"remapped_rows_pending": None, "remapped_rows_failure": None}),
    ("gpu.temperature", {"errors": {"temperature": "CORRUPTED_INFOROM"}}, {"temperature_c": None}),
    ("gpu.throttle", {"errors": {"clock_event_reasons": "UNKNOWN"}}, {"clock_event_reasons": None}),
    ("gpu.fabric", {"errors": {"fabric": "UNKNOWN"}}, {"fabric_state": None}),
    ("gpu.memory_released", {"errors": {"memory": "UNKNOWN"}}, {"memory_used_mib": None}),
    ("gpu.processes", {"errors": {"processes": "UNKNOWN"}}, {}),
    ("gpu.model", {"errors": {"name": "UNKNOWN"}}, {"name": None}),
])
def test_a_value_nvml_answered_an_error_for_is_incomplete_never_ok(check_id, fields, attrs):
    """An error for one GPU's field (UNKNOWN, TIMEOUT, ...): that check cannot judge the GPU. It used to report OK
    for gpu.ecc and gpu.recovery_action, and the health check took that for "cleared" and undrained."""
    profile = replace(P5, nvswitch=True)
    found = run(check_id, bad_gpu(3, **attrs, **fields), job_gpus=tuple(range(8)), profile=profile)
    bad = [f for f in found if f.severity is not Severity.OK]
    assert [(f.severity, f.gpu) for f in bad] == [(Severity.INCOMPLETE, 3)], found
    assert "unsupported" not in bad[0].evidence  # an error may escalate when it keeps coming back
    assert bad[0].keyword == get_check(check_id).keyword


def test_ecc_counter_not_supported_while_ecc_is_on_is_unknown():
    f = run("gpu.ecc", bad_gpu(5, ecc_volatile_uncorrected=None, unsupported=["ecc_volatile_uncorrected"]))
    assert [(x.severity, x.gpu, x.evidence.get("unsupported")) for x in f] == [(Severity.INCOMPLETE, 5, True)]
    assert "ecc_volatile_uncorrected (NOT_SUPPORTED)" in f[0].message
    # a GPU without ECC at all (mode and counters NOT_SUPPORTED on every GPU): not applicable, skipped
    no_ecc = node(*[h100(i, ecc_enabled=None, ecc_pending_enabled=None, ecc_volatile_uncorrected=None,
                         ecc_aggregate_uncorrected=None) for i in range(8)])
    assert run("gpu.ecc", no_ecc)[0].severity is Severity.SKIP
    # ... but one such GPU among GPUs that report ECC: unknown, never clear
    f = run("gpu.ecc", bad_gpu(4, ecc_enabled=None, ecc_volatile_uncorrected=None))
    assert [(x.severity, x.gpu) for x in f] == [(Severity.INCOMPLETE, 4)]


def test_recovery_action_not_supported_on_one_gpu_is_unknown():
    """The issue's case: recovery action GPU_RESET on GPU 2, then NVML answers NOT_SUPPORTED for that field on
    GPU 2 while the other GPUs report NONE. That is not "back to NONE"."""
    f = run("gpu.recovery_action", bad_gpu(2, recovery_action=None, unsupported=["recovery_action"]))
    assert [(x.severity, x.gpu, x.evidence.get("unsupported")) for x in f] == [(Severity.INCOMPLETE, 2, True)]
    assert f[0].evidence["unread"] == {"recovery_action": "NOT_SUPPORTED"}


def test_retired_pages_not_supported_on_every_h100_is_not_applicable():
    """Real H100s answer NOT_SUPPORTED for page retirement (tests/fixtures/nvml/): not incomplete on every node."""
    obs = node(*[h100(i, unsupported=["retired_pages_sbe", "retired_pages_dbe", "retired_pages_pending"])
                 for i in range(8)])
    assert run("gpu.retired_pages", obs)[0].severity is Severity.SKIP
    obs = bad_gpu(3, errors={"retired_pages_pending": "UNKNOWN"})  # an error is not "not supported"
    assert [(x.severity, x.gpu) for x in run("gpu.retired_pages", obs)] == [(Severity.INCOMPLETE, 3)]


def test_a_gpu_without_a_handle_is_unknown_for_every_node_check():
    obs = node(*[h100(i) for i in range(7)], GpuInfo(index=7, errors={"handle": "NO_PERMISSION"}))
    for cid in ("gpu.ecc", "gpu.row_remap", "gpu.recovery_action"):
        f = [x for x in run(cid, obs) if x.severity is not Severity.OK]
        assert [(x.severity, x.gpu) for x in f] == [(Severity.INCOMPLETE, 7)], cid


def test_real_h100_readings_are_judged_clear():
    """The readings of a real H100 SXM (driver 580, tests/fixtures/nvml/): fields NVML does not support there
    (retired pages, fabric state on a GPU without NVSwitch) never make a check incomplete."""
    import json
    from pathlib import Path

    data = json.loads((Path(__file__).resolve().parents[1] / "fixtures" / "nvml"
                       / "h100_gpuguard_observations.json").read_text())
    fields = set(GpuInfo.__dataclass_fields__)
    g = GpuInfo(**{k: v for k, v in data["idle"].items() if k in fields and k != "processes"})
    g.unsupported = ["retired_pages_sbe", "retired_pages_dbe", "retired_pages_pending", "fabric"]
    obs = node(*[replace(g, index=i, uuid=f"GPU-{i}") for i in range(8)])
    for cid in ("gpu.ecc", "gpu.row_remap", "gpu.recovery_action", "gpu.retired_pages", "gpu.temperature",
                "gpu.throttle", "gpu.fabric", "gpu.model", "gpu.memory"):
        assert sev(run(cid, obs, job_gpus=tuple(range(8)))) <= {Severity.OK, Severity.SKIP}, cid


def test_real_h200_readings_are_judged_as_on_the_machine():
    """A real H200 (driver 580, tests/fixtures/nvml/h200_*): against the p5e profile cut to its one GPU, every check
    is clear except NVLink, whose 18 link states NVML answers NOT_SUPPORTED there: unknown, said as such, never
    clear and never a drain. Its 2 lifetime uncorrectable ECC errors with nothing volatile and no remapped, pending
    or failed rows are history, not a reason to drain."""
    import json
    from pathlib import Path

    data = json.loads((Path(__file__).resolve().parents[1] / "fixtures" / "nvml"
                       / "h200_gpuguard_observation.json").read_text())["observation"]
    fields = set(GpuInfo.__dataclass_fields__)
    gpu = GpuInfo(**{k: v for k, v in data["gpus"][0].items() if k in fields and k != "processes"})
    assert (gpu.ecc_aggregate_uncorrected, gpu.ecc_volatile_uncorrected, gpu.remapped_rows_uncorrectable) == (2, 0, 0)
    obs = Observations(nvml=NvmlObservation(status=ProbeStatus(), driver_version=data["driver_version"],
                                            device_count=1, gpus=[gpu]))
    profile = replace(load_profile("p5e.48xlarge"), gpu_count=1, efa_devices=0)
    for cid in [*ALL_NVML_CHECKS, "gpu.fabric", "gpu.retired_pages"]:
        found = run(cid, obs, profile=profile, job_gpus=(0,))
        if cid == "gpu.nvlink":
            assert [(f.severity, f.evidence.get("unsupported")) for f in found] == [(Severity.INCOMPLETE, True)]
            assert "NOT_SUPPORTED" in found[0].message
        else:
            assert sev(found) <= {Severity.OK, Severity.SKIP}, (cid, found)
    ecc = run("gpu.ecc", obs, profile=profile, job_gpus=(0,))[0]
    assert ecc.message == "ECC enabled, no uncorrectable errors since boot (GPU 0: 2 over its lifetime)"


def test_temperature_limits_are_the_gpus_own():
    """An H100/H200 fails at its own slowdown temperature (89 C, from NVML), not at a profile's 85 C, which is 2 C
    below its max operating temperature and would drain healthy GPUs under load."""
    assert P5.gpu_temp_fail_c is None  # the profile no longer guesses
    assert run("gpu.temperature", bad_gpu(0, temperature_c=80))[0].severity is Severity.WARN  # profile's early warn
    for t in (85, 87, 88):
        assert run("gpu.temperature", bad_gpu(0, temperature_c=t))[0].severity is Severity.WARN, t
    f = run("gpu.temperature", bad_gpu(0, temperature_c=89))[0]
    assert (f.severity, f.keyword, f.action) == (Severity.FAIL, "THERMAL", Action.DRAIN)
    assert "limit 89C, the GPU's slowdown temperature" in f.message
    # a site limit can only make it stricter
    assert run("gpu.temperature", bad_gpu(0, temperature_c=91), params={"fail_c": 99})[0].message.count("limit 89C")
    f = run("gpu.temperature", bad_gpu(0, temperature_c=84), params={"fail_c": 84})[0]
    assert f.severity is Severity.FAIL and "limit 84C, configured" in f.message
    # a GPU that reports no thresholds falls back to the profile (A100 on p4d: 85 C)
    p4d = load_profile("p4d.24xlarge")
    f = run("gpu.temperature", bad_gpu(0, temperature_c=86, temperature_slowdown_c=None, temperature_gpu_max_c=None,
                                          name="NVIDIA A100-SXM4-40GB"), profile=p4d)[0]
    assert f.severity is Severity.FAIL and "limit 85C" in f.message


def test_hbm_temperature():
    f = run("gpu.temperature", bad_gpu(3, memory_temperature_c=95))[0]
    assert (f.severity, f.gpu) == (Severity.FAIL, 3) and "HBM at 95C" in f.message
    assert run("gpu.temperature", bad_gpu(3, memory_temperature_c=91))[0].severity is Severity.WARN
    assert sev(run("gpu.temperature", bad_gpu(3, memory_temperature_c=None))) == {Severity.OK}


def test_throttle_reasons():
    f = run("gpu.throttle", bad_gpu(4, clock_event_reasons=0x1 | 0x40))[0]
    assert f.severity is Severity.FAIL and "hw_thermal" in f.message and f.keyword == "CLOCKS"
    # the failure must persist before the runner drains (gpuguard.pipeline.policy.apply_persistence)
    assert f.evidence["persist"] == {"key": "GPU-4:hw_thermal", "seconds": 240.0}
    assert run("gpu.throttle", bad_gpu(4, clock_event_reasons=0x80))[0].severity is Severity.FAIL
    assert run("gpu.throttle", bad_gpu(4, clock_event_reasons=0x20))[0].severity is Severity.WARN
    assert sev(run("gpu.throttle", bad_gpu(4, clock_event_reasons=0x4))) == {Severity.OK}  # SW power cap is normal


BUSY = dict(clock_event_reasons=0x0, utilization_gpu_pct=99)  # a real H100 under a bf16 matmul: reason 0x0, 99 %


def test_pcie_idle_readings_are_never_drained_on():
    """At idle the driver may drop the link generation and width (nvidia-smi's docs): reported, not judged."""
    assert sev(run("gpu.pcie", bad_gpu(6, pcie_gen_current=1))) == {Severity.OK}
    f = run("gpu.pcie", bad_gpu(6, pcie_width_current=8, pcie_gen_current=1))
    assert sev(f) == {Severity.OK} and "GPU 6 x8 (expected x16)" in f[0].message and "not judged" in f[0].message


def had(**inventory) -> dict:
    """What the node's remembered inventory (checks.inventory) says it was seen with before."""
    return {"inventory": inventory}


def test_pcie_link_degraded_under_load_drains_when_it_trained_wider_before():
    """Under load at x8 on a GPU that trained x16 under load on this node before: the link degraded (reboot)."""
    obs = bad_gpu(6, pcie_width_current=8, pcie_gen_current=5, **BUSY)
    obs.previous = had(pcie={"GPU-6": [5, 16]})
    f = run("gpu.pcie", obs)[0]
    assert (f.severity, f.action) == (Severity.FAIL, Action.REBOOT) and "x8 (expected x16) under load" in f.message
    assert "trained at Gen5 x16 under load before" in f.message
    obs = bad_gpu(6, pcie_width_current=16, pcie_gen_current=3, **BUSY)
    obs.previous = had(pcie={"GPU-6": [5, 16]})
    f = run("gpu.pcie", obs)[0]
    assert f.severity is Severity.FAIL and "Gen3 (expected Gen5) under load" in f.message
    assert sev(run("gpu.pcie", bad_gpu(6, pcie_gen_current=5, **BUSY))) == {Severity.OK}


def test_pcie_link_below_the_profile_that_never_trained_higher_warns():
    """The same x8 on a node whose GPU never trained wider under load (a platform/slot limit on every node of the
    fleet, or a first look) warns: draining for it would drain the fleet."""
    f = run("gpu.pcie", bad_gpu(6, pcie_width_current=8, pcie_gen_current=5, **BUSY))[0]
    assert (f.severity, f.action) == (Severity.WARN, Action.NONE) and f.evidence["launch_choice"]
    assert f.evidence["first_seen"] is True and "never trained higher under load" in f.message
    obs = bad_gpu(6, pcie_width_current=8, pcie_gen_current=5, **BUSY)
    obs.previous = had(pcie={"GPU-6": [5, 8]})  # remembered: this GPU always trained x8
    f = run("gpu.pcie", obs)[0]
    assert f.severity is Severity.WARN and f.evidence["first_seen"] is False


def test_pcie_max_generation_is_a_capability_not_a_fault():
    f = run("gpu.pcie", bad_gpu(6, pcie_gen_max=4))[0]
    assert (f.keyword, f.severity, f.action) == ("PCIE", Severity.WARN, Action.NONE)


def test_pcie_replay_rate():
    now = 10_000.0
    obs = bad_gpu(2, pcie_replay_counter=500)
    obs.now, obs.previous = now, {"pcie_replay": {"GPU-2": [100, now - 600]}}  # 400 replays in 10 min
    f = run("gpu.pcie", obs)[0]
    assert f.severity is Severity.WARN and "40 PCIe replays/min" in f.message and "DCGM limit 8/min" in f.message
    f = run("gpu.pcie", obs, params={"replay_rate_fail_per_min": 20})[0]
    assert (f.severity, f.action) == (Severity.FAIL, Action.REBOOT)
    obs.previous = {"pcie_replay": {"GPU-2": [490, now - 600]}}  # 1 replay/min: normal
    assert sev(run("gpu.pcie", obs)) == {Severity.OK}
    obs.previous = {"pcie_replay": {"GPU-2": [100, now - 10]}}  # too short a window to judge a rate
    assert sev(run("gpu.pcie", obs)) == {Severity.OK}


def test_nvlink_down():
    links = [True] * 18
    links[3] = links[7] = False
    f = run("gpu.nvlink", bad_gpu(2, nvlink_active=links))[0]
    assert f.severity is Severity.FAIL and "NVLink 3,7 down (16/18 active)" in f.message


def test_nvlink_state_nvml_cannot_read_is_unknown_never_no_nvlinks():
    """NOT_SUPPORTED for a link's state (what NVML answers a GPU/driver that cannot say) used to read as "no
    NVLinks" and reboot-drain the node: it is incomplete, marked unsupported (never escalated to a drain)."""
    f = run("gpu.nvlink", bad_gpu(2, nvlink_active=[None] * 18, unsupported=["nvlink"]))[0]
    assert (f.severity, f.gpu, f.evidence["unsupported"]) == (Severity.INCOMPLETE, 2, True)
    assert "NOT_SUPPORTED" in f.message
    f = run("gpu.nvlink", bad_gpu(2, nvlink_active=[True] * 17 + [None], errors={"nvlink": "UNKNOWN"}))[0]
    assert f.severity is Severity.INCOMPLETE and "unsupported" not in f.evidence and f.evidence["unknown"] == [17]
    f = run("gpu.nvlink", bad_gpu(2, nvlink_active=None, unsupported=["nvlink"]))[0]  # no NVLink API at all
    assert f.severity is Severity.INCOMPLETE and f.evidence["unsupported"]


def test_nvlinks_fewer_than_the_profile_judged_against_the_node_history():
    # NVML says the GPU has no NVLink (link count 0) on a node never seen with more: a platform, not a fault
    f = run("gpu.nvlink", bad_gpu(2, nvlink_active=[]))[0]
    assert (f.severity, f.evidence["launch_choice"], f.evidence["first_seen"]) == (Severity.WARN, True, True)
    # the same GPU had 18 links before: they disappeared, a hardware fault
    obs = bad_gpu(2, nvlink_active=[True] * 12)
    obs.previous = had(nvlinks={"GPU-2": 18})
    f = run("gpu.nvlink", obs)[0]
    assert (f.severity, f.action) == (Severity.FAIL, Action.REBOOT) and "6 gone (this node had 18)" in f.message


def test_leftover_processes():
    obs = bad_gpu(1, processes=[GpuProcess(pid=4242, used_memory_mib=30000, name="python")])
    f = run("gpu.processes", obs, job_gpus=(0, 1))[0]
    assert f.severity is Severity.FAIL and "pid 4242 python 30000 MiB" in f.message and f.keyword == "GPUPROC"
    assert run("gpu.processes", obs, job_gpus=(1,), params={"severity": "warn"})[0].severity is Severity.WARN
    assert sev(run("gpu.processes", obs, job_gpus=(0,))) == {Severity.OK}
    assert run("gpu.processes", obs, job_gpus=())[0].severity is Severity.SKIP


def test_generic_profile_skips_hardware_expectations():
    gen = load_profile("generic")
    for cid in ("gpu.count", "gpu.model", "gpu.memory", "gpu.pcie", "gpu.nvlink"):
        assert run(cid, node(), profile=gen)[0].severity is Severity.SKIP, cid


def test_cpu_node_without_driver_is_skipped_not_incomplete():
    """A generic (CPU) node has no NVIDIA driver: every GPU check skips, so nothing can escalate to a drain."""
    obs = Observations(nvml=NvmlObservation(status=ProbeStatus(complete=False), init_error="LIBRARY_NOT_FOUND"))
    gen = load_profile("generic")
    for cid in ALL_NVML_CHECKS + ["gpu.retired_pages", "gpu.leftovers", "gpu.memory_released"]:
        assert {f.severity for f in run(cid, obs, profile=gen)} == {Severity.SKIP}, cid
    # ... but a GPU node without its driver is incomplete everywhere and fails in gpu.nvml
    assert run("gpu.ecc", obs)[0].severity is Severity.INCOMPLETE
