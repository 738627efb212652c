"""Families that the sweep of session 22 (experiments/family_sweep.py: every text model type of
transformers 5.24 built tiny, the checks of tests/support/family_matrix.py run on each) found LRP
getting wrong: relevance not conserved, which compute_lrp's conservation check then failed after
the work. Now each has a rule, or is refused by check_rules before any work, naming the module:

* Nemotron's ``LayerNorm1P`` normalises with ``1 + weight``: the layer-norm rule's factor is the
  one a LayerNorm subclass really applies (checked);
* ESM's ``EsmIntermediate`` applies GELU as a function: the activation rule on its output;
* Moshi's ``MoshiGatingMLP`` is ``fc2(act(h0) * h1)`` with ``h0, h1`` the halves of ``fc1(x)``:
  the fused gated rule (only where ``fc1`` is twice as wide as ``fc2``'s input);
* LFM2's MLP (``w2(silu(w1 x) * w3 x)``, the activation a function call; refused until session 28): the
  activation and product rules of Llama's gated MLP, hooked on ``w1``, ``w3`` and ``w2`` (tests/test_lrp_norm_rules.py);
* Gemma 3n (refused until session 30): AltUp's coefficients held constant, activation sparsity's ordinary backward
  (tests/test_lrp_altup.py);
* RecurrentGemma (refused until session 35): the RG-LRU's gates and decay held constant, the GeLU branch a gate held
  constant (tests/test_lrp_rg_lru.py);
* MiniMax's lightning attention (refused until session 35 as a token mixer that is no block): ``q . k`` and the
  decay held constant, the output gate held constant (tests/test_lrp_lightning_attention.py);
* Falcon-H1's Mamba-2 mixer (refused until session 35): the selective SSM's decay and input/output matrices held
  constant, MambaLRP's rule (tests/test_lrp_mamba.py).

It also found UMT5 and Switch Transformers (T5's layout: ``encoder.block.N.layer.0.SelfAttention``)
refused, their layer index read off the wrong number of the path ("two modules claim enc_self layer 0"):
they now use T5's table entry. And it found two causal LMs whose attention says nowhere that it is causal (no ``is_causal``, no
``is_decoder``): XGLM and Doge were taken for encoders (``enc_self``), and so for masked LMs, their
importance measures computing the wrong objective; a ``...ForCausalLM`` class now makes them ``dec_self``.

Tiny models built from their configs (hidden 32, 2 layers, 4 query heads over 2 key/value heads of 8,
vocab 99), random biases and norm weights; no download.
"""

from __future__ import annotations

import re

import pytest
import torch
import transformers as tf

from headlab import HeadlabError, attention_blocks
from headlab.importance import ImportanceData, compute_lrp, describe_model
from headlab.importance.lrp import lrp_precision
from headlab.importance.rules import check_rules

_GQA = dict(vocab_size=99, hidden_size=32, intermediate_size=37, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, max_position_embeddings=64, bos_token_id=0, eos_token_id=1,
            pad_token_id=2)

