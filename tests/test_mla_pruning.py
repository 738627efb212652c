"""Physical pruning of multi-head latent attention (DeepSeek-V2, DeepSeek-V3 with and without a query
latent, Sarvam-MLA, GLM-4-MoE-Lite, MiniCPM3, DeepSeek-V3.2 and GLM-MoE-DSA with their indexers; Mistral 4,
Youtu, A.X-K1 and Kimi Linear's attention layers; Mistral Large 4, per-head query scaling and latents shared across
layers; LongCat-Flash in tests/test_longcat_flash.py).

transformers' MLA (``DeepseekV3Attention.forward``): the query projection (``q_b_proj`` after
``q_a_proj`` and ``q_a_layernorm``, or ``q_proj`` when ``q_lora_rank`` is None) is viewed
``[batch, seq, -1, nope + rope]``; ``kv_a_proj_with_mqa`` emits the key/value latent and ONE rotary key
for all heads; ``kv_b_proj`` reads the latent and is viewed ``[batch, seq, -1, nope + v]``, split
``[k_nope | v]``; ``o_proj`` reads ``v`` per head. The head count is read off the widths (``-1``), and
the cache holds the latents, not the heads. So removing head h removes its rows of the query
projection and of ``kv_b_proj`` and its columns of ``o_proj``; the latents, the rotary key, the norms
and the indexer stay (``Family.head_rows``, ``adapters.families.LATENT_ATTENTION``).

Before this, pruning was refused ("projection layout is unknown"). Here, on tiny models: pruning
slices exactly those rows (the weights compared with the originals, read off the modeling code),
equals masking on padded rows and in cached generation, empties a layer (GLM-MoE-DSA's stand-in still
hands the next "shared" layer its indexer's selection; Mistral Large 4's still stores the latents later layers
reuse), reloads with ``load_pruned`` and plain
transformers (remote code), passes ``headlab prune`` on the command line; gates at one change
nothing on the pruned model; LRP conserves on it (tests/test_lrp_latent_attention.py: LRP through MLA).
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
import transformers as tf
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

from headlab import (
    HeadlabError,
    ScalarGates,
    attention_blocks,
    capture_attention,
    gates_attached,
    load_pruned,
    mask_heads,
    prune_heads,
    save_pruned,
)
from headlab.adapters.families import OUTPUT_GATES
from headlab.checkpoint import model_class_for
from support.family_matrix import (
    check_gates_at_one_change_nothing,
    check_pruned_generates_as_masked,
    greedy_generation,
    padded_inputs,
    padded_logits,
    perturbed_model,
    tiny_inputs,
)
from support.lrp_families import assert_conserved

NOPE, ROPE, V = 4, 4, 8  # per head: queries and keys [nope | rope], values of 8
_SIZES = dict(vocab_size=99, hidden_size=32, intermediate_size=40, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=4, max_position_embeddings=64, bos_token_id=0, eos_token_id=1, pad_token_id=2,
              q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=NOPE, qk_rope_head_dim=ROPE, v_head_dim=V,
              first_k_dense_replace=1, moe_intermediate_size=40, n_routed_experts=4, num_experts_per_tok=2,
              n_shared_experts=1, n_group=1, topk_group=1)
_INDEXER = dict(index_topk=3, index_n_heads=2, index_head_dim=8)  # 3 keys of up to 11: the selection counts
CONFIGS = {
    "deepseek_v2": {},
    "deepseek_v3": {},
    "deepseek_v3-no-q-latent": {"q_lora_rank": None},  # q_proj instead of q_a_proj -> q_b_proj
    "sarvam_mla": {},
    "glm4_moe_lite": {},
    "minicpm3": {},
    "deepseek_v32": _INDEXER,
    "glm_moe_dsa": _INDEXER,
    # layer 1 attends to layer 0's selection (no indexer of its own), handed on by layer 0's forward
    "glm_moe_dsa-shared": {**_INDEXER, "indexer_types": ["full", "shared"]},
    # session 25 (fam10): the same layout read off their forwards (LongCat-Flash: tests/test_longcat_flash.py)
    "mistral4": {},
    "mistral4-no-q-latent": {"q_lora_rank": None},
    # session 26 (fam12): Mistral 4's queries times 1 + beta * log(1 + floor(position / original_max_position_embeddings))
    # (get_llama_4_attn_scale), active: at its default window (8192) every position of a test is below it and the factor
    # is 1; here it is 2, so positions 2.. of the probe, the padded rows and cached generation are scaled, by beta = 1
    # (at weights of std 0.1, which the scale moves by up to 0.85 in the logits: test_the_llama_4_scaling_is_active)
    "mistral4-llama4-scaling": {"initializer_range": 0.1, "rope_parameters": {
        "type": "yarn", "rope_theta": 10000.0, "factor": 32.0, "original_max_position_embeddings": 2,
        "max_position_embeddings": 64, "beta_fast": 32.0, "beta_slow": 1.0, "mscale_all_dim": 1.0, "mscale": 1.0,
        "llama_4_scaling_beta": 1.0}},
    "youtu": {},
    "axk1": {},
    "kimi_linear": {"layer_types": ["full_attention", "full_attention"], "num_local_experts": 4},
    # session 25 (fam11): an output gate sigmoid(g) per head before o_proj (tests/test_output_gates.py):
    # Bailing-hybrid's MLA layers and dots3-note's text model (g_proj, a row per head), A.X-K2 (q_gate_proj:
    # per head [query | gate], no q_b_proj)
    "bailing_hybrid": {"layer_types": ["full_attention", "full_attention"]},
    "dots3_note_text": _INDEXER,
    "axk2": _INDEXER,
}
FAMILIES = tuple(CONFIGS)
# not in AutoModelForCausalLM's table (a config naming no class builds the bare model; a directory saved from it
# names it in architectures and loads as it, tests/test_saved_class.py)
CLASSES = {"mistral4": "Mistral4ForCausalLM"}


def tiny_model(family: str, seed: int = 0) -> torch.nn.Module:
    model_type = family.split("-")[0]
    if model_type not in CONFIG_MAPPING:
        pytest.skip(f"this transformers has no {model_type}")
    config = CONFIG_MAPPING[model_type](**copy.deepcopy({**_SIZES, **CONFIGS[family]}))
    cls = getattr(tf, CLASSES[model_type]) if model_type in CLASSES else model_class_for(config)
    return perturbed_model(cls, config, seed)


def _query(attention) -> torch.nn.Linear:
    return attention.q_proj if attention.q_b_proj is None else attention.q_b_proj


UNGATED = tuple(f for f in FAMILIES if f.split("-")[0] not in OUTPUT_GATES)  # gated: tests/test_output_gates.py


@pytest.mark.parametrize("family", UNGATED)
def test_pruning_slices_each_heads_rows_and_leaves_what_heads_share(family):
    """Head h owns rows h*(nope+rope).. of the query projection, h*(nope+v).. of kv_b_proj, columns h*v.. of
    o_proj (the modeling code's views); the latent projections, norms and indexer are untouched."""
    model = tiny_model(family)
    attention = model.model.layers[1].self_attn
    before = {name: p.clone() for name, p in attention.named_parameters()}
    query_name = "q_proj" if attention.q_b_proj is None else "q_b_proj"
    assert prune_heads(model, {("dec_self", 1): [0, 2]}) == {("dec_self", 1): [1, 3]}
    rows = lambda width: [r for h in (1, 3) for r in range(h * width, (h + 1) * width)]  # noqa: E731
    assert torch.equal(_query(attention).weight, before[f"{query_name}.weight"][rows(NOPE + ROPE)])
    assert torch.equal(attention.kv_b_proj.weight, before["kv_b_proj.weight"][rows(NOPE + V)])
    assert torch.equal(attention.o_proj.weight, before["o_proj.weight"][:, rows(V)])
    sliced = {f"{query_name}.weight", "kv_b_proj.weight", "o_proj.weight"}
    for name, parameter in attention.named_parameters():
        if name not in sliced:
            assert torch.equal(parameter, before[name]), name
    blocks = attention_blocks(model)
    assert [(b.n_heads, b.n_kv_heads, b.d_head) for b in blocks] == [(4, 4, V), (2, 2, V)]


SPECS = {
    "some heads": ({("dec_self", 0): [1], ("dec_self", 1): [0, 2]}, [3, 2]),
    "no head left": ({("dec_self", 0): [0, 1, 2, 3], ("dec_self", 1): [3]}, [0, 3]),
}


@pytest.mark.parametrize("spec_name", SPECS)
@pytest.mark.parametrize("family", FAMILIES)
def test_pruning_equals_masking_generates_and_reloads(family, spec_name, tmp_path):
    spec, heads_left = SPECS[spec_name]
    model = tiny_model(family)
    ids, mask = padded_inputs(pad_id=2)
    expected, _ = check_pruned_generates_as_masked(model, spec, heads_left, ids, mask, atol=1e-5)
    check_gates_at_one_change_nothing(model, tiny_inputs())

    save_pruned(model, tmp_path)
    record = json.loads((tmp_path / "headlab_pruning.json").read_text())
    assert {layer: entry["kept_heads"] for layer, entry in record["blocks"]["dec_self"].items()} == {
        str(layer): [h for h in range(4) if h not in removed] for (_, layer), removed in spec.items()}
    reloaded = load_pruned(tmp_path)
    assert [b.n_heads for b in attention_blocks(reloaded)] == heads_left
    assert torch.equal(padded_logits(reloaded, ids, mask), padded_logits(model, ids, mask))
    assert record["portable"]["how"] == "remote code"
    model_type = family.split("-")[0]
    auto = tf.AutoModel if model_type in CLASSES else tf.AutoModelForCausalLM  # config.json's auto_map
    # every weight loaded (A.X-K1's post_mlp_layernorm was left newly initialised: tests/test_portable_conversions.py)
    plain, info = auto.from_pretrained(tmp_path, trust_remote_code=True, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    plain.eval()
    torch.testing.assert_close(padded_logits(plain, ids, mask), expected, atol=1e-5, rtol=0)


def test_the_llama_4_scaling_is_active():
    """The scaled configuration's logits differ from the same model's with beta = 0 (the factor 1 everywhere), on
    the padded rows and in cached generation: what prune == mask and the reloads above compare is scaled."""
    model = tiny_model("mistral4-llama4-scaling")
    ids, mask = padded_inputs(pad_id=2)
    scaled, (_, scaled_scores) = padded_logits(model, ids, mask), greedy_generation(model, ids, mask)
    model.config.rope_parameters["llama_4_scaling_beta"] = 0.0  # the forward reads it at each call
    assert (padded_logits(model, ids, mask) - scaled).abs().max() > 0.1
    assert (greedy_generation(model, ids, mask)[1] - scaled_scores).abs().max() > 0.1


SCALED = {"mistral4-llama4-scaling": "query scale per position (llama_4_scaling_beta)",
          "mistral_large4_text": "query scale and bias per head (softmax_scaling)"}


def scaled_model(family: str, attn_implementation: str = "sdpa") -> torch.nn.Module:
    """Mistral 4 with its llama-4 scaling active, or Mistral Large 4's text model (analysed and masked, pruning
    refused) with its per-head softmax_scaling off its initial identity (scale 0, bias 1): heads scaled apart."""
    if family.startswith("mistral4"):
        model = tiny_model(family)
    else:
        if family not in CONFIG_MAPPING:
            pytest.skip(f"this transformers has no {family}")
        config = CONFIG_MAPPING[family](**{**_SIZES, **_INDEXER, "initializer_range": 0.1})
        model = perturbed_model(model_class_for(config), config)
        with torch.no_grad():
            for layer in _layers(model):
                layer.self_attn.softmax_scaling.scale.copy_(torch.tensor([0.0, 1.0, -0.3, 2.0]))
                layer.self_attn.softmax_scaling.bias.copy_(torch.tensor([1.0, 0.5, 2.0, 1.5]))
    model.config._attn_implementation = attn_implementation
    return model


def _unscaled(model) -> None:
    """The scaling made the identity: beta = 0 (Mistral 4), scale 0 and bias 1 per head (Mistral Large 4)."""
    if "llama_4_scaling_beta" in model.config.rope_parameters:
        model.config.rope_parameters["llama_4_scaling_beta"] = 0.0
    for layer in _layers(model):
        if hasattr(layer.self_attn, "softmax_scaling"):
            with torch.no_grad():
                layer.self_attn.softmax_scaling.scale.zero_()
                layer.self_attn.softmax_scaling.bias.fill_(1.0)


def _layers(model) -> torch.nn.ModuleList:
    return model.model.layers if hasattr(model, "model") else model.layers


def _output(model, inputs: dict, **kwargs):
    with torch.no_grad():
        out = model(**inputs, **kwargs)
    return out, out.logits if hasattr(out, "logits") else out.last_hidden_state


@pytest.mark.parametrize("family", SCALED)
def test_scaled_queries_capture_and_masking(family):
    """With the queries scaled (per position, or per head) before the attention function: capture equals
    transformers' own output_attentions (eager), masking head j of layer 1 equals zeroing its value rows of kv_b_proj
    (rows j*(nope+v)+nope ..), scalar gates at one change nothing, and the scaling changes the result."""
    inputs = tiny_inputs()
    eager, _ = _output(scaled_model(family, "eager"), inputs, output_attentions=True)
    model = scaled_model(family)
    with capture_attention(model) as record:
        _output(model, inputs)
    before = _output(model, inputs)[1]
    assert sorted(record) == [("dec_self", 0), ("dec_self", 1)]
    for (_, layer), probs in record.items():
        torch.testing.assert_close(probs, eager.attentions[layer], atol=1e-6, rtol=0)
    for head in range(4):
        with mask_heads(model, {("dec_self", 1): [head]}):
            masked = _output(model, inputs)[1]
        zeroed = scaled_model(family)
        rows = torch.arange(head * (NOPE + V) + NOPE, (head + 1) * (NOPE + V))
        with torch.no_grad():
            _layers(zeroed)[1].self_attn.kv_b_proj.weight[rows] = 0
        torch.testing.assert_close(masked, _output(zeroed, inputs)[1], atol=1e-6, rtol=0)
        assert not torch.allclose(masked, before)
    with gates_attached(model, ScalarGates.for_model(model)):
        assert torch.equal(_output(model, inputs)[1], before)
    _unscaled(model)
    assert (_output(model, inputs)[1] - before).abs().max() > 0.05


def test_an_emptied_layer_hands_the_next_its_indexer_selection():
    """GLM-MoE-DSA's layer 0 returns its indexer's top-k keys, which layer 1 ("shared", no indexer of its
    own) attends to. The indexer reads the layer's input and the query latent, not the heads: emptied,
    the layer still hands on the keys the full layer picks. Regression: its stand-in returned two values
    where the decoder layer unpacks three, and no selection for layer 1 (transformers raises)."""
    model = tiny_model("glm_moe_dsa-shared")
    attention_blocks(model)  # the probe pass before the hook
    given: list[torch.Tensor] = []
    model.model.layers[1].self_attn.register_forward_pre_hook(
        lambda module, args, kwargs: given.append(kwargs["prev_topk_indices"]), with_kwargs=True)
    ids, mask = padded_inputs(pad_id=2)
    padded_logits(model, ids, mask)
    prune_heads(model, {("dec_self", 0): [0, 1, 2, 3]})
    given.clear()
    padded_logits(model, ids, mask)
    assert type(model.model.layers[0].self_attn).__name__ == "ZeroHeadAttention"
    assert len(given) == 1 and given[0] is not None
    full = tiny_model("glm_moe_dsa-shared")
    expected: list[torch.Tensor] = []
    full.model.layers[1].self_attn.register_forward_pre_hook(
        lambda module, args, kwargs: expected.append(kwargs["prev_topk_indices"]), with_kwargs=True)
    padded_logits(full, ids, mask)
    assert torch.equal(given[0], expected[0])


def test_prune_on_the_command_line(tmp_path, capsys):
    """`headlab prune` checks the layout before loading, prunes, checks itself and writes the directory."""
    from headlab.cli import main
    from support.family_matrix import save_tiny

    save_tiny(tiny_model("deepseek_v3"), tmp_path / "mla", ["the", "cat", "sat"])
    code = main(["prune", str(tmp_path / "mla"), "--heads", "dec_self:1:0,2", "--out", str(tmp_path / "out")])
    assert code == 0, capsys.readouterr().err
    record = json.loads((tmp_path / "out" / "headlab_pruning.json").read_text())
    assert record["blocks"] == {"dec_self": {"1": {"n_heads": 4, "kept_heads": [1, 3], "kept_kv_heads": [1, 3]}}}
    assert [b.n_heads for b in attention_blocks(load_pruned(tmp_path / "out"))] == [4, 2]


def test_resaved_by_transformers_without_record_reads_the_heads_off_the_weights(tmp_path):
    """A pruned directory re-saved by plain transformers (no headlab_pruning.json): the heads left are read off
    o_proj's width (each head its own key and value); before, the layer was skipped and loading refused."""
    from headlab.loading import load_model

    model = tiny_model("deepseek_v3")
    prune_heads(model, {("dec_self", 0): [0, 1, 2, 3], ("dec_self", 1): [1]})
    save_pruned(model, tmp_path / "pruned")
    tf.AutoModelForCausalLM.from_pretrained(tmp_path / "pruned", trust_remote_code=True).save_pretrained(
        tmp_path / "resaved")
    loaded = load_model(str(tmp_path / "resaved"))
    assert [(b.n_heads, b.n_kv_heads) for b in attention_blocks(loaded)] == [(0, 0), (3, 3)]
    ids, mask = padded_inputs(pad_id=2)
    torch.testing.assert_close(padded_logits(loaded, ids, mask), padded_logits(model, ids, mask), atol=1e-6, rtol=0)


def test_a_layer_with_no_head_loaded_without_headlab_is_refused_not_dropped(tmp_path):
    """Plain transformers' copy of an emptied layer (NoHeadAttention) knows no original numbering: refused as
    for the other families. Before, the layer was left out of the blocks without a word."""
    model = tiny_model("deepseek_v3")
    prune_heads(model, {("dec_self", 0): [0, 1, 2, 3]})
    save_pruned(model, tmp_path)
    plain = tf.AutoModelForCausalLM.from_pretrained(tmp_path, trust_remote_code=True)
    with pytest.raises(HeadlabError, match=r"model\.layers\.0\.self_attn .*a layer pruned by headlab, loaded without "
                                           "headlab"):
        attention_blocks(plain)


@pytest.mark.parametrize("family", ["deepseek_v3", "glm_moe_dsa", "axk2"])
def test_lrp_conserves_on_the_pruned_model(family):
    """LRP's rule for latent attention (tests/test_lrp_latent_attention.py) reads the heads left: on the pruned model
    (kv_b_proj of 3 heads x (nope + v) rows) bias-free in float64 the relevance reaching the first layer is the
    explained logit. Before: refused, naming the latent attention, before and after pruning (A.X-K2: then for its
    gated norm, until session 29)."""
    from support.family_matrix import check_lrp_conserves

    model = tiny_model(family)
    prune_heads(model, {("dec_self", 0): [1]})  # in float32: its check runs the experts' grouped matmuls
    model.double()
    assert model.model.layers[0].self_attn.kv_b_proj.out_features == 3 * (NOPE + V)
    check_lrp_conserves(model, model.model.layers[0])


def test_a_latent_projection_of_another_width_is_refused():
    """A kv_b_proj that does not hold the output projection's heads x (nope + v) rows: refused, naming it."""
    model = tiny_model("deepseek_v3")
    attention_blocks(model)  # the probe pass (which such a model would fail), kept while the blocks stay
    attention = model.model.layers[0].self_attn
    attention.kv_b_proj = torch.nn.Linear(16, 4 * (NOPE + V) + 1, bias=False)
    with pytest.raises(HeadlabError, match=r"kv_b_proj emits 49 features, not the output projection's 4 heads x 12"):
        attention_blocks(model)


# Mistral Large 4 (session 26, fam13): its text attention (MistralLarge4TextAttention) has no query latent (q_proj viewed
# [batch, seq, -1, nope + rope]), scales each head's queries by scale[h] * log(position + 1) + bias[h]
# (softmax_scaling, one entry per head) and lets a layer read an earlier layer's latents (kv_source_layers). Here four
# layers: 0 and 2 store their latents (rotary and NoPE), 1 and 3 reuse them (3 with an indexer of its own, 1 attending
# to layer 0's selection), every scale and bias off its identity (scale 0, bias 1) and apart per head.
_LARGE4 = dict(num_hidden_layers=4, initializer_range=0.1, kv_source_layers=[0, 0, 2, 2], no_rope_layers=[1, 1, 0, 0],
               indexer_types=["full", "shared", "full", "full"], **_INDEXER)
_SCALE, _BIAS = torch.tensor([0.0, 1.0, -0.3, 2.0]), torch.tensor([1.0, 0.5, 2.0, 1.5])


def mistral_large4(wrapper: bool = True) -> torch.nn.Module:
    """MistralLarge4ForConditionalGeneration (the released checkpoints' class; transformers 5.24 has no causal LM of the
    text model) with a one-layer vision tower, or its text model alone (MistralLarge4TextModel, no LM head)."""
    if "mistral_large4" not in CONFIG_MAPPING:
        pytest.skip("this transformers has no mistral_large4")
    text = CONFIG_MAPPING["mistral_large4_text"](**{**_SIZES, **_LARGE4})
    assert text.kv_sharing_modes == ["store", "reuse", "store", "reuse_but_indexer"]
    if wrapper:
        config = CONFIG_MAPPING["mistral_large4"](text_config=text.to_dict(), vision_config=dict(
            hidden_size=16, intermediate_size=20, num_hidden_layers=1, num_attention_heads=2, image_size=28,
            patch_size=14))
        model = perturbed_model(tf.MistralLarge4ForConditionalGeneration, config)
    else:
        model = perturbed_model(tf.MistralLarge4TextModel, text)
    with torch.no_grad():
        for layer in _large4_layers(model):
            layer.self_attn.softmax_scaling.scale.copy_(_SCALE)
            layer.self_attn.softmax_scaling.bias.copy_(_BIAS)
    return model


def _large4_layers(model) -> torch.nn.ModuleList:
    return model.model.language_model.layers if hasattr(model, "model") else model.layers


def _text_blocks(model) -> list[int]:
    return [b.n_heads for b in attention_blocks(model) if b.kind == "dec_self"]


def test_mistral_large4_scaling_and_latent_reuse_change_the_output():
    """What the pruning tests below compare is scaled per head and reads shared latents: layers 1 and 3 have no latent
    projection of their own, and zeroing the latents they are handed (layer 0's, layer 2's) moves the logits; the
    scaling made the identity moves the logits and the cached generation's scores."""
    from transformers.cache_utils import KVSharingDict

    model = mistral_large4()
    ids, mask = padded_inputs(pad_id=2)
    logits, (_, scores) = padded_logits(model, ids, mask), greedy_generation(model, ids, mask)
    layers = _large4_layers(model)
    assert [layer.self_attn.kv_a_proj_with_mqa is None for layer in layers] == [False, True, False, True]

    def zero_latents(module, args, kwargs):
        kwargs["shared_kv_states"] = KVSharingDict(
            {key: tuple(torch.zeros_like(t) for t in value) for key, value in kwargs["shared_kv_states"].items()})
        return args, kwargs

    for reader in (1, 3):
        handle = layers[reader].self_attn.register_forward_pre_hook(zero_latents, with_kwargs=True)
        assert (padded_logits(model, ids, mask) - logits).abs().max() > 0.05, reader
        handle.remove()
    with torch.no_grad():
        for layer in layers:
            layer.self_attn.softmax_scaling.scale.zero_()
            layer.self_attn.softmax_scaling.bias.fill_(1.0)
    assert (padded_logits(model, ids, mask) - logits).abs().max() > 0.05
    assert (greedy_generation(model, ids, mask)[1] - scores).abs().max() > 0.05


ALL = [0, 1, 2, 3]
LARGE4_SPECS = {
    "some heads": ({("dec_self", 1): [0, 2], ("dec_self", 2): [1], ("dec_self", 3): [0, 1, 3]}, [4, 2, 3, 1]),
    # the layers whose latents (and layer 0's selection) the others read, emptied: their stand-ins still compute,
    # cache and store the latents and run the indexer
    "sources emptied": ({("dec_self", 0): ALL, ("dec_self", 2): ALL, ("dec_self", 1): [3]}, [0, 3, 0, 4]),
    # the readers emptied: no cache of their own to keep in step (layer 1's is transformers' DummyLayer, which
    # refuses an update), layer 3's indexer still keeps its key cache
    "readers emptied": ({("dec_self", 1): ALL, ("dec_self", 3): ALL, ("dec_self", 0): [1]}, [3, 0, 4, 0]),
}


@pytest.mark.parametrize("spec_name", LARGE4_SPECS)
def test_mistral_large4_pruning_equals_masking_generates_and_reloads(spec_name, tmp_path):
    """Pruning slices each head's rows of q_proj and kv_b_proj, its columns of o_proj and its entries of the query
    scale and bias, and leaves the latents the other layers read: it equals masking on padded rows and in cached
    generation, with layers emptied too, and reloads with load_pruned and plain transformers (remote code). Before,
    refused: "its queries are scaled per head ... read an earlier layer's key/value latents"."""
    spec, heads_left = LARGE4_SPECS[spec_name]
    model = mistral_large4()
    ids, mask = padded_inputs(pad_id=2)
    with mask_heads(model, spec):
        expected = padded_logits(model, ids, mask)
        expected_tokens, expected_scores = greedy_generation(model, ids, mask)
    prune_heads(model, spec)  # checks itself against masking (padded probe, cached generation)
    assert _text_blocks(model) == heads_left
    for (_, layer), removed in spec.items():
        kept = [h for h in ALL if h not in removed]
        scaling = _large4_layers(model)[layer].self_attn.softmax_scaling
        assert torch.equal(scaling.scale, _SCALE[kept]) and torch.equal(scaling.bias, _BIAS[kept])
    torch.testing.assert_close(padded_logits(model, ids, mask), expected, atol=1e-5, rtol=0)
    tokens, scores = greedy_generation(model, ids, mask)
    assert torch.equal(tokens, expected_tokens)
    torch.testing.assert_close(scores, expected_scores, atol=1e-5, rtol=0)

    save_pruned(model, tmp_path)
    reloaded = load_pruned(tmp_path)
    assert _text_blocks(reloaded) == heads_left
    assert torch.equal(padded_logits(reloaded, ids, mask), padded_logits(model, ids, mask))
    plain, info = tf.AutoModel.from_pretrained(tmp_path, trust_remote_code=True, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    plain.eval()
    torch.testing.assert_close(padded_logits(plain, ids, mask), expected, atol=1e-5, rtol=0)
    assert torch.equal(greedy_generation(plain, ids, mask)[0], expected_tokens)


def test_mistral_large4_text_model_alone_is_pruned_and_reloads(tmp_path):
    """MistralLarge4TextModel (no LM head, checked on the padded probe): pruned as the wrapper's language model."""
    from headlab.surgery import check_prunable

    model = mistral_large4(wrapper=False)
    check_prunable(model)
    inputs = tiny_inputs()
    spec = {("dec_self", 0): ALL, ("dec_self", 1): [2], ("dec_self", 3): [0, 3]}
    with mask_heads(model, spec):
        expected = _output(model, inputs)[1]
    prune_heads(model, spec)
    assert _text_blocks(model) == [0, 3, 4, 2]
    torch.testing.assert_close(_output(model, inputs)[1], expected, atol=1e-5, rtol=0)
    save_pruned(model, tmp_path)
    torch.testing.assert_close(_output(load_pruned(tmp_path), inputs)[1], expected, atol=1e-5, rtol=0)
    plain = tf.AutoModel.from_pretrained(tmp_path, trust_remote_code=True).eval()
    torch.testing.assert_close(_output(plain, inputs)[1], expected, atol=1e-5, rtol=0)


def test_a_per_head_scale_of_another_length_is_refused():
    """A softmax_scaling whose scale does not hold one entry per head of the output projection: refused, naming it,
    before pruning would slice it with the heads."""
    model = mistral_large4(wrapper=False)
    attention_blocks(model)  # the probe pass, kept while the blocks stay
    _large4_layers(model)[2].self_attn.softmax_scaling.scale = torch.nn.Parameter(torch.zeros(5))
    with pytest.raises(HeadlabError, match=r"layers\.2\.self_attn.*softmax_scaling\.scale \(shape \[5\]\) is not one "
                                           r"entry per head of the output projection's 4"):
        attention_blocks(model)


def test_a_latent_attention_of_an_unchecked_type_is_refused_naming_it(monkeypatch):
    """A kv_b_proj in a model type headlab has not read the forward of: refused as such, LRP too."""
    from headlab.adapters import families
    from headlab.importance.rules import check_rules

    monkeypatch.delitem(families.LATENT_ATTENTION, "deepseek_v3")
    model = tiny_model("deepseek_v3")
    with pytest.raises(HeadlabError, match=r"physical pruning is refused: multi-head latent attention: a kv_b_proj in a "
                                           "forward headlab has not checked against DeepSeek-V3's"):
        prune_heads(model, {("dec_self", 1): [0]})
    with pytest.raises(HeadlabError, match=r"LRP: no rule for the attention of model\.layers\.0\.self_attn .*multi-head "
                                           r"latent attention, but its layout is not one headlab read"):
        check_rules(model)


_GLM5_NEXT = dict(vocab_size=99, hidden_size=32, intermediate_size=40, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=4, max_position_embeddings=64, bos_token_id=0, eos_token_id=1, pad_token_id=2,
                  q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=0, v_head_dim=8,
                  index_topk=4, index_n_heads=2, index_head_dim=8, index_kpool=2, linear_head_dim=8, linear_num_heads=4,
                  hc_mult=2, mlp_layer_types=["dense", "dense"])


def glm5_next(layer_types: list[str], attn_implementation: str = "sdpa") -> torch.nn.Module:
    """GLM-5-Next's multimodal model (Glm5NextForConditionalGeneration: transformers 5.24 has no causal LM of its text
    model; a directory saved from it loads as it, tests/test_saved_class.py) with a one-layer vision tower."""
    if "glm5_next" not in CONFIG_MAPPING:
        pytest.skip("this transformers has no glm5_next")
    text = CONFIG_MAPPING["glm5_next_text"](**_GLM5_NEXT, layer_types=layer_types)
    config = CONFIG_MAPPING["glm5_next"](text_config=text.to_dict(), vision_config=dict(
        depth=1, hidden_size=16, num_heads=2, intermediate_size=16, out_hidden_size=32))
    return perturbed_model(tf.Glm5NextForConditionalGeneration, config, attn_implementation=attn_implementation)


def test_glm5_next_with_its_linear_attention_layers_is_analysed_on_its_attention_layers():
    """Its released layout (KDA linear-attention layers between indexed-attention ones): the KDA layers are a hybrid's
    other mixer (adapters.families.LINEAR_MIXERS, as Qwen3-Next's Gated DeltaNet), so the blocks are the attention
    layers alone, analysed exactly (capture equals output_attentions, masking equals zeroing the head's value rows),
    pruned (equal to masking in cached generation, the attention layer emptied), and LRP has its rules (the KDA layer's:
    tests/test_lrp_kda.py). Before session 38 the model was refused, the wrapper and the text model alike, its KDA layer taken
    for attention that skipped the interface."""
    from headlab.importance.rules import check_rules

    inputs = tiny_inputs()
    model = glm5_next(["linear_attention", "indexed_attention"])
    assert [(b.kind, b.layer, b.name) for b in attention_blocks(model)] == [
        ("dec_self", 1, "model.language_model.layers.1.self_attn")]
    with torch.no_grad():
        reference = glm5_next(["linear_attention", "indexed_attention"], "eager")(**inputs,
                                                                                output_attentions=True).attentions
    with capture_attention(model) as record:
        _output(model, inputs)
    assert sorted(record) == [("dec_self", 1)]
    assert torch.equal(record[("dec_self", 1)], next(a for a in reference if a is not None))
    with mask_heads(model, {("dec_self", 1): [2]}):
        masked = _output(model, inputs)[1]
    zeroed = glm5_next(["linear_attention", "indexed_attention"])
    with torch.no_grad():
        zeroed.model.language_model.layers[1].self_attn.kv_b_proj.weight[2 * 16 + 8:3 * 16] = 0
    torch.testing.assert_close(masked, _output(zeroed, inputs)[1], atol=1e-6, rtol=0)
    assert not torch.allclose(masked, _output(model, inputs)[1])
    check_rules(model)  # KDA has a rule since session 38: tests/test_lrp_kda.py
    ids, mask = padded_inputs(pad_id=2)  # its one attention layer emptied: the KDA layer runs on
    check_pruned_generates_as_masked(glm5_next(["linear_attention", "indexed_attention"]),
                                     {("dec_self", 1): [0, 1, 2, 3]}, [0], ids, mask)


def test_glm5_next_multimodal_model_of_indexed_attention_only_is_analysed_pruned_and_explained(tmp_path):
    """The wrapper given text: its language model's blocks only (the vision tower does not run); capture equals
    output_attentions, masking head 2 of layer 1 equals zeroing its value rows of kv_b_proj, whatever the
    hyper-connections do around the layer. Since session 38 (LATENT_ATTENTION's glm5_next_rows: no rotary part as
    released, an indexer whose picks the next "shared" layer reuses, which a layer left with no head still computes)
    pruning equals masking in cached generation, a layer emptied too, and reloads; LRP conserves (its hyper-connections'
    pre, post and Sinkhorn comb held constant). Before, pruning and LRP were refused as an unchecked latent attention."""
    inputs = tiny_inputs()
    with torch.no_grad():
        reference = glm5_next(["indexed_attention"] * 2, "eager")(**inputs, output_attentions=True).attentions
    model = glm5_next(["indexed_attention"] * 2)
    assert [b.name for b in attention_blocks(model)] == ["model.language_model.layers.0.self_attn",
                                                         "model.language_model.layers.1.self_attn"]
    with capture_attention(model) as record:
        _output(model, inputs)
    for (_, layer), probs in record.items():
        assert torch.equal(probs, reference[layer])
    with mask_heads(model, {("dec_self", 1): [2]}):
        masked = _output(model, inputs)[1]
    zeroed = glm5_next(["indexed_attention"] * 2)
    with torch.no_grad():
        zeroed.model.language_model.layers[1].self_attn.kv_b_proj.weight[2 * 16 + 8:3 * 16] = 0
    torch.testing.assert_close(masked, _output(zeroed, inputs)[1], atol=1e-6, rtol=0)
    assert not torch.allclose(masked, _output(model, inputs)[1])
    ids, mask = padded_inputs(pad_id=2)
    for spec, left in (({("dec_self", 0): [0, 1, 2, 3], ("dec_self", 1): [1]}, [0, 3]), ({("dec_self", 1): [0, 3]},
                                                                                          [4, 2])):
        pruned = glm5_next(["indexed_attention"] * 2)  # layer 0's indexer picks for the "shared" layer 1
        check_pruned_generates_as_masked(pruned, spec, left, ids, mask)
    save_pruned(pruned, tmp_path)
    reloaded = load_pruned(tmp_path)
    assert [b.n_heads for b in attention_blocks(reloaded)] == [4, 2]
    torch.testing.assert_close(padded_logits(reloaded, ids, mask), padded_logits(pruned, ids, mask), atol=0, rtol=0)
    plain, info = tf.AutoModelForImageTextToText.from_pretrained(tmp_path, trust_remote_code=True,
                                                                  output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    torch.testing.assert_close(padded_logits(plain.eval(), ids, mask), padded_logits(pruned, ids, mask), atol=1e-6,
                               rtol=0)
    explained = glm5_next(["indexed_attention"] * 2)
    explained.config.get_text_config()._experts_implementation = "eager"
    assert_conserved(explained.double(), 1e-8)


@pytest.mark.parametrize("part", ["text", "multimodal"])
def test_glm5_next_checkpoint_directory_loads_and_is_analysed_exactly(part, tmp_path, capsys):
    """A saved GLM-5-Next directory (its text model, and the bare multimodal model Glm5NextModel; the wrapper's:
    tests/test_saved_class.py) through headlab's directory loader. Before, every command refused it: the structure is built on the
    meta device, whose probe forward fails where GLM-5-Next reads values (``torch.all(mask == 1)`` in its recurrent
    mask, its indexer's boolean selection of pooled keys), and the name-based fallback has no latent attention:
    "found no attention block: the probe forward pass ... failed (RuntimeError: Tensor.item() cannot be called on
    meta tensors)". Now the probe runs on zeros in the meta tensors' place; the loaded model is analysed exactly:
    capture equals transformers' eager output_attentions, masking equals zeroing the head's value rows."""
    from headlab.cli import main
    from headlab.loading import build_from_config, check_supported, load_model

    wrapper = glm5_next(["indexed_attention"] * 2)
    model = wrapper.model.language_model if part == "text" else wrapper.model
    model.save_pretrained(tmp_path)
    names = ["layers.0.self_attn", "layers.1.self_attn"]
    names = names if part == "text" else [f"language_model.{name}" for name in names]
    check_supported(str(tmp_path))  # raised before
    assert [b.name for b in attention_blocks(build_from_config(str(tmp_path)))] == names
    assert main(["heads", str(tmp_path), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["module"], r["n_heads"], r["d_head"]) for r in rows] == [(name, 4, 8) for name in names]
    loaded = load_model(str(tmp_path))
    assert [b.name for b in attention_blocks(loaded)] == names
    inputs = tiny_inputs()
    cls = type(model)
    with torch.no_grad():
        reference = cls.from_pretrained(tmp_path, attn_implementation="eager")(**inputs, output_attentions=True)
    with capture_attention(loaded) as record:
        out = _output(loaded, inputs)[1]
    assert sorted(record) == [("dec_self", 0), ("dec_self", 1)]
    for (_, layer), probs in record.items():
        assert torch.equal(probs, reference.attentions[layer])
    torch.testing.assert_close(out, reference.last_hidden_state, atol=1e-6, rtol=0)
    with mask_heads(loaded, {("dec_self", 1): [2]}):
        masked = _output(loaded, inputs)[1]
    zeroed = load_model(str(tmp_path))
    with torch.no_grad():
        zeroed.get_submodule(names[1]).kv_b_proj.weight[2 * 16 + 8:3 * 16] = 0  # head 2's values: [k_nope 8 | v 8]
    torch.testing.assert_close(masked, _output(zeroed, inputs)[1], atol=1e-6, rtol=0)
    assert not torch.allclose(masked, out)
    assert all(p.device.type == "cpu" and not p.is_meta for p in loaded.parameters())


def test_the_probe_of_a_meta_structure_leaves_it_on_the_meta_device():
    """The zeros the probe puts in place of a meta structure's tensors are taken back: the structure stays weightless
    (its parameters and buffers the same meta tensors), and the blocks are those of the model built with values."""
    text = CONFIG_MAPPING["glm5_next_text"](**_GLM5_NEXT, layer_types=["indexed_attention"] * 2) \
        if "glm5_next_text" in CONFIG_MAPPING else pytest.skip("this transformers has no glm5_next_text")
    with torch.device("meta"):
        structure = tf.Glm5NextTextModel(text)
    before = {name: t for name, t in (*structure.named_parameters(), *structure.named_buffers())}
    blocks = attention_blocks(structure)
    after = {name: t for name, t in (*structure.named_parameters(), *structure.named_buffers())}
    assert before.keys() == after.keys() and all(after[name] is t for name, t in before.items())
    real = [(b.name, b.n_heads, b.n_kv_heads, b.d_head) for b in attention_blocks(tf.Glm5NextTextModel(text))]
    assert [(b.name, b.n_heads, b.n_kv_heads, b.d_head) for b in blocks] == real


def test_glm5_next_directory_of_its_released_layout_lists_its_attention_layers(tmp_path, capsys):
    """A saved directory with a KDA linear-attention layer (the released layout): every command finds its attention
    layers from its structure, the KDA layer left out (adapters.families.LINEAR_MIXERS). Before session 36 the
    name-based fallback took the KDA layer for softmax attention (``headlab heads`` listed its 4 "heads"); from then
    until session 38 the directory was refused."""
    from headlab.cli import main
    from headlab.loading import check_supported

    glm5_next(["linear_attention", "indexed_attention"]).model.language_model.save_pretrained(tmp_path)
    check_supported(str(tmp_path))
    assert main(["heads", str(tmp_path), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["module"], r["n_heads"]) for r in rows] == [("layers.1.self_attn", 4)]
