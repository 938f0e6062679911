"""Fixtures shared across test files: the tiny preset and its seed-0 checkpoint, generated once per session."""
import shutil

import pytest

from checkpoint_helpers import SEED
from kimik3_jax.checkpoint.generate import make_checkpoint
from kimik3_jax.params import init_params
from kimik3_jax.presets import preset, preset_dict


@pytest.fixture(scope="session")
def cfg():
    return preset("tiny")


@pytest.fixture(scope="session")
def cfg_dict():
    return preset_dict("tiny")


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory, cfg_dict):
    """The seed-0 tiny checkpoint, default shard count. Read-only: copy it before tampering."""
    out = tmp_path_factory.mktemp("base") / "tiny"
    make_checkpoint(cfg_dict, out, seed=SEED, progress=False)
    return out


@pytest.fixture(scope="session")
def host_params(cfg):
    """init_params per seed, computed once each."""
    cache = {}

    def get(seed):
        if seed not in cache:
            cache[seed] = init_params(cfg, seed)
        return cache[seed]
    return get


@pytest.fixture
def ckpt_copy(tiny_ckpt, tmp_path):
    d = tmp_path / "ckpt"
    shutil.copytree(tiny_ckpt, d)
    return d
