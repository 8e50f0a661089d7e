"""A global tensor's key in torch.compile's AOTAutograd cache (compat/aot_cache.py): the same in every
process for the same layout and pieces -- Python's ``hash()`` is salted per process, so a key built
from it would never find another process's cached graph -- and different wherever the layout, the
pieces or ``requires_grad`` differ."""
from __future__ import annotations

import os
import subprocess
import sys

import torch

import globaltensor as gt

S, B = gt.sbp.split, gt.sbp.broadcast

KEY_OF = """
import torch, globaltensor as gt
with gt.simulate(2):
    p = gt.placement("cpu", [0, 1])
    x = gt.distribute(torch.zeros(4, 8, dtype=torch.float64), p, gt.sbp.split(0)).requires_grad_()
    print(x._stable_hash_for_caching())
"""


def _key(shape=(4, 8), dtype=torch.float64, sbp=S(0), ranks=(0, 1), requires_grad=True) -> str:
    with gt.simulate(2):
        p = gt.placement("cpu", list(ranks))
        x = gt.distribute(torch.zeros(shape, dtype=dtype), p, sbp)
        return x.requires_grad_(requires_grad)._stable_hash_for_caching()


def test_the_key_is_the_same_in_a_process_with_another_hash_seed():
    seed = "1" if os.environ.get("PYTHONHASHSEED") != "1" else "2"
    env = dict(os.environ, PYTHONHASHSEED=seed)
    out = subprocess.run([sys.executable, "-c", KEY_OF], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[-1] == _key()


def test_the_key_tells_layouts_pieces_and_requires_grad_apart():
    keys = {
        "base": _key(), "again": _key(),
        "sbp": _key(sbp=B), "head-tail": _key(sbp=S(0, order="head_tail")), "blocked": _key(sbp=S(0, blocks=2)),
        "shape": _key(shape=(6, 8)), "dtype": _key(dtype=torch.float32), "placement": _key(ranks=(1, 0)),
        "requires_grad": _key(requires_grad=False),
    }
    assert keys["base"] == keys["again"]
    assert len(set(keys.values())) == len(keys) - 1, keys
