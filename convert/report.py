"""What a finished conversion writes besides the units: the manifest (for readers) and the report
(for people): source revision facts, counts, bytes, timings and the sha256 of every source tensor."""

from __future__ import annotations

import sys
import time

from convert.manifest import manifest_entry
from convert.plan import FORMAT, FORMAT_VERSION, SOURCE_INDEX_FILE, VISION_PREFIXES
from convert.source import revision_facts
from kimik3_jax.checkpoint.load import Checkpoint
from kimik3_jax.checkpoint.safetensors_io import read_header


def build_manifest(ckpt: Checkpoint, units, options: dict, extras: list[str]) -> dict:
    metadata = {f: read_header(ckpt.dir / f)[1] for f in ckpt.files}
    return {"format": FORMAT, "version": FORMAT_VERSION, "experts": options["experts"],
            "text_only": options["text_only"], "part_bytes": options["part_bytes"],
            "units": [manifest_entry(u) for u in units],
            "source": {"path": str(ckpt.dir.resolve()), "index_file": SOURCE_INDEX_FILE,
                       "shard_metadata": metadata, "skipped": extras}}


def build_report(ckpt: Checkpoint, units, records: dict, options: dict, extras: list[str], fp: dict,
            started: float, run_no: int) -> dict:
    import jax
    import orbax.checkpoint as ocp

    digests = {}
    for u in units:
        digests.update(records[u.name]["digests"])
    ordered = {t.name: digests[t.name] for u in units for t in u.tensors}
    runs: dict[int, list[float]] = {}
    for rec in records.values():
        span = runs.setdefault(rec["run"], [rec["started"], rec["finished"]])
        span[0], span[1] = min(span[0], rec["started"]), max(span[1], rec["finished"])
    earlier = sum(b - a for r, (a, b) in runs.items() if r != run_no)  # interrupted runs, up to their last unit
    vision = sum(1 for n in ckpt.weight_map if n.startswith(VISION_PREFIXES)) if options["text_only"] else 0
    return {
        "format": "kimik3-convert-report", "version": 1,
        "source": {**revision_facts(ckpt), "fingerprint": fp, "index_tensors": len(ckpt.weight_map),
                   "index_total_size": ckpt.total_size},
        "options": options,
        "converted": {"units": len(units), "tensors": len(ordered),
                      "source_bytes": sum(u.source_bytes for u in units),
                      "output_bytes": sum(u.nbytes for u in units),
                      "skipped_extra": extras, "skipped_vision_tensors": vision},
        "elapsed_s": round(time.time() - started, 3),
        "elapsed_with_interrupted_runs_s": round(time.time() - started + earlier, 3),
        "runs": run_no,
        "unit_seconds": {u: {"read": r.get("read_s"), "save": r.get("save_s")} for u, r in records.items()},
        "tools": {"python": sys.version.split()[0], "jax": jax.__version__, "orbax": ocp.__version__},
        "checksums": {"algorithm": "sha256", "of": "each source tensor's bytes as stored in its shard",
                      "tensors": ordered},
    }
