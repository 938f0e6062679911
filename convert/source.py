"""The source side of conversion: validating a release directory and reading its tensors.

`validate` runs before any heavy I/O: the header-level problems of `Checkpoint.problems` (every
tensor the config implies present, in the shard the index names, with the right dtype and shape; no
shard missing or truncated; no orphan `weight_packed`; no unknown tensor unless allowed) and, unless
asked for headers only, the A_log padding (a few hundred bytes per KDA layer). Scale bytes (1/16 of
the expert bytes) are checked as they stream through `SourceReader`.

`SourceReader` reads each tensor's byte range with a positional read straight into the array of the
piece being built (no intermediate copy, no mapping that would grow the resident set), asks the
kernel to read ahead (`POSIX_FADV_WILLNEED`), and hashes each tensor (sha256) in a helper thread
while the next one is read. Copying out of a memory map was measured at half the speed of `preadv`
on this machine (page faults), so the shards are not mapped.
"""

from __future__ import annotations

import hashlib
import json
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import ml_dtypes  # noqa: F401  (registers bfloat16 with numpy)
import numpy as np

from convert.plan import VISION_PREFIXES, Piece
from kimik3_jax import mxfp4
from kimik3_jax.checkpoint.layout import CONFIG_FILE, INDEX_FILE, inventory
from kimik3_jax.checkpoint.load import Checkpoint, a_log_padding_problem
from kimik3_jax.checkpoint.safetensors_io import NUMPY_TO_SAFETENSORS
from kimik3_jax.config import ModelConfig
from kimik3_jax.errors import CheckpointError

LOOKAHEAD = 256 << 20  # bytes of the following tensors the kernel is asked to read ahead


def extra_tensors(ckpt: Checkpoint, cfg: ModelConfig, text_only: bool) -> list[str]:
    """Indexed tensors the config does not imply (vision ones are not extra under --text-only)."""
    expected = {t.name for t in inventory(cfg, text_only)}
    return sorted(n for n in ckpt.weight_map if n not in expected
                  and not (text_only and n.startswith(VISION_PREFIXES)))


def validate(ckpt: Checkpoint, cfg: ModelConfig, *, text_only: bool, allow_extra: bool,
             headers_only: bool = False) -> tuple[list[str], list[str]]:
    """(problems, extra tensors skipped). An empty problem list means the source can be converted."""
    problems = ckpt.problems(cfg, text_only)
    extras = extra_tensors(ckpt, cfg, text_only)
    if allow_extra:
        # orphan weight_packed stays an error: it is a broken expert, not an unknown tensor
        unknown = [n for n in extras if not n.endswith(".weight_packed")
                   or n.removesuffix("weight_packed") + "weight_scale" in ckpt.weight_map]
        problems = [p for p in problems if not any(f": unexpected tensor {n} (" in p for n in unknown)]
        if not problems and unknown:  # problems() skips the total_size check when it found any problem
            actual = sum(i.end - i.begin for h in ckpt.headers.values() for i in h.values())
            if ckpt.total_size != actual:
                problems.append(f"{ckpt.dir / INDEX_FILE}: metadata.total_size = {ckpt.total_size}, "
                                f"but the shards hold {actual} tensor bytes")
        extras = [n for n in extras if n in unknown]
    else:
        extras = []
    mismatched = _mismatched(ckpt, cfg, text_only)
    if len(mismatched) > 1:  # many at once usually means config.json and the shards disagree: say so first
        problems.insert(0, f"{ckpt.dir / CONFIG_FILE}: {len(mismatched)} tensors have another shape or dtype than "
                           f"it implies (first {mismatched[0]}): the config or the shards are not this model's")
    vision = [t.name for t in inventory(cfg, text_only) if t.name.startswith(VISION_PREFIXES)]
    if vision and not any(n in ckpt.weight_map for n in vision):
        problems.append(f"{ckpt.dir}: config.json has a vision_config but the index lists no vision tensor: "
                        "pass --text-only to convert the text model only")
    if not problems and not headers_only:
        problems += _check_a_log(ckpt, cfg)
    return problems, extras


def _mismatched(ckpt: Checkpoint, cfg: ModelConfig, text_only: bool) -> list[str]:
    out = []
    for t in inventory(cfg, text_only):
        info = ckpt.headers.get(ckpt.weight_map.get(t.name, ""), {}).get(t.name)
        if info is not None and (info.dtype != NUMPY_TO_SAFETENSORS[t.leaf.dtype] or tuple(info.shape) != t.shape):
            out.append(t.name)
    return out


def _check_a_log(ckpt: Checkpoint, cfg: ModelConfig) -> list[str]:
    """Every A_log entry past num_heads must be +0.0 (all bits zero: -0.0 could not be restored exactly)."""
    found = []
    for t in inventory(cfg, True):
        if t.leaf.init.kind == "alog":
            problem = a_log_padding_problem(t.leaf, t.name, ckpt.read(t.name))
            if problem:
                found.append(f"{ckpt.dir / ckpt.weight_map[t.name]}: {problem}")
    return found


def fingerprint(ckpt: Checkpoint) -> dict:
    """What identifies the source bytes cheaply: config and index digests, each shard's size and mtime."""
    shards = []
    for f in ckpt.files:
        st = (ckpt.dir / f).stat()
        shards.append({"file": f, "bytes": st.st_size, "mtime_ns": st.st_mtime_ns})
    return {"config_sha256": _file_sha256(ckpt.dir / CONFIG_FILE),
            "index_sha256": _file_sha256(ckpt.dir / INDEX_FILE), "shards": shards}


