"""Tiny random models of the families LRP's normalisation rules were written for, beyond
tests/support/models.py: OLMo's parameter-free LayerNorm, Gemma's ``x * (1 + w)`` RMS norms,
mT5's LayerNorm (an RMS norm), and families whose norms are plain (Mistral, OLMo2, Qwen3,
StableLM, GPT-J, OPT), and mixtures of experts (Mixtral, Qwen2-MoE with its gated shared expert,
Qwen3-MoE, Inkling with its shared experts scaled by the router's gammas). Built from configs (hidden 32, 2 layers
(Inkling 3), 4 heads, vocab 99): no downloads.

Besides (not in ``FAMILIES``): Gemma 4's and Gemma 3n's text models with per-layer inputs (:func:`gemma4_text`,
:func:`gemma3n_text`, built by :func:`per_layer_model`), :func:`lrp_data`, and the checks
tests/test_lrp_per_layer_inputs.py and tests/test_lrp_altup.py share: the rules leave the forward unchanged, every
strategy gives vmap's shares, compute_lrp refuses a model whose input a pre-hook changed."""

from __future__ import annotations

import torch
import transformers as tf

from support.models import VOCAB

_DECODER = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=37, num_hidden_layers=2, num_attention_heads=4,
                max_position_embeddings=64, bos_token_id=0, eos_token_id=1, pad_token_id=2)

INKLING = dict(_DECODER, intermediate_size=40, num_hidden_layers=3, num_key_value_heads=2, head_dim=8,
               swa_num_attention_heads=4, swa_num_key_value_heads=2, swa_head_dim=8, d_rel=6, rel_extent=16,
               sliding_window_size=4, log_scaling_n_floor=2, n_routed_experts=4, num_experts_per_tok=2,
               n_shared_experts=2, moe_intermediate_size=16, layer_types=["hybrid_sliding", "hybrid", "hybrid_sliding"],
               mlp_layer_types=["sparse", "dense", "sparse"])

CONFIGS = {
    "olmo": lambda: (tf.OlmoForCausalLM, tf.OlmoConfig(**_DECODER, num_key_value_heads=4)),
    "olmo2": lambda: (tf.Olmo2ForCausalLM, tf.Olmo2Config(**_DECODER, num_key_value_heads=2)),
    "mistral": lambda: (tf.MistralForCausalLM, tf.MistralConfig(**_DECODER, num_key_value_heads=2)),
    "qwen3": lambda: (tf.Qwen3ForCausalLM, tf.Qwen3Config(**_DECODER, num_key_value_heads=2, head_dim=8)),
    "gemma": lambda: (tf.GemmaForCausalLM, tf.GemmaConfig(**_DECODER, num_key_value_heads=2, head_dim=8)),
    "gemma2": lambda: (tf.Gemma2ForCausalLM, tf.Gemma2Config(**_DECODER, num_key_value_heads=2, head_dim=8)),
    "gemma3": lambda: (tf.Gemma3ForCausalLM, tf.Gemma3TextConfig(**_DECODER, num_key_value_heads=2, head_dim=8)),
    "stablelm": lambda: (tf.StableLmForCausalLM, tf.StableLmConfig(**_DECODER, num_key_value_heads=4,
                                                                  use_qkv_bias=True)),
    "gptj": lambda: (tf.GPTJForCausalLM, tf.GPTJConfig(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64,
                                                       rotary_dim=4, bos_token_id=0, eos_token_id=1)),
    "opt": lambda: (tf.OPTForCausalLM, tf.OPTConfig(vocab_size=VOCAB, hidden_size=32, ffn_dim=37, num_hidden_layers=2,
                                                    num_attention_heads=4, max_position_embeddings=64,
                                                    word_embed_proj_dim=32, pad_token_id=2)),
    # mixtures of experts (intermediate 40: torch's grouped matmul wants rows of a multiple of 16 bytes)
    "mixtral": lambda: (tf.MixtralForCausalLM, tf.MixtralConfig(**{**_DECODER, "intermediate_size": 40},
                                                                 num_key_value_heads=2, num_local_experts=3,
                                                                 num_experts_per_tok=2)),
    "qwen2_moe": lambda: (tf.Qwen2MoeForCausalLM, tf.Qwen2MoeConfig(
        **_DECODER, num_key_value_heads=2, num_experts=3, num_experts_per_tok=2, moe_intermediate_size=40,
        shared_expert_intermediate_size=40)),
    "qwen3_moe": lambda: (tf.Qwen3MoeForCausalLM, tf.Qwen3MoeConfig(
        **_DECODER, num_key_value_heads=2, head_dim=8, num_experts=3, num_experts_per_tok=2,
        moe_intermediate_size=40, norm_topk_prob=True)),
    # Inkling: relative-position logits in the scores, short convolutions, routed and shared experts (a sliding layer
    # with experts, a full one with log scaling and a dense MLP, a sliding one with experts)
    "inkling": lambda: (tf.InklingForCausalLM, tf.InklingTextConfig(**INKLING)),
    "mt5": lambda: (tf.MT5ForConditionalGeneration, tf.MT5Config(
        vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=37, num_layers=2, num_heads=4, pad_token_id=0, eos_token_id=1,
        decoder_start_token_id=0)),
}
FAMILIES = tuple(CONFIGS)


