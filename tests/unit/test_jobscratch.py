"""gpuguard.pipeline.jobscratch: the epilog removes a job's private scratch as root without trusting anything below /tmp.
Real files, real ownership (the tests chown to other uids when they run as root, which the epilog does)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from gpuguard.pipeline.jobscratch import remove_job_scratch

ROOT_ONLY = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to create files owned by other users")
USER, OTHER = 1234, 2345


def _tree(base: Path, uid: int) -> Path:
    (base / "triton-cache" / "ab" / "cd").mkdir(parents=True)
    (base / "triton-cache" / "ab" / "cd" / "kernel.so").write_bytes(b"\x7fELF")
    (base / "torchelastic").mkdir()
    (base / "torchelastic" / "log").write_text("x")
    for p in [base, *base.rglob("*")]:
        os.lchown(p, uid, uid)
    return base


@pytest.fixture
def tmproot(tmp_path):
    root = tmp_path / "tmp"
    root.mkdir()
    os.chmod(root, 0o1777)  # like /tmp
    return root


@ROOT_ONLY
def test_removes_the_jobs_directories_and_nothing_else(tmproot):
    mine = _tree(tmproot / "gpuguard-77", USER)
    fallback = _tree(tmproot / "gpuguard-77.Ab3dE9xQ", USER)  # mktemp's fallback name
    other_job = _tree(tmproot / "gpuguard-778", USER)
    unrelated = _tree(tmproot / "gpuguard-77-notes", USER)
    res = remove_job_scratch("77", USER, [str(tmproot)])
    assert sorted(res.removed) == sorted([str(mine), str(fallback)]) and not res.errors and not res.incomplete
    assert not mine.exists() and not fallback.exists()
    assert other_job.exists() and unrelated.exists()


@ROOT_ONLY
def test_a_link_planted_by_another_user_removes_nothing_outside(tmproot, tmp_path):
    """Issue 9: a symlink named like the job's scratch, pointing at a root-owned directory, must not make the
    root epilog delete that directory's contents."""
    precious = tmp_path / "etc-like"
    precious.mkdir()
    (precious / "shadow").write_text("root:x")
    (precious / "sub").mkdir()
    (precious / "sub" / "conf").write_text("keep")
    link = tmproot / "gpuguard-77"
    link.symlink_to(precious)
    os.lchown(link, OTHER, OTHER)
    res = remove_job_scratch("77", USER, [str(tmproot)])
    assert res.removed == [] and any("not a directory" in s for s in res.skipped)
    assert (precious / "shadow").read_text() == "root:x" and (precious / "sub" / "conf").exists()
    assert link.is_symlink()  # another user's entry: not ours to remove
    # the same link owned by the job's user is still never followed
    os.lchown(link, USER, USER)
    remove_job_scratch("77", USER, [str(tmproot)])
    assert (precious / "shadow").exists() and (precious / "sub" / "conf").exists()


@ROOT_ONLY
def test_links_inside_the_users_directory_are_unlinked_not_followed(tmproot, tmp_path):
    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "data").write_text("keep")
    mine = _tree(tmproot / "gpuguard-77", USER)
    (mine / "triton-cache" / "evil").symlink_to(precious)
    (mine / "evil-file").symlink_to(precious / "data")
    os.lchown(mine / "triton-cache" / "evil", USER, USER)
    os.lchown(mine / "evil-file", USER, USER)
    res = remove_job_scratch("77", USER, [str(tmproot)])
    assert res.removed == [str(mine)] and not mine.exists()
    assert (precious / "data").read_text() == "keep"


@ROOT_ONLY
def test_directories_of_other_users_are_left_alone(tmproot):
    squatted = _tree(tmproot / "gpuguard-77", OTHER)  # pre-created by someone else
    res = remove_job_scratch("77", USER, [str(tmproot)])
    assert squatted.exists() and any(f"owned by uid {OTHER}" in s for s in res.skipped)
    # a subdirectory owned by someone else inside the user's directory is not descended into
    mine = _tree(tmproot / "gpuguard-77.xYz12345", USER)
    foreign = mine / "foreign"
    foreign.mkdir()
    (foreign / "f").write_text("x")
    os.lchown(foreign, OTHER, OTHER)
    res = remove_job_scratch("77", USER, [str(tmproot)])
    assert foreign.exists() and (foreign / "f").exists() and mine.exists()
    assert not (mine / "triton-cache").exists()  # the rest was removed


def test_bounded_in_time_and_never_raises(tmproot):
    uid = os.geteuid()
    big = tmproot / "gpuguard-5"
    big.mkdir()
    for i in range(200):
        (big / f"f{i}").write_text("x")
    ticks = iter(range(10**6))
    res = remove_job_scratch("5", uid, [str(tmproot)], deadline_s=50, clock=lambda: next(ticks))
    assert res.incomplete and big.exists() and len(list(big.iterdir())) < 200
    assert remove_job_scratch("5", uid, [str(tmproot)]).removed == [str(big)]  # the next run finishes the job
    # hostile or missing inputs: nothing happens, nothing raises
    assert remove_job_scratch("5/../..", uid, [str(tmproot)]).errors
    assert remove_job_scratch("*", uid, [str(tmproot)]).errors
    assert remove_job_scratch(None, uid, [str(tmproot)]).errors
    assert remove_job_scratch("5", None, [str(tmproot)]).errors
    assert remove_job_scratch("5", uid, [str(tmproot / "missing")]).removed == []


def test_a_scratch_root_that_is_a_link_is_refused(tmp_path):
    real = tmp_path / "real"
    real.mkdir()
    (real / "gpuguard-9").mkdir()
    link = tmp_path / "linked-root"
    link.symlink_to(real)
    res = remove_job_scratch("9", os.geteuid(), [str(link)])
    assert res.errors and (real / "gpuguard-9").exists()


def test_deep_trees_are_removed_without_recursion(tmproot):
    uid = os.geteuid()
    top = tmproot / "gpuguard-3"
    d = top
    for _ in range(60):
        d = d / "d"
    d.mkdir(parents=True)
    (d / "leaf").write_text("x")
    res = remove_job_scratch("3", uid, [str(tmproot)])
    assert res.removed == [str(top)] and not top.exists()


@ROOT_ONLY
def test_a_scratch_removed_at_the_same_time_by_the_other_nodes_epilog_is_gone_without_errors(tmproot):
    """A scratch root shared by the job's nodes (a shared /scratch, or simulated nodes on one host): every node's
    epilog removes the same directory at the same moment. What another remover took first is gone, not an error
    that leaves the rest in place (seen in a CI-like run: both epilogs stopped on ENOENT and left gpuguard-1)."""
    mine = _tree(tmproot / "gpuguard-77", USER)
    calls = []

    def clock() -> float:  # the emptier asks the time before each step: the other epilog wins the race at step 3
        calls.append(1)
        if len(calls) == 3:
            shutil.rmtree(mine)
        return 0.0

    res = remove_job_scratch("77", USER, [str(tmproot)], clock=clock)
    assert len(calls) > 3 and res.errors == [] and not res.incomplete
    assert res.removed == [str(mine)] and not mine.exists()
