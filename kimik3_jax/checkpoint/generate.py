"""`make-checkpoint`: a random checkpoint in exactly the release layout, written streaming.

Each tensor is drawn from its own random stream (see `params.random`) and written straight to its
shard, so memory stays at about one tensor whatever the model size. The directory is assembled
under a temporary name beside `out` and renamed into place at the end: nothing at `out` ever looks
like a complete checkpoint unless it is one.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

from tqdm import tqdm

from kimik3_jax.checkpoint.layout import CONFIG_FILE, inventory, plan_shards, shard_name, write_index
from kimik3_jax.checkpoint.safetensors_io import ShardWriter
from kimik3_jax.config import ModelConfig
from kimik3_jax.errors import CheckpointError
from kimik3_jax.params.random import draw_tensor
from kimik3_jax.tokenizer import write_small_tokenizer


def make_checkpoint(config: dict[str, Any], out: str | Path, *, seed: int = 0, num_shards: int | None = None,
                    text_only: bool = False, overwrite: bool = False, progress: bool = True) -> Path:
    """Write a random release-layout checkpoint of `config` (a release-style config dict) to `out`."""
    out = Path(out)
    config = dict(config)
    if text_only:
        config.pop("vision_config", None)
    cfg = ModelConfig.from_dict(config, origin=str(out / CONFIG_FILE))
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not overwrite:
        raise CheckpointError(f"{out}: already exists and is not empty (pass --overwrite to replace it)")
    tensors = inventory(cfg)
    shards = plan_shards(tensors, num_shards)
    total = sum(t.nbytes for t in tensors)
    _check_free_space(out, total)

    _remove_abandoned(out)
    tmp = out.with_name(f".{out.name}.partial-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:  # the cheap files first, so that a problem with them shows before hours of tensor writing
        (tmp / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
        write_small_tokenizer(tmp, cfg.vocab_size)
        weight_map: dict[str, str] = {}
        with tqdm(total=total, unit="B", unit_scale=True, desc=f"writing {out.name}", disable=not progress) as bar:
            for i, shard in enumerate(shards, start=1):
                fname = shard_name(i, len(shards))
                by_name = {t.name: t for t in shard}
                with ShardWriter(tmp / fname, [(t.name, t.leaf.dtype, t.shape) for t in shard]) as writer:
                    for name in writer.order:
                        t = by_name[name]
                        writer.write(name, draw_tensor(t.leaf, seed, t.layer, t.expert))
                        weight_map[name] = fname
                        bar.update(t.nbytes)
        write_index(tmp, weight_map, total)
        if out.exists():
            shutil.rmtree(out) if out.is_dir() else out.unlink()
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _check_free_space(out: Path, needed: int) -> None:
    probe = out
    while not probe.exists():
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    if needed > free:
        raise CheckpointError(f"{out}: the checkpoint needs {needed / 1e9:.2f} GB of tensors, "
                              f"but only {free / 1e9:.2f} GB is free there")


def _remove_abandoned(out: Path) -> None:
    """Delete temporary directories that a killed earlier run left beside `out` (their process is gone)."""
    if not out.parent.is_dir():
        return
    for tmp in out.parent.glob(f".{out.name}.partial-*"):
        pid = tmp.name.rsplit("-", 1)[-1]
        if pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(tmp, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