CONSERVING = {
    "nemotron": lambda: (tf.NemotronForCausalLM, tf.NemotronConfig(**_GQA)),
    "esm": lambda: (tf.EsmForMaskedLM, tf.EsmConfig(
        vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=37,
        max_position_embeddings=64, pad_token_id=2, mask_token_id=3)),
    # fc1: 32 -> 80 ([gate | up], 40 each), fc2: 40 -> 32
    "moshi": lambda: (tf.MoshiForCausalLM, tf.MoshiConfig(**{**_GQA, "intermediate_size": None}, ffn_dim=80)),
    "lfm2": lambda: (tf.Lfm2ForCausalLM, tf.Lfm2Config(**_GQA, layer_types=["full_attention"] * 2)),
    # per-layer inputs: Ding's product rule, the per-layer token embeddings counted as input (refused until session 29)
    "gemma4_text": lambda: (tf.Gemma4ForCausalLM, tf.Gemma4TextConfig(
        **_GQA, layer_types=["sliding_attention", "full_attention"], sliding_window=4, global_head_dim=8,
        hidden_size_per_layer_input=8, vocab_size_per_layer_input=99)),
    # AltUp's coefficients held constant, activation sparsity's ordinary backward (refused until session 30:
    # tests/test_lrp_altup.py)
    "gemma3n_text": lambda: (tf.Gemma3nForCausalLM, tf.Gemma3nTextConfig(
        **{**_GQA, "intermediate_size": [37, 37]}, layer_types=["sliding_attention", "full_attention"],
        num_kv_shared_layers=0, laurel_rank=4, altup_num_inputs=2, hidden_size_per_layer_input=8,
        vocab_size_per_layer_input=99, activation_sparsity_pattern=[0.95, 0.0])),
    # part 2 of the sweep (per-family sizes): Griffin's RG-LRU, its gates and decay held constant and the GeLU branch a
    # gate held constant (refused until session 35: tests/test_lrp_rg_lru.py)
    "recurrent_gemma": lambda: (tf.RecurrentGemmaForCausalLM, tf.RecurrentGemmaConfig(
        **{**_GQA, "num_key_value_heads": 1}, block_types=["recurrent", "attention"], attention_window_size=16,
        lru_width=32)),
    # MiniMax's lightning attention: q . k and the decay held constant, the output gate held constant (refused until
    # session 35 as a token mixer named attention: tests/test_lrp_lightning_attention.py)
    "minimax": lambda: (tf.MiniMaxForCausalLM, tf.MiniMaxConfig(
        **{**_GQA, "intermediate_size": 40}, layer_types=["full_attention", "linear_attention"],
        num_local_experts=2, num_experts_per_tok=1)),
    # its Mamba-2 mixer beside the attention in every layer: the selective SSM's decay and input/output matrices held
    # constant (refused until session 35: importance/mixer_rules/mamba.py, tests/test_lrp_mamba.py)
    "falcon_h1": lambda: (tf.FalconH1ForCausalLM, tf.FalconH1Config(
        **_GQA, mamba_d_ssm=32, mamba_n_heads=4, mamba_d_head=8, mamba_d_state=8, mamba_chunk_size=4)),
}


def _tiny(build) -> torch.nn.Module:
    cls, config = build()
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = cls(config).eval()
    with torch.no_grad():  # off their initial values, so that a rule ignoring them shows
        for name, parameter in model.named_parameters():
            if name.endswith("bias"):
                parameter.normal_(0, 0.1)
            elif "norm" in name.lower() and name.endswith("weight"):
                parameter.uniform_(0.5, 1.5)
    return model


def _data(model) -> tuple[ImportanceData, object]:
    info = describe_model(model)
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(3, 9, (4,), generator=g).tolist()
    return ImportanceData.from_ids([torch.randint(4, 99, (k,), generator=g).tolist() + [1] for k in lengths]), info


@pytest.mark.parametrize("family", CONSERVING)
def test_lrp_conserves_relevance(family):
    """Relevance at the embeddings plus the biases' shares is the explained logit, per sentence
    (before the rules: nemotron, esm and moshi failed the run outside the 1e-3 tolerance; lfm2, gemma4_text and
    gemma3n_text were refused; recurrent_gemma, minimax and falcon_h1 until session 35)."""
    model = _tiny(CONSERVING[family])
    check_rules(model)
    data, info = _data(model)
    record = compute_lrp(model, data, info, bootstrap=0).signature["conservation"]
    assert record["n_sentences"] == 4 and record["n_outside"] == 0, record
    total = record["with_biases"]
    assert abs(total["min"] - 1) < 1e-6 and abs(total["max"] - 1) < 1e-6, total


def test_moshis_gating_mlp_is_a_gated_mlp_and_nanochats_plain_mlp_is_not():
    """fc1/fc2/activation_fn is gated only where fc1 gives two halves (float64 for the product rule)."""
    assert lrp_precision(_tiny(CONSERVING["moshi"])) == torch.float64
    nanochat = tf.NanoChatForCausalLM(tf.NanoChatConfig(**_GQA))  # fc2(act(fc1 x)), no product
    assert lrp_precision(nanochat) == torch.float32


CAUSAL = {
    "xglm": lambda: (tf.XGLMForCausalLM, tf.XGLMConfig(vocab_size=99, d_model=32, num_layers=2, attention_heads=4,
                                                       ffn_dim=37, max_position_embeddings=64, pad_token_id=2)),
    "doge": lambda: (tf.DogeForCausalLM, tf.DogeConfig(**_GQA)),
}


