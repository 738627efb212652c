"""A model whose attention heads were removed by headlab, loadable with plain transformers.

headlab copies this file next to the weights of a pruned model (as ``pruned_heads.py``, with
the line ``BASE_CLASS = ...`` naming the original class) and points ``auto_map`` in
config.json at :class:`PrunedModel`, so that

    AutoModelForSeq2SeqLM.from_pretrained(path, trust_remote_code=True)   # or ...CausalLM, ...

rebuilds it without headlab installed. It imports only torch and transformers (and accelerate's
``align_module_device`` where accelerate offloaded a T5 stack's table). The model is
the original class; before the weights are read, the projections of the pruned attention
layers are resized and the attention modules' head counts set as config.json's
``headlab_pruned`` plan says (the plan is written by ``headlab.portable``). A layer left with
no head computes what the full layer does with no head: the output projection's bias (zero
without one), so that the residual path carries the rest (Voita et al. 2019, footnote 9). A pruned
T5 stack (T5, mT5, Switch Transformers, LongT5), whose first layer hands its position bias of every
head to the others, has each layer handed its kept heads' columns by a pre-hook (the plan's
``shared_bias``; :class:`StackBiasHook`, an object that a deep copy or pickle of the model carries).

A PEFT adapter of a pruned model is saved with the heads the pruning kept (``headlab_adapter.json``:
:func:`save_adapter`) and refused on a pruned attention layer where that record is missing or another
(:func:`load_checked_adapter`, :func:`peft_from_pretrained`; peft's own loaders by the load_state_dict hooks):
an adapter of another pruning with the same head counts fits every shape.
"""

import contextlib
import functools
import importlib
import inspect
import json
import os
import sys
import threading
import types

import torch
import transformers
from torch import nn
from torch.overrides import TorchFunctionMode

BASE_CLASS = "PreTrainedModel"  # replaced by the pruned model's own class when copied

_BASE = getattr(transformers, BASE_CLASS)


def cache_argument(kwargs: dict):
    """The key/value cache an attention module was called with: transformers 5.24 renamed the
    argument ``past_key_values`` to ``cache`` (the old name is deprecated until 5.40); GPT-NeoX,
    Falcon, Bloom and GPT-BigCode call it ``layer_past``, FSMT ``layer_state``."""
    for name in ("cache", "past_key_values", "layer_past", "layer_state"):
        if kwargs.get(name) is not None:
            return kwargs[name]
    return None


def _set_submodule(model: nn.Module, path: str, module: nn.Module) -> None:
    parent_path, _, name = path.rpartition(".")
    setattr(model.get_submodule(parent_path) if parent_path else model, name, module)


class NoInputConv1d(nn.Conv1d):
    """A 1x1 convolution left with no input channel (the output projection of a SqueezeBERT layer with no head left,
    ``post_attention.conv1d``): sum over no input = its bias at every position of ``[batch, 0, seq]``, which torch's
    convolution refuses to compute from an empty input. Its weight ``[out, 0, 1]`` and bias keep their names."""

    def forward(self, x):
        out = x.new_zeros(x.shape[0], self.out_channels, x.shape[-1])
        return out if self.bias is None else out + self.bias.to(out.dtype)[:, None]


def _resized(old: nn.Module, kind: str, n_in: int, n_out: int, *extra) -> nn.Module:
    """A projection of the pruned shape, on the old one's device and dtype (the weights follow); ``extra``: a 1x1
    convolution's groups, a grouped linear map's."""
    weight = old.weight
    if kind == "conv1d_k1":  # SqueezeBERT's 1x1 nn.Conv1d over [batch, channels, seq], (groups,) in extra
        cls = NoInputConv1d if n_in == 0 else nn.Conv1d
        return cls(n_in, n_out, kernel_size=1, groups=int(extra[0]) if extra else 1, bias=old.bias is not None,
                   device=weight.device, dtype=weight.dtype)
    if kind == "conv1d":  # transformers' Conv1D (GPT-2): weight [in, out]
        from transformers.pytorch_utils import Conv1D

        new = Conv1D(n_out, n_in)
        return new.to(device=weight.device, dtype=weight.dtype)
    if kind == "grouped_linear":  # DeepSeek-V4's o_a_proj (DeepseekV4GroupedLinear): in per group, out, (groups,)
        new = type(old)(n_in, n_out, int(extra[0]), bias=old.bias is not None)
        return new.to(device=weight.device, dtype=weight.dtype)
    if kind == "quant_linear":  # I-BERT's QuantLinear (quant_mode=False): its own class, its integer buffers resized
        new = type(old)(n_in, n_out, bias=old.bias is not None, weight_bit=old.weight_bit, bias_bit=old.bias_bit,
                        per_channel=old.per_channel, quant_mode=old.quant_mode)
        return new.to(device=weight.device, dtype=weight.dtype)
    return nn.Linear(n_in, n_out, bias=old.bias is not None, device=weight.device, dtype=weight.dtype)


LIST_OUTPUTS = frozenset({"transformers.models.openai.modeling_openai.Attention"})
"""Attention classes whose forward returns a list, which their caller extends with a list (GPT-1's ``Block``:
``[h] + attn_outputs[1:]``; a tuple there raises): a layer of theirs with no head left returns a list too."""

PAIRED_OUTPUTS = frozenset({"transformers.models.ibert.modeling_ibert.IBertSelfAttention"})
"""Attention classes whose forward returns ``(outputs, scaling factors)``, two tuples (I-BERT's: ``((context,
probs), (factors))``, the factors None with quant_mode=False): a layer of theirs with no head left returns such a
pair, its factors None."""

CHANNELS_FIRST = frozenset({"transformers.models.squeezebert.modeling_squeezebert.SqueezeBertSelfAttention"})
"""Attention classes over channels-first hidden states, ``[batch, channels, seq]``, returning a dict (SqueezeBERT's:
``{"context_layer": [batch, heads x d, seq]}``, and ``"attention_score"`` with output_attentions, read by its
SqueezeBertModule): a layer of theirs with no head left returns ``[batch, 0, seq]`` so, its scores None."""

TIME_FIRST = frozenset({"transformers.models.fsmt.modeling_fsmt.Attention"})
"""Attention classes whose hidden states are time-first, ``[T, B, C]`` (FSMT's: its cross-attention reads the
encoder's output from its ``key`` argument, ``[S, B, C]``): a layer of theirs with no head left keeps the cache in
step with ``[B, 1, T, 1]`` placeholders all the same."""

MERGED_CACHES = frozenset({"transformers.models.t5gemma2.modeling_t5gemma2.T5Gemma2MergedAttention"})
"""Attention classes that attend over [their own tokens | the encoder's] in one softmax and cache both, the self part
in the cache's ``self_attention_cache`` and the encoder's in its ``cross_attention_cache`` (T5Gemma 2's decoder,
handed ``encoder_hidden_states`` at every step): a layer of theirs with no head left keeps both in step."""

OUTPUT_BIASES = {"transformers.models.gpt_neox_japanese.modeling_gpt_neox_japanese.GPTNeoXJapaneseAttention":
                 "dense_bias"}
"""Attention classes that return last a bias of their own (a parameter, or None) that their caller adds to their
output, their output projection's bias in all but name (GPT-NeoX-Japanese's ``dense_bias``, a vector in the last
layer only: ``(dense(heads), probs, dense_bias)``): a layer of theirs with no head left keeps the parameter (the same
state_dict key) and returns it, Concat() W^O + b = b."""

def output_bias_name(module: nn.Module) -> str | None:
    """The name of the bias ``module`` returns last for its caller to add (:data:`OUTPUT_BIASES`), or None."""
    qualified = f"{type(module).__module__}.{type(module).__qualname__}"
    own = getattr(module, "output_bias", None)  # a layer with no head left says it (a NoHeadAttention's name)
    return OUTPUT_BIASES.get(qualified) or (own if isinstance(own, str) else None)


SECOND_STREAMS = {"transformers.models.luke.modeling_luke.LukeSelfAttention": "entity_hidden_states",
                  # (tokens' output, global tokens' output, probabilities): both through out_proj
                  "transformers.models.pegasus_x.modeling_pegasus_x.PegasusXGlobalLocalAttention":
                      "global_hidden_states"}
"""Attention classes that attend over two streams of hidden states, the second (by the argument named here) after the
first, and return the second's heads' outputs second (LUKE's entities: None where it gets none; its caller
concatenates the two before its output projection): a layer of theirs with no head left returns an empty output for
the second stream too."""


STACKED_STREAMS = {"transformers.models.prophetnet.modeling_prophetnet.ProphetNetNgramSelfAttention": "ngram"}
"""Attention classes whose hidden states stack further streams after the tokens' along the sequence, as many rows
each, and which cache the tokens' keys and values only (ProphetNet's decoder self-attention: ``[main | ngram
predicting streams]``, the attribute naming how many follow): a layer of theirs with no head left keeps the cache in
step with the tokens' length, which the decoder reads the next position from."""

def _fsmt_forward(self, query, key, key_padding_mask=None, layer_state=None, attn_mask=None, output_attentions=False,
                  **kwargs):
    """FSMT's ``Attention.forward`` (transformers 5.24, modeling_fsmt; time-first [T, B, C]) line for line, but that it
    merges ``num_heads * head_dim`` (the kept heads) where the original merges the query's width ``embed_dim``, which
    a pruned layer's heads no longer fill."""
    from transformers.cache_utils import EncoderDecoderCache

    tgt_len, bsz, embed_dim = query.size()
    assert embed_dim == self.embed_dim
    is_updated, curr_cache = False, None
    if layer_state is not None:
        if isinstance(layer_state, EncoderDecoderCache):
            is_updated = layer_state.is_updated.get(self.layer_idx)
            curr_cache = layer_state.cross_attention_cache if self.encoder_decoder_attention \
                else layer_state.self_attention_cache
        else:
            curr_cache = layer_state
    current_states = key if self.encoder_decoder_attention else query
    if self.encoder_decoder_attention and layer_state is not None and is_updated:
        key_states = curr_cache.layers[self.layer_idx].keys
        value_states = curr_cache.layers[self.layer_idx].values
    else:
        key_states = self.k_proj(current_states).view(-1, bsz, self.num_heads, self.head_dim).permute(1, 2, 0, 3)
        value_states = self.v_proj(current_states).view(-1, bsz, self.num_heads, self.head_dim).permute(1, 2, 0, 3)
        if layer_state is not None:
            key_states, value_states = curr_cache.update(key_states, value_states, self.layer_idx, kwargs=kwargs)
            if self.encoder_decoder_attention:
                layer_state.is_updated[self.layer_idx] = True
    query_states = self.q_proj(query) * self.scaling
    query_states = query_states.view(-1, bsz * self.num_heads, self.head_dim).transpose(0, 1)
    key_states = key_states.reshape(bsz * self.num_heads, -1, self.head_dim)
    value_states = value_states.reshape(bsz * self.num_heads, -1, self.head_dim)
    src_len = key_states.size(1)
    attn_weights = torch.bmm(query_states, key_states.transpose(1, 2))
    if attn_mask is not None:
        attn_weights = attn_weights.view(bsz, self.num_heads, tgt_len, src_len) + attn_mask
        attn_weights = attn_weights.view(bsz * self.num_heads, tgt_len, src_len)
    if key_padding_mask is not None and key_padding_mask.dim() == 0:
        key_padding_mask = None
    if key_padding_mask is not None:
        attn_weights = attn_weights.view(bsz, self.num_heads, tgt_len, src_len)
        attn_weights = attn_weights.masked_fill(key_padding_mask.unsqueeze(1).unsqueeze(2),
                                                torch.finfo(attn_weights.dtype).min)
        attn_weights = attn_weights.view(bsz * self.num_heads, tgt_len, src_len)
    attn_weights = nn.functional.softmax(attn_weights, dim=-1)
    attn_weights_reshaped = attn_weights.view(bsz, self.num_heads, tgt_len, src_len) if output_attentions else None
    if output_attentions:
        attn_weights = attn_weights_reshaped.view(bsz * self.num_heads, tgt_len, src_len)
    attn_probs = nn.functional.dropout(attn_weights, p=self.dropout, training=self.training)
    attn_output = torch.bmm(attn_probs, value_states)
    attn_output = attn_output.transpose(0, 1).contiguous().view(tgt_len, bsz, self.num_heads * self.head_dim)
    return self.out_proj(attn_output), attn_weights_reshaped


