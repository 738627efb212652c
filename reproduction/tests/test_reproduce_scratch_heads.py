"""The from-scratch stage trains a sweep point's own heads, or refuses the point (Table 2 and footnote 8 compare the
point with that run as the same configuration)."""

import json

import numpy as np
import pytest

from headlab.heads import HeadScores
from headlab.resume import SkipStage
from headlab.surgery import PRUNING_FILE
from reproduction.stages import _check_scratch_heads

P_OPEN = {"enc_self": np.array([[0.9, 0.2, 0.7], [0.1, 0.95, 0.3]]), "dec_self": np.array([[0.8, 0.6, 0.05]])}


def _point(tmp_path, kept: dict) -> object:
    point = tmp_path / "keep-4"
    (point / "pruned").mkdir(parents=True)
    HeadScores(P_OPEN, "hard_concrete_p_open", "tiny").save(point / "gates.json")
    blocks = {kind: {str(layer): {"n_heads": 3, "kept_heads": heads, "kept_kv_heads": heads}
                     for layer, heads in layers.items()} for kind, layers in kept.items()}
    (point / "pruned" / PRUNING_FILE).write_text(json.dumps({"format": 1, "blocks": blocks}))
    return point


def test_the_points_own_heads_pass(tmp_path):
    # the top 4 by P(open): enc 0.95 (1,1), 0.9 (0,0), dec 0.8 (0,0), enc 0.7 (0,2); a layer that lost none is listed
    point = _point(tmp_path, {"enc_self": {0: [0, 2], 1: [1]}, "dec_self": {0: [0]}})
    _check_scratch_heads(point, None, 4)
    _check_scratch_heads(point, ("enc_self",), 3)  # the encoder sweep: its kinds only
    # among the committed results the record is kept.json beside gates.json
    (point / "pruned" / PRUNING_FILE).rename(point / "kept.json")
    _check_scratch_heads(point, None, 4)


def test_other_heads_are_refused_naming_the_layers(tmp_path):
    # same counts per kind (3 encoder, 1 decoder), other heads: enc layer 1 kept head 2 for head 1
    point = _point(tmp_path, {"enc_self": {0: [0, 2], 1: [2]}, "dec_self": {0: [0]}})
    with pytest.raises(SkipStage, match=r"point keep-4 kept other heads than the top 4 .* enc_self layer 1\)"):
        _check_scratch_heads(point, None, 4)


def test_a_point_without_its_record_is_refused(tmp_path):
    point = _point(tmp_path, {"enc_self": {}})
    (point / "pruned" / PRUNING_FILE).unlink()
    with pytest.raises(SkipStage, match="no headlab_pruning.json"):
        _check_scratch_heads(point, None, 4)
