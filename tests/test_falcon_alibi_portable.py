"""A pruned Falcon with ALiBi and fewer key/value heads than query heads (new_decoder_architecture=True with
num_kv_heads < num_attention_heads; multi_query=True) loads with plain transformers through pruned_heads.py and
computes what the pruned model computes; pruning it further is for headlab's loader only.

* plain ``from_pretrained(trust_remote_code=True)``: the logits of a padded batch and cached greedy generation (tokens
  and scores) equal the pruned model's in float64 (eager and sdpa: Falcon folds ALiBi into the attention mask, whose
  heads the hook selects too), a key/value head dropped with its whole group;
* the plain-loaded model carries the ALiBi hook's kept query heads but not the key/value heads headlab records: until
  session 34 ``prune_heads`` on it failed with ``AttributeError: ... '_headlab_kept_kv_heads'``; a plain-loaded
  directory of a family without ALiBi (GPT-2) carries no numbering at all, and ``prune_heads`` named its kept heads
  0, 1, ... as if they were the original ones (``save_pruned`` then wrote that record), without a word. Both are
  refused now before any work, naming headlab's loader, as is a plain-loaded standard config (Llama);
* ``headlab.load_pruned`` of the same directory prunes further, exactly (the masked original model's logits).
"""

from __future__ import annotations

import pytest
import torch
import transformers as tf

from headlab import attention_blocks, load_pruned, mask_heads, prune_heads, save_pruned
from headlab.errors import HeadlabError
from headlab.surgery import original_heads
from support.family_matrix import logits, perturbed_model, tiny_inputs
from support.models import tiny_model
from support.seq2seq_families import cached_generation

LAYOUTS = {  # 4 query heads of 8 in each
    "grouped": dict(new_decoder_architecture=True, num_kv_heads=2),  # two groups of two
    "multi-query": dict(multi_query=True, parallel_attn=False),  # one key/value head for all
}
# layer 1 loses key/value head 0's whole group in the grouped layout
SPEC = {("dec_self", 0): [1], ("dec_self", 1): [0, 1]}
KEPT = [([0, 2, 3], 4), ([2, 3], 4)]
REFUSED = "was pruned by headlab and loaded without it"


def _falcon(layout: str, attn_implementation: str) -> torch.nn.Module:
    config = tf.FalconConfig(vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, alibi=True,
                             bias=True, bos_token_id=0, eos_token_id=1, pad_token_id=2, **LAYOUTS[layout])
    return perturbed_model(tf.FalconForCausalLM, config, 0, attn_implementation).double()


def _plain(directory, attn_implementation: str) -> torch.nn.Module:
    return tf.AutoModelForCausalLM.from_pretrained(directory, trust_remote_code=True, dtype=torch.float64,
                                                   attn_implementation=attn_implementation).eval()


@pytest.mark.parametrize("attn_implementation", ["eager", "sdpa"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_pruned_falcon_with_alibi_and_shared_key_values_loads_with_plain_transformers(layout, attn_implementation,
                                                                                      tmp_path):
    model, inputs = _falcon(layout, attn_implementation), tiny_inputs()
    with mask_heads(model, SPEC):
        expected = logits(model, inputs)
        tokens, scores = cached_generation(model, inputs)
    prune_heads(model, SPEC)
    assert [original_heads(b) for b in attention_blocks(model)] == KEPT
    save_pruned(model, tmp_path)
    plain = _plain(tmp_path, attn_implementation)
    assert type(plain).__name__ == "PrunedModel"
    for loaded in (model, plain):
        torch.testing.assert_close(logits(loaded, inputs), expected, atol=1e-12, rtol=0)
        loaded_tokens, loaded_scores = cached_generation(loaded, inputs)
        assert torch.equal(loaded_tokens, tokens)
        torch.testing.assert_close(loaded_scores, scores, atol=1e-12, rtol=0)
    assert [original_heads(b) for b in attention_blocks(plain)] == KEPT  # the ALiBi hook's, which analysis reads


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_plain_loaded_falcon_is_pruned_further_by_headlabs_loader_only(layout, tmp_path):
    model, inputs = _falcon(layout, "eager"), tiny_inputs()
    with mask_heads(model, {**SPEC, ("dec_self", 1): [0, 1, 2]}):
        expected = logits(model, inputs)  # the original model without the heads of both prunings
    prune_heads(model, SPEC)
    save_pruned(model, tmp_path / "pruned")
    plain = _plain(tmp_path / "pruned", "eager")
    before = {k: v.clone() for k, v in plain.state_dict().items()}
    with pytest.raises(HeadlabError, match=f"{REFUSED} \\(its pruned_heads.py\\).*headlab.load_pruned"):
        prune_heads(plain, {("dec_self", 1): [0]})
    assert all(torch.equal(v, plain.state_dict()[k]) for k, v in before.items())
    with pytest.raises(HeadlabError, match=REFUSED):
        save_pruned(plain, tmp_path / "again")
    assert not (tmp_path / "again").exists()
    reloaded = load_pruned(tmp_path / "pruned").double()
    reloaded.config._attn_implementation = "eager"  # Falcon's eager and sdpa ALiBi differ (eager adds it twice)
    assert prune_heads(reloaded, {("dec_self", 1): [0]}) == {("dec_self", 0): [0, 2, 3], ("dec_self", 1): [3]}
    torch.testing.assert_close(logits(reloaded, inputs), expected, atol=1e-12, rtol=0)


@pytest.mark.parametrize("family", ["gpt2", "llama"])  # pruned_heads.py; a standard config (every layer alike)
def test_a_plain_loaded_directory_without_alibi_is_not_pruned_under_other_numbers(family, tmp_path):
    model = tiny_model(family, attn_implementation="eager")
    prune_heads(model, {("dec_self", 0): [0, 3], ("dec_self", 1): [0, 3]})
    save_pruned(model, tmp_path / "pruned")
    plain = tf.AutoModelForCausalLM.from_pretrained(tmp_path / "pruned", trust_remote_code=True)
    how = "its pruned_heads.py" if family == "gpt2" else "a standard config"
    with pytest.raises(HeadlabError, match=f"{REFUSED} \\({how}\\)"):  # was: kept heads [1] of 2, not [2] of 4
        prune_heads(plain, {("dec_self", 0): [0]})
    with pytest.raises(HeadlabError, match=REFUSED):
        save_pruned(plain, tmp_path / "again")
    # a model built afresh from the config headlab's loader restores is the original model: pruned as such
    fresh = type(model)._from_config(load_pruned(tmp_path / "pruned").config).eval()
    assert prune_heads(fresh, {("dec_self", 0): [1]}) == {("dec_self", 0): [0, 2, 3]}
