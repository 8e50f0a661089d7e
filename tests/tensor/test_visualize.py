"""gt.visualize draws which rank holds which block."""
import pytest
import torch

import globaltensor as gt
from globaltensor.sbp import B, P, S


def test_visualize_2d_blocks_and_replicas(capsys):
    with gt.simulate(4):
        p = gt.placement("cpu", [[0, 1], [2, 3]])
        gt.visualize(gt.zeros(7, 10, placement=p, sbp=(S(0), S(1))))
        out = capsys.readouterr().out
        assert "rows 0:4" in out and "rows 4:7" in out and "0:5" in out and "5:10" in out
        text = gt.render_sharding(gt.zeros(7, 10, placement=p, sbp=(S(1), B)))
        assert "0,1" in text and "2,3" in text
        assert "P 0,2" in gt.render_sharding(gt.zeros(7, 10, placement=p, sbp=(P, S(0))))


def test_visualize_1d_and_rejects_3d():
    with gt.simulate(4):
        p = gt.placement("cpu", [0, 1, 2, 3])
        text = gt.render_sharding(gt.zeros(10, placement=p, sbp=S(0)))
        assert all(f"{a}:{b}" in text for a, b in [(0, 3), (3, 6), (6, 8), (8, 10)])
        with pytest.raises(ValueError, match="1-D or 2-D"):
            gt.render_sharding(gt.zeros(2, 2, 2, placement=p, sbp=B))
        with pytest.raises(TypeError, match="global tensor"):
            gt.render_sharding(torch.zeros(3))
