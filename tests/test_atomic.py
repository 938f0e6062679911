"""atomic_file: a writer that fails leaves the old file and no temporary behind."""

import pytest

from kimik3_jax.atomic import atomic_file


def test_replaces_on_success_and_keeps_the_old_file_on_failure(tmp_path):
    path = tmp_path / "out.txt"
    with atomic_file(path) as f:
        f.write("first\n")
    assert path.read_text() == "first\n"
    with pytest.raises(RuntimeError, match="boom"):
        with atomic_file(path) as f:
            f.write("half")
            raise RuntimeError("boom")
    assert path.read_text() == "first\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.txt"]
