"""`kimik3 convert --dry-run`: the plan and every problem, from config.json and the shard headers only."""

from __future__ import annotations

from pathlib import Path

from convert.manifest import is_orbax_checkpoint
from convert.plan import EXPERTS_BF16, UNITS_DIR, plan_units
from convert.run import experts_mode, work_dir
from convert.source import validate
from kimik3_jax.checkpoint.load import Checkpoint
from kimik3_jax.errors import K3Error


def _gb(n: int) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e7 else f"{n / 1e6:.2f} MB"


def dry_run(src, dst, *, text_only: bool = False, dequantize: str | None = None,
            allow_extra: bool = False) -> tuple[list[str], list[str]]:
    """(lines to print, problems). Reads config.json, the index and the shard headers; writes nothing."""
    src, dst = Path(src), Path(dst)
    lines = [f"source {src}"]
    try:
        experts = experts_mode(dequantize)
        ckpt = Checkpoint(src)
        cfg = ckpt.config()
    except K3Error as e:
        return lines + [f"1 problem:\n  - {e}"], [str(e)]
    lines.append(cfg.summary())
    problems, extras = validate(ckpt, cfg, text_only=text_only, allow_extra=allow_extra, headers_only=True)
    units = plan_units(cfg, text_only, experts)
    n_in = sum(len(u.tensors) for u in units)
    b_in = sum(u.source_bytes for u in units)
    b_out = sum(u.nbytes for u in units)
    lines += [
        f"index: {len(ckpt.weight_map):,} tensors in {len(ckpt.files)} shards, total_size {ckpt.total_size:,} bytes",
        (f"convert: {n_in:,} tensors, {_gb(b_in)} in -> {sum(len(u.pieces) for u in units):,} arrays, "
         f"{_gb(b_out)} out (experts {'decoded to bf16' if experts == EXPERTS_BF16 else 'kept packed (MXFP4)'}"
         f"{', vision left out' if text_only else ''})"),
    ]
    if extras:
        lines.append(f"skipped (--allow-extra): {len(extras)} tensors: {', '.join(extras[:5])}"
                     + (" ..." if len(extras) > 5 else ""))
    big = max(units, key=lambda u: u.nbytes)
    parts = sorted((sum(p.nbytes for p in pieces) for u in units for _, pieces in u.parts), reverse=True)
    lines += [
        f"output {dst}/:",
        "  config.json, tokenizer and other side files (copied), source.safetensors.index.json,",
        "  convert_report.json (revision facts, counts, sha256 of every source tensor), kimik3_orbax.json (manifest)",
        f"  {UNITS_DIR}/: {len(units)} units: " + ", ".join(
            [u.name for u in units] if len(units) <= 6 else [u.name for u in units[:3]] + ["..."]
            + [u.name for u in units[-2:]]),
        (f"  {sum(len(u.parts) for u in units)} Orbax checkpoints in all (parts of about 1 GiB); largest unit "
         f"{big.name}: {_gb(big.nbytes)}"),
        f"peak memory of conversion: about {_gb(sum(parts[:2]))} (a part written while the next is read)",
    ]
    if is_orbax_checkpoint(dst):
        lines.append(f"destination {dst} is a complete conversion: --overwrite to replace it, --verify to check it")
    elif dst.exists():
        lines.append(f"destination {dst} exists: --overwrite to replace it")
    if work_dir(dst).exists():
        lines.append(f"an interrupted conversion waits at {work_dir(dst)}: --resume to continue it")
    lines.append("data checks (A_log padding, scale bytes) run during the conversion itself")
    if problems:
        lines.append(f"{len(problems)} problem(s):")
        lines += [f"  - {p}" for p in problems]
    else:
        lines.append("no problems found")
    return lines, problems
