"""Physical pruning checks itself: the pruned model must compute what the masked one computes.

Removing heads physically is exact when the pruned model equals the unpruned model with the same
heads masked (:func:`headlab.gates.mask_heads`: their outputs times 0 before W^O). Whether a
family's attention survives the slicing (partial rotary, query/key norms, grouped key/value
heads, cached generation, padding) cannot be known from a table for every model a user brings,
so :func:`headlab.surgery.prune_heads` measures it: it runs :func:`run_probe` on the masked model,
prunes, runs it again and hands both traces to :func:`first_mismatch`.

The probe is small: 3 rows of 6 tokens (one full, one padded on the right, one on the left),
then, for a model that generates, 3 steps of cached decoding with fixed tokens (teacher forced,
so that both models see the same tokens) whose scores are compared; an encoder-decoder gets the
padded rows on its encoder and a 3-token decoder prefix, and both stacks are compared. Compared
are the output of every attention block (in forward order, so the first one that differs is
named) and the model's output (logits, or the last hidden state), at the positions that are not
padding (a padded query's output is not defined).

Tolerance: two tensors agree when max |pruned - masked| <= sqrt(eps) * max |masked| with eps the
machine epsilon of the model's dtype (float32: 3.5e-4 of the tensor's largest value; bfloat16:
8.8e-2; float16: 3.1e-2). Slicing only reorders floating-point sums, which moves results by a few
eps; a wrong slice moves them by the size of a head's contribution. A float64 model whose attention
takes part of its computation in float32 whatever the dtype (Granite-SWA's sink scale) is held to float32's
tolerance by the caller (:mod:`headlab.surgery` picks the dtype).

Where the masked reference itself is NaN or inf (a float64 model in transformers' eager attention
on the left-padded row: float64's lowest mask value is -inf in its float32 softmax), nothing can
be compared there, and NaN in both is no evidence that they agree: :func:`first_mismatch` reports
those items (``not_finite`` where the pruned model differs, ``uncompared`` where it is NaN or inf
too) only when every finite value agrees, and :func:`own_nan_cause` says why the unmodified model
gives them. :func:`headlab.surgery.prune_heads` then runs both models again with the mask floored
at float32's lowest value (:func:`run_floored`), which makes such a model finite and leaves every
other value unchanged to the bit, and compares every value there; where the floor leaves NaN too,
the pruning is refused, naming what could not be compared.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn

from headlab.adapters import attention_blocks, config_value
from headlab.adapters.big_bird import block_sparse_probe
from headlab.errors import HeadlabError

__all__ = ["Trace", "Mismatch", "probe_inputs", "first_probe", "run_probe", "run_floored", "first_mismatch", "tolerance",
           "not_finite"]

ROWS, LENGTH, PADS, DECODER_LENGTH, STEPS = 3, 6, 2, 3, 3


def tolerance(dtype: torch.dtype) -> float:
    """sqrt(eps) of ``dtype``, relative to the largest value of the reference tensor."""
    return math.sqrt(torch.finfo(dtype).eps) if dtype.is_floating_point else 0.0


@dataclass
class Trace:
    """What one probe run computed: ``(call, what, tensor)`` in the order computed, ``what`` an
    attention block's ``(kind, layer)`` or the name of a model output; tensors hold the positions
    that are not padding only. ``error`` is set when the run raised, ``where`` then names the
    block that was running."""

    entries: list[tuple[str, object, torch.Tensor]] = field(default_factory=list)
    error: BaseException | None = None
    where: object = None
    ran: set = field(default_factory=set)
    """The blocks ``(kind, layer)`` whose module's forward started: one that never ran is compared nowhere."""
    places: list = field(default_factory=list)
    """Beside each entry: the ``(row, position)`` of each of its first-axis items ([n, 2]), or None where
    that axis is the probe's rows (a generation step's logits)."""

    def add(self, call: str, what: object, tensor: torch.Tensor, mask: torch.Tensor | None) -> None:
        value = _valid(tensor, mask)
        kept = mask is not None and tensor.dim() >= 2 and tuple(tensor.shape[:2]) == tuple(mask.shape)
        self.entries.append((call, what, value))
        self.places.append(mask.nonzero().cpu() if kept and mask is not None else None)


