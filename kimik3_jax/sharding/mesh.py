"""Device meshes with the named axes (data, expert, tensor): from `--mesh data=D,expert=E,tensor=T`
or from a preset, over all devices of all processes."""

from __future__ import annotations

import math

import jax
import numpy as np
from jax.sharding import Mesh

from kimik3_jax.sharding.rules import MESH_AXES, ShardingError

# preset -> {axis: size} for n devices (an axis left out has size 1)
PRESETS = {
    "single": lambda n: {},
    "tp": lambda n: {"tensor": n},
    "ep": lambda n: {"expert": n},
    "ep_tp": lambda n: {"expert": n // 2, "tensor": 2},
    "dp_ep": lambda n: {"data": 2, "expert": n // 2},
}


def parse_mesh(text: str) -> dict[str, int]:
    """'data=2,expert=4' -> {'data': 2, 'expert': 4}; a clear error naming the bad part."""
    sizes: dict[str, int] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, eq, value = part.partition("=")
        name = name.strip()
        if not eq or name not in MESH_AXES:
            raise ShardingError(f"--mesh {text!r}: {part!r} is not AXIS=SIZE with AXIS one of {', '.join(MESH_AXES)}")
        if name in sizes:
            raise ShardingError(f"--mesh {text!r}: axis {name!r} is given twice")
        try:
            size = int(value)
        except ValueError:
            size = 0
        if size < 1:
            raise ShardingError(f"--mesh {text!r}: the size of {name!r} must be a positive integer, got {value!r}")
        sizes[name] = size
    if not sizes:
        raise ShardingError(f"--mesh {text!r}: give at least one AXIS=SIZE (axes: {', '.join(MESH_AXES)})")
    return sizes


def preset_sizes(name: str, num_devices: int) -> dict[str, int]:
    if name not in PRESETS:
        raise ShardingError(f"unknown mesh preset {name!r} (presets: {', '.join(PRESETS)})")
    sizes = PRESETS[name](num_devices)
    if name == "single":
        return sizes
    if min(sizes.values()) < 1 or math.prod(sizes.values()) != num_devices:
        raise ShardingError(f"mesh preset {name!r} does not fit {num_devices} devices")
    return sizes


def make_mesh(sizes: dict[str, int], devices=None) -> Mesh:
    """A Mesh with axes (data, expert, tensor) of the given sizes (missing axes: 1) over `devices`
    (default: every device of every process; the preset 'single' uses the first). The product of the
    sizes must equal the number of devices."""
    devices = list(jax.devices() if devices is None else devices)
    shape = tuple(sizes.get(a, 1) for a in MESH_AXES)
    n = math.prod(shape)
    if n == 1:
        devices = devices[:1]
    if n != len(devices):
        given = ",".join(f"{a}={s}" for a, s in zip(MESH_AXES, shape))
        raise ShardingError(f"mesh {given} has {n} devices, but {len(devices)} are available "
                            f"(the product of the axis sizes must equal the device count)")
    try:  # topology-aware order on real hardware (keeps tensor-parallel groups on fast links)
        from jax.experimental import mesh_utils
        grid = mesh_utils.create_device_mesh(shape, devices=devices)
    except Exception:  # noqa: BLE001 - CPU devices or an unusual topology: plain order is correct
        grid = np.array(devices).reshape(shape)
    return Mesh(grid, MESH_AXES)
