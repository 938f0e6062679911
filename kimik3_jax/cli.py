"""The `kimik3` command line. Each subcommand parses its arguments and calls one library function."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from kimik3_jax.errors import K3Error
from kimik3_jax.sharding.distributed import add_sharding_arguments

DEFAULT_CACHE = Path.home() / ".cache" / "kimik3"


def _human(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000
    return str(n)


def cmd_make_checkpoint(args: argparse.Namespace) -> int:
    from kimik3_jax.checkpoint.generate import make_checkpoint
    from kimik3_jax.checkpoint.load import Checkpoint
    from kimik3_jax.presets import config_dict

    out = make_checkpoint(config_dict(args.preset, args.layers), args.out, seed=args.seed,
                          num_shards=args.shards, text_only=args.text_only, overwrite=args.overwrite,
                          progress=not args.quiet)
    ckpt = Checkpoint(out)
    print(f"{ckpt.config().summary()}\nwrote {out} ({_human(ckpt.total_size)} of tensors in "
          f"{len(ckpt.files)} shards, seed {args.seed})")
    return 0


def cmd_inspect(args: argparse.Namespace) -> int:
    from kimik3_jax.checkpoint.load import Checkpoint, summarize
    from kimik3_jax.params import param_count
    from kimik3_jax.tokenizer import K3Tokenizer

    ckpt = Checkpoint(args.dir)
    cfg = ckpt.config()
    print(f"{ckpt.dir}\n{cfg.summary()}")
    print(f"parameters: {param_count(cfg):,} text ({param_count(cfg, experts=True):,} routed-expert), "
          f"{param_count(cfg, vision=True):,} vision")
    from kimik3_jax.model.state import state_bytes
    sb = state_bytes(cfg)
    print(f"decode state per sequence: KDA {sb['kda_state'] / 2**20:,.1f} MiB fp32 + conv tails "
          f"{sb['kda_conv'] / 2**20:,.2f} MiB; MLA cache {sb['mla_per_token']:,} B per token (bf16)")
    problems = ckpt.problems(cfg, text_only=args.text_only)
    rows = summarize(ckpt, cfg)
    print(f"{len(ckpt.files)} shards, {sum(r[1] for r in rows):,} tensors, {_human(sum(r[2] for r in rows))} "
          f"(index total_size {ckpt.total_size})")
    for kind, count, size in rows:
        print(f"  {kind:<40} {count:>9,} tensors {_human(size):>12}")
    try:
        tok = K3Tokenizer.from_dir(ckpt.dir)
        print(f"tokenizer: {tok.num_bpe_tokens:,} BPE tokens + {tok.vocab_size - tok.num_bpe_tokens} specials")
        if tok.vocab_size != cfg.vocab_size:
            problems.append(f"{ckpt.dir}: tokenizer has {tok.vocab_size} ids, config.json vocab_size is {cfg.vocab_size}")
    except K3Error as e:
        problems.append(str(e))
    if problems:
        print(f"{len(problems)} problem(s):")
        for p in problems:
            print(f"  - {p}")
        return 1
    print("no problems found")
    return 0


def cmd_logits(args: argparse.Namespace) -> int:
    from kimik3_jax.model.logits import parse_tokens, read_tokens_file, save_npy, sequence_logits

    if args.tokens is not None:
        tokens, origin = parse_tokens(args.tokens, "--tokens"), "--tokens"
    else:
        tokens, origin = read_tokens_file(args.tokens_file), args.tokens_file
    from kimik3_jax.sharding.distributed import is_writer, plan_from_args

    logits = sequence_logits(args.checkpoint, tokens, args.dtype, origin, plan_from_args(args))
    if not is_writer():
        return 0
    save_npy(args.out, logits)
    print(f"wrote {args.out}: logits {list(logits.shape)} {logits.dtype} ({args.dtype} model); "
          f"argmax of the last position {int(logits[-1].argmax())}")
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    from kimik3_jax.config import ModelConfig
    from kimik3_jax.presets import preset
    from kimik3_jax.sharding import parse_mesh
    from kimik3_jax.sharding.memory import parse_bytes, plan_memory, report

    cfg = ModelConfig.from_file(args.config) if args.config else preset(args.preset)
    for flag, value in (("--batch", args.batch), ("--context", args.context)):
        if value < 1:
            raise K3Error(f"{flag} must be >= 1, got {value}")
    if not 0 <= args.headroom < 1:
        raise K3Error(f"--headroom must be in [0, 1), got {args.headroom}")
    sizes = parse_mesh(args.mesh) if args.mesh else {}
    mp = plan_memory(cfg, sizes, device_bytes=parse_bytes(args.device_memory), headroom=args.headroom)
    print(report(cfg, mp, args.batch, args.context))
    return 0


def cmd_convert(args: argparse.Namespace) -> int:
    from convert.cli import run_convert

    return run_convert(args)


def cmd_export(args: argparse.Namespace) -> int:
    from convert.cli import run_export

    return run_export(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kimik3", description="Kimi K3 in JAX: checkpoints, inference, tools.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("make-checkpoint", help="write a random checkpoint in the exact release layout")
    p.add_argument("--preset", default="tiny", help="tiny | slice | k3 | path to a config.json (default tiny)")
    p.add_argument("--out", required=True, help="output directory (must not exist or be empty)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--shards", type=int, default=None, help="number of shard files (default: by size, at least 4)")
    p.add_argument("--layers", type=int, default=None, help="keep only the first N layers (e.g. a 1-layer slice)")
    p.add_argument("--text-only", action="store_true", help="leave out the vision tower")
    p.add_argument("--overwrite", action="store_true", help="replace an existing output directory")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_make_checkpoint)

    p = sub.add_parser("inspect", help="summarise a checkpoint directory and list every problem (headers only)")
    p.add_argument("dir")
    p.add_argument("--text-only", action="store_true", help="do not expect the vision tower")
    p.set_defaults(func=cmd_inspect)

    p = sub.add_parser("logits", help="write the logits [T, vocab] of one token sequence")
    p.add_argument("--checkpoint", required=True,
                   help="checkpoint directory: the release safetensors layout or a `kimik3 convert` output")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--tokens", help="token ids, e.g. 1,2,3")
    src.add_argument("--tokens-file", help="token ids: text (commas/spaces), a JSON list, or a .npy array")
    p.add_argument("--out", required=True, help="output .npy file")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float64"],
                   help="bfloat16: the production precision policy; float32/float64: every op in that dtype")
    add_sharding_arguments(p)
    p.set_defaults(func=cmd_logits)

    p = sub.add_parser("plan", help="bytes per device of parameters and decode state under a mesh; what fits")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--config", help="a config.json (release or generated)")
    src.add_argument("--preset", default="k3", help="k3 | tiny | slice (default k3)")
    p.add_argument("--mesh", default=None, metavar="data=D,expert=E,tensor=T", help="default: one device")
    p.add_argument("--batch", type=int, default=1, help="sequences decoded together (default 1)")
    p.add_argument("--context", type=int, default=131072, help="tokens per sequence (default 131072)")
    p.add_argument("--device-memory", default="141GB", help="memory of one device (default 141GB, an H200)")
    p.add_argument("--headroom", type=float, default=0.1,
                   help="fraction of each device kept for activations and workspace (default 0.1)")
    p.set_defaults(func=cmd_plan)

    from kimik3_jax.generate.cli import add_generate_parser  # stdlib-only at import: the parser stays fast
    add_generate_parser(sub)

    from convert.cli import add_convert_arguments, add_export_arguments  # argparse only

    p = sub.add_parser("convert", help="release safetensors -> Orbax: validated, streaming, resumable (docs/convert.md)")
    add_convert_arguments(p)
    p.set_defaults(func=cmd_convert)

    p = sub.add_parser("export", help="a converted (Orbax) directory -> the release safetensors layout")
    add_export_arguments(p)
    p.set_defaults(func=cmd_export)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if hasattr(args, "mesh"):  # the sharded commands: start jax.distributed first when asked
            from kimik3_jax.sharding.distributed import initialize

            initialize(args)
        return args.func(args)
    except K3Error as e:
        print(f"kimik3 {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
