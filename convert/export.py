"""`kimik3 export`: a converted directory back to the release layout, for engines that read safetensors.

Tensor names, dtypes and shapes are the release's (A_log padded back with zeros, experts packed as
they were). The shard assignment, the shards' `__metadata__` and the index come from the source the
directory was converted from (kept in it), so exporting an unedited conversion of a safetensors-
written release reproduces its shards and index byte for byte; where tensors were left out
(`--text-only`, `--allow-extra`), shards left empty are dropped and the rest renumbered. Each shard is
laid out with `ShardWriter`'s header and offsets (those of safetensors' own writer) and filled piece
by piece: each stored array is restored once and its tensors written at their offsets, so memory
stays at one piece whatever the shards' data order. The output appears only when complete (a
temporary name, then a rename). A checkpoint converted with `--dequantize bf16` is refused: re-quantising is not
exact (a group's scale byte cannot be recovered from its decoded values when the release chose a
larger one, and all-zero groups may carry any byte).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import numpy as np
from tqdm import tqdm

from convert.manifest import copy_side_files, open_converted
from convert.orbax_io import restore_numpy
from convert.plan import (
    EXPERTS_PACKED,
    MANIFEST_FILE,
    REPORT_FILE,
    SOURCE_INDEX_FILE,
    UNITS_DIR,
    Piece,
)
from kimik3_jax.checkpoint.layout import (
    CONFIG_FILE,
    INDEX_FILE,
    plan_shards,
    shard_name,
    write_index,
)
from kimik3_jax.checkpoint.safetensors_io import ShardWriter
from kimik3_jax.errors import CheckpointError


def export_checkpoint(src, dst, *, overwrite: bool = False, progress: bool = True,
                      log=lambda m: print(m, file=sys.stderr)) -> Path:
    src, dst = Path(src), Path(dst)
    _, manifest, units = open_converted(src)
    if manifest["experts"] != EXPERTS_PACKED:
        raise CheckpointError(f"{src}: converted with --dequantize {manifest['experts']}; the release layout "
                              "stores experts as MXFP4 and re-quantising is not exact, so it cannot be exported "
                              "(export a checkpoint converted without --dequantize)")
    if dst.exists() and (not dst.is_dir() or any(dst.iterdir())) and not overwrite:
        raise CheckpointError(f"--dst {dst}: already exists (pass --overwrite to replace it)")
    if dst.resolve() == src.resolve() or src.resolve() in dst.resolve().parents:
        raise CheckpointError(f"--dst {dst}: must not be the converted directory or inside it")
    where = {t.name: (u, p, i) for u in units for p in u.pieces for i, t in enumerate(p.tensors)}
    shards, verbatim = _shards(src, manifest, where)
    metadata = manifest["source"].get("shard_metadata") or {}

    tmp = dst.with_name(f".{dst.name}.export-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        config = json.loads((src / CONFIG_FILE).read_text())
        if manifest["text_only"] and "vision_config" in config:  # no vision tensors: keep the two consistent
            config.pop("vision_config")
            (tmp / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
        else:
            shutil.copyfile(src / CONFIG_FILE, tmp / CONFIG_FILE)
        copy_side_files(src, tmp, skip={CONFIG_FILE, MANIFEST_FILE, REPORT_FILE, SOURCE_INDEX_FILE})
        total = sum(p.leaf.tensor_bytes for _, p, _ in where.values())
        weight_map = {n: new for (_, new), names in shards.items() for n in names}
        _write_shards(src, tmp, units, where, shards, metadata, total, progress)
        if verbatim:
            shutil.copyfile(src / SOURCE_INDEX_FILE, tmp / INDEX_FILE)
        else:
            write_index(tmp, weight_map, total)
        if dst.exists() or dst.is_symlink():
            shutil.rmtree(dst) if dst.is_dir() and not dst.is_symlink() else dst.unlink()
        os.replace(tmp, dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log(f"wrote {dst}: {len(where):,} tensors in {len(shards)} shards, {total / 1e9:.2f} GB")
    return dst


def _shards(src: Path, manifest: dict, where: dict) -> tuple[dict[tuple[str, str], list[str]], bool]:
    """{(source shard, output shard): tensor names} and whether the source index can be copied verbatim."""
    path = src / manifest["source"].get("index_file", SOURCE_INDEX_FILE)
    try:
        weight_map = json.loads(path.read_text())["weight_map"]
    except (OSError, json.JSONDecodeError, KeyError, TypeError):
        weight_map = {}
    if not weight_map or any(n not in weight_map for n in where):  # no usable record: the release plan
        planned = plan_shards([piece.tensors[i] for _, piece, i in where.values()])
        return {("", shard_name(i, len(planned))): [t.name for t in s] for i, s in enumerate(planned, 1)}, False
    kept: dict[str, list[str]] = {}
    for name, f in weight_map.items():
        if name in where:
            kept.setdefault(f, []).append(name)
    files = sorted(set(weight_map.values()))
    if len(kept) == len(files):
        return {(f, f): kept[f] for f in files}, len(weight_map) == len(where)
    ordered = sorted(kept)
    return {(f, shard_name(i, len(ordered))): kept[f] for i, f in enumerate(ordered, 1)}, False


def _tensor(array: np.ndarray, piece: Piece, i: int) -> np.ndarray:
    """Release tensor i of a piece (A_log padded back to head_dim with zeros)."""
    one = array[np.unravel_index(i, piece.lead)] if piece.lead else array
    if piece.how == "alog":
        padded = np.zeros(piece.leaf.shape, piece.dtype)
        padded[:one.shape[-1]] = one
        return padded
    return one


def _write_shards(src: Path, tmp: Path, units, where: dict, shards: dict, metadata: dict, total: int,
                  progress: bool) -> None:
    """Lay out every shard (header written, data region sized), then fill it piece by piece: each
    stored array is restored once and its tensors written at their offsets (`ShardWriter` computes
    the same header and offsets as safetensors' own writer). Memory: one piece."""
    layouts, fds = {}, {}
    try:
        for (old, new), names in shards.items():
            decl = [(n, where[n][1].leaf.dtype, where[n][1].leaf.shape) for n in names]
            layouts[new] = ShardWriter(tmp / new, decl, metadata=metadata.get(old))
            fds[new] = os.open(tmp / new, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.pwrite(fds[new], layouts[new].header, 0)
            os.ftruncate(fds[new], layouts[new].file_size)
        shard_of = {n: new for (_, new), names in shards.items() for n in names}
        with tqdm(total=total, unit="B", unit_scale=True, desc=f"exporting {src.name}", disable=not progress,
                  file=sys.stderr) as bar:
            for unit in units:
                for part, pieces in unit.parts:
                    for piece in pieces:
                        if not any(t.name in shard_of for t in piece.tensors):
                            continue
                        path = src / UNITS_DIR / unit.name / part
                        array = restore_numpy(path, [piece])[piece.key]
                        if array.shape != piece.shape or array.dtype != piece.dtype:
                            raise CheckpointError(f"{path}: {piece.key} is {array.dtype} {list(array.shape)}, the "
                                                  f"manifest says {np.dtype(piece.dtype)} {list(piece.shape)}")
                        for i, t in enumerate(piece.tensors):
                            if t.name in shard_of:
                                f = shard_of[t.name]
                                data = np.ascontiguousarray(_tensor(array, piece, i)).reshape(-1).view(np.uint8)
                                _pwrite_all(fds[f], data, layouts[f].infos[t.name].begin)
                                bar.update(t.nbytes)
                        del array
        for fd in fds.values():
            os.fsync(fd)
    finally:
        for fd in fds.values():
            os.close(fd)


def _pwrite_all(fd: int, data: np.ndarray, offset: int) -> None:
    view = memoryview(data)
    done = 0
    while done < len(view):
        done += os.pwrite(fd, view[done:done + (1 << 30)], offset + done)


