"""`--verify`: reopen a converted directory and compare every stored array with its source.

Piece by piece (memory: one stored array and its source), each array is restored from Orbax
and compared byte for byte with what conversion would make of the source now: the release bytes for
copied pieces (packed experts included: equal bytes decode equally), the decoded bf16 for
`--dequantize` pieces, the real heads for `A_log`. The source tensors' sha256 are compared with the
ones in the report as well, so a source that changed after conversion is reported as such.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
from tqdm import tqdm

from convert.manifest import open_converted
from convert.orbax_io import restore_numpy, unit_arrays
from convert.plan import REPORT_FILE, UNITS_DIR
from convert.source import SourceReader
from kimik3_jax.checkpoint.load import Checkpoint
from kimik3_jax.errors import CheckpointError


def verify_checkpoint(out_dir: str | Path, src_dir: str | Path | None = None, *, progress: bool = True) -> list[str]:
    """Every difference between a converted directory and its source (empty: they agree)."""
    out_dir = Path(out_dir)
    cfg, manifest, units = open_converted(out_dir)
    src = Path(src_dir) if src_dir is not None else Path(manifest["source"]["path"])
    try:
        recorded = json.loads((out_dir / REPORT_FILE).read_text())["checksums"]["tensors"]
    except (OSError, json.JSONDecodeError, KeyError, TypeError) as e:
        return [f"{out_dir / REPORT_FILE}: unreadable report ({type(e).__name__}: {e})"]
    ckpt = Checkpoint(src)
    problems = ckpt.problems(cfg, bool(manifest["text_only"]))
    if problems:
        return [f"source {src}: {p}" for p in problems]
    reader = SourceReader(ckpt)
    bar = tqdm(total=sum(u.source_bytes for u in units), unit="B", unit_scale=True, desc=f"verifying {out_dir.name}",
               disable=not progress, file=sys.stderr)
    try:
        for unit in units:
            stored, digests = {}, {}
            for part, _ in unit.parts:
                try:
                    stored.update(unit_arrays(out_dir / UNITS_DIR / unit.name / part))
                except Exception as e:  # noqa: BLE001  a part Orbax cannot open
                    problems.append(f"{out_dir / UNITS_DIR / unit.name / part}: cannot be opened ({type(e).__name__}: {e})")
            for piece in unit.pieces:  # one piece at a time: memory is two pieces, not a unit
                path = out_dir / UNITS_DIR / unit.name / unit.part_of(piece.key)
                where = f"{path}: {piece.key}"
                bar.update(piece.source_bytes)
                if stored.get(piece.key) != (piece.shape, piece.dtype):
                    problems.append(f"{where} is stored as {stored.get(piece.key)}, expected {(piece.shape, piece.dtype)}")
                    continue
                try:
                    got = restore_numpy(path, [piece])[piece.key]
                except CheckpointError as e:
                    problems.append(str(e))
                    continue
                try:
                    want = reader.read_piece(piece, digests)
                except CheckpointError as e:
                    problems.append(f"source {src}: {e}")
                    continue
                problems += _compare(where, piece, got, want)
                del got, want
            for name, digest in digests.items():
                if recorded.get(name) != digest:
                    problems.append(f"source tensor {name}: sha256 {digest[:16]}... differs from the report's "
                                    f"{str(recorded.get(name))[:16]}... (the source changed after conversion?)")
    finally:
        bar.close()
        reader.close()
    return problems


def _compare(where: str, piece, got: np.ndarray, want: np.ndarray) -> list[str]:
    if got.shape != want.shape or got.dtype != want.dtype:
        return [f"{where}: restored {got.dtype} {list(got.shape)}, expected {want.dtype} {list(want.shape)}"]
    rows_got = np.ascontiguousarray(got).reshape(len(piece.tensors), -1).view(np.uint8)
    rows_want = want.reshape(len(piece.tensors), -1).view(np.uint8)
    out = []
    for i, t in enumerate(piece.tensors):
        if not np.array_equal(rows_got[i], rows_want[i]):
            n = int(np.count_nonzero(rows_got[i] != rows_want[i]))
            out.append(f"{where}: differs from source tensor {t.name} ({n} byte(s) differ)")
    return out
