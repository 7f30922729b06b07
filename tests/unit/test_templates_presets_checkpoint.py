"""Presets (instance type x software stack, AWS's EFA cheatsheet) and finding the checkpoint to resume from."""

from __future__ import annotations

import os
import time

import pytest

from gpuguard.templates.checkpoint import find_checkpoint
from gpuguard.templates.presets import (PresetError, load_presets, resolve_preset, stack_for_versions,
                                        version_findings)


@pytest.mark.parametrize("versions,stack", [
    ({"libfabric": "1.22.0", "aws_ofi_nccl": "1.13.2"}, "efa"),
    ({"libfabric": "1.18.0", "aws_ofi_nccl": "1.7.0"}, "efa"),
    ({"libfabric": "1.17.1", "aws_ofi_nccl": "1.7.4"}, "efa-ofi-1.6"),  # old libfabric still needs DEVICE_RDMA
    ({"libfabric": "1.18.1", "aws_ofi_nccl": "1.6.0"}, "efa-ofi-1.6"),
    ({"aws_ofi_nccl": "v1.5.0-aws"}, "efa-ofi-1.5"),
    ({"aws_ofi_nccl": "1.4"}, "efa-ofi-1.5"),
])
def test_stack_from_versions_follows_the_cheatsheet(versions, stack):
    assert stack_for_versions(versions) == stack


def test_stack_versions_errors():
    with pytest.raises(PresetError, match="aws_ofi_nccl version is needed"):
        stack_for_versions({"libfabric": "1.22"})
    with pytest.raises(PresetError, match="not a version number"):
        stack_for_versions({"aws_ofi_nccl": "latest"})