def _trocr_forward(self, hidden_states, key_value_states=None, cache=None, attention_mask=None, output_attentions=False,
                   **kwargs):
    """TrOCR's ``TrOCRAttention.forward`` (transformers 5.24, modeling_trocr) line for line (its checks of shapes left
    out), but that it merges ``num_heads * head_dim`` (the kept heads) where the original reshapes to the hidden
    states' width ``embed_dim``, which a pruned layer's heads no longer fill."""
    from transformers.cache_utils import EncoderDecoderCache

    is_cross_attention = key_value_states is not None
    bsz, tgt_len, _ = hidden_states.size()
    query_states = self.q_proj(hidden_states) * self.scaling
    is_updated, curr_cache = False, None
    if cache is not None:
        if isinstance(cache, EncoderDecoderCache):
            is_updated = cache.is_updated.get(self.layer_idx)
            curr_cache = cache.cross_attention_cache if is_cross_attention else cache.self_attention_cache
        else:
            curr_cache = cache
    current_states = key_value_states if is_cross_attention else hidden_states
    if is_cross_attention and cache is not None and is_updated:
        key_states = curr_cache.layers[self.layer_idx].keys
        value_states = curr_cache.layers[self.layer_idx].values
    else:
        key_states = self.k_proj(current_states).view(bsz, -1, self.num_heads, self.head_dim).transpose(1, 2)
        value_states = self.v_proj(current_states).view(bsz, -1, self.num_heads, self.head_dim).transpose(1, 2)
        if cache is not None:
            key_states, value_states = curr_cache.update(key_states, value_states, self.layer_idx, kwargs=kwargs)
            if is_cross_attention and isinstance(cache, EncoderDecoderCache):
                cache.is_updated[self.layer_idx] = True
    proj_shape = (bsz * self.num_heads, -1, self.head_dim)
    query_states = query_states.view(bsz, tgt_len, self.num_heads, self.head_dim).transpose(1, 2).reshape(*proj_shape)
    key_states = key_states.reshape(*proj_shape)
    value_states = value_states.reshape(*proj_shape)
    src_len = key_states.size(1)
    attn_weights = torch.bmm(query_states, key_states.transpose(1, 2))
    if attention_mask is not None:
        attn_weights = attn_weights.view(bsz, self.num_heads, tgt_len, src_len) + attention_mask
        attn_weights = attn_weights.view(bsz * self.num_heads, tgt_len, src_len)
    attn_weights = nn.functional.softmax(attn_weights, dim=-1)
    attn_weights_reshaped = attn_weights.view(bsz, self.num_heads, tgt_len, src_len) if output_attentions else None
    if output_attentions:
        attn_weights = attn_weights_reshaped.view(bsz * self.num_heads, tgt_len, src_len)
    attn_probs = nn.functional.dropout(attn_weights, p=self.dropout, training=self.training)
    attn_output = torch.bmm(attn_probs, value_states).view(bsz, self.num_heads, tgt_len, self.head_dim)
    attn_output = attn_output.transpose(1, 2).reshape(bsz, tgt_len, self.num_heads * self.head_dim)
    return self.out_proj(attn_output), attn_weights_reshaped


def _led_decoder_forward(self, hidden_states, key_value_states=None, cache=None, attention_mask=None,
                         output_attentions=False, **kwargs):
    """LED's ``LEDDecoderAttention.forward`` (transformers 5.24, modeling_led) is TrOCR's but for the cache it returns
    third (its layer unpacks three outputs) and the ``kwargs`` it does not hand the cache's update (it takes none):
    the same, merging ``num_heads * head_dim``."""
    cache = cache if cache is not None else cache_argument(kwargs)  # past_key_values: the deprecated name
    output, weights = _trocr_forward(self, hidden_states, key_value_states, cache, attention_mask, output_attentions)
    return output, weights, cache


def _mvp_forward(self, hidden_states, key_value_states=None, cache=None, attention_mask=None, attn_prompt=None,
                 output_attentions=False, **kwargs):
    """MVP's ``MvpAttention.forward`` (transformers 5.24, modeling_mvp) is TrOCR's but for its layer-wise prompt
    (``attn_prompt``: keys and values of every head prepended to its own): without one, the same, merging
    ``num_heads * head_dim``. Its prompt holds every head of the config (``MvpPrompt`` views its output as
    ``config.encoder_attention_heads`` heads), so a pruned layer cannot take one."""
    if attn_prompt is not None:
        raise ValueError("a pruned MVP attention layer was given a layer-wise prompt (use_prompt=True), whose keys "
                         "and values hold every head of the config: MVP with prompts cannot be pruned")
    cache = cache if cache is not None else cache_argument(kwargs)  # past_key_values: the deprecated name
    return _trocr_forward(self, hidden_states, key_value_states, cache, attention_mask, output_attentions, **kwargs)


def _longformer_forward(self, hidden_states, attention_mask=None, is_index_masked=None, is_index_global_attn=None,
                        is_global_attn=None, output_attentions=False):
    """Longformer's ``LongformerSelfAttention.forward`` (transformers 5.24, modeling_longformer; LED's
    ``LEDEncoderSelfAttention`` is its copy) line for line (its checks of shapes left out), but that it merges
    ``num_heads * head_dim`` (the kept heads) where the original reshapes to the input's width ``embed_dim``, which a
    pruned layer's heads no longer fill. Its helpers read ``num_heads`` (kept in step by pruning) and ``embed_dim``,
    the input's width, which the global queries' gathered hidden states keep."""
    import math

    hidden_states = hidden_states.transpose(0, 1)
    query_vectors = self.query(hidden_states)
    key_vectors = self.key(hidden_states)
    value_vectors = self.value(hidden_states)
    seq_len, batch_size, _ = hidden_states.size()
    query_vectors /= math.sqrt(self.head_dim)
    query_vectors = query_vectors.view(seq_len, batch_size, self.num_heads, self.head_dim).transpose(0, 1)
    key_vectors = key_vectors.view(seq_len, batch_size, self.num_heads, self.head_dim).transpose(0, 1)
    attn_scores = self._sliding_chunks_query_key_matmul(query_vectors, key_vectors, self.one_sided_attn_window_size)
    remove_from_windowed_attention_mask = (attention_mask != 0)[:, :, None, None]
    float_mask = remove_from_windowed_attention_mask.type_as(query_vectors).masked_fill(
        remove_from_windowed_attention_mask, torch.finfo(query_vectors.dtype).min)
    diagonal_mask = self._sliding_chunks_query_key_matmul(float_mask.new_ones(size=float_mask.size()), float_mask,
                                                          self.one_sided_attn_window_size)
    attn_scores += diagonal_mask
    if is_global_attn:
        (max_num_global_attn_indices, is_index_global_attn_nonzero, is_local_index_global_attn_nonzero,
         is_local_index_no_global_attn_nonzero) = self._get_global_attn_indices(is_index_global_attn)
        global_key_attn_scores = self._concat_with_global_key_attn_probs(
            query_vectors=query_vectors, key_vectors=key_vectors,
            max_num_global_attn_indices=max_num_global_attn_indices,
            is_index_global_attn_nonzero=is_index_global_attn_nonzero,
            is_local_index_global_attn_nonzero=is_local_index_global_attn_nonzero,
            is_local_index_no_global_attn_nonzero=is_local_index_no_global_attn_nonzero)
        attn_scores = torch.cat((global_key_attn_scores, attn_scores), dim=-1)
    attn_probs = nn.functional.softmax(attn_scores, dim=-1, dtype=torch.float32)
    attn_probs = torch.masked_fill(attn_probs, is_index_masked[:, :, None, None], 0.0)
    attn_probs = attn_probs.type_as(attn_scores)
    attn_probs = nn.functional.dropout(attn_probs, p=self.dropout, training=self.training)
    value_vectors = value_vectors.view(seq_len, batch_size, self.num_heads, self.head_dim).transpose(0, 1)
    if is_global_attn:
        attn_output = self._compute_attn_output_with_global_indices(
            value_vectors=value_vectors, attn_probs=attn_probs, max_num_global_attn_indices=max_num_global_attn_indices,
            is_index_global_attn_nonzero=is_index_global_attn_nonzero,
            is_local_index_global_attn_nonzero=is_local_index_global_attn_nonzero)
    else:
        attn_output = self._sliding_chunks_matmul_attn_probs_value(attn_probs, value_vectors,
                                                                    self.one_sided_attn_window_size)
    attn_output = attn_output.transpose(0, 1).reshape(seq_len, batch_size, self.num_heads * self.head_dim).contiguous()
    if is_global_attn:
        global_attn_output, global_attn_probs = self._compute_global_attn_output_from_hidden(
            hidden_states=hidden_states, max_num_global_attn_indices=max_num_global_attn_indices,
            is_local_index_global_attn_nonzero=is_local_index_global_attn_nonzero,
            is_index_global_attn_nonzero=is_index_global_attn_nonzero,
            is_local_index_no_global_attn_nonzero=is_local_index_no_global_attn_nonzero,
            is_index_masked=is_index_masked)
        nonzero_global_attn_output = global_attn_output[
            is_local_index_global_attn_nonzero[0], :, is_local_index_global_attn_nonzero[1]]
        attn_output[is_index_global_attn_nonzero[::-1]] = nonzero_global_attn_output.view(
            len(is_local_index_global_attn_nonzero[0]), -1)
        attn_probs[is_index_global_attn_nonzero] = 0
    outputs = (attn_output.transpose(0, 1),)
    if output_attentions:
        outputs += (attn_probs,)
    return outputs + (global_attn_probs,) if (is_global_attn and output_attentions) else outputs


def _pegasus_x_forward(self, token_hidden_states, global_hidden_states, attention_mask=None, **kwargs):
    """PEGASUS-X's ``PegasusXGlobalLocalAttention.forward`` (transformers 5.24, modeling_pegasus_x) line for line, but
    that it merges ``num_heads * head_dim`` (the kept heads) where the original views the heads' outputs at the input's
    width, which a pruned layer's heads no longer fill. Its helpers read the head count and size from ``dim``."""
    import importlib

    modeling = importlib.import_module(type(self).__module__)  # DimensionInfo
    width = self.num_heads * self.head_dim
    dim = modeling.DimensionInfo(
        batch_size=token_hidden_states.shape[0], seq_len=token_hidden_states.shape[1], block_size=self.block_size,
        num_heads=self.num_heads, hidden_dim=width, dim_per_head=self.head_dim,
        num_blocks=token_hidden_states.shape[1] // self.block_size, global_len=global_hidden_states.shape[1],
        padded_seq_len=token_hidden_states.shape[1])
    local_q = self._shape(self.q_proj(token_hidden_states) * self.scaling, seq_len=dim.padded_seq_len,
                          bsz=dim.batch_size)
    local_k = self._shape(self.k_proj(token_hidden_states), seq_len=dim.padded_seq_len, bsz=dim.batch_size)
    local_v = self._shape(self.v_proj(token_hidden_states), seq_len=dim.padded_seq_len, bsz=dim.batch_size)
    global_q = self._shape(self.q_proj(global_hidden_states) * self.scaling, seq_len=dim.global_len,
                           bsz=dim.batch_size)
    global_k = self._shape(self.k_proj(global_hidden_states), seq_len=dim.global_len, bsz=dim.batch_size)
    global_v = self._shape(self.v_proj(global_hidden_states), seq_len=dim.global_len, bsz=dim.batch_size)
    global_attn_output, global_attn_probs = self.compute_global_attention_representations(
        global_q=global_q, global_k=global_k, global_v=global_v, local_k=local_k, local_v=local_v,
        mask=attention_mask, dim=dim)
    local_attn_output, local_attn_probs = self.compute_local_attention_representations(
        global_k=global_k, global_v=global_v, local_q=local_q, local_k=local_k, local_v=local_v,
        mask=attention_mask, dim=dim)
    global_attn_output = global_attn_output.transpose(1, 2).contiguous().view(dim.batch_size, dim.global_len, width)
    global_attn_output = self.out_proj(global_attn_output)
    local_attn_output = local_attn_output.permute(0, 2, 3, 1, 4).contiguous()
    local_attn_output = local_attn_output.view(dim.batch_size, dim.padded_seq_len, width)
    local_attn_output = self.out_proj(local_attn_output)
    return local_attn_output, global_attn_output, {"global": global_attn_probs, "local": local_attn_probs}


