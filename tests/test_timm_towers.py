"""PerceptionLM and FastVLM: their vision towers are timm models (``TimmWrapperModel``). Without timm installed
(this environment), the check every command makes before any work (``loading.check_supported``) refuses such a model
with exit 2 and a HeadlabError naming timm, not a raw ImportError from deep inside a stage (session 38, mm38b).
Their text path through the wrapper, on token ids, is checked by experiments/family_sweep.py --multimodal with a
CLIP tower standing in for the timm one (idle on token ids)."""

from __future__ import annotations

import importlib.util

import pytest
import transformers as tf

from headlab import HeadlabError
from headlab.cli import main
from headlab.loading import check_supported

_TEXT = dict(hidden_size=32, intermediate_size=40, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             vocab_size=99, max_position_embeddings=64)

pytestmark = pytest.mark.skipif(importlib.util.find_spec("timm") is not None, reason="timm is installed")


@pytest.mark.parametrize("config", [
    lambda: tf.PerceptionLMConfig(text_config=dict(_TEXT, model_type="llama"), image_token_id=98),
    lambda: tf.FastVlmConfig(text_config=dict(_TEXT, model_type="qwen2"), image_token_id=98),
], ids=["perception_lm", "fast_vlm"])
def test_a_timm_tower_without_timm_is_refused_before_any_work(config, tmp_path, capsys):
    config().save_pretrained(tmp_path / "model")
    with pytest.raises(HeadlabError, match=r"(?s)cannot build the model from its config \(.*requires the timm library"):
        check_supported(str(tmp_path / "model"))
    out = tmp_path / "out"
    assert main(["functions", str(tmp_path / "model"), "--conllu", str(tmp_path / "tb.conllu"), "--out",
                 str(out)]) == 2
    err = capsys.readouterr().err
    assert "internal error" not in err and "Traceback" not in err
    assert "timm" in err, err
    assert not out.exists()
