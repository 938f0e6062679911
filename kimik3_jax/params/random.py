"""Random parameter values: a counter-based hash generator written once for NumPy and jax.numpy.

Every release tensor draws from its own stream, keyed by (seed, leaf name, layer id, expert id), so a
tensor has the same value whether it is drawn alone (checkpoint generation, on the host), inside a
stacked host init, or inside a jitted, sharded init in device memory (vmapped over layers/experts).
Integer-valued kinds (packed nibbles, scale bytes) are bit-identical across NumPy and XLA; float
kinds can differ by one ulp of their dtype (XLA may fold the two constant multiplies into one, and
backends round `log` differently). The host values are the reference: checkpoints use them.

Why not `jax.random`: threefry programs cost ~0.3 s of XLA compilation per distinct tensor shape on
the CPU, which made a few-MB checkpoint take half a minute; this generator is a handful of integer
ops (and vectorised NumPy on the host). Normals are Irwin-Hall sums of four uniforms (bounded at
+-3.46 sigma, which is all test weights need).
"""

from __future__ import annotations

import math
import zlib
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from kimik3_jax.params.leaf import Init, Leaf

_NONE = 0xFFFFFFFF  # the layer/expert word of a tensor that is not stacked over layers/experts
_LANE = 0x9E3779B9


def leaf_id(leaf: Leaf) -> int:
    """A stable 32-bit id of a leaf, from its release name template."""
    return zlib.crc32(leaf.name.encode())


def _u32(xp, x):
    return xp.asarray(x, dtype=xp.uint32)


def _mix(xp, x):
    """lowbias32 (Wellons): a bijective 32-bit integer hash with good avalanche."""
    x = x ^ (x >> _u32(xp, 16))
    x = x * _u32(xp, 0x7FEB352D)
    x = x ^ (x >> _u32(xp, 15))
    x = x * _u32(xp, 0x846CA68B)
    return x ^ (x >> _u32(xp, 16))


def stream_key(xp, seed: int, leaf: Leaf, layer, expert):
    """The 32-bit key of one tensor's stream; `layer`/`expert` may be traced (vmapped) ints."""
    k = _mix(xp, _u32(xp, seed & 0xFFFFFFFF) ^ _u32(xp, 0x5EED5EED))
    for word in (leaf_id(leaf), _NONE if layer is None else layer, _NONE if expert is None else expert):
        k = _mix(xp, k ^ (_u32(xp, word) if isinstance(word, int) else word.astype(xp.uint32)))
    return k


def _bits(xp, key, start: int, n: int, lane: int):
    """Words start..start+n-1 (uint32) of stream `key`, lane `lane` (independent lanes per element)."""
    counter = xp.arange(start, start + n, dtype=xp.uint32)
    return _mix(xp, _mix(xp, counter ^ key) ^ (key + _u32(xp, (lane * _LANE) & 0xFFFFFFFF)))


def _normal(xp, key, start: int, n: int):
    """Approximately standard normal float32: (sum of 4 uniforms - 2) * sqrt(3)."""
    total = sum((_bits(xp, key, start, n, lane) >> _u32(xp, 8)).astype(xp.int32) for lane in range(4))
    return (total - (1 << 25)).astype(xp.float32) * xp.float32(math.sqrt(3.0) / (1 << 24))


def _draw_flat(xp, init: Init, key, shape: tuple[int, ...], dtype: Any, start: int, n: int):
    """Elements start..start+n-1 of the flattened tensor (`start` a multiple of 4)."""
    kind = init.kind
    if kind == "bits":  # four uniform bytes per hashed word
        words = _bits(xp, key, start // 4, -(-n // 4), 0)
        out = xp.stack([(words >> _u32(xp, 8 * j)) & _u32(xp, 0xFF) for j in range(4)], axis=-1)
        return out.astype(xp.uint8).reshape(-1)[:n]
    if kind == "scale_bytes":
        span = init.hi - init.lo + 1
        out = ((_bits(xp, key, start, n, 0) >> _u32(xp, 8)) * _u32(xp, span) >> _u32(xp, 24)) + _u32(xp, init.lo)
        return out.astype(xp.uint8)
    if kind == "alog":  # log of a decay rate in [1, 16) per head, zero padding after the real heads
        u = (_bits(xp, key, start, n, 0) >> _u32(xp, 8)).astype(xp.float32) * xp.float32(2.0 ** -24)
        real = xp.log(xp.float32(1.0) + xp.float32(15.0) * u)
        return xp.where(xp.arange(start, start + n) % shape[-1] < init.lo, real, xp.float32(0.0)).astype(dtype)
    z = _normal(xp, key, start, n)
    if kind == "fan_in":
        out = z * xp.float32(init.scale / math.sqrt(math.prod(shape[1:]) or 1))
    elif kind == "near_one":
        out = xp.float32(1.0) + z * xp.float32(init.scale)
    elif kind == "normal":
        out = z * xp.float32(init.scale)
    else:
        raise ValueError(f"unknown init kind {kind!r}")
    return out.astype(dtype)


def draw(xp, init: Init, key, shape: tuple[int, ...], dtype: Any):
    """One tensor of `shape` for `init`, from stream `key`, with array module `xp` (np or jnp)."""
    return _draw_flat(xp, init, key, shape, dtype, 0, math.prod(shape)).reshape(shape)


HOST_CHUNK = 1 << 24  # elements drawn at once on the host: bounds the temporaries to a few hundred MB


def draw_tensor(leaf: Leaf, seed: int, layer: int | None, expert: int | None) -> np.ndarray:
    """One release tensor on the host, as `make-checkpoint --seed` writes it."""
    key = stream_key(np, seed, leaf, layer, expert)
    n = math.prod(leaf.shape)
    out = np.empty(n, leaf.dtype)
    for start in range(0, n, HOST_CHUNK):
        count = min(HOST_CHUNK, n - start)
        out[start:start + count] = _draw_flat(np, leaf.init, key, leaf.shape, leaf.dtype, start, count)
    return out.reshape(leaf.shape)


def draw_leaf_host(leaf: Leaf, seed: int) -> np.ndarray:
    """The whole stacked leaf on the host, tensor by tensor."""
    out = np.empty(leaf.full_shape, leaf.dtype)
    for index, _, layer, expert in leaf.tensors():
        out[index] = draw_tensor(leaf, seed, layer, expert)
    return out


def draw_leaf_traced(leaf: Leaf, seed: int) -> jax.Array:
    """The whole stacked leaf in jax.numpy (jit it with out_shardings to fill device memory)."""

    def one(layer, expert):
        return draw(jnp, leaf.init, stream_key(jnp, seed, leaf, layer, expert), leaf.shape, leaf.dtype)

    def per_layer(layer):
        if leaf.experts:
            return jax.vmap(lambda e: one(layer, e))(jnp.arange(leaf.experts, dtype=jnp.uint32))
        return one(layer, None)

    if leaf.layers is None:
        return per_layer(None)
    return jax.vmap(per_layer)(jnp.asarray(leaf.layers, jnp.uint32))