@dataclass(frozen=True)
class Mismatch:
    call: str
    what: object
    difference: float
    allowed: float
    error: str | None = None
    not_finite: str | None = None
    """Set where the only difference is at items the reference itself has NaN or inf: which ones."""
    uncompared: str | None = None
    """Set where every finite value agrees and the reference and the pruned model are both NaN or inf at some
    items (``not_finite`` unset): which ones, compared nowhere."""
    floored: bool = False
    """A difference: found with the float64 attention mask floored at float32's lowest value (:func:`run_floored`);
    ``not_finite``: with the mask floored every value agrees."""

    @property
    def unchecked(self) -> bool:
        """Only items the reference has NaN or inf differ or went uncompared: nothing finite differs."""
        return self.not_finite is not None or self.uncompared is not None

    def describe(self, model_type: str) -> str:
        where = _name(self.what)
        if self.not_finite is not None:
            return (f"{model_type}: cannot check pruning: the masked model, the reference, gives NaN or inf in {where} "
                    f"({self.call}) at {self.not_finite}, and the pruned model does not; every finite value agrees")
        if self.uncompared is not None:
            return (f"{model_type}: cannot check pruning: the masked model, the reference, and the pruned model both "
                    f"give NaN or inf in {where} ({self.call}) at {self.uncompared}, so those values were compared "
                    "nowhere; every finite value agrees")
        if self.error is not None:
            return f"{model_type}: the pruned model fails in {where} ({self.call}): {self.error}"
        floored = (" with the float64 attention mask floored at float32's lowest value, where both are finite (the "
                   "model's own NaN on padded rows hides it otherwise)") if self.floored else ""
        return (f"{model_type}: the pruned model differs from the masked one in {where} ({self.call}){floored}: "
                f"max difference {self.difference:.3g}, allowed {self.allowed:.3g}")


def _name(what: object) -> str:
    return f"{what[0]} layer {what[1]}" if isinstance(what, tuple) else str(what)


def _embeddings(model: nn.Module) -> nn.Module | None:
    get = getattr(model, "get_input_embeddings", None)
    try:
        return get() if callable(get) else None
    except NotImplementedError:  # transformers' default finds no table (PPFormulaNetModel): the config's vocab_size
        return None


def _device(model: nn.Module) -> torch.device:
    embeddings = _embeddings(model)
    weight = getattr(embeddings, "weight", None)
    return weight.device if weight is not None else next(model.parameters()).device


def probe_inputs(model: nn.Module, padded: bool = True) -> dict:
    """Token ids (fixed seed, drawn above the usual special-token ids), the attention mask of the
    padded rows, the decoder prefix and the generation steps' tokens. ``padded=False``: one row
    without padding, for a model that cannot take a padded batch (a classifier with no padding
    token)."""
    config = model.config
    embeddings = _embeddings(model)
    vocab = int(getattr(embeddings, "num_embeddings", 0) or config_value(config, "vocab_size") or 0)
    low = 3 if vocab > 6 else 0
    g = torch.Generator().manual_seed(0)
    device = _device(model)

    def ids(*shape):
        return torch.randint(low, vocab, shape, generator=g).to(device)

    rows = ROWS if padded else 1
    # block-sparse BigBird refuses short rows and padding that changes a row's blocks (headlab.adapters.big_bird)
    length, pads, left = block_sparse_probe(model) or (LENGTH, PADS, PADS)
    mask = torch.ones(rows, length, dtype=torch.long)
    if padded:
        mask[1, length - pads:] = 0  # padded on the right
        mask[2, :left] = 0  # padded on the left
    input_ids = ids(rows, length)
    pad = config_value(config, "pad_token_id")  # a wrapper's is its text config's
    if isinstance(pad, int) and 0 <= pad < vocab:
        input_ids = input_ids.masked_fill(mask.to(device) == 0, pad)
    if getattr(config, "is_encoder_decoder", False):
        # the decoder's own vocabulary: FSMT's (wmt19 ru-en, en-ru) differs from the source's
        vocab = _decoder_vocab(model, vocab)
        probe = {"input_ids": input_ids, "attention_mask": mask.to(device), "steps": ids(STEPS, rows, 1)}
        probe["decoder_input_ids"] = ids(rows, DECODER_LENGTH)
        return probe
    return {"input_ids": input_ids, "attention_mask": mask.to(device), "steps": ids(STEPS, rows, 1)}


