"""LRP head relevance (Voita et al. 2019, Sec. 4 and Appendix A.3), computed fast.

Definitions, from the paper:

* **target**: the top-1 logit of each generation step of the model's own translation,
  teacher-forced on that translation (not the reference). A decoder-only model's target is
  the top-1 logit of its LM head at every position of the text; an encoder-only (masked) LM's
  at every non-special token; a fine-tuned classifier's, the logit of its predicted class (one
  target per text).
* **head relevance for one target**: the sum of the relevances of the head's neurons (the
  head's output, at the input of the output projection; over every run of it where the layer runs its output
  projection more than once, ``Family.output_calls``: PEGASUS-X's global tokens and tokens), normalised over the
  heads of its layer. Relevance can be negative, so the normaliser is the sum of absolute values: for
  non-negative relevances this is the plain normalisation of the paper, and a layer's scores
  always have absolute values summing to one.
* **head relevance**: the average of that over all generation steps of the data set, or over
  a seeded sample of ``targets`` steps per sentence (:func:`sample_targets`); its sampling error
  is a bootstrap over sentences (:func:`bootstrap_stderr`), kept in the signature.

The rules are in :mod:`headlab.importance.rules`: the modified backward pass that makes
gradient x input equal to LRP. Every target needs its own backward pass; ``strategy``
chooses how they are computed, all with equal results:

* ``"vmap"`` (default): batched backward passes, each for several steps of the batch at once
  (``torch.autograd.grad(..., is_grads_batched=True)``, i.e. ``vmap`` over one-hot
  ``grad_outputs``; steps per call from ``chunk_size`` or :func:`_auto_chunk`), with targets
  read from the needed rows of the output projection only;
* ``"loop"``: a Python loop of one backward per slot (each covering one step of every sentence
  of the batch);
* ``"jacobian"``: the full Jacobian of every target, one backward per output element, as the
  original TF code builds its Jacobians. Slow by construction; kept for checking and benchmarks.

The rows of a batch never interact, so one backward pass can explain one target of every row
at once, wherever each row's target sits: slot ``c`` is the ``c``-th step of each row
(:func:`_slots`). A batch costs as many backward passes as its longest row has steps, so a
sample of ``K`` targets per sentence costs ``K`` of them, not one per position that any row
happens to sample.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, replace
from typing import Any, cast

import numpy as np
import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from headlab.adapters import AttentionBlock, attention_blocks, is_linear
from headlab.adapters.families import LEARNED_STREAMS, LEARNED_TOKENS
from headlab.capture import Applications, HookHandles, eager_attention, eval_mode, float32_mask_floor, head_output_hooks
from headlab.data.batching import with_progress
from headlab.data.inputs import Batch, ImportanceData, count_batches, make_batches
from headlab.errors import HeadlabError, RunFailed, counted
from headlab.gates import measures_heads
from headlab.heads import HeadScores
from headlab.importance import cca_rule
from headlab.importance.common import block_scores
from headlab.importance.measure import MASK_INSTEAD, ImportanceMeasure
from headlab.importance.measure_options import STRATEGIES, LRPOptions
from headlab.importance.mixer_rules.hyper_connection import injection_probe_hooks
from headlab.importance.rules import (
    ROUTED_ROWS,
    adapted_gated_mlps,
    altup_inputs,
    altup_models,
    called_gated_mlps,
    check_rules,
    clamped_gated_mlps,
    expert_bias_probes,
    fused_gated_mlps,
    gated_mlps,
    is_paired_layer_norm,
    lrp_rules,
    norm_rule,
    per_layer_embeddings,
    per_layer_input_layers,
    register_hooks,
    routed_expert_rows,
    routed_experts,
)
from headlab.model_description import ModelInfo, describe_model, output_layer, pooled_pad_id
from headlab.portable_code import NoHeadAttention, output_bias_name
from headlab.shard import Ledger, active
from headlab.surgery import head_biases

__all__ = ["LRP", "LRPOptions", "STRATEGIES", "TargetRelevance", "bootstrap_stderr", "compute_lrp", "head_relevance",
           "normalize_per_layer", "sample_targets"]

@dataclass
class TargetRelevance:
    """Raw head relevances of a batch, one row per generation step.

    ``steps`` ``[n, 2]`` holds (row, position) of each target; ``logits`` ``[n]`` the target
    logits (without constant biases); ``relevance[(kind, layer)]`` ``[n, n_heads]`` the summed
    relevance of each head's neurons for each target (not normalised); ``embedding`` ``[n]`` the
    relevance that reached the input embeddings (:func:`_embeddings`; encoder and
    decoder embeddings together, and Gemma 3n's and Gemma 4's per-layer token embeddings); ``biases`` ``[n]``
    the relevance the biases kept (:func:`_bias_probes`, and the output layer's bias). The rules conserve
    relevance: ``embedding + biases == logits`` up to rounding. ``per_layer_embedding`` ``[n]``: the part of
    ``embedding`` that reached the per-layer token embeddings (:func:`_per_layer_embeddings`; zeros without them).
    """

    steps: torch.Tensor
    logits: torch.Tensor
    tokens: torch.Tensor
    relevance: dict[tuple[str, int], torch.Tensor]
    embedding: torch.Tensor
    biases: torch.Tensor
    per_layer_embedding: torch.Tensor | None = None


def normalize_per_layer(relevance: torch.Tensor) -> torch.Tensor:
    """``[n, n_heads]`` relevances divided by their layer's sum of absolute values (0 stays 0)."""
    total = relevance.abs().sum(-1, keepdim=True)
    return relevance / torch.where(total == 0, torch.ones_like(total), total)


def _multiplying_head(model: nn.Module) -> nn.Module | None:
    """MobileBERT's LM head (``MobileBertLMPredictionHead``), which never calls its output layer ``decoder``: it
    multiplies ``transform``'s output by ``[decoder.weight^T; dense.weight]`` itself and adds ``decoder.bias``
    (the embeddings' width is less than the hidden width); the head, or None for any other model."""
    output = output_layer(model)
    return next((m for m in model.modules() if type(m).__name__ == "MobileBertLMPredictionHead"
                 and getattr(m, "decoder", None) is output and output is not None), None)


_EMBEDDING_HEADS = ("DebertaLMPredictionHead", "DebertaV2LMPredictionHead")


def _embedding_head(model: nn.Module) -> nn.Module | None:
    """DeBERTa's (v1, v2) LM head with ``legacy=False``: it computes its logits itself, as
    ``LayerNorm(act(dense(x))) @ word_embeddings.weight^T + bias`` (transformers 5.24, the word embeddings handed to
    its forward), while ``get_output_embeddings`` names its ``dense`` (hidden to hidden), whose output is not the
    logits: that head, or None for any other model."""
    output = output_layer(model)
    return next((m for m in model.modules() if type(m).__name__ in _EMBEDDING_HEADS
                 and getattr(m, "dense", None) is output and output is not None), None)


def _logit_bias(model: nn.Module) -> torch.Tensor | None:
    """The bias added to the logits themselves: the output layer's, or DeBERTa's embedding head's own."""
    head = _embedding_head(model)
    bias = getattr(head if head is not None else output_layer(model), "bias", None)
    return bias if isinstance(bias, torch.Tensor) else None


def _output_weight(model: nn.Module) -> torch.Tensor:
    """``[vocab, d]``: the weight the logits are the product of ``z`` with (:func:`_lm_input`), detached."""
    head: Any = _multiplying_head(model)
    if head is not None:
        return torch.cat([head.decoder.weight.t(), head.dense.weight], dim=0).t().detach()
    if _embedding_head(model) is not None:
        return cast(torch.Tensor, cast(Any, model).get_input_embeddings().weight).detach()
    output = output_layer(model)
    assert output is not None  # head_relevance refuses a model without one first
    return cast(torch.Tensor, output.weight).detach()


@contextmanager
def _lm_input(model: nn.Module) -> Iterator[dict]:
    """Record the input of the output projection (the LM head's, or a classifier's last linear map);
    of MobileBERT's, which is never called (:func:`_multiplying_head`), the output of ``transform``; of DeBERTa's
    embedding head (:func:`_embedding_head`), the output of its ``LayerNorm``."""
    output = output_layer(model)
    assert output is not None  # head_relevance refuses a model without one first
    seen: dict = {}

    def hook(module, args):
        seen["z"] = args[0]

    head: Any = _multiplying_head(model)
    last = head.transform if head is not None else getattr(_embedding_head(model), "LayerNorm", None)
    handle = last.register_forward_hook(lambda module, args, out: hook(module, (out,))) \
        if last is not None else output.register_forward_pre_hook(hook)
    try:
        yield seen
    finally:
        handle.remove()


def _layer_path(name: str) -> str:
    """The layer holding the attention block ``name``: its nearest enclosing module whose path ends with a layer
    number (``model.layers.0`` for ``model.layers.0.self_attn``), whose input is the residual stream. GPT-Neo's
    attention nests one deeper (``transformer.h.0.attn.attention``): its parent, ``attn``, reads the normed
    stream, and relevance reaching it left out the residual path's share. XLM's and FlauBERT's module lists hold
    the attention modules themselves (``transformer.attentions.0``, beside ``layer_norm1.0`` and ``ffns.0``, no layer
    module): a block whose own path ends with its number, and holds no other number, is its layer, its input the
    residual stream (LongCat-Flash's ``model.layers.0.self_attn.0`` is one of two attentions in ``model.layers.0``).
    The parent where no path ends so."""
    parts = name.split(".")
    if parts[-1].isdigit() and not any(part.isdigit() for part in parts[:-1]):
        return name
    parts = parts[:-1]
    while parts and not parts[-1].isdigit():
        parts.pop()
    return ".".join(parts) if parts else name.rpartition(".")[0]


def _cut_path(block: AttentionBlock) -> str:
    """Where :func:`_embeddings` reads a stack's input: the layer holding its first block (:func:`_layer_path`); for a
    channels-first family (SqueezeBERT), the module holding its layer list, ``transformer.encoder``:
    SqueezeBertEncoder calls ``layer.forward(...)`` itself (transformers 5.24), so no hook on a layer runs, and its
    own input (``hidden_states``, [batch, seq, hidden], which it permutes to [batch, hidden, seq]) is the first
    layer's."""
    path = _layer_path(block.name)
    return path.rsplit(".", 2)[0] if block.family.channels_first and path.count(".") >= 2 else path


def _stack_start(names: dict[str, nn.Module], path: str) -> str:
    """The first layer of the module list whose layer ``path`` is (``model.layers.0`` for ``model.layers.1``), ``path``
    itself where it is the first or in no list. A hybrid's layers before its first attention block (Qwen3-Next's and
    OLMo-hybrid's Gated DeltaNet at layer 0, attention at 1) are crossed by relevance too: cut at the first attention
    layer, the relevance through them was never measured, and conservation held whatever they did with it."""
    parent, _, index = path.rpartition(".")
    if index.isdigit() and index != "0" and isinstance(names.get(parent), nn.ModuleList) and f"{parent}.0" in names:
        return f"{parent}.0"
    return path


def _learned_streams(module: nn.Module) -> int:
    """How many streams of rows that are no tokens follow the tokens' rows in ``module``'s input
    (:data:`~headlab.adapters.families.LEARNED_STREAMS`: ProphetNet's decoder's predicting streams); 0 elsewhere."""
    path = LEARNED_STREAMS.get(type(module).__name__)
    if path is None:
        return 0
    owner, _, name = path.rpartition(".")
    count = getattr(module.get_submodule(owner) if owner else module, name)
    return int(count)


@contextmanager
def _embeddings(model: nn.Module, ones: Callable[[torch.Tensor], torch.Tensor | None] | None = None
                ) -> Iterator[list[torch.Tensor]]:
    """The input embeddings of each stack (encoder, decoder) as its first layer receives them,
    what transformers calls ``hidden_states[0]``: relevance reaching them has crossed every
    layer; position embeddings, embedding scales and norms are on their near side. Recorded by
    a pre-hook on the first layer of the list holding each stack's first attention block (:func:`_stack_start`;
    ``output_hidden_states``
    would leave transformers' recording hooks on the model). Gemma 3n's text model: the input of
    ``per_layer_model_projection`` instead, the input embeddings its AltUp streams and per-layer inputs are both
    made from (:func:`headlab.importance.rules.altup_inputs`). A first layer whose input holds streams of rows that
    are no tokens after the tokens' (:func:`_learned_streams`, ProphetNet's decoder): the tokens' rows are the cut,
    the other rows times ``ones`` (a probe per row, :func:`_token_probe`), so that their relevance is kept as a
    bias's."""
    found: list[torch.Tensor] = []
    names = dict(model.named_modules())
    firsts: dict[str, AttentionBlock] = {}
    for block in attention_blocks(model):
        if block.idle:  # a tower token ids never run (GIT's image encoder): not a stack the logits come from
            continue
        stack = "enc" if block.kind == "enc_self" else "dec"
        if stack not in firsts or block.layer < firsts[stack].layer:
            firsts[stack] = block
    cuts = [_stack_start(names, _cut_path(b)) for b in firsts.values()]
    layers = {id(names[cut]): names[cut] for cut in cuts}
    # Gemma 3n: the first layer reads a stack of AltUp streams made from the input embeddings, which the per-layer
    # inputs read too (through per_layer_model_projection): the input embeddings themselves are the cut
    for text, projection in zip(altup_models(model), altup_inputs(model)):
        if layers.pop(id(cast(nn.ModuleList, text.layers)[0]), None) is not None:
            layers[id(projection)] = projection
    applications = Applications(list(firsts.values()))
    shared = {id(names[_layer_path(b.name)]): b.core for b in firsts.values() if b.shared}
    time_first = {id(names[_layer_path(b.name)]) for b in firsts.values() if b.family.time_first}

    def record(module, args, kwargs):
        if not torch.is_grad_enabled():
            return  # a pass under no_grad (discovery's probe forward) is not the one explained
        core = shared.get(id(module))
        if core is not None and applications.running.get(id(core), -1) != -1:
            return  # a shared layer (ALBERT) at a later depth: the stack's input is its first call's
        x = args[0] if args else kwargs.get("hidden_states")
        if not isinstance(x, torch.Tensor):
            raise HeadlabError(f"LRP: cannot find the input of {type(module).__name__}, so conservation cannot "
                               "be measured")
        if id(module) in time_first and args:  # FSMT's layers read [pos, batch, d] (positionally): the cut is its
            x = x.transpose(0, 1)  # batch-first view, which the layer then reads through
            found.append(x)
            return (x.transpose(0, 1), *args[1:]), kwargs
        streams = _learned_streams(module)
        if streams and ones is not None and all(x is not seen for seen in found):
            tokens = x.shape[1] // (1 + streams)  # [batch, (1 + streams) x tokens, d]: the tokens' rows first
            learned = x[:, tokens:]
            probe = ones(learned)
            found.append(x[:, :tokens])
            if probe is not None:
                x = torch.cat([found[-1], learned * probe], dim=1)
                return ((x, *args[1:]), kwargs) if args else (args, {**kwargs, "hidden_states": x})
            return None
        if all(x is not seen for seen in found):
            found.append(x)

    handles = HookHandles()
    handles.extend(applications.handles)
    try:
        for layer in layers.values():
            handles.append(layer.register_forward_pre_hook(record, with_kwargs=True))
        yield found
    finally:
        handles.remove()


@contextmanager
def _per_layer_embeddings(model: nn.Module) -> Iterator[list[torch.Tensor]]:
    """The outputs of the per-layer token embeddings (Gemma 3n's and Gemma 4's ``embed_tokens_per_layer``,
    :func:`headlab.importance.rules.per_layer_embeddings`): an input of the model beside its input embeddings,
    where the relevance the per-layer inputs' product rule sends into them ends (the rest crosses
    ``per_layer_model_projection`` to the input embeddings). Counted as input relevance, so that conservation
    holds, and reported apart."""
    found: list[torch.Tensor] = []

    def record(module, args, output):
        if torch.is_grad_enabled():  # not discovery's probe forward
            found.append(output)

    handles = HookHandles()
    try:
        for module in per_layer_embeddings(model):
            handles.append(module.register_forward_hook(record))
        yield found
    finally:
        handles.remove()


def lrp_precision(model: nn.Module) -> torch.dtype:
    """The float type LRP computes in: float64 for a model with gated MLPs (fused [gate | up]
    projections, LFM2's with its activation a function call, MiniMax-M3's clamped SwiGLU, and mixtures of experts
    included) or per-layer inputs (the same product rule), float32 otherwise.

    Ding et al.'s product rule splits ``a * b`` as ``a / (a + b)`` and ``b / (a + b)``, and
    ``a + b`` crosses zero: on the bundled English LM single neurons of the lowest layers get
    up to 1e10 times the explained logit, with opposite signs, which cancel exactly in real
    numbers. float32 keeps 7 digits: there the relevance reaching the embeddings came to between
    -0.5 and 47 times the logit per sentence, float64 to 1 within 2e-6 (docs/importance.md).
    Half-precision models are never computed in their own precision."""
    gated = gated_mlps(model) or fused_gated_mlps(model) or called_gated_mlps(model) or routed_experts(model) \
        or adapted_gated_mlps(model) \
        or clamped_gated_mlps(model) or per_layer_input_layers(model)
    return torch.float64 if gated else torch.float32


@contextmanager
def _widened(model: nn.Module, dtype: torch.dtype) -> Iterator[None]:
    """``model`` computed in ``dtype`` (float32 or float64): its narrower floating parameters and
    buffers are widened in place and narrowed back on exit, exactly (every float16, bfloat16 and
    float32 number is a float64 number), so the model is the same object, bit for bit, afterwards,
    and no second copy of it is held."""
    wide = torch.finfo(dtype).bits
    changed: list[tuple[object, str, torch.dtype]] = []
    try:
        seen: set[int] = set()
        for parameter in model.parameters():
            if parameter.is_floating_point() and torch.finfo(parameter.dtype).bits < wide \
                    and id(parameter) not in seen:
                seen.add(id(parameter))
                changed.append((parameter, "data", parameter.dtype))
                parameter.data = parameter.data.to(dtype)
        for module in model.modules():
            for name, buffer in list(module._buffers.items()):
                if buffer is not None and buffer.is_floating_point() and torch.finfo(buffer.dtype).bits < wide:
                    changed.append((module, name, buffer.dtype))
                    module._buffers[name] = buffer.to(dtype)
        yield
    finally:
        for owner, name, narrow in reversed(changed):
            if name == "data":
                owner.data = owner.data.to(narrow)  # type: ignore[attr-defined]
            else:
                owner._buffers[name] = owner._buffers[name].to(narrow)  # type: ignore[attr-defined]


class _KeptWide(TorchFunctionMode):
    """Every floating type narrower than ``dtype`` that the model's code asks for is ``dtype``.

    Widening the weights is not enough: transformers' code narrows on its own (Beam's MLP takes
    ``act(gate.float()) * up.float()``, Hunyuan-V3 adds its experts' outputs in ``.float()``, the
    norms and the eager softmax compute in float32). A narrowing on the relevance's path rounds its
    value, not its gradient, so ``x * g`` loses ~1e-7 of the logit at each (Beam: 3e-6 relevance
    not conserved in float64, 5e-14 with this). Here ``.float()``, ``.half()``, ``.bfloat16()``,
    ``.to(dtype)``, ``.type_as(other)`` and every ``dtype=`` of a narrower float give ``dtype``
    instead; ``.view(dtype)`` (a reinterpretation of the bits) is left alone."""

    _NARROWING = (torch.Tensor.float, torch.Tensor.half, torch.Tensor.bfloat16)

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.dtype = dtype
        self.bits = torch.finfo(dtype).bits

    def _narrow(self, value: Any) -> bool:
        return isinstance(value, torch.dtype) and value.is_floating_point and torch.finfo(value).bits < self.bits

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func in self._NARROWING:
            func, args = torch.Tensor.to, (args[0], self.dtype)
        elif func is torch.Tensor.type_as and isinstance(args[1], torch.Tensor) and self._narrow(args[1].dtype):
            func, args = torch.Tensor.to, (args[0], self.dtype)
        elif func is torch.Tensor.to and len(args) > 1 and isinstance(args[1], torch.Tensor) \
                and self._narrow(args[1].dtype):  # x.to(other): other's device, not its narrower type
            args = (args[0], args[1].device, self.dtype, *args[2:])
        elif func is not torch.Tensor.view:
            args = tuple(self.dtype if self._narrow(a) else a for a in args)
            if self._narrow(kwargs.get("dtype")):
                kwargs["dtype"] = self.dtype
        return func(*args, **kwargs)


def _computed_in(model: nn.Module) -> torch.dtype:
    """The widest floating type of ``model``'s parameters: what a widened model computes in."""
    return max((p.dtype for p in model.parameters() if p.is_floating_point()), key=lambda d: torch.finfo(d).bits,
               default=torch.float32)


def _finite_masks(model: nn.Module) -> AbstractContextManager[None]:
    """Additive float64 attention masks raised to float32's lowest number
    (:func:`headlab.capture.float32_mask_floor`): a query that may attend to no key at all (a padding
    position under a sliding window: Gemma 2 and 3, ModernBERT's local layers; left padding) would
    otherwise get NaN probabilities in a float64 model, which reach every gradient of its row.
    (:class:`_KeptWide` now gives eager attention a float64 softmax, where such a row is finite
    without the floor; the floor stays for any float32 arithmetic a mask meets.)"""
    return float32_mask_floor(model)


@dataclass(frozen=True)
class _Tokens:
    """The tokens of one forward, as the bias probes read a module's output: ``batch_size`` sentences, and the
    ``lengths`` of its inputs (the source's and the target's, ``[batch, length]``; 1: a row per sentence)."""

    batch_size: int
    lengths: frozenset[int]

    @classmethod
    def of(cls, inputs: Mapping[str, Any]) -> _Tokens:
        batch_size = next(iter(inputs.values())).shape[0]
        lengths = {x.shape[1] for x in inputs.values()
                   if isinstance(x, torch.Tensor) and x.dim() >= 2 and x.shape[0] == batch_size}
        return cls(batch_size, frozenset(lengths | {1}))

    def per_token(self, rows: torch.Size) -> bool:
        """Whether an output whose leading dimensions (all but the features) are ``rows`` holds the batch's tokens,
        batch-major. Flattened rows (``[rows, features]``: OPT's MLP, GPT-OSS's experts) must be all of them, a
        batch times an input's length: a gathered subset (an expert's tokens) whose count is a multiple of the batch
        size, read batch-major, would send its biases' shares to the wrong sentences (experts held as modules with
        biases are refused before any work, rules._routed_biases_problem, but those whose rows headlab computes:
        :class:`_RoutedRows`)."""
        if len(rows) == 1:
            return rows[0] in {self.batch_size * n for n in self.lengths}
        return len(rows) > 1 and rows.numel() % self.batch_size == 0


@dataclass
class _ProbeLog:
    """What the bias probes saw besides their probes: the probes of biases added to rows that are not the batch's
    tokens, by module path (:func:`_refuse_unplaced`), and the module path of each probe, by its id."""

    unplaced: dict[str, list[torch.Tensor]]
    paths: dict[int, str]


class _RoutedRows:
    """The probes of the biases of experts that run on rows gathered from the batch's tokens (rules.ROUTED_ROWS:
    NLLB-MoE's ``fc1`` and ``fc2``). At each call of the experts module, ``s``: ones, one per token of the batch
    (``[tokens, 1]``, batch-major as the flattened hidden states are), a probe; each expert, on the rows ``r`` of
    those tokens it runs on, gets ``s[r]`` as the probe of its modules' biases. Indexing's backward sums the
    gradient reaching ``s[r]`` back onto the tokens the rows came from (a token routed twice, twice), so each bias's
    share goes to its token's sentence. An expert whose input is not the rows so computed is refused (another
    implementation); one called otherwise keeps probes of its own (``_refuse_unplaced``)."""

    def __init__(self, model: nn.Module, tokens: _Tokens, probes: list[torch.Tensor], log: _ProbeLog,
                 paths: Mapping[int, str]) -> None:
        self.tokens, self.probes, self.log, self.paths = tokens, probes, log, paths
        self.experts = [module for module in model.modules() if type(module).__name__ in ROUTED_ROWS]
        self.inside = {id(module) for experts in self.experts for module in experts.modules()}
        self.routed: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}  # id(expert) -> (x, rows, s)
        self.current: dict[int, torch.Tensor] = {}  # id(a module of the running expert) -> its rows of s

    def hooks(self) -> HookHandles:
        handles = HookHandles()
        for experts in self.experts:
            handles.append(experts.register_forward_pre_hook(self.before_experts))
            for expert in experts.children():
                handles.append(expert.register_forward_pre_hook(self.before_expert))
                handles.append(expert.register_forward_hook(self.after_expert))
        return handles

    def probe_of(self, module: nn.Module, probe: Callable) -> Callable:
        """The bias probe of ``module``: ``probe`` (one per row of its output), but on a module of these experts
        while its expert runs on known rows, their tokens' probes."""

        def routed_probe(module, args, output):
            rows, bias = self.current.get(id(module)), module.bias
            if rows is None or not isinstance(output, torch.Tensor) or output.shape[:-1] != rows.shape[:-1] \
                    or bias.dim() != 1 or output.shape[-1] != bias.shape[0]:
                return probe(module, args, output)
            kept = bias.detach().to(output.dtype) * rows
            return output + (kept - kept.detach())

        return routed_probe if id(module) in self.inside else probe

    def before_experts(self, module: nn.Module, args: tuple) -> None:
        for expert in module.children():
            self.routed.pop(id(expert), None)
        x = args[0] if args else None
        if not torch.is_grad_enabled() or len(args) < 2 or not isinstance(x, torch.Tensor) or x.dim() != 2 \
                or not self.tokens.per_token(x.shape[:-1]):
            return  # its experts' biases keep probes of their own, refused if relevance reaches them
        s = torch.ones(x.shape[0], 1, dtype=x.dtype, device=x.device, requires_grad=True)
        self.probes.append(s)
        self.log.paths[id(s)] = self.paths[id(module)]
        for name, rows in cast(dict, routed_expert_rows(module, args)).items():
            self.routed[id(module.get_submodule(name))] = (x, rows, s)

    def before_expert(self, expert: nn.Module, args: tuple) -> None:
        self.after_expert(expert)
        routed = self.routed.pop(id(expert), None)
        if routed is None:
            return
        x, rows, s = routed
        if not args or not isinstance(args[0], torch.Tensor) or args[0].shape != (len(rows), x.shape[-1]) \
                or not torch.equal(args[0], x[rows]):
            raise HeadlabError(
                f"LRP: no rule for the biases of the expert {self.paths[id(expert)]}: it does not run on the rows of the "
                "batch's tokens headlab computes from its router mask (as transformers 5.24's forward gathers them), "
                "so their shares cannot be given to the sentences the rows came from; the other measures work on this "
                "model")
        tokens = s[rows]
        for module in expert.modules():
            self.current[id(module)] = tokens

    def after_expert(self, expert: nn.Module, *_: Any) -> None:
        for module in expert.modules():
            self.current.pop(id(module), None)