def test_every_variable_has_a_reason_and_presets_differ_by_stack():
    data = load_presets()
    for inst in data["instances"]:
        for stack in data["instances"][inst]["stacks"]:
            p = resolve_preset(inst, stack)
            assert all(e.why and len(e.why) > 20 for e in p.env + p.unset)
            names = {e.name: e.value for e in p.env}
            assert names["NCCL_DEBUG"] == "WARN" and names["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "3"
            assert names.get("NCCL_SOCKET_IFNAME") != "eth0"
            if stack == "efa":
                assert names["FI_EFA_USE_HUGE_PAGE"] == "0" and "NCCL_PROTO" not in names and "NCCL_ALGO" not in names
                assert "FI_EFA_USE_DEVICE_RDMA" not in names and "FI_PROVIDER" not in names


def test_site_overrides_add_instances_and_replace_common_values():
    site = {"instances": {"a100-ib": {"fabric": "ib", "stacks": ["ib"], "env": [
        {"name": "NCCL_IB_HCA", "value": "=mlx5_0,mlx5_1", "why": "our two compute HCAs, exact names"}]}},
            "common": {"env": [{"name": "NCCL_DEBUG", "value": "VERSION", "why": "print NCCL's version once per rank"}]}}
    p = resolve_preset("a100-ib", None, site)
    env = {e.name: e for e in p.env}
    assert env["NCCL_IB_HCA"].value == "=mlx5_0,mlx5_1" and env["NCCL_DEBUG"].value == "VERSION"
    with pytest.raises(PresetError, match="every variable needs a one-line 'why'"):
        resolve_preset("generic", None, {"common": {"env": [{"name": "X", "value": "1"}]}})
    with pytest.raises(PresetError, match="unknown stack 'efa2'"):
        resolve_preset("generic", None, {"instances": {"x": {"fabric": "efa", "stacks": ["efa2"]}}})


@pytest.mark.parametrize("instance,versions,error", [
    ("p5en.48xlarge", {"aws_ofi_nccl": "1.12.1"}, "p5en.48xlarge needs aws-ofi-nccl >= 1.13.0"),  # v1.13.0-aws
    ("p6-b200.48xlarge", {"aws_ofi_nccl": "1.14.2"}, "p6-b200.48xlarge needs aws-ofi-nccl >= 1.15.0"),  # v1.15.0
    ("p5.48xlarge", {"aws_ofi_nccl": "1.7.1"}, "p5.48xlarge needs aws-ofi-nccl >= 1.7.2"),  # AWS cheatsheet
])
def test_minimum_plugin_versions_per_instance(instance, versions, error):
    with pytest.raises(PresetError, match=error):
        resolve_preset(instance, versions)


def test_recommended_versions_and_known_bad_combinations():
    data = load_presets()
    errors, warnings, extra = version_findings(data, "p6-b200.48xlarge", {"aws_ofi_nccl": "1.15.0"})
    assert not errors and len(warnings) == 1 and "tuner" in warnings[0] and not extra
    assert version_findings(data, "p6-b200.48xlarge", {"aws_ofi_nccl": "1.16.0"}) == ([], [], [])
    _, warnings, _ = version_findings(data, "p5.48xlarge", {"aws_ofi_nccl": "v1.14.0-aws"})
    assert any("1.14.0" in w and "1.14.2 or later" in w for w in warnings)
    assert not version_findings(data, "p5.48xlarge", {"aws_ofi_nccl": "1.14.2"})[1]
    # EFA installer < 1.29.1 with NCCL >= 2.19: AWS's workaround variable is set, with its why
    _, warnings, extra = version_findings(data, "p4d.24xlarge", {"aws_ofi_nccl": "1.9.1", "efa_installer": "1.29.0",
                                                                 "nccl": "2.19.3"})
    assert [(e.name, e.value) for e in extra] == [("FI_EFA_SET_CUDA_SYNC_MEMOPS", "0")] and "1.29.1" in warnings[0]
    for ok in ({"efa_installer": "1.29.1", "nccl": "2.19.3"}, {"efa_installer": "1.28.0", "nccl": "2.18.5"},
               {"nccl": "2.21.5"}):  # unknown installer version: no guess
        assert not version_findings(data, "p4d.24xlarge", {"aws_ofi_nccl": "1.9.1", **ok})[2]
    p = resolve_preset("p4d.24xlarge", {"aws_ofi_nccl": "1.9.1", "efa_installer": "1.28.0", "nccl": "2.21.5"})
    assert {e.name: e.value for e in p.env}["FI_EFA_SET_CUDA_SYNC_MEMOPS"] == "0" and p.warnings


def test_preset_values_cannot_carry_control_characters():
    with pytest.raises(PresetError, match="control characters"):
        resolve_preset("generic", None, {"common": {"env": [{"name": "X", "value": "a\nrm -rf /", "why": "w"}]}})


def test_huge_page_reason_follows_aws():
    why = {e.name: e.why for e in resolve_preset("p5.48xlarge").env}["FI_EFA_USE_HUGE_PAGE"]
    assert "os.fork()" in why and "runs out of huge pages" in why and "minor performance cost" in why


# --------------------------------------------------------------------------- checkpoints


def _ckpt(root, name, marker=True, mtime=None):
    d = root / name
    d.mkdir()
    (d / "model.pt").write_bytes(b"x")
    if marker:
        (d / "COMPLETE").write_text("")
    if mtime:
        os.utime(d, (mtime, mtime))
    return d


def test_glob_picks_the_highest_step_that_is_complete(tmp_path):
    now = time.time()
    _ckpt(tmp_path, "step-9", mtime=now)
    _ckpt(tmp_path, "step-10", mtime=now - 100)  # natural order: 10 > 9 even though older
    _ckpt(tmp_path, "step-11", marker=False)      # still being written
    (tmp_path / ".tmp-step-12").mkdir()
    found = find_checkpoint(str(tmp_path), "glob", "step-*", "COMPLETE")
    assert found.path.name == "step-10" and found.step == 10
    assert find_checkpoint(str(tmp_path), "glob", "step-*").path.name == "step-11"  # without marker: non-empty dir
    assert find_checkpoint(str(tmp_path / "missing"), "glob", "*") is None
    assert find_checkpoint(str(tmp_path), "glob", "nothing-*") is None


def test_megatron_tracker(tmp_path):
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("2000\n")
    assert find_checkpoint(str(tmp_path), "megatron") is None  # tracker points at a missing iteration
    (tmp_path / "iter_0002000").mkdir()
    found = find_checkpoint(str(tmp_path), "megatron")
    assert found.path == tmp_path and found.step == 2000  # --load takes the root; Megatron reads the tracker
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("garbage")
    assert find_checkpoint(str(tmp_path), "megatron") is None
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("release")
    (tmp_path / "release").mkdir()
    assert find_checkpoint(str(tmp_path), "megatron").path == tmp_path


def test_latest_link_or_tag_file(tmp_path):
    _ckpt(tmp_path, "global_step300")
    (tmp_path / "latest").symlink_to("global_step300")
    assert find_checkpoint(str(tmp_path), "latest").path.name == "global_step300"
    (tmp_path / "latest").unlink()
    (tmp_path / "latest").write_text("global_step300\n")  # DeepSpeed writes the tag into a file
    assert find_checkpoint(str(tmp_path), "latest").path == tmp_path / "global_step300"
    (tmp_path / "latest").write_text("../../etc")
    assert find_checkpoint(str(tmp_path), "latest") is None
    with pytest.raises(ValueError, match="kind must be one of"):
        find_checkpoint(str(tmp_path), "newest")
