"""LRP on NLLB-MoE with its experts' biases counted per sentence (session 42). Before, refused before any work ("no
rule for the mixture-of-experts module NllbMoeExperts ...: its experts' biases (fc1, fc2) apply to the tokens routed
to each expert only"): each expert (``NllbMoeDenseActDense``, biased ``fc1`` and ``fc2``) runs on the rows of the
tokens routed to it, gathered by its router mask (a token may come twice), where headlab's bias probes read one
probe per token of the batch, batch-major. Now each expert's biases get the probes of the tokens its rows are
(``rules.ROUTED_ROWS``, ``lrp._RoutedRows``): their share goes to the sentence the token is in. The routing weights
are held constant, as Switch Transformers' are. Tiny float64 models from configs, biases drawn large (N(0, 1)) so that
a share given to the wrong sentence would show; a padded batch of 3 sentences of different lengths on both sides."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import transformers as tf

from headlab.data.inputs import ImportanceData, make_batches
from headlab.errors import HeadlabError
from headlab.importance import compute_lrp, describe_model
from headlab.importance.lrp import head_relevance
from headlab.importance.rules import check_rules
from support.lrp_families import check_strategies_agree

SOURCES = [[17, 33, 8, 1], [9, 12, 40, 22, 70, 31, 28, 44, 1], [5, 61, 13, 6, 50, 1]]
TARGETS = [[21, 7, 64, 30, 11, 45, 1], [88, 4, 1], [36, 19, 52, 9, 1]]  # the sentences' decoder sides


def _nllb_moe(num_experts: int = 4) -> torch.nn.Module:
    config = tf.NllbMoeConfig(vocab_size=99, d_model=32, encoder_layers=2, decoder_layers=2, encoder_ffn_dim=40,
                              decoder_ffn_dim=40, encoder_attention_heads=4, decoder_attention_heads=4,
                              num_experts=num_experts, encoder_sparse_step=1, decoder_sparse_step=2, expert_capacity=64,
                              pad_token_id=0, eos_token_id=1, bos_token_id=0, decoder_start_token_id=1,
                              max_position_embeddings=64)
    torch.manual_seed(0)
    model = tf.NllbMoeForConditionalGeneration(config).eval().double()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("bias"):
                parameter.normal_(0, 1.0)
            elif "norm" in name and name.endswith("weight"):
                parameter.uniform_(0.5, 1.5)
    return model


def _data(sentences: list[int] | None = None) -> ImportanceData:
    chosen = range(len(SOURCES)) if sentences is None else sentences
    return replace(ImportanceData.from_ids([SOURCES[i] for i in chosen]), translations=[TARGETS[i] for i in chosen])


def _conservation(model: torch.nn.Module) -> dict:
    record = compute_lrp(model, _data(), describe_model(model), bootstrap=0, batch_size=3).signature["conservation"]
    assert record["n_sentences"] == 3 and record["n_outside"] == 0, record
    return record


def test_the_experts_biases_are_no_longer_refused():
    """Before: check_rules raised "NllbMoeExperts ...: its experts' biases (fc1, fc2) apply to the tokens routed"."""
    check_rules(_nllb_moe())


@pytest.mark.parametrize("num_experts", [2, 4])
def test_every_sentence_of_a_padded_batch_conserves_with_large_biases(num_experts):
    """The embeddings' and the biases' shares are each sentence's explained logits to 1e-8 (measured: 2e-16); the
    embeddings alone keep far from all of it, so the biases' shares matter. 2 experts: every token is some expert's
    row once or twice, the row count the batch's token count (read batch-major, permuted); 4: three times."""
    record = _conservation(_nllb_moe(num_experts))
    total = record["with_biases"]
    assert abs(total["min"] - 1) < 1e-8 and abs(total["max"] - 1) < 1e-8, total
    assert abs(record["embeddings"]["mean"] - 1) > 0.1, record