@pytest.mark.parametrize("family", CAUSAL)
def test_a_causal_lm_without_an_is_causal_flag_is_a_decoder(family):
    """Its blocks are dec_self, the model a causal LM, and its attention (transformers' own
    output_attentions) is indeed causal: nothing attends to a later position."""
    model = _tiny(CAUSAL[family])
    assert [(b.kind, b.layer) for b in attention_blocks(model)] == [("dec_self", 0), ("dec_self", 1)]
    assert describe_model(model).arch == "causal"
    with torch.no_grad():
        maps = model(input_ids=torch.tensor([[5, 6, 7, 8, 9]]), output_attentions=True).attentions
    assert all(torch.triu(m[0], diagonal=1).abs().sum() == 0 for m in maps)


T5_LIKE = {
    "umt5": lambda: (tf.UMT5ForConditionalGeneration, tf.UMT5Config(
        vocab_size=99, d_model=32, d_kv=8, d_ff=37, num_layers=2, num_heads=4, pad_token_id=0, eos_token_id=1,
        decoder_start_token_id=0)),
    "switch_transformers": lambda: (tf.SwitchTransformersForConditionalGeneration, tf.SwitchTransformersConfig(
        vocab_size=99, d_model=32, d_kv=8, d_ff=37, num_layers=2, num_decoder_layers=2, num_sparse_encoder_layers=1,
        num_sparse_decoder_layers=1, num_experts=2, num_heads=4, pad_token_id=0, eos_token_id=1,
        decoder_start_token_id=0)),
}


@pytest.mark.parametrize("family", T5_LIKE)
def test_t5_like_families_capture_and_mask_exactly(family):
    """Every block found; capture equals transformers' own output_attentions (encoder, decoder,
    cross); masking heads 2 and 3 of each kind's layer 1 equals zeroing their value rows by hand."""
    from headlab import capture_attention, mask_heads

    model = _tiny(T5_LIKE[family])
    blocks = attention_blocks(model)
    assert [(b.kind, b.layer, b.n_heads) for b in blocks] == [
        ("enc_self", 0, 4), ("enc_self", 1, 4), ("dec_self", 0, 4), ("dec_cross", 0, 4), ("dec_self", 1, 4),
        ("dec_cross", 1, 4)]
    g = torch.Generator().manual_seed(1)
    inputs = {"input_ids": torch.randint(3, 99, (2, 7), generator=g), "attention_mask": torch.ones(2, 7, dtype=torch.long),
              "decoder_input_ids": torch.randint(3, 99, (2, 5), generator=g)}
    inputs["attention_mask"][1, -2:] = 0
    with torch.no_grad():
        out = model(**inputs, output_attentions=True)
        with capture_attention(model) as record:
            before = model(**inputs).logits
    references = {"enc_self": out.encoder_attentions, "dec_self": out.decoder_attentions,
                  "dec_cross": out.cross_attentions}
    for (kind, layer), probs in record.items():
        assert torch.equal(probs, references[kind][layer]), (kind, layer)
    for block in blocks:
        if block.layer != 1:
            continue
        with torch.no_grad(), mask_heads(model, {block.key: [2, 3]}):
            masked = model(**inputs).logits
        saved = block.v.weight.detach().clone()
        with torch.no_grad():
            block.v.weight[16:32] = 0  # heads 2 and 3's values (T5's v: heads x 8 rows, no bias)
            zeroed = model(**inputs).logits
            block.v.weight.copy_(saved)
        assert not torch.allclose(masked, before)
        torch.testing.assert_close(masked, zeroed, atol=1e-6, rtol=0)


def _zamba():
    # one Mamba layer, then two hybrid layers whose shared transformer's weights are tied
    return tf.ZambaForCausalLM, tf.ZambaConfig(
        vocab_size=99, hidden_size=32, intermediate_size=37, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, bos_token_id=0, eos_token_id=1, pad_token_id=2,
        mamba_d_state=8, layers_block_type=["mamba", "hybrid", "hybrid"])


