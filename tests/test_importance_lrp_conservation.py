"""LRP correct or refused (issue 31, item 3): a rule for every normalisation met (OLMo's
parameter-free LayerNorm, Gemma's ``x * (1 + w)``, mT5's LayerNorm) or a refusal before any work;
conservation measured on every run, in the signature and the report, and a run outside the
tolerance failed with its ratio; half-precision models computed widened; an LRP failure that
keeps the other measures' files."""

import contextlib
import gzip
import json
import math

import numpy as np
import pytest
import torch

from headlab.cli import main
from headlab.errors import HeadlabError, RunFailed
from headlab.importance import (
    ImportanceConfig,
    ImportanceData,
    compute_lrp,
    describe_model,
    lrp_rules,
    run_importance,
    translate_data,
)
from headlab.importance import lrp as lrp_module
from headlab.importance import rules as rules_module
from headlab.importance.lrp import CONSERVATION_TOLERANCE, lrp_precision
from headlab.importance.pipeline import MeasuresFailed
from headlab.nmt.tokenizer import train_tokenizer
from support.lrp_families import FAMILIES as NEW_FAMILIES
from support.lrp_families import tiny_lrp_model
from support.models import FAMILIES, tiny_model


def _data(model, n=4, seed=0):
    info = describe_model(model)
    eos = min(info.eos_ids) if info.eos_ids else 1
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, 9, (n,), generator=g).tolist()
    data = ImportanceData.from_ids([torch.randint(3, 99, (k,), generator=g).tolist() + [eos] for k in lengths])
    if info.is_seq2seq:
        data = translate_data(model, data, info, max_length_a=0, max_length_b=6)
    return data, info


def _model(family, **kwargs):
    return tiny_model(family) if family in FAMILIES else tiny_lrp_model(family, **kwargs)


def _forwards(model):
    """The model's forwards, but discovery's probe (4 token ids under no_grad, no data: check_rules asks it what a
    module without a rule never runs, rules.never_run)."""
    from headlab.adapters import discovery

    calls = []
    model.register_forward_pre_hook(lambda module, args: None if discovery._ACTIVE else calls.append(1))
    return calls


@pytest.mark.parametrize("family", [*FAMILIES, *NEW_FAMILIES])
def test_every_run_records_conservation_within_the_tolerance(family):
    """Embeddings plus the biases' shares equal the explained logits, per sentence, on every
    family (random biases and norm weights): float32 rounding, or float64 for gated MLPs."""
    model = _model(family)
    data, info = _data(model)
    record = compute_lrp(model, data, info, bootstrap=0).signature["conservation"]
    # (a sentence whose translation is empty has no target: 3 of the tiny mT5's 4 are)
    assert 0 < record["n_sentences"] <= len(data) and record["n_outside"] == 0 and record["tolerance"] == 1e-3
    total = record["with_biases"]
    assert abs(total["min"] - 1) < 1e-6 and abs(total["max"] - 1) < 1e-6
    assert record["embeddings"]["min"] <= record["embeddings"]["mean"] <= record["embeddings"]["max"]


@pytest.mark.parametrize("family", [*FAMILIES, *NEW_FAMILIES, "hy_v3"])
def test_a_float64_model_conserves_to_float64_rounding(family):
    """In float64 LRP computes in float64 everywhere, also where the model's code asks for float32 (the norms, the
    eager softmax; Hunyuan-V3 adds its experts' outputs in float32, Beam's MLP multiplies in it: tests/
    test_output_gates.py). Before, Hunyuan-V3 lost 7e-11 of the logit there; now every family is within 5e-14."""
    from support.converted import tiny_model as converted_model

    model = (converted_model(family) if family == "hy_v3" else _model(family)).to(torch.float64)
    data, info = _data(model)
    total = compute_lrp(model, data, info, bootstrap=0).signature["conservation"]["with_biases"]
    assert abs(total["min"] - 1) < 1e-12 and abs(total["max"] - 1) < 1e-12