@contextmanager
def _bias_probes(model: nn.Module, tokens: _Tokens, skip: nn.Module | None,
                 log: _ProbeLog) -> Iterator[list[torch.Tensor]]:
    """Measure the relevance each row's biases keep (a bias is a neuron of its own, Voita et al.
    2019, App. A.2): a module with a ``bias`` adds ``b * s - stop(b * s)`` (zero) to its output,
    with ``s`` a tensor of ones, one per token (``output.shape[:-1]``, batch-major also when the
    module sees the tokens flattened, as OPT's MLP does), so that ``s * d y / d s`` is the
    relevance of its bias. Forward values are unchanged. The probe goes before the module's
    other hooks (detached query and key columns drop it), except on a normalisation, whose rule
    would drop it; ``skip`` (the output layer, whose bias is added to the target directly)
    gets none. The experts' biases held in 3-d parameters (GPT-OSS's) are probed inside their rule
    (:func:`headlab.importance.rules.expert_bias_probes`); those of experts held as modules on rows gathered from the
    tokens (NLLB-MoE's) with the probes of their rows' tokens (:class:`_RoutedRows`). ``tokens``: what an output per token is
    (:meth:`_Tokens.per_token`); a module adding its bias to other rows gets probes of its own, by its path in
    ``log.unplaced``, which no relevance may reach (:func:`_refuse_unplaced`). ``log.paths``: each probe's module,
    for :func:`_check_rows`."""
    probes: list[torch.Tensor] = []
    batch_size = tokens.batch_size
    paths = {id(m): path for path, m in model.named_modules()}
    routed = _RoutedRows(model, tokens, probes, log, paths)  # experts on gathered rows (NLLB-MoE's): their tokens' probes
    # the modules of a time-first family's layers (FSMT's), whose outputs are [pos, batch, ...]: probed batch-first
    names = dict(model.named_modules())
    time_first = {id(m) for b in attention_blocks(model) if b.family.time_first
                  for m in names[_layer_path(b.name)].modules()}
    # the modules of a channels-first family's layers (SqueezeBERT's), whose outputs are [batch, channels, seq]
    channels_first = {id(m) for b in attention_blocks(model) if b.family.channels_first
                      for m in names[_layer_path(b.name)].modules()}

    def probe(module, args, output):
        if not torch.is_grad_enabled():
            return None  # a pass under no_grad (discovery's probe forward) is not the one explained
        if isinstance(output, tuple) and len(output) == 2 and output[1] is None and paired(module):
            # I-BERT's QuantLinear and IntLayerNorm (quant_mode=False): (output, None), the bias in the output
            out = probe(module, args, output[0])
            return None if out is None else (out, None)
        bias = module.bias
        if (id(module) in channels_first or isinstance(module, nn.Conv1d)) and isinstance(output, torch.Tensor) \
                and output.dim() == 3 and bias.dim() == 1 and output.shape[1] == bias.shape[0] \
                and output.shape[0] == batch_size:
            # SqueezeBERT's 1x1 convolutions and layer norms over [batch, channels, seq]: one s per token, [b, 1, seq];
            # any 1-d convolution's output likewise (RecurrentGemma's conv_1d: [batch, channels, seq + padding], the
            # padded positions sliced off after it and so keeping nothing)
            s = torch.ones(output.shape[0], 1, output.shape[2], dtype=output.dtype, device=output.device,
                           requires_grad=True)
            probes.append(s)  # batch-major: _reached sums over all but the batch dimension
            kept = bias.detach().to(output.dtype)[:, None] * s
            return output + (kept - kept.detach())
        if not isinstance(output, torch.Tensor) or output.dim() < 2 or bias.dim() != 1 \
                or output.shape[-1] != bias.shape[0]:
            return None  # no bias added per row: its bias, if any, shows in the conservation check
        if id(module) in seq_major or id(module) in time_first and output.dim() == 3:
            # called on [seq, batch, d] (Longformer's projections, FSMT's time-first layers): s batch-major, as
            # _reached reads it
            s = torch.ones(output.shape[1], output.shape[0], *output.shape[2:-1], 1, dtype=output.dtype,
                           device=output.device, requires_grad=True)
            kept = bias.detach().to(output.dtype) * s.transpose(0, 1)
        else:
            s = torch.ones(*output.shape[:-1], 1, dtype=output.dtype, device=output.device, requires_grad=True)
            kept = bias.detach().to(output.dtype) * s
        # rows that are not the batch's tokens (a gathered subset, rows the sentences share): a probe of their own,
        # which _refuse_unplaced checks no relevance reaches
        per_token = tokens.per_token(output.shape[:-1])
        (probes if per_token else log.unplaced.setdefault(paths[id(module)], [])).append(s)
        log.paths[id(s)] = paths[id(module)]
        return output + (kept - kept.detach())

    def paired(module) -> bool:
        return is_linear(module) and not isinstance(module, nn.Linear) or is_paired_layer_norm(module)

    def expert_probe(x):
        # the experts' own biases (GPT-OSS's 3-d gate_up_proj_bias, down_proj_bias): rules.expert_bias_probes
        if not torch.is_grad_enabled() or x.dim() != 2 or not tokens.per_token(x.shape[:-1]):
            return None
        s = torch.ones(x.shape[0], 1, dtype=x.dtype, device=x.device, requires_grad=True)
        probes.append(s)
        return s

    def no_head_probe(module, args, output):
        # A layer pruned to no head adds its output projection's bias without calling the projection
        # (ZeroHeadAttention): the same probe on that bias, on the layer's output. With the block's own
        # output norm (ALBERT, which is never pruned) the bias is inside the norm: nothing to probe. The projection may
        # lie deeper than a child (Inkling2's o_proj.linear; before, getattr of the dotted path failed there)
        projection = module.get_submodule(module.o_name) if module.o_name else None
        if projection is None or module.norm or not isinstance(getattr(projection, "bias", None), torch.Tensor):
            return None
        out = probe(projection, args, output[0])
        return None if out is None else type(output)([out, *output[1:]])  # GPT-1's list stays a list

    def output_bias_probe(module, args, output):
        # the bias an attention returns last for its caller to add to its output (GPT-NeoX-Japanese's dense_bias,
        # portable_code.OUTPUT_BIASES; None but in the last layer): handed back per token with the same probe, the
        # caller's expand_as then a no-op
        bias, out = output[-1], output[0]
        if not torch.is_grad_enabled() or not isinstance(bias, torch.Tensor) or bias.dim() != 1 \
                or not isinstance(out, torch.Tensor) or out.dim() < 2 or out.shape[-1] != bias.shape[0] \
                or not tokens.per_token(out.shape[:-1]):
            return None
        s = torch.ones(*out.shape[:-1], 1, dtype=out.dtype, device=out.device, requires_grad=True)
        probes.append(s)
        kept = bias.detach().to(out.dtype) * s
        return type(output)([*output[:-1], bias.to(out.dtype).expand(out.shape) + (kept - kept.detach())])

    def head_bias_probe(block: AttentionBlock):
        # biases the forward adds to the fused projection's query and value heads after it (DeBERTa v1's q_bias and
        # v_bias: Family.head_biases): the same probe, at their columns of the projection's output (the query's gets
        # no gradient there, the query columns being detached by the rules)
        q, _, v = block.qkv_columns()
        parts = [(owner, name, (q if part == "q" else v).reshape(-1)) for owner, name, part in head_biases(block)]

        def hook(module, args, output):
            if not torch.is_grad_enabled() or not isinstance(output, torch.Tensor) or output.dim() < 2 \
                    or not tokens.per_token(output.shape[:-1]):
                return None
            full = output.new_zeros(output.shape[-1])
            for owner, name, columns in parts:
                full = full.index_copy(0, columns.to(full.device), getattr(owner, name).detach().to(full.dtype))
            s = torch.ones(*output.shape[:-1], 1, dtype=output.dtype, device=output.device, requires_grad=True)
            probes.append(s)
            kept = full * s
            return output + (kept - kept.detach())

        return hook

    handles = HookHandles()
    seq_major = {id(block.module.get_submodule(path)) for block in attention_blocks(model) if block.n_heads
                 for path in block.family.seq_major}
    held = query_key_norms(model)
    try:
        for block in attention_blocks(model):
            if block.qkv is not None and block.n_heads and head_biases(block):
                handles.append(block.qkv.register_forward_hook(head_bias_probe(block), prepend=True))
        for module in model.modules():
            if output_bias_name(module):
                handles.append(module.register_forward_hook(output_bias_probe, prepend=True))
            if isinstance(module, NoHeadAttention):
                handles.append(module.register_forward_hook(no_head_probe, prepend=True))
                continue
            if module is skip or isinstance(module, nn.Embedding) or id(module) in held \
                    or not isinstance(getattr(module, "bias", None), torch.Tensor):
                continue
            try:
                ruled = norm_rule(module) is not None
            except HeadlabError:  # a norm without a rule where LRP's forward never goes (lrp_rules refuses it there)
                ruled = True
            handles.append(module.register_forward_hook(routed.probe_of(module, probe), prepend=not ruled))
        # ZAYA's biases that no module's bias holds
        handles.extend(register_hooks(cca_rule.bias_probe_hooks(model, _token_probe(probes, tokens))))
        # Qwen4-Exp's n-gram injections, detached by their rule: a source whose share is kept, as a bias's
        handles.extend(register_hooks(injection_probe_hooks(model, _token_probe(probes, tokens))))
        # learned tokens that are not input tokens (PEGASUS-X's global tokens, LEARNED_TOKENS): constants the model
        # adds, their share kept as a bias's
        handles.extend(_learned_token_probes(model, _token_probe(probes, tokens)))
        handles.extend(routed.hooks())
        with expert_bias_probes(model, expert_probe):
            yield probes
    finally:
        handles.remove()


