"""Interrupting `kimik3 convert` (SIGKILL in a subprocess, at several points of the unit loop) and
resuming gives a bit-identical result; nothing at OUT_DIR looks complete until the end; a run without
--resume refuses to touch the interrupted one; a changed source cannot be resumed; a second
converter on the same output is locked out."""
import fcntl
import json
import os
import signal
import subprocess
import sys

import pytest
from test_convert import assert_same_tree

from convert.orbax_io import restore_numpy
from convert.plan import plan_units
from convert.run import CRASH_ENV, work_dir
from kimik3_jax.checkpoint.open import load_checkpoint
from kimik3_jax.cli import main

UNITS = 10  # tiny: globals, 8 layers, vision


def killed(src, dst, point, *extra):
    """Run the converter in a subprocess that SIGKILLs itself at `point` ("<where>:<unit index>")."""
    env = {**os.environ, CRASH_ENV: point}
    run = subprocess.run([sys.executable, "-m", "convert", "--quiet", "--src", str(src), "--dst", str(dst), *extra],
                         env=env, capture_output=True, text=True, check=False, timeout=300)
    assert run.returncode == -signal.SIGKILL, (run.returncode, run.stderr)
    assert not dst.exists()
    return work_dir(dst)


def convert(src, dst, *extra):
    return main(["convert", "--quiet", "--src", str(src), "--dst", str(dst), *extra])


@pytest.fixture(scope="module")
def reference(tiny_ckpt, tmp_path_factory):
    out = tmp_path_factory.mktemp("ref") / "out"
    assert convert(tiny_ckpt, out) == 0
    return out


def assert_same_conversion(a, b, cfg):
    for unit in plan_units(cfg):
        for part, pieces in unit.parts:
            ua = restore_numpy(a / "units" / unit.name / part, list(pieces))
            ub = restore_numpy(b / "units" / unit.name / part, list(pieces))
            for key in ua:
                assert ua[key].dtype == ub[key].dtype and ua[key].tobytes() == ub[key].tobytes(), (unit.name, key)
    ma, mb = (json.loads((d / "kimik3_orbax.json").read_text()) for d in (a, b))
    ma["source"].pop("path"), mb["source"].pop("path")  # the source may be a copy elsewhere
    assert ma == mb
    ra, rb = (json.loads((d / "convert_report.json").read_text()) for d in (a, b))
    assert ra["checksums"] == rb["checksums"] and ra["converted"] == rb["converted"]
    assert_same_tree(load_checkpoint(a, text_only=False)[1], load_checkpoint(b, text_only=False)[1])


@pytest.mark.parametrize("point", ["read:0", "saving:3", "saved:5", "recorded:2", f"commit:{UNITS}"])
def test_killed_then_resumed_is_bit_identical(tiny_ckpt, reference, tmp_path, cfg, point):
    out = tmp_path / "out"
    work = killed(tiny_ckpt, out, point)
    assert work.is_dir()
    assert convert(tiny_ckpt, out, "--resume") == 0
    assert not work.exists()
    assert_same_conversion(reference, out, cfg)
    report = json.loads((out / "convert_report.json").read_text())
    assert report["runs"] == (1 if point == "read:0" else 2)  # a run that recorded no unit does not count


def test_killed_twice_and_refused_without_resume(tiny_ckpt, reference, tmp_path, cfg, capsys):
    out = tmp_path / "out"
    work = killed(tiny_ckpt, out, "saving:2")
    capsys.readouterr()
    assert convert(tiny_ckpt, out) == 2  # neither --resume nor --overwrite: the interrupted run is kept
    err = capsys.readouterr().err
    assert "--resume" in err and str(work) in err and not out.exists()
    killed(tiny_ckpt, out, "recorded:6", "--resume")
    assert len((work / "progress.jsonl").read_text().splitlines()) == 7  # units 0..6
    capsys.readouterr()
    assert convert(tiny_ckpt, out, "--resume") == 0
    assert "7 of 10 units already converted" in capsys.readouterr().err
    assert_same_conversion(reference, out, cfg)
    assert json.loads((out / "convert_report.json").read_text())["runs"] == 3
    capsys.readouterr()
    assert convert(tiny_ckpt, out) == 2 and "--overwrite" in capsys.readouterr().err


def test_a_changed_source_is_not_resumed(ckpt_copy, reference, tmp_path, cfg, capsys):
    out = tmp_path / "out"
    work = killed(ckpt_copy, out, "recorded:4")
    shard = next(ckpt_copy.glob("model-*.safetensors"))
    os.utime(shard, ns=(shard.stat().st_atime_ns, shard.stat().st_mtime_ns + 10**9))
    capsys.readouterr()
    assert convert(ckpt_copy, out, "--resume") == 2
    err = capsys.readouterr().err
    assert "cannot resume" in err and "fingerprint" in err and "--overwrite" in err
    assert convert(ckpt_copy, out, "--overwrite") == 0 and not work.exists()
    assert_same_conversion(reference, out, cfg)


def test_a_second_converter_is_locked_out(tiny_ckpt, tmp_path, capsys):
    out = tmp_path / "out"
    work = killed(tiny_ckpt, out, "recorded:1")
    fd = os.open(work / ".lock", os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # as a live converter would hold it
        capsys.readouterr()
        assert convert(tiny_ckpt, out, "--resume") == 2
        assert "another conversion" in capsys.readouterr().err and not out.exists()
    finally:
        os.close(fd)
    assert convert(tiny_ckpt, out, "--resume") == 0


def test_damaged_unit_is_converted_again(tiny_ckpt, reference, tmp_path, cfg, capsys):
    out = tmp_path / "out"
    work = killed(tiny_ckpt, out, "recorded:5")
    (work / "units" / "layer_002" / "part_0" / "_METADATA").unlink()  # a recorded unit that no longer opens
    (work / "units" / "layer_009.orbax-checkpoint-tmp").mkdir()  # debris of some other crash
    capsys.readouterr()
    assert convert(tiny_ckpt, out, "--resume") == 0
    assert "layer_002: recorded but not intact" in capsys.readouterr().err
    assert_same_conversion(reference, out, cfg)
    assert not [p for p in (out / "units").rglob("*tmp*")]


def test_killed_with_many_parts_per_unit(tiny_ckpt, reference, tmp_path):
    out = tmp_path / "out"
    killed(tiny_ckpt, out, "saving:4", "--part-bytes", "65536")  # units 0..3 recorded, unit 4 half written
    assert convert(tiny_ckpt, out, "--resume", "--part-bytes", "65536") == 0
    assert_same_tree(load_checkpoint(reference, text_only=False)[1], load_checkpoint(out, text_only=False)[1])
    sums = [json.loads((d / "convert_report.json").read_text())["checksums"] for d in (reference, out)]
    assert sums[0] == sums[1]
    assert not work_dir(out).exists()
