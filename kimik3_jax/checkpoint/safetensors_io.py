"""Streaming safetensors shard writer and cheap, validating header reader.

File layout (huggingface/safetensors, ``safetensors/src/tensor.rs``): an 8-byte little-endian
u64 ``n``, then ``n`` bytes of UTF-8 JSON, then the raw little-endian tensor bytes.
``ShardWriter`` reproduces what the library's ``prepare``/``serialize_to_file`` write, so the
file is byte-identical to ``safetensors.numpy.save_file`` of the same dict:

* data order: tensors sorted by *descending* ``Dtype`` enum position (the enum is declared in
  increasing alignment order: BOOL < ... < U8 < I8 < F8_* < I16 < U16 < F16 < BF16 < I32 < U32
  < F32 < C64 < F64 < I64 < U64), ties broken by name in byte (= code point) order;
* header JSON: compact serde_json; ``"__metadata__"`` first when metadata is given (even if
  empty), then one ``{"dtype","shape","data_offsets"}`` entry per tensor in data order;
  ``data_offsets`` are relative to the start of the data section;
* the JSON is padded with spaces to a multiple of 8 bytes and ``n`` counts the padding.

The library serializes ``__metadata__`` from a Rust ``HashMap``, so with two or more metadata
keys its key order is random per call; we write them sorted (identical whenever <= 1 key).
"""
from __future__ import annotations

import json
import math
import os
from typing import NamedTuple

import ml_dtypes
import numpy as np
from safetensors import SafetensorError, safe_open

from kimik3_jax.errors import CheckpointError

MAX_HEADER_SIZE = 100_000_000  # the library refuses larger headers (read and write)

# Rust `Dtype` enum declaration order; the writer sorts by descending position.
_DTYPE_ENUM_ORDER = (
    "BOOL", "F4", "F6_E2M3", "F6_E3M2", "U8", "I8", "F8_E5M2", "F8_E4M3", "F8_E8M0",
    "F8_E4M3FNUZ", "F8_E5M2FNUZ", "I16", "U16", "F16", "BF16", "I32", "U32", "F32", "C64",
    "F64", "I64", "U64",
)
_DTYPE_RANK = {code: i for i, code in enumerate(_DTYPE_ENUM_ORDER)}

# safetensors dtype code -> numpy dtype (F4/F6 are packed sub-byte formats and are left out).
SAFETENSORS_DTYPES: dict[str, np.dtype] = {code: np.dtype(t) for code, t in (
    ("BOOL", np.bool_), ("U8", np.uint8), ("I8", np.int8), ("F8_E5M2", ml_dtypes.float8_e5m2),
    ("F8_E4M3", ml_dtypes.float8_e4m3fn), ("F8_E8M0", ml_dtypes.float8_e8m0fnu),
    ("F8_E4M3FNUZ", ml_dtypes.float8_e4m3fnuz), ("F8_E5M2FNUZ", ml_dtypes.float8_e5m2fnuz),
    ("I16", np.int16), ("U16", np.uint16), ("F16", np.float16), ("BF16", ml_dtypes.bfloat16),
    ("I32", np.int32), ("U32", np.uint32), ("F32", np.float32), ("C64", np.complex64),
    ("F64", np.float64), ("I64", np.int64), ("U64", np.uint64))}
# numpy dtype -> safetensors dtype code (the inverse of SAFETENSORS_DTYPES).
NUMPY_TO_SAFETENSORS: dict[np.dtype, str] = {dt: code for code, dt in SAFETENSORS_DTYPES.items()}


class TensorInfo(NamedTuple):
    """One tensor of a shard; ``begin``/``end`` are absolute byte offsets in the file."""
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int


def safetensors_dtype(dtype, where: str = "") -> str:
    """The safetensors code ("BF16", "U8", ...) of a numpy/ml_dtypes dtype (any byte order) or code."""
    if isinstance(dtype, str) and dtype in SAFETENSORS_DTYPES:
        return dtype  # already a code; checked first since np.dtype("U8") is a unicode dtype
    try:
        return NUMPY_TO_SAFETENSORS[np.dtype(dtype).newbyteorder("=")]
    except (TypeError, KeyError):
        raise CheckpointError(f"{where}unsupported safetensors dtype {dtype!r}") from None