def test_pruning_attention_weights_tied_across_depths_at_one_depth_is_refused_before_any_work():
    """Zamba's hybrid layers hold one set of attention weights (tied parameters, two modules).
    Slicing layer 1's heads untied them in memory (masking-exact there), and transformers re-tied
    them on loading, giving layer 2 layer 1's pruned weights: load_pruned gave a broken model.
    Refused now, the model untouched; masking one depth stays exact. (The same heads removed at
    both layers prune: tests/test_tied_pruning.py.)"""
    from headlab import mask_heads, prune_heads
    from headlab.surgery import check_prunable

    model = _tiny(_zamba)
    blocks = attention_blocks(model)
    assert [(b.kind, b.layer, b.n_heads) for b in blocks] == [("dec_self", 1, 4), ("dec_self", 2, 4)]
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    calls: list = []
    model.register_forward_pre_hook(lambda module, args: calls.append(1))
    with pytest.raises(HeadlabError, match=r"dec_self layers 1,2: their attention weights are shared by 2 depths "
                                           r"\(tied parameters"):
        prune_heads(model, {("dec_self", 1): [3]})
    assert not calls
    assert all(torch.equal(p, weights[n]) for n, p in model.named_parameters())
    assert model.model.layers[1].shared_transf.self_attn.q_proj.weight is \
        model.model.layers[2].shared_transf.self_attn.q_proj.weight
    check_prunable(model)  # the same heads at both layers prune; undone, the weights tied as before
    assert all(torch.equal(p, weights[n]) for n, p in model.named_parameters())
    assert model.model.layers[1].shared_transf.self_attn.q_proj.weight is \
        model.model.layers[2].shared_transf.self_attn.q_proj.weight
    # masking layer 2 only: its heads' outputs zeroed, layer 1 unchanged (the attention function's reference)
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    with torch.no_grad(), mask_heads(model, {("dec_self", 2): [2, 3]}):
        masked = model(input_ids=ids).logits
    attention = model.model.layers[2].shared_transf.self_attn
    hook = attention.o_proj.register_forward_pre_hook(
        lambda module, args: (args[0].reshape(*args[0].shape[:-1], 4, -1).index_fill(-2, torch.tensor([2, 3]), 0)
                              .flatten(-2),))
    with torch.no_grad():
        zeroed = model(input_ids=ids).logits
    hook.remove()
    torch.testing.assert_close(masked, zeroed, atol=1e-6, rtol=0)


BERT_DECODERS = {
    "bert": lambda: (tf.BertLMHeadModel, tf.BertConfig),
    "roberta": lambda: (tf.RobertaForCausalLM, tf.RobertaConfig),
    # found at run time (no table): the cross-attention was another dec_self of its layer ("two modules claim")
    "bert-generation": lambda: (tf.BertGenerationDecoder, tf.BertGenerationConfig),
    "data2vec-text": lambda: (tf.Data2VecTextForCausalLM, tf.Data2VecTextConfig),
}


@pytest.mark.parametrize("family", BERT_DECODERS)
def test_a_bert_style_decoder_is_a_decoder(family):
    """BERT-style causal LMs (``is_decoder=True``, with cross-attention layers) attend causally: their
    blocks were enc_self (BERT, RoBERTa: the encoder's table entry) and the model a masked LM, or the
    model was refused (found at run time: "two modules claim dec_self layer 0", the cross-attention's
    too); now dec_self and dec_cross. Capture equals output_attentions; masking equals zeroing the value rows by hand."""
    from headlab import capture_attention, mask_heads

    cls, config_class = BERT_DECODERS[family]()
    config = config_class(vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                          intermediate_size=37, max_position_embeddings=64, pad_token_id=2, is_decoder=True,
                          add_cross_attention=True)
    model = _tiny(lambda: (cls, config))
    blocks = attention_blocks(model)
    assert [(b.kind, b.layer) for b in blocks] == [("dec_self", 0), ("dec_cross", 0), ("dec_self", 1), ("dec_cross", 1)]
    assert describe_model(model).arch == "causal"
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    with torch.no_grad():
        maps = model(input_ids=ids, output_attentions=True).attentions
        with capture_attention(model) as record:
            before = model(input_ids=ids).logits
        with mask_heads(model, {("dec_self", 1): [2, 3]}):
            masked = model(input_ids=ids).logits
        value = blocks[2].v
        value.weight[16:32] = 0
        value.bias[16:32] = 0
        zeroed = model(input_ids=ids).logits
    assert sorted(record) == [("dec_self", 0), ("dec_self", 1)]  # the cross-attention does not run without an encoder
    for layer in (0, 1):
        assert torch.equal(record[("dec_self", layer)], maps[layer])
        assert torch.triu(maps[layer][0], diagonal=1).abs().sum() == 0
    assert not torch.allclose(masked, before)
    torch.testing.assert_close(masked, zeroed, atol=1e-6, rtol=0)
    # without is_decoder: the encoder's entry, as before
    plain = _tiny(lambda: (cls, config_class(vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                             intermediate_size=37, max_position_embeddings=64, pad_token_id=2)))
    assert [b.kind for b in attention_blocks(plain)] == ["enc_self", "enc_self"]