def tiny_lrp_model(family: str, seed: int = 0, *, biases: bool = True, dtype: torch.dtype = torch.float32,
                   **config_values):
    """A tiny random ``family`` model in eval mode. transformers initialises norm weights to one
    (zero for Gemma's ``1 + w``) and biases to zero: both are drawn at random here, so that a rule
    that ignores a weight or a bias is visible. ``config_values`` override the config's."""
    cls, config = CONFIGS[family]()
    for name, value in config_values.items():
        setattr(config, name, value)
    torch.manual_seed(seed)
    model = cls(config).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("bias"):
                parameter.normal_(0, 0.1) if biases else parameter.zero_()
            elif "norm" in name and name.endswith("weight"):
                parameter.uniform_(0.5, 1.5)
    return model.to(dtype)


# -- Gemma 4's and Gemma 3n's per-layer inputs (and Gemma 3n's AltUp), and the checks their LRP test files share
# (tests/test_lrp_per_layer_inputs.py, tests/test_lrp_altup.py)

_GQA = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=37, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, max_position_embeddings=64, bos_token_id=0, eos_token_id=1,
            pad_token_id=2)
_PER_LAYER = dict(hidden_size_per_layer_input=8, vocab_size_per_layer_input=VOCAB)


def gemma4_text(**values):
    """Gemma 4's text model with per-layer inputs (a sliding layer, then a full one); ``values`` override."""
    return tf.Gemma4ForCausalLM, tf.Gemma4TextConfig(**{
        **_GQA, "layer_types": ["sliding_attention", "full_attention"], "sliding_window": 4, "global_head_dim": 8,
        **_PER_LAYER, **values})


def gemma3n_text(**values):
    """Gemma 3n's text model: per-layer inputs, two AltUp streams, no activation sparsity unless ``values`` say."""
    return tf.Gemma3nForCausalLM, tf.Gemma3nTextConfig(
        **{**_GQA, "intermediate_size": [37, 37]}, layer_types=["sliding_attention", "full_attention"],
        num_kv_shared_layers=0, laurel_rank=4, **_PER_LAYER,
        **{"activation_sparsity_pattern": [0.0, 0.0], "altup_num_inputs": 2, **values})


