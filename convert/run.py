"""`convert_checkpoint`: a release directory to a converted (Orbax) directory, streaming and resumable.

The run, in order:
1. validate the source (headers, then the A_log padding) and refuse before writing anything;
2. check the destination: an existing output needs --overwrite, an interrupted run --resume;
3. work in `.<OUT>.partial` beside OUT, holding an exclusive lock (a second converter is refused);
   `plan.json` pins the source fingerprint and the options, so --resume refuses a changed source;
4. for each unit not yet done, part by part: read its tensors from the shards (hashing each) while a
   saver thread writes the previous part with Orbax (fsynced, renamed into place by Orbax); after a
   unit's last part, the saver appends a line to `progress.jsonl` (fsynced): a unit counts as done
   only once that line exists;
5. write the report, then the manifest, then rename the work directory to OUT: the one atomic step
   that makes OUT appear, complete.
A killed run leaves only the work directory; --resume re-checks the recorded units against their
Orbax metadata, deletes anything unrecorded (Orbax temporaries included) and continues.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import signal
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from tqdm import tqdm

from convert.manifest import (
    copy_side_files,
    is_orbax_checkpoint,
    write_json,
)
from convert.orbax_io import TMP_SUFFIX, save_unit, unit_arrays
from convert.plan import (
    EXPERTS_BF16,
    EXPERTS_PACKED,
    FORMAT,
    FORMAT_VERSION,
    MANIFEST_FILE,
    PART_BYTES,
    REPORT_FILE,
    SOURCE_INDEX_FILE,
    UNITS_DIR,
    Unit,
    plan_units,
)
from convert.report import build_manifest, build_report
from convert.source import SourceReader, fingerprint, validate
from kimik3_jax.atomic import atomic_file
from kimik3_jax.checkpoint.layout import INDEX_FILE
from kimik3_jax.checkpoint.load import MAX_LISTED, Checkpoint
from kimik3_jax.errors import CheckpointError

PLAN_FILE, PROGRESS_FILE, LOCK_FILE = "plan.json", "progress.jsonl", ".lock"
CRASH_ENV = "KIMIK3_CONVERT_CRASH"  # tests: "<point>:<unit index>" makes the converter SIGKILL itself


def _stderr(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


@dataclass
class ConvertResult:
    dst: Path
    units_written: int = 0
    units_resumed: int = 0
    report: dict = field(default_factory=dict)
    verify_problems: list[str] = field(default_factory=list)


def work_dir(dst: Path) -> Path:
    """Where a conversion to `dst` is assembled (and where an interrupted one waits for --resume)."""
    return dst.parent / f".{dst.name}.partial"


def experts_mode(dequantize: str | None) -> str:
    if dequantize in (None, "", "none"):
        return EXPERTS_PACKED
    if dequantize == "bf16":
        return EXPERTS_BF16
    raise CheckpointError(f"--dequantize {dequantize!r}: only bf16 is supported")


def listing(where, problems: list[str], limit: int | None = MAX_LISTED) -> str:
    shown = problems if limit is None else problems[:limit]
    more = f"\n  ... and {len(problems) - len(shown)} more" if len(problems) > len(shown) else ""
    return f"{where}: {len(problems)} problem(s):\n  " + "\n  ".join(shown) + more


def convert_checkpoint(src, dst, *, text_only: bool = False, dequantize: str | None = None,
                       allow_extra: bool = False, resume: bool = False, overwrite: bool = False,
                       verify: bool = False, progress: bool = True, part_bytes: int = PART_BYTES,
                       log=_stderr) -> ConvertResult:
    started = time.time()
    src, dst = Path(src), Path(dst)
    experts = experts_mode(dequantize)
    ckpt = Checkpoint(src)
    cfg = ckpt.config()
    problems, extras = validate(ckpt, cfg, text_only=text_only, allow_extra=allow_extra)
    if problems:
        raise CheckpointError(listing(src, problems))
    if part_bytes < 1:
        raise CheckpointError(f"--part-bytes {part_bytes}: must be positive")
    units = plan_units(cfg, text_only, experts, part_bytes)
    result = ConvertResult(dst)
    if _same_or_nested(src, dst):
        raise CheckpointError(f"--dst {dst}: must not be the source directory or inside it (or contain it)")
    if dst.exists() and (not dst.is_dir() or any(dst.iterdir())) and not overwrite:
        if is_orbax_checkpoint(dst) and (verify or resume):
            log(f"{dst}: already converted; nothing to resume" if resume else f"{dst}: already converted")
            if verify:
                result.verify_problems = _verify(dst, src, progress, log)
            return result
        raise CheckpointError(f"--dst {dst}: already exists (pass --overwrite to replace it)")
    options = {"text_only": text_only, "experts": experts, "allow_extra": allow_extra, "part_bytes": part_bytes}
    work = work_dir(dst)
    if work.exists() and not (resume or overwrite):
        raise CheckpointError(f"--dst {dst}: an interrupted conversion is waiting at {work}: pass --resume to "
                              "continue it, or --overwrite to discard it and start over")
    work.mkdir(parents=True, exist_ok=True)
    lock = _lock(work)
    try:
        fp = fingerprint(ckpt)
        plan = {"format": FORMAT, "version": FORMAT_VERSION, "source": str(src.resolve()), "fingerprint": fp,
                "options": options, "units": [u.name for u in units]}
        done = _prepare(work, plan, units, resume, log)
        result.units_resumed = len(done)
        copy_side_files(src, work)
        shutil.copyfile(src / INDEX_FILE, work / SOURCE_INDEX_FILE)
        run_no = 1 + max((r.get("run", 0) for r in done.values()), default=0)
        try:
            _convert_units(ckpt, work, units, done, run_no, progress, log)
        except CheckpointError:  # bad source data (scale byte 255): fixing it changes the source, so
            shutil.rmtree(work, ignore_errors=True)  # there is nothing to resume; interruptions keep `work`
            raise
        result.units_written = len(units) - result.units_resumed
        records = _read_progress(work)
        result.report = build_report(ckpt, units, records, options, extras, fp, started, run_no)
        write_json(work / REPORT_FILE, result.report)
        write_json(work / MANIFEST_FILE, build_manifest(ckpt, units, options, extras))
        _crash("commit", len(units))
        for name in (PLAN_FILE, PROGRESS_FILE):
            (work / name).unlink()
        _commit(work, dst)
    finally:
        os.close(lock)
    log(f"wrote {dst}: {len(units)} units ({result.units_resumed} from an earlier run), "
        f"{result.report['converted']['tensors']:,} tensors, {result.report['converted']['output_bytes'] / 1e9:.2f} GB "
        f"in {result.report['elapsed_s']:.1f} s")
    if verify:
        result.verify_problems = _verify(dst, src, progress, log)
    return result


def _same_or_nested(a: Path, b: Path) -> bool:
    a, b = a.resolve(), b.resolve()
    return a == b or a in b.parents or b in a.parents


def _lock(work: Path) -> int:
    fd = os.open(work / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise CheckpointError(f"{work}: another conversion is writing there (it holds {work / LOCK_FILE})") from None
    return fd


def _prepare(work: Path, plan: dict, units: tuple[Unit, ...], resume: bool, log) -> dict[str, dict]:
    """Start afresh, or (--resume) keep the units an earlier run recorded and still finds intact."""
    done: dict[str, dict] = {}
    old = None
    if resume and (work / PLAN_FILE).is_file():
        old = json.loads((work / PLAN_FILE).read_text())
        changed = [k for k in ("format", "version", "source", "fingerprint", "options", "units")
                   if old.get(k) != plan.get(k)]
        if changed:
            raise CheckpointError(f"{work}: cannot resume: {', '.join(changed)} changed since the interrupted "
                                  "run (pass --overwrite to start over)")
        by_name = {u.name: u for u in units}
        for name, rec in _read_progress(work).items():
            unit = by_name.get(name)
            if unit is not None and _intact(work / UNITS_DIR / name, unit):
                done[name] = rec
            else:
                log(f"{work / UNITS_DIR / name}: recorded but not intact, converting it again")
    else:
        for p in work.iterdir():
            if p.name != LOCK_FILE:
                shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()
    (work / UNITS_DIR).mkdir(exist_ok=True)
    for p in (work / UNITS_DIR).iterdir():  # unrecorded units and Orbax temporaries of a killed run
        if p.name not in done:
            shutil.rmtree(p) if p.is_dir() else p.unlink()
    if done:
        _rewrite_progress(work, [done[u.name] for u in units if u.name in done])
        log(f"resuming {work}: {len(done)} of {len(units)} units already converted")
    elif (work / PROGRESS_FILE).exists():
        (work / PROGRESS_FILE).unlink()
    if old is None:
        write_json(work / PLAN_FILE, plan)
    return done


def _intact(path: Path, unit: Unit) -> bool:
    """Every part of the unit opens and holds the planned arrays (Orbax metadata only)."""
    try:
        return all(unit_arrays(path / part) == {p.key: (p.shape, p.dtype) for p in pieces}
                   for part, pieces in unit.parts)
    except Exception:  # noqa: BLE001  a missing or unreadable unit is simply converted again
        return False


def _read_progress(work: Path) -> dict[str, dict]:
    records = {}
    path = work / PROGRESS_FILE
    if path.is_file():
        for line in path.read_text().splitlines():
            try:
                rec = json.loads(line)
                records[rec["unit"]] = rec
            except (json.JSONDecodeError, KeyError, TypeError):
                continue  # a line torn by a kill: that unit is not done
    return records


def _rewrite_progress(work: Path, records: list[dict]) -> None:
    with atomic_file(work / PROGRESS_FILE) as f:
        f.writelines(json.dumps(r) + "\n" for r in records)


def _append_progress(work: Path, record: dict) -> None:
    with open(work / PROGRESS_FILE, "a") as f:
        f.write(json.dumps(record) + "\n")
        f.flush()
        os.fsync(f.fileno())


def _convert_units(ckpt: Checkpoint, work: Path, units, done: dict, run_no: int, progress: bool, log) -> None:
    """Read part after part (tensor by tensor); a single saver thread writes each part with Orbax
    while the next one is read, so reading and writing overlap and at most two parts are in memory.
    The saver records a unit in progress.jsonl once its last part is saved."""
    total_tensors = sum(len(u.tensors) for u in units)
    tensors = sum(len(u.tensors) for u in units if u.name in done)
    reader = SourceReader(ckpt)
    saver = ThreadPoolExecutor(1, thread_name_prefix="orbax-save")
    saving = None
    buffers = _Buffers()
    bar = tqdm(total=sum(u.source_bytes for u in units), initial=sum(u.source_bytes for u in units if u.name in done),
               unit="B", unit_scale=True, desc=f"converting {ckpt.dir.name}", disable=not progress, file=sys.stderr)
    try:
        for i, unit in enumerate(units):
            if unit.name in done:
                continue
            timing = {"unit": unit.name, "run": run_no, "started": time.time(), "read_s": 0.0, "save_s": 0.0}
            digests: dict[str, str] = {}
            for j, (part, pieces) in enumerate(unit.parts):
                t0 = time.time()
                arrays = {}
                for piece, out in zip(pieces, buffers.take(pieces)):
                    arrays[piece.key] = reader.read_piece(piece, digests, out)
                    tensors += len(piece.tensors) + len(piece.scales)
                    bar.set_postfix_str(f"{tensors:,}/{total_tensors:,} tensors, {unit.name}", refresh=False)
                    bar.update(piece.source_bytes)
                timing["read_s"] += time.time() - t0
                last = j == len(unit.parts) - 1
                if last:
                    _crash("read", i)
                if saving is not None:
                    saving.result()  # the previous part is written: only this one and the next read stay in memory
                    buffers.written()
                saving = saver.submit(_save_part, work, unit, i, part, pieces, arrays, timing,
                                      digests if last else None)
                del arrays
        if saving is not None:
            saving.result()
    finally:
        saver.shutdown(wait=True, cancel_futures=True)
        bar.close()
        reader.close()


class _Buffers:
    """Two part-sized buffers in turn: the part being written and the one being read. A buffer comes
    back for reuse once its part is written, so the kernel does not zero fresh pages for every part
    (measured: 15% of the converter's CPU time); a too-small one is dropped before a bigger one is made."""

    def __init__(self):
        self.free: np.ndarray | None = None  # the buffer of the part written last
        self.busy: list[np.ndarray] = []  # [part being written, part being read]

    def take(self, pieces) -> list[np.ndarray]:
        offsets, size = [], 0
        for p in pieces:
            offsets.append(size)
            size += -(-p.nbytes // 64) * 64  # 64-byte aligned arrays
        buf, self.free = self.free, None
        if buf is None or buf.nbytes < size:
            del buf
            buf = np.empty(max(size, 1), np.uint8)
        self.busy.append(buf)
        return [buf[o:o + p.nbytes].view(p.dtype).reshape(p.shape) for o, p in zip(offsets, pieces)]

    def written(self) -> None:
        """The oldest busy buffer's part is saved: keep it for the next part."""
        self.free = self.busy.pop(0)


def _save_part(work: Path, unit: Unit, index: int, part: str, pieces, arrays: dict, timing: dict,
               digests: dict | None) -> None:
    path = work / UNITS_DIR / unit.name / part
    path.parent.mkdir(exist_ok=True)
    t0 = time.time()
    with _crash_while_saving(index, path, armed=digests is not None):
        save_unit(path, list(pieces), arrays)
    timing["save_s"] += time.time() - t0
    if digests is None:
        return
    _crash("saved", index)
    _append_progress(work, {**timing, "finished": time.time(), "read_s": round(timing["read_s"], 3),
                            "save_s": round(timing["save_s"], 3), "digests": digests})
    _crash("recorded", index)


def _crash(point: str, index: int) -> None:
    if os.environ.get(CRASH_ENV) == f"{point}:{index}":
        os.kill(os.getpid(), signal.SIGKILL)


class _crash_while_saving:
    """Test hook: SIGKILL as soon as Orbax's temporary directory for the unit appears (mid-save)."""

    def __init__(self, index: int, path: Path, armed: bool = True):
        self.armed = armed and os.environ.get(CRASH_ENV) == f"saving:{index}"
        self.tmp = path.with_name(path.name + TMP_SUFFIX)

    def _watch(self):
        while not self.tmp.exists():
            time.sleep(0.0002)
        os.kill(os.getpid(), signal.SIGKILL)

    def __enter__(self):
        if self.armed:
            threading.Thread(target=self._watch, daemon=True).start()

    def __exit__(self, *exc):
        if self.armed:
            os.kill(os.getpid(), signal.SIGKILL)  # the save beat the watcher: die right after it


def _commit(work: Path, dst: Path) -> None:
    (work / LOCK_FILE).unlink()
    old = None
    if dst.exists() or dst.is_symlink():
        old = dst.with_name(f".{dst.name}.replaced-{os.getpid()}")
        os.replace(dst, old)
    os.replace(work, dst)
    if old is not None:
        shutil.rmtree(old) if old.is_dir() and not old.is_symlink() else old.unlink()


def _verify(dst: Path, src: Path, progress: bool, log) -> list[str]:
    from convert.verify import verify_checkpoint

    problems = verify_checkpoint(dst, src, progress=progress)
    if problems:
        raise CheckpointError(listing(f"verify {dst}", problems))
    log(f"verified {dst}: every tensor equals its source")
    return problems