NLLB_MOE = lambda: (tf.NllbMoeForConditionalGeneration, tf.NllbMoeConfig(  # noqa: E731
    vocab_size=99, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
    encoder_ffn_dim=37, decoder_ffn_dim=37, num_experts=2, expert_capacity=8, encoder_sparse_step=2,
    decoder_sparse_step=2, max_position_embeddings=64, pad_token_id=1, bos_token_id=0, eos_token_id=2,
    decoder_start_token_id=2))
SEQ2SEQ_PRUNED = {**T5_LIKE, "nllb-moe": NLLB_MOE}


@pytest.mark.parametrize("setting,expected", [
    ({"moe_eval_capacity_token_fraction": 0.5}, "moe_eval_capacity_token_fraction=0.5 drops"),
    ({"second_expert_policy": "random"}, "second_expert_policy='random' routes tokens to their second expert at random"),
    ({"second_expert_policy": "sampling"}, "second_expert_policy='sampling'"),
])
def test_nllb_moe_routing_that_depends_on_the_batch_or_chance_is_refused(setting, expected):
    """Found in session 41: with moe_eval_capacity_token_fraction below 1 an expert's capacity in evaluation mode is
    counted over the whole batch, so a right-padded sentence's logits differ from the sentence alone (3e-3 on this
    model); the sampling and random second-expert policies route at random in evaluation mode too. Refused before any
    work; the defaults stay supported."""
    cls, config = NLLB_MOE()
    for name, value in setting.items():
        setattr(config, name, value)
    with pytest.raises(HeadlabError, match=re.escape(expected)):
        attention_blocks(cls(config).eval())
    assert attention_blocks(NLLB_MOE()[0](NLLB_MOE()[1]).eval())