@pytest.mark.parametrize("family", ["gpt2", "bart"])
def test_the_conservation_check_measures_the_explained_pass_only(family, monkeypatch):
    """The check's numbers (the first layers' inputs, the biases' probes) are read from the pass LRP explains: a
    pass under no_grad inside the LRP context (discovery's probe forward, were the blocks read again there) is not
    recorded. Before, its first-layer input was taken for an embedding and the run failed ("found no input
    embeddings on the path to the logits")."""
    model = tiny_model(family).to(torch.float64)
    data, info = _data(model)
    lm_input = lrp_module._lm_input

    @contextlib.contextmanager
    def after_a_probe_pass(model):
        with torch.no_grad():
            model(**{"input_ids": torch.tensor([[5, 17, 33]]),
                     **({"decoder_input_ids": torch.tensor([[0, 9]])} if info.is_seq2seq else {})})
        with lm_input(model) as seen:
            yield seen

    monkeypatch.setattr(lrp_module, "_lm_input", after_a_probe_pass)
    total = compute_lrp(model, data, info, bootstrap=0).signature["conservation"]["with_biases"]
    assert abs(total["min"] - 1) < 1e-12 and abs(total["max"] - 1) < 1e-12


@pytest.mark.parametrize("family", ["olmo", "gemma", "gemma2", "gemma3", "mt5", "qwen3", "olmo2"])
def test_each_normalisation_rule_conserves_layer_to_layer(family):
    """OLMo's parameter-free LayerNorm used to get no rule (9% of the logit reached the
    embeddings), Gemma's ``x * (1 + w)`` and mT5's LayerNorm were refused: bias-free, in float64,
    every layer's hidden states now hold the whole logit."""
    model = tiny_lrp_model(family, biases=False, dtype=torch.float64)
    model.config.final_logit_softcapping = None  # Gemma 2: LRP explains the logit before capping
    inputs = {"input_ids": torch.tensor([[5, 17, 33, 8, 61, 4]])}
    if model.config.is_encoder_decoder:
        inputs["decoder_input_ids"] = torch.tensor([[0, 9, 27, 3]])
    with torch.enable_grad(), lrp_rules(model):
        out = model(**inputs, output_hidden_states=True)
        y = out.logits[0, 2].max()
        if model.config.is_encoder_decoder:  # cross-attention sends some to the encoder: the bottom cut
            hidden = [out.encoder_hidden_states[0], out.decoder_hidden_states[0]]
            grads = torch.autograd.grad(y, hidden)
            totals = [float((hidden[0] * grads[0]).sum().detach() + (hidden[1] * grads[1]).sum().detach())]
        else:
            grads = torch.autograd.grad(y, list(out.hidden_states))
            totals = [float((h * g).sum().detach()) for h, g in zip(out.hidden_states, grads)]
    np.testing.assert_allclose(totals, float(y.detach()), rtol=1e-9)


def test_a_soft_capped_logit_gets_the_relevance_of_the_logit_before_capping_times_the_caps_slope():
    """Gemma 2's final soft-capping y = 30 tanh(z / 30) follows the LM head: z, the logit LRP explains, keeps
    its whole relevance, and y's is z's scaled by dy/dz (tests/support/family_matrix.check_lrp_conserves)."""
    from support.family_matrix import check_lrp_conserves

    model = tiny_lrp_model("gemma2", biases=False, dtype=torch.float64)
    assert model.config.final_logit_softcapping == 30
    check_lrp_conserves(model, model.model.layers[0])


