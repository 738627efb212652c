"""Fuzz headlab's core invariants over random model shapes and random head sets (session 46, task fuzz).

The test matrix (tests/support) checks the invariants on fixed tiny configs (hidden 32, 2 layers, 4 heads of 8) and
fixed head sets. This campaign draws, from a seed, a valid config of a family (head counts, grouped and multi-query
key/value heads, head sizes other than hidden / heads, 1 to 3 layers, partial rotary, biases, sliding windows, the
family's own options: see ``FAMILIES``) and a random head set (one head, every head of a layer, every query head of one
key/value group, all but one, a random subset, several kinds at once), and checks in float64 on a padded batch (right
padding, pad ids in the padded places, as headlab.data.inputs pads):

* ``gates``: scalar gates at one, and Hard Concrete gates open (eval mode, log_alpha high), change nothing (to the bit);
* ``mask``: :func:`headlab.mask_heads` equals this script's own reference, the heads' slice of the output projection's
  input zeroed by a pre-hook (not headlab's); with scalar gates at one attached as well, the same;
* ``prune``: :func:`headlab.prune_heads` equals masking (logits of the kept positions; greedy cached generation for a
  causal LM: the same tokens, scores within the bound); head counts, key/value head counts (a key/value head goes
  with its whole group of query heads) and projection widths as expected;
* ``save``: the pruned model saved (:func:`headlab.save_pruned`) loads back with :func:`headlab.load_pruned` and with
  plain transformers (``trust_remote_code`` where the directory says "remote code") to the same logits;
* ``twice``: pruning a random part of the head set, then the rest (in the pruned model's numbering:
  :func:`headlab.surgery.to_current_numbering`), equals pruning the whole set at once;
* ``capture``: :func:`headlab.capture_attention` equals transformers' eager ``output_attentions``
  (experiments/family_sweep.check_capture);
* ``fused``: the fused statistics engine (``headlab.functions``' default) writes what the eager engine writes
  (tests/test_fused_statistics.py's comparison: counts equal, floats to 1e-8);
* ``lrp``: compute_lrp conserves relevance to 1e-8 in float64, on the model and on the pruned model
  (experiments/family_sweep.check_compute_lrp).

A refusal (HeadlabError) before any work is a note, not a failure. A check that finds a difference is FAIL, an
exception other than HeadlabError is CRASH; either prints the seed, family, config and head set, replayable with
``--replay SEED FAMILY``. Draws depend on (seed, family) only.

    cd <checkout> && PYTHONPATH=src:tests OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 .venv/bin/python experiments/fuzz_heads.py \\
        [--budget SECONDS] [--seeds N] [--first-seed S] [--only FAMILY ...] [--skip CHECK ...] [--replay SEED FAMILY]
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import random
import sys
import tempfile
import time
import traceback
import warnings
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import transformers as tf

from headlab import (
    HardConcreteGates,
    HeadlabError,
    ScalarGates,
    attention_blocks,
    gates_attached,
    load_pruned,
    mask_heads,
    prune_heads,
    save_pruned,
)
from headlab.surgery import to_current_numbering

sys.path.insert(0, str(Path(__file__).resolve().parent))
import family_sweep  # noqa: E402  (its capture and compute_lrp checks, reused)
from family_sweep import Fail, close, tolerance_for  # noqa: E402

VOCAB = 99
SPECIAL = dict(bos_token_id=0, eos_token_id=1, pad_token_id=2)
TOLERANCE = tolerance_for(torch.float64)
CHECKS = ("gates", "mask", "prune", "save", "twice", "numbering", "capture", "fused", "lrp")


# -- random configs --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Family:
    cls: Callable
    config: Callable
    draw: Callable[[random.Random], dict]
    kind: str  # "causal", "masked" or "seq2seq"


def _grouped(r: random.Random, mqa: bool = True) -> tuple[int, int]:
    """(query heads, key/value heads): 1 to 3 key/value heads of 1 to 3 query heads each (1 key/value head: MQA)."""
    n_kv = r.choice([1, 2, 3] if mqa else [2, 3])
    return n_kv * r.choice([1, 2, 3]), n_kv


def _free_heads(r: random.Random, grouped: bool = True) -> dict:
    """Llama-like sizes with a head size of its own (not hidden / heads)."""
    n, n_kv = _grouped(r) if grouped else (r.choice([1, 2, 3, 5]),) * 2
    return dict(hidden_size=n * r.choice([4, 6, 8]), num_attention_heads=n, num_key_value_heads=n_kv,
                head_dim=r.choice([4, 6, 8, 12]), intermediate_size=r.choice([20, 37]),
                num_hidden_layers=r.choice([1, 2, 3]), max_position_embeddings=64, vocab_size=VOCAB, **SPECIAL)


def _tied_heads(r: random.Random, grouped: bool = True) -> dict:
    """hidden = heads x head size (families whose head size is hidden / heads)."""
    n, n_kv = _grouped(r) if grouped else (r.choice([1, 2, 3, 5]),) * 2
    d = r.choice([4, 6, 8])
    return dict(hidden_size=n * d, num_attention_heads=n, num_key_value_heads=n_kv, intermediate_size=r.choice([20, 37]),
                num_hidden_layers=r.choice([1, 2, 3]), max_position_embeddings=64, vocab_size=VOCAB, **SPECIAL)


def _window(r: random.Random) -> int | None:
    return r.choice([None, 3, 5])


def draw_llama(r):
    return dict(_free_heads(r), attention_bias=r.random() < 0.5, mlp_bias=r.random() < 0.3)


def draw_mistral(r):
    return dict(_free_heads(r), sliding_window=_window(r))


def draw_qwen3(r):
    return dict(_free_heads(r), attention_bias=r.random() < 0.5)


def draw_gemma2(r):
    c = _free_heads(r)
    return dict(c, query_pre_attn_scalar=r.choice([c["head_dim"], 16]), sliding_window=r.choice([3, 5]),
                attn_logit_softcapping=r.choice([None, 5.0]), final_logit_softcapping=r.choice([None, 3.0]))


def draw_gemma3(r):
    c = _free_heads(r)
    return dict(c, query_pre_attn_scalar=r.choice([c["head_dim"], 16]), sliding_window=r.choice([3, 5]),
                sliding_window_pattern=r.choice([1, 2]))


def draw_phi3(r):
    c = _tied_heads(r)
    d = c["hidden_size"] // c["num_attention_heads"]
    factor = r.choice([1.0, 0.5]) if d % 4 == 0 else 1.0
    return dict(c, original_max_position_embeddings=64,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": factor})


def draw_gpt_neox(r):
    c = _tied_heads(r, grouped=False)
    c.pop("num_key_value_heads")
    d = c["hidden_size"] // c["num_attention_heads"]
    factor = r.choice([f for f in (0.25, 0.5, 1.0) if (d * f) % 2 == 0 and d * f >= 2])
    return dict(c, attention_bias=r.random() < 0.7, use_parallel_residual=r.random() < 0.5,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": factor})


def draw_stablelm(r):
    c = _tied_heads(r)
    d = c["hidden_size"] // c["num_attention_heads"]
    factor = r.choice([f for f in (0.25, 0.5, 1.0) if (d * f) % 2 == 0 and d * f >= 2])
    return dict(c, use_qkv_bias=r.random() < 0.5, qk_layernorm=r.random() < 0.5, use_parallel_residual=r.random() < 0.5,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": factor})


def draw_olmo2(r):
    return _tied_heads(r)


def draw_gpt_oss(r):
    c = _free_heads(r)
    layers = c["num_hidden_layers"]
    return dict(c, num_local_experts=r.choice([2, 3]), num_experts_per_tok=r.choice([1, 2]), sliding_window=r.choice([3, 5]),
                layer_types=[r.choice(["sliding_attention", "full_attention"]) for _ in range(layers)])


def draw_qwen3_moe(r):
    return dict(_free_heads(r), num_experts=r.choice([2, 4]), num_experts_per_tok=2, moe_intermediate_size=20,
                decoder_sparse_step=r.choice([1, 2]))


def draw_deepseek_v3(r):
    n = r.choice([1, 2, 3, 4, 6])
    rope = r.choice([2, 4])
    layers = r.choice([1, 2, 3])
    return dict(hidden_size=r.choice([16, 32]), num_attention_heads=n, num_key_value_heads=n, head_dim=rope,
                qk_rope_head_dim=rope, qk_nope_head_dim=r.choice([2, 4, 6]), v_head_dim=r.choice([4, 6, 8]),
                kv_lora_rank=r.choice([8, 16]), q_lora_rank=r.choice([None, 12]), intermediate_size=20,
                moe_intermediate_size=12, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, n_group=1,
                topk_group=1, first_k_dense_replace=r.choice([0, 1, layers]), num_hidden_layers=layers,
                max_position_embeddings=64, vocab_size=VOCAB, **SPECIAL)


def draw_gpt2(r):
    n, d = r.choice([1, 2, 3, 5]), r.choice([4, 6, 8])
    return dict(n_embd=n * d, n_head=n, n_layer=r.choice([1, 2, 3]), n_positions=64, n_inner=r.choice([None, 20]),
                vocab_size=VOCAB, bos_token_id=0, eos_token_id=1)


def draw_opt(r):
    n, d = r.choice([1, 2, 3, 5]), r.choice([4, 6, 8])
    return dict(hidden_size=n * d, num_attention_heads=n, num_hidden_layers=r.choice([1, 2, 3]), ffn_dim=20,
                word_embed_proj_dim=n * d, do_layer_norm_before=r.random() < 0.7, enable_bias=r.random() < 0.8,
                max_position_embeddings=64, vocab_size=VOCAB, **SPECIAL)


def draw_falcon(r):
    layout = r.choice(["grouped", "multi_query", "alibi", "per_head"])
    n_kv = r.choice([1, 2, 3])
    n = n_kv * r.choice([1, 2, 3]) if layout == "grouped" else r.choice([1, 2, 3, 4])
    d = r.choice([4, 6, 8])
    extra = {"grouped": dict(new_decoder_architecture=True, num_kv_heads=n_kv),
             "multi_query": dict(multi_query=True),
             "alibi": dict(multi_query=False, alibi=True, parallel_attn=r.random() < 0.5),
             "per_head": dict(multi_query=False, parallel_attn=r.random() < 0.5)}[layout]
    return dict(hidden_size=n * d, num_attention_heads=n, num_hidden_layers=r.choice([1, 2, 3]), bias=r.random() < 0.7,
                vocab_size=VOCAB, **extra, **SPECIAL)


def draw_bloom(r):
    n, d = r.choice([1, 2, 3, 4, 5]), r.choice([4, 6, 8])
    return dict(hidden_size=n * d, n_head=n, n_layer=r.choice([1, 2, 3]), vocab_size=VOCAB, **SPECIAL)


def draw_bert(r):
    n, d = r.choice([1, 2, 3, 5]), r.choice([4, 6, 8])
    return dict(hidden_size=n * d, num_attention_heads=n, num_hidden_layers=r.choice([1, 2, 3]), intermediate_size=20,
                max_position_embeddings=70, vocab_size=VOCAB, pad_token_id=2)


def draw_t5(r):
    layers = r.choice([1, 2, 3])
    return dict(d_model=r.choice([16, 24, 32]), d_kv=r.choice([4, 6, 8]), num_heads=r.choice([1, 2, 3, 5]), d_ff=20,
                num_layers=layers, num_decoder_layers=r.choice([1, 2, 3]),
                feed_forward_proj=r.choice(["relu", "gated-gelu"]), relative_attention_num_buckets=8,
                relative_attention_max_distance=16, vocab_size=VOCAB, pad_token_id=0, eos_token_id=1,
                decoder_start_token_id=0)


def draw_bart(r):
    d = r.choice([4, 6, 8])
    enc, dec = r.choice([1, 2, 3, 6]), r.choice([1, 2, 3, 6])
    width = max(enc, dec) * d if max(enc, dec) % min(enc, dec) == 0 else enc * dec * d
    return dict(d_model=width, encoder_attention_heads=enc, decoder_attention_heads=dec,
                encoder_layers=r.choice([1, 2, 3]), decoder_layers=r.choice([1, 2, 3]), encoder_ffn_dim=20,
                decoder_ffn_dim=20, max_position_embeddings=64, vocab_size=VOCAB, pad_token_id=2, bos_token_id=0,
                eos_token_id=1, decoder_start_token_id=1)


def draw_marian(r):
    return dict(draw_bart(r), pad_token_id=2, decoder_start_token_id=2, scale_embedding=r.random() < 0.5)


def draw_persimmon(r):
    """Per-head [q | k | v] in one projection, per-head query/key layer norms, partial rotary."""
    c = _tied_heads(r, grouped=False)
    c.pop("num_key_value_heads")
    d = c["hidden_size"] // c["num_attention_heads"]
    factor = r.choice([f for f in (0.25, 0.5, 1.0) if (d * f) % 2 == 0 and d * f >= 2])
    return dict(c, qk_layernorm=r.random() < 0.7,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": factor})


def draw_gpt_bigcode(r):
    return dict(draw_gpt2(r), multi_query=r.random() < 0.6)


def _roberta(r):
    return dict(draw_bert(r), pad_token_id=1)


FAMILIES: dict[str, Family] = {
    "llama": Family(tf.LlamaForCausalLM, tf.LlamaConfig, draw_llama, "causal"),
    "mistral": Family(tf.MistralForCausalLM, tf.MistralConfig, draw_mistral, "causal"),
    "qwen2": Family(tf.Qwen2ForCausalLM, tf.Qwen2Config, _tied_heads, "causal"),
    "qwen3": Family(tf.Qwen3ForCausalLM, tf.Qwen3Config, draw_qwen3, "causal"),
    "gemma": Family(tf.GemmaForCausalLM, tf.GemmaConfig, _free_heads, "causal"),
    "gemma2": Family(tf.Gemma2ForCausalLM, tf.Gemma2Config, draw_gemma2, "causal"),
    "gemma3_text": Family(tf.Gemma3ForCausalLM, tf.Gemma3TextConfig, draw_gemma3, "causal"),
    "phi3": Family(tf.Phi3ForCausalLM, tf.Phi3Config, draw_phi3, "causal"),
    "gpt2": Family(tf.GPT2LMHeadModel, tf.GPT2Config, draw_gpt2, "causal"),
    "gpt_neox": Family(tf.GPTNeoXForCausalLM, tf.GPTNeoXConfig, draw_gpt_neox, "causal"),
    "opt": Family(tf.OPTForCausalLM, tf.OPTConfig, draw_opt, "causal"),
    "falcon": Family(tf.FalconForCausalLM, tf.FalconConfig, draw_falcon, "causal"),
    "bloom": Family(tf.BloomForCausalLM, tf.BloomConfig, draw_bloom, "causal"),
    "olmo2": Family(tf.Olmo2ForCausalLM, tf.Olmo2Config, draw_olmo2, "causal"),
    "bert": Family(tf.BertForMaskedLM, tf.BertConfig, draw_bert, "masked"),
    "roberta": Family(tf.RobertaForMaskedLM, tf.RobertaConfig, _roberta, "masked"),
    "t5": Family(tf.T5ForConditionalGeneration, tf.T5Config, draw_t5, "seq2seq"),
    "bart": Family(tf.BartForConditionalGeneration, tf.BartConfig, draw_bart, "seq2seq"),
    "marian": Family(tf.MarianMTModel, tf.MarianConfig, draw_marian, "seq2seq"),
    # the risky ones: partial rotary with per-head norms, latent attention, learned sinks, experts
    "stablelm": Family(tf.StableLmForCausalLM, tf.StableLmConfig, draw_stablelm, "causal"),
    "deepseek_v3": Family(tf.DeepseekV3ForCausalLM, tf.DeepseekV3Config, draw_deepseek_v3, "causal"),
    "gpt_oss": Family(tf.GptOssForCausalLM, tf.GptOssConfig, draw_gpt_oss, "causal"),
    "qwen3_moe": Family(tf.Qwen3MoeForCausalLM, tf.Qwen3MoeConfig, draw_qwen3_moe, "causal"),
    "persimmon": Family(tf.PersimmonForCausalLM, tf.PersimmonConfig, draw_persimmon, "causal"),
    "gpt_bigcode": Family(tf.GPTBigCodeForCausalLM, tf.GPTBigCodeConfig, draw_gpt_bigcode, "causal"),
}


def in_float64(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` in float64 as ``from_pretrained(dtype=torch.float64)`` gives it (``config.dtype`` too, which the saved
    config records and load_pruned builds in), its experts run one by one (transformers' grouped_mm takes no float64:
    torch 2.13)."""
    config: Any = model.config
    config.dtype = torch.float64
    if getattr(config, "_experts_implementation", None) not in (None, "eager"):
        config._experts_implementation = "eager"
    return model.double()