@pytest.mark.parametrize("family", SEQ2SEQ_PRUNED)
def test_seq2seq_families_prune_as_they_mask_and_reload(family, tmp_path):
    """The session-26 sweep: pruning UMT5 failed its check with a bare TypeError ("got multiple values for keyword
    argument 'position_bias'": T5's shared-bias hooks on a model whose every self-attention layer computes its own
    bias), Switch Transformers' and NLLB-MoE's were refused because their own forwards failed on the check's probe
    (use_cache handed to Switch's encoder stack; NLLB-MoE reads encoder_outputs.last_hidden_state, the probe gave a
    tuple). Now the probe runs an encoder-decoder as generate() does, UMT5's per-layer bias keeps the kept heads'
    columns: pruning (an emptied layer too) equals masking, and the model reloads (load_pruned and plain transformers;
    Switch's shared bias as T5's, since session 33)."""
    import json

    from headlab import load_pruned, mask_heads, prune_heads, save_pruned

    model = _tiny(SEQ2SEQ_PRUNED[family])
    g = torch.Generator().manual_seed(1)
    inputs = {"input_ids": torch.randint(3, 99, (2, 7), generator=g), "attention_mask": torch.ones(2, 7, dtype=torch.long),
              "decoder_input_ids": torch.randint(3, 99, (2, 5), generator=g)}
    inputs["attention_mask"][1, -2:] = 0
    spec = {("enc_self", 0): [0, 1, 2, 3], ("enc_self", 1): [0, 2], ("dec_self", 0): [1], ("dec_self", 1): [3],
            ("dec_cross", 1): [0, 1, 2, 3]}
    with torch.no_grad():
        before = model(**inputs).logits
        with mask_heads(model, spec):
            masked = model(**inputs).logits
    assert not torch.allclose(masked, before)
    prune_heads(model, spec)
    assert [b.n_heads for b in attention_blocks(model)] == [0, 2, 3, 4, 3, 0]
    with torch.no_grad():
        torch.testing.assert_close(model(**inputs).logits, masked, atol=1e-5, rtol=0)
    if family == "umt5":  # the kept heads' columns of each self-attention layer's own bias table
        assert model.encoder.block[1].layer[0].SelfAttention.relative_attention_bias.weight.shape == (32, 2)
        assert model.decoder.block[0].layer[0].SelfAttention.relative_attention_bias.weight.shape == (32, 3)
    save_pruned(model, tmp_path)
    with torch.no_grad():
        torch.testing.assert_close(load_pruned(tmp_path)(**inputs).logits, masked, atol=1e-5, rtol=0)
    portable = json.loads((tmp_path / "headlab_pruning.json").read_text())["portable"]
    assert portable["how"] == "remote code"  # switch_transformers: T5's one bias table per stack, sliced per layer
    plain, info = tf.AutoModelForSeq2SeqLM.from_pretrained(tmp_path, trust_remote_code=True, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    with torch.no_grad():
        torch.testing.assert_close(plain.eval()(**inputs).logits, masked, atol=1e-5, rtol=0)


def _inkling():
    config = tf.AutoConfig.for_model("inkling_text", **{**_GQA, "intermediate_size": 40})
    return tf.AutoModelForCausalLM.from_config, config


def test_pruning_inklings_key_value_convolutions_is_refused_before_any_work():
    """Inkling's attention runs depthwise short convolutions over the key and value projections' channels
    (k_sconv, v_sconv: one kernel per channel, their states in the cache), which pruning does not slice: the
    pruned forward failed its check with a bare Conv1d error (the session-26 sweep). Refused before anything
    runs now, naming them; the model untouched."""
    from headlab import prune_heads

    cls, config = _inkling()
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = cls(config).float().eval()
    assert [(b.kind, b.layer) for b in attention_blocks(model)][:1] == [("dec_self", 0)]
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    calls: list = []
    model.register_forward_pre_hook(lambda module, args: calls.append(1))
    with pytest.raises(HeadlabError, match=r"model.layers.0.self_attn .*physical pruning is refused: .*modules whose "
                                           r"weights span the heads' channels \(r_proj \(Linear weight \[1024, 32\]: "
                                           r"64 query heads x 16\), k_sconv \(InklingShortConvolution "
                                           r"conv1d.weight \[\d+, 1, \d+\]\), v_sconv"):
        prune_heads(model, {("dec_self", 0): [3]})
    assert not calls
    assert all(torch.equal(p, weights[n]) for n, p in model.named_parameters())


class _NoConvolution(torch.nn.Module):
    """Stands in for Inkling's InklingShortConvolution: the channels passed as they are."""

    def forward(self, hidden_states, cache=None, conv_mask=None, **kwargs):
        return hidden_states


def test_pruning_inklings_relative_position_projection_alone_is_refused_before_any_work():
    """Inkling's r_proj emits num_heads x d_rel (each head's relative-position features, viewed [..., heads, -1]),
    which pruning does not slice. With the key/value convolutions taken out and heads of 4 (q width 16, hidden 32,
    d_rel 6: r_proj [24, 32] has no dimension of a projection's width), it alone is unsliced: refused before anything
    runs, naming it; the model untouched. Before: the pruned forward failed its check after the work, with a bare
    shape error ("mat1 and mat2 shapes cannot be multiplied")."""
    from headlab import prune_heads

    cls, config = _inkling()
    config.swa_num_attention_heads, config.swa_num_key_value_heads, config.swa_head_dim = 4, 2, 4
    config.d_rel = 6
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = cls(config).float().eval()
    for layer in model.model.layers:
        layer.self_attn.k_sconv = _NoConvolution()
        layer.self_attn.v_sconv = _NoConvolution()
    assert [(b.n_heads, b.n_kv_heads, b.d_head) for b in attention_blocks(model)] == [(4, 2, 4)] * 2
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    calls: list = []
    model.register_forward_pre_hook(lambda module, args: calls.append(1))
    with pytest.raises(HeadlabError, match=r"model.layers.0.self_attn .*physical pruning is refused: .*modules whose "
                                           r"weights span the heads' channels \(r_proj \(Linear weight \[24, 32\]: 4 "
                                           r"query heads x 6\)\)"):
        prune_heads(model, {("dec_self", 0): [3]})
    assert not calls
    assert all(torch.equal(p, weights[n]) for n, p in model.named_parameters())


OPERATIONS_NAMED = {  # model type -> (config sizes beyond _GQA, what the refusal names)
    "deepseek_v4": (dict(), r"o_a_proj through operations other than reshapes and casts \(transpose, getitem, mul"),
    "jetmoe": (dict(num_local_experts=4, num_experts_per_tok=2, kv_channels=8),
               r"experts.output_linear through operations other than reshapes and casts \(getitem\)"),
}


@pytest.mark.parametrize("model_type", OPERATIONS_NAMED)
def test_a_refused_attention_names_the_operations_on_its_output(model_type, monkeypatch):
    """Refusals of attentions whose output reaches the output projection through more than reshapes named no
    operation ("a gate, a norm, a transpose, a sum"); they name the operations now (DeepSeek-V4: the rotary
    slice rotated back; JetMoE: the heads' outputs indexed into attention experts). Beam's gate, seen as a gate
    once view_as lent a shape only, is now accepted (tests/test_output_gates.py, whose refusal without its table
    entry keeps that check). JetMoE is refused by name since session 32 (a mixture of attention heads:
    tests/test_refused_families.py); without that entry the operations are still named. DeepSeek-V4 has a table entry
    since session 39 (tests/test_deepseek_v4.py): without it, discovery names the operations as before."""
    from headlab.adapters import families

    monkeypatch.delitem(families.UNSUPPORTED, model_type, raising=False)
    monkeypatch.delitem(families.FAMILIES, model_type, raising=False)
    sizes, pattern = OPERATIONS_NAMED[model_type]
    config = tf.AutoConfig.for_model(model_type, **{**_GQA, **sizes})
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(config)  # JetMoE's routing reads values: not on the meta device
    with pytest.raises(HeadlabError, match=pattern):
        attention_blocks(model)


# Forwards that read values the meta device does not have (transformers' create_recurrent_attention_mask of the hybrids'
# linear layers tests torch.all(mask == 1); JetMoE's routing takes expert sizes .tolist()): the probe of the structure
# built from the config runs again on zeros.
VALUE_READING = {
    "lfm2": dict(layer_types=["conv", "full_attention"]),
    "falcon_h1": dict(mamba_d_ssm=32, mamba_n_heads=4, mamba_d_head=8, mamba_d_state=8, mamba_chunk_size=4),
    "minimax": dict(intermediate_size=40, layer_types=["full_attention", "linear_attention"], num_local_experts=2,
                    num_experts_per_tok=1),
    "jetmoe": dict(num_local_experts=4, num_experts_per_tok=2, kv_channels=8),
    "bailing_hybrid": {},
}


def _outcome(model) -> list | str:
    try:
        return [(b.name, b.n_heads, b.n_kv_heads, b.d_head, b.family.name) for b in attention_blocks(model)]
    except HeadlabError as error:
        return str(error)


@pytest.mark.parametrize("model_type", VALUE_READING)
def test_a_structure_whose_forward_reads_values_gives_the_loaded_models_blocks(model_type):
    """What every command checks before any work (the structure, on the meta device) is what the loaded model gives:
    before, these families' probe failed on the meta device and the structure got the name-based blocks
    ("generic:lfm2" where the loaded model's are "discovered:lfm2"), or a refusal naming the meta device where the
    loaded model's names what is missing (JetMoE), or blocks where the loaded model is refused (Bailing-hybrid's
    linear-attention layers: refused only after the weights were read)."""
    config = tf.AutoConfig.for_model(model_type, **{**_GQA, **VALUE_READING[model_type]})
    with torch.device("meta"):
        structure = tf.AutoModelForCausalLM.from_config(config)
    torch.manual_seed(0)
    loaded = _outcome(tf.AutoModelForCausalLM.from_config(config))
    assert _outcome(structure) == loaded
    assert all(t.is_meta for t in (*structure.parameters(), *structure.buffers()))