def test_the_conservation_helper_checks_the_explained_pass_not_the_blocks_probe(monkeypatch):
    """A model whose blocks were never read: entering lrp_rules reads them, and discovery's probe forward (under
    no_grad) calls the first layer before the explained pass. The helper checks the explained call, the only one
    it counts (before: it took the probe's input, which is on no path to the logit, and failed with "One of the
    differentiated Tensors does not require grad", counting 2 calls)."""
    from headlab.adapters import discovery
    from support.family_matrix import check_lrp_conserves

    probes = []
    discover = discovery._discover
    monkeypatch.setattr(discovery, "_discover", lambda model: probes.append(1) or discover(model))
    model = tiny_lrp_model("olmo", biases=False, dtype=torch.float64)
    assert check_lrp_conserves(model, model.model.layers[0]) == 1
    assert probes == [1]  # the trap was there: the probe ran inside the helper


class ScaleNorm(torch.nn.Module):
    """A normalisation headlab has no rule for, without parameters (as OLMo's was)."""

    def forward(self, x):
        return x / x.norm(dim=-1, keepdim=True)


def test_a_normalisation_without_a_rule_is_refused_before_any_work():
    model = tiny_model("gpt2")
    model.transformer.h[1].ln_2 = ScaleNorm()
    data, info = _data(model)
    calls = _forwards(model)
    with pytest.raises(HeadlabError, match=r"no rule for the normalisation module ScaleNorm \(at transformer.h.1.ln_2\)"):
        compute_lrp(model, data, info)
    assert calls == []
    # Asked for by name next to another measure: refused before the other one runs either.
    with pytest.raises(HeadlabError, match="cannot run lrp: LRP: no rule .* ScaleNorm"):
        run_importance(model, data, info, ImportanceConfig(methods=("confidence", "lrp")))
    assert calls == []
    # Asked for with all: skipped with the reason, the others run.
    result = run_importance(model, data, info, ImportanceConfig(methods=("all",)))
    assert "ScaleNorm" in result.skipped["lrp"] and "confidence" in result.scores and "lrp" not in result.scores


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "qwen3_moe", "inkling"])
def test_mixture_of_experts_conserves_with_the_gated_rule_per_expert(family):
    """transformers' fused experts (gate_up_proj parameters, not gate/up modules) got no product
    rule and their routing weights a gradient: Mixtral conserved 1.0015 to 1.008 of the logit.
    Now each expert gets the gated-MLP rules and routing weights (and Qwen2-MoE's shared-expert
    gate) are constants: bias-free in float64 every layer holds the whole logit. The experts'
    implementation (grouped matmul by default) is restored afterwards."""
    model = tiny_lrp_model(family, biases=False, dtype=torch.float64)
    implementation = model.config._experts_implementation
    with torch.enable_grad(), lrp_rules(model):
        out = model(input_ids=torch.tensor([[5, 17, 33, 8, 61, 4]]), output_hidden_states=True)
        y = out.logits[0, 3].max()
        grads = torch.autograd.grad(y, list(out.hidden_states))
        totals = [float((h * g).sum().detach()) for h, g in zip(out.hidden_states, grads)]
    np.testing.assert_allclose(totals, float(y.detach()), rtol=1e-9)
    assert model.config._experts_implementation == implementation
    assert lrp_precision(model) == torch.float64


@pytest.mark.parametrize(("flag", "refusal"), [
    # a post-expert norm is followed since session 38 where it is an RMS norm (Muse Spark's): said, but not there
    ("has_post_expert_norm", r"its layout differs \(has_post_expert_norm=True, no RMS norm post_expert_norm\)"),
    # biases are followed since session 28 (GPT-OSS's): said, but not there
    ("has_bias", r"it says it has biases \(has_bias\) but not gate_up_proj_bias"),
])
def test_experts_without_a_rule_are_refused_before_any_work(flag, refusal):
    model = tiny_lrp_model("mixtral")
    setattr(model.model.layers[1].mlp.experts, flag, True)
    data, info = _data(model)
    calls = _forwards(model)
    with pytest.raises(HeadlabError, match=r"no rule for the mixture-of-experts module MixtralExperts "
                                           r"\(model.layers.1.mlp.experts\): " + refusal):
        compute_lrp(model, data, info)
    assert calls == []