def build(family: str, config_kwargs: dict, implementation: str, seed: int) -> torch.nn.Module:
    """The family's model from ``config_kwargs`` in float64, its biases, norm weights and sinks moved off their
    initial values (support.family_matrix.perturbed_model); ``seed`` fixes the weights."""
    from support.family_matrix import perturbed_model

    spec = FAMILIES[family]
    config = spec.config(**copy.deepcopy(config_kwargs))
    if implementation == "sdpa" and not getattr(spec.cls, "_supports_sdpa", False):
        implementation = "eager"
    model = in_float64(perturbed_model(spec.cls, config, seed=seed, attn_implementation=implementation))
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("sinks"):  # float32 values: load_pruned builds in float32 (docs/benchmarks.md)
                parameter.copy_((parameter + torch.randn_like(parameter)).float())
    return model


# -- random inputs and head sets -------------------------------------------------------------------------------------
def padded_inputs(r: random.Random, seq2seq: bool) -> dict:
    """3 rows of 3 to 9 ids, right-padded with the pad id (headlab.data.inputs._pad), one row full length, at most 2
    pads in a row: a padded query that a sliding window of 3 gives no real key is NaN in transformers' own forward,
    and its values NaN in every later query's weighted sum (0 x NaN), before headlab does anything."""
    width = r.randint(3, 9)
    lengths = [width] + [r.randint(max(1, width - 2), width) for _ in range(2)]
    ids = torch.full((3, width), SPECIAL["pad_token_id"], dtype=torch.long)
    mask = torch.zeros(3, width, dtype=torch.long)
    for i, n in enumerate(lengths):
        ids[i, :n] = torch.tensor([r.randint(3, VOCAB - 1) for _ in range(n)])
        mask[i, :n] = 1
    inputs = {"input_ids": ids, "attention_mask": mask}
    if seq2seq:
        targets = [r.randint(2, 6) for _ in range(3)]
        dec = torch.full((3, max(targets)), SPECIAL["pad_token_id"], dtype=torch.long)
        dec_mask = torch.zeros_like(dec)
        for i, n in enumerate(targets):
            dec[i, :n] = torch.tensor([r.randint(3, VOCAB - 1) for _ in range(n)])
            dec_mask[i, :n] = 1
        inputs.update(decoder_input_ids=dec, decoder_attention_mask=dec_mask)
    return inputs