def _prophetnet_attention_forward(self, hidden_states, key_value_states=None, attention_mask=None, cache=None,
                                  output_attentions=False, **kwargs):
    """ProphetNet's ``ProphetNetAttention.forward`` (transformers 5.24, modeling_prophetnet) line for line (its checks of
    shapes left out), but that it merges ``num_attn_heads * head_dim`` (the kept heads) where the original reshapes to
    the hidden states' width, and adds the padding mask, ``[batch, config's heads, 1, keys]`` with every head's row the
    same (the encoder and decoder repeat one over the config's head count), as its first head's row, broadcast over
    the kept heads."""
    from transformers.cache_utils import EncoderDecoderCache

    cache = cache if cache is not None else cache_argument(kwargs)  # past_key_values: the deprecated name
    batch_size, tgt_len, _ = hidden_states.size()
    is_cross_attention = key_value_states is not None
    query_states = self.query_proj(hidden_states) / (self.head_dim**0.5)
    is_updated, curr_cache = False, None
    if cache is not None:
        if isinstance(cache, EncoderDecoderCache):
            is_updated = cache.is_updated.get(self.layer_idx)
            curr_cache = cache.cross_attention_cache if is_cross_attention else cache.self_attention_cache
        else:
            curr_cache = cache
    current_states = key_value_states if is_cross_attention else hidden_states
    if is_cross_attention and cache is not None and is_updated:
        key_states = curr_cache.layers[self.layer_idx].keys
        value_states = curr_cache.layers[self.layer_idx].values
    else:
        key_states = self.key_proj(current_states).view(batch_size, -1, self.num_attn_heads, self.head_dim)
        value_states = self.value_proj(current_states).view(batch_size, -1, self.num_attn_heads, self.head_dim)
        key_states, value_states = key_states.transpose(1, 2), value_states.transpose(1, 2)
        if cache is not None:
            key_states, value_states = curr_cache.update(key_states, value_states, self.layer_idx, kwargs=kwargs)
            if is_cross_attention and isinstance(cache, EncoderDecoderCache):
                cache.is_updated[self.layer_idx] = True
    query_states = query_states.view(batch_size, tgt_len, self.num_attn_heads, self.head_dim).transpose(1, 2)
    attn_weights = torch.einsum("bsij,bsjk->bsik", query_states, key_states.transpose(2, 3))
    if attention_mask is not None and attention_mask.dim() == 0:
        attention_mask = None
    if attention_mask is not None:
        attn_weights = attn_weights + attention_mask[:, :1]
    attn_weights_reshaped = attn_weights if output_attentions else None
    attn_weights = nn.functional.softmax(attn_weights, dim=-1)
    attn_probs = nn.functional.dropout(attn_weights, p=self.attention_dropout, training=self.training)
    attn_output = torch.einsum("bsij,bsjk->bsik", attn_probs, value_states)
    attn_output = attn_output.transpose(1, 2).reshape(batch_size, tgt_len, self.num_attn_heads * self.head_dim)
    attn_output = self.out_proj(attn_output)
    attn_output = nn.functional.dropout(attn_output, p=self.dropout, training=self.training)
    return attn_output, attn_weights_reshaped


SCORE_HEADS_ATTR = "_headlab_score_heads"
"""On a pruned layer whose forward computes scores for every head of the config and keeps its own heads' (ProphetNet's
decoder self-attention, :func:`_prophetnet_ngram_forward`): the heads it kept, in the config's numbering. Set by
headlab's pruning and by the plan's ``score_heads``; not :data:`KEPT_ATTR`, which tells headlab that a layer's
numbering is known (:data:`BIAS_KEPT_ATTR`'s reason)."""


class _ConfigHeads:
    """A view of a pruned ProphetNet n-gram self-attention that answers ``num_attn_heads`` with the config's head count
    and everything else (``relative_pos_embeddings``, ``num_buckets``, ``ngram``...) with the module's own."""

    def __init__(self, module: nn.Module, heads: int) -> None:
        self._module, self.num_attn_heads = module, heads

    def __getattr__(self, name: str):
        return getattr(self._module, name)


def _config_heads(mask, dim: int, kept: torch.Tensor):
    """A mask built for the config's heads (the decoder expands one over them on ``dim``), the kept heads' rows."""
    return mask if mask is None or mask.shape[dim] == 1 else mask.index_select(dim, kept.to(mask.device))


def _prophetnet_ngram_forward(self, hidden_states, cache=None, attention_mask=None,
                              extended_predict_attention_mask=None, main_relative_position_buckets=None,
                              predict_relative_position_buckets=None, position_ids=None, **kwargs):
    """ProphetNet's ``ProphetNetNgramSelfAttention.forward`` (transformers 5.24, modeling_prophetnet) line for line
    (its checks of shapes left out), but for what depends on the config's head count. Its relative-position scores
    (``get_main_relative_pos_embeddings``, ``get_predict_relative_pos_embeddings``) are computed by transformers' own
    methods for the config's heads, from ``relative_pos_embeddings`` kept whole, then the kept heads' taken
    (:data:`SCORE_HEADS_ATTR`): the predicting streams' gather a head's scores from rows ordered [batch, position, stream,
    head] by an index ordered [stream, batch, head, position], so head h's depend on the head count and on the other
    heads' rows. The masks the decoder builds for the config's heads give the kept heads' rows; the heads merge to
    ``num_attn_heads * head_dim``. A layer with no head left is a :class:`NoHeadAttention`."""
    from transformers.cache_utils import EncoderDecoderCache

    modeling = importlib.import_module(type(self).__module__)  # its softmax: float32, as the original's
    cache = cache if cache is not None else cache_argument(kwargs)  # past_key_values: the deprecated name
    batch_size, ngram_sequence_length, hidden_size = hidden_states.size()
    heads, d, ngram = self.num_attn_heads, self.head_dim, self.ngram
    config_heads = self.relative_pos_embeddings.out_features // self.num_buckets
    kept = torch.tensor(getattr(self, SCORE_HEADS_ATTR), dtype=torch.long, device=hidden_states.device)
    whole = _ConfigHeads(self, config_heads)

    def shaped(states):
        return states.view(batch_size, -1, heads, d).transpose(1, 2).contiguous()

    query_states = shaped(self.query_proj(hidden_states) / (d**0.5))
    key_states, value_states = shaped(self.key_proj(hidden_states)), shaped(self.value_proj(hidden_states))
    hidden_states_list = hidden_states.chunk(1 + ngram, dim=1)
    query_states_list = query_states.chunk(1 + ngram, dim=2)
    key_states_list = key_states.chunk(1 + ngram, dim=2)
    value_states_list = value_states.chunk(1 + ngram, dim=2)
    main_hidden_states, hidden_states_predict_list = hidden_states_list[0], hidden_states_list[1:]
    main_query_states, predict_query_states_list = query_states_list[0], query_states_list[1:]
    main_key_states, predict_key_states_list = key_states_list[0], key_states_list[1:]
    main_value_states, predict_value_states_list = value_states_list[0], value_states_list[1:]
    if cache is not None:
        curr_cache = cache.self_attention_cache if isinstance(cache, EncoderDecoderCache) else cache
        main_key_states, main_value_states = curr_cache.update(main_key_states, main_value_states, self.layer_idx)
    sequence_length = ngram_sequence_length // (1 + ngram)
    width = heads * d

    main_attn_weights = torch.einsum("bntc,bncs->bnts", main_query_states, main_key_states.transpose(2, 3))
    every_head = main_attn_weights.new_empty(()).expand(batch_size, config_heads, *main_attn_weights.shape[2:])
    main_relative_pos_embeddings = type(self).get_main_relative_pos_embeddings(
        whole, main_hidden_states, every_head, position_ids, main_relative_position_buckets).index_select(1, kept)
    main_attn_weights = main_attn_weights + main_relative_pos_embeddings
    if attention_mask is not None:
        main_attn_weights = main_attn_weights + _config_heads(attention_mask, 1, kept)
    main_attn_probs = modeling.softmax(main_attn_weights, dim=-1, onnx_trace=self.onnx_trace).type_as(main_attn_weights)
    main_attn_probs = nn.functional.dropout(main_attn_probs, p=self.attention_dropout, training=self.training)
    main_attn_output = torch.einsum("bntc,bncs->bnts", main_attn_probs, main_value_states)
    main_attn_output = self.out_proj(main_attn_output.transpose(1, 2).reshape(batch_size, 1, sequence_length, width))

    predict_query_states = torch.stack(predict_query_states_list, 1).view(batch_size, ngram, heads, sequence_length, d)
    predict_key_states = torch.stack([torch.cat([main_key_states, key], 2) for key in predict_key_states_list], 1)
    predict_hidden_states = torch.stack(hidden_states_predict_list, dim=2)
    predict_value_states = torch.cat(
        [torch.cat([main_value_states, v_p], 2).unsqueeze(2) for v_p in predict_value_states_list], 2)
    predict_attn_weights = torch.einsum("bnhtc,bnhsc->bnhts", (predict_query_states, predict_key_states))
    every_head = predict_attn_weights.new_empty(()).expand(batch_size, ngram, config_heads,
                                                           *predict_attn_weights.shape[3:])
    predict_relative_pos_embeddings = type(self).get_predict_relative_pos_embeddings(
        whole, predict_hidden_states, every_head, position_ids, predict_relative_position_buckets).index_select(2, kept)
    predict_attn_weights = predict_attn_weights + predict_relative_pos_embeddings
    if extended_predict_attention_mask is not None:
        extended_predict_attention_mask = extended_predict_attention_mask.permute(0, 2, 1, 3, 4)
        extended_predict_attention_mask = _config_heads(extended_predict_attention_mask, 2, kept)
        predict_attn_weights = predict_attn_weights + extended_predict_attention_mask.to(predict_attn_weights.dtype)
    predict_attn_probs = modeling.softmax(predict_attn_weights, dim=-1, onnx_trace=self.onnx_trace).type_as(
        predict_attn_weights)
    predict_attn_probs = nn.functional.dropout(predict_attn_probs, p=self.attention_dropout, training=self.training)
    predict_attn_output = torch.einsum("bnhts,bnhsc->bnhtc", (predict_attn_probs, predict_value_states.transpose(1, 2)))
    predict_attn_output = predict_attn_output.transpose(2, 3).reshape(batch_size, ngram, sequence_length, width)
    predict_attn_output = self.out_proj(predict_attn_output)

    attn_output = torch.cat([main_attn_output, predict_attn_output], 1).view(batch_size, -1, hidden_size)
    main_attn_probs = main_attn_probs.view(batch_size, heads, sequence_length, -1)
    attn_output = nn.functional.dropout(attn_output, p=self.dropout, training=self.training)
    return attn_output, main_attn_probs, predict_attn_probs