def first_probe(model: nn.Module) -> tuple[dict, Trace]:
    """The probe ``model`` runs, and its trace: the padded probe; where the model fails on it, the same with the
    position ids ``generate()`` would give (:func:`generation_positions`), then one unpadded row (a classifier with no
    padding token). The trace's ``error`` is the last failure, where all three fail."""
    probe = probe_inputs(model)
    trace = run_probe(model, probe)
    if trace.error is not None:
        probe = {**probe, "positions": True}
        trace = run_probe(model, probe)
    if trace.error is not None:
        probe = probe_inputs(model, padded=False)
        trace = run_probe(model, probe)
    return probe, trace


def generation_positions(model: nn.Module, probe: dict) -> torch.Tensor | None:
    """The position ids ``generate()`` gives the probe's first forward (transformers 5.24's
    ``_prepare_position_ids_for_generation``, which a model may override: the Qwen-Omni thinkers' M-RoPE positions),
    for a probe marked ``positions`` (:func:`first_probe` marks it where the model fails the plain probe: the thinkers
    compute their own decoding positions from the whole attention mask, one per cached token); None for a model that
    takes none."""
    prepare = getattr(model, "_prepare_position_ids_for_generation", None)
    if prepare is None or getattr(model.config, "is_encoder_decoder", False):
        return None
    return prepare(probe["input_ids"], {"input_ids": probe["input_ids"], "attention_mask": probe["attention_mask"]})


def _decoder_vocab(model: nn.Module, vocab: int) -> int:
    """The size of an encoder-decoder's target vocabulary (its decoder's token embeddings), ``vocab`` where none is
    found."""
    get_decoder = getattr(model, "get_decoder", None)
    decoder = get_decoder() if callable(get_decoder) else None
    size = getattr(getattr(decoder, "embed_tokens", None), "num_embeddings", None)
    return size if isinstance(size, int) and size > 0 else vocab


def _generates(model: nn.Module) -> bool:
    can = getattr(model, "can_generate", None)
    return bool(can()) if callable(can) else False


@contextmanager
def _eval(model: nn.Module) -> Iterator[None]:
    modes = {module: module.training for module in model.modules()}
    model.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        for module, mode in modes.items():
            module.train(mode)


def _traced(block) -> nn.Module:
    """The module whose output stands for ``block``'s: the block; for a channels-first family (SqueezeBERT), its output
    projection's parent, ``post_attention`` (ConvDropoutLayerNorm, [batch, channels, seq]): SqueezeBertEncoder calls
    each layer's ``forward`` itself, so no hook on the layer runs."""
    if block.family.channels_first and "." in block.family.o:
        return block.module.get_submodule(block.family.o.rpartition(".")[0])
    return block.module


def _first(output) -> torch.Tensor | None:
    value = output[0] if isinstance(output, (tuple, list)) else output
    return value if isinstance(value, torch.Tensor) else None