def kept_positions(inputs: dict) -> torch.Tensor:
    return (inputs.get("decoder_attention_mask", inputs["attention_mask"])).bool()


def logits(model, inputs: dict) -> torch.Tensor:
    """The logits of the positions the masks keep."""
    with torch.no_grad():
        out = model(**inputs, **({"use_cache": False} if "decoder_input_ids" in inputs else {})).logits
    return out[kept_positions(inputs)]


def draw_heads(r: random.Random, n_heads: int, n_kv: int) -> list[int]:
    """One of: one head, every head, every query head of one key/value group, all but one, a random subset."""
    group = n_heads // n_kv
    pattern = r.choice(["one", "all", "group", "all_but_one", "subset"])
    if pattern == "one":
        return [r.randrange(n_heads)]
    if pattern == "all":
        return list(range(n_heads))
    if pattern == "group":
        j = r.randrange(n_kv)
        return list(range(j * group, (j + 1) * group))
    if pattern == "all_but_one":
        left = r.randrange(n_heads)
        return [h for h in range(n_heads) if h != left]
    return sorted(r.sample(range(n_heads), r.randint(1, n_heads)))


def draw_spec(r: random.Random, blocks) -> dict:
    """Heads of a random non-empty choice of blocks, of every kind the model has."""
    live = [b for b in blocks if not b.idle and b.n_heads]
    chosen = [b for b in live if r.random() < 0.6] or [r.choice(live)]
    return {b.key: draw_heads(r, b.n_heads, b.n_kv_heads) for b in chosen}


