"""atomic_write: readers see the old file or the new one; nothing is left behind on failure."""

import os

import pytest

from gpuguard.util.fs import atomic_write


def test_replaces_with_mode_and_leaves_no_temp(tmp_path):
    p = tmp_path / "sub" / "gpuguard_prolog.prom"
    atomic_write(p, "a 1\n")
    atomic_write(p, b"a 2\n", mode=0o640)
    assert p.read_text() == "a 2\n" and (os.stat(p).st_mode & 0o777) == 0o640
    assert [x.name for x in p.parent.iterdir()] == ["gpuguard_prolog.prom"]


def test_failure_leaves_the_old_file_and_no_temp(tmp_path):
    p = tmp_path / "f.json"
    atomic_write(p, "{}")
    with pytest.raises(TypeError):
        atomic_write(p, 42)  # type: ignore[arg-type]
    assert p.read_text() == "{}" and [x.name for x in tmp_path.iterdir()] == ["f.json"]
