"""Command-line sharding: `--mesh` and the multi-host flags shared by `logits`, `generate`, `convert`.

Multi-host: `--coordinator HOST:PORT --num-processes N --process-id I` (or the environment variables
JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID, or a SLURM / Open MPI job that JAX detects
by itself) start `jax.distributed` before anything touches a device. The mesh then spans the devices of
every process; each process reads only the shards of its own devices (`load_checkpoint` builds arrays
with `jax.make_array_from_callback`), and only process 0 writes outputs (`is_writer`). See
docs/multihost.md.
"""

from __future__ import annotations

import argparse
import os

from kimik3_jax.errors import K3Error

_CLUSTER_ENV = ("SLURM_JOB_ID", "OMPI_COMM_WORLD_SIZE")


def add_sharding_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sharding and multi-host (docs/multihost.md)")
    g.add_argument("--mesh", default=None, metavar="data=D,expert=E,tensor=T",
                   help="run sharded over a device mesh (any subset of the axes; the product must equal the "
                        "device count of all processes); default: one device")
    g.add_argument("--coordinator", default=None, metavar="HOST:PORT",
                   help="multi-host: address of process 0 (or $JAX_COORDINATOR_ADDRESS)")
    g.add_argument("--num-processes", type=int, default=None,
                   help="multi-host: number of processes ($JAX_NUM_PROCESSES)")
    g.add_argument("--process-id", type=int, default=None, help="multi-host: this process, 0-based ($JAX_PROCESS_ID)")


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        raise K3Error(f"${name} = {value!r} is not an integer") from None


def initialize(args: argparse.Namespace) -> None:
    """Start `jax.distributed` when the flags, the environment or a detected cluster ask for it."""
    import jax

    coordinator = getattr(args, "coordinator", None) or os.environ.get("JAX_COORDINATOR_ADDRESS")
    num = getattr(args, "num_processes", None)
    num = num if num is not None else _env_int("JAX_NUM_PROCESSES")
    pid = getattr(args, "process_id", None)
    pid = pid if pid is not None else _env_int("JAX_PROCESS_ID")
    if coordinator is None and num is None and pid is None:
        if any(v in os.environ for v in _CLUSTER_ENV) and os.environ.get("KIMIK3_NO_CLUSTER_DETECT") is None:
            _cpu_collectives()
            jax.distributed.initialize()  # SLURM / Open MPI: JAX reads the job's own variables
        return
    missing = [flag for flag, v in (("--coordinator", coordinator), ("--num-processes", num),
                                    ("--process-id", pid)) if v is None]
    if missing:
        raise K3Error(f"multi-host needs --coordinator, --num-processes and --process-id together; missing "
                      f"{', '.join(missing)}")
    if num < 1 or not 0 <= pid < num:
        raise K3Error(f"--process-id {pid} must be in [0, --num-processes {num})")
    _cpu_collectives()
    jax.distributed.initialize(coordinator_address=coordinator, num_processes=num, process_id=pid)


def _cpu_collectives() -> None:
    """CPU devices of several processes talk through gloo (GPUs use NCCL whatever this says)."""
    import jax

    try:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    except (AttributeError, ValueError):  # an option this JAX does not have: its default applies
        pass


def plan_from_args(args: argparse.Namespace):
    """The ShardingPlan `--mesh` asks for (after `initialize`), or None for one device."""
    if getattr(args, "mesh", None) is None:
        return None
    from kimik3_jax.sharding import ShardingPlan, parse_mesh

    return ShardingPlan.create(parse_mesh(args.mesh))


def is_writer() -> bool:
    """Only process 0 writes outputs."""
    import jax

    return jax.process_index() == 0
