"""A multimodal wrapper headlab refuses as a whole, around a language model it supports by a table (MiniCPM-V 4.6:
Qwen3.5's gated queries), is analysed as that language model (headlab.language_model).

Before, MiniCPM-V 4.6 / 4.7 and MiniCPM-OCR checkpoints were refused, with a hint that ``load_model(path)`` would load
their language model, which it did not (transformers has no causal-LM class for the wrapper's type): no way in. Every
test here fails on that main (load_model and check_supported refused; ``language_model_of`` did not exist)."""

from __future__ import annotations

import pytest
import torch
import transformers as tf

import headlab
from headlab import HeadlabError, attention_blocks, capture_attention, mask_heads, prune_heads
from headlab.language_model import check_same_logits, language_model_of
from headlab.loading import build_from_config, check_supported, load_model
from support.family_matrix import qwen3_next

VISION = dict(hidden_size=16, intermediate_size=20, num_hidden_layers=1, num_attention_heads=2, image_size=32,
              patch_size=8, insert_layer_id=0)


def minicpm_v(dtype=torch.float64):
    """A tiny MiniCPM-V 4.6 around a Qwen3.5 text model (a Gated DeltaNet layer, then gated full attention)."""
    if "minicpmv4_6" not in tf.models.auto.configuration_auto.CONFIG_MAPPING:
        pytest.skip("this transformers has no MiniCPM-V 4.6")
    _, text = qwen3_next("qwen3_5_text", ["linear_attention", "full_attention"])
    config = tf.MiniCPMV4_6Config(text_config=text.to_dict(), vision_config=VISION, image_size=32, patch_size=8)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = tf.MiniCPMV4_6ForConditionalGeneration(config).to(dtype).eval()
    with torch.no_grad():  # biases off zero, so that they count
        for name, parameter in model.named_parameters():
            if name.endswith("bias"):
                parameter.normal_(0, 0.1)
    return model


def _inputs():
    ids = torch.tensor([[5, 6, 7, 8, 9, 10], [11, 12, 13, 14, 15, 16]])
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    return {"input_ids": ids, "attention_mask": mask}


def test_the_wrapper_is_refused_naming_the_call_that_gives_its_language_model():
    with pytest.raises(HeadlabError, match=r"multimodal model around a 'qwen3_5_text' language model, which headlab "
                                           r"supports on its own: pass that causal LM \(headlab.language_model_of"):
        attention_blocks(minicpm_v())


def test_language_model_of_shares_the_wrappers_weights_and_logits():
    wrapper = minicpm_v()
    causal = headlab.language_model_of(wrapper)
    assert type(causal).__name__ == "Qwen3_5ForCausalLM" and not causal.training
    shared = {p.data_ptr() for p in wrapper.parameters()}
    assert all(p.data_ptr() in shared for p in causal.parameters())  # the same tensors, no copy
    assert [b.name for b in attention_blocks(causal)] == ["model.layers.1.self_attn"]
    inputs = _inputs()
    with torch.no_grad():
        expected, got = wrapper(**inputs).logits, causal(**inputs).logits
    assert torch.equal(expected[inputs["attention_mask"].bool()], got[inputs["attention_mask"].bool()])
    check_same_logits(wrapper, causal, "tiny")


def test_capture_masking_and_pruning_of_the_language_model():
    causal = language_model_of(minicpm_v(torch.float32))  # float64's eager softmax gives left padding NaN rows
    inputs = _inputs()
    with torch.no_grad():
        reference = causal(**inputs, output_attentions=True).attentions
    with capture_attention(causal) as record:
        with torch.no_grad():
            causal(**inputs)
    assert len(reference) == 1 and torch.equal(record[("dec_self", 1)], reference[0])  # attention layers only
    with mask_heads(causal, {("dec_self", 1): [0, 3]}):
        with torch.no_grad():
            masked = causal(**inputs).logits
    prune_heads(causal, {("dec_self", 1): [0, 3]})
    with torch.no_grad():
        pruned = causal(**inputs).logits
    keep = inputs["attention_mask"].bool()
    torch.testing.assert_close(pruned[keep], masked[keep], rtol=0, atol=1e-6)


def test_a_checkpoint_loads_as_its_language_model(tmp_path):
    wrapper = minicpm_v(torch.float32)
    wrapper.save_pretrained(tmp_path)
    check_supported(str(tmp_path))
    check_supported(str(tmp_path), prune=True)
    structure = build_from_config(str(tmp_path))
    assert type(structure).__name__ == "Qwen3_5ForCausalLM"
    loaded = load_model(str(tmp_path))
    assert type(loaded).__name__ == "Qwen3_5ForCausalLM"
    assert [b.name for b in attention_blocks(loaded)] == ["model.layers.1.self_attn"]
    inputs = _inputs()
    keep = inputs["attention_mask"].bool()
    with torch.no_grad():  # the loaded model on SDPA, the wrapper on eager: to float32's rounding
        torch.testing.assert_close(loaded(**inputs).logits[keep], wrapper(**inputs).logits[keep], rtol=0, atol=1e-6)


def test_weights_that_do_not_fit_the_language_model_are_named(tmp_path):
    from safetensors.torch import load_file, save_file

    minicpm_v(torch.float32).save_pretrained(tmp_path)
    (file,) = tmp_path.glob("*.safetensors")
    tensors = load_file(file)
    name = next(n for n in tensors if n.endswith("layers.1.self_attn.o_proj.weight"))
    tensors[name] = tensors[name][:, :-8].contiguous()
    save_file(tensors, file, metadata={"format": "pt"})
    with pytest.raises(HeadlabError, match=r"the weights do not match it: model\.layers\.1\.self_attn\.o_proj\.weight"):
        load_model(str(tmp_path))


def test_a_wrapper_that_does_more_than_its_language_model_on_text_is_refused():
    wrapper = minicpm_v()
    causal = language_model_of(wrapper)
    forward = wrapper.forward

    def scaled(*args, **kwargs):  # a wrapper whose text forward is not its language model's
        out = forward(*args, **kwargs)
        out.logits = out.logits * 2
        return out

    wrapper.forward = scaled
    with pytest.raises(HeadlabError, match=r"does not give the wrapper's logits on token ids"):
        check_same_logits(wrapper, causal, "tiny")


def test_a_model_without_a_language_model_inside_gives_none():
    _, text = qwen3_next("qwen3_5_text", ["full_attention"])
    assert language_model_of(tf.Qwen3_5ForCausalLM(text)) is None


def test_analyze_end_to_end_on_the_checkpoint(tmp_path):
    """`headlab analyze --ablation` on a saved tiny MiniCPM-V 4.6: every stage done on its language model."""
    from support.family_matrix import ANALYZE_STAGES, analyze, save_tiny, treebank_files

    save_tiny(minicpm_v(torch.float32), tmp_path / "model", treebank_files(tmp_path))
    code, stages = analyze(tmp_path / "model", tmp_path)
    assert code == 0 and all(stages[name]["status"] == "done" for name in ANALYZE_STAGES), stages
