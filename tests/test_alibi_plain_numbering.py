"""A pruned ALiBi directory (Bloom, MPT, Falcon with alibi; MPNet's shared position bias) loaded by plain
transformers carries headlab's kept-head attribute on every pruned layer with heads left (pruned_heads.py's ALiBi
hook needs it), so check_pruned_numbering lets it through. This pins that doing so is right: such a layer is named by
its original heads, an unpruned layer has its original numbering anyway, and a layer left with no head is refused."""

from __future__ import annotations

import pytest
import torch
import transformers as tf

from headlab import attention_blocks, capture_attention, prune_heads, save_pruned
from headlab.errors import HeadlabError
from headlab.surgery import original_heads
from support.family_matrix import tiny_model

ALIBI = ["bloom", "mpt", "falcon_alibi"]


@pytest.mark.parametrize("family", [*ALIBI, "mpnet"])  # MPNet: its shared position bias goes through the same hook
def test_a_plain_loaded_alibi_directory_keeps_the_original_numbering(family, tmp_path):
    kind, auto = ("enc_self", tf.AutoModelForMaskedLM) if family == "mpnet" else ("dec_self", tf.AutoModelForCausalLM)
    model = tiny_model(family)
    prune_heads(model, {(kind, 0): [1]})
    save_pruned(model, tmp_path)
    plain = auto.from_pretrained(tmp_path, trust_remote_code=True)
    with capture_attention(plain) as record:
        plain(torch.tensor([[3, 4, 5]]))
    assert set(record) == {(kind, 0), (kind, 1)}
    assert [original_heads(b) for b in attention_blocks(plain)] == [([0, 2, 3], 4), ([0, 1, 2, 3], 4)]


@pytest.mark.parametrize("family", ALIBI)
def test_a_plain_loaded_alibi_directory_with_an_emptied_layer_is_refused(family, tmp_path):
    model = tiny_model(family)
    prune_heads(model, {("dec_self", 0): [0, 1, 2, 3], ("dec_self", 1): [2]})
    save_pruned(model, tmp_path)
    plain = tf.AutoModelForCausalLM.from_pretrained(tmp_path, trust_remote_code=True)
    with pytest.raises(HeadlabError, match="a layer pruned by headlab, loaded without headlab"):
        with capture_attention(plain):
            pass