def test_a_pruned_model_conserves():
    """Physically pruned (a layer emptied, heads gone in others): its kept heads explained, every sentence conserved."""
    from headlab import prune_heads

    model = _nllb_moe()
    prune_heads(model, {("enc_self", 0): [0, 1, 2, 3], ("enc_self", 1): [1], ("dec_self", 0): [0, 2],
                        ("dec_cross", 1): [3]})
    total = _conservation(model)["with_biases"]
    assert abs(total["min"] - 1) < 1e-8 and abs(total["max"] - 1) < 1e-8, total


def test_each_sentences_relevance_in_the_batch_is_its_own():
    """Each sentence's head relevances, embeddings' and biases' shares in the padded batch of 3 are those it gets
    explained alone (to 1e-8): no expert's bias share reaches another sentence."""
    model = _nllb_moe()
    info = describe_model(model)
    batch = next(make_batches(_data(), info, batch_size=3))
    both = head_relevance(model, batch)
    for row, sentence in enumerate(batch.index):
        alone = head_relevance(model, next(make_batches(_data([sentence]), info, batch_size=1)))
        mine = both.steps[:, 0] == row
        assert int(mine.sum()) == len(alone.steps) == len(TARGETS[sentence])
        for name in ("logits", "embedding", "biases"):
            torch.testing.assert_close(getattr(both, name)[mine], getattr(alone, name), rtol=1e-8, atol=1e-10)
        for key, values in alone.relevance.items():
            torch.testing.assert_close(both.relevance[key][mine], values, rtol=1e-8, atol=1e-10)


@pytest.mark.parametrize("strategy", ["loop", "jacobian"])
def test_every_strategy_gives_vmaps_shares(strategy):
    model = _nllb_moe()
    check_strategies_agree(model, _data(), describe_model(model), strategy)


def test_experts_gathering_other_rows_are_refused():
    """An NllbMoeExperts whose forward gathers each expert's rows in another order than transformers 5.24's (here
    reversed, its output the same): refused, naming the expert, rather than its biases' shares read in the wrong order
    (lrp._RoutedRows checks each expert's input against the rows it computes)."""
    model = _nllb_moe()
    experts = model.model.encoder.layers[0].ffn.experts

    def reversed_rows(hidden_states, router_mask, router_probs):
        out = torch.zeros_like(hidden_states)
        expert_mask = torch.nn.functional.one_hot(router_mask, num_classes=experts.num_experts).permute(2, 1, 0)
        for e in range(experts.num_experts):
            idx, top_x = torch.where(expert_mask[e])
            idx, top_x = idx.flip(0), top_x.flip(0)
            if len(top_x):
                out.index_add_(0, top_x, experts[f"expert_{e}"](hidden_states[top_x]) * router_probs[top_x, idx, None])
        return out * (1 - experts.moe_token_dropout)  # its evaluation-mode scale, as transformers' forward

    experts.forward = reversed_rows
    with pytest.raises(HeadlabError, match=r"no rule for the biases of the expert model.encoder.layers.0.ffn.experts."
                                           r"expert_\d: it does not run on the rows"):
        compute_lrp(model, _data(), describe_model(model), bootstrap=0, batch_size=3)


def test_the_family_sweep_checks_compute_lrp_on_experts():
    """experiments/family_sweep.py's tiny NLLB-MoE has experts (before: encoder_sparse_step 4 over 2 layers, none, so
    they went unchecked), and its compute_lrp check passes: conserved in float64 to its 1e-8, the model given back as
    compute_lrp got it (its router's classifier cast to float32 by the model's own first forward, translate_data's,
    read before as compute_lrp changing the model)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    from support.experiments import load_experiment

    sweep = load_experiment("family_sweep")
    config_class = CONFIG_MAPPING["nllb-moe"]
    model = sweep.as_analysed(sweep.build(config_class, sweep.model_class(config_class), "eager", torch.float64)[0])
    assert any(type(module).__name__ == "NllbMoeExperts" for module in model.modules())
    assert sweep.check_compute_lrp(model) is None