def per_layer_model(build, dtype=torch.float32, **values) -> torch.nn.Module:
    """``build(**values)``'s model, eager, in eval mode from seed 0, in ``dtype``."""
    cls, config = build(**values)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = cls(config).eval().to(dtype)
    with torch.no_grad():  # off their initial values (norm weights one), so that a rule ignoring them shows
        for name, parameter in model.named_parameters():
            if "norm" in name.lower() and name.endswith("weight"):
                parameter.uniform_(0.5, 1.5)
    return model


def lrp_data(model, n=4, longest=8):
    """``n`` sentences of 3 to ``longest`` random ids and an end of sentence (id 1), and ``model``'s description."""
    from headlab.importance import ImportanceData, describe_model

    info = describe_model(model)
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(3, longest + 1, (n,), generator=g).tolist()
    return ImportanceData.from_ids([torch.randint(4, 99, (k,), generator=g).tolist() + [1] for k in lengths]), info


def offset_biases_and_norms(model, *, biases: bool = True) -> None:
    """Biases drawn from N(0, 0.1) (``biases``) and norm weights from U(0.5, 1.5), in place: transformers initialises
    them to zero and one, where a rule that ignores them would not show."""
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("bias"):
                if biases:
                    parameter.normal_(0, 0.1)
            elif "norm" in name.lower() and name.endswith("weight"):
                parameter.uniform_(0.5, 1.5)


def assert_conserved(model, tolerance: float, *, longest: int = 8) -> dict:
    """compute_lrp's conservation record on :func:`lrp_data`'s four sentences: every sentence explained, none outside
    the pipeline's tolerance, and the embeddings plus the biases' shares within ``tolerance`` of the explained logit;
    the record back."""
    from headlab.importance import compute_lrp

    data, info = lrp_data(model, longest=longest)
    record = compute_lrp(model, data, info, bootstrap=0).signature["conservation"]
    assert record["n_sentences"] == len(data) and record["n_outside"] == 0, record
    total = record["with_biases"]
    assert abs(total["min"] - 1) < tolerance and abs(total["max"] - 1) < tolerance, total
    return record


def check_probed_widened_and_left_as_it_was(model) -> None:
    """A half-precision ``model``: check_rules' probes (run widened) leave every parameter and buffer as it was, bit for
    bit and in its type, and LRP conserves (to 1e-6: computed widened)."""
    from headlab.importance.rules import check_rules

    before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    check_rules(model)
    after = model.state_dict()
    assert all(after[name].dtype == tensor.dtype and torch.equal(after[name], tensor) for name, tensor in before.items())
    assert_conserved(model, 1e-6)


def check_rules_leave_the_forward_unchanged(model, *, padded: bool = False) -> None:
    """Under lrp_rules (with gradients), the logits of two rows of random ids are the plain forward's, bit for bit
    (with ``padded``, the first row's first two tokens padding)."""
    from headlab.capture import eager_attention
    from headlab.importance import lrp_rules

    ids = torch.randint(4, 99, (2, 7), generator=torch.Generator().manual_seed(1))
    inputs = {"input_ids": ids}
    if padded:
        inputs["attention_mask"] = torch.ones_like(ids)
        inputs["attention_mask"][0, :2] = 0
    with torch.no_grad(), eager_attention(model):
        before = model(**inputs).logits
    with torch.enable_grad(), eager_attention(model), lrp_rules(model):
        during = model(**inputs).logits
    assert torch.equal(during.detach(), before)