# -- the checks --------------------------------------------------------------------------------------------------------
def _o_width(block) -> int:
    """The output projection's input width (Linear: in_features; GPT-2's Conv1D: weight rows)."""
    return block.o.in_features if hasattr(block.o, "in_features") else block.o.weight.shape[0]


def reference_masked(model, blocks, spec: dict, inputs: dict) -> torch.Tensor:
    """The logits with the heads' slices of each output projection's input zeroed by this script's own pre-hooks."""
    handles = []
    for block in blocks:
        if block.key not in spec:
            continue
        width = _o_width(block) // block.n_heads

        def zero(module, args, heads=tuple(spec[block.key]), width=width):
            x = args[0].clone()
            for h in heads:
                x[..., h * width:(h + 1) * width] = 0
            return (x, *args[1:])
        handles.append(block.o.register_forward_pre_hook(zero))
    try:
        return logits(model, inputs)
    finally:
        for handle in handles:
            handle.remove()


def check_gates(model, inputs: dict, before: torch.Tensor) -> None:
    with gates_attached(model, ScalarGates.for_model(model)):
        if not torch.equal(logits(model, inputs), before):
            raise Fail("gates", "scalar gates at one changed the logits")
    gates = HardConcreteGates.for_model(model, init_log_alpha=10.0).double().eval()
    with gates_attached(model, gates):
        if not torch.equal(logits(model, inputs), before):
            raise Fail("gates", "Hard Concrete gates open (eval) changed the logits")
    if any(m._forward_pre_hooks or m._forward_hooks for m in model.modules()):
        raise Fail("gates", "hooks left behind")


