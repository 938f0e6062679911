"""Conversion throughput and peak memory, next to plain reading of the same files in the same run.

    PYTHONPATH=$PWD python benchmarks/convert.py [--src DIR] [--out DIR] [--preset slice] [--layers 2]
                                                 [--verify] [--keep]

Without an existing --src it first generates one with `make-checkpoint --preset slice --layers 2`: a
KDA layer with the dense FFN and an MLA layer with a real-width MoE layer of all 896 experts, plus
the embedding, LM head and vision tower (24.5 GB). Each phase runs in its own process, measured with
`wait4` (wall time, peak resident memory): plain reading of every shard byte (sequential 64 MiB
reads), then `python -m convert`, both after the source files were evicted from the page cache
(`posix_fadvise(DONTNEED)`), so both read from the disk. The stated bound on the converter's peak
memory is two parts (one written while the next is read; the largest are 4.9 GB expert stacks)
plus MEMORY_SLACK for the runtime: less than the one real-width MoE layer (16.6 GB).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

MEMORY_SLACK = 1.5e9  # Python + jax + Orbax + tensorstore, hashing and Orbax's in-flight chunk buffers
READ_BLOCK = 64 << 20


def plain_read(src: Path) -> None:
    """Child: read every shard byte sequentially into one reused buffer."""
    buf = bytearray(READ_BLOCK)
    view = memoryview(buf)
    total = 0
    for path in sorted(src.glob("*.safetensors")):
        fd = os.open(path, os.O_RDONLY)
        try:
            while n := os.readv(fd, [view]):
                total += n
        finally:
            os.close(fd)
    print(f"read {total} bytes")


def evict(src: Path) -> None:
    for path in src.glob("*.safetensors"):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def measured(cmd: list[str], env=None) -> tuple[float, int, float]:
    """(wall seconds, peak RSS bytes, CPU seconds user + system) of a child process."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    out = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{out[-4000:]}")
    return wall, usage.ru_maxrss * 1024, usage.ru_utime + usage.ru_stime


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--src", type=Path, default=Path("/tmp/k3-bench/src"))
    ap.add_argument("--out", type=Path, default=None, help="default: beside --src")
    ap.add_argument("--preset", default="slice")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--verify", action="store_true", help="also time `convert --verify` of the output")
    ap.add_argument("--keep", action="store_true", help="keep the generated source and the output")
    ap.add_argument("--repeat", type=int, default=2, help="alternate plain read and convert this many times, "
                    "report the fastest of each (the host is shared: the fastest is the least disturbed)")
    ap.add_argument("--plain-read", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.plain_read:
        return plain_read(args.plain_read)

    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONPATH": f"{root}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    src, out = args.src, args.out or args.src.with_name(args.src.name + "-orbax")
    generated = not src.exists()
    if generated:
        wall, rss, _ = measured([sys.executable, "-m", "kimik3_jax.cli", "make-checkpoint", "--preset", args.preset,
                                 "--layers", str(args.layers), "--out", str(src), "--quiet"], env)
        print(f"generated {src} in {wall:.0f} s (peak RSS {rss / 1e9:.2f} GB)")

    sys.path.insert(0, str(root))
    from convert.plan import plan_units
    from convert.run import work_dir
    from kimik3_jax.checkpoint.load import Checkpoint

    ckpt = Checkpoint(src)
    cfg = ckpt.config()
    units = plan_units(cfg)
    largest = max(units, key=lambda u: u.nbytes)
    parts = sorted((sum(p.nbytes for p in pieces) for u in units for _, pieces in u.parts), reverse=True)
    two_parts = sum(parts[:2])  # the converter holds a part being written and the next one being read
    file_bytes = sum(p.stat().st_size for p in src.glob("*.safetensors"))
    print(f"{cfg.summary()}\nsource: {len(ckpt.weight_map):,} tensors, {ckpt.total_size / 1e9:.2f} GB of tensors in "
          f"{len(ckpt.files)} shards ({file_bytes / 1e9:.2f} GB of files); largest unit {largest.name}: "
          f"{largest.nbytes / 1e9:.2f} GB, in {len(largest.parts)} parts; two largest parts {two_parts / 1e9:.2f} GB")

    runs: dict[str, list[tuple[float, int, float]]] = {"read": [], "convert": []}
    for _ in range(args.repeat):
        evict(src)
        runs["read"].append(measured([sys.executable, __file__, "--plain-read", str(src)], env))
        shutil.rmtree(out, ignore_errors=True)
        shutil.rmtree(work_dir(out), ignore_errors=True)  # an earlier, interrupted benchmark run
        evict(src)
        runs["convert"].append(measured([sys.executable, "-m", "convert", "--src", str(src), "--dst", str(out),
                                         "--quiet"], env))
    rows = [("plain read of the shards", *min(runs["read"]), file_bytes),
            ("convert (read, sha256, Orbax write)", *min(runs["convert"]), ckpt.total_size)]
    convert_rss = max(r[1] for r in runs["convert"])
    for name, times in runs.items():
        print(f"{name}: " + ", ".join(f"{w:.1f} s ({c:.0f} s CPU)" for w, _, c in times))
    if args.verify:
        evict(src)
        rows.append(("verify (restore + compare)", *measured([sys.executable, "-m", "convert", "--src", str(src),
                                                              "--dst", str(out), "--verify", "--quiet"], env),
                     ckpt.total_size))
    out_bytes = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())

    print("\n| phase | seconds | GB | GB/s | CPU seconds | peak RSS |\n| --- | --- | --- | --- | --- | --- |")
    for name, wall, rss, cpu, size in rows:
        print(f"| {name} | {wall:.1f} | {size / 1e9:.2f} | {size / 1e9 / wall:.2f} | {cpu:.0f} | {rss / 1e9:.2f} GB |")
    ratio = rows[1][1] / rows[0][1]
    bound = two_parts + MEMORY_SLACK
    print(f"\noutput: {out_bytes / 1e9:.2f} GB on disk")
    print(f"convert / plain read time: {ratio:.2f}x ({'within' if ratio <= 2 else 'NOT within'} 2x)")
    print(f"peak RSS {convert_rss / 1e9:.2f} GB vs bound {bound / 1e9:.2f} GB (two largest parts "
          f"{two_parts / 1e9:.2f} GB + {MEMORY_SLACK / 1e9:.1f} GB; one layer is {largest.nbytes / 1e9:.2f} GB): "
          f"{'within' if convert_rss <= bound else 'EXCEEDED'}")
    if not args.keep:
        shutil.rmtree(out, ignore_errors=True)
        if generated:
            shutil.rmtree(src, ignore_errors=True)


if __name__ == "__main__":
    main()