def check_mixer_rule_written_out(model, mixer, reference, *, rtol: float, atol: float, forward_atol: float,
                                 conserved: float) -> None:
    """A float64 ``model`` run under lrp_rules on one sentence: the relevance of ``mixer``'s input for a random weighting
    ``w`` of its output (gradient x input) is that of ``reference(mixer, x)``, the rule written out by hand (every
    factor computed from the input held constant), to ``rtol`` / ``atol``; the reference computes the mixer's forward
    (to ``rtol`` / ``forward_atol``), and the relevance sums to ``w . y`` within ``conserved`` (the rule is bias-free)."""
    from headlab.importance import lrp_rules
    from headlab.importance.lrp import _KeptWide

    seen = {}
    handle = mixer.register_forward_hook(lambda m, args, kwargs, out: seen.update(
        x=kwargs.get("hidden_states", args[0] if args else None), y=out), with_kwargs=True)
    ids = torch.tensor([[5, 17, 33, 8, 61, 4, 9, 12, 40]])
    try:
        with torch.enable_grad(), lrp_rules(model), _KeptWide(torch.float64):
            model(input_ids=ids, use_cache=False)
    finally:
        handle.remove()
    x, y = seen["x"], seen["y"]
    w = torch.randn(y.shape, generator=torch.Generator().manual_seed(3), dtype=y.dtype)
    grad, = torch.autograd.grad((y * w).sum(), x)
    relevance = x.detach() * grad
    x_ref = x.detach().requires_grad_(True)
    with torch.enable_grad():
        y_ref = reference(mixer, x_ref)
        grad_ref, = torch.autograd.grad((y_ref * w).sum(), x_ref)
    torch.testing.assert_close(y_ref.detach(), y.detach(), rtol=rtol, atol=forward_atol)  # the same forward
    torch.testing.assert_close(relevance, x_ref.detach() * grad_ref, rtol=rtol, atol=atol)
    assert abs(float(relevance.sum() - (y * w).sum().detach())) < conserved  # and it conserves, bias-free


def check_strategies_agree(model, data, info, strategy: str) -> None:
    """head_relevance by ``strategy`` on the first batch of 2 gives vmap's shares (embedding, biases, per-layer
    embedding, every head's relevance) to rtol 1e-9, atol 1e-12."""
    from headlab.data.inputs import make_batches
    from headlab.importance.lrp import head_relevance

    batch = next(iter(make_batches(data, info, batch_size=2, side="translation", device=torch.device("cpu"))))
    vmap, other = head_relevance(model, batch), head_relevance(model, batch, strategy=strategy)
    for name in ("embedding", "biases", "per_layer_embedding"):
        torch.testing.assert_close(getattr(other, name), getattr(vmap, name), rtol=1e-9, atol=1e-12)
    for key, values in vmap.relevance.items():
        torch.testing.assert_close(other.relevance[key], values, rtol=1e-9, atol=1e-12)


def check_lrp_refused_before_any_work(model, match: str, *, longest: int = 8) -> None:
    """compute_lrp on :func:`lrp_data`'s sentences raises a HeadlabError matching ``match`` before any forward of
    ``model`` on them: every forward it ran is a probe (discovery's, the rules' checks: token ids all 0), nothing
    explained."""
    import pytest

    from headlab import HeadlabError
    from headlab.importance import compute_lrp

    seen: list = []  # the input ids of every forward
    handle = model.register_forward_pre_hook(lambda module, args, kwargs: seen.append(kwargs.get("input_ids")),
                                             with_kwargs=True)
    try:
        with pytest.raises(HeadlabError, match=match):
            compute_lrp(model, *lrp_data(model, longest=longest), bootstrap=0)
    finally:
        handle.remove()
    assert seen and all(ids is not None and not ids.any() for ids in seen), seen  # probes only


def check_lrp_refused_under_pre_hook(model, module: torch.nn.Module, hook, match: str, *, n: int = 4,
                                     **hook_options) -> None:
    """With ``hook`` a forward pre-hook of ``module`` (``hook_options``: register_forward_pre_hook's; it is removed
    after), compute_lrp on :func:`lrp_data`'s ``n`` sentences raises a HeadlabError matching ``match``."""
    import pytest

    from headlab import HeadlabError
    from headlab.importance import compute_lrp

    data, info = lrp_data(model, n)
    handle = module.register_forward_pre_hook(hook, **hook_options)
    try:
        with pytest.raises(HeadlabError, match=match):
            compute_lrp(model, data, info, bootstrap=0)
    finally:
        handle.remove()