def check_mask(model, blocks, spec: dict, inputs: dict) -> torch.Tensor:
    expected = reference_masked(model, blocks, spec, inputs)
    with mask_heads(model, spec):
        got = logits(model, inputs)
    ok, diff = close(got, expected, TOLERANCE)
    if not ok:
        raise Fail("mask", f"mask_heads differs from the zeroed output-projection input by {diff:.3g}")
    with gates_attached(model, ScalarGates.for_model(model)), mask_heads(model, spec):
        ok, diff = close(logits(model, inputs), expected, TOLERANCE)
    if not ok:
        raise Fail("mask", f"mask_heads under scalar gates at one differs from the reference by {diff:.3g}")
    gates = HardConcreteGates.for_model(model, init_log_alpha=10.0).double().eval()
    with torch.no_grad():
        for key, heads in spec.items():  # closed: P(g = 0) > P(g = 1), the test-time gate 0
            gates.log_alpha[f"{key[0]}_{key[1]}"][heads] = -10.0
    with gates_attached(model, gates):
        ok, diff = close(logits(model, inputs), expected, TOLERANCE)
    if not ok:
        raise Fail("mask", f"Hard Concrete gates closed on the heads (eval) differ from the reference by {diff:.3g}")
    return got


def greedy(model, inputs: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy cached generation (4 tokens) on the rows moved to left padding: tokens and per-step scores."""
    ids, mask = inputs["input_ids"], inputs["attention_mask"]
    left = torch.stack([torch.cat([row[~m.bool()], row[m.bool()]]) for row, m in zip(ids, mask)])
    left_mask = torch.stack([torch.cat([m[~m.bool()], m[m.bool()]]) for m in mask])
    with torch.no_grad():
        out = model.generate(input_ids=left, attention_mask=left_mask, max_new_tokens=4, do_sample=False,
                             output_scores=True, return_dict_in_generate=True, pad_token_id=SPECIAL["pad_token_id"])
    return out.sequences, torch.stack(out.scores)


def expected_counts(blocks, spec: dict) -> dict:
    """{key: (query heads, key/value heads)} after removing ``spec``. A key/value head goes with its whole group; where
    the groups left are of unequal sizes, each query head left gets a copy of its key/value head (``repeat_kv`` maps
    equal groups only: headlab.heads.kv_heads_kept's rule, restated)."""
    counts = {}
    for b in blocks:
        if b.idle:
            continue
        removed = set(spec.get(b.key, ()))
        left = [h for h in range(b.n_heads) if h not in removed]
        group = b.n_heads // b.n_kv_heads
        sizes = Counter(h // group for h in left)
        n_kv = len(sizes) if len(set(sizes.values())) <= 1 else len(left)
        counts[b.key] = (len(left), n_kv)
    return counts


def check_shapes(model, blocks_before, spec: dict) -> None:
    before = {b.key: b for b in blocks_before}
    want = expected_counts(blocks_before, spec)
    for b in attention_blocks(model):
        if b.idle:
            continue
        got = (b.n_heads, b.n_kv_heads)
        if b.n_heads and got != want[b.key]:
            raise Fail("prune", f"{b.key}: {got} (query, key/value) heads after pruning, expected {want[b.key]}")
        if not b.n_heads and want[b.key][0]:
            raise Fail("prune", f"{b.key}: no head left, expected {want[b.key][0]}")
        old = before[b.key]
        if b.n_heads and _o_width(b) != _o_width(old) // old.n_heads * b.n_heads:
            raise Fail("prune", f"{b.key}: output projection reads {_o_width(b)} columns for {b.n_heads} heads "
                                f"(was {_o_width(old)} for {old.n_heads})")


def check_prune(model, blocks, spec: dict, inputs: dict, masked: torch.Tensor, causal: bool, notes: list):
    """A pruned copy of ``model`` (None where pruning was refused), checked against masking."""
    pruned = copy.deepcopy(model)
    try:
        prune_heads(pruned, spec)
    except HeadlabError as error:
        notes.append(f"prune refused: {str(error).splitlines()[0][:160]}")
        return None
    check_shapes(pruned, blocks, spec)
    ok, diff = close(logits(pruned, inputs), masked, TOLERANCE)
    if not ok:
        raise Fail("prune", f"pruned differs from masked by {diff:.3g}")
    if causal and not greedy(model, inputs)[1].isfinite().all():
        notes.append("generation not checked: the model's own scores on left padding are NaN or inf (float64's lowest "
                     "mask value overflowing, before headlab does anything)")
    elif causal:
        with mask_heads(model, spec):
            tokens, scores = greedy(model, inputs)
        got_tokens, got_scores = greedy(pruned, inputs)
        if not torch.equal(got_tokens, tokens):
            raise Fail("prune", f"generated {got_tokens.tolist()}, masked {tokens.tolist()}")
        ok, diff = close(got_scores, scores, TOLERANCE)
        if not ok:
            raise Fail("prune", f"generation scores differ from masked by {diff:.3g}")
    return pruned


AUTO = {"causal": tf.AutoModelForCausalLM, "masked": tf.AutoModelForMaskedLM, "seq2seq": tf.AutoModelForSeq2SeqLM}


def check_save(model, pruned, spec: dict, kind: str, inputs: dict, notes: list) -> None:
    """save_pruned, then load_pruned: the pruned model's logits to the bit; plain transformers: the logits of the
    unpruned model saved and loaded by transformers the same way, with the heads masked (the same loading path on both
    sides: transformers recomputes some buffers, Gemma's embedding scale, in float32)."""
    expected = logits(pruned, inputs)
    with tempfile.TemporaryDirectory() as directory, tempfile.TemporaryDirectory() as unpruned:
        try:
            save_pruned(pruned, directory)
        except HeadlabError as error:
            notes.append(f"save refused: {str(error).splitlines()[0][:160]}")
            return
        # load_pruned builds in the default dtype: float32, exact here (every weight is float32-valued, see build)
        reloaded = in_float64(load_pruned(directory))
        if not torch.equal(logits(reloaded, inputs), expected):
            raise Fail("save", f"load_pruned differs by {close(logits(reloaded, inputs), expected, 0)[1]:.3g}")
        how = json.loads((Path(directory) / "headlab_pruning.json").read_text())["portable"]["how"]
        if how not in ("remote code", "standard config"):
            notes.append(f"plain loading: {how}")
            return
        plain, info = AUTO[kind].from_pretrained(directory, trust_remote_code=how == "remote code",
                                                 output_loading_info=True, dtype=torch.float64)
        plain = in_float64(plain.eval())
        if info["missing_keys"] or info["unexpected_keys"] or info["mismatched_keys"]:
            raise Fail("save", f"plain transformers ({how}): {info}")
        model.save_pretrained(unpruned)
        whole = in_float64(AUTO[kind].from_pretrained(unpruned, dtype=torch.float64).eval())
        with mask_heads(whole, spec):
            masked = logits(whole, inputs)
        ok, diff = close(logits(plain, inputs), masked, TOLERANCE)
        if not ok:
            raise Fail("save", f"plain transformers ({how}) differs from the masked model by {diff:.3g}")


def check_twice(model, r: random.Random, spec: dict, inputs: dict, pruned, notes: list) -> None:
    """Part of ``spec`` pruned, then the rest: the model pruned by ``spec`` at once."""
    first = {key: [h for h in heads if r.random() < 0.5] for key, heads in spec.items()}
    first = {key: heads for key, heads in first.items() if heads}
    rest = {key: [h for h in heads if h not in first.get(key, ())] for key, heads in spec.items()}
    rest = {key: heads for key, heads in rest.items() if heads}
    if not first or not rest:
        return
    twice = copy.deepcopy(model)
    prune_heads(twice, first)
    with mask_heads(twice, to_current_numbering(twice, rest)):  # the rest masked on the pruned model, by name
        ok, diff = close(logits(twice, inputs), logits(pruned, inputs), TOLERANCE)
    if not ok:
        raise Fail("twice", f"pruned {first}, the rest {rest} masked, differs from all pruned by {diff:.3g}")
    prune_heads(twice, to_current_numbering(twice, rest))
    counts = {b.key: (b.n_heads, b.n_kv_heads) for b in attention_blocks(twice)}
    once = {b.key: (b.n_heads, b.n_kv_heads) for b in attention_blocks(pruned)}
    if {k: n for k, (n, _) in counts.items()} != {k: n for k, (n, _) in once.items()}:
        raise Fail("twice", f"pruned in two steps {first} then {rest}: heads {counts}, at once {once}")
    if counts != once:  # the same heads, more key/value copies: larger, not wrong
        notes.append(f"twice: key/value heads {counts} in two steps, {once} at once")
    ok, diff = close(logits(twice, inputs), logits(pruned, inputs), TOLERANCE)
    if not ok:
        raise Fail("twice", f"pruned in two steps {first} then {rest} differs from at once by {diff:.3g}")


def check_fused(model, seq2seq: bool) -> None:
    import numpy as np

    from headlab.capture import not_streamable
    from headlab.data.frequencies import TokenFrequencies
    from headlab.functions import AnalysisConfig, analyze_heads
    from support.treebank import SAMPLE_CONLLU
    from test_chunked_statistics import _assert_close, _written
    from test_fused_statistics import word_tokenizer

    tokenizer = word_tokenizer()
    with tempfile.TemporaryDirectory() as directory:
        path = Path(directory) / "tb.conllu"
        path.write_text(SAMPLE_CONLLU, encoding="utf-8")
        written = []
        for engine in ("eager", "chunked", "fused"):
            counts = np.arange(tokenizer.vocab_size, dtype=np.int64) % 5 + 1
            config = AnalysisConfig(batch_size=3, top_frequent=3, window=4, top_k=3, engine=engine, sensitivity=True,
                                    query_chunk=3 if engine != "eager" else None)
            result = analyze_heads(model, tokenizer, path, target_conllu=path if seq2seq else None, config=config,
                                   frequencies=TokenFrequencies(counts, "hand-set"))
            written.append(_written(result.results.values(), Path(directory) / engine))
        # outside transformers' attention interface (Bloom, Falcon) the chunks are cut from the eager maps, whose
        # float32 softmax the fused passes sum in float32 (up to 6e-8 relative; the default engine runs eager there)
        own = 1e-7 if not_streamable(model) else 0.0
        for reference, name, rtol in ((written[1], "chunked", own), (written[0], "eager", 1e-5)):
            try:
                # the eager softmax of most families runs in float32 whatever the model's dtype
                # (tests/test_fused_statistics.FLOAT32_EAGER): relative 1e-5 against it, 1e-8 against chunked
                _assert_close(written[2], reference, atol=1e-8, rtol=rtol)
            except AssertionError as error:
                raise Fail("fused", f"fused statistics differ from {name}: {str(error)[:200]}") from error


def check_lrp(model, what: str, notes: list) -> None:
    """compute_lrp on three sentences: conservation to 1e-8 in float64 (its signature's sum with the biases' share),
    every kept head's score finite (a pruned model's table is in the original numbering: NaN where a head is gone)."""
    from headlab.data.inputs import ImportanceData
    from headlab.importance import compute_lrp, describe_model
    from headlab.surgery import original_heads

    g = torch.Generator().manual_seed(0)
    data = ImportanceData.from_ids([torch.randint(3, VOCAB, (k,), generator=g).tolist() + [1] for k in (4, 6, 8)])
    scores = compute_lrp(copy.deepcopy(model), data, describe_model(model), bootstrap=0)
    for block in attention_blocks(model):
        kept, _ = original_heads(block)
        values = scores.scores[block.kind][block.layer, kept] if kept else torch.zeros(0)
        if not torch.as_tensor(values).isfinite().all():
            raise Fail("lrp", f"{what}: non-finite scores for the kept heads {kept} of {block.key}")
    total = scores.signature["conservation"].get("with_biases") or {}
    gap = max(abs(total["min"] - 1), abs(total["max"] - 1)) if total else 0.0
    if gap > 1e-8:
        raise Fail("lrp", f"{what}: compute_lrp conserved relevance to {gap:.1g} in float64")


def check_confidence(model, pruned, spec: dict, seq2seq: bool) -> None:
    """compute_confidence (default and eager engines) on the pruned model: its table in the original numbering, the
    kept heads' scores those of the masked model (masking changes no map of a kept head), the removed heads' NaN."""
    from headlab.data.inputs import ImportanceData, translate_data
    from headlab.gates import measuring
    from headlab.importance import compute_confidence, describe_model

    g = torch.Generator().manual_seed(0)
    data = ImportanceData.from_ids([torch.randint(3, VOCAB, (k,), generator=g).tolist() + [1] for k in (4, 6, 9)])
    info = describe_model(model)
    if seq2seq:  # the model's own translation, as confidence scores it
        data = translate_data(model, data, info, max_length_a=0.5, max_length_b=3)
    for engine in (None, "eager"):
        with measuring(model, "fuzz: confidence masked"), mask_heads(model, spec):  # as run(mask=) measures
            masked = compute_confidence(model, data, info, engine=engine)
        got = compute_confidence(pruned, data, describe_model(pruned), engine=engine)
        for kind, table in masked.scores.items():
            for (k, layer), heads in spec.items():
                if k != kind:
                    continue
                row = torch.as_tensor(got.scores[kind][layer])
                if not row[heads].isnan().all():
                    raise Fail("numbering", f"{engine or 'default'} engine: removed heads {heads} of {k}:{layer} "
                                            f"scored {row[heads].tolist()} on the pruned model")
            want, have = torch.as_tensor(table), torch.as_tensor(got.scores[kind])
            kept = ~have.isnan()
            ok, diff = close(have[kept], want[kept], 1e-9)
            if not ok or not torch.equal(kept, ~want.isnan() & kept) or kept.sum() + sum(map(len, (
                    h for (k, _), h in spec.items() if k == kind))) != (~want.isnan()).sum():
                raise Fail("numbering", f"{engine or 'default'} engine, {kind}: the pruned model's confidence "
                                        f"differs from the masked model's by {diff:.3g} or names other heads")


def alibi_twice(model) -> bool:
    """Falcon with ALiBi in eager mode adds the bias twice (transformers 5.24; tests/test_falcon_alibi_eager.py): its
    output_attentions is no reference (headlab refuses an eager-loaded one; its SDPA capture is checked there)."""
    return model.config.model_type == "falcon" and bool(model.config.alibi)


# -- one case --------------------------------------------------------------------------------------------------------
@dataclass
class Case:
    seed: int
    family: str
    config: dict
    spec: dict
    outcome: str = "pass"
    detail: str = ""


def run_case(seed: int, family: str, skip: frozenset = frozenset()) -> Case:
    r = random.Random(f"{family}:{seed}")
    spec_family = FAMILIES[family]
    config = spec_family.draw(r)
    case = Case(seed, family, config, {})
    notes: list[str] = []
    try:
        try:
            model = build(family, config, "sdpa", seed)
            eager = build(family, config, "eager", seed)
        except Exception as error:  # a config the family's own class does not accept: the drawing is wrong
            case.outcome, case.detail = "skipped", f"does not build: {type(error).__name__}: {str(error)[:200]}"
            return case
        seq2seq = spec_family.kind == "seq2seq"
        inputs = padded_inputs(r, seq2seq)
        try:
            blocks = attention_blocks(model)
        except HeadlabError as error:
            case.outcome, case.detail = "refused", str(error).splitlines()[0][:200]
            return case
        case.spec = draw_spec(r, blocks)
        before = logits(model, inputs)
        masked = check_mask(model, blocks, case.spec, inputs)
        failed: list[Fail] = []
        pruned = None

        def step(name: str, check: Callable, *args) -> None:
            """One check; a refusal (HeadlabError) is a note, a Fail is kept; the other checks go on."""
            nonlocal pruned
            if name in skip:
                return
            try:
                out = check(*args)
                if name == "prune":
                    pruned = out
            except HeadlabError as error:
                notes.append(f"{name} refused: {str(error).splitlines()[0][:200]}")
            except Fail as error:
                failed.append(error)

        step("gates", check_gates, model, inputs, before)
        if not alibi_twice(eager):
            step("capture", family_sweep.check_capture, eager, model, [b for b in blocks if not b.idle],
                 {k: v for k, v in inputs.items() if k != "decoder_attention_mask"}, TOLERANCE)
        step("prune", check_prune, model, blocks, case.spec, inputs, masked, spec_family.kind == "causal", notes)
        if pruned is not None:
            step("save", check_save, model, pruned, case.spec, spec_family.kind, inputs, notes)
            step("twice", check_twice, model, r, case.spec, inputs, pruned, notes)
            step("numbering", check_confidence, model, pruned, case.spec, seq2seq)
        step("fused", check_fused, model, seq2seq)
        if not seq2seq:
            step("lrp", check_lrp, model, "model", notes)
            if pruned is not None:
                step("lrp", check_lrp, pruned, "pruned", notes)
        if failed:
            raise Fail(",".join(dict.fromkeys(f.check for f in failed)), "\n  ".join(str(f) for f in failed))
    except Fail as error:
        case.outcome, case.detail = "FAIL", str(error)
    except HeadlabError as error:
        case.outcome, case.detail = "refused", str(error).splitlines()[0][:300]
    except Exception as error:
        case.outcome = "CRASH"
        case.detail = f"{type(error).__name__}: {str(error)[:300]}\n{traceback.format_exc()}"
    if case.outcome == "pass" and notes:
        case.detail = "; ".join(notes)
    return case


def describe(case: Case) -> str:
    head = f"[{case.outcome}] seed={case.seed} family={case.family}"
    if case.outcome in ("FAIL", "CRASH", "refused"):
        detail = case.detail if len(case.detail) < 3000 else case.detail[:300] + " ...\n" + case.detail[-2500:]
        return (f"{head}\n  config={case.config}\n  heads={case.spec}\n  {detail}\n"
                f"  replay: --replay {case.seed} {case.family}")
    return f"{head} heads={case.spec}" + (f"  ({case.detail})" if case.detail else "")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--budget", type=float, default=600.0, help="seconds for the whole campaign")
    parser.add_argument("--seeds", type=int, default=10 ** 9, help="at most this many seeds per family")
    parser.add_argument("--first-seed", type=int, default=0)
    parser.add_argument("--only", nargs="+", choices=list(FAMILIES), help="these families only")
    parser.add_argument("--skip", nargs="+", choices=CHECKS, default=[], help="checks left out (for speed)")
    parser.add_argument("--replay", nargs=2, metavar=("SEED", "FAMILY"), help="one case, with its traceback")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    torch.set_num_threads(1)
    skip = frozenset(args.skip)
    if args.replay:
        case = run_case(int(args.replay[0]), args.replay[1], skip)
        print(describe(case))
        sys.exit(case.outcome in ("FAIL", "CRASH"))
    families = args.only or list(FAMILIES)
    tally: dict[str, Counter] = {f: Counter() for f in families}
    start = time.monotonic()
    seed = args.first_seed
    while seed < args.first_seed + args.seeds and time.monotonic() - start < args.budget:
        for family in families:
            if time.monotonic() - start >= args.budget:
                break
            case = run_case(seed, family, skip)
            tally[family][case.outcome] += 1
            print(describe(case), flush=True)
        seed += 1
    print(f"\n{time.monotonic() - start:.0f} s, seeds {args.first_seed}..{seed - 1}")
    for family, counts in tally.items():
        print(f"  {family:12} " + " ".join(f"{k}={v}" for k, v in sorted(counts.items())))
    sys.exit(any(c["FAIL"] or c["CRASH"] for c in tally.values()))


if __name__ == "__main__":
    main()