_QUERY_KEY_NORM = re.compile(r"(q|k|query|key)_?(layer_?)?norm")
"""The name of a norm over an attention's queries or keys alone (Persimmon's q_layernorm, Qwen3's k_norm), not over
keys and values (DeepSeek's kv_a_layernorm)."""


def query_key_norms(model: nn.Module) -> set[int]:
    """The norms (by id) that only an attention's queries or keys pass, after the projections whose outputs the rules
    detach: the queries and keys are held constant, so such a norm's bias keeps no relevance. A probe on it would
    open a path through the softmax that the rules close, and lose relevance there (Persimmon's q_layernorm and
    k_layernorm, LayerNorms with biases: conserved to 3e-4 in float64 before; experiments/fuzz_heads.py)."""
    found: set[int] = set()
    for block in attention_blocks(model):
        for path, module in block.core.named_modules():
            if path and _QUERY_KEY_NORM.fullmatch(path.split(".")[0]) and not is_linear(module):
                found.add(id(module))
    return found


def _refuse_unplaced(unplaced: Mapping[str, list[torch.Tensor]], y: torch.Tensor, steps: torch.Tensor,
                     tokens: _Tokens) -> None:
    """Refuse when relevance of the explained steps reaches a bias added to rows that are not the batch's tokens
    (:meth:`_Tokens.per_token`): its share belongs to the sentences of rows headlab cannot tell apart (an expert's
    gathered tokens), so relevance would be conserved only in total, silently wrong per sentence. Rows that none
    reaches (DeBERTa's relative-position projections, shared by the sentences and feeding the constant attention
    weights only) keep nothing and pass."""
    if not unplaced:
        return
    ends = [s for probes in unplaced.values() for s in probes]
    grads = torch.autograd.grad((y * steps).sum(), ends, retain_graph=True, allow_unused=True)
    reached = iter(g is not None and bool(g.ne(0).any()) for g in grads)
    for path, probes in unplaced.items():
        if any([next(reached) for _ in probes]):
            rows = [tuple(s.shape[:-1]) for s in probes]
            raise HeadlabError(
                f"LRP: no rule for the bias of {path}: it is added to rows {rows[0]} that are not the batch's tokens "
                f"({tokens.batch_size} sentences of {'/'.join(map(str, sorted(tokens.lengths - {1})))} tokens: a subset "
                "gathered from them, as a mixture of experts routes them, or in another order), and relevance reaches "
                "it, so its share cannot be given to the sentences it came from; the other measures work on this model")


