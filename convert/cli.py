"""Arguments and entry points of `kimik3 convert` / `kimik3 export` (also `python -m convert`)."""

from __future__ import annotations

import argparse
import sys


def add_convert_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--src", required=True, help="release-layout directory (config.json, index, shards)")
    p.add_argument("--dst", required=True, help="output directory; appears only when complete")
    p.add_argument("--dry-run", action="store_true",
                   help="read only config.json and the shard headers, print the plan and every problem, write nothing")
    p.add_argument("--text-only", action="store_true", help="leave the vision tower and projector out")
    p.add_argument("--dequantize", choices=["bf16"], default=None,
                   help="store the routed experts decoded to bf16 (research use; about 4x the bytes; cannot be exported)")
    p.add_argument("--allow-extra", action="store_true",
                   help="skip tensors the config does not imply instead of refusing the source")
    p.add_argument("--resume", action="store_true", help="continue an interrupted conversion to --dst")
    p.add_argument("--overwrite", action="store_true",
                   help="replace an existing --dst (or discard an interrupted conversion to it)")
    p.add_argument("--verify", action="store_true",
                   help="afterwards, reopen the output and compare every tensor with the source "
                        "(on an existing complete --dst: verify it only)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--part-bytes", type=int, default=None, help=argparse.SUPPRESS)  # tests: many small parts
    from kimik3_jax.sharding.distributed import add_sharding_arguments
    add_sharding_arguments(p)  # --mesh: after converting, restore --dst sharded over that mesh as a check


def add_export_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--src", required=True, help="a directory written by `kimik3 convert`")
    p.add_argument("--dst", required=True, help="release-layout output directory; appears only when complete")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --dst")
    p.add_argument("--quiet", action="store_true", help="no progress bar")


def run_convert(args: argparse.Namespace) -> int:
    if args.dry_run:
        from convert.dry_run import dry_run

        lines, problems = dry_run(args.src, args.dst, text_only=args.text_only, dequantize=args.dequantize,
                                  allow_extra=args.allow_extra)
        print("\n".join(lines))
        return 1 if problems else 0
    from convert.run import convert_checkpoint
    from kimik3_jax.sharding.distributed import is_writer, plan_from_args

    plan = plan_from_args(args)  # before converting: a bad --mesh fails before hours of work
    if is_writer():  # multi-host: process 0 converts (to a shared file system), the others restore
        convert_checkpoint(args.src, args.dst, text_only=args.text_only, dequantize=args.dequantize,
                           allow_extra=args.allow_extra, resume=args.resume, overwrite=args.overwrite,
                           verify=args.verify, progress=not args.quiet,
                           **({"part_bytes": args.part_bytes} if args.part_bytes else {}))
    if plan is not None:
        from convert.restore import check_sharded_restore

        print(check_sharded_restore(args.dst, plan, text_only=args.text_only))
    return 0


def run_export(args: argparse.Namespace) -> int:
    from convert.export import export_checkpoint

    export_checkpoint(args.src, args.dst, overwrite=args.overwrite, progress=not args.quiet)
    return 0


def main(argv: list[str] | None = None) -> int:
    """`python -m convert --src HF_DIR --dst OUT_DIR [...]` (or `python -m convert export --src ... --dst ...`)."""
    from kimik3_jax.errors import K3Error

    argv = sys.argv[1:] if argv is None else list(argv)
    export = bool(argv) and argv[0] == "export"
    parser = argparse.ArgumentParser(prog="python -m convert" + (" export" if export else ""),
                                     description="Release safetensors <-> Orbax checkpoint conversion.")
    (add_export_arguments if export else add_convert_arguments)(parser)
    args = parser.parse_args(argv[1:] if export else argv)
    try:
        if not export:
            from kimik3_jax.sharding.distributed import initialize

            initialize(args)
        return run_export(args) if export else run_convert(args)
    except K3Error as e:
        print(f"{parser.prog}: error: {e}", file=sys.stderr)
        return 2