def _convbert_forward(self, hidden_states, attention_mask=None, encoder_hidden_states=None, **kwargs):
    """ConvBERT's ``ConvBertSelfAttention.forward`` (transformers 5.24, modeling_convbert) line for line, but that its
    query is kept whole, the kept heads' rows first (every row feeds the convolution heads' kernels: headlab's pruning
    reorders it and ``key_conv_attn_layer``'s and ``conv_kernel_layer``'s query channels with it), the attention reading
    the first ``num_attention_heads * attention_head_size`` rows, and that the convolution heads keep their own width
    (``conv_out_layer``'s, their count ``conv_kernel_layer``'s rows over ``conv_kernel_size``), with no attention head
    left too."""
    import math

    input_shape = hidden_states.shape[:-1]
    heads, d, kernel = self.num_attention_heads, self.attention_head_size, self.conv_kernel_size
    conv_width = self.conv_out_layer.out_features
    hidden_shape = (*input_shape, heads, d)
    states = hidden_states if encoder_hidden_states is None else encoder_hidden_states
    mixed_key_layer, mixed_value_layer = self.key(states), self.value(states)
    mixed_key_conv_attn_layer = self.key_conv_attn_layer(hidden_states.transpose(1, 2)).transpose(1, 2)
    mixed_query_layer = self.query(hidden_states)
    query_layer = mixed_query_layer[..., :heads * d].reshape(hidden_shape).transpose(1, 2)
    key_layer = mixed_key_layer.view(*mixed_key_layer.shape[:-1], heads, d).transpose(1, 2)
    value_layer = mixed_value_layer.view(*mixed_value_layer.shape[:-1], heads, d).transpose(1, 2)
    conv_attn_layer = torch.multiply(mixed_key_conv_attn_layer, mixed_query_layer)
    conv_kernel_layer = self.conv_kernel_layer(conv_attn_layer)
    conv_kernel_layer = torch.softmax(torch.reshape(conv_kernel_layer, [-1, kernel, 1]), dim=1)
    conv_out_layer = self.conv_out_layer(hidden_states)
    conv_out_layer = torch.reshape(conv_out_layer, [input_shape[0], -1, conv_width])
    conv_out_layer = conv_out_layer.transpose(1, 2).contiguous().unsqueeze(-1)
    conv_out_layer = nn.functional.unfold(conv_out_layer, kernel_size=[kernel, 1], dilation=1,
                                          padding=[(kernel - 1) // 2, 0], stride=1)
    conv_out_layer = conv_out_layer.transpose(1, 2).reshape(input_shape[0], -1, conv_width, kernel)
    conv_out_layer = torch.reshape(conv_out_layer, [-1, d, kernel])
    conv_out_layer = torch.matmul(conv_out_layer, conv_kernel_layer)
    conv_out = torch.reshape(conv_out_layer, [*input_shape, conv_width])
    attention_scores = torch.matmul(query_layer, key_layer.transpose(-1, -2)) / math.sqrt(d)
    if attention_mask is not None:
        attention_scores = attention_scores + attention_mask
    attention_probs = self.dropout(nn.functional.softmax(attention_scores, dim=-1))
    context_layer = torch.matmul(attention_probs, value_layer).permute(0, 2, 1, 3).reshape(*input_shape, heads * d)
    return torch.cat([context_layer, conv_out], dim=-1), attention_probs


PRUNED_FORWARDS = {"fsmt": _fsmt_forward, "trocr": _trocr_forward, "led-decoder": _led_decoder_forward,
                   "longformer": _longformer_forward, "mvp": _mvp_forward,
                   "pegasus-x": _pegasus_x_forward, "prophetnet-attention": _prophetnet_attention_forward,
                   "convbert": _convbert_forward, "prophetnet": _prophetnet_ngram_forward}
"""Forwards a pruned attention layer of a family is given where its own cannot run with fewer heads (FSMT's,
TrOCR's, LED's decoder's, Longformer's, MVP's, PEGASUS-X's encoder's and ProphetNet's merge the heads into the hidden
states' width; ProphetNet's encoder and cross attention also check masks built for the config's heads; ConvBERT's
keeps its query whole and its convolution heads; ProphetNet's decoder self-attention computes its relative-position
scores for the config's heads): the plan's ``classes`` name one per layer (:func:`pruned_class`)."""
_PRUNED_CLASSES: dict = {}


def pruned_class(cls: type, name: str) -> type:
    """``cls`` with the forward ``PRUNED_FORWARDS[name]``: the class a pruned layer of ``cls`` takes (one per ``cls``,
    so that two layers share it); its name is the original's."""
    if getattr(cls, "_headlab_pruned_forward", None) == name:  # pruned again
        return cls
    key = (cls, name)
    if key not in _PRUNED_CLASSES:
        _PRUNED_CLASSES[key] = type(cls.__name__, (cls,), {
            "forward": PRUNED_FORWARDS[name], "_headlab_pruned_forward": name,
            "__module__": cls.__module__, "__qualname__": cls.__qualname__})  # :data:`TIME_FIRST` reads them
    return _PRUNED_CLASSES[key]


class NoHeadAttention(nn.Module):
    """An attention layer with no head left: Concat() W^O + b = b at every position (plus the
    residual where the attention adds it itself: ``residual`` = (argument name, position); ALBERT
    ends in ``norm``: LayerNorm(input + b)). ``selection``: the argument holding the previous layer's
    top-k key selection, which the layer returns last (GLM-MoE-DSA: see :meth:`_selection`)."""

    def __init__(self, original: nn.Module, o_name, n_outputs: int, d_head: int, residual=None, norm=None,
                 selection=None):
        super().__init__()
        for name, child in original.named_children():  # same state_dict keys as before
            self.add_module(name, child)
        # its cache layer: GPT-Neo's attention calls it layer_id (layer_past.update(key, value, self.layer_id))
        self.layer_idx = next((index for index in (getattr(original, "layer_idx", None), getattr(original, "layer_id", None))
                               if isinstance(index, int) and not isinstance(index, bool)), None)
        self.o_name, self.n_outputs, self.d_head = o_name, n_outputs, d_head
        # the names of the original forward's arguments after the hidden states, so that one called positionally
        # (GitAttention hands GitSelfAttention its mask and cache by position) still keeps its cache in step
        parameters = list(inspect.signature(type(original).forward).parameters.values())[1:]
        self.arg_names = getattr(original, "arg_names", None) or tuple(
            p.name for p in parameters[1:] if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD))
        # the hidden states' argument, which a caller may pass by keyword (FSMT's layers: query=x)
        self.input_name = getattr(original, "input_name", None) or parameters[0].name
        # the original's plain settings that the model reads off its layers (GIT's image_patch_tokens, read from
        # layer 0 in cached generation), but none naming a head size or count: this layer has no head
        for name, value in vars(original).items():
            if not name.startswith("_") and "head" not in name and name not in vars(self) and \
                    isinstance(value, (int, float, bool, str)):
                setattr(self, name, value)
        qualified = f"{type(original).__module__}.{type(original).__qualname__}"
        self.list_output = qualified in LIST_OUTPUTS or getattr(original, "list_output", False) is True
        self.paired_output = qualified in PAIRED_OUTPUTS or getattr(original, "paired_output", False) is True
        self.channels_first = qualified in CHANNELS_FIRST or getattr(original, "channels_first", False) is True
        self.time_first = qualified in TIME_FIRST or getattr(original, "time_first", False) is True
        self.second_stream = SECOND_STREAMS.get(qualified) or getattr(original, "second_stream", None)
        self.merged_cache = qualified in MERGED_CACHES or getattr(original, "merged_cache", False) is True
        streams = STACKED_STREAMS.get(qualified)
        self.stacked_streams = 1 + int(getattr(original, streams)) if streams else \
            getattr(original, "stacked_streams", 1)
        self.output_bias = output_bias_name(original)
        if self.output_bias:  # GPT-NeoX-Japanese's dense_bias: a parameter of the attention itself, or None
            bias = getattr(original, self.output_bias)
            if isinstance(bias, nn.Parameter):
                self.register_parameter(self.output_bias, bias)
            else:
                setattr(self, self.output_bias, bias)
        if hasattr(original, "compute_bias"):  # T5's first layer: the position table the stack's other layers read
            self._relative_position_bucket = type(original)._relative_position_bucket
            # a partial, not a bound method: the model pickles (a bound method is rebuilt by getattr on a module not
            # yet restored) and a deep copy binds its own copy
            self.compute_bias = functools.partial(type(original).compute_bias, self)
        self.residual = tuple(residual) if residual else None
        self.norm = norm
        self.selection = selection
        # Mistral Large 4 (kv_sharing_modes): a layer whose key/value latents later layers read ('store') still
        # computes, caches and hands them on; one that reads an earlier layer's ('reuse') has no cache of its own
        self.stores_latents = getattr(original, "store_full_length_kv", None) is True
        self.reads_latents = getattr(original, "is_kv_shared_layer", None) is True
        if self.stores_latents:
            self.kv_lora_rank, self.qk_rope_head_dim = original.kv_lora_rank, original.qk_rope_head_dim
            self.use_rope = bool(original.use_rope)
            self.modeling = type(original).__module__  # where its interleaved rotation is

    def forward(self, *args, **kwargs):
        hidden_states = args[0] if args else kwargs.pop(self.input_name)
        args = args[1:]
        out = self._no_heads(hidden_states)
        if self.residual is not None:  # Bloom adds the residual inside its attention
            name, position = self.residual
            out = out + (kwargs[name] if name in kwargs else args[position - 1])
        if self.norm:  # the block's own output norm of its input plus the attention
            out = getattr(self, self.norm)(hidden_states + out)
        named = {**dict(zip(self.arg_names, args)), **kwargs}
        if self.stores_latents:
            self._store_latents(hidden_states, named)
        elif not self.reads_latents:
            self._keep_cache_in_step(hidden_states, named)
        extras = [None] * (self.n_outputs - 1)
        if self.second_stream:  # (first's output, second's output or None, probs): LUKE's (words, entities)
            second = named.get(self.second_stream)
            extras[0] = None if second is None else self._no_heads(second)
        elif self.selection:  # (output, probs, selection)
            extras[-1] = self._selection(hidden_states, kwargs)
        elif self.n_outputs == 3:  # (output, position_bias, probs)
            extras[0] = kwargs.get("position_bias")
        if self.output_bias:  # (output, probs, bias): the caller adds the bias to the output
            extras[-1] = getattr(self, self.output_bias)
        if self.channels_first:  # SqueezeBertModule reads att["context_layer"], att["attention_score"] when asked
            return {"context_layer": out, **({"attention_score": None} if named.get("output_attentions") else {})}
        if self.paired_output:  # I-BERT: ((output, probs), (their scaling factors)), no factor without quantisation
            return (out, *extras), (None,) * self.n_outputs
        return [out, *extras] if self.list_output else (out, *extras)

    def _no_heads(self, hidden_states):
        """Concat() W^O + b = b at each position of ``hidden_states``, or an empty input of the output projection
        where it follows outside this module."""
        if self.o_name:
            o = self.get_submodule(self.o_name)  # a child, or deeper (NeoMME's output_projection.o_proj)
            width = int(o.out_features) if hasattr(o, "out_features") else int(o.nf)  # Linear, QuantLinear; Conv1D
            out = hidden_states.new_zeros(*hidden_states.shape[:-1], width)
            return out if o.bias is None else out + o.bias.to(out.dtype)
        if self.channels_first:  # SqueezeBERT: [batch, 0, seq] for its post_attention.conv1d (a NoInputConv1d)
            return hidden_states.new_zeros(hidden_states.shape[0], 0, hidden_states.shape[-1])
        return hidden_states.new_zeros(*hidden_states.shape[:-1], 0)  # the output projection follows outside

    def _selection(self, hidden_states, kwargs):
        """The top-k keys this layer hands the next (GLM-MoE-DSA's "shared" layers attend to the previous
        full layer's): its own indexer's, or the previous layer's where it has none. The indexer reads the
        layer's input and the query latent, not the heads, so a layer with no head picks what the full
        layer picks (called as ``GlmMoeDsaAttention.forward`` calls it, its key cache kept in step)."""
        indexer = getattr(self, "indexer", None)
        handed = getattr(self, "next_skip_topk", True)  # GLM-5-Next hands its picks on only to a "shared" next layer
        if indexer is None:
            return kwargs.get(self.selection) if handed else None
        cache = cache_argument(kwargs)
        if "position_embeddings" not in inspect.signature(type(indexer).forward).parameters:  # GLM-5-Next's indexer
            q_resid = self.q_a_layernorm(self.q_a_proj(hidden_states))
            picks = indexer(hidden_states=hidden_states, q_resid=q_resid, attention_mask=kwargs["attention_mask"],
                            cache=cache)
            return picks if handed else None
        mask = kwargs["attention_mask"][:, 0, :, :]
        if getattr(self, "q_a_proj", None) is None:  # Mistral Large 4: no query latent, its indexer reads the input only
            return indexer(hidden_states, kwargs["position_embeddings"], mask, kwargs.get("position_ids"), cache=cache)
        q_resid = self.q_a_layernorm(self.q_a_proj(hidden_states))
        return indexer(hidden_states, q_resid, kwargs["position_embeddings"], mask, kwargs.get("position_ids"),
                       cache=cache)

    def _store_latents(self, hidden_states, kwargs) -> None:
        """What ``MistralLarge4TextAttention.forward`` does for the layers that reuse this one's latents (transformers
        5.24): the normed key/value latent and the rotated rotary key, cached, then stored in ``shared_kv_states``
        under "rope" or "nope". No head enters it, so a layer with no head stores what the full layer stores."""
        batch, length = hidden_states.shape[:-1]
        kv_pass, k_rot = torch.split(self.kv_a_proj_with_mqa(hidden_states), [self.kv_lora_rank, self.qk_rope_head_dim],
                                     dim=-1)
        k_pass = self.kv_a_layernorm(kv_pass).view(batch, 1, length, self.kv_lora_rank)
        k_rot = k_rot.view(batch, 1, length, self.qk_rope_head_dim)
        if self.use_rope:
            cos, sin = kwargs["position_embeddings"]
            rotate = importlib.import_module(self.modeling).apply_rotary_pos_emb_interleave
            k_rot = rotate(k_rot, k_rot, cos, sin)[1]
        cache = cache_argument(kwargs)
        if cache is not None:
            k_pass, k_rot = cache.update(k_pass, k_rot, self.layer_idx)
        kwargs["shared_kv_states"]["rope" if self.use_rope else "nope"] = (k_pass, k_rot)

    def _keep_cache_in_step(self, hidden_states, kwargs) -> None:
        """Placeholder keys and values, so that generation still counts positions. They hold one
        zero per position (one head of width 1), not none: transformers counts a cache layer
        with no elements as length 0, and reads the next position from layer 0. A forward handed its layer's index
        keeps it there (Zamba's and Zamba 2's ``layer_idx`` argument, which they update the cache at: Zamba 2 builds
        its shared attention with ``layer_idx=-1``, the last cache layer, another layer's); one handed a
        ``cache_offset`` (Inkling2-Loop's loop layers, each pass at cache layer ``layer_idx + cache_offset``) there."""
        cache = cache_argument(kwargs)
        given = kwargs.get("layer_idx")
        layer_idx = given if isinstance(given, int) and not isinstance(given, bool) else self.layer_idx
        if cache is None or layer_idx is None:
            return
        offset = kwargs.get("cache_offset")  # Inkling2-Loop's later passes: cache layers of their own, layer_idx + offset
        if isinstance(offset, int) and not isinstance(offset, bool):
            layer_idx += offset
        memory = kwargs.get("key_value_states", kwargs.get("encoder_hidden_states"))
        if self.time_first:  # FSMT: the encoder's output is the cross-attention's key, [S, B, C]
            memory = kwargs.get("key") if getattr(self, "encoder_decoder_attention", False) else None
        is_cross = memory is not None
        if self.merged_cache and is_cross and hasattr(cache, "self_attention_cache"):  # T5Gemma 2: both parts cached
            placeholder = hidden_states.new_zeros(hidden_states.shape[0], 1, hidden_states.shape[1], 1)
            cache.self_attention_cache.update(placeholder, placeholder, layer_idx)
        target = cache
        if hasattr(cache, "self_attention_cache"):
            if is_cross and cache.is_updated.get(layer_idx):
                return
            target = cache.cross_attention_cache if is_cross else cache.self_attention_cache
        batch, time = (1, 0) if self.time_first else (0, 1)
        length = memory.shape[time] if is_cross else hidden_states.shape[time] // getattr(self, "stacked_streams", 1)
        placeholder = hidden_states.new_zeros(hidden_states.shape[batch], 1, length, 1)
        target.update(placeholder, placeholder, layer_idx)
        if is_cross and hasattr(cache, "is_updated"):
            cache.is_updated[layer_idx] = True


class LayerConfig:
    """One pruned layer's view of the config its model shares: ``overrides`` (head counts) are
    read from here, everything else from and to the shared config, so that switching the
    attention implementation on the model still reaches the layer. (Phi-3 splits its fused
    projection at ``config.num_attention_heads * head_dim``.)"""

    def __init__(self, base, overrides: dict) -> None:
        self.__dict__.update(base=base, overrides=dict(overrides))

    def __getattr__(self, name: str):
        state = self.__dict__
        if "base" not in state:  # being copied or unpickled: no attribute yet
            raise AttributeError(name)
        if name in state["overrides"]:
            return state["overrides"][name]
        return getattr(state["base"], name)

    def __setattr__(self, name: str, value) -> None:
        if name in self.__dict__["overrides"]:
            self.__dict__["overrides"][name] = value
        else:
            setattr(self.__dict__["base"], name, value)

    def __repr__(self) -> str:
        return f"LayerConfig({type(self.__dict__['base']).__name__}, {self.__dict__['overrides']})"


KEPT_ATTR = "_headlab_kept_heads"
ORIGINAL_ATTR = "_headlab_original"
# On a norm over a whole query or key projection (OLMo 2's q_norm: RMSNorm over every head's features at once):
# {"of": the projection's name beside it, "heads": the heads kept, in the projection's numbering, "size": per head}
SELECTED_ATTR = "_headlab_selected"


def selection_hook(module: nn.Module, args, output):
    """A forward hook on a norm that spans a whole query or key projection: its output narrowed to the
    heads kept (``module._headlab_selected``). Removing a head's rows from the projection would change
    the statistic the norm divides every other head's features by (RMSNorm: a_i / sqrt(mean_j a_j^2) * g_i
    over the whole width, Zhang & Sennrich 2019; ESMC's LayerNorm also subtracts the mean over it), so the
    projection and the norm stay whole and the heads are selected after it: what the full layer computes
    for the kept heads, exactly."""
    selected = getattr(module, SELECTED_ATTR, None)
    if not selected:  # a layer since emptied (its stand-in never calls the norm), or pruning undone
        return output
    heads, size = selected["heads"], selected["size"]
    key = (output.device, tuple(heads), size)
    cached = module.__dict__.get("_headlab_selected_index")
    if cached is None or cached[0] != key:
        index = torch.tensor([h * size + i for h in heads for i in range(size)], dtype=torch.long,
                             device=output.device)
        cached = module.__dict__["_headlab_selected_index"] = (key, index)
    return output.index_select(-1, cached[1])


def select_after_norm(norm: nn.Module, selected: dict) -> None:
    """Narrow ``norm``'s output to ``selected`` (:data:`SELECTED_ATTR`), with the hook added once."""
    setattr(norm, SELECTED_ATTR, selected)
    if not getattr(norm, "_headlab_select_hooked", False):
        norm.register_forward_hook(selection_hook)
        norm._headlab_select_hooked = True


def alibi_hook(cls: type, name: str = "alibi"):
    """A forward pre-hook for a pruned attention module of class ``cls`` that takes ALiBi biases
    (Bloom; Falcon with alibi=True). The model builds them once for all the heads of its config
    and every layer reads them in head order; the hook hands the layer the rows of the heads it
    kept (``module._headlab_kept_heads`` of ``module._headlab_original``), and the attention
    mask's too where Falcon folded the biases into it (Press et al. 2022: a head's bias depends
    on its original index only). ``name``: the forward's argument holding them (MPT's ``position_bias``,
    ``[heads, 1, keys]``, sliced as Bloom's; MPNet's, a relative position bias its encoder computes once for all the
    config's heads, ``[batch, heads, q, k]``, as Falcon's)."""
    import inspect

    position = list(inspect.signature(cls.forward).parameters).index(name) - 1  # without self

    def hook(module, args, kwargs):
        kept, original = getattr(module, KEPT_ATTR), getattr(module, ORIGINAL_ATTR)
        if len(kept) == original:
            return args, kwargs
        positional = name not in kwargs and len(args) > position
        alibi = args[position] if positional else kwargs.get(name)
        if alibi is None:  # rotary Falcon
            return args, kwargs
        index = torch.tensor(kept, dtype=torch.long, device=alibi.device)
        if alibi.dim() == 4:  # Falcon: [batch, heads, 1, keys]; MPNet's relative bias [batch, heads, q, k]
            alibi = alibi.index_select(1, index)
        else:  # Bloom: [batch * heads, 1, keys]; MPT: [heads, 1, keys]
            alibi = alibi.reshape(-1, original, *alibi.shape[1:]).index_select(1, index).flatten(0, 1)
        if positional:
            args = (*args[:position], alibi, *args[position + 1:])
        else:
            kwargs[name] = alibi
        mask = kwargs.get("attention_mask")
        if isinstance(mask, torch.Tensor) and mask.dim() == 4 and mask.shape[1] == original > 1:
            kwargs["attention_mask"] = mask.index_select(1, index.to(mask.device))
        return args, kwargs

    return hook


BIAS_KEPT_ATTR = "_headlab_bias_heads"
"""On a pruned T5 layer loaded by this module: the heads (original numbering) whose columns of the stack's position bias
it is handed. Not :data:`KEPT_ATTR`, which tells headlab that a layer's numbering is known: a directory loaded by plain
transformers does not know every layer's (headlab refuses to analyse it, naming why)."""


class StackBiasHook:
    """A forward pre-hook for a pruned layer of a T5 stack (T5, mT5, Switch Transformers; LongT5's decoder). T5Stack
    computes the relative position bias ``[1, heads, q, k]`` of every head in its first layer (``compute_bias``, from
    that layer's one table) and hands it to the others, which breaks once layers keep different heads (Raffel et al.
    2020, sec. 2.1: one table per stack, a scalar per head and bucket). Each pruned layer is handed instead the full
    bias recomputed from ``source`` (the first layer), its kept heads' columns (``module.<attr>``, original
    numbering); cross-attention has no position bias: zeros. The mask is added by the attention itself.

    ``local``: the same for a pruned layer of LongT5's local encoder: LongT5LocalAttention's position bias as its
    forward builds it without one (transformers 5.24): ``compute_bias(block_len)`` (``[1, 1, heads, block_len,
    3 * block_len]``) plus the blocked mask (``[batch, 1, blocks, block_len, 3 * block_len]``, True where a key is
    seen) made 0 or -1e10 and moved to the heads' axis, here with the kept heads' columns only (the stack hands on
    the first layer's sum, mask included).

    ``transient_global``: the same for a pruned layer of LongT5's transient-global encoder, whose forward (transformers
    5.24, LongT5TransientGlobalAttention, called with the 2-d attention mask) builds after that local bias the side
    keys' (``compute_side_bias``: ``global_relative_attention_bias`` by each token's distance to each global block,
    -1e10 where the block is not one of the row's), split into the token blocks and concatenated:
    ``[batch, blocks, heads, block_len, 3 * block_len + global blocks]``, here the kept heads' columns of both tables.

    The bias is computed where the table is and handed to each layer on that layer's device (its hidden states'): a
    device_map may put the first layer and a later one apart, and an offloaded table is loaded for the computation
    (:func:`_table_loaded`). (transformers' T5 hands the first layer's bias on, and accelerate's hooks move it.)

    An object, not a closure: ``copy.deepcopy`` of the model gives the copy's hooks the copy's table (a closure would
    keep reading the original's: an averaged or fine-tuned copy computed with another table, silently), and the
    model pickles (``torch.save``)."""

    def __init__(self, source: nn.Module, attr: str = KEPT_ATTR, local: bool = False,
                 transient_global: bool = False) -> None:
        # in __dict__, not registered: the table's layer is a module of the model already (or, emptied, its
        # stand-in's children are that layer's)
        self.source, self.attr, self.local, self.transient_global = source, attr, local, transient_global

    def __call__(self, module, args, kwargs):
        if getattr(self, "transient_global", False):  # (a hook pickled before it had the attribute: not one)
            return self._transient_global(module, args, kwargs)
        return (self._local if self.local else self._t5)(module, args, kwargs)

    def _t5(self, module, args, kwargs):
        hidden = args[0] if args else kwargs["hidden_states"]
        kept = getattr(module, self.attr)
        q_len = hidden.shape[1]
        memory = kwargs.get("key_value_states")
        if memory is not None:
            bias = hidden.new_zeros(1, len(kept), q_len, memory.shape[1])
        else:
            cache = cache_argument(kwargs)
            past = cache.get_seq_length(module.layer_idx) if cache is not None else 0
            # the keys' length as T5Attention reads it after the cache's update (key_states.shape[-2]): a static cache
            # hands back all its max_cache_len slots (the mask hides the empty ones), a dynamic one past + q_len
            k_len = cache.get_mask_sizes(q_len, module.layer_idx)[0] if cache is not None else q_len
            with _table_loaded(self.source) as table:  # computed where the table is, handed over where the layer is
                past = past.to(table) if isinstance(past, torch.Tensor) else past
                full = self.source.compute_bias(q_len, k_len, device=table, past_seen_tokens=past)
            bias = full[:, kept].to(hidden.device)  # [1, kept heads, q_len, k_len]
        kwargs["position_bias"] = bias
        return args, kwargs

    def _local(self, module, args, kwargs):
        kept = getattr(module, self.attr)
        hidden = args[0] if args else kwargs["hidden_states"]
        with _table_loaded(self.source):  # on the table's device (compute_bias's own choice), then the layer's
            bias = self.source.compute_bias(module.block_len)[:, :, kept].to(hidden.device)
        mask = kwargs.get("mask", args[1] if len(args) > 1 else None)
        if mask is not None:
            bias = bias + torch.where(mask > 0, 0.0, -1e10).transpose(1, 2)
        return _position_bias_handed(args, kwargs, bias)

    def _transient_global(self, module, args, kwargs):
        from transformers.models.longt5 import modeling_longt5 as longt5

        kept = getattr(module, self.attr)
        hidden = args[0] if args else kwargs["hidden_states"]
        mask = kwargs.get("mask", args[1] if len(args) > 1 else None)
        source = self.source
        with _table_loaded(source):  # on the table's device (compute_bias's own choice), then the layer's
            bias = source.compute_bias(module.block_len)[:, :, kept].to(hidden.device)
        with _table_loaded(source, "global_relative_attention_bias"):  # its kept columns, on the layer's device
            columns = source.global_relative_attention_bias.weight[:, kept].to(hidden.device)
        if mask is not None:
            local = longt5._get_local_attention_mask(mask, module.block_len, hidden.device)
            bias = bias + torch.where(local > 0, 0.0, -1e10).transpose(1, 2)
        # compute_side_bias on the layer's device (the mask's): the kept columns looked up by its buckets
        real = mask if mask is not None else torch.ones(hidden.shape[:2], device=hidden.device)
        _, segments = longt5._make_global_fixed_block_ids(real, module.global_block_size)
        buckets = source._relative_position_bucket(
            longt5._make_side_relative_position_ids(real, module.global_block_size), bidirectional=not source.is_decoder,
            num_buckets=source.relative_attention_num_buckets, max_distance=source.relative_attention_max_distance)
        seen = torch.eq(real[..., None], segments[:, None, :])[:, None, ...]  # [batch, 1, seq, global blocks]
        side = torch.where(seen > 0, 0.0, -1e10) + columns[buckets].permute(0, 3, 1, 2)
        side = longt5._split_into_blocks(side, module.block_len, dim=-2).transpose(1, 2)
        return _position_bias_handed(args, kwargs, torch.cat([bias.type(hidden.dtype), side.type(hidden.dtype)], -1))


def _position_bias_handed(args: tuple, kwargs: dict, bias: torch.Tensor) -> tuple[tuple, dict]:
    """A LongT5 encoder attention's arguments with ``bias`` as its position_bias (its third argument)."""
    if len(args) > 2:  # position_bias passed by position (LongT5's layers pass it by keyword)
        args = (*args[:2], bias, *args[3:])
    else:
        kwargs["position_bias"] = bias
    return args, kwargs


@contextlib.contextmanager
def _table_loaded(source: nn.Module, name: str = "relative_attention_bias"):
    """The device of ``source``'s position bias table, its weight there for the time of the context. A device_map
    may put the table's layer on another device than a layer handed its bias; accelerate's offloading (a device_map's
    "cpu" or "disk" beside a GPU) keeps the weight on the meta device outside its module's forward, and loads it in
    (``align_module_device``: what the module's hook does around its forward) only when asked."""
    table = getattr(source, name)
    if getattr(getattr(table, "_hf_hook", None), "offload", False):  # accelerate's: only where it dispatched the model
        try:  # in a try, as every import here of a package transformers does not need: see peft_from_pretrained
            from accelerate.utils import align_module_device
        except ImportError as error:  # accelerate's hook without accelerate: not a model it dispatched
            raise ImportError(f"{name}: offloaded by an accelerate hook, and accelerate does not import") from error

        with align_module_device(table):
            yield table.weight.device
    else:
        yield table.weight.device


def t5_bias_hook(source: nn.Module, attr: str = KEPT_ATTR) -> StackBiasHook:
    """:class:`StackBiasHook` for a layer of a T5 stack."""
    return StackBiasHook(source, attr)


def local_bias_hook(source: nn.Module, attr: str = KEPT_ATTR) -> StackBiasHook:
    """:class:`StackBiasHook` for a layer of LongT5's local encoder."""
    return StackBiasHook(source, attr, local=True)


VALUE_EMBEDS_ATTR = "_headlab_value_embeds_kept"
"""On a pruned attention layer handed the model's value embeddings (NeoMME's ``value_embeds``): the key/value heads
whose columns it reads, in the original numbering (a repeated one where each kept query head has its own copy)."""


class ValueEmbedsHook:
    """A forward pre-hook for a pruned attention layer that adds the model's value embeddings to its values, key/value
    head by key/value head (NeoMME's first and last full-attention layers: ``value_states + value_embeds.view(...,
    -1, head_dim)``, ``value_embeds`` ``[batch, seq, kv heads x head_dim]`` from the model's one embedding of every
    key/value head, transformers 5.24). The layer is handed the columns of the key/value heads it kept
    (``module.<VALUE_EMBEDS_ATTR>``, original numbering, repeats where the kept groups are uneven), in the order of its
    pruned value projection's heads, so that each kept value head gets its own embedding as before. An object, not a
    closure: a deep copy or pickle of the model carries it."""

    def __init__(self, n_kv_heads: int) -> None:
        self.n_kv_heads = n_kv_heads

    def __call__(self, module, args, kwargs):
        positional = len(args) > 3  # forward(hidden_states, position_embeddings, attention_mask, value_embeds)
        embeds = args[3] if positional else kwargs.get("value_embeds")
        if embeds is None:
            return None
        kept = torch.tensor(getattr(module, VALUE_EMBEDS_ATTR), dtype=torch.long, device=embeds.device)
        narrowed = embeds.view(*embeds.shape[:-1], self.n_kv_heads, -1).index_select(-2, kept).flatten(-2)
        if positional:
            return (*args[:3], narrowed, *args[4:]), kwargs
        return args, {**kwargs, "value_embeds": narrowed}


def transient_global_bias_hook(source: nn.Module, attr: str = KEPT_ATTR) -> StackBiasHook:
    """:class:`StackBiasHook` for a layer of LongT5's transient-global encoder."""
    return StackBiasHook(source, attr, transient_global=True)


STACK_BIAS_HOOKS = {"t5": t5_bias_hook, "local": local_bias_hook, "transient-global": transient_global_bias_hook}
"""The plan's ``shared_bias`` kinds (headlab's ``Family.shared_bias``): the hook a pruned layer of such a stack gets."""


def apply_plan(model: nn.Module, plan: dict) -> None:
    """Give ``model`` (built from the original config) the pruned shapes of ``plan``."""
    with torch.no_grad():
        for path, (kind, n_in, n_out, *extra) in plan["projections"].items():
            _set_submodule(model, path, _resized(model.get_submodule(path), kind, n_in, n_out, *extra))
        for path, values in plan["attributes"].items():
            module = model.get_submodule(path)
            for name, value in values.items():
                setattr(module, name, value)
        for path, values in plan.get("config", {}).items():
            module = model.get_submodule(path)
            module.config = LayerConfig(module.config, values)
        for path, (kept, original, *argument) in plan.get("alibi", {}).items():  # [kept, original[, argument]]
            module = model.get_submodule(path)
            setattr(module, KEPT_ATTR, kept)
            setattr(module, ORIGINAL_ATTR, original)
            module.register_forward_pre_hook(alibi_hook(type(module), *argument), with_kwargs=True)
        for path, name in plan.get("classes", {}).items():  # a forward that runs with fewer heads (FSMT's)
            module = model.get_submodule(path)
            module.__class__ = pruned_class(type(module), name)
        for path, kept in plan.get("score_heads", {}).items():  # ProphetNet's: scores for every head, its kept
            setattr(model.get_submodule(path), SCORE_HEADS_ATTR, list(kept))
        for path, length in plan.get("vectors", {}).items():  # per kept head: query scales, attention sinks
            owner_path, _, name = path.rpartition(".")
            owner = model.get_submodule(owner_path)
            old = getattr(owner, name)
            setattr(owner, name, nn.Parameter(old.new_empty(length), requires_grad=old.requires_grad))
        for path, shape in plan.get("parameters", {}).items():  # bare per-head parameters (XLNet's): pruned shapes
            owner_path, _, name = path.rpartition(".")
            owner = model.get_submodule(owner_path)
            old = getattr(owner, name)
            setattr(owner, name, nn.Parameter(old.new_empty(shape), requires_grad=old.requires_grad))
        for path, (rows, columns) in plan.get("columns", {}).items():  # one column per kept head (UMT5's position bias)
            embedding = model.get_submodule(path)
            embedding.weight = nn.Parameter(embedding.weight.new_empty(rows, columns))
            embedding.embedding_dim = columns
        for path, channels in plan.get("depthwise", {}).items():  # Inkling's k_sconv / v_sconv: kept heads' channels
            conv = model.get_submodule(path)
            conv.weight = nn.Parameter(conv.weight.new_empty(channels, *conv.weight.shape[1:]),
                                       requires_grad=conv.weight.requires_grad)
            if conv.bias is not None:
                conv.bias = nn.Parameter(conv.bias.new_empty(channels), requires_grad=conv.bias.requires_grad)
            conv.in_channels = conv.out_channels = conv.groups = channels
        for path, (kept, n_kv_heads) in plan.get("value_embeds", {}).items():  # NeoMME's value embeddings, narrowed
            module = model.get_submodule(path)
            setattr(module, VALUE_EMBEDS_ATTR, list(kept))
            module.register_forward_pre_hook(ValueEmbedsHook(n_kv_heads), with_kwargs=True)
        for path, selected in plan.get("selected", {}).items():  # a norm over a whole query/key projection
            select_after_norm(model.get_submodule(path), selected)
        for path, (o_name, n_outputs, d_head, *rest) in plan["no_head"].items():  # [residual[, norm[, selection]]]
            _set_submodule(model, path, NoHeadAttention(model.get_submodule(path), o_name, n_outputs, d_head,
                                                        *rest[:3]))
        # a pruned T5 stack: each layer with heads left handed its kept heads' columns of the bias computed from the
        # stack's first layer (its table; a NoHeadAttention where that layer has no head left keeps it and compute_bias)
        for path, (kept, source, kind) in plan.get("shared_bias", {}).items():
            module = model.get_submodule(path)
            setattr(module, BIAS_KEPT_ATTR, list(kept))
            module.register_forward_pre_hook(STACK_BIAS_HOOKS[kind](model.get_submodule(source), BIAS_KEPT_ATTR),
                                             with_kwargs=True)


# Key selections that do not depend on the batch: ties at an indexer's top-k boundary go to the lowest index.
#
# transformers' sparse-attention indexers (5.24: DeepSeek-V3.2's, GLM-MoE-DSA's, dots3-note's, A.X-K2's, HY-V4's,
# Mistral-Large-4's, GLM-5-Next's, MiniMax-M3's, DeepSeek-V4's, Qwen4-Exp's QSA; every class named ``...Indexer``)
# keep each query's top-k keys with ``Tensor.topk``, which breaks ties in no documented order. The scores do tie: a
# DSA index score is a weighted sum of ``relu(q . k)`` over the indexer's heads, exactly 0 for a key every head
# scores below zero. The tied key kept then follows the tensor's length and the device, not the sentence: on a tiny
# GLM-MoE-DSA (``attention_bias=True``, ``index_topk`` 3; the family sweep's padding check, session 40) a
# right-padded row kept key 3 where the row alone kept key 4 (both scored 0), and its logits moved by 5e-3: the kept
# keys are attended with the attention's own scores. :func:`install_tie_rule` (headlab calls it whenever it makes a
# model's blocks, and a pruned model built from this file calls it too) swaps each indexer's class for a subclass of
# the same name whose ``topk`` is a stable descending sort's first k: on untied scores transformers' own selection,
# on ties the lowest indices, the same for a sentence alone, in any padded batch and on any device. The sort costs
# three copies of the index scores, beside the indexer's own ``[batch, seq, index heads, keys]`` scores.
_TIE_RULE = "_headlab_lowest_index_ties"
_TOPK = (torch.topk, torch.Tensor.topk)
_TIE_RULE_CLASSES: dict = {}


def stable_topk(input, k, dim=-1, largest=True, sorted=True, *, out=None):
    """``torch.topk`` whose ties go to the lowest indices: the first ``k`` of a stable sort (returned sorted, which
    ``sorted=False`` allows)."""
    if out is not None:
        raise TypeError("stable_topk does not write into out=")
    values, indices = torch.sort(input, dim=dim, descending=largest, stable=True)
    return torch.return_types.topk((values.narrow(dim, 0, k), indices.narrow(dim, 0, k)))


class _LowestIndexTies(TorchFunctionMode):
    """Every ``topk`` run inside it is :func:`stable_topk`."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in _TOPK:
            return stable_topk(*args, **(kwargs or {}))
        return func(*args, **(kwargs or {}))


def _under_tie_rule(forward):
    """``forward`` (the class's, or a function set on the instance by accelerate's hooks) run under the rule, its
    signature kept (``functools.wraps``: :class:`NoHeadAttention` reads the indexer's to call it as its layer does)."""
    @functools.wraps(forward)
    def wrapped(*args, **kwargs):
        with _LowestIndexTies():
            return forward(*args, **kwargs)

    setattr(wrapped, _TIE_RULE, True)
    return wrapped


# A model's own indexers (trust_remote_code: its modeling file in the HF modules cache, DeepSeek-V3.2's own code) are
# no class of ``transformers.models``: one named ``...Indexer`` whose code calls ``topk`` gets the rule as well; one
# that selects otherwise (a sort, an argsort, kthvalue), which the rule does not reach, is refused.
_OTHER_SELECTIONS = ("sort", "argsort", "msort", "kthvalue")


def _code_names(cls):
    """The names the code of ``cls.forward`` uses, and that of what it calls by name: the methods of ``cls`` and of its
    bases (``torch.nn``'s aside: ``super().forward``), nested functions, and the functions of their modules
    (``x.topk``, ``torch.topk``: topk)."""
    classes = [klass for klass in cls.__mro__ if not klass.__module__.startswith(("torch.", "builtins"))]
    names, seen, stack = set(), set(), [getattr(cls, "forward", None)]
    while stack:
        value = stack.pop()
        code = value if isinstance(value, types.CodeType) else getattr(inspect.unwrap(value), "__code__", None) \
            if callable(value) else None
        if code is None or code in seen:
            continue
        seen.add(code)
        names.update(code.co_names)
        stack.extend(const for const in code.co_consts if isinstance(const, types.CodeType))
        stack.extend(vars(klass)[name] for klass in classes for name in code.co_names if name in vars(klass))
        module = sys.modules.get(getattr(value, "__module__", None) or "")
        if module is not None:  # the module's functions it calls
            stack.extend(f for name, f in vars(module).items()
                         if name in code.co_names and isinstance(f, types.FunctionType))
    return names


def _own_indexer_selection(cls):
    """For a model's own class named ``...Indexer`` (not transformers'): ``"topk"`` when its code calls topk, the
    other selection it calls (:data:`_OTHER_SELECTIONS`) when it calls none, None when it selects nothing."""
    if not cls.__name__.endswith("Indexer") or cls.__module__.startswith("transformers.models."):
        return None
    names = _code_names(cls)
    return "topk" if "topk" in names else next((name for name in _OTHER_SELECTIONS if name in names), None)


def is_indexer(module):
    """A key selector of a sparse attention: a class of ``transformers.models`` named ``...Indexer``, or a model's
    own class so named whose code calls ``topk`` (remote code)."""
    cls = type(module)
    if cls.__name__.endswith("Indexer") and cls.__module__.startswith("transformers.models."):
        return True
    return _own_indexer_selection(cls) == "topk"


def install_tie_rule(model):
    """Make every indexer of ``model`` (once) break its top-k ties toward the lowest index (above): its class becomes
    a subclass of the same name, no hook (so that headlab's hooks come off as they went on); a forward set on the
    instance (accelerate's hooks, which would skip the class's) is wrapped likewise. A model's own indexer that
    selects by another means than topk is refused (ValueError), before any is changed."""
    for name, module in model.named_modules():
        selection = _own_indexer_selection(type(module))
        if selection is not None and selection != "topk":
            raise ValueError(
                f"the sparse-attention indexer {type(module).__name__} ({name}, the model's own code, "
                f"{type(module).__module__}) selects its keys with {selection}, not topk: headlab gives tied index "
                "scores the lowest keys (the same selection for a sentence alone and in any padded batch) only "
                "through topk, and without it the keys kept would depend on the batch; refused")
    for module in model.modules():
        if not is_indexer(module):
            continue
        cls = type(module)
        if not getattr(cls, _TIE_RULE, False):
            if cls not in _TIE_RULE_CLASSES:
                _TIE_RULE_CLASSES[cls] = type(cls.__name__, (cls,), {
                    "forward": _under_tie_rule(cls.forward), _TIE_RULE: True,
                    "__module__": cls.__module__, "__qualname__": cls.__qualname__})
            module.__class__ = _TIE_RULE_CLASSES[cls]
        own = vars(module).get("forward")
        if own is not None and not getattr(own, _TIE_RULE, False):
            module.forward = _under_tie_rule(own)


class PrunedModel(_BASE):
    """The original class, with the pruned attention shapes of ``config.headlab_pruned``."""

    def __init__(self, config, *args, **kwargs):
        super().__init__(config, *args, **kwargs)
        apply_plan(self, config.headlab_pruned)
        install_tie_rule(self)  # as headlab's model computed, whose selections it pruned against
        with _registry_lock():
            _share_checkpoint_conversion(self)
        record_kept_blocks(self, config.headlab_pruned)

    @classmethod
    def from_pretrained(cls, *args, **kwargs):
        """transformers' loading, refused when it left a weight of the pruned model newly initialised
        or a weight of the checkpoint unused: that would be another model, with no error."""
        wants_info = kwargs.get("output_loading_info", False)
        kwargs["output_loading_info"] = True
        # held from this class's registration (in __init__) to transformers' lookup of it, right after
        with _registry_lock():
            model, info = super().from_pretrained(*args, **kwargs)
        check_loading_info(info, BASE_CLASS)
        return (model, info) if wants_info else model

    def load_adapter(self, peft_model_id=None, adapter_name=None, *args, **kwargs):
        """transformers' loading of a PEFT adapter, refused (and the adapter taken off again) when it left an
        adapter weight at its initialisation or one of the adapter's file unused (transformers only logs
        those, and under ``ignore_mismatched_sizes=True`` initialises anew the weights of another shape, as an
        adapter made on the unpruned model has: its q/k/v rows, its output projection's columns), or when it
        adapts a pruned attention layer and its ``headlab_adapter.json`` is missing or names other kept heads
        (an adapter of another pruning with the same head counts fits every shape)."""
        return load_checked_adapter(self, super().load_adapter, peft_model_id, adapter_name, *args, **kwargs)

    def save_pretrained(self, save_directory, *args, **kwargs):
        """transformers' saving; where it saves the adapters loaded by ``load_adapter`` (and not the model),
        with the record of the heads this pruning kept beside them (``headlab_adapter.json``)."""
        result = super().save_pretrained(save_directory, *args, **kwargs)
        known = None not in self.__dict__.get(KEPT_BLOCKS_ATTR, {None: None}).values()  # else nothing to record
        if getattr(self, "_hf_peft_config_loaded", False) and kwargs.get("is_main_process", True) and known:
            write_adapter_record(self, save_directory)
        return result

    @staticmethod
    def save_adapter(model, directory, **kwargs):
        """:func:`save_adapter` where headlab is not installed: ``pruned.save_adapter(peft_model, directory)``."""
        return save_adapter(model, directory, **kwargs)

    @staticmethod
    def peft_from_pretrained(model, model_id, **kwargs):
        """:func:`peft_from_pretrained`: peft's ``PeftModel.from_pretrained`` with the adapter's record checked."""
        return peft_from_pretrained(model, model_id, **kwargs)

    def _adjust_missing_and_unexpected_keys(self, loading_info) -> None:
        """transformers drops the keys its ignore lists (``_keys_to_ignore_on_load_missing`` /
        ``_unexpected``) match from the loading report; never a weight of a projection headlab resized:
        that one is loaded, or the load refused. (GPT-2's ``attn.bias``, meant for an old mask buffer,
        is a regular expression that also matches every ``attn.c_attn.bias``.)"""
        prefix = f"{self.base_model_prefix}." if getattr(self, "base_model_prefix", "") else ""

        def inside(key: str) -> str:
            return (key[len(prefix):] if prefix and key.startswith(prefix) else key) + "."

        pruned = tuple(inside(path) for path in self.config.headlab_pruned["projections"])
        kept = {name: {key for key in getattr(loading_info, name) if inside(key).startswith(pruned)}
                for name in ("missing_keys", "unexpected_keys")}
        super()._adjust_missing_and_unexpected_keys(loading_info)
        for name, keys in kept.items():
            setattr(loading_info, name, set(getattr(loading_info, name)) | keys)


def _take_off_adapter(model: nn.Module, name: str) -> None:
    """What transformers' ``delete_adapter`` does (it refuses a peft older than 0.22, which loads adapters), and the
    adapter layers left with no adapter replaced by their base layers: the model is the one before the load."""
    _unload(model, {name})
    if not getattr(model, "peft_config", None):
        if "peft_config" in model.__dict__:
            del model.peft_config
        model._hf_peft_config_loaded = False


ADAPTER_RECORD = "headlab_adapter.json"  # beside an adapter saved from a pruned model: the heads it was trained on
KEPT_BLOCKS_ATTR = "_headlab_kept_blocks"  # in a pruned model's __dict__: attention path -> [kept, kept k/v, original]
_CHECKED_ATTR = "_headlab_adapter_checked"  # in __dict__ while load_checked_adapter loads (its record read there)
_RECORD_ATTR = "_headlab_adapter_record"  # in __dict__ during peft_from_pretrained: (source, its record)
_LOADING_ATTR = "_headlab_adapter_loading"  # in __dict__ between the load_state_dict hooks: adapter -> its keys
_ERRORS_ATTR = "_headlab_adapter_errors"  # the same: (keys left unread, the load's errors, which torch raises after)


def record_kept_blocks(model: nn.Module, plan: dict) -> None:
    """Keep on ``model`` the heads each pruned attention layer kept (``plan["kept"]``, original numbering), which
    an adapter's record is compared with, and guard peft's loading of adapters (:func:`_adapter_load_pre_hook`).
    A plan written before it had ``kept`` knows only the resized projections: their layers' heads unknown."""
    kept = plan.get("kept")
    if kept is None:
        kept = {path.rpartition(".")[0]: None for path in plan["projections"]}
    model.__dict__[KEPT_BLOCKS_ATTR] = {path: (None if entry is None else [list(entry[0]), list(entry[1]), int(entry[2])])
                                       for path, entry in kept.items()}
    if not model.__dict__.get("_headlab_adapter_hooks"):
        model.register_load_state_dict_pre_hook(_adapter_load_pre_hook)
        model.register_load_state_dict_post_hook(_adapter_load_post_hook)
        model.__dict__["_headlab_adapter_hooks"] = True


def _tuner_layers(module: nn.Module) -> list:
    """(path, layer) of every PEFT adapter layer under ``module`` (peft's BaseTunerLayer, by its interface:
    peft is optional)."""
    return [(name, layer) for name, layer in module.named_modules()
            if hasattr(layer, "adapter_layer_names") and hasattr(layer, "get_base_layer")]


def _adapter_names(layer: nn.Module) -> set:
    return {name for attr in layer.adapter_layer_names for name in (getattr(layer, attr, None) or {})}


def _pruned_root(model: nn.Module):
    """(the pruned model inside ``model``, its kept heads per attention path), or None: ``model`` itself, or the
    base model of a PeftModel."""
    for module in model.modules():
        if module.__dict__.get(KEPT_BLOCKS_ATTR) is not None:
            return module, module.__dict__[KEPT_BLOCKS_ATTR]
    return None


def _adapted_blocks(root: nn.Module, kept: dict, names: set) -> list:
    """The pruned attention paths of ``kept`` with a layer of one of the adapters ``names`` in them."""
    adapted = [path for path, layer in _tuner_layers(root) if _adapter_names(layer) & names]
    return sorted(block for block in kept if any(path == block or path.startswith(f"{block}.") for path in adapted))


def _class_name(model: nn.Module) -> str:
    """The class a user knows: the original one's name for this module's PrunedModel."""
    return BASE_CLASS if isinstance(model, PrunedModel) else type(model).__name__


def _heads(entry) -> str:
    if entry is None:
        return "heads not recorded"
    kept, kv_kept, original = entry
    kv = f" (key/value heads {','.join(map(str, kv_kept)) or 'none'})" if kv_kept != kept else ""
    return f"heads {','.join(map(str, kept)) or 'none'} of {original}{kv}"


def check_adapter_record(model: nn.Module, record, names: set, source: str) -> None:
    """Raise when an adapter ``names`` of ``model`` adapts a pruned attention layer and ``record`` (its
    ``headlab_adapter.json``, None where there is none) is missing or names other kept heads for that layer:
    its weights on the q/k/v rows and output-projection columns belong to the heads it was trained on, and an
    adapter of another pruning with the same head counts fits every shape."""
    found = _pruned_root(model)
    if found is None:
        return
    root, kept = found
    adapted = _adapted_blocks(root, kept, names)
    if not adapted:
        return
    unknown = [block for block in adapted if kept[block] is None]
    if unknown:
        raise RuntimeError(f"pruned_heads.py: the adapter {source} adapts the attention of pruned layers "
                           f"({', '.join(unknown[:3])}), and this pruned {_class_name(root)}'s config.json does not "
                           "record which heads they kept (a plan written before it did): its adapters cannot be "
                           "checked. Save the model again with headlab (headlab.save_pruned(headlab.load_pruned(path), "
                           "path)) to record them")
    if record is None:
        raise RuntimeError(f"pruned_heads.py: the adapter {source} adapts the attention of pruned layers "
                           f"({', '.join(adapted[:3])}{', ...' if len(adapted) > 3 else ''}) and has no "
                           f"{ADAPTER_RECORD}, the record of the heads it was trained on: an adapter of another pruning "
                           "with the same head counts fits every shape and would act on other heads. Save adapters "
                           "of a pruned model with headlab.save_adapter(model, directory) (without headlab: "
                           "the pruned model's save_adapter(model, directory), or its save_pretrained), which write it")
    theirs = record.get("kept") if isinstance(record, dict) else None
    if not isinstance(theirs, dict):
        raise RuntimeError(f"pruned_heads.py: the adapter {source}: its {ADAPTER_RECORD} is malformed (no 'kept')")
    differ = [block for block in adapted if theirs.get(block) != kept[block]]
    if differ:
        shown = "; ".join(f"{block}: the adapter's {_heads(theirs.get(block))}, this model's {_heads(kept[block])}"
                          for block in differ[:3])
        raise RuntimeError(f"pruned_heads.py: the adapter {source} was trained on another pruning than this pruned "
                           f"{_class_name(root)}'s ({len(differ)} attention layer{'s' if len(differ) != 1 else ''} "
                           f"differ: {shown}{'; ...' if len(differ) > 3 else ''}): its attention weights would act on "
                           "other heads. Train the adapter on this pruning")


def read_adapter_record(source, subfolder=None):
    """The ``headlab_adapter.json`` of the adapter directory ``source`` (None where it has none or is no directory
    here: a hub adapter is read through transformers' cache)."""
    if source is None:
        return None
    directory = os.path.join(str(source), subfolder) if subfolder else str(source)
    path = os.path.join(directory, ADAPTER_RECORD)
    if not os.path.isdir(str(source)):
        try:
            from transformers.utils import cached_file

            path = cached_file(str(source), ADAPTER_RECORD, subfolder=subfolder or "",
                               _raise_exceptions_for_missing_entries=False)
        except (OSError, ValueError):
            path = None
    if not path or not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as handle:
        return json.load(handle)


def write_adapter_record(model: nn.Module, directory) -> None:
    """Write beside each adapter saved in ``directory`` (peft writes adapters other than "default" in a folder of
    their name) the heads the pruned model in ``model`` kept, atomically."""
    found = _pruned_root(model)
    if found is None:
        raise ValueError(f"{type(model).__name__}: no model pruned by headlab in it (nothing to record)")
    root, kept = found
    unknown = [block for block, entry in kept.items() if entry is None]
    if unknown:
        raise ValueError(f"{_class_name(root)}: its config.json does not record which heads {', '.join(unknown[:3])} "
                         "kept; save the model again with headlab to record them")
    text = json.dumps({"format": 1, "kept": kept}, indent=1, sort_keys=True) + "\n"
    names = [name for name in (getattr(model, "peft_config", None) or {}) if name != "default"]
    for folder in [str(directory), *(os.path.join(str(directory), name) for name in names)]:
        if os.path.isfile(os.path.join(folder, "adapter_config.json")):
            temporary = os.path.join(folder, f".{ADAPTER_RECORD}.{os.getpid()}.tmp")
            with open(temporary, "w", encoding="utf-8") as handle:
                handle.write(text)
            os.replace(temporary, os.path.join(folder, ADAPTER_RECORD))


def save_adapter(model: nn.Module, directory, **kwargs) -> None:
    """``model.save_pretrained(directory, **kwargs)`` (a PeftModel around a pruned model, or a pruned model with
    adapters loaded by transformers) and the record of the heads the pruning kept, which loading an adapter
    onto a pruned model compares with its own."""
    if _pruned_root(model) is None:
        raise ValueError(f"{type(model).__name__}: no model pruned by headlab in it (save it with save_pretrained)")
    model.save_pretrained(directory, **kwargs)
    write_adapter_record(model, directory)


def load_checked_adapter(model: nn.Module, load, peft_model_id=None, adapter_name=None, *args, **kwargs):
    """``load(peft_model_id, adapter_name, ...)`` (transformers' ``load_adapter`` of ``model``), refused and the
    adapter taken off when a weight was left at its initialisation or unused (:func:`check_loading_info`) or its
    record of kept heads is missing or another (:func:`check_adapter_record`)."""
    name = adapter_name or "default"
    new = name not in (getattr(model, "peft_config", None) or {})  # else hotswapped: the old one stays
    kwargs["ignore_mismatched_sizes"] = True  # the shapes reported, not raised with a pointer to a log
    model.__dict__[_CHECKED_ATTR] = True
    try:
        info = load(peft_model_id, adapter_name, *args, **kwargs)
    finally:
        model.__dict__.pop(_CHECKED_ATTR, None)
    try:
        check_loading_info({key: getattr(info, key, None) for key in
                            ("missing_keys", "unexpected_keys", "mismatched_keys")}, _class_name(model), "adapter")
        subfolder = (kwargs.get("adapter_kwargs") or {}).get("subfolder")
        check_adapter_record(model, read_adapter_record(peft_model_id, subfolder), {name},
                             repr(str(peft_model_id)) if peft_model_id is not None else "(given as a state dict)")
    except RuntimeError:
        if new:
            _take_off_adapter(model, name)
        raise
    return info


def peft_from_pretrained(model: nn.Module, model_id, **kwargs):
    """peft's ``PeftModel.from_pretrained(model, model_id, **kwargs)`` with the adapter's record of kept heads read
    first and compared once peft has loaded it (the load_state_dict hooks of a pruned model refuse peft's loading
    of an adapter on its pruned attention otherwise). A local directory only (its ``subfolder`` too)."""
    # In a try: transformers' check_imports makes every package a remote-code file imports outside one a requirement
    # of loading it, and a pruned model loads with plain transformers, peft or not.
    try:
        from peft import PeftModel
    except ImportError as error:
        raise ImportError("peft_from_pretrained needs peft: pip install peft") from error

    found = _pruned_root(model)
    if found is None:
        return PeftModel.from_pretrained(model, model_id, **kwargs)
    root = found[0]
    root.__dict__[_RECORD_ATTR] = (repr(str(model_id)), read_adapter_record(model_id, kwargs.get("subfolder")))
    try:
        return PeftModel.from_pretrained(model, model_id, **kwargs)
    finally:
        root.__dict__.pop(_RECORD_ATTR, None)


def _adapter_load_pre_hook(module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                           error_msgs) -> None:
    """Before ``load_state_dict`` (peft's loading: PeftModel.from_pretrained, its load_adapter): the keys of each
    adapter the state dict loads, to be found again in what the load left missing."""
    keys = set(state_dict)
    loading: dict = {}
    attrs: set = set()
    for path, layer in _tuner_layers(module):
        attrs.update(layer.adapter_layer_names)
        for attr in layer.adapter_layer_names:
            for name, holder in (getattr(layer, attr, None) or {}).items():
                stem = f"{prefix}{path}.{attr}.{name}"
                expected = [f"{stem}.{key}" for key in holder.state_dict()] if isinstance(holder, nn.Module) else [stem]
                loading.setdefault(name, []).extend(expected)
    loading = {name: expected for name, expected in loading.items() if keys.intersection(expected)}
    module.__dict__[_LOADING_ATTR] = loading
    # adapter weights of the file that no weight of this model takes (peft passes them on under their saved name,
    # without the adapter's; torch lists none without strict=True)
    own = {f"{prefix}{key}" for key in module.state_dict(keep_vars=True)} if loading else set()
    unread = sorted(key for key in keys - own if key.startswith(prefix) and any(f".{attr}." in key for attr in attrs))
    module.__dict__[_ERRORS_ATTR] = (unread, error_msgs)


def _adapter_load_post_hook(module, incompatible) -> None:
    """After ``load_state_dict``: refuse an adapter load that left weights of the adapter at their initialisation
    (peft's ``ignore_mismatched_sizes=True`` drops those of another shape, with a warning) or, outside
    :func:`load_checked_adapter`, one that adapts a pruned attention layer: peft's loaders do not hand the model
    the adapter's directory, so its record of kept heads cannot be read there. The adapter is taken off."""
    loading = module.__dict__.pop(_LOADING_ATTR, None) or {}
    unread, errors = module.__dict__.pop(_ERRORS_ATTR, ([], None))
    if not loading:
        return
    if errors:  # torch raises them next (size mismatches): its message, the adapter taken off first
        _unload(module, set(loading))
        return
    expected = {key for keys in loading.values() for key in keys}
    missing = sorted(key for key in incompatible.missing_keys if key in expected)
    found = _pruned_root(module)
    adapted = _adapted_blocks(*found, set(loading)) if found is not None else []
    if missing:
        problem = (f"left {len(missing)} adapter weight{'s' if len(missing) != 1 else ''} at their initialisation "
                   f"(of another shape under ignore_mismatched_sizes=True, or missing from the file): "
                   f"{', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''}. An adapter made on the unpruned "
                   "model (or another pruning) has other shapes where heads were removed: train it on the pruned model")
    elif unread:
        problem = (f"left {len(unread)} weight{'s' if len(unread) != 1 else ''} of the adapter's file unread (no such "
                   f"adapter weight in the model): {', '.join(unread[:3])}{', ...' if len(unread) > 3 else ''}")
    elif adapted and _RECORD_ATTR in module.__dict__:  # peft_from_pretrained: the record read beforehand
        source, record = module.__dict__[_RECORD_ATTR]
        try:
            check_adapter_record(module, record, set(loading), source)
        except RuntimeError as error:
            _unload(module, set(loading))
            raise RuntimeError(f"{error}; the adapter was taken off the model again") from None
        return
    elif adapted and not module.__dict__.get(_CHECKED_ATTR):
        problem = (f"adapts the attention of pruned layers ({', '.join(adapted[:3])}{', ...' if len(adapted) > 3 else ''}),"
                   f" and peft's loaders do not show the model the adapter's {ADAPTER_RECORD}, the record of the heads it "
                   "was trained on (an adapter of another pruning with the same head counts fits every shape). Load it "
                   "with headlab.load_adapter(model, path) (peft_model=True for a PeftModel), or without headlab with "
                   "the pruned model's load_adapter(path) or peft_from_pretrained(model, path), which read the record")
    else:
        return
    _unload(module, set(loading))
    raise RuntimeError(f"pruned_heads.py: loading the adapter {', '.join(sorted(loading))} onto this pruned "
                       f"{_class_name(module)} {problem}; the adapter was taken off the model again")


def _unload(model: nn.Module, names: set) -> None:
    """Take the adapters ``names`` off ``model``, and the adapter layers left with none (their base layers back)."""
    for path, layer in _tuner_layers(model):
        for name in names & _adapter_names(layer):
            layer.delete_adapter(name)
        if not _adapter_names(layer):
            _set_submodule(model, path, layer.get_base_layer())
    configs = model.__dict__.get("peft_config")
    if isinstance(configs, dict):
        for name in names:
            configs.pop(name, None)


def check_loading_info(info: dict, base_class: str, adapter: str = "") -> None:
    """Raise when ``info`` (``from_pretrained``'s ``output_loading_info``; ``load_adapter``'s, with
    ``adapter``) names a weight left newly initialised (missing; of another shape, under
    ``ignore_mismatched_sizes=True``) or one of the checkpoint not loaded (unexpected)."""
    mismatched = [f"{key} {tuple(old)} in the checkpoint, {tuple(new)} in the model"
                  for key, old, new in info.get("mismatched_keys") or ()]
    problems = [f"{what} {found}" for found, what in (
        (sorted(info.get("missing_keys") or ()), "newly initialised (missing from the checkpoint):"),
        (sorted(mismatched), "newly initialised (another shape):"),
        (sorted(info.get("unexpected_keys") or ()), "in the checkpoint but not loaded:")) if found]
    if problems and adapter:
        raise RuntimeError(f"pruned_heads.py: the {adapter} does not fit the pruned {base_class}; weights "
                           f"{'; '.join(problems)}. An adapter made on the unpruned model (or another pruning) "
                           "has other shapes where heads were removed: train it on the pruned model.")
    if problems:
        raise RuntimeError(f"pruned_heads.py: this transformers ({transformers.__version__}) did not load the "
                           f"pruned {base_class} exactly; weights {'; '.join(problems)}. Load it with "
                           "headlab.load_pruned(path) instead.")


def _registry_lock():
    """One lock for every pruned_heads.py in this process (each checkpoint's copy is a module of its own):
    all register under the one class name ``PrunedModel`` (below), so a registration waits until a load
    that registered before it has looked its own entry up. Kept on transformers' registry module, which
    every copy shares; re-entrant, as from_pretrained's __init__ takes it again."""
    try:
        from transformers import conversion_mapping as mapping
    except ImportError:  # a transformers without checkpoint conversions: nothing to guard
        return threading.RLock()
    return mapping.__dict__.setdefault("_headlab_pruned_model_lock", threading.RLock())


def _share_checkpoint_conversion(model: nn.Module) -> None:
    """transformers converts some checkpoints when it loads a model of its own classes (renames:
    GPT-NeoX's embed_out is lm_head; fuses the experts of many mixtures of experts) and converts back
    when it saves, looking the conversion up by class name, then by ``model_type``, for the model and
    each sub-model not already covered (``conversion_mapping.get_model_conversion_mapping``). A class
    defined outside transformers is skipped unless its name is registered. Register this class under
    exactly the original class's own entry, which may be none (``None``): then, like the original, it
    is looked up by model type, which also covers its sub-models. Registering the model type's list
    under this class's name instead would apply it a second time through the sub-model (the inner
    model, looked up by model type): A.X-K1's ``post_mlp_layernorm`` was renamed twice and left newly
    initialised.

    The registry is one dict keyed by name, and every pruned model of every family is a ``PrunedModel``:
    the entry is the last one registered. So the caller holds :func:`_registry_lock`, and the model
    keeps its own conversions for saving (``_weight_conversions``, which ``save_pretrained`` reverts,
    and from_pretrained replaces with those its load used): else a model built here from its config and
    saved after a pruned model of another family was built was saved with that family's conversion (a
    pruned Llama's lm_head written as GPT-NeoX's embed_out, which no load reads back)."""
    try:
        from transformers import conversion_mapping as mapping
    except ImportError:  # a transformers without checkpoint conversions
        return
    # registered also when None: the last pruned model loaded in this process may have had an entry
    mapping.register_checkpoint_conversion_mapping(type(model).__name__,
                                                   mapping.get_checkpoint_conversion_mapping(BASE_CLASS),
                                                   overwrite=True)
    from transformers import core_model_loading

    # as save_pretrained looks a model up that was not loaded: without the prefix changes, which only
    # undo what a load saw (core_model_loading.revert_weight_conversion)
    prefix_change = getattr(core_model_loading, "PrefixChange", ())
    model._weight_conversions = [transform for transform in mapping.get_model_conversion_mapping(model, add_legacy=False)
                                 if not isinstance(transform, prefix_change)]
