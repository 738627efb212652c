"""MVP (RUCAIBox/mvp, BART with optional layer-wise prompts) as a table family (session 31, fam31b; before, refused by
discovery with its generic reason: no attention interface, no table). ProphetNet, refused here from session 31, is a
table family since session 41 (tests/test_prophetnet.py); PEGASUS-X, refused here from session 31, since session 40
(tests/test_pegasus_x.py).

MVP without prompts is BART with BART's old attention (``MvpAttention``, outside the attention interface: its
probabilities only with ``output_attentions``), which merges the heads to the hidden states' width: a pruned layer takes
``portable_code.PRUNED_FORWARDS["mvp"]``, in headlab and in the directory's pruned_heads.py. On a tiny MVP in float64:
capture equals transformers' ``output_attentions`` for the three kinds, masking a head equals zeroing its values, gates
at one change nothing, pruning (a head, a whole layer) equals masking on a padded batch and in greedy cached generation,
and so does the saved directory (load_pruned and plain transformers); LRP conserves relevance, pruned too. MVP with
prompts (``use_prompt``: prompt keys and values prepended to every head's) is refused per config.
"""

from __future__ import annotations

import pytest
import torch
import transformers as tf

from headlab import HeadlabError, attention_blocks, prune_heads
from headlab.cli import main
from support.family_matrix import check_gates_at_one_change_nothing, check_pruned_generates_as_masked, padded_inputs
from support.models import mvp_config, tiny_mvp
from support.seq2seq_families import (
    KINDS,
    SPECS,
    check_analyze_end_to_end,
    check_blocks_are_bart_layout,
    check_captured_probabilities,
    check_masking_equals_zeroed,
    check_pruned_equals_masked,
    check_pruned_reloads,
    check_translated_lrp_conserves,
    seq2seq_inputs,
)

PAD = 2


def _inputs() -> dict:
    return seq2seq_inputs(PAD)


def _check_refused(model, words: tuple[str, ...], directory, capsys) -> None:
    """attention_blocks refuses ``model`` naming every one of ``words``, and ``headlab heads`` on it saved to
    ``directory`` once (exit 2, nothing on stdout), naming the first."""
    with pytest.raises(HeadlabError, match="is not supported") as caught:
        attention_blocks(model)
    for word in words:
        assert word in str(caught.value)
    model.save_pretrained(directory)
    assert main(["heads", str(directory)]) == 2
    captured = capsys.readouterr()
    assert captured.err.count("is not supported") == 1 and words[0] in captured.err and captured.out == ""


def test_mvp_blocks_are_the_table():
    check_blocks_are_bart_layout(tiny_mvp(), "mvp")


def test_mvp_captured_probabilities_are_the_models_own():
    """What capture reads (asking each MvpAttention for its probabilities) is transformers' output_attentions, bit
    for bit, for the encoder's, the decoder's and the decoder-encoder attention, on a padded batch."""
    check_captured_probabilities(tiny_mvp(), _inputs())


@pytest.mark.parametrize("kind", KINDS)
def test_mvp_masking_equals_zeroed_values(kind):
    """Masking head 2 of layer 1 equals zeroing its rows of v_proj (weights and bias): its output is then 0."""
    check_masking_equals_zeroed(tiny_mvp(), kind, _inputs())


def test_mvp_gates_at_one_change_nothing():
    check_gates_at_one_change_nothing(tiny_mvp(), _inputs())


@pytest.mark.parametrize("spec_name", SPECS)
def test_mvp_pruned_equals_masked_and_generates_so(spec_name):
    """Pruned (its forward merging the kept heads; a layer with none left: the output projection's bias) equals
    masked in float64: the logits of a padded batch and greedy generation with the cache, step by step. Before the
    pruned forward, MvpAttention's own failed on a pruned layer (its reshape to the hidden states' width)."""
    check_pruned_equals_masked(tiny_mvp(), SPECS[spec_name], _inputs())


@pytest.mark.parametrize("spec_name", SPECS)
def test_mvp_pruned_reloads(spec_name, tmp_path):
    """save_pruned, load_pruned and plain transformers (pruned_heads.py, trust_remote_code): every weight loaded, the
    pruned layers' forward the one that merges their heads; logits and cached generation equal the masked model's."""
    check_pruned_reloads(tiny_mvp(), SPECS[spec_name], _inputs(), tmp_path, {"mvp"})


def test_mvp_causal_lm_prunes_as_masked():
    """MvpForCausalLM (its decoder alone): the cross-attention it builds is never fed (idle), and its self-attention
    pruned (a layer left with no head) equals masked on a padded batch and in greedy cached generation."""
    model = tiny_mvp(tf.MvpForCausalLM)
    assert [(b.kind, b.layer, b.idle) for b in attention_blocks(model)] == \
        [("dec_self", 0, False), ("dec_cross", 0, True), ("dec_self", 1, False), ("dec_cross", 1, True)]
    ids, mask = padded_inputs(pad_id=PAD)
    spec = {("dec_self", 0): [0, 1, 2, 3], ("dec_self", 1): [2]}
    check_pruned_generates_as_masked(model, spec, [0, 3], ids, mask, atol=1e-12)


@pytest.mark.parametrize(("dtype", "bar"), [(torch.float64, 1e-9), (torch.float32, 1e-6)], ids=["float64", "float32"])
@pytest.mark.parametrize("spec_name", [None, *SPECS])
def test_mvp_lrp_conserves(spec_name, dtype, bar):
    """compute_lrp on the model's own outputs (biases on, sources of three lengths) conserves every sentence's logit
    to 1e-9 in float64, and to the bar of tests/test_importance_lrp_conservation.py (1e-6) in float32, pruned too."""
    model = tiny_mvp().to(dtype)
    if spec_name:
        prune_heads(model, SPECS[spec_name])
    check_translated_lrp_conserves(model, eos=1, bar=bar)


def test_mvp_with_prompts_is_refused_before_any_work(tmp_path, capsys):
    """use_prompt=True: prompt keys and values prepended to every head's (a map over [prompt | tokens]; the prompt
    projection holding every layer's heads) is refused, naming why, by attention_blocks and by the command line."""
    model = tiny_mvp(use_prompt=True, prompt_length=3, prompt_mid_dim=16)
    _check_refused(model, ("use_prompt=True", "[prompt | tokens]"), tmp_path / "mvp", capsys)


def test_mvp_pruned_forward_refuses_a_prompt():
    """A pruned layer's forward (pruned_heads.py's too) refuses a prompt rather than attend with every head's."""
    model = tiny_mvp()
    prune_heads(model, {("enc_self", 0): [1]})
    attention = model.model.encoder.layers[0].self_attn
    hidden = torch.zeros(1, 3, 32, dtype=torch.float64)
    with pytest.raises(ValueError, match="cannot be pruned"):
        attention(hidden, attn_prompt=torch.zeros(2, 4, 3, 8, dtype=torch.float64))


def test_mvp_analyze_end_to_end(tmp_path, capsys):
    """Every stage of ``headlab analyze`` on a saved MVP (a word tokenizer with Marian's special ids: pad 0, eos 1)
    runs, LRP and ablation included, and the attention examples hold causal decoder self-attention."""
    torch.manual_seed(0)
    model = tf.MvpForConditionalGeneration(mvp_config(pad_token_id=0, bos_token_id=1, eos_token_id=1,
                                                      decoder_start_token_id=1, forced_eos_token_id=None)).eval()
    with torch.no_grad():  # (drawn at random, it ends every translation at once: no decoder map to read)
        model.final_logits_bias[0, 1] = -5
    check_analyze_end_to_end(model, tmp_path, capsys)