def revision_facts(ckpt: Checkpoint) -> dict:
    """Where the source came from, as far as the directory tells: the Hugging Face snapshot commit
    (hub cache `snapshots/<commit>`, or a `local_dir` download's `.cache/huggingface` metadata) and
    the config's own provenance fields."""
    path = ckpt.dir.resolve()
    facts: dict = {"path": str(path)}
    if path.parent.name == "snapshots" and path.parent.parent.name.startswith("models--"):
        facts["hf_repo"] = path.parent.parent.name.removeprefix("models--").replace("--", "/")
        facts["hf_commit"] = path.name
    meta = ckpt.dir / ".cache" / "huggingface" / "download" / f"{CONFIG_FILE}.metadata"
    if meta.is_file():
        lines = meta.read_text().splitlines()
        if lines:
            facts.setdefault("hf_commit", lines[0].strip())
    try:
        config = json.loads((ckpt.dir / CONFIG_FILE).read_text())
        for k in ("_name_or_path", "transformers_version", "model_type"):
            if k in config:
                facts[k] = config[k]
    except (OSError, json.JSONDecodeError):
        pass
    return facts


def _file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


class SourceReader:
    """Reads pieces of a validated `Checkpoint`, tensor by tensor, straight into the piece's array."""

    def __init__(self, ckpt: Checkpoint):
        self.ckpt = ckpt
        self._fds: dict[str, int] = {}
        self._hasher = ThreadPoolExecutor(1, thread_name_prefix="sha256")

    def _span(self, name: str) -> tuple[int, int, int]:
        """(file descriptor, first byte, end byte) of a tensor's data in its shard."""
        f = self.ckpt.weight_map[name]
        if f not in self._fds:
            self._fds[f] = os.open(self.ckpt.dir / f, os.O_RDONLY)
        info = self.ckpt.headers[f][name]
        return self._fds[f], info.begin, info.end

    def _read_into(self, name: str, dest: np.ndarray) -> None:
        """The tensor's bytes into `dest` (contiguous, exactly that many bytes): the kernel copies
        from the page cache into our array, nothing in between."""
        fd, begin, end = self._span(name)
        view = memoryview(dest.reshape(-1).view(np.uint8))
        done = 0
        while done < end - begin:  # one call reads at most ~2 GiB on Linux
            n = os.preadv(fd, [view[done:done + (1 << 30)]], begin + done)
            if n <= 0:
                raise CheckpointError(f"{self.ckpt.dir / self.ckpt.weight_map[name]}: tensor {name} ends early "
                                      f"(read {done} of {end - begin} bytes; truncated while converting?)")
            done += n

    def _bytes(self, name: str) -> np.ndarray:
        _, begin, end = self._span(name)
        out = np.empty(end - begin, np.uint8)
        self._read_into(name, out)
        return out

    def _will_need(self, tensors) -> None:
        for t in tensors:
            fd, begin, end = self._span(t.name)
            os.posix_fadvise(fd, begin, end - begin, os.POSIX_FADV_WILLNEED)

    def read_piece(self, piece: Piece, digests: dict[str, str], out: np.ndarray | None = None) -> np.ndarray:
        """The stored array of `piece` (into `out` when given); adds the sha256 of every source tensor
        read to `digests`. Raises CheckpointError (MXFP4Error) naming the tensor on a scale byte 255."""
        out = np.empty(piece.shape, piece.dtype) if out is None else out
        rows = out.reshape((len(piece.tensors), -1))
        groups = [(t,) + ((piece.scales[i],) if piece.scales else ()) for i, t in enumerate(piece.tensors)]
        ahead = max(1, LOOKAHEAD // max(1, sum(t.nbytes for t in groups[0])))
        for group in groups[:ahead]:  # the kernel reads ahead of us (the experts are read out of file order)
            self._will_need(group)
        futures = []
        try:
            for i, group in enumerate(groups):
                if i + ahead < len(groups):
                    self._will_need(groups[i + ahead])
                t = group[0]
                if piece.how == "copy":
                    self._read_into(t.name, rows[i])
                    if t.leaf.mx == "scale":
                        mxfp4.check_scales(t.name, rows[i].reshape(t.shape))
                    futures.append((t.name, self._hasher.submit(_sha256, rows[i])))  # while we read the next
                    continue
                raw = [self._bytes(s.name) for s in group]  # small (alog) or research-only (dequant)
                for s, data in zip(group, raw):
                    digests[s.name] = _sha256(data)
                if piece.how == "alog":
                    rows[i] = raw[0].view(piece.dtype)[:piece.shape[-1]]
                else:
                    scale = raw[1].reshape(group[1].shape)
                    mxfp4.check_scales(group[1].name, scale)
                    rows[i] = mxfp4.dequantize_np(raw[0].reshape(t.shape), scale, piece.dtype, name=t.name).reshape(-1)
            for name, fut in futures:
                digests[name] = fut.result()
        finally:
            for _, fut in futures:
                fut.cancel()
        return out

    def close(self) -> None:
        self._hasher.shutdown(wait=True)
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


def _sha256(data: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(data).reshape(-1).view(np.uint8)).hexdigest()
