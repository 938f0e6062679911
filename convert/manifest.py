"""The converted directory's manifest: writing it, reading it back, and checking it against the plan.

`kimik3_orbax.json` is written last, after every unit and the report, and only then is the work
directory renamed to the output name: a directory with a manifest is complete. Readers re-derive the
unit plan from `config.json` and the recorded options and refuse a manifest that disagrees with it,
so a hand-edited config or a manifest from another format version is caught before any restore.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np

from convert.plan import (
    EXPERTS_BF16,
    EXPERTS_PACKED,
    FORMAT,
    FORMAT_VERSION,
    MANIFEST_FILE,
    UNITS_DIR,
    Unit,
    plan_units,
)
from kimik3_jax.atomic import atomic_file
from kimik3_jax.checkpoint.layout import CONFIG_FILE, INDEX_FILE
from kimik3_jax.config import ModelConfig
from kimik3_jax.errors import CheckpointError


def is_orbax_checkpoint(directory: str | Path) -> bool:
    """True for a complete converted directory (it has the manifest of this format)."""
    path = Path(directory) / MANIFEST_FILE
    if not path.is_file():
        return False
    try:
        return json.loads(path.read_text()).get("format") == FORMAT
    except (OSError, json.JSONDecodeError, AttributeError):
        return False


def write_json(path: Path, data) -> None:
    """Write JSON durably and atomically (a temporary file, fsync, rename)."""
    with atomic_file(path) as f:
        json.dump(data, f, indent=1)
        f.write("\n")


def manifest_entry(unit: Unit) -> dict:
    return {"name": unit.name, "layer": unit.layer, "arrays": {
        p.key: {"part": part, "stack": p.stack, "how": p.how, "shape": list(p.shape), "dtype": np.dtype(p.dtype).name}
        for part, pieces in unit.parts for p in pieces}}


def read_manifest(directory: str | Path) -> dict:
    directory = Path(directory)
    path = directory / MANIFEST_FILE
    if not directory.is_dir():
        raise CheckpointError(f"{directory}: checkpoint directory not found")
    try:
        manifest = json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path}: not found: {directory} is not a complete converted checkpoint") from None
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: unreadable manifest ({e})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(f"{path}: not a {FORMAT} manifest")
    if manifest.get("version") != FORMAT_VERSION:
        raise CheckpointError(f"{path}: format version {manifest.get('version')}, this code reads {FORMAT_VERSION}")
    if manifest.get("experts") not in (EXPERTS_PACKED, EXPERTS_BF16):
        raise CheckpointError(f"{path}: experts = {manifest.get('experts')!r}, expected mxfp4 or bf16")
    return manifest


def open_converted(directory: str | Path) -> tuple[ModelConfig, dict, tuple[Unit, ...]]:
    """(config, manifest, units) of a complete converted directory; the units re-planned from the config
    and checked against the manifest."""
    directory = Path(directory)
    manifest = read_manifest(directory)
    if not (directory / CONFIG_FILE).is_file():
        raise CheckpointError(f"{directory / CONFIG_FILE}: config file not found in the converted checkpoint")
    cfg = ModelConfig.from_file(directory / CONFIG_FILE)
    part_bytes = manifest.get("part_bytes")
    if not isinstance(part_bytes, int) or part_bytes < 1:
        raise CheckpointError(f"{directory / MANIFEST_FILE}: part_bytes = {part_bytes!r}, expected a positive integer")
    units = plan_units(cfg, bool(manifest.get("text_only")), manifest["experts"], part_bytes)
    recorded = {u.get("name"): u for u in manifest.get("units", [])}
    for unit in units:
        want = manifest_entry(unit)
        got = recorded.pop(unit.name, None)
        if got != want:
            what = "is missing" if got is None else "disagrees with config.json"
            raise CheckpointError(f"{directory / MANIFEST_FILE}: unit {unit.name} {what} "
                                  f"(config.json implies arrays {sorted(want['arrays'])[:4]}...)")
        for part, _ in unit.parts:
            if not (directory / UNITS_DIR / unit.name / part).is_dir():
                raise CheckpointError(f"{directory / UNITS_DIR / unit.name / part}: Orbax checkpoint missing")
    if recorded:
        raise CheckpointError(f"{directory / MANIFEST_FILE}: units {sorted(recorded)} are not implied by config.json")
    return cfg, manifest, units


def side_files(directory: Path) -> list[Path]:
    """The small files beside the weights (config, tokenizer, code, chat template): every regular
    top-level file except the shards, the index and hidden files."""
    return sorted(p for p in directory.iterdir() if p.is_file() and not p.name.startswith(".")
                  and not p.name.endswith(".safetensors") and p.name != INDEX_FILE)


def copy_side_files(src: Path, dst: Path, skip=()) -> None:
    for p in side_files(src):
        if p.name not in skip:
            shutil.copyfile(p, dst / p.name)