class ShardWriter:
    """Write one safetensors shard streaming, one tensor at a time, in ``self.order``.

    The header is fixed up front from ``tensors`` = [(name, dtype, shape), ...]. Data goes to
    ``path + ".partial"``, renamed to ``path`` only when the ``with`` block exits cleanly after
    every tensor was written; otherwise the partial file is removed and ``path`` is untouched.
    """

    def __init__(self, path, tensors, metadata: dict[str, str] | None = None, fsync: bool = True):
        self.path = os.fspath(path)
        self.tmp_path = self.path + ".partial"
        self._fsync = fsync
        where = f"shard {self.path}: "
        decl: dict[str, tuple[str, tuple[int, ...]]] = {}
        for name, dtype, shape in tensors:
            if not isinstance(name, str) or name == "__metadata__" or name in decl:
                raise CheckpointError(f"{where}invalid or duplicate tensor name {name!r}")
            shape = tuple(shape)
            if not all(isinstance(d, (int, np.integer)) and d >= 0 for d in shape):
                raise CheckpointError(f"{where}tensor {name!r} has invalid shape {shape!r}")
            decl[name] = (safetensors_dtype(dtype, f"{where}tensor {name!r}: "),
                          tuple(int(d) for d in shape))
        if metadata is not None and not all(
                isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
            raise CheckpointError(f"{where}metadata must map str to str, got {metadata!r}")
        self.order: list[str] = sorted(decl, key=lambda n: (-_DTYPE_RANK[decl[n][0]], n))
        header: dict = {} if metadata is None else {"__metadata__": dict(sorted(metadata.items()))}
        offset = 0
        for name in self.order:
            code, shape = decl[name]
            nbytes = math.prod(shape) * SAFETENSORS_DTYPES[code].itemsize
            header[name] = {"dtype": code, "shape": list(shape),
                            "data_offsets": [offset, offset + nbytes]}
            offset += nbytes
        raw = json.dumps(header, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
        raw += b" " * (-len(raw) % 8)
        if len(raw) > MAX_HEADER_SIZE:
            raise CheckpointError(f"{where}header of {len(raw)} bytes exceeds {MAX_HEADER_SIZE}")
        self._header = len(raw).to_bytes(8, "little") + raw
        start = len(self._header)
        self.infos: dict[str, TensorInfo] = {  # absolute file offsets, in data order
            n: TensorInfo(*decl[n], *(start + o for o in header[n]["data_offsets"]))
            for n in self.order}
        self.data_size = offset  # bytes of tensor data (an index's "total_size" contribution)
        self.file_size = start + offset
        self._next = 0
        self._file = None
        self._failed = False

    @property
    def header(self) -> bytes:
        """The file's leading bytes (length, JSON, padding), for a writer that places tensors at
        `infos[name].begin` in another order (convert's export)."""
        return self._header

    def __enter__(self) -> "ShardWriter":
        self._file = open(self.tmp_path, "wb")
        self._file.write(self._header)
        return self

    def _fail(self, msg: str):
        self._failed = True
        raise CheckpointError(f"shard {self.path}: {msg}")

    def write(self, name: str, array) -> None:
        """Append tensor ``name``; it must be ``self.order[k]`` for the k-th call."""
        if self._file is None:
            self._fail(f"write({name!r}) outside the ShardWriter context")
        if self._next >= len(self.order):
            self._fail(f"tensor {name!r} written after all {len(self.order)} declared tensors")
        expected = self.order[self._next]
        if name != expected:
            what = "is not declared" if name not in self.infos else "is written out of order"
            self._fail(f"tensor {name!r} {what}; expected {expected!r} next (writer.order)")
        info = self.infos[name]
        arr = np.asarray(array)
        if arr.dtype.newbyteorder("=") != SAFETENSORS_DTYPES[info.dtype]:
            self._fail(f"tensor {name!r} has dtype {arr.dtype}, declared {info.dtype} "
                       f"({SAFETENSORS_DTYPES[info.dtype]})")
        if arr.shape != info.shape:
            self._fail(f"tensor {name!r} has shape {arr.shape}, declared {info.shape}")
        le = np.ascontiguousarray(arr, dtype=SAFETENSORS_DTYPES[info.dtype].newbyteorder("<"))
        try:
            self._file.write(memoryview(le.reshape(-1).view(np.uint8)))
        except BaseException:
            self._failed = True  # e.g. disk full: the shard is unusable even if caught
            raise
        self._next += 1

    def __exit__(self, exc_type, exc, tb) -> None:
        f, self._file = self._file, None
        missing = self.order[self._next:]
        problem = ("an earlier write() failed" if self._failed else f"{len(missing)} declared "
                   f"tensor(s) never written, first {missing[0]!r}" if missing else None)
        ok = False
        try:
            if exc_type is None and problem is None:
                f.flush()
                if f.tell() != self.file_size:
                    problem = f"wrote {f.tell()} bytes, expected {self.file_size}"
                else:
                    if self._fsync:
                        os.fsync(f.fileno())
                    ok = True
        finally:
            f.close()
            if ok:
                os.replace(self.tmp_path, self.path)
            elif os.path.exists(self.tmp_path):
                os.unlink(self.tmp_path)
        if exc_type is None and problem:
            raise CheckpointError(f"shard {self.path}: not written, {problem}")


def read_header(path) -> tuple[dict[str, TensorInfo], dict[str, str] | None]:
    """``({name: TensorInfo}, metadata)`` of a shard, reading only its header (no tensor data).

    The file is validated by the safetensors library (``safe_open``: header length, JSON,
    contiguous offsets, sizes matching dtype x shape, data section covering exactly the rest of
    the file) and again here (declared data end == file size). Problems raise CheckpointError.
    """
    path = os.fspath(path)
    try:
        with safe_open(path, framework="numpy") as f:
            metadata = f.metadata()
            slices = {k: f.get_slice(k) for k in f.keys()}
            lib = {k: (s.get_dtype(), tuple(s.get_shape())) for k, s in slices.items()}
        with open(path, "rb") as fh:
            n = int.from_bytes(fh.read(8), "little")
            header = json.loads(fh.read(n).decode("utf-8"))
            size = os.fstat(fh.fileno()).st_size
    except FileNotFoundError:
        raise CheckpointError(f"safetensors shard {path} does not exist") from None
    except (SafetensorError, OSError, ValueError) as e:
        raise CheckpointError(f"{path} is not a valid safetensors file "
                              f"(truncated or corrupt?): {e}") from None
    header.pop("__metadata__", None)
    infos, end = {}, 0
    try:
        for name, ent in header.items():
            b, e = ent["data_offsets"]
            infos[name] = TensorInfo(ent["dtype"], tuple(ent["shape"]), 8 + n + b, 8 + n + e)
            end = max(end, e)
    except (TypeError, KeyError, ValueError) as e:
        raise CheckpointError(f"{path}: malformed safetensors header: {e!r}") from None
    if 8 + n + end != size:
        raise CheckpointError(f"{path}: header declares {8 + n + end} bytes but the file has "
                              f"{size} (truncated or modified while reading?)")
    if lib != {k: (i.dtype, i.shape) for k, i in infos.items()}:
        raise CheckpointError(f"{path}: header parsed here disagrees with the safetensors library")
    return infos, metadata