def _valid(tensor: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """The positions that are not padding (``tensor`` [batch, pos, ...], ``mask`` [batch, pos])."""
    tensor = tensor.detach()
    if mask is None or tensor.dim() < 2 or tuple(tensor.shape[:2]) != tuple(mask.shape):
        return tensor.clone()
    return tensor[mask.to(tensor.device).bool()].clone()


def run_probe(model: nn.Module, probe: dict) -> Trace:
    """Run the probe; never raises for an error inside the model (it is recorded in the trace)."""
    trace = Trace()
    seq2seq = bool(getattr(model.config, "is_encoder_decoder", False))
    masks: dict[str, torch.Tensor | None] = {}
    state: dict = {"call": "forward"}
    handles = []

    def pre_hook(key):
        def hook(module, args, kwargs):
            trace.where = key
            trace.ran.add(key)

        return hook

    def post_hook(key, channels_first: bool = False):
        def hook(module, args, kwargs, output):
            value = _first(output)
            if channels_first and value is not None and value.dim() == 3:  # [batch, channels, seq]: read per position
                value = value.transpose(1, 2)
            if value is not None:
                stack = "decoder" if seq2seq and key[0] != "enc_self" else "main"
                trace.add(state["call"], key, value, masks.get(stack))

        return hook

    with _eval(model):
        for block in attention_blocks(model):
            traced = _traced(block)
            handles.append(traced.register_forward_pre_hook(pre_hook(block.key), with_kwargs=True))
            handles.append(traced.register_forward_hook(post_hook(block.key, block.family.channels_first),
                                                        with_kwargs=True))
        try:
            _calls(model, probe, seq2seq, masks, state, trace)
        except Exception as error:  # the pruned model may fail anywhere: that is what is measured
            trace.error = error
        finally:
            for handle in handles:
                handle.remove()
    return trace


def _record_output(trace: Trace, call: str, output, mask, encoder_mask, encoder_outputs=None) -> None:
    logits = getattr(output, "logits", None)
    main = logits if logits is not None else getattr(output, "last_hidden_state", None)
    if main is None:
        main = _first(output)
    if main is not None:
        trace.add(call, "logits" if logits is not None else "output", main, mask)
    encoder = getattr(encoder_outputs if encoder_outputs is not None else output, "encoder_last_hidden_state"
                      if encoder_outputs is None else "last_hidden_state", None)
    if encoder_mask is not None and encoder is not None:
        trace.add(call, "encoder output", encoder, encoder_mask)


def _calls(model: nn.Module, probe: dict, seq2seq: bool, masks: dict, state: dict, trace: Trace) -> None:
    generates = _generates(model)
    mask = probe["attention_mask"]
    kwargs = {"input_ids": probe["input_ids"], "attention_mask": mask}
    encoder_outputs = None
    if seq2seq:
        kwargs["decoder_input_ids"] = probe["decoder_input_ids"]
        masks.update(main=mask, decoder=torch.ones_like(probe["decoder_input_ids"]))
        get_encoder = getattr(model, "get_encoder", None)
        encoder = get_encoder() if generates and callable(get_encoder) else None
        if encoder is not None:
            # As generate() runs an encoder-decoder: the encoder on its own, without use_cache (Switch
            # Transformers' forward hands use_cache to its encoder stack, which raises), and its output
            # object, not a tuple, to the decoder (NLLB-MoE reads encoder_outputs.last_hidden_state)
            encoder_outputs = encoder(input_ids=kwargs.pop("input_ids"), attention_mask=mask, return_dict=True)
            kwargs["encoder_outputs"] = encoder_outputs
    else:
        masks.update(main=mask)
    if generates:
        kwargs["use_cache"] = True
    positions = generation_positions(model, probe) if probe.get("positions") else None
    if positions is not None:  # as generate() gives them (the Qwen-Omni thinkers' own decoding positions fail)
        kwargs["position_ids"] = positions
    output = model(**kwargs)
    # transformers 5.24 renamed the cache argument ``past_key_values`` to ``cache``
    cache_name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    _record_output(trace, "forward", output, masks["decoder" if seq2seq else "main"], mask if seq2seq else None,
                   encoder_outputs)
    cache = _cache_of(output) if generates else None
    if cache is None:
        return
    if seq2seq and encoder_outputs is None:
        from transformers.modeling_outputs import BaseModelOutput

        encoder_outputs = BaseModelOutput(last_hidden_state=output.encoder_last_hidden_state)
    for step, tokens in enumerate(probe["steps"], 1):
        state["call"] = f"generation step {step}"
        ones = torch.ones_like(tokens)
        if seq2seq:
            masks.update(decoder=ones)
            step_kwargs = {"encoder_outputs": encoder_outputs, "attention_mask": mask, "decoder_input_ids": tokens}
        else:
            mask = torch.cat([mask, ones], dim=1)
            masks.update(main=ones)
            step_kwargs = {"input_ids": tokens, "attention_mask": mask}
            if positions is not None:  # one past the last, as generate() moves them on
                positions = positions[..., -1:] + 1
                step_kwargs["position_ids"] = positions
        output = model(**step_kwargs, **{cache_name: cache}, use_cache=True)
        cache = _cache_of(output)
        logits = getattr(output, "logits", None)
        if logits is not None:
            trace.add(state["call"], "logits", logits[:, -1], None)


def run_floored(model: nn.Module, probe: dict) -> Trace:
    """:func:`run_probe` with additive float64 attention masks floored at float32's lowest value
    (:func:`headlab.capture.float32_mask_floor`): a float64 eager model's padding queries that may
    attend to no key stay finite, every other value is unchanged to the bit. Enter it anew for each
    run: its hooks sit on the modules there when it starts (pruning replaces some)."""
    from headlab.capture import float32_mask_floor

    with float32_mask_floor(model):
        return run_probe(model, probe)


def _cache_of(output):
    # transformers 5.24's outputs hold ``cache``; their ``past_key_values`` is a deprecated alias of it that logs a
    # warning, read only for outputs that have no ``cache`` field (remote code's own output classes)
    if "cache" in getattr(output, "__dataclass_fields__", ()):
        return output.cache
    cache = getattr(output, "cache", None)
    return cache if cache is not None else getattr(output, "past_key_values", None)


def _difference(reference: torch.Tensor, pruned: torch.Tensor) -> tuple[float, float, torch.Tensor | None,
                                                                       torch.Tensor | None]:
    """(max |pruned - reference| over the items where the reference is finite, a NaN of ``pruned`` there
    counted as inf; max |reference|; the items where the reference is NaN or inf and ``pruned`` is not
    the same, or None; the items where both are the same NaN or inf, compared nowhere, or None)."""
    if reference.shape != pruned.shape:
        return math.inf, 0.0, None, None
    reference, pruned = reference.double(), pruned.double().to(reference.device)
    bad = ~reference.isfinite()
    diff = (pruned - reference).abs().masked_fill(bad, 0.0).nan_to_num(nan=math.inf)
    same = (pruned == reference) | (reference.isnan() & pruned.isnan())
    finite = reference[~bad]
    scale = float(finite.abs().max()) if finite.numel() else 0.0

    def items(where: torch.Tensor) -> torch.Tensor | None:
        first = where.reshape(where.shape[0], -1).any(-1) if where.dim() else where.reshape(1)
        return first if bool(first.any()) else None

    return (float(diff.max()) if diff.numel() else 0.0), scale, items(bad & ~same), items(bad & same)


def first_mismatch(reference: Trace, pruned: Trace, dtype: torch.dtype) -> Mismatch | None:
    """The first place (in forward order) where ``pruned`` leaves the tolerance around ``reference``.
    Where the reference itself is NaN or inf (a model that gives NaN on padded rows by itself) nothing
    can be compared: those items are returned (``not_finite`` set where ``pruned`` differs there, else
    ``uncompared`` where it is NaN or inf too) only if no finite value differs anywhere, so that a real
    difference is never hidden behind them; None means every value was compared and agrees."""
    if reference.error is not None:  # the masked model itself fails on the probe: nothing to compare
        raise reference.error
    if pruned.error is not None:
        error = f"{type(pruned.error).__name__}: {pruned.error}".splitlines()[0][:300]
        return Mismatch("forward", pruned.where or "model", math.inf, 0.0, error)
    ref = _numbered(reference.entries)
    places = dict(zip(ref, reference.places))
    got = _numbered(pruned.entries)
    rel = tolerance(dtype)
    unchecked: Mismatch | None = None
    uncompared: Mismatch | None = None
    for (call, what, n), value in ref.items():
        if (call, what, n) not in got:
            if isinstance(what, tuple):
                continue  # a block reduced to no head is not an attention block any more: its output is in the next
            return Mismatch(call, what, math.inf, 0.0, "the pruned model did not compute it")
        difference, scale, unmatched, both = _difference(value, got[(call, what, n)])
        allowed = rel * max(scale, torch.finfo(dtype).tiny)
        if not difference <= allowed:
            return Mismatch(call, what, difference, allowed)
        if unmatched is not None and unchecked is None:
            unchecked = Mismatch(call, what, math.inf, allowed, not_finite=probe_places(unmatched,
                                                                                        places[(call, what, n)]))
        if both is not None and uncompared is None:
            uncompared = Mismatch(call, what, math.nan, allowed, uncompared=probe_places(both, places[(call, what, n)]))
    extra = [key for key in got if key not in ref and not isinstance(key[1], tuple)]
    if extra:
        return Mismatch(extra[0][0], extra[0][1], math.inf, 0.0, "the masked model did not compute it")
    return unchecked or uncompared


def probe_places(items: torch.Tensor, places: torch.Tensor | None) -> str:
    """The probe rows and positions of the first-axis ``items`` (bool) of an entry: "probe row 2 (padded
    on the left), positions 2-5"."""
    from headlab.capture import spans

    index = items.nonzero().flatten().cpu()
    if places is None:
        rows: dict[int, list[int]] = {int(i): [] for i in index}
    else:
        rows = {}
        for row, position in places[index].tolist():
            rows.setdefault(row, []).append(position)
    sides = {1: " (padded on the right)", 2: " (padded on the left)"}
    return "; ".join(f"probe row {row}{sides.get(row, '')}" + (f", positions {spans(pos)}" if pos else "")
                     for row, pos in rows.items())


def _numbered(entries: list) -> dict:
    """``(call, what, n)`` -> value, in forward order: the n-th output recorded as ``what`` in ``call``
    (a shared module, ALBERT's, runs several times in one call: each run is compared with its own)."""
    out: dict = {}
    counts: dict = {}
    for call, what, value in entries:
        n = counts[(call, what)] = counts.get((call, what), -1) + 1
        out[(call, what, n)] = value
    return out


def not_finite(trace: Trace) -> str | None:
    """Where a probe run failed or produced NaN/inf at a position that is not padding (or None)."""
    if trace.error is not None:
        where = trace.where
        where = f"{where[0]} layer {where[1]}" if isinstance(where, tuple) else "the model"
        return f"fails in {where}: {type(trace.error).__name__}: {str(trace.error).splitlines()[0][:300]}"
    for (call, what, value), places in zip(trace.entries, trace.places):
        if value.is_floating_point() and not bool(value.isfinite().all()):
            bad = ~value.isfinite()
            items = bad.reshape(bad.shape[0], -1).any(-1) if bad.dim() else bad.reshape(1)
            return f"computes NaN or inf in {_name(what)} ({call}) at {probe_places(items, places)}"
    return None


def own_nan_cause(model: nn.Module, probe: dict) -> str | None:
    """Why ``model``, unmodified, gives NaN or inf on ``probe``, where that is known: its float64
    attention mask, whose lowest value transformers' eager attention takes to -inf in its float32
    softmax (a padding query that may attend to no key gets NaN, and the next layer's real rows read
    it). Confirmed by running the probe again with the mask floored at float32's lowest
    (:func:`headlab.capture.float32_mask_floor`); the remedies named are those that run finite."""
    from headlab.capture import _attention_implementation, float32_mask_floor

    with float32_mask_floor(model):
        floored = run_probe(model, probe)
    if not_finite(floored) is not None:
        return _self_filled_cause(model)
    remedies = ["load it in float32 (its mask stays finite there)"]
    if getattr(model.config, "_attn_implementation", None) == "eager":
        try:
            with _attention_implementation(model, "sdpa"):
                sdpa = run_probe(model, probe)
        except (ValueError, ImportError, RuntimeError, HeadlabError):  # no SDPA path, or one headlab refuses
            sdpa = None
        if sdpa is not None and not_finite(sdpa) is None:
            remedies.append('load it with attn_implementation="sdpa"')
    return ("its float64 attention mask holds float64's lowest value, which becomes -inf in the float32 softmax of "
            "transformers' eager attention, so a padding query that may attend to no key gets NaN and the next "
            "layer's real rows read it (with the mask floored at float32's lowest value the probe is finite); "
            + ", or ".join(remedies))


def _self_filled_cause(model: nn.Module) -> str | None:
    """:func:`own_nan_cause` for a float64 model of :data:`headlab.capture.SELF_FILLED_MASKS`, whose NaN the floor
    does not remove."""
    if next((p.dtype for p in model.parameters() if p.is_floating_point()), None) != torch.float64:
        return None
    from headlab.capture import SELF_FILLED_MASKS

    found = next((SELF_FILLED_MASKS[type(m).__name__] for m in model.modules() if type(m).__name__ in SELF_FILLED_MASKS),
                 None)
    if found is None:
        return None
    return (f"{found}: a query padded on the left may attend to no key and gets NaN, which the next layer's real rows "
            "read (headlab cannot floor a mask the attention fills itself); load it in float32, where it is finite")