def _check_rows(probes: list[torch.Tensor], paths: Mapping[int, str], y: torch.Tensor, steps: torch.Tensor,
                batch_size: int) -> None:
    """Refuse when a probe's rows are not batch-major after all: relevance of one sentence's steps reaching the rows
    _reached gives another sentence. Checked on the probes whose rows could be in any order (``[rows, 1]``: a
    flattened MLP's, as OPT's; or not led by the batch), by backward passes of the explained steps scaled per
    sentence ``r`` by ``2^(r mod 32)`` and by ``2^(r // 32 mod 32)``: a row of sentence ``r`` alone gets exactly the
    unscaled gradient times its sentence's powers of two (scaling by a power of two is exact in floating point),
    and a row of another sentence a gradient at least twice or half that (a permutation or a gathered subset of all
    the rows, which the row count alone does not tell, :meth:`_Tokens.per_token`)."""
    # (no row: X-MOD's adapter of a language no sentence of the batch is in, run on [0, seq, d])
    loose = [s for s in probes if (s.dim() == 2 or s.shape[0] != batch_size) and s.numel()]
    if not loose:
        return
    sentence = torch.arange(batch_size, device=y.device)
    scales = torch.stack([torch.ones_like(sentence), sentence % 32, sentence // 32 % 32]).to(y.dtype)
    scales[1:] = 2.0 ** scales[1:]
    selectors = steps.to(y.dtype)[None] * scales.reshape(3, batch_size, *[1] * (y.dim() - 1))
    # three plain backward passes, not one batched (vmap) one: the check holds under every strategy, "loop" being
    # the one for models whose backward vmap cannot batch
    passes = [torch.autograd.grad(y, loose, grad_outputs=selector, retain_graph=True, allow_unused=True)
              for selector in selectors]
    grads = [None if any(g is None for g in per_probe) else torch.stack(per_probe) for per_probe in zip(*passes)]
    for s, grad in zip(loose, grads):
        if grad is None or not torch.isfinite(grad).all():
            continue  # none reaches it; or a NaN, which the conservation check reports as such
        grad = grad.reshape(3, batch_size, -1)  # the rows batch-major, as _reached reads them
        expected = grad[0][None] * scales[1:, :, None]
        if not torch.allclose(grad[1:], expected, rtol=1e-6, atol=1e-9 * float(expected.abs().max())):
            raise HeadlabError(
                f"LRP: no rule for the bias of {paths.get(id(s), 'a module')}: its {s.shape[0]} rows are not the "
                "batch's tokens in batch order (relevance of one sentence reaches rows of another: a subset of the "
                "tokens gathered or reordered, as a mixture of experts routes them), so its share cannot be given to "
                "the sentences it came from; the other measures work on this model")


def _learned_token_probes(model: nn.Module, ones) -> HookHandles:
    """:func:`_source_probe` on each embedding of learned tokens (:data:`~headlab.adapters.families.LEARNED_TOKENS`)."""
    handles = HookHandles()
    for module in model.modules():
        if (child := LEARNED_TOKENS.get(type(module).__name__)) is not None:
            handles.append(getattr(module, child).register_forward_hook(_source_probe(ones)))
    return handles


def _source_probe(ones):
    """A forward hook on a module whose output is a constant of the model (learned tokens' embeddings): the output
    unchanged, plus a probe per token (``ones``, :func:`_token_probe`) whose gradient is the relevance reaching it."""

    def hook(module, args, output):
        s = ones(output)
        if s is None:
            return None
        kept = output.detach() * s
        return output + (kept - kept.detach())

    return hook


def _token_probe(probes: list[torch.Tensor], tokens: _Tokens):
    """``ones(x)``: ones ``[..., 1]``, one per token of ``x`` (``[batch, seq, ...]``), that require grad, appended to
    ``probes`` (None under no_grad or where ``x`` is not per token): for the biases a rule adds itself
    (:func:`headlab.importance.cca_rule.bias_probe_hooks`)."""

    def ones(x: torch.Tensor) -> torch.Tensor | None:
        if not torch.is_grad_enabled() or not isinstance(x, torch.Tensor) or x.dim() < 2 \
                or not tokens.per_token(x.shape[:-1]):
            return None
        s = torch.ones(*x.shape[:-1], 1, dtype=x.dtype, device=x.device, requires_grad=True)
        probes.append(s)
        return s

    return ones


def _pooled_positions(model: nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    """Where a decoder-only classifier reads its class logits: the last non-padding token, as
    transformers' ``...ForSequenceClassification`` pools them (a wrapper's by its text config's padding id)."""
    pad = pooled_pad_id(model.config)
    if pad is None:
        return torch.full((input_ids.shape[0],), input_ids.shape[1] - 1, device=input_ids.device)
    positions = torch.arange(input_ids.shape[1], device=input_ids.device)
    return (positions * (input_ids != pad)).argmax(-1)


def _targets(model: nn.Module, logits: torch.Tensor, z: torch.Tensor,
             input_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-1 token of every position and its logit recomputed from the needed rows only; for a
    classifier (logits ``[batch, classes]``) the predicted class, as one step ``[batch, 1]``."""
    output = output_layer(model)
    if logits.dim() == 2:  # a sequence classifier
        if z.dim() == 3:  # its class layer ran at every position (GPT-2's score): take the pooled one
            assert input_ids is not None  # a classifier's batch has them
            z = z[torch.arange(z.shape[0], device=z.device), _pooled_positions(model, input_ids)]
        z, logits = z[:, None, :], logits[:, None, :]  # [batch, 1, d], [batch, 1, classes]
    if z.dim() == 4 and logits.dim() == 3:  # ProphetNet's LM head runs on its predicting streams, [batch, ngram,
        z = z[:, 0]  # t_len, d]: its logits are the first stream's (the next token's), the others logits_ngram
    top = logits.detach().argmax(-1)  # [batch, t_len]
    assert output is not None  # head_relevance refuses a model without one first
    weight = _output_weight(model)  # [vocab, d]
    y = (z * weight[top]).sum(-1)  # [batch, t_len]
    bias = _logit_bias(model)
    if bias is not None:
        y = y + bias.detach()[top]
    if _multiplying_head(model) is not None or _embedding_head(model) is not None:  # rebuilt from the head's parts
        with torch.no_grad():
            if not torch.allclose(y, logits.gather(-1, top[..., None])[..., 0], rtol=1e-4, atol=1e-5):
                head = ("MobileBERT's LM head does not compute its logits as transform(x) times "
                        "[decoder.weight^T; dense.weight] plus decoder.bias" if _multiplying_head(model) is not None
                        else "DeBERTa's LM head (legacy=False) does not compute its logits as LayerNorm(act(dense(x))) "
                        "times the input embeddings' weight^T plus its bias")
                raise HeadlabError(f"LRP: {head}; headlab cannot explain them")
    return y, top


def _slots(steps: torch.Tensor) -> tuple[torch.Tensor, int]:
    """The rank of each step within its row (``[batch, t_len]``, -1 where no step) and the
    number of slots (the most steps of a row): backward ``c`` explains the ``c``-th step of
    every row at once."""
    rank = torch.where(steps, steps.long().cumsum(1) - 1, torch.full_like(steps, -1, dtype=torch.long))
    return rank, int(steps.sum(1).max()) if steps.numel() else 0


def _slot_selectors(steps: torch.Tensor, rank: torch.Tensor, start: int, stop: int, like: torch.Tensor) -> torch.Tensor:
    """One-hot ``grad_outputs`` ``[stop - start, *like.shape]``: slice ``c`` selects the step of
    rank ``start + c`` in every row that has one."""
    selector = torch.zeros(stop - start, *like.shape, dtype=like.dtype, device=like.device)
    chosen = steps & (rank >= start) & (rank < stop)
    rows, positions = chosen.nonzero(as_tuple=True)
    selector[rank[rows, positions] - start, rows, positions] = 1
    return selector


def sample_targets(steps: torch.Tensor, sentences: list[int], k: int | None, seed: int = 0) -> torch.Tensor:
    """A seeded sample of ``k`` steps of each row of ``steps`` (``[batch, t_len]`` bool); a row
    with at most ``k`` steps, or ``k`` None or 0, keeps all of them.

    Row ``r``'s sample depends only on ``(seed, sentences[r])`` (its sentence number in the
    data set), so it does not change with the batch size or the order of the batches.
    """
    if not k:
        return steps
    sampled = torch.zeros_like(steps)
    for row, sentence in enumerate(sentences):
        positions = steps[row].nonzero().flatten()
        if len(positions) > k:
            rng = np.random.default_rng((seed, sentence))
            positions = positions[torch.as_tensor(np.sort(rng.choice(len(positions), k, replace=False)))]
        sampled[row, positions] = True
    return sampled


def bootstrap_stderr(sums: np.ndarray, counts: np.ndarray, resamples: int = 200, seed: int = 0) -> np.ndarray:
    """Bootstrap standard error over sentences of ``sums.sum(0) / counts.sum()``.

    ``sums`` ``[n_sentences, n]`` are each sentence's summed per-target scores, ``counts``
    ``[n_sentences]`` its number of targets. Each of ``resamples`` draws ``n_sentences``
    sentences with replacement (seeded) and recomputes the ratio; the standard error is the
    standard deviation (ddof 1) of those. Sentences are the unit because targets of one
    sentence are not independent. NaN with fewer than two resamples or sentences.
    """
    sums, counts = np.asarray(sums, dtype=np.float64), np.asarray(counts, dtype=np.float64)
    n = len(counts)
    if resamples < 2 or n < 2:
        return np.full(sums.shape[1:], np.nan)
    rng = np.random.default_rng(seed)
    weights = rng.multinomial(n, np.full(n, 1 / n), size=resamples).astype(np.float64)  # [resamples, n]
    totals = weights @ counts
    ratios = (weights @ sums) / np.where(totals == 0, 1, totals)[:, None]
    return ratios.std(axis=0, ddof=1)


def _append_summed(per_slot: dict, keys: list, pieces: list[torch.Tensor]) -> None:
    """Append to ``per_slot[key]`` the sum of the ``pieces`` of that key (one per recorded run of its block's output
    projection: several where ``Family.output_calls`` says so, one elsewhere)."""
    summed: dict = {}
    for key, piece in zip(keys, pieces):
        summed[key] = summed[key] + piece if key in summed else piece
    for key, piece in summed.items():
        per_slot[key].append(piece)


def _contract(grad: torch.Tensor | None, heads: torch.Tensor, n: int | None = None) -> torch.Tensor:
    """Relevance summed over positions and head dims: ``[(n,) batch, pos, H, d] -> [(n,) batch, H]``.

    ``grad`` is None when no head of the block lies on the path to the targets.
    """
    if grad is None:
        shape = (heads.shape[0], heads.shape[2]) if n is None else (n, heads.shape[0], heads.shape[2])
        return heads.new_zeros(shape)
    return (grad * heads).sum(-1).sum(-2)


@measures_heads("LRP (head_relevance)", instead=MASK_INSTEAD)
def head_relevance(
    model: nn.Module,
    batch: Batch,
    *,
    blocks: list[AttentionBlock] | None = None,
    strategy: str = "vmap",
    chunk_size: int | None = None,
) -> TargetRelevance:
    """Raw LRP relevance of every head for every generation step of ``batch``."""
    if strategy not in STRATEGIES:
        raise HeadlabError(f"unknown LRP strategy {strategy!r}; expected one of {', '.join(STRATEGIES)}")
    if output_layer(model) is None:
        raise HeadlabError("LRP needs a language-model head (its top-1 logit is the target); this model has none")
    blocks = [b for b in (attention_blocks(model) if blocks is None else blocks) if b.n_heads > 0]
    recorded: dict[tuple[str, int], list[torch.Tensor]] = {}

    def record(block: AttentionBlock, heads: torch.Tensor) -> torch.Tensor:
        # [batch, pos, n_heads, d_head]; every run of an output projection that runs more than once per call
        # (Family.output_calls: PEGASUS-X's encoder, its global tokens' heads and its tokens'), a head's relevance the sum
        runs = recorded.get(block.key, []) if block.family.output_calls > 1 else []
        recorded[block.key] = [*runs, heads]
        return heads

    seen_tokens = _Tokens.of(batch.inputs)
    log = _ProbeLog({}, {})  # probes of biases on rows that are not tokens (_refuse_unplaced), probes' modules
    logit_layer = _embedding_head(model) or output_layer(model)  # its bias is added to the target itself
    with _widened(model, lrp_precision(model)), eval_mode(model), torch.enable_grad(), eager_attention(model), \
            _finite_masks(model), lrp_rules(model), _bias_probes(model, seen_tokens, logit_layer, log) as probes, \
            _embeddings(model, _token_probe(probes, seen_tokens)) as embedded, \
            _per_layer_embeddings(model) as per_layer, _lm_input(model) as seen, head_output_hooks(blocks, record):
        with _KeptWide(_computed_in(model)):  # the forward only: the backward passes below are torch's own
            out = model(**batch.inputs, use_cache=False) if "decoder_input_ids" in batch.inputs \
                else model(**batch.inputs)
        y, top = _targets(model, out.logits, seen["z"], batch.inputs.get("input_ids"))
        # Where relevance ends: the input embeddings ([batch, pos, d] each), and the biases (probes).
        if not embedded or not all(e.requires_grad for e in embedded):
            raise HeadlabError("LRP: found no input embeddings on the path to the logits (the input of each "
                               "stack's first layer), so conservation cannot be measured")
        if per_layer_input_layers(model) and (not per_layer or not all(e.requires_grad for e in per_layer)):
            raise HeadlabError("LRP: found no per-layer token embeddings (embed_tokens_per_layer) on the path to the "
                               "logits, though the model's layers take per-layer inputs, so conservation cannot be "
                               "measured")
        steps = batch.steps.to(y.device)
        _refuse_unplaced(log.unplaced, y, steps, seen_tokens)
        _check_rows(probes, log.paths, y, steps, seen_tokens.batch_size)
        # A bias before the embeddings' cut (BERT's and BART's embedding norms) is inside them already.
        before = torch.autograd.grad([e.sum() for e in embedded], probes, retain_graph=True, allow_unused=True) \
            if probes else []
        # the per-layer token embeddings are input embeddings too: counted with them (_reached)
        ends = embedded + per_layer + [s for s, g in zip(probes, before) if g is None]
        n_emb = (len(embedded), len(per_layer))
        index = steps.nonzero()  # [n, 2] (row, position), row-major order
        keys = [b.key for b in blocks for _ in recorded[b.key]]  # a key per recorded run (Family.output_calls)
        tensors = [t for b in blocks for t in recorded[b.key]]
        heads = [t.detach() for t in tensors]
        values = [t.detach() for t in ends]
        rank, n_slots = _slots(steps)
        if strategy == "jacobian":  # one backward per output element: full Jacobian rows
            rows: dict = {k: [] for k in keys}
            reached = []
            for r, p in index.tolist():
                grads = torch.autograd.grad(y[r, p], tensors + ends, retain_graph=True, allow_unused=True)
                step: dict = {}
                for key, g, h in zip(keys, grads, heads):
                    jac = torch.zeros_like(h) if g is None else g  # d y[r, p] / d heads, whole batch
                    step[key] = step.get(key, 0) + (jac * h).sum(dim=(0, 1, 3))  # [H], over the block's runs
                for key, row in step.items():
                    rows[key].append(row)
                at_ends = [g[None] if g is not None else None for g in grads[len(keys):]]
                reached.append(_reached(at_ends, values, n_emb, y, 1)[0, r])
            relevance = {
                key: torch.stack(rows[key]) if rows[key] else h.new_zeros(0, h.shape[2])
                for key, h in zip(keys, heads)
            }
            shares = torch.stack(reached) if reached else y.new_zeros(0, 3)
        else:
            per_slot: dict = {k: [] for k in keys}  # pieces of [n_slots, batch, H]
            at_ends = []  # pieces of [n_slots, batch, 2]
            if strategy == "vmap":
                size = chunk_size or _auto_chunk(y, tensors, n_slots)
                for start in range(0, n_slots, size):
                    stop = min(start + size, n_slots)
                    grads = torch.autograd.grad(
                        y, tensors + ends, grad_outputs=_slot_selectors(steps, rank, start, stop, y),
                        retain_graph=True, allow_unused=True, is_grads_batched=True,
                    )
                    _append_summed(per_slot, keys, [_contract(grad, h, stop - start) for grad, h in zip(grads, heads)])
                    at_ends.append(_reached(grads[len(keys):], values, n_emb, y, stop - start))
            else:  # "loop": one backward per slot, all rows at once
                for slot in range(n_slots):
                    selector = _slot_selectors(steps, rank, slot, slot + 1, y)[0]
                    grads = torch.autograd.grad(y, tensors + ends, grad_outputs=selector, retain_graph=True,
                                                allow_unused=True)
                    _append_summed(per_slot, keys, [_contract(grad, h)[None] for grad, h in zip(grads, heads)])
                    at_ends.append(_reached([None if g is None else g[None] for g in grads[len(keys):]],
                                            values, n_emb, y, 1))
            picks = rank[index[:, 0], index[:, 1]]
            relevance = {
                key: torch.cat(per_slot[key])[picks, index[:, 0]] if n_slots
                else h.new_zeros(0, h.shape[2])
                for key, h in zip(keys, heads)
            }
            shares = torch.cat(at_ends)[picks, index[:, 0]] if n_slots else y.new_zeros(0, 3)
        logits = y.detach()[index[:, 0], index[:, 1]] if len(index) else y.new_zeros(0)
        tokens = top[index[:, 0], index[:, 1]] if len(index) else top.new_zeros(0)
        lm_bias = _logit_bias(model)
        kept = shares[:, 1].detach()
        if lm_bias is not None:  # the output layer's bias is part of the target itself
            kept = kept + lm_bias.detach().to(kept.dtype)[tokens]
    return TargetRelevance(index, logits, tokens, relevance, shares[:, 0].detach(), kept, shares[:, 2].detach())


def _reached(grads, ends: list[torch.Tensor], n_emb: tuple[int, int], y: torch.Tensor, n: int) -> torch.Tensor:
    """``[n, batch, 3]``: gradient x input summed over all but the batch dimension, over the
    input embeddings, the first ``sum(n_emb)`` of ``ends`` (the encoder's and the decoder's, then
    ``n_emb[1]`` per-layer token embeddings), over the rest (the bias probes), and over the
    per-layer token embeddings alone (a part of the first)."""
    total = y.new_zeros(n, y.shape[0], 3)
    main, per_layer = n_emb
    for i, (grad, x) in enumerate(zip(grads, ends)):
        if grad is not None:
            summed = (grad * x).reshape(n, y.shape[0], -1).sum(-1)
            total[..., int(i >= main + per_layer)] += summed
            if main <= i < main + per_layer:
                total[..., 2] += summed
    return total


_BUDGET = 1 << 25  # numbers in the widest batched gradient of one vmapped backward
_ONE_THREAD_BUDGET = 1 << 22  # on a CPU with one torch thread (16 MB of float32)


def _auto_chunk(y: torch.Tensor, tensors: list[torch.Tensor], n_slots: int | None = None) -> int:
    """Steps per batched backward: the widest batched gradient (an FFN activation, ~4x the
    widest head tensor, times the number of steps) is kept near 2^22 numbers on a CPU running
    one torch thread, and near 2^25 otherwise.

    Every step costs one backward's arithmetic whatever the strategy, so batching steps only
    saves per-call costs. On one CPU thread there are few, and gradients many steps wide cost
    more than they save: each is a fresh allocation above glibc's mmap threshold, page-faulted
    on every call, that falls out of the caches (one 20-step call at batch 32 took 1.07-1.3x
    the CPU time of calls of 1 to 6 steps). With several threads every operation of a call
    also synchronises them, which is costly when the cores are shared, and there one call for
    all steps was 1.6x faster than two calls (docs/benchmarks.md, head importance).
    """
    widest = max((t.numel() for t in tensors), default=1) * 4  # FFN activations are ~4x wider
    one_thread = y.device.type == "cpu" and torch.get_num_threads() == 1
    budget = _ONE_THREAD_BUDGET if one_thread else _BUDGET
    n_slots = y.shape[1] if n_slots is None else n_slots
    return int(max(1, min(n_slots, budget // max(1, widest))))


@measures_heads("LRP", instead=MASK_INSTEAD)
def compute_lrp(
    model: nn.Module,
    data: ImportanceData,
    info: ModelInfo | None = None,
    *,
    batch_size: int = 32,
    strategy: str = "vmap",
    chunk_size: int | None = None,
    kinds: tuple[str, ...] | None = None,
    progress: bool = False,
    targets: int | None = None,
    seed: int = 0,
    bootstrap: int = 200,
) -> HeadScores:
    """LRP head relevance over ``data`` (Voita et al. 2019, Sec. 4), one HeadScores table.

    For a translation model ``data`` must hold the model's translations
    (:func:`~headlab.data.inputs.translate_data`): the targets are their top-1 logits.
    ``targets``: explain a seeded sample of that many steps per sentence (``seed``), all of
    them when None or 0. ``bootstrap``: resamples of the sentences for the standard error of
    every score, written to the signature's ``bootstrap`` (0: none).
    """
    info = info or describe_model(model)
    if not info.has_lm_head:
        raise HeadlabError("LRP needs a language-model head (the target is its top-1 logit); this model has none")
    if info.is_seq2seq and data.translations is None:
        raise HeadlabError("LRP scores the model's own translation: run translate_data first")
    if targets is not None and targets < 0:
        raise HeadlabError(f"LRP targets per sentence must be at least 0 (0: all), got {targets}")
    check_rules(model)  # a normalisation without a rule is refused before any work
    blocks = [b for b in attention_blocks(model) if b.n_heads > 0 and not b.idle and (kinds is None or b.kind in kinds)]
    keys = [b.key for b in blocks]
    shard = active()  # several processes: each its own batches, combined below
    # Per batch and block: the normalised and the raw relevance summed over the steps, added in
    # batch order (a Ledger: the one-process sums to the bit).
    ledger = Ledger(shard, {b.key: (torch.zeros(b.n_heads, dtype=torch.float64),) * 2 for b in blocks})
    per_sentence = {b.key: torch.zeros(len(data), b.n_heads, dtype=torch.float64) for b in blocks}  # bootstrap
    counts = torch.zeros(len(data), dtype=torch.float64)
    # Per sentence: relevance that reached the input embeddings, that the biases kept, and the logits.
    reached, kept, explained, per_layer = (torch.zeros(len(data), dtype=torch.float64) for _ in range(4))
    n_steps = n_available = 0
    batches: Iterable = shard.numbered(make_batches(data, info, batch_size=batch_size, side="translation",
                                          device=next(model.parameters()).device))
    batches = with_progress(batches, progress, "lrp", total=shard.count(count_batches(data, batch_size)), unit="batch")
    precision = {p.dtype for p in model.parameters() if p.is_floating_point()}
    with _widened(model, lrp_precision(model)):
        for number, batch in batches:
            n_available += batch.n_steps
            batch = replace(batch, steps=sample_targets(batch.steps, batch.index, targets, seed))
            result = head_relevance(model, batch, blocks=blocks, strategy=strategy, chunk_size=chunk_size)
            n_steps += len(result.steps)
            sentences = torch.as_tensor(batch.index, dtype=torch.long)[result.steps[:, 0].cpu()]
            counts.index_add_(0, sentences, torch.ones(len(sentences), dtype=torch.float64))
            reached.index_add_(0, sentences, result.embedding.double().cpu())
            kept.index_add_(0, sentences, result.biases.double().cpu())
            explained.index_add_(0, sentences, result.logits.double().cpu())
            if result.per_layer_embedding is not None:
                per_layer.index_add_(0, sentences, result.per_layer_embedding.double().cpu())
            part = {}
            for key, values in result.relevance.items():
                normalised = normalize_per_layer(values.double()).cpu()
                part[key] = (normalised.sum(0), values.double().sum(0).cpu())
                per_sentence[key].index_add_(0, sentences, normalised)
            ledger.add(number, part)
    totals = ledger.total()
    sums = {key: total for key, (total, _) in totals.items()}
    raw = {key: total for key, (_, total) in totals.items()}
    # A sentence's row is filled by one process, zeros elsewhere, and its step count is an integer:
    # added over the processes, the bootstrap sees the one-process rows to the bit.
    per_sentence, counts, n_steps, n_available, reached, kept, explained, per_layer = shard.sum(
        (per_sentence, counts, n_steps, n_available, reached, kept, explained, per_layer))
    if n_steps == 0:
        why = ("are all translations empty?" if info.is_seq2seq else
               f"no sentence keeps a token to explain once cut to {info.max_length} tokens: --max-length?")
        raise HeadlabError(f"LRP found no token to explain in the data ({why})")
    conservation = conservation_record(reached, kept, explained, counts,
                                       per_layer if per_layer_input_layers(model) else None)
    signature = {
        **data.signature(),
        "n_steps": n_steps,
        "target": "logit of the predicted class" if info.arch == "classifier"
        else "top-1 logit of the model's own output, teacher-forced",
        "targets_per_sentence": targets or "all",
        "normalisation": "per target, over the heads of a layer (sum of |relevance|)",
        "rules": "Ding et al. 2017 weight ratios (Voita et al. 2019, App. A); attention weights constant",
        "strategy": strategy,
        "mean_raw_relevance": {f"{k[0]}:{k[1]}": (v / n_steps).tolist() for k, v in raw.items()},
        "conservation": conservation,
    }
    computed = lrp_precision(model)
    signature["precision"] = str(computed).removeprefix("torch.") + (
        " (gated MLPs: Ding's product rule divides by a + b, which crosses zero)" if computed == torch.float64 else "")
    narrower = sorted(str(d).removeprefix("torch.") for d in precision if torch.finfo(d).bits < torch.finfo(computed).bits)
    if narrower:
        signature["precision"] += f"; the model's {', '.join(narrower)} weights widened for LRP"
    if targets:
        signature["target_sample"] = {"seed": seed, "n_available_steps": n_available}
    if bootstrap:
        stacked = torch.cat([per_sentence[key] for key in keys], dim=1).numpy()
        flat = bootstrap_stderr(stacked, counts.numpy(), bootstrap, seed)
        splits = np.split(flat, np.cumsum([per_sentence[key].shape[1] for key in keys])[:-1])
        errors = block_scores(attention_blocks(model), dict(zip(keys, splits)))
        signature["bootstrap"] = {
            "resamples": bootstrap, "seed": seed, "unit": "sentence",
            "stderr": {kind: [[None if np.isnan(v) else float(v) for v in row] for row in array.tolist()]
                       for kind, array in errors.items() if kinds is None or kind in kinds},
        }
    check_conservation(conservation)  # after the sums: every process decides alike
    scores = block_scores(attention_blocks(model), {k: (v / n_steps).numpy() for k, v in sums.items()}, kinds)
    return HeadScores(scores, "lrp", info.name, signature)


CONSERVATION_TOLERANCE = 1e-3
"""Largest ``|ratio - 1|`` of a sentence's conservation ratio (embeddings plus biases over the
logits). Measured (docs/importance.md): within 2e-6 on the bundled Multi30k EN-DE (float32) and
English LM (float64) models, 200 sentences each, and on tiny random models of 20 families with
random biases and norm weights; 0.91 on OLMo before its norm had a rule."""


def _ratio_stats(ratio: np.ndarray) -> dict:
    finite = ratio[np.isfinite(ratio)]
    if not len(finite):
        return {"mean": None, "min": None, "max": None}
    return {"mean": float(finite.mean()), "min": float(finite.min()), "max": float(finite.max())}


def conservation_record(reached: torch.Tensor, kept: torch.Tensor, explained: torch.Tensor,
                        counts: torch.Tensor, per_layer: torch.Tensor | None = None) -> dict:
    """The signature's ``conservation``, per sentence (sums over the sentence's targets):
    ``embeddings``, the relevance reaching the input embeddings over the explained logits, and
    ``with_biases``, that plus the relevance the biases kept, which the rules make one; the
    sentences whose ``with_biases`` lies outside the tolerance are listed (the first ten).
    ``per_layer`` (a model with per-layer inputs: Gemma 3n, Gemma 4): the part of ``reached`` at the per-layer
    token embeddings, recorded as ``per_layer_embeddings`` over the logits."""
    scored = counts > 0
    numbers = scored.nonzero().flatten().numpy()
    logits = explained[scored]
    embeddings = (reached[scored] / logits).numpy()
    total = ((reached[scored] + kept[scored]) / logits).numpy()
    bad = ~(np.abs(total - 1) <= CONSERVATION_TOLERANCE)  # NaN is bad too
    extra = {} if per_layer is None else {
        "per_layer_embeddings": _ratio_stats((per_layer[scored] / logits).numpy()),
        "per_layer_definition": "the part of embeddings that reached the per-layer token embeddings "
                                "(embed_tokens_per_layer), an input of their own beside the input embeddings"}
    return {
        "definition": "per sentence, summed over its targets: relevance reaching the input embeddings "
                      "(embeddings), and that plus the relevance kept by biases (with_biases), over the explained "
                      "logits; the rules make with_biases 1",
        "tolerance": CONSERVATION_TOLERANCE,
        "n_sentences": int(len(total)),
        "embeddings": _ratio_stats(embeddings),
        "with_biases": _ratio_stats(total),
        "n_outside": int(bad.sum()),
        "outside": [{"sentence": int(n), "ratio": float(r) if np.isfinite(r) else None}
                    for n, r in zip(numbers[bad], total[bad])][:10],
        **extra,
    }


def check_conservation(record: dict) -> None:
    """:class:`RunFailed` when a sentence's conservation ratio lies outside the tolerance: a rule
    does not fit one of the model's modules (or the numbers lost it), and its scores would be
    silently wrong."""
    if not record["n_outside"]:
        return
    worst = ", ".join(f"sentence {o['sentence']}: {o['ratio']:.6g}" if o["ratio"] is not None
                      else f"sentence {o['sentence']}: not finite" for o in record["outside"][:3])
    raise RunFailed(
        f"LRP did not conserve relevance on this model: in {record['n_outside']} of {record['n_sentences']} "
        f"sentences the relevance reaching the input embeddings plus the biases' shares is not the explained logit "
        f"within {record['tolerance']:g} ({worst}; relevance at the embeddings alone: mean "
        f"{record['embeddings']['mean']:.4g} of the logit). A rule does not fit one of its modules; no LRP scores "
        "are written"
    )


def _per_layer_note(record: Mapping[str, Any]) -> str:
    """The share of the per-layer token embeddings (Gemma 3n, Gemma 4) in the caption, '' without them."""
    share = record.get("per_layer_embeddings")
    if not isinstance(share, Mapping) or share.get("min") is None:
        return ""
    return f" (of it at the per-layer token embeddings {share['min']:.3f} to {share['max']:.3f})"


class LRP(ImportanceMeasure):
    """:func:`compute_lrp` as a registered measure."""

    name = "lrp"
    tables = {"lrp": ("LRP relevance", "layer-wise relevance of each head, normalised over the heads of a layer "
                                       "(Voita et al. 2019, Sec. 4.2)")}
    needs_lm_head = True
    reads_translation = True
    Options = LRPOptions

    @classmethod
    def caption_note(cls, signature: Mapping[str, Any]) -> str:
        """The conservation of :func:`conservation_record`, per sentence, for the report's caption."""
        record: Any = signature.get("conservation")
        try:
            embeddings, total = record["embeddings"], record["with_biases"]
            return (f"; conservation over {counted(record['n_sentences'], 'sentence')}: relevance reaching the input embeddings "
                    f"{embeddings['min']:.3f} to {embeddings['max']:.3f} of the explained logit (mean "
                    f"{embeddings['mean']:.3f}){_per_layer_note(record)}, with the biases' shares {total['min']:.6f} "
                    f"to {total['max']:.6f} (tolerance 1 ± {record['tolerance']:g})")
        except (KeyError, TypeError, ValueError):
            return ""

    def unsupported(self, model: nn.Module) -> str | None:
        """A module without an LRP rule (a normalisation headlab does not know), found before any work."""
        try:
            check_rules(model)
        except HeadlabError as error:
            return str(error)
        return None

    def score(self, model, data, info, *, batch_size=32, kinds=None, progress=False, tokenizer=None) -> HeadScores:
        o = self.options
        return compute_lrp(model, data, info, batch_size=batch_size, strategy=o.strategy, kinds=kinds,
                           progress=progress, targets=o.targets, seed=o.seed, bootstrap=o.bootstrap)