def test_experts_that_compute_something_else_are_refused():
    """The rule recomputes the experts' output: a forward it does not reproduce is refused, not explained."""
    model = tiny_lrp_model("mixtral")
    model.model.layers[0].mlp.experts.register_forward_hook(lambda module, args, output: 2 * output)
    data, info = _data(model)
    with pytest.raises(HeadlabError, match="MixtralExperts is not a sum of routed gated experts"):
        compute_lrp(model, data, info)


def test_experts_given_nan_say_nan_not_another_formula():
    """NaN hidden states (a model that gives NaN by itself) fail the rule's check of its formula: the refusal names
    the NaN, as the norms' rules do, not a layout the experts do not have (session 27: it said the latter)."""
    from headlab.importance.rules import _experts_rule

    experts = tiny_lrp_model("mixtral").model.layers[0].mlp.experts
    x = torch.randn(4, experts.gate_up_proj.shape[-1], dtype=experts.gate_up_proj.dtype)
    x[1] = math.nan
    index, weights = torch.tensor([[0, 1]] * 4), torch.full((4, 2), 0.5, dtype=x.dtype)
    with torch.no_grad():
        output = experts(x, index, weights)
    with pytest.raises(HeadlabError, match="not finite .*NaN or infinity reached MixtralExperts"):
        _experts_rule(experts, (x, index, weights), {}, output)


def test_a_rule_that_does_not_fit_fails_the_run_with_its_ratio(monkeypatch):
    """As OLMo's norm did before it had a rule: no rule applied, relevance not conserved. The run
    fails (exit 1) with the ratio, instead of writing scores."""
    real = rules_module.norm_rule
    monkeypatch.setattr(rules_module, "norm_rule",
                        lambda module: None if type(module).__name__ == "OlmoLayerNorm" else real(module))
    model = tiny_lrp_model("olmo")
    data, info = _data(model)
    with pytest.raises(RunFailed, match=r"did not conserve relevance .* in 4 of 4 sentences .*\(sentence 0: 0\.\d+") as error:
        compute_lrp(model, data, info)
    assert error.value.exit_code == 1


def test_tolerance_flags_a_sentence_outside_and_nan():
    record = lrp_module.conservation_record(
        torch.tensor([1.0, 2.0, 0.0, 3.0]), torch.tensor([0.0, 0.0, 0.0, 0.0]),
        torch.tensor([1.0, 2.0 * (1 + 2 * CONSERVATION_TOLERANCE), 0.0, 0.0]), torch.tensor([1.0, 1.0, 0.0, 1.0]))
    assert record["n_sentences"] == 3 and record["n_outside"] == 2
    assert [o["sentence"] for o in record["outside"]] == [1, 3] and record["outside"][1]["ratio"] is None
    with pytest.raises(RunFailed, match="in 2 of 3 sentences"):
        lrp_module.check_conservation(record)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_models_are_computed_widened_and_left_as_they_were(dtype):
    """They used to fail with "no LRP rule for LlamaRMSNorm". Now: the scores of the same
    weights widened, and the model afterwards in its own precision, bit for bit."""
    half = tiny_model("llama").to(dtype)
    before = {name: p.clone() for name, p in half.state_dict().items()}
    data, info = _data(half)
    scores = compute_lrp(half, data, info, bootstrap=0)
    after = half.state_dict()
    assert all(after[name].dtype == value.dtype and torch.equal(after[name], value) for name, value in before.items())
    widened = compute_lrp(half.float(), data, info, bootstrap=0)
    for kind in scores.kinds:
        np.testing.assert_array_equal(scores[kind], widened[kind])
    assert scores.signature["precision"].startswith("float64") and str(dtype)[6:] in scores.signature["precision"]


@pytest.mark.parametrize("family", ["gemma2", "gemma3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_padding_query_with_no_key_in_its_window_stays_finite(family, dtype):
    """Gemma 2 and 3 with a sliding window shorter than the padding: a padding query may attend
    to no key. Their float64 mask (float64's lowest number) became -inf in eager attention's
    float32 softmax, NaN reached the norms, and LRP refused them ("Gemma2RMSNorm is not x /
    rms(x) ..."). Now they conserve as without padding."""
    model = tiny_lrp_model(family, dtype=dtype, sliding_window=2)
    g = torch.Generator().manual_seed(0)
    data = ImportanceData.from_ids([torch.randint(3, 99, (k,), generator=g).tolist() + [1] for k in (3, 6, 9)])
    record = compute_lrp(model, data, describe_model(model), bootstrap=0).signature["conservation"]
    assert record["n_sentences"] == 3 and record["n_outside"] == 0
    assert abs(record["with_biases"]["min"] - 1) < 1e-6 and abs(record["with_biases"]["max"] - 1) < 1e-6


def test_a_forward_that_is_not_finite_is_named_so(monkeypatch):
    """Without the mask floor Gemma 2's padding rows were NaN, and LRP blamed the norm's formula. (Both guards off:
    the floor, and the float64 softmax that _KeptWide gives its eager attention's float32 one.)"""
    monkeypatch.setattr(lrp_module, "_finite_masks", lambda model: contextlib.nullcontext())
    monkeypatch.setattr(lrp_module, "_KeptWide", lambda dtype: contextlib.nullcontext())
    model = tiny_lrp_model("gemma2", sliding_window=2)
    data = ImportanceData.from_ids([[5, 6, 7, 1], [5, 6, 7, 8, 9, 10, 11, 1]])
    with pytest.raises(HeadlabError, match="forward is not finite in float64: NaN or infinity reached Gemma2RMSNorm"):
        compute_lrp(model, data, describe_model(model), bootstrap=0)


@pytest.mark.parametrize("family", ["modernbert", "phi3"])
def test_fused_gated_mlps_are_computed_in_float64_also_with_padding(family):
    """A fused [gate | up] projection (ModernBERT's ``Wi``, Phi-3's ``gate_up_proj``) is a gated MLP
    too, but was computed in float32: ModernBERT's padded sentences (a padding query of its local
    layers sees no key) had no finite relevance in float64. Now both run in float64, finite."""
    from support.family_matrix import tiny_model as matrix_model

    model = matrix_model(family)
    assert lrp_precision(model) == torch.float64
    g = torch.Generator().manual_seed(0)
    data = ImportanceData.from_ids([torch.randint(3, 99, (k,), generator=g).tolist() for k in (3, 6, 9, 12)])
    scores = compute_lrp(model, data, describe_model(model), bootstrap=0)
    record = scores.signature["conservation"]
    assert scores.signature["precision"].startswith("float64") and record["n_outside"] == 0
    assert abs(record["with_biases"]["min"] - 1) < 1e-9 and abs(record["with_biases"]["max"] - 1) < 1e-9


def test_gated_mlps_are_computed_in_float64_and_the_model_is_unchanged():
    """Ding's product rule divides by a + b, which crosses zero (the English LM's sentences
    conserved between -0.5 and 47 times the logit in float32)."""
    llama, gpt2 = tiny_model("llama"), tiny_model("gpt2")
    assert lrp_precision(llama) == torch.float64 and lrp_precision(gpt2) == torch.float32
    before = {name: p.clone() for name, p in llama.state_dict().items()}
    data, info = _data(llama)
    assert compute_lrp(llama, data, info, bootstrap=0).signature["precision"].startswith("float64 (gated MLPs")
    assert all(torch.equal(llama.state_dict()[name], value) and llama.state_dict()[name].dtype == value.dtype
               for name, value in before.items())


SENTENCES = ["a man is riding a bike", "two dogs play in the snow", "a woman reads a book",
             "children are playing football", "a cat sleeps on the sofa"]


@pytest.fixture
def saved_llama(tmp_path):
    tokenizer = train_tokenizer(SENTENCES, vocab_size=90, min_frequency=1)
    path = tmp_path / "llama"
    tiny_model("llama").save_pretrained(path)
    tokenizer.save_pretrained(path)
    source = tmp_path / "text.en.gz"
    with gzip.open(source, "wt", encoding="utf-8") as handle:
        handle.write("\n".join(SENTENCES) + "\n")
    return str(path), str(source)


def test_importance_in_float16_writes_lrp_with_its_conservation(saved_llama, tmp_path, capsys):
    model, source = saved_llama
    out = tmp_path / "out"
    code = main(["importance", model, "--data", source, "--method", "confidence,lrp", "--dtype", "float16",
                 "--out", str(out), "--no-progress"])
    assert code == 0, capsys.readouterr().err
    signature = json.loads((out / "lrp.json").read_text())["signature"]
    assert signature["conservation"]["n_outside"] == 0 and "float16 weights widened" in signature["precision"]
    assert (out / "confidence.json").is_file()


def test_an_lrp_failure_keeps_the_other_measures_files(saved_llama, tmp_path, capsys, monkeypatch):
    """`headlab importance` used to write nothing when LRP failed, losing the confidence scores."""
    def fail(*args, **kwargs):
        raise RunFailed("LRP did not conserve relevance on this model: sentence 0: 0.0949")

    monkeypatch.setattr(lrp_module, "compute_lrp", fail)
    model, source = saved_llama
    out = tmp_path / "out"
    code = main(["importance", model, "--data", source, "--method", "confidence,lrp,gradient", "--out", str(out),
                 "--no-progress"])
    captured = capsys.readouterr()
    assert code == 1
    assert "lrp failed: LRP did not conserve relevance on this model: sentence 0: 0.0949" in captured.err
    written = sorted(p.name for p in out.iterdir() if p.name != ".headlab")  # .headlab: the run's manifest
    assert written == ["confidence.json", "gradient.json", "gradient_raw.json"]
    # The Python API raises too, carrying what was computed.
    model_ = tiny_model("gpt2")
    data, info = _data(model_)
    with pytest.raises(MeasuresFailed) as error:
        run_importance(model_, data, info, ImportanceConfig(methods=("lrp", "confidence")))
    assert error.value.failures == {"lrp": "LRP did not conserve relevance on this model: sentence 0: 0.0949"}
    assert list(error.value.result.scores) == ["confidence"]


def test_the_report_shows_conservation(tmp_path):
    from headlab.report.collect import collect

    model = tiny_model("gpt2")
    data, info = _data(model)
    (tmp_path / "importance").mkdir()
    compute_lrp(model, data, info, bootstrap=0).save(tmp_path / "importance" / "lrp.json")
    caption = next(h["caption"] for h in collect(tmp_path).heatmaps if h["name"] == "lrp")
    assert "conservation over 4 sentences: relevance reaching the input embeddings" in caption
    assert "with the biases' shares 1.000000 to 1.000000 (tolerance 1 ± 0.001)" in caption


def test_analyze_fails_the_lrp_stage_with_its_ratio_and_runs_the_others(saved_llama, tmp_path, monkeypatch):
    def fail(*args, **kwargs):
        raise RunFailed("LRP did not conserve relevance on this model: sentence 0: 0.0949")

    monkeypatch.setattr(lrp_module, "compute_lrp", fail)
    model, source = saved_llama
    out = tmp_path / "out"
    code = main(["analyze", model, "--source", source, "--out", str(out), "--no-progress",
                 "--skip", "agreement", "functions", "aggregate", "table", "attention", "figures", "report"])
    assert code == 1
    stages = {s["name"]: s for s in json.loads((out / "manifest.json").read_text())["stages"]}
    assert stages["lrp"]["status"] == "failed" and "sentence 0: 0.0949" in stages["lrp"]["reason"]
    assert stages["confidence"]["status"] == stages["gradient"]["status"] == "done"
    assert sorted(p.name for p in (out / "importance").iterdir()) == [
        "confidence.json", "gradient.json", "gradient_raw.json"]
