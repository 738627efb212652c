"""Declarative tables: where each model family keeps its attention projections.

Each entry names, per attention kind, a regular expression over module paths whose group 1 is
the layer index, and the attribute paths (relative to the matched module) of the q, k, v and
output projections. ``core`` is the sub-module whose forward computes the attention
probabilities and returns them at ``probs_index`` of its output tuple (the eager path).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any


@dataclass(frozen=True)
class Family:
    name: str
    patterns: tuple[tuple[str, str], ...]
    """(kind, regex over the module path; group 1 is the layer)."""
    q: str | None
    k: str | None
    v: str | None
    o: str
    d_head_attr: str
    """Attribute of ``core`` that holds the head size."""
    qkv: str | None = None
    """A fused q/k/v projection (GPT-2's ``c_attn``), its columns ordered as ``qkv_layout`` says."""
    qkv_layout: str = "q|k|v"
    """Column order of ``qkv`` (see :data:`QKV_LAYOUTS`): what discovery cannot read from the model."""
    qkv_groups_attr: str | None = None
    """Attribute of ``core`` holding the number of groups the "mp-groups" layout splits ``qkv`` into (CodeGen's
    ``mp_num``), kept in step by physical pruning."""
    core: str = ""
    """Path of the module that computes the attention probabilities ("" = the matched one)."""
    probs_index: int = 1
    """Where that module's output tuple holds the probabilities."""
    head_count_attrs: tuple[str, ...] = ()
    """Attributes of ``core`` holding a head count, kept in step by physical pruning."""
    kv_groups_attr: str | None = None
    """Attribute of ``core`` holding query heads per key/value head (grouped-query attention)."""
    probs_argument: tuple[str, int] | None = None
    """(name, position) of the ``core`` forward's argument without which it returns no
    probabilities (DeBERTa-v2's ``output_attentions``); capture passes it as True."""
    width_attrs: tuple[str, ...] = ()
    """Attributes of ``core`` holding the query width (heads x head size) that its forward splits
    the fused projection by (GPT-BigCode's ``embed_dim``), kept in step by physical pruning."""
    kv_head_count_attrs: tuple[str, ...] = ()
    """Attributes of ``core`` holding the key/value head count, beyond the usual names."""
    kv_width_attrs: tuple[str, ...] = ()
    """Attributes of ``core`` holding the key/value width (GPT-BigCode's ``kv_dim``)."""
    config_head_count_attrs: tuple[str, ...] = ()
    """Fields of the config, shared by every layer, that ``core``'s forward reads its query head
    count from (Phi-3 splits its fused projection at ``config.num_attention_heads * head_dim``):
    a pruned layer gets its own view of the config with its own count."""
    alibi_argument: str = "alibi"
    """The ``core`` forward's argument holding ALiBi biases built once for all the config's heads, in head order,
    that a pruned layer must get the rows of its kept heads of (Bloom's and Falcon's ``alibi``; MPT's
    ``position_bias``, ``[heads, 1, keys]``; MPNet's relative ``position_bias``, ``[batch, heads, q, k]``), where the
    forward takes one."""
    residual_argument: tuple[str, int] | None = None
    """(name, position) of the ``core`` forward's argument that it adds to its output (Bloom's
    ``residual``): a layer left with no head still adds it."""
    d_head: int = 0
    """The head size, where run-time discovery measured it or the config gives it (GPT-1's attention keeps none;
    0: read ``d_head_attr``)."""
    d_qk: int = 0
    """The query/key head size where discovery measured one other than ``d_head`` (MiMo-V2-Flash: 192 against
    value heads of 128); 0: the same as ``d_head``."""
    kv_heads: int = 0
    """Key/value heads measured by run-time discovery, for a block whose key projection it could
    not name (no ``q``/``k``/``v``, no ``qkv``: analysis and masking only)."""
    applications: Callable[[Any], list[tuple[int, ...]]] | None = None
    """Shared layers (ALBERT): the pattern's groups of the module run at each depth, in forward
    order, from the config; a block is one application of a module (one depth), not the module."""
    scope: str = ""
    output_norms: tuple[str, ...] = ()
    """Children of the block that normalise its output after the output projection (ALBERT's
    ``LayerNorm`` of the residual sum), not a projection's width: pruning leaves them as they are."""
    """With ``applications``: the name of the module list whose parent's forward is one pass over
    every depth (where headlab starts counting a shared module's applications)."""
    query_gate: bool = False
    """``q`` outputs per head ``[query (d_head) | gate (d_head)]``, and the forward multiplies the
    heads' outputs by ``sigmoid(gate)`` before the output projection (Qwen3-Next, Qwen3.5): a head's
    output projection input is still its own slice (zero where its values are zero)."""
    head_rows: tuple[tuple[str, tuple[str | int, ...]], ...] = ()
    """Projections (paths relative to the block) whose output rows are head-major, each head owning as
    many rows as the sum of ``core``'s attributes named beside it (an int: that many rows; an output
    gate's projection, :data:`OUTPUT_GATES`); the block has no ``q``/``k``/``v``
    (multi-head latent attention: ``q_b_proj`` emits per head ``[q_nope | q_rope]``, ``kv_b_proj``
    ``[k_nope | v]``). Physical pruning slices a removed head's rows out of each and its columns out of
    the output projection; what all heads share (the latents, their norms, the rotary key) stays."""
    head_vectors: tuple[str, ...] = ()
    """Parameters (paths relative to the block) of one entry per query head, entry h read by head h only
    (Mistral Large 4's ``softmax_scaling.scale`` and ``.bias``, :data:`HEAD_VECTORS`; the learned attention
    sinks of :data:`ATTENTION_SINKS`, held by the attention module itself): physical pruning keeps the kept
    heads' entries."""
    head_biases: tuple[tuple[str, str], ...] = ()
    """(path relative to the block, "q" or "v") of bias vectors that the forward adds to a fused projection's query
    or value heads outside it, ``d_head`` entries per query head, head-major (DeBERTa v1's ``q_bias`` and ``v_bias``
    beside its bias-free ``in_proj``): physical pruning keeps the kept heads' entries, and LRP's bias probes count
    what they keep (at those columns of the projection's output)."""
    kv_dynamic_mask: tuple[str, ...] = ()
    """(projection, vector), paths relative to the block, of a dynamic mask per key/value head computed from the
    values of every key/value head (Doge's ``dt_proj`` and ``A``, :data:`KV_DYNAMIC_MASKS`): physical pruning keeps
    every key/value head, slicing them with the key/value heads (rows, entries) and their values (columns)."""
    bias_rows: tuple[str, ...] = ()
    """Those of ``head_rows`` whose outputs feed only a bias of the scores that LRP has a rule for (Inkling's ``r_proj``,
    read by ``rel_logits_proj``, whose output that rule detaches: :mod:`headlab.importance.mixer_rules.inkling`):
    LRP leaves them to that rule, where it detaches the other head rows itself, so that a forward using them otherwise
    still fails the rule's conservation probe."""
    head_tables: tuple[str, ...] = ()
    """Parameters (paths relative to the block) of one row per query head on their first dimension, row h read by head h
    only (Inkling2's ``q_proj.norm.scale`` and ``relative_position_bias.norm.scale``, ``[heads, size]``:
    :data:`HEAD_TABLES`): physical pruning keeps the kept heads' rows."""
    count_holders: tuple[tuple[str, str], ...] = ()
    """(path relative to the block, "q" or "kv") of sub-modules whose forward views its input per head by an attribute
    ``num_heads`` set at init (Inkling2's ``relative_position_bias``: query heads; its dynamic convolutions: key/value
    heads, :data:`HEAD_COUNT_HOLDERS`): physical pruning sets it to the heads kept, as it does the attention's own."""
    kv_dynamic_convs: tuple[tuple[str, str], ...] = ()
    """(path relative to the block, "k" or "v") of dynamic short convolutions over the key or value channels whose taps
    are shared within a key/value head (Inkling2's ``Inkling2DynamicShortConvolution``, :data:`KV_DYNAMIC_CONVS`):
    physical pruning keeps the kept channels' columns of ``static_weight``, the kept key/value heads' rows of
    ``weight_proj`` and sets ``num_heads``."""
    kv_convs: tuple[tuple[str, str], ...] = ()
    """(path relative to the block, "k" or "v") of depthwise convolutions over the key or value projection's channels
    (``groups`` = channels, one kernel per channel, no channel reading another: Inkling's ``k_sconv.conv1d`` and
    ``v_sconv.conv1d``, :data:`KV_CHANNEL_CONVS`): physical pruning keeps the kept key/value heads' channels of each."""
    head_columns: tuple[str, ...] = ()
    """Embeddings of ``core`` (paths relative to it) with one column per head, read in head order by its own
    forward (UMT5's ``relative_attention_bias``, ``[buckets, heads]``, in every self-attention layer; absent
    from a layer without one): physical pruning keeps the kept heads' columns."""
    selection_argument: str | None = None
    """The ``core`` forward's argument holding the previous layer's top-k key selection, which the
    forward returns after the probabilities (GLM-MoE-DSA's ``prev_topk_indices``: a "shared" layer
    attends to the previous full layer's picks): a layer with no head left still returns it."""
    kv_from: str = ""
    """A discovered layer that attends with another layer's keys and values (Gemma 4's key/value-shared layers):
    the path, from the model, of that layer's key projection ('' elsewhere). Only ``q`` is tied then (``k`` and ``v``
    are None): masking and LRP work on it, physical pruning refuses it, and pruning the other layer keeps every
    key/value head it stores (:func:`headlab.surgery.prune_heads`)."""
    never_fed: tuple[tuple[str, str], ...] = ()
    """(kind, regex) of cross-attention modules whose projections the entry does not describe, which a model of the
    family without an encoder never runs (GPT-2's and GPT-BigCode's ``crossattention`` with ``add_cross_attention``:
    it attends to ``encoder_hidden_states``, an argument headlab never passes). Listed as idle blocks, so that what
    is left out is said, not forgotten: their heads counted from the output projection's input, their projections
    not tied (nothing headlab runs or slices reaches them)."""
    time_first: bool = False
    """The layers' hidden states are time-first, ``[T, B, C]`` (FSMT's, after fairseq): the heads' outputs at the
    output projection's input are ``[T, B, heads x d]``, which headlab's per-sentence measures read batch-first
    (:func:`headlab.capture.register_head_output_hooks`, LRP's cuts and bias probes)."""
    channels_first: bool = False
    """The layers' hidden states are channels-first, ``[batch, channels, seq]`` (SqueezeBERT's, whose projections are
    1x1 convolutions): the heads' outputs at the output projection's input are ``[batch, heads x d, seq]``, which
    headlab's per-head hooks read as ``[batch, seq, heads, d]`` (:func:`headlab.capture.register_head_output_hooks`)
    and LRP's bias probes per channel (dimension 1)."""
    pruned_forward: str = ""
    """A key of :data:`headlab.portable_code.PRUNED_FORWARDS`: the forward a pruned layer of the family takes, where
    its own cannot run with fewer heads (FSMT's merges the heads into the query's width); '' elsewhere."""
    towers: tuple[tuple[str, str, str], ...] = ()
    """(kind, regex, output projection) of a multimodal model's tower attentions, of another class, that token ids
    never run (GIT's image encoder, run on ``pixel_values`` only): listed as idle blocks, as :attr:`never_fed`'s,
    whatever else the model holds, their heads counted from the output projection's input."""
    probs_reader: Callable[[Any, tuple, dict, Any], Any] | None = None
    """``(core, args, kwargs, output) -> [batch, heads, q, k]``: the dense probability map, where ``core``'s output
    holds it in another form (Longformer's band of ``2w + 1`` keys per query, its global keys' and global queries'
    probabilities beside it, :func:`longformer_probs`); None: the tensor at ``probs_index``."""
    padded_by: str = ""
    """Class name of the module whose forward pads the tokens to a length the attention needs (``LongformerModel``,
    to a multiple of ``attention_window``) before ``core`` runs: capture records the length that module was called
    with and cuts the map back to it (the padding is masked: no query of the input attends to it)."""
    seq_major: tuple[str, ...] = ()
    """Projections (paths relative to the block) that ``core`` calls on ``[seq, batch, d]`` (Longformer's forward
    transposes its input first): LRP's bias probes count their biases' relevance per sentence so."""
    head_row_values: tuple[str, ...] = ()
    """Those of ``head_rows`` whose outputs are values, weighed by attention weights (Longformer's ``value_global``):
    LRP passes relevance through them as through ``v``, where it holds the other head rows constant (Longformer's
    ``query_global`` and ``key_global``, which only shape the global attention's weights, as ``q`` and ``k``)."""
    extra_outputs: int = 0
    """Outputs of ``core``'s forward after the probabilities that its caller unpacks (LED's decoder attention returns
    its cache third): a layer with no head left returns as many (None), as it does the probabilities."""
    sub_norm: str = ""
    """A norm between the heads and the output projection, over all heads' concatenated outputs (path relative to the
    block; :data:`SUB_NORMS`: BitNet's ``attn_sub_norm``), '' elsewhere. The heads' outputs are read, masked and gated
    at its input (:func:`headlab.adapters.head_input`), where zeroing a head equals zeroing its value rows; physical
    pruning keeps the kept heads' entries of its weight, rescaled with its epsilon (:data:`SUB_NORMS`)."""
    head_parameters: tuple[tuple[str, int], ...] = ()
    """(parameter of ``core``, the dimension that indexes its heads) of a family whose forward applies bare parameters
    (XLNet's q, k, v, o, r and seg_embed, heads on dim 1; r_w_bias, r_r_bias, r_s_bias on dim 0), its q/k/v/o the
    identity points :attr:`install` gives it: physical pruning slices these, and a pruned directory records their
    shapes (pruned_heads.py resizes them: ``plan["parameters"]``)."""
    install: Callable[[Any], None] | None = None
    """Gives the model the modules its entry names, before its blocks are made (XLNet's points,
    :func:`headlab.adapters.xlnet.install_points`), or a forward that refuses inputs the entry cannot read exactly
    before they run (block-sparse BigBird's, :func:`headlab.adapters.big_bird.install_guard`): called by
    :func:`headlab.adapters.attention_blocks`, it changes nothing the model computes on a sentence alone (ConvBERT's,
    :func:`headlab.adapters.convbert.install_padding_mask`, makes each row of a padded batch compute that)."""
    shared_bias: str = ""
    """How a stack of the family hands its relative position bias from layer to layer, where its first layer computes
    it for all (T5): ``"t5"`` (``compute_bias(query length, key length, ...)``, ``[1, heads, q, k]``), ``"local"``
    (LongT5's local attention: ``compute_bias(block_len)``, ``[1, 1, heads, block_len, 3 * block_len]``, the mask
    folded in), ``"transient-global"`` (LongT5's transient-global attention: that local bias with the mask folded in,
    then the side keys' bias from ``global_relative_attention_bias`` with their mask, ``[batch, blocks, heads,
    block_len, 3 * block_len + global blocks]``); '' where none is handed on. A pruned stack gets each layer's own,
    sliced to the heads it kept (:func:`headlab.surgery.prune_heads`; the tables stay whole), and pruned_heads.py does
    the same on a plain transformers load (the plan's ``shared_bias``: :data:`headlab.portable_code.STACK_BIAS_HOOKS`)."""
    input_readers: tuple[str, ...] = ()
    """Children of ``core`` that read the layer's input only, never a head's rows, and whose output no head's output
    reaches (Qwen4-Exp's QSA indexer ``indexer``: a key selection from its own projection of the layer's input, folded
    into the mask before the attention function; LongT5 transient-global's ``global_input_layer_norm``, over the sum of
    each global block's input states, of the model's width, before the layer's k and v): pruning leaves them whole,
    whatever their widths, and takes none for a norm over a projection's heads."""
    query_channels: tuple[tuple[str, int], ...] = ()
    """(parameter path relative to ``core``, dimension) of the parameters indexed by the query projection's output
    channels besides the attention (ConvBERT's: ``key_conv_attn_layer``'s pointwise rows and bias, multiplied channel by
    channel with the query, and ``conv_kernel_layer``'s columns, which read that product for the convolution heads'
    kernels); '' where none. Physical pruning keeps such a query whole, its rows reordered, the kept heads' first (then
    the others'), and these parameters reordered with them, so the kernels are unchanged; the attention reads the first
    heads x d rows (the family's ``pruned_forward``), and blocks count the heads from the output projection's input."""
    kept_whole: tuple[str, ...] = ()
    """Children of ``core`` that pruning leaves whole (ConvBERT's convolution heads: ``key_conv_attn_layer``,
    ``conv_kernel_layer``, ``conv_out_layer``, of the original head count's widths; ProphetNet's decoder
    self-attention's ``relative_pos_embeddings``, a row per (bucket, head of the config): ``score_heads``), whose
    parameters' head-sized widths are not heads physical pruning must slice."""
    score_heads: bool = False
    """The layer's forward computes a part of its scores for every head of the config at once, in an order that
    follows the head count (ProphetNet's decoder self-attention: ``get_predict_relative_pos_embeddings`` gathers a
    head's relative-position scores from other heads' rows), from children listed in ``kept_whole``: a pruned layer
    is told its kept heads in the config's numbering (:data:`headlab.portable_code.SCORE_HEADS_ATTR`), and its
    ``pruned_forward`` computes that part for the config's heads and takes the kept heads'."""
    parts: tuple[Family, ...] = ()
    """Entries for the model's other attention kinds where they are laid out differently (LED: its encoder's
    attention is Longformer's, its decoder's BART's), each with its own ``patterns``: the model's blocks are this
    entry's and theirs, each block carrying the entry that matched it (one level: a part has no parts)."""
    group_holders: tuple[str, ...] = ()
    """Children of ``core`` (paths relative to it) that repeat the key/value heads over their query heads themselves,
    from an attribute set at init (NeoMME's ``exclusive_self_attention``, :data:`HEAD_MAPS`: ``num_key_value_groups``
    from the config): physical pruning sets that attribute to the layer's new group size, as it does the core's."""
    shared_kv: bool = False
    """One key-value head, read by every query head as both its key and its value (DeepSeek-V4's ``kv_proj``), beside
    ``head_rows`` that are the queries' only: the block has ``kv_heads`` (1) key/value heads, not one per head as a
    latent attention's ``head_rows`` give."""
    appended_keys: str = ""
    """What ``core`` appends to the tokens' keys before its attention function runs, where it does (DeepSeek-V4's
    compressed key-value entries): the function's weights span ``[tokens | appended]`` and ``probs_reader`` cuts the
    tokens' columns out. headlab's own attention function (the fused and chunked engines) would count the appended
    columns as keys, so these blocks run on the eager path (:func:`headlab.capture.unregistrable`), whose maps the
    reader cuts; '' elsewhere."""
    output_after: str = ""
    """The projection (path relative to ``core``) that reads the output projection's output and gives the layer's
    (DeepSeek-V4's ``o_b_proj`` after its grouped ``o_a_proj``), where the layer's output is not the output
    projection's: a layer left with no head returns its output on zeros (its bias, or zeros); '' elsewhere."""
    prune_refused: str = ""
    """Why physical pruning refuses this block where LRP may not ('' elsewhere: :data:`PRUNING_REFUSED`, Inkling2's in
    session 40)."""
    output_calls: int = 1
    """How many times one call of ``core`` runs the output projection (PEGASUS-X's encoder attention: twice, on the
    global tokens' heads, then on the tokens'): a stochastic gate (Hard Concrete's) draws once per call of ``core`` and
    scales every run with that sample (:mod:`headlab.gates`), so a head is on or off for all of them; LRP sums a
    head's relevance over the runs (:func:`headlab.importance.lrp.head_relevance`)."""
    lrp_refused: str = ""
    """Why LRP refuses this block where physical pruning does not ('' where it does not: DeepSeek-V4's, refused until
    session 40, has its rule, :mod:`headlab.importance.shared_kv_rule`, ConvBERT's, refused until session 43,
    :mod:`headlab.importance.mixer_rules.convbert`); ``refused`` refuses both."""
    refused: str = ""
    """Why physical pruning and LRP refuse this block, where a table of layouts discovery does not tie
    (:data:`QKV_ADAPTERS`) read the attention and found it laid out otherwise, or where a table entry says why; ''
    elsewhere: said instead of "layout unknown"."""
    columns_after_heads: str = ""
    """Attribute of ``core`` (a dotted path) holding how many columns the output projection's input has after the
    heads' ``n_heads x d_head`` (ConvBERT's ``conv_out_layer.out_features``: its span-based dynamic convolution heads'
    outputs, concatenated after the attention heads'); '' where it has none. headlab's per-head hooks (masks, gates,
    gradient importance, ablation) pass them through untouched (:func:`headlab.capture.register_head_output_hooks`);
    physical pruning, whose slicing knows the heads' columns only, must be refused (``refused`` or ``prune_refused``)
    or keep them with a forward of its own (``query_channels`` and ``pruned_forward``: ConvBERT's; checked when the
    entry is made); LRP needs a mixer rule for ``core`` that covers them (:mod:`headlab.importance.mixer_rules`:
    ConvBERT's), else :func:`headlab.importance.rules.check_rules` refuses it."""

    def __post_init__(self) -> None:
        pruning_knows = self.refused or self.prune_refused or (self.query_channels and self.pruned_forward)
        if self.columns_after_heads and (not pruning_knows or self.channels_first):
            raise ValueError(f"family {self.name!r}: columns after the heads ({self.columns_after_heads}) need a reason "
                             "physical pruning is refused (refused or prune_refused) or a pruned forward that keeps "
                             "them (query_channels, pruned_forward), and heads' outputs on the last axis")


def rows_per_head(core: Any, sizes: tuple[str | int, ...]) -> int | None:
    """The rows one head owns in a ``Family.head_rows`` projection: the sum of ``core``'s attributes (or
    numbers) in ``sizes``; None where one is missing or not a positive int."""
    total = 0
    for size in sizes:
        value = size if isinstance(size, int) else getattr(core, size, None)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            return None
        total += value
    return total


def latent_attention_rows(core: Any) -> tuple[tuple[str, tuple[str | int, ...]], ...]:
    """Multi-head latent attention as transformers writes it (DeepSeek-V2's, ``DeepseekV3Attention``): the
    query projection (``q_b_proj`` after the query latent, or ``q_proj`` where ``q_lora_rank`` is None)
    is viewed ``[batch, seq, -1, qk_nope_head_dim + qk_rope_head_dim]``, ``kv_b_proj`` (reading the
    key/value latent) ``[batch, seq, -1, qk_nope_head_dim + v_head_dim]``: head-major rows, the head
    count read off the width. ``kv_a_proj_with_mqa`` (the latent and the one rotary key of all heads),
    ``q_a_proj`` and the norms serve every head. Empty where the module is not laid out so."""
    q = "q_proj" if getattr(core, "q_b_proj", None) is None else "q_b_proj"
    needs = (q, "kv_b_proj", "kv_a_proj_with_mqa")
    sizes = ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
    if any(getattr(core, name, None) is None for name in needs) or \
            not all(isinstance(getattr(core, name, None), int) for name in sizes):
        return ()
    return ((q, ("qk_nope_head_dim", "qk_rope_head_dim")), ("kv_b_proj", ("qk_nope_head_dim", "v_head_dim")))


def gated_latent_attention_rows(core: Any) -> tuple[tuple[str, tuple[str | int, ...]], ...]:
    """Bailing-hybrid's MLA layers (``BailingHybridAttention``) and dots3-note's (``Dots3NoteTextAttention``):
    DeepSeek-V3's views and splits, then ``attn_output * sigmoid(g_proj(hidden_states))`` with ``g_proj`` of
    one row per head, viewed ``[batch, seq, heads, 1]`` (dots3: ``.view(b, s, -1, 1)``; Bailing:
    ``.unsqueeze(-1)``): head h owns row h of ``g_proj``."""
    rows = latent_attention_rows(core)
    if not rows or getattr(core, "g_proj", None) is None:
        return ()
    return (*rows, ("g_proj", (1,)))


def query_gate_latent_rows(core: Any) -> tuple[tuple[str, tuple[str | int, ...]], ...]:
    """A.X-K2's MLA (``AXK2Attention``): no ``q_b_proj``; ``q_gate_proj`` (reading ``[q_resid | q_compressed]``)
    is viewed ``[batch, seq, -1, qk_nope + qk_rope + v_head_dim]`` and split per head ``[query | gate]``; the
    heads' outputs, reshaped ``[batch, seq, heads * v]``, are multiplied by ``sigmoid(gate)`` reshaped so
    (head h's gate meets head h's values); ``kv_b_proj`` as DeepSeek-V3's. Head h owns those rows of both."""
    sizes = ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
    if any(getattr(core, name, None) is None for name in ("q_gate_proj", "kv_b_proj", "kv_a_proj_with_mqa")) or \
            rows_per_head(core, sizes) is None:
        return ()
    return (("q_gate_proj", sizes), ("kv_b_proj", ("qk_nope_head_dim", "v_head_dim")))


def hy_v4_rows(core: Any) -> tuple[tuple[str, tuple[str | int, ...]], ...]:
    """HY-V4's MLA (``HYV4Attention``, transformers 5.24): DeepSeek-V3's views and splits (``q_b_proj`` viewed
    ``[batch, seq, -1, qk_nope + qk_rope]``, ``kv_b_proj`` ``[batch, seq, -1, qk_nope + v]``), then the attention
    function's output ``[batch, seq, heads, v]`` times ``sigmoid(gate_proj(hidden_states).view(batch, seq, -1,
    gate_projection_size))``, ``gate_projection_size`` = ``v_head_dim``: head h owns rows ``h * v_head_dim ..`` of
    ``gate_proj``. Its indexer (DSA, under no_grad) and the hyper-connections around the layer read the layer's input
    only; its sinks are :data:`ATTENTION_SINKS`'."""
    rows = latent_attention_rows(core)
    if not rows or getattr(core, "gate_proj", None) is None or \
            getattr(core, "gate_projection_size", None) != getattr(core, "v_head_dim", None):
        return ()
    return (*rows, ("gate_proj", ("v_head_dim",)))


def glm5_next_rows(core: Any) -> tuple[tuple[str, tuple[str | int, ...]], ...]:
    """GLM-5-Next's indexed attention (``Glm5NextTextAttention``, transformers 5.24): DeepSeek-V3.2's views (``q_b_proj``
    viewed ``[batch, seq, -1, qk_head_dim]``, ``kv_b_proj`` ``[batch, seq, -1, qk_nope + v]``, split ``[k_nope | v]``,
    the rotary key, possibly of width 0 as released, copied after ``k_nope``); its indexer reads the layer's input and
    the query latent ``q_resid`` only, and the hyper-connections act around the layer."""
    if any(getattr(core, name, None) is None for name in ("q_b_proj", "kv_b_proj", "kv_a_proj_with_mqa")) or \
            rows_per_head(core, ("qk_head_dim",)) is None or \
            rows_per_head(core, ("qk_nope_head_dim", "v_head_dim")) is None:
        return ()
    return (("q_b_proj", ("qk_head_dim",)), ("kv_b_proj", ("qk_nope_head_dim", "v_head_dim")))


def mistral_large4_rows(core: Any) -> tuple[tuple[str, tuple[str | int, ...]], ...]:
    """Mistral Large 4's MLA (``MistralLarge4TextAttention``, transformers 5.24): no query latent; ``q_proj`` is
    viewed ``[batch, seq, -1, qk_head_dim]`` and split ``[qk_nope_head_dim | qk_rope_head_dim]`` (a NoPE layer: rope
    0, its nope part the whole ``qk_head_dim``), ``kv_b_proj`` as DeepSeek-V3's. A layer of ``kv_sharing_modes``
    'reuse' has no ``kv_a_proj_with_mqa``: it reads the latents an earlier layer stored (``shared_kv_states``: the
    normed latent and the rotated rotary key, before any layer's ``kv_b_proj``), which no head of either layer
    changes. Its per-head query scaling is :data:`HEAD_VECTORS`'."""
    if getattr(core, "q_proj", None) is None or getattr(core, "kv_b_proj", None) is None or \
            (getattr(core, "kv_a_proj_with_mqa", None) is None and getattr(core, "is_kv_shared_layer", None) is not True) \
            or rows_per_head(core, ("qk_head_dim",)) is None or rows_per_head(core, ("qk_nope_head_dim", "v_head_dim")) is None:
        return ()
    return (("q_proj", ("qk_head_dim",)), ("kv_b_proj", ("qk_nope_head_dim", "v_head_dim")))


LATENT_ATTENTION: dict[str, Callable[[Any], tuple[tuple[str, tuple[str | int, ...]], ...]]] = dict.fromkeys(
    ["deepseek_v2", "deepseek_v3", "deepseek_v32", "glm_moe_dsa", "sarvam_mla", "glm4_moe_lite", "minicpm3",
     # the same views and splits (read off their forwards): LongCat-Flash scales the query and key/value
     # latents by constants, Mistral 4 the queries by a per-position factor the same for every head, Kimi
     # Linear's leave out the rotation; none of it per head
     "longcat_flash", "mistral4", "youtu", "axk1", "kimi_linear"],
    latent_attention_rows) | dict.fromkeys(["bailing_hybrid", "dots3_note_text"], gated_latent_attention_rows) | \
    {"axk2": query_gate_latent_rows} | dict.fromkeys(["hy_v4", "hy_v4_vl_text", "hy_v4_vl"], hy_v4_rows) | \
    dict.fromkeys(["mistral_large4_text", "mistral_large4"], mistral_large4_rows) | \
    dict.fromkeys(["glm5_next_text", "glm5_next"], glm5_next_rows)
"""Model types found at run time whose attention is multi-head latent attention, each with what gives
a block's ``Family.head_rows`` from its attention module (whose forward headlab's tests check: pruning
equals masking, tests/test_mla_pruning.py). Other types with a ``kv_b_proj`` stay unpruned, as not
checked (:func:`unpruned_latent_reason`)."""

HEAD_VECTORS: dict[str, tuple[str, ...]] = dict.fromkeys(
    ["mistral_large4_text", "mistral_large4"], ("softmax_scaling.scale", "softmax_scaling.bias"))
"""Latent-attention types whose forward scales each head's queries by its own entries of parameters with one
entry per head (``Family.head_vectors``). Mistral Large 4: ``MistralLarge4TextSoftmaxScaling`` multiplies head
h's queries by ``scale[h] * log(position + 1) + bias[h]`` (``head_dim_first``: ``[batch, heads, seq]``), after
the query projection's per-head view and before the attention function, so the kept heads keep their entries
(the indexer's own ``softmax_scaling``, over the indexer's heads, is not the attention's and stays)."""


ATTENTION_SINKS: dict[str, tuple[str, ...]] = dict.fromkeys(
    ["gpt_oss", "granite_swa", "granitemoe_swa", "flint", "mimo_v2_flash", "hy_v4", "hy_v4_vl_text", "hy_v4_vl"],
    ("sinks",))
"""Model types whose attention module holds learned attention sinks, ``sinks``: one logit per query head (its
``num_attention_heads`` entries; MiMo-V2-Flash's sliding-window layers only, ``None`` in the others), read by
transformers' attention functions for that head alone (transformers 5.24). Eager (GPT-OSS, Flint, MiMo-V2-Flash, HY-V4):
``sinks.reshape(1, -1, 1, 1)`` is appended to each head's row of logits as one more softmax column, then dropped;
Granite-SWA and GraniteMoE-SWA: head h's output times ``sigmoid(logsumexp(logits_h) - sinks[h])``
(``sinks.view(1, -1, 1)``), the same extra softmax logit; flex attention: the output renormalised by
``exp(lse - logsumexp([lse, sink]))`` with ``s_aux.view(1, -1, 1, 1)``, off a CPU only (on a CPU transformers raises,
and headlab refuses such a model before any work: :func:`headlab.adapters.refuse_broken_flex`); SDPA is not supported
by these classes.
Head h's sink changes head h's output only, so masking a head (zeros at the output projection's input) leaves
the others' exact and pruning keeps the kept heads' entries (``Family.head_vectors``). A layer left with no
head needs none (its stand-in adds the output projection's bias). Other per-head parameters of an attention
module stay refused (:func:`headlab.surgery.check_block_sliceable`), but Doge's ``A`` (one entry per key/value
head): :data:`KV_DYNAMIC_MASKS`."""

SINKS_SCALE_OUTPUT = frozenset({"granite_swa", "granitemoe_swa"})
"""Model types of :data:`ATTENTION_SINKS` whose eager attention returns the softmax without the sink (rows of 1)
and applies the sink after, scaling head h's output by ``sigmoid(logsumexp(logits_h) - sinks[h])`` (transformers
5.24, ``eager_attention_forward`` of their modeling modules): the weights the values get are those rows times the
scale, which headlab's capture returns (:func:`headlab.capture.capture_attention`), as the others' eager returns them."""

CAUSAL_ON_TOKEN_IDS = frozenset({"paligemma", "gemma", "gemma2", "gemma3"})
"""Model types (of the wrapper) whose language model's attention says it is not causal where its text config sets
``use_bidirectional_attention`` (``is_causal`` False, for the prefix of image and prompt tokens that ``token_type_ids``
marks) but is causal on token ids alone, as headlab runs it: PaliGemma (transformers 5.24, ``PaliGemmaModel.forward``:
without ``token_type_ids``, ``create_causal_mask``; its config sets the flag), and Gemma, Gemma 2 and Gemma 3's
multimodal wrapper with the flag set (their masks ignore it; Gemma 3's text model, ``gemma3_text``, honours it: its
blocks are ``enc_self`` there). Their blocks are ``dec_self`` (:func:`causal_on_token_ids`; before session 39 Gemma,
Gemma 2 and Gemma 3's were ``enc_self`` with the flag set, a masked LM's objective: experiments/variant_sweep.py).
Under an implementation that skips that mask on a batch without padding (SDPA: ``is_causal`` False then attends
bidirectionally, and a padded batch causally) the model is refused before any work, naming the way out: eager
attention, which always builds it (:func:`headlab.adapters.refuse_mask_skip`)."""


_T5_FLEX = ("its attention hands transformers' flex_attention_forward a relative position bias of one batch row "
            "([1, heads, queries, keys]: T5Attention.forward, compute_bias), which flex's score_mod indexes by batch "
            "row (position_bias[batch_idx, ...]): a batch of more than one sentence fails, index out of bounds",
            "position_bias[batch_idx")
FLEX_REFUSED: dict[str, tuple[str, str]] = {
    "doge": ("its attention (DogeAttention.prepare_dynamic_mask) drops the causal block mask and hands flex attention "
             "its dynamic mask alone, so every query attends to later tokens too, while eager and SDPA are causal",
             "not isinstance(attention_mask, BlockMask)"),
    **dict.fromkeys(("t5", "mt5", "umt5"), _T5_FLEX),
}
"""Model types that transformers 5.24 runs wrongly under ``attn_implementation="flex_attention"``: what goes wrong,
and the text of its source that does it (the model's modeling module or ``integrations/flex_attention.py``: a
transformers whose code no longer has it is not refused). Doge's ``prepare_dynamic_mask`` adds its dynamic mask onto a
4-D mask tensor but skips a ``BlockMask`` and hands the attention function the dynamic mask alone, which
``flex_attention_forward`` adds as a score mask with no block mask: not causal (headlab's eager reading would be, a
silent wrong result). T5, mT5 and UMT5 hand it a position bias of one batch row that its ``score_mod`` indexes by
batch row. Every measurement refuses them before any work, naming the way out, SDPA
(:func:`headlab.adapters.refuse_broken_flex`; found by experiments/family_sweep.py ``--attn-implementation
flex_attention``, session 46)."""


def causal_on_token_ids(config: Any) -> bool:
    """The model of ``config`` is one of :data:`CAUSAL_ON_TOKEN_IDS` with its text config's
    ``use_bidirectional_attention`` set (True): its attention's ``is_causal`` is False, its mask causal."""
    if getattr(config, "model_type", None) not in CAUSAL_ON_TOKEN_IDS:
        return False
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return getattr(text, "use_bidirectional_attention", None) is True


CLIPPED_QKV: dict[str, str] = {
    "DbrxAttention": "clip_qkv", "MptAttention": "clip_qkv",
    "OlmoAttention": "config.clip_qkv", "OlmoeAttention": "config.clip_qkv"}
"""Attention classes whose forward clamps its query, key and value projections' outputs to ``[-c, c]`` element by
element, with where ``c`` is read (a path from the attention module; None or 0: no clamp): DBRX and MPT clamp the
fused ``Wqkv`` output (MPT only where ``clip_qkv`` is truthy), OLMo and OLMoE each of ``q_proj``, ``k_proj`` and
``v_proj``'s in place (transformers 5.24). Per element, so slicing heads keeps it exact; LRP passes the values'
relevance through it by the activation rule (:class:`headlab.importance.rules._ClampIdentity`), where the clamp's own
gradient, 0 where it clips, lost it."""

_NOUNS = {"q": "queries", "k": "keys", "v": "values"}


def zamba2_attention_adapters(core: Any, sources: tuple[tuple[str, ...], ...]) -> dict[str, Any] | str:
    """Zamba 2's attention with shared attention adapters (``Zamba2Attention``, transformers 5.24, with
    ``use_shared_attention_adapter``): ``query = q_proj(x) + linear_q_adapter_list[i](x)``, the same for the keys
    and values, ``i`` the layer's place among the hybrid layers (``layer_dic[layer_idx]``), each adapter
    ``nn.Sequential(Linear(d, rank), Linear(rank, d))`` without biases (``nn.Identity`` at the places this block does
    not serve, which it never runs); the sums are viewed ``[.., heads, head_dim]`` (the forward runs only with as many
    key/value heads as query heads and ``heads x head_dim = attention_hidden_size``). So head h owns rows
    ``h * head_dim ..`` of ``q_proj``, ``k_proj``, ``v_proj`` and of every adapter's second Linear; the first Linear
    (to the rank) is shared by all heads and stays. ``sources`` (:attr:`~headlab.adapters.discovery.Discovered.sources`,
    relative to ``core``) must show each of the queries, keys and values coming from its projection and one adapter,
    the same place for the three. The fields the block's :class:`Family` takes (``q``, ``k``, ``v``, ``head_rows``:
    every adapter's second Linear, ``head_row_values``: the value adapters', which LRP passes relevance through as
    through ``v_proj``, holding the query and key adapters constant with ``q_proj`` and ``k_proj``), or why not."""
    from torch import nn

    cls = type(core)
    if cls.__name__ != "Zamba2Attention" or not cls.__module__.startswith("transformers.models.zamba2."):
        return f"its attention class {cls.__module__}.{cls.__name__} is not transformers' Zamba2Attention, the forward " \
               "headlab read"
    if len(sources) != 3:
        return "the probe forward did not trace its queries, keys and values to projections of the attention module"
    rows: list[tuple[str, tuple[str | int, ...]]] = []
    values: list[str] = []
    places = set()
    for which, came_from in zip("qkv", sources):
        name, listed = f"{which}_proj", f"linear_{which}_adapter_list"
        projection, adapters = getattr(core, name, None), getattr(core, listed, None)
        if not isinstance(projection, nn.Linear) or not isinstance(adapters, nn.ModuleList):
            return f"it has no linear {name} beside a module list {listed}"
        served = []
        for i, adapter in enumerate(adapters):
            if isinstance(adapter, nn.Identity):
                continue
            parts = list(adapter) if isinstance(adapter, nn.Sequential) else []
            if len(parts) != 2 or not all(isinstance(p, nn.Linear) and p.bias is None for p in parts) \
                    or parts[0].in_features != projection.in_features or parts[0].out_features != parts[1].in_features \
                    or parts[1].out_features != projection.out_features:
                return (f"its adapter {listed}.{i} is not two bias-free linear maps {projection.in_features} -> rank -> "
                        f"{projection.out_features} ({name}'s widths), nor nn.Identity")
            served.append(f"{listed}.{i}.1")
        adapter_rows = set(came_from) - {name}
        if name not in came_from or len(adapter_rows) != 1 or not adapter_rows <= set(served):
            return (f"its {_NOUNS[which]} came from "
                    f"{', '.join(came_from) or 'no projection of it'} in the probe forward, not from {name} and one "
                    f"adapter of {listed}")
        places.add(next(iter(adapter_rows)).split(".")[1])
        rows += [(path, ("head_dim",)) for path in served]
        values += served if which == "v" else []
    if len(places) != 1:
        return f"its queries, keys and values came from the adapters of different places ({', '.join(sorted(places))})"
    return dict(q="q_proj", k="k_proj", v="v_proj", head_rows=tuple(rows), head_row_values=tuple(values))


QKV_ADAPTERS: dict[str, Callable[[Any, tuple[tuple[str, ...], ...]], dict[str, Any] | str]] = {
    "zamba2": zamba2_attention_adapters}
"""Model types found at run time whose queries, keys and values are each a projection's output plus an adapter's
(which discovery ties to no single projection), with what reads the layout off the attention module and the
projections discovery traced them to: the :class:`Family` fields that tie them (``q``, ``k``, ``v`` and the
adapters' rows per head, ``head_rows``, sliced with the heads by physical pruning), or why the module is not laid
out so (``Family.refused``: pruning and LRP refused, naming it). Zamba 2: :func:`zamba2_attention_adapters`."""

FUSED_REFUSED: dict[str, str] = {
    "ZayaAttention": "its queries, keys and values come from ZAYA's compressed convolutional attention "
                     "(qkv_proj, ZayaCCAProjection), not from projections per head: each query is mixed with its "
                     "key/value head's key ((q + k) / 2) and each key with the mean of that over its group's query "
                     "heads, queries and keys are convolved over time (conv_qk_depthwise, conv_qk_grouped), and the "
                     "values are split between the current and the previous token (v_proj_current, v_proj_delayed), "
                     "so removing a query head changes the keys of its group, which masking it does not"}
"""Attention classes found by discovery (no projection tied) whose layout headlab read and does not slice, with why:
physical pruning is refused naming it, before any work (transformers 5.24). LRP has a rule for ZAYA's
(:mod:`headlab.importance.cca_rule`); any other class here is refused by LRP too."""

HEAD_PARAMETERS_REFUSED: dict[str, str] = {}
"""Attention classes (their names) whose per-head parameters no slicing keeps exact, with why (read off their
forwards, transformers 5.24): physical pruning is refused naming it, before any work. (Doge's ``A``, refused in
session 26, is sliced: :data:`KV_DYNAMIC_MASKS`.)"""

KV_DYNAMIC_MASKS: dict[str, tuple[str, str]] = {"doge": ("dt_proj", "A")}
"""Model types whose attention adds to each head's logits a dynamic mask of one value per key/value head and key
position, computed from the values of every key/value head of the layer: (the projection, the vector of one entry
per key/value head), relative to the attention module (``Family.kv_dynamic_mask``). Doge (``DogeAttention``,
transformers 5.24): ``dt = exp(A * softplus(dt_proj(v)))`` with ``v`` the values of all key/value heads
concatenated (``[batch, keys, kv heads x head_dim]``) and ``dt_proj`` (kv heads x head_dim -> kv heads), the
mask (its top ``keep_window_size`` keys per row kept where a row is longer) repeated over each group's query
heads. So removing query heads while every key/value head keeps one leaves every mask as it was, and physical
pruning keeps ``A``'s entries and ``dt_proj``'s rows of the kept key/value heads (repeated with them where uneven
groups repeat a key/value head) and each key/value head's columns of ``dt_proj`` once, at its first copy (the
copies read the same values; zeros at the others). Removing a key/value head (its whole group) takes its values out
of every other head's mask: refused before any work (:func:`headlab.surgery.kv_dynamic_mask_reason`)."""


OUTPUT_GATES: dict[str, tuple[str, ...]] = {
    "bailing_hybrid": ("g_proj",), "dots3_note_text": ("g_proj",), "axk2": ("q_gate_proj",), "beam": ("gate_proj",),
    "afmoe": ("gate_proj",), "laguna": ("g_proj",), "lfm3": ("g_proj",),
    **dict.fromkeys(["hy_v4", "hy_v4_vl_text", "hy_v4_vl"], ("gate_proj",)),
    **dict.fromkeys(["step3p5", "step3p7"], ("g_proj",)),
    **dict.fromkeys(["muse_glimmer_text", "muse_glimmer", "muse_spark_text", "muse_spark"], ("gate_proj",)),
    "neomme": ("output_projection.gate_proj",),
    **dict.fromkeys(["inkling2_text", "inkling2", "inkling2_loop_text", "inkling2_loop"], ("o_proj.gate_proj",))}
"""Model types whose attention multiplies the heads' outputs by a gate between the attention function and
``o_proj`` (:mod:`headlab.adapters.discovery` sees the product), with the projections (relative to the
attention module) that the gate is computed from: their forwards were read (transformers 5.24) and each head's
gate is computed from the layer's input by its own rows of that projection, which
:data:`LATENT_ATTENTION`'s ``head_rows`` name (:data:`QKV_OUTPUT_GATES`' for an attention with q/k/v
projections), and multiplies that head's slice only. So capture (the attention
function's probabilities) is untouched, masking a head (zeros at ``o_proj``'s input) equals removing it
(``0 * sigmoid(g) = 0``; Laguna's ``softplus(g) * 0 = 0``) and physical pruning removes the head's gate rows with
its query and key/value rows. A gate from any other projection, or in a model type not listed, is refused before
any work (discovery's message names the projection)."""

SUB_NORMS: dict[str, str] = {"BitNetRMSNorm": "rms", "DoryL2Norm": "l2"}
"""Classes of transformers' own norms (their names) that an attention applies to the concatenated heads' outputs
between the attention function and ``o_proj`` (``o_proj(norm(attn_output))``), with the formula each computes over
the last dimension only (read off transformers 5.24's forwards); :mod:`headlab.adapters.discovery` lets the heads'
outputs pass through one of them to the output projection (``Family.sub_norm``). Masking a head (zeros at the norm's
input) is then what zeroing its value rows gives. Physical pruning removes the head's zero entries from the norm's
input, which must leave the other entries' outputs as they were:

* ``"rms"`` (``BitNetRMSNorm``: ``w * x / sqrt(mean(x^2) + eps)``, in float32, the weight after the cast back): over
  ``n`` entries of which ``n'`` are kept (the others zero), ``mean`` over all is ``S / n`` with ``S`` the kept
  entries' sum of squares, so ``w x / sqrt(S / n + eps) = (w sqrt(n / n')) x / sqrt(S / n' + eps n / n')``: the kept
  entries of the weight times ``sqrt(n / n')`` and ``eps' = eps n / n'`` (the norm's ``variance_epsilon``, one per
  layer after pruning, which the portable plan carries as an attribute of the norm);
* ``"l2"`` (``DoryL2Norm``: ``x / sqrt(sum(x^2) + eps)``, no weight): removing zero entries changes neither the sum nor
  eps, so the norm stays as it is.

A layer left with no head: the norm's input is all zeros, its output ``0 / sqrt(eps) = 0`` in both, so the layer
adds ``o_proj(0)``, the output projection's bias, which the stand-in of a layer with no head returns."""

HEAD_NORMS: frozenset[str] = frozenset({"MuseSparkRMSNorm"})
"""Classes of transformers' own norms (their names) that an attention may apply to the attention function's output
``[batch, seq, heads, head_dim]`` before regrouping it for ``o_proj``: each normalises the last dimension only, with a
weight of that size where it has one (read off transformers 5.24: Muse Spark's ``o_norm``, ``MuseSparkRMSNorm(
with_scale=False)``, ``x * (mean(x^2) + eps)^-0.5``). Applied there, it computes each head's output from that head's
values only and maps a head's zeros to zeros, so :mod:`headlab.adapters.discovery` lets the heads' outputs pass
through it (only at that width: ``head_dim`` features of one head). Masking at ``o_proj``'s input then equals zeroing
the head's value rows, a gate scales the head's column of ``o_proj``'s input exactly, and physical pruning leaves the
norm as it is (its weight, if any, is shared by the heads)."""

HEAD_MAPS: dict[str, tuple[str, str]] = {"NeoMMEExclusiveSelfAttention": ("alpha", "num_key_value_groups")}
"""Classes of transformers' own modules (their names) that an attention applies to the attention function's output
``[batch, seq, heads, head_dim]``, with the layer's values, before regrouping it for the output projection, and that
map each head's output by a linear map of that head's own, for fixed values: (the parameter of one entry per query
head, the attribute giving the query heads per key/value head its forward repeats the values by). Read off
transformers 5.24: NeoMME's ``exclusive_self_attention`` (``NeoMMEExclusiveSelfAttention(attn_output,
value_states)``), ``o_i - tanh(alpha_h) (o_i . v^_i) v^_i`` per query head h and position i, ``v^_i`` the unit vector of
position i's own value in head h's key/value group (``repeat_kv(value_states, num_key_value_groups)``). So a head
whose output is 0 stays 0, a gate ``g`` on a head's output gives ``g`` times the map's output, and no head reads
another's output: :mod:`headlab.adapters.discovery` lets the heads' outputs pass through it as through
:data:`HEAD_NORMS` (only at one head's width, its parameter one entry per query head), masking at the output
projection's input equals zeroing the head's output before the map, and physical pruning keeps the kept heads' entries
of the parameter (``Family.head_vectors``) and sets the attribute to the layer's new group size
(``Family.group_holders``). LRP holds ``v^`` constant: :mod:`headlab.importance.head_map_rule`."""

VALUE_EMBEDDINGS: dict[str, tuple[str, str]] = {"neomme": ("value_embeddings", "value_embedding_layers")}
"""Model types whose model adds a token embedding of its own to the values of some attention layers: (the model's
embedding, ``[vocab, kv heads x head_dim]``, the model's set of the layer indices that get it), read off transformers
5.24: NeoMME's ``NeoMMEModel.value_embeddings``, handed to its first and last full-attention layers
(``value_embedding_layers``), whose attention adds ``value_embeds.view(..., -1, head_dim)`` to its value states, key/value
head by key/value head. The embedding is the model's, one for those layers (left whole), so a pruned layer there that
keeps other key/value heads than all of them, each once, is handed its kept heads' columns of it, repeated as its value
heads are (:class:`headlab.portable_code.ValueEmbedsHook`, which pruned_heads.py installs too)."""

LINEAR_MIXERS: frozenset[str] = frozenset({"KimiLinearDeltaAttention", "Glm5NextTextLinearAttention"})
"""Classes of transformers' own linear-attention layers that hold query/key/value/output projections but compute no
attention map: Kimi Delta Attention (KDA, Kimi Linear's and GLM-5-Next's ``linear_attention`` layers; read in
transformers 5.24: ``chunk_kimi_delta_attention`` / ``recurrent_kimi_delta_attention``, a delta-rule recurrent state
per head with per-channel forget gates, no softmax over keys). They are a hybrid's other mixer, as Qwen3-Next's Gated
DeltaNet (``linear_attn``) is: headlab analyses the model's attention layers and leaves these as they are, not as heads
(before session 38 their names made them look like attention that skipped the interface, and the model was refused).
LRP through them: :mod:`headlab.importance.mixer_rules.kda`."""

DEPTH_MIXERS: frozenset[str] = frozenset({"Inkling2BlockAttentionResidual", "Inkling2LoopBlockAttentionResidual",
                                         "Inkling2LoopMessageAttentionResidual"})
"""Classes of transformers' own modules that call the attention interface but attend over depth, not over tokens:
Inkling2's block attention residuals (``Inkling2BlockAttentionResidual``: a decoder layer's ``attention_input``,
``mlp_input`` and the text model's ``final_input``; read in transformers 5.24). At each position, one to three learned
queries (no projection, the same at every position) attend over that position's states at the earlier block
boundaries and the current partial state, ``stacked_states`` viewed ``[batch, seq, blocks, hidden]`` and handed to the
function as ``[batch, "heads", queries, hidden]``: the function's "heads" are the sequence's positions, its keys the
depths. They have no heads and no map over the input's tokens: discovery leaves them out (they are a part of the
residual stream, as a hybrid's other mixers are), so they never claim a layer number of the model's attention."""

GateRows = tuple[tuple[tuple[str, tuple[str | int, ...]], ...], tuple[str, ...]]


def beam_gate(core: Any) -> GateRows:
    """Beam (``BeamAttention``): ``gate = gate_proj(hidden_states).view_as(attn_output) + gate_bias[None, None, :,
    None]``, ``attn_output * sigmoid(gate)``, with ``attn_output`` the attention function's ``[batch, seq, heads,
    head_dim]``: head h's gate is rows ``h * head_dim ..`` of ``gate_proj`` (hidden -> heads x head_dim) plus
    ``gate_bias[h]`` (one value per head, broadcast over its features)."""
    return (("gate_proj", ("head_dim",)),), ("gate_bias",)


def afmoe_gate(core: Any) -> GateRows:
    """AFMoE (``AfmoeAttention``): the attention function's output reshaped ``[batch, seq, heads * head_dim]`` times
    ``sigmoid(gate_proj(hidden_states))`` (hidden -> heads x head_dim): head h's gate is rows ``h * head_dim ..``."""
    return (("gate_proj", ("head_dim",)),), ()


def laguna_gate(core: Any) -> GateRows:
    """Laguna (``LagunaAttention``): ``gate = softplus(g_proj(hidden_states))``; with ``gate_per_head`` (config
    ``gating`` True or "per-head") ``g_proj`` is hidden -> heads and the output viewed ``[batch, seq, heads,
    head_dim]`` times ``gate.unsqueeze(-1)`` (head h: row h), else hidden -> heads x head_dim times the output
    reshaped ``[batch, seq, heads * head_dim]`` (head h: rows ``h * head_dim ..``). Neither, where the flag is not
    a bool (a forward not read)."""
    per_head = getattr(core, "gate_per_head", None)
    if not isinstance(per_head, bool):
        return (), ()
    return (("g_proj", (1,) if per_head else ("head_dim",)),), ()


def lfm3_gate(core: Any) -> GateRows:
    """LFM3 (``Lfm3Attention``): with ``use_attention_gate``, the attention function's output ``[batch, seq, heads,
    head_dim]`` times ``sigmoid(g_proj(hidden_states)).unsqueeze(-1)`` (hidden -> heads): head h's gate is row h;
    without, ``g_proj`` is None and there is no gate."""
    return ((("g_proj", (1,)),), ()) if getattr(core, "g_proj", None) is not None else ((), ())


def step3p7_gate(core: Any) -> GateRows:
    """Step-3.7 (``Step3p7Attention``, its text model's type ``step3p5``): with ``gate_per_head`` (config ``gating``
    True or "per-head") the attention function's output viewed ``[batch, seq, heads, head_dim]`` times
    ``g_proj(hidden_states).unsqueeze(-1).sigmoid()`` (hidden -> heads): head h's gate is row h. Otherwise ``g_proj``
    is hidden -> heads x head_dim and the forward's product does not broadcast (transformers 5.24): no rows."""
    return ((("g_proj", (1,)),), ()) if getattr(core, "gate_per_head", None) is True else ((), ())


def neomme_gate(core: Any) -> GateRows:
    """NeoMME (``NeoMMEAttention``): ``output_projection`` (``NeoMMESigmoidGatedProjection``) computes
    ``o_proj(attn_output * sigmoid(gate_proj(hidden_states)))``, ``attn_output`` the heads' outputs (after
    ``exclusive_self_attention``, :data:`HEAD_MAPS`) reshaped ``[batch, seq, heads * head_dim]`` and ``gate_proj``
    hidden -> heads x head_dim: head h's gate is rows ``h * head_dim ..``."""
    return (("output_projection.gate_proj", ("head_dim",)),), ()


def inkling_rows(core: Any) -> tuple[tuple[str, tuple[str | int, ...]], ...]:
    """Inkling (``InklingAttention``, transformers 5.24): ``r_proj`` (hidden -> heads x ``config.d_rel``) is viewed
    ``[batch, seq, heads, d_rel]`` and ``rel_logits_proj`` maps each head's ``d_rel`` features to that head's bias of
    the scores only: head h owns rows ``h * d_rel ..``. None where the module has no such projection or size."""
    d_rel = getattr(getattr(core, "config", None), "d_rel", None)
    if not isinstance(d_rel, int) or isinstance(d_rel, bool) or d_rel <= 0 or getattr(core, "r_proj", None) is None:
        return ()
    return (("r_proj", (d_rel,)),)


def inkling2_rows(core: Any) -> tuple[tuple[str, tuple[str | int, ...]], ...]:
    """Inkling2 and Inkling2-Loop (``Inkling2SlidingAttention``, ``Inkling2FullAttention`` and the Loop's, transformers
    5.24): ``sink_proj`` (hidden -> heads) gives head h its sink logit from row h (``.transpose(1, 2).unsqueeze(-1)``:
    one extra softmax column of that head's scores); ``relative_position_bias.linear`` (hidden -> heads x
    ``config.d_rel``) is viewed ``[batch, seq, num_heads, d_rel]``, its norm scales and clips each head's vector alone,
    and ``proj`` maps it to that head's bias: head h owns rows ``h * d_rel ..``. (The gate's rows:
    :func:`inkling2_gate`.)"""
    d_rel = getattr(getattr(core, "config", None), "d_rel", None)
    if not isinstance(d_rel, int) or isinstance(d_rel, bool) or d_rel <= 0:
        return ()
    return (("sink_proj", (1,)), ("relative_position_bias.linear", (d_rel,)))


_INKLING2 = ["inkling2_text", "inkling2", "inkling2_loop_text", "inkling2_loop"]

QKV_HEAD_ROWS: dict[str, Callable[[Any], tuple[tuple[str, tuple[str | int, ...]], ...]]] = {
    **dict.fromkeys(["inkling_text", "inkling"], inkling_rows), **dict.fromkeys(_INKLING2, inkling2_rows)}
"""Model types whose attention, beside its q/k/v projections, has projections of the layer's input with rows per
query head that only that head reads (each function's docstring: read off transformers 5.24's forward), giving
``Family.head_rows`` from the attention module: physical pruning slices them with the heads."""

SCORE_BIAS_ROWS: dict[str, tuple[str, ...]] = dict.fromkeys(["inkling_text", "inkling"], ("r_proj",))
"""Those of :data:`QKV_HEAD_ROWS`' projections that feed only a score bias LRP has a rule for (``Family.bias_rows``)."""

QKV_APART: dict[str, tuple[str, str, str]] = dict.fromkeys(
    ["Inkling2FullAttention", "Inkling2LoopFullAttention"], ("q_proj.linear", "k_proj.linear", "v_proj.linear"))
"""Attention classes (their names) whose queries, keys and values are projections of three different inputs, which
discovery's probe does not tie (Inkling2's full-attention layers: ``key_hidden_states``, ``value_hidden_states``,
normed block-residual mixes of their own; read in transformers 5.24), with their query, key and value projections
(relative to the attention module): each feeds one part only, head-major (``view(..., -1, head_dim)``), so their rows
are the heads' as any q/k/v projection's, whatever their inputs."""

HEAD_TABLES: dict[str, tuple[str, ...]] = dict.fromkeys(
    _INKLING2, ("q_proj.norm.scale", "relative_position_bias.norm.scale"))
"""Model types whose attention holds parameters of one row per query head (``Family.head_tables``). Inkling2
(``Inkling2ScaledL2Clip`` / ``Inkling2LogScaledL2Clip``, transformers 5.24): ``scale`` ``[heads, size]`` multiplies the
states viewed ``[batch, seq, heads, size]`` and the L2 clip then acts on each head's vector alone."""

HEAD_COUNT_HOLDERS: dict[str, tuple[tuple[str, str], ...]] = dict.fromkeys(
    _INKLING2, (("relative_position_bias", "q"), ("k_proj.sconv", "kv"), ("v_proj.sconv", "kv")))
"""Model types whose attention's sub-modules view their states per head by a ``num_heads`` of their own
(``Family.count_holders``; one without the attribute, Inkling2's static convolutions, is left out)."""

KV_DYNAMIC_CONVS: dict[str, tuple[tuple[str, str], ...]] = dict.fromkeys(
    _INKLING2, (("k_proj.sconv", "k"), ("v_proj.sconv", "v")))
"""Model types whose attention runs dynamic short convolutions over the key/value channels (``Family.kv_dynamic_convs``;
only those with ``static_weight`` and ``weight_proj``). Inkling2's full-attention layers
(``Inkling2DynamicShortConvolution``, transformers 5.24): taps ``static_weight.T.view(num_heads, -1, kernel)`` (one
kernel per channel) plus ``weight_proj(dynamic_input).view(batch, seq, num_heads, 1, kernel)`` (one kernel per
key/value head and token, shared by its channels), applied to each channel's own window (``windows`` viewed
``[batch, seq, num_heads, -1, kernel]``), plus the channel itself, over ``sqrt(2 kernel + 1)``; its conv states in the
cache (sized from the input on first use). No key/value head reads another's channels or rows, so pruning keeps the
kept heads' columns of ``static_weight``, their ``kernel`` rows each of ``weight_proj``, and sets ``num_heads``."""

KV_CHANNEL_CONVS: dict[str, tuple[tuple[str, str], ...]] = {
    **dict.fromkeys(["inkling_text", "inkling"], (("k_sconv.conv1d", "k"), ("v_sconv.conv1d", "v"))),
    # Inkling2's sliding-window layers (Inkling2ShortConvolution): Inkling's, over (u + conv1d(u)) / sqrt(kernel + 1)
    **dict.fromkeys(_INKLING2, (("k_proj.sconv.conv1d", "k"), ("v_proj.sconv.conv1d", "v")))}
"""Model types whose attention runs a depthwise convolution over the key or value projection's channels before the
attention function (``Family.kv_convs``: path relative to the attention module, "k" or "v"). Inkling
(``InklingShortConvolution``, transformers 5.24): ``u + conv1d(u)`` over time in float32, ``conv1d`` an ``nn.Conv1d``
with ``groups`` = channels (one causal kernel per channel, no bias), the padded positions zeroed first
(``conv_mask``, per position) and the last ``kernel - 1`` inputs of each channel kept in the cache's conv states
(``cache.update_conv_state``, sized from the input on first use). No channel reads another, and the key norm
(``k_norm``) acts per head after it, so a key/value head's keys and values come from its own channels only: physical
pruning keeps the kept key/value heads' channels (their kernels), and a pruned layer's conv states hold those
channels alone. headlab checks each is such a convolution before slicing it
(:func:`headlab.surgery.check_block_sliceable`)."""


def inkling2_gate(core: Any) -> GateRows:
    """Inkling2 (``Inkling2SlidingAttention``, ``Inkling2FullAttention``): ``o_proj`` (``Inkling2GatedOutputProjection``)
    computes ``linear(attn_output * sigmoid(gate_proj(hidden_states)))``, ``attn_output`` the attention function's output
    reshaped ``[batch, seq, heads * head_dim]`` and ``gate_proj`` hidden -> heads x head_dim: head h's gate is rows
    ``h * head_dim ..``. Its other per-head rows (``sink_proj``, ``relative_position_bias``): :func:`inkling2_rows`."""
    return (("o_proj.gate_proj", ("head_dim",)),), ()


QKV_OUTPUT_GATES: dict[str, Callable[[Any], GateRows]] = {
    "beam": beam_gate, "afmoe": afmoe_gate, "laguna": laguna_gate, "lfm3": lfm3_gate,
    **dict.fromkeys(["step3p5", "step3p7"], step3p7_gate),
    # Muse Glimmer (MuseGlimmerTextAttention): AFMoE's, the output [batch, seq, heads * head_dim] times
    # sigmoid(gate_proj(hidden_states)), hidden -> heads x head_dim
    **dict.fromkeys(["muse_glimmer_text", "muse_glimmer", "muse_spark_text", "muse_spark"], afmoe_gate),
    "neomme": neomme_gate,
    **dict.fromkeys(["inkling2_text", "inkling2", "inkling2_loop_text", "inkling2_loop"], inkling2_gate)}
"""Model types of :data:`OUTPUT_GATES` whose attention has q/k/v projections, each with what gives the gate's
``Family.head_rows`` and ``Family.head_vectors`` from its attention module (read off transformers 5.24's forwards,
each function's docstring): head h's gate comes from its own rows (and entries) and multiplies head h's output
only. Empty rows where a module has no gate (LFM3 without ``use_attention_gate``); a gate that discovery sees where
the function gives no rows is refused (:func:`headlab.adapters.attention_blocks`)."""

OUTPUT_GATES_REFUSED: dict[str, str] = {}
"""Model types with an output gate (see :data:`OUTPUT_GATES`) refused for a reason of their own (none since session 40:
Inkling2 and Inkling2-Loop, listed from session 28 to 39, are analysed and masked)."""

def inkling2_loop_depths(config: Any) -> list[int] | None:
    """The decoder layer (its index in ``layers``) run at each depth of Inkling2-Loop's forward, in order
    (``Inkling2LoopTextModel.forward``, transformers 5.24): the layers before ``loop_layer_index_start``, then
    ``loop_num_passes`` passes over the loop layers (``loop_layer_index_start`` .. ``loop_layer_index_end``), then the
    rest; None where the config does not give them as ints."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    values = [getattr(text, name, None) for name in (
        "loop_layer_index_start", "loop_layer_index_end", "loop_num_passes", "num_hidden_layers")]
    numbers = [v for v in values if isinstance(v, int) and not isinstance(v, bool)]
    if len(numbers) != len(values):
        return None
    start, end, passes, layers = numbers
    return [*range(start), *list(range(start, end)) * passes, *range(end, layers)]


LOOPED_LAYERS: dict[str, Callable[[Any], list[int] | None]] = dict.fromkeys(
    ["inkling2_loop_text", "inkling2_loop"], inkling2_loop_depths)
"""Model types whose forward runs some decoder layers several times (Inkling2-Loop's loop layers, each pass with
messages of the previous one mixed into its input through gates, and its own cache layers): with the decoder layer
run at each depth, in forward order. One attention module is then one block per depth it runs at (ALBERT's shared
layers: ``AttentionBlock.application``), numbered by depth as transformers' ``output_attentions`` lists its calls;
capture, masking and gates act on that call only. A module run at one depth stays one block, numbered by its depth."""

PROBE_FAILURES: dict[str, str] = dict.fromkeys(
    ["inkling2_text", "inkling2", "inkling2_loop_text", "inkling2_loop"],
    "Inkling2 keeps modules in float32 (its _keep_in_fp32_modules_strict: the routers' weights, the short "
    "convolutions, the block attention residuals' queries) and its forward mixes their float32 products with the "
    "other weights' dtype: a model converted whole (model.double()) fails there; load it in float64 with "
    "transformers' dtype= (from_pretrained, from_config), which keeps them in float32")
"""Model types found only by discovery's probe forward: where it fails, the model is refused with this (what makes
their forward fail as built), not guessed by the names of its projections (before: "cannot read the output width of
Inkling2QueryProjection")."""

PRUNING_REFUSED: dict[str, str] = {}
"""Model types whose attention is analysed and masked but not physically pruned, with why (``Family.prune_refused``
of every block discovery finds in them): refused before any work. None since session 41: Inkling2 and Inkling2-Loop,
listed in session 40, are pruned (their per-head parts: :data:`QKV_HEAD_ROWS`, :data:`HEAD_TABLES`,
:data:`HEAD_COUNT_HOLDERS`, :data:`KV_CHANNEL_CONVS`, :data:`KV_DYNAMIC_CONVS`, :data:`QKV_APART`; a loop layer's
module, run at several depths, as ALBERT's shared module: the same heads removed at each depth,
:func:`headlab.surgery.check_shared_plan`)."""

LRP_REFUSED: dict[str, str] = {}
"""Model types whose attention is analysed (and masked) but whose LRP is refused before any work, with why
(``Family.lrp_refused`` of every block discovery finds in them). None since session 42: Inkling2 and Inkling2-Loop,
listed from session 40 to 41 (no rule for their block attention residuals and dynamic key/value short convolutions),
have their rules (:mod:`headlab.importance.mixer_rules.inkling2`)."""


def unpruned_latent_reason(family: Family, core: Any) -> str | None:
    """Why physical pruning leaves a multi-head latent attention (a ``kv_b_proj``) that
    :data:`LATENT_ATTENTION` gave no ``head_rows`` alone; None for any other block."""
    if family.head_rows or getattr(core, "kv_b_proj", None) is None:
        return None
    return ("multi-head latent attention: a kv_b_proj in a forward headlab has not checked against DeepSeek-V3's views "
            "and splits (the model types of headlab.adapters.families.LATENT_ATTENTION, laid out so, are pruned)")


ATTENTION_SUBLAYERS: dict[str, int] = {"longcat_flash": 2}
"""Model types whose decoder layers each hold several attention modules in a list (LongCat-Flash's
``layers.N.self_attn.i``, i = 0, 1): block ``N * count + i``, transformers' own number of that attention
(its ``layer_idx``, its cache layer and its place in ``output_attentions``), not the path's last number
(which gave every layer's first attention the number 0)."""


QKV_LAYOUTS = {
    "q|k|v": "every query head, then every key head, then every value head (GPT-2, Phi-3, multi-query "
             "GPT-BigCode and Falcon); key/value widths may be narrower (grouped or multi-query attention)",
    "per-head": "for each head h: [q_h | k_h | v_h] (GPT-NeoX, Bloom, Falcon and GPT-BigCode without multi-query)",
    "grouped": "for each key/value head: [its group's query heads | k | v] (Falcon's new decoder architecture)",
    "mp-groups": "in groups of consecutive heads (``Family.qkv_groups_attr`` of them, CodeGen's mp_num model-parallel "
                 "shards): for each group [its query heads | their values | their keys], as many key/value heads as "
                 "query heads (CodeGen)",
}
"""The fused projection layouts headlab knows."""


def _seq2seq(prefix_enc: str, prefix_dec: str) -> tuple[tuple[str, str], ...]:
    return (
        ("enc_self", rf"(?:^|\.){prefix_enc}\.(\d+)\.self_attn$"),
        ("dec_self", rf"(?:^|\.){prefix_dec}\.(\d+)\.self_attn$"),
        ("dec_cross", rf"(?:^|\.){prefix_dec}\.(\d+)\.encoder_attn$"),
    )


BART_LIKE = Family(
    name="bart-like",
    patterns=_seq2seq(r"encoder\.layers", r"decoder\.layers"),
    q="q_proj", k="k_proj", v="v_proj", o="out_proj",
    d_head_attr="head_dim",
    head_count_attrs=("num_heads",),
)

BERT_LIKE = Family(
    name="bert-like",
    patterns=(("enc_self", r"(?:^|\.)encoder\.layer\.(\d+)\.attention$"),),
    q="self.query", k="self.key", v="self.value", o="output.dense",
    d_head_attr="attention_head_size",
    core="self",
    head_count_attrs=("num_attention_heads",),
)

DISTILBERT = Family(
    name="distilbert",
    patterns=(("enc_self", r"(?:^|\.)transformer\.layer\.(\d+)\.attention$"),),
    q="q_lin", k="k_lin", v="v_lin", o="out_lin",
    d_head_attr="attention_head_size",
    head_count_attrs=("n_heads",),
)

GPT_NEO = Family(
    # GPTNeoSelfAttention (transformers 5.24), outside the attention interface, nested as h.N.attn.attention:
    # q/k/v_proj viewed [batch, seq, num_heads, head_dim]; q @ k^T in float32 with no 1/sqrt(d) scaling, the causal
    # (global) or windowed (local, config.window_size) buffer ``bias`` ([1, 1, pos, pos], shared by all heads),
    # + attention_mask, softmax, cast to the values' dtype; returns (out_proj(merged heads), weights) always.
    # GPTNeoFlashAttention2 returns no weights: refused (CORE_CLASSES_REFUSED)
    name="gpt-neo",
    patterns=(("dec_self", r"(?:^|\.)h\.(\d+)\.attn\.attention$"),),
    q="q_proj", k="k_proj", v="v_proj", o="out_proj",
    d_head_attr="head_dim",
    head_count_attrs=("num_heads",),
)

GPT2 = Family(
    name="gpt2",
    patterns=(("dec_self", r"(?:^|\.)h\.(\d+)\.attn$"),),
    never_fed=(("dec_cross", r"(?:^|\.)h\.(\d+)\.crossattention$"),),  # q_attn, and keys|values fused in c_attn
    q=None, k=None, v=None, o="c_proj", qkv="c_attn",
    d_head_attr="head_dim",
    head_count_attrs=("num_heads",),
)

T5 = Family(
    name="t5",
    patterns=(
        ("enc_self", r"(?:^|\.)encoder\.block\.(\d+)\.layer\.0\.SelfAttention$"),
        ("dec_self", r"(?:^|\.)decoder\.block\.(\d+)\.layer\.0\.SelfAttention$"),
        ("dec_cross", r"(?:^|\.)decoder\.block\.(\d+)\.layer\.1\.EncDecAttention$"),
    ),
    q="q", k="k", v="v", o="o",
    d_head_attr="key_value_proj_dim",
    probs_index=2,
    head_count_attrs=("n_heads",),
    shared_bias="t5",
)

# UMT5: T5's layout, but every self-attention layer computes its own relative position bias
# (UMT5Attention.compute_bias from its own relative_attention_bias, passed as position_bias to the attention
# function), not the stack's first layer for all: no bias handed between layers, one column per head to slice
UMT5 = replace(T5, name="umt5", probs_index=1, head_columns=("relative_attention_bias",),  # returns (output, weights)
               shared_bias="")  # each layer its own bias: none handed on


def longt5_local_probs(core: Any, args: tuple, kwargs: dict, output: Any) -> Any:
    """LongT5's dense ``[batch, heads, n, n]`` map from ``LongT5LocalAttention``'s output (transformers 5.24, its
    forward read): ``output[2]`` is ``[batch, blocks, heads, block_len, 3 * block_len]``, the tokens split into blocks
    of ``block_len = local_radius + 1`` (the last padded), block ``b``'s queries attending over blocks ``b - 1, b,
    b + 1`` (zero blocks padding both ends). Query ``q`` of block ``q // block_len`` sees key ``k`` at column
    ``k - (q // block_len - 1) * block_len`` of its window; keys outside the window, farther than local_radius, in the
    padding or masked have a -1e10 score, so probability exactly 0 (a real query always sees itself), and the
    window's columns put in place give every real query's whole row. A padded query's (every key masked) is uniform
    over its window, part of it in the padding: its row here, cut to the n tokens, does not sum to one. The softmax
    is float32 whatever the model's dtype (``softmax(scores.float())``)."""
    hidden = args[0] if args else kwargs["hidden_states"]
    return _windows_in_place(output[2], int(hidden.shape[1]))


def _windows_in_place(blocked: Any, n: int) -> Any:
    """The dense ``[batch, heads, n, n]`` map of LongT5's blocked local probabilities ``[batch, blocks, heads,
    block_len, 3 * block_len]`` (:func:`longt5_local_probs`)."""
    import torch

    batch, blocks, heads, block_len, width = blocked.shape
    rows = blocked.permute(0, 2, 1, 3, 4).reshape(batch, heads, blocks * block_len, width)[:, :, :n]
    positions = torch.arange(n, device=blocked.device)
    column = positions[None, :] - (positions[:, None] // block_len - 1) * block_len  # [query, key]
    inside = (column >= 0) & (column < width)
    dense = rows.gather(-1, column.clamp(0, width - 1).expand(batch, heads, n, n))
    return torch.where(inside, dense, torch.zeros((), dtype=blocked.dtype, device=blocked.device))


def longt5_transient_global_probs(core: Any, args: tuple, kwargs: dict, output: Any) -> Any:
    """LongT5's transient-global encoder map over the tokens from ``LongT5TransientGlobalAttention``'s output
    (transformers 5.24, its forward read): ``output[2]`` is ``[batch, blocks, heads, block_len, 3 * block_len +
    global_seq_len]``, one softmax per token over [its local window (three blocks of ``block_len``, as
    LongT5LocalAttention's) | the side keys], a side key per global block of ``global_block_size`` tokens (through the
    layer's k and v, of ``global_input_layer_norm`` of the sum of that block's states). The window's columns are put in
    place as :func:`longt5_local_probs` does; the side keys are not tokens: their share is left out, as a sink's is,
    so a real token's row sums to one less its mass on them."""
    hidden = args[0] if args else kwargs["hidden_states"]
    blocked = output[2]
    return _windows_in_place(blocked[..., :3 * blocked.shape[3]], int(hidden.shape[1]))


# LongT5 (LongT5ForConditionalGeneration, LongT5EncoderModel; transformers 5.24, models/longt5) with
# encoder_attention_type="local": the encoder's encoder.block.N.layer.0.LocalSelfAttention is LongT5LocalAttention,
# T5's q/k/v/o without the attention interface (einsum over blocks of block_len = local_radius + 1 tokens, each
# attending over 3 blocks, masked to local_radius each side), returning (output, position_bias, probabilities) with
# output_attentions (its 4th argument, passed by keyword), the probabilities blocked (read by longt5_local_probs).
# Its first layer computes the relative position bias (compute_bias(block_len)) and adds the mask to it; the stack
# hands that sum to the others. Its forward views the heads with n_heads and merges them with inner_dim (kept in step
# by pruning). The decoder is T5's (LongT5Attention through the attention interface, its bias shared as T5's): a part.
# With encoder_attention_type="transient-global" (google/long-t5-tglobal-*; session 41, branch ltg) the encoder's
# encoder.block.N.layer.0.TransientGlobalSelfAttention is LongT5TransientGlobalAttention (a part): the local attention's
# layout and arguments, each token attending over [its local window | one side key per global block of
# global_block_size tokens]; the side keys and values are the layer's own k and v of global_input_layer_norm(the sum of
# the block's input states, a token at the end of no full block counted in the block before), side scores biased by
# global_relative_attention_bias and masked to the row's real global blocks (0 or -1e10). The first layer hands on the
# whole [local | side] bias, mask folded in, [batch, blocks, heads, block_len, 3 * block_len + global blocks]
# (shared_bias "transient-global": a pruned stack recomputes it from the first layer's two tables, kept whole, sliced to
# each layer's heads). Masking and pruning at o's input remove a head from the tokens' and the side keys' values alike
# (o runs once); longt5_transient_global_probs leaves the side keys' share out. LRP: q and k detached hold both scores
# constant; a side value is v of an RMS norm (its factor held constant) of a sum of the layer's input states, so
# relevance reaches the tokens through linear maps, exactly.
LONGT5_DECODER = replace(T5, name="longt5-decoder", patterns=T5.patterns[1:])
LONGT5_TRANSIENT_GLOBAL = replace(
    T5,
    name="longt5-transient-global",
    patterns=(("enc_self", r"(?:^|\.)encoder\.block\.(\d+)\.layer\.0\.TransientGlobalSelfAttention$"),),
    probs_argument=("output_attentions", 3),
    probs_reader=longt5_transient_global_probs,
    width_attrs=("inner_dim",),
    shared_bias="transient-global",
    input_readers=("global_input_layer_norm",),
)
LONGT5 = replace(
    T5,
    name="longt5",
    patterns=(("enc_self", r"(?:^|\.)encoder\.block\.(\d+)\.layer\.0\.LocalSelfAttention$"),),
    probs_argument=("output_attentions", 3),
    probs_reader=longt5_local_probs,
    width_attrs=("inner_dim",),
    shared_bias="local",
    parts=(LONGT5_DECODER, LONGT5_TRANSIENT_GLOBAL),
)

LLAMA_LIKE = Family(
    name="llama-like",
    patterns=(("dec_self", r"(?:^|\.)layers\.(\d+)\.self_attn$"),),
    q="q_proj", k="k_proj", v="v_proj", o="o_proj",
    d_head_attr="head_dim",
    kv_groups_attr="num_key_value_groups",
)

# Qwen3-Next and Qwen3.5 (dense and MoE): their full-attention layers are Llama-like with per-head
# q/k RMS norms, and q_proj emits per head [query | gate]: o_proj(attn_output * sigmoid(gate)).
# Their linear-attention layers (Gated DeltaNet, ``linear_attn``) have no heads headlab analyses:
# the pattern finds ``self_attn`` only.
QWEN3_NEXT = replace(LLAMA_LIKE, name="qwen3-next", query_gate=True)

# Qwen4-Exp's text model (Qwen4ExpTextAttention, transformers 5.24): Qwen3-Next's attention (q_proj viewed [.., -1,
# 2 x head_dim] and chunked [query | gate], per-head q/k norms, o_proj(attn_output * sigmoid(gate))) behind a QSA
# indexer of its own (index_qk_proj, from the layer's input) whose selection is folded into the mask before the
# attention function: no head's rows reach it. Hyper-connections and n-gram embeddings act around the layer.
QWEN4_EXP = replace(QWEN3_NEXT, name="qwen4-exp", input_readers=("indexer",))

GPT_NEOX = Family(
    name="gpt-neox",
    patterns=(("dec_self", r"(?:^|\.)layers\.(\d+)\.attention$"),),
    q=None, k=None, v=None, o="dense", qkv="query_key_value", qkv_layout="per-head",
    d_head_attr="head_size",
)

PHI3 = Family(
    name="phi3",
    patterns=(("dec_self", r"(?:^|\.)layers\.(\d+)\.self_attn$"),),
    q=None, k=None, v=None, o="o_proj", qkv="qkv_proj",
    d_head_attr="head_dim",
    kv_groups_attr="num_key_value_groups",
    config_head_count_attrs=("num_attention_heads",),
)

PHI = Family(
    name="phi",
    patterns=(("dec_self", r"(?:^|\.)layers\.(\d+)\.self_attn$"),),
    q="q_proj", k="k_proj", v="v_proj", o="dense",
    d_head_attr="head_dim",
    kv_groups_attr="num_key_value_groups",
)

BLOOM = Family(
    name="bloom",
    patterns=(("dec_self", r"(?:^|\.)h\.(\d+)\.self_attention$"),),
    q=None, k=None, v=None, o="dense", qkv="query_key_value", qkv_layout="per-head",
    d_head_attr="head_dim",
    head_count_attrs=("num_heads",),
    residual_argument=("residual", 1),
)

MPT = Family(
    # MptAttention (transformers 5.24), outside the attention interface: Wqkv(x).chunk(3) -> [all q | all k | all v],
    # each reshaped [batch, seq, n_heads, head_dim]; scores + position_bias (ALiBi built by MptModel for
    # config.n_heads, [heads, 1, max_seq_len], its last keys taken), masked, softmax; returns (out_proj(context),
    # attn_weights) whatever output_attentions says
    name="mpt",
    patterns=(("dec_self", r"(?:^|\.)blocks\.(\d+)\.attn$"),),
    q=None, k=None, v=None, o="out_proj", qkv="Wqkv", qkv_layout="q|k|v",
    d_head_attr="head_dim",
    head_count_attrs=("n_heads",),
    alibi_argument="position_bias",
)


DEBERTA_V2 = Family(
    name="deberta-v2",
    patterns=(("enc_self", r"(?:^|\.)encoder\.layer\.(\d+)\.attention$"),),
    q="self.query_proj", k="self.key_proj", v="self.value_proj", o="output.dense",
    d_head_attr="attention_head_size",
    core="self",
    head_count_attrs=("num_attention_heads",),
    probs_argument=("output_attentions", 2),
)

def deberta(config: Any) -> Family:
    """DeBERTa v1 (DebertaForMaskedLM, transformers 5.24: ``DisentangledSelfAttention``, outside the attention
    interface). ``in_proj`` (no bias) is viewed ``[batch, seq, heads, 3 * d]`` and chunked: per head ``[q | k | v]``;
    ``q_bias`` and ``v_bias`` (``heads * d``, head-major) are added to the queries and values after it. With
    ``relative_attention`` the relative embeddings (shared by every head) go through ``pos_proj`` (c2p, no bias) and
    ``pos_q_proj`` (p2c), each viewed per head as the queries are: head rows, sliced with the heads and held constant
    by LRP with the queries and keys. It returns (context, probs) only with ``output_attentions`` (position 2).
    Talking heads (``talking_head``: ``head_logits_proj``/``head_weights_proj`` mix the heads' logits and weights)
    are refused by :data:`UNSUPPORTED_CONFIGS`."""
    kinds = getattr(config, "pos_att_type", None) or () if getattr(config, "relative_attention", False) else ()
    rows = tuple((path, ("attention_head_size",)) for kind, path in (("c2p", "self.pos_proj"), ("p2c", "self.pos_q_proj"))
                 if kind in kinds)
    return replace(DEBERTA_V2, name="deberta", q=None, k=None, v=None, qkv="self.in_proj", qkv_layout="per-head",
                   head_rows=rows, head_biases=(("self.q_bias", "q"), ("self.v_bias", "v")))


MODERNBERT = Family(
    name="modernbert",
    patterns=(("enc_self", r"(?:^|\.)layers\.(\d+)\.attn$"),),
    q=None, k=None, v=None, o="Wo", qkv="Wqkv",  # view(..., 3, heads, d): [q | k | v]
    d_head_attr="head_dim",
)


# Attention classes found by discovery whose fused projection's layout is read off their forwards (transformers
# 5.24), entries of FUSED_ATTENTION_CLASSES only (their models have no table entry: discovery finds the blocks).
CODEGEN = Family(
    # CodeGenAttention: qkv_proj(x).view(..., -1, 3 * local_dim) with local_dim = embed_dim // mp_num (mp_num 4, set
    # in __init__, not from the config), split (query, value, key), each reshaped (..., -1, head_dim): group g holds
    # [q | v | k] of heads g * H / mp_num ..; partial rotary (rotary_dim) per head
    name="codegen",
    patterns=(("dec_self", r"(?:^|\.)h\.(\d+)\.attn$"),),
    q=None, k=None, v=None, o="out_proj", qkv="qkv_proj", qkv_layout="mp-groups", qkv_groups_attr="mp_num",
    d_head_attr="head_dim",
    width_attrs=("embed_dim",),
)

PERSIMMON = Family(
    # PersimmonAttention: query_key_value(x).view(batch, seq, num_heads, 3, head_dim): [q_h | k_h | v_h] per head
    # (Bloom's); its q_layernorm and k_layernorm normalise each head's head_dim alone, with weights all heads share
    name="persimmon",
    patterns=(("dec_self", r"(?:^|\.)layers\.(\d+)\.self_attn$"),),
    q=None, k=None, v=None, o="dense", qkv="query_key_value", qkv_layout="per-head",
    d_head_attr="head_dim",
    head_count_attrs=("num_heads",),
)

DBRX = Family(
    # DbrxAttention: Wqkv(x).clamp(-clip_qkv, clip_qkv) split [hidden_size | kv heads x d | kv heads x d]: [q | k | v]
    # with grouped key/value heads; hidden_size (the query width) is what the split reads
    name="dbrx",
    patterns=(("dec_self", r"(?:^|\.)blocks\.(\d+)\.norm_attn_norm\.attn$"),),
    q=None, k=None, v=None, o="out_proj", qkv="Wqkv", qkv_layout="q|k|v",
    d_head_attr="head_dim",
    kv_groups_attr="num_key_value_groups",
    width_attrs=("hidden_size",),
)


def albert_applications(config: Any) -> list[tuple[int, ...]]:
    """(group, layer within the group) of each application, in forward order: AlbertTransformer runs
    group ``int(i / (num_hidden_layers / num_hidden_groups))`` at depth ``i``, each group its
    ``inner_group_num`` layers in turn (transformers' modeling_albert.py)."""
    depths, groups = config.num_hidden_layers, config.num_hidden_groups
    return [(int(i / (depths / groups)), j) for i in range(depths) for j in range(config.inner_group_num)]


ALBERT = Family(
    name="albert",
    patterns=(("enc_self", r"(?:^|\.)albert_layer_groups\.(\d+)\.albert_layers\.(\d+)\.attention$"),),
    q="query", k="key", v="value", o="dense",
    d_head_attr="attention_head_size",
    head_count_attrs=("num_attention_heads",),
    applications=albert_applications,
    scope="albert_layer_groups",
    output_norms=("LayerNorm",),
)


def _falcon(layout: str) -> Family:
    return Family(
        name=f"falcon ({layout})",
        patterns=(("dec_self", r"(?:^|\.)h\.(\d+)\.self_attention$"),),
        q=None, k=None, v=None, o="dense", qkv="query_key_value", qkv_layout=layout,
        d_head_attr="head_dim",
        head_count_attrs=("num_heads",),
    )


def _gpt_bigcode(layout: str) -> Family:
    return Family(
        name=f"gpt-bigcode ({layout})",
        patterns=(("dec_self", r"(?:^|\.)h\.(\d+)\.attn$"),),
        never_fed=(("dec_cross", r"(?:^|\.)h\.(\d+)\.crossattention$"),),  # as GPT-2's
        q=None, k=None, v=None, o="c_proj", qkv="c_attn", qkv_layout=layout,
        d_head_attr="head_dim",
        head_count_attrs=("num_heads",),
        kv_groups_attr="num_key_value_groups",
        width_attrs=("embed_dim",), kv_head_count_attrs=("kv_heads",), kv_width_attrs=("kv_dim",),
    )


def falcon(config: Any) -> Family:
    """Falcon's layout follows its config: grouped (new decoder architecture), multi-query, or per head."""
    if getattr(config, "new_decoder_architecture", False):
        return _falcon("grouped")
    return _falcon("q|k|v" if getattr(config, "multi_query", False) else "per-head")


BERT_LIKE_DECODER = Family(
    name="bert-like-decoder",
    patterns=(("dec_self", r"(?:^|\.)encoder\.layer\.(\d+)\.attention$"),
              ("dec_cross", r"(?:^|\.)encoder\.layer\.(\d+)\.crossattention$")),
    q="self.query", k="self.key", v="self.value", o="output.dense",
    d_head_attr="attention_head_size",
    core="self",
    head_count_attrs=("num_attention_heads",),
)


# GIT (GitForCausalLM, transformers 5.24): BERT's post-norm layers over [image tokens | text], the text causal
# (create_causal_mask with the image tokens as one bidirectional block); GitSelfAttention computes its own
# softmax(q k^T / sqrt(d) + mask) and returns (context, probs); GitAttention returns output(context, input) only.
# Its image encoder (a CLIP tower, run on pixel_values only) is idle for token ids.
GIT = Family(
    name="git",
    patterns=(("dec_self", r"(?:^|\.)encoder\.layer\.(\d+)\.attention$"),),
    towers=(("enc_self", r"(?:^|\.)image_encoder\.vision_model\.encoder\.layers\.(\d+)\.self_attn$", "out_proj"),),
    q="self.query", k="self.key", v="self.value", o="output.dense",
    d_head_attr="attention_head_size",
    core="self",
    head_count_attrs=("num_attention_heads",),
)


# XGLM (XGLMForCausalLM, transformers 5.24): XGLMAttention, outside the attention interface, computes
# softmax(q / sqrt(d) k^T + mask) itself (bmm over [batch * num_heads, ...]) and returns (out_proj(merged), weights)
# always; it reshapes the merged heads to ``embed_dim`` (kept in step by pruning). Its encoder_attn (with
# add_cross_attention) attends to encoder_hidden_states, which headlab never passes: idle.
XGLM = Family(
    name="xglm",
    patterns=(("dec_self", r"(?:^|\.)layers\.(\d+)\.self_attn$"),),
    never_fed=(("dec_cross", r"(?:^|\.)layers\.(\d+)\.encoder_attn$"),),
    q="q_proj", k="k_proj", v="v_proj", o="out_proj",
    d_head_attr="head_dim",
    head_count_attrs=("num_heads",),
    width_attrs=("embed_dim",),
)


# MPNet (MPNetForMaskedLM, transformers 5.24): encoder.layer.N.attention.attn (MPNetSelfAttention), outside the
# attention interface: q/k/v viewed [batch, seq, -1, attention_head_size], softmax(q k^T / sqrt(d) + position_bias +
# mask), o(merged heads) inside it; returns the probabilities only with output_attentions (its 4th argument,
# passed by keyword). position_bias ([batch, heads, q, k]) is computed once by MPNetEncoder from its one
# relative_attention_bias (buckets x config heads) and handed to every layer by position: a pruned layer gets the
# columns of the heads it kept (alibi_argument's hook, as MPT's ALiBi), the shared table stays whole.
MPNET = Family(
    name="mpnet",
    patterns=(("enc_self", r"(?:^|\.)encoder\.layer\.(\d+)\.attention\.attn$"),),
    q="q", k="k", v="v", o="o",
    d_head_attr="attention_head_size",
    head_count_attrs=("num_attention_heads",),
    width_attrs=("all_head_size",),
    probs_argument=("output_attentions", 3),
    alibi_argument="position_bias",
)


def ibert_probs(core: Any, args: tuple, kwargs: dict, output: Any) -> Any:
    """I-BERT's probabilities: ``IBertSelfAttention`` returns ``((context, probs), (context's scaling factor,
    probs'))`` with ``output_attentions`` (transformers 5.24), the map at ``output[0][1]``."""
    return output[0][1]


# I-BERT with quant_mode=False (IBertForMaskedLM, transformers 5.24): BERT's layout and arithmetic (QuantLinear is
# F.linear, IntSoftmax softmax, IntLayerNorm a layer norm over the last axis, QuantAct the identity or the residual
# sum), outside the attention interface, every module taking and returning (value, scaling factor) pairs, the
# factors None. quant_mode=True is refused by :data:`UNSUPPORTED_CONFIGS`.
IBERT = Family(
    name="ibert",
    patterns=(("enc_self", r"(?:^|\.)encoder\.layer\.(\d+)\.attention$"),),
    q="self.query", k="self.key", v="self.value", o="output.dense",
    d_head_attr="attention_head_size",
    core="self",
    head_count_attrs=("num_attention_heads",),
    probs_argument=("output_attentions", 3),
    probs_reader=ibert_probs,
)


def squeezebert_probs(core: Any, args: tuple, kwargs: dict, output: Any) -> Any:
    """SqueezeBERT's probabilities: ``SqueezeBertSelfAttention`` returns a dict, with ``output_attentions`` its
    ``attention_score`` (q k^T / sqrt(d) + mask, BEFORE the softmax: what transformers 5.24 hands out as SqueezeBERT's
    ``attentions``), and its probabilities are ``self.softmax`` (``nn.Softmax(dim=-1)``) of exactly that tensor: the
    same softmax on the same scores, recomputed here."""
    import torch

    return torch.softmax(output["attention_score"], dim=-1)


# SqueezeBERT (SqueezeBertForMaskedLM, transformers 5.24): encoder.layers.N (SqueezeBertModule) holds ``attention``
# (SqueezeBertSelfAttention: query/key/value 1x1 Conv1d over [batch, channels, seq], grouped by q_groups, k_groups,
# v_groups; viewed [batch, heads, d, seq]: head h owns output channels hd .. hd + d) and ``post_attention``
# (ConvDropoutLayerNorm: a 1x1 Conv1d grouped by post_attention_groups, the residual, a layer norm over channels):
# post_attention.conv1d is the output projection, its input the heads' outputs, channels-first. Outside the attention
# interface; the attention returns a dict, its scores (not probabilities) only with output_attentions (position 2).
SQUEEZEBERT = Family(
    name="squeezebert",
    patterns=(("enc_self", r"(?:^|\.)encoder\.layers\.(\d+)$"),),
    q="attention.query", k="attention.key", v="attention.value", o="post_attention.conv1d",
    d_head_attr="attention_head_size",
    core="attention",
    head_count_attrs=("num_attention_heads",),
    width_attrs=("all_head_size",),
    probs_argument=("output_attentions", 2),
    probs_reader=squeezebert_probs,
    channels_first=True,
)


def longformer_probs(core: Any, args: tuple, kwargs: dict, output: Any) -> Any:
    """Longformer's dense ``[batch, heads, seq, seq]`` map from ``LongformerSelfAttention``'s output (transformers
    5.24, its forward read): ``output[1]`` is ``[batch, seq, heads, G + 2w + 1]``, the probabilities over the
    batch's G global key slots (the i-th global position of each sequence, in order; a sequence with fewer has
    slots of probability 0) then over keys ``q - w .. q + w``; outside the band, and at a global key inside it
    (masked there: it is counted in its slot), a query's probability is exactly 0 (a -inf or finfo.min score), so
    scattering the band and the slots into place gives every query's whole row. A global query's row in the band
    was set to 0; its probabilities are ``output[2]``, ``[batch, heads, G, seq]`` (from query_global/key_global,
    weighing value_global's values). A masked query's row is 0. The softmax is float32 whatever the model's dtype."""
    import torch

    band = output[1]
    is_global = kwargs.get("is_index_global_attn", args[3] if len(args) > 3 else None)
    batch, seq, heads, width = band.shape
    if is_global is None or not bool(is_global.any()):
        is_global = None
    slots = 0 if is_global is None else int(is_global.sum(dim=1).max())
    window = (width - slots - 1) // 2  # one_sided_attn_window_size
    positions = torch.arange(seq, device=band.device)
    offset = positions[None, :] - positions[:, None] + window  # [query, key]: the key's column in the band
    inside = (offset >= 0) & (offset <= 2 * window)
    local = band[..., slots:].gather(-1, offset.clamp(0, 2 * window)[None, :, None, :].expand(batch, seq, heads, seq))
    dense = torch.where(inside[None, :, None, :], local, torch.zeros((), dtype=band.dtype, device=band.device))
    if is_global is not None:
        which, where = is_global.nonzero(as_tuple=True)  # ordered by sequence, then position: slot = rank
        slot = is_global.long().cumsum(dim=1)[which, where] - 1
        by_key = dense.permute(0, 3, 1, 2)  # [batch, key, query, heads], a view
        by_key.index_put_((which, where), band[which, :, :, slot], accumulate=True)  # 0 there before
        dense[which, where] = output[2][which, :, slot].to(dense.dtype)  # the global queries' rows
    return dense.permute(0, 2, 1, 3)


# Longformer (LongformerForMaskedLM, transformers 5.24): encoder.layer.N.attention, BERT's layout
# (self.query/key/value, output.dense) with a second set of projections for global attention
# (self.query_global/key_global/value_global, head-major as the first: viewed [.., num_heads, head_dim]), outside the
# attention interface: LongformerSelfAttention returns (output, band probabilities, global probabilities) only with
# output_attentions (its 6th argument, passed by keyword). LongformerModel pads the tokens to a multiple of
# attention_window first. A head's output columns carry both its local and its global queries' outputs (the latter
# overwrite the former's rows), so masking there is exact. Physical pruning slices the global projections' rows with
# the heads (``head_rows``); the forward reshapes the heads' output to the width of its input (reshape(seq_len,
# batch_size, embed_dim), embed_dim read off hidden_states), so a pruned layer takes PRUNED_FORWARDS["longformer"],
# which merges num_heads * head_dim (``embed_dim``, the input's width, stays: the global queries gather hidden
# states of that width).
_GLOBAL = ("query_global", "key_global", "value_global")
LONGFORMER = Family(
    name="longformer",
    patterns=(("enc_self", r"(?:^|\.)encoder\.layer\.(\d+)\.attention$"),),
    q="self.query", k="self.key", v="self.value", o="output.dense",
    d_head_attr="head_dim",
    core="self",
    head_count_attrs=("num_heads",),
    probs_argument=("output_attentions", 5),
    probs_reader=longformer_probs,
    padded_by="LongformerModel",
    # the global projections, head-major: physical pruning slices their rows with the heads
    head_rows=tuple((f"self.{name}", ("head_dim",)) for name in _GLOBAL),
    # LRP holds the head rows constant but value_global (query_global and key_global make the global attention's
    # weights, which weigh value_global's values linearly, as the local weights weigh value's)
    head_row_values=("self.value_global",),
    pruned_forward="longformer",
    # LongformerSelfAttention transposes hidden_states to [seq, batch, d] before every projection
    seq_major=tuple(f"self.{name}" for name in ("query", "key", "value", *_GLOBAL)),
)


# ConvBERT (ConvBertForMaskedLM, transformers 5.24, models/convbert): encoder.layer.N.attention, BERT's names
# (self.query/key/value, output.dense), outside the attention interface. ConvBertSelfAttention has num_attention_heads
# // head_ratio softmax heads (1 where that is 0) of attention_head_size = (hidden_size / heads) // 2: query/key/value
# viewed [.., heads, d], softmax(q k^T / sqrt(d) + mask), returning (context, probs) always (its mask bidirectional
# whatever is_decoder says: create_bidirectional_mask). Beside them as many span-based dynamic convolution heads: kernels
# softmax(conv_kernel_layer(query(x) * key_conv_attn_layer(x))) (every attention head's query rows, all heads'
# channels), applied to conv_out_layer(x) over conv_kernel_size positions. output.dense reads [attention heads' outputs
# (heads x d) | convolution heads' outputs (all_head_size)]: masking and gating act on a head's columns among the
# first heads x d (what transformers' old head_mask did: it multiplied attention_probs), the convolution heads' columns
# passed through untouched. ConvBertModel never passes encoder states: a decoder's crossattention is never fed. Its
# convolutions have no padding mask in transformers: in a padded batch a row's edge tokens would read the padding's
# states (where the row alone reads zeros); the hooks installed on the model (headlab.adapters.convbert) zero the
# padded positions where the convolutions read them, so each row of a padded batch is the row alone.
def _install_convbert_padding_mask(model: Any) -> None:
    from headlab.adapters.convbert import install_padding_mask

    install_padding_mask(model)


CONVBERT = Family(
    name="convbert",
    patterns=(("enc_self", r"(?:^|\.)encoder\.layer\.(\d+)\.attention$"),),
    never_fed=(("dec_cross", r"(?:^|\.)encoder\.layer\.(\d+)\.crossattention$"),),
    q="self.query", k="self.key", v="self.value", o="output.dense",
    d_head_attr="attention_head_size",
    core="self",
    head_count_attrs=("num_attention_heads",),
    columns_after_heads="conv_out_layer.out_features",
    # LRP: the convolution heads' rule, headlab.importance.mixer_rules.convbert (their taps held constant).
    # Pruning: every head's query rows feed the convolution heads' kernels, so the query stays whole, the kept heads'
    # rows first, key_conv_attn_layer's and conv_kernel_layer's query channels reordered with them; key, value and
    # output.dense's head columns sliced; a layer with no attention head left keeps its convolution heads
    query_channels=(("key_conv_attn_layer.pointwise.weight", 0), ("key_conv_attn_layer.bias", 0),
                    ("conv_kernel_layer.weight", 1)),
    kept_whole=("key_conv_attn_layer", "conv_kernel_layer", "conv_out_layer"),
    pruned_forward="convbert",
    install=_install_convbert_padding_mask,
)


# LED (LEDForConditionalGeneration, transformers 5.24, models/led): two layouts. The encoder's layers.N.self_attn is
# LEDEncoderAttention, Longformer's attention (longformer_self_attn: LEDEncoderSelfAttention, a copy of
# LongformerSelfAttention, with query/key/value and their _global twins, called on [seq, batch, d]) and its output
# projection ``output``; LEDEncoder pads the tokens to a multiple of attention_window (and cuts its output back); a
# pruned encoder layer takes Longformer's PRUNED_FORWARDS["longformer"] (its helpers are the copies' own). The
# decoder's self_attn and encoder_attn are LEDDecoderAttention, BART's old attention outside the attention interface
# (q_proj/k_proj/v_proj/out_proj, bmm over [batch * heads, ...]), returning its probabilities only with
# output_attentions (argument 4, by keyword) and merging the heads to the hidden states' width: a pruned layer takes
# PRUNED_FORWARDS["led-decoder"].
LED_DECODER = Family(
    name="led-decoder",
    patterns=(("dec_self", r"(?:^|\.)decoder\.layers\.(\d+)\.self_attn$"),
              ("dec_cross", r"(?:^|\.)decoder\.layers\.(\d+)\.encoder_attn$")),
    q="q_proj", k="k_proj", v="v_proj", o="out_proj",
    d_head_attr="head_dim",
    head_count_attrs=("num_heads",),
    probs_argument=("output_attentions", 4),
    extra_outputs=1,  # (output, probabilities, cache): LEDDecoderLayer unpacks three
    pruned_forward="led-decoder",
)

LED = replace(
    LONGFORMER,
    name="led",
    patterns=(("enc_self", r"(?:^|\.)encoder\.layers\.(\d+)\.self_attn$"),),
    q="longformer_self_attn.query", k="longformer_self_attn.key", v="longformer_self_attn.value", o="output",
    core="longformer_self_attn",
    padded_by="LEDEncoder",
    head_rows=tuple((f"longformer_self_attn.{name}", ("head_dim",)) for name in _GLOBAL),
    head_row_values=("longformer_self_attn.value_global",),
    seq_major=tuple(f"longformer_self_attn.{name}" for name in ("query", "key", "value", *_GLOBAL)),
    parts=(LED_DECODER,),
)


# OpenAI GPT (GPT-1, OpenAIGPTLMHeadModel, transformers 5.24): h.N.attn (``Attention``), outside the attention
# interface: Conv1D c_attn split at split_size into [all q | all k | all v], each viewed [.., n_head, width // n_head];
# (q k^T / sqrt(d) with ``scale``) * causal buffer ``bias`` + -1e4 where it is 0, + mask, softmax; c_proj(merged);
# returns [output, probs] (a list) only with output_attentions (its 3rd argument, by keyword). It keeps no head size:
# the config's n_embd / n_head (:func:`openai_gpt`).
OPENAI_GPT = Family(
    name="openai-gpt",
    patterns=(("dec_self", r"(?:^|\.)h\.(\d+)\.attn$"),),
    q=None, k=None, v=None, o="c_proj", qkv="c_attn", qkv_layout="q|k|v",
    d_head_attr="",
    head_count_attrs=("n_head",),
    width_attrs=("split_size",),
    probs_argument=("output_attentions", 2),
)


# FSMT (fairseq's WMT19 translation Transformers, FSMTForConditionalGeneration, transformers 5.24): model.encoder.layers.N.
# self_attn, model.decoder.layers.N.self_attn and .encoder_attn (``Attention`` of modeling_fsmt, BART's old one):
# time-first [T, B, C], q scaled by head_dim**-0.5 before q k^T, bmm over [batch * num_heads, ...], softmax; returns
# (out_proj(merged), probs [batch, heads, q, k]) and the probabilities only with output_attentions (its 6th argument,
# passed by keyword). Its forward merges the heads with ``view(tgt_len, bsz, embed_dim)``, embed_dim the query's
# width: a pruned layer is given :class:`headlab.portable_code.PrunedFSMTAttention`, whose forward merges
# ``num_heads * head_dim`` (``Family.pruned_forward``).
FSMT = Family(
    name="fsmt",
    patterns=_seq2seq(r"encoder\.layers", r"decoder\.layers"),
    q="q_proj", k="k_proj", v="v_proj", o="out_proj",
    d_head_attr="head_dim",
    head_count_attrs=("num_heads",),
    probs_argument=("output_attentions", 5),
    pruned_forward="fsmt",
    time_first=True,
)


# TrOCR (TrOCRForCausalLM, the text decoder of microsoft/trocr-*, transformers 5.24): model.decoder.layers.N.self_attn
# (TrOCRAttention, BART's old attention, batch-first): q scaled by head_dim**-0.5, bmm over [batch * num_heads, ...],
# softmax; returns (out_proj(merged), probs) and the probabilities only with output_attentions (its 5th argument, by
# keyword). Its forward merges the heads to the hidden states' width: a pruned layer takes PRUNED_FORWARDS["trocr"].
# Its encoder_attn (TrOCRForCausalLM sets is_decoder) attends to encoder_hidden_states (the image encoder's, in a
# VisionEncoderDecoderModel), which headlab never passes: idle.
TROCR = Family(
    name="trocr",
    patterns=(("dec_self", r"(?:^|\.)decoder\.layers\.(\d+)\.self_attn$"),),
    never_fed=(("dec_cross", r"(?:^|\.)decoder\.layers\.(\d+)\.encoder_attn$"),),
    q="q_proj", k="k_proj", v="v_proj", o="out_proj",
    d_head_attr="head_dim",
    head_count_attrs=("num_heads",),
    probs_argument=("output_attentions", 4),
    pruned_forward="trocr",
)


# MVP (MvpForConditionalGeneration, RUCAIBox/mvp*, transformers 5.24, models/mvp): BART with BART's old attention
# (MvpAttention, outside the attention interface: q scaled by head_dim**-0.5, bmm over [batch * num_heads, ...],
# softmax), batch-first, in model.encoder.layers.N.self_attn and model.decoder.layers.N.self_attn/.encoder_attn; it
# returns (out_proj(merged), probs) and the probabilities only with output_attentions (its 6th argument, by keyword),
# and merges the heads to the hidden states' width: a pruned layer takes PRUNED_FORWARDS["mvp"]. With use_prompt its
# layers take layer-wise prompts (attn_prompt), refused per config (:func:`_mvp_prompts`).
MVP = Family(
    name="mvp",
    patterns=_seq2seq(r"encoder\.layers", r"decoder\.layers"),
    q="q_proj", k="k_proj", v="v_proj", o="out_proj",
    d_head_attr="head_dim",
    head_count_attrs=("num_heads",),
    probs_argument=("output_attentions", 5),
    pruned_forward="mvp",
)


# GPT-NeoX-Japanese (GPTNeoXJapaneseForCausalLM, abeja/gpt-neox-japanese-2.7b, transformers 5.24, models/
# gpt_neox_japanese): gpt_neox_japanese.layers.N.attention (GPTNeoXJapaneseAttention), outside the attention interface:
# query_key_value viewed [.., num_attention_heads, 3 * head_size], head h's [q | k | v] together (GPT-NeoX's per-head
# layout), partial rotary on q and k, softmax(q k^T / sqrt(d) + mask) (baddbmm), dense(merged heads); no bias on
# either. It always returns (output, probs, dense_bias): ``dense_bias``, a vector only in the last layer (None in the
# others), is added by the layer after the attention output, so it is the output projection's bias in all but name:
# a layer left with no head still returns it (:data:`headlab.portable_code.OUTPUT_BIASES`).
GPT_NEOX_JAPANESE = Family(
    name="gpt-neox-japanese",
    patterns=(("dec_self", r"(?:^|\.)layers\.(\d+)\.attention$"),),
    q=None, k=None, v=None, o="dense", qkv="query_key_value", qkv_layout="per-head",
    d_head_attr="head_size",
    head_count_attrs=("num_attention_heads",),
    extra_outputs=1,
)


def openai_gpt(config: Any) -> Family:
    """GPT-1's head size, which its attention does not keep: ``n_embd // n_head`` of the config (the original
    model's, which a pruned directory keeps: pruning leaves the head size as it was)."""
    return replace(OPENAI_GPT, d_head=config.n_embd // config.n_head)


# XLM (XLMWithLMHeadModel, transformers 5.24) and FlauBERT (FlaubertModel's attention is XLM's MultiHeadAttention,
# copied): its parallel module lists hold the attention modules themselves (``attentions.N``, beside layer_norm1.N,
# ffns.N, layer_norm2.N), outside the attention interface: q_lin/k_lin/v_lin viewed [batch, seq, n_heads, head_dim],
# q / sqrt(d) k^T, masked_fill(finfo.min), softmax in float32, out_lin of the merged heads (viewed to n_heads *
# head_dim: ``n_heads`` kept in step by pruning); it returns the weights only with output_attentions (argument 4).
# ``causal`` (a CLM checkpoint) attends through a triangular mask: its layers are a decoder's.
XLM = Family(
    name="xlm",
    patterns=(("enc_self", r"(?:^|\.)attentions\.(\d+)$"),),
    q="q_lin", k="k_lin", v="v_lin", o="out_lin",
    d_head_attr="head_dim",
    head_count_attrs=("n_heads",),
    probs_argument=("output_attentions", 4),
)
XLM_CAUSAL = replace(XLM, name="xlm-causal", patterns=(("dec_self", r"(?:^|\.)attentions\.(\d+)$"),))

# TAPAS (TapasForMaskedLM, transformers 5.24): BERT's post-norm attention (self.query/key/value, output.dense) whose
# TapasSelfAttention computes its own softmax(q k^T / sqrt(d) + mask) and returns the probabilities only with
# output_attentions (argument 4); TapasModel's mask is bidirectional whatever ``is_decoder`` says, so its layers stay
# an encoder's. Its crossattention (add_cross_attention) attends to encoder_hidden_states, which headlab never
# passes: idle.
TAPAS = Family(
    name="tapas",
    patterns=(("enc_self", r"(?:^|\.)encoder\.layer\.(\d+)\.attention$"),),
    never_fed=(("dec_cross", r"(?:^|\.)encoder\.layer\.(\d+)\.crossattention$"),),
    q="self.query", k="self.key", v="self.value", o="output.dense",
    d_head_attr="attention_head_size",
    core="self",
    head_count_attrs=("num_attention_heads",),
    probs_argument=("output_attentions", 4),
)


# LUKE (LukeForMaskedLM, transformers 5.24, models/luke): RoBERTa's post-norm layers over [words | entities] (the
# entities, from entity_ids, optional: without them the words alone). LukeSelfAttention(word_hidden_states,
# entity_hidden_states, attention_mask, output_attentions), outside the attention interface, computes its own
# softmax(q k^T / sqrt(d) + mask) over the concatenation and returns (words' context, entities' context or None[,
# probs]) (probabilities third, only with output_attentions, its 4th argument, passed by position); LukeAttention
# hands output.dense the two contexts concatenated. With use_entity_aware_attention (the default) and entities given,
# the query of each (word | entity) x (word | entity) block comes from its own projection (query for word-to-word,
# w2e_query, e2w_query, e2e_query), each viewed [.., num_attention_heads, attention_head_size] as query is: a head owns
# its rows in all four, which physical pruning slices with it (head_rows) and LRP holds constant as it holds q (they
# only make the weights, choosing a query by block is no operation on the values). Keys and values serve every block.
_LUKE_QUERIES = ("w2e_query", "e2w_query", "e2e_query")
LUKE = Family(
    name="luke",
    patterns=(("enc_self", r"(?:^|\.)encoder\.layer\.(\d+)\.attention$"),),
    q="self.query", k="self.key", v="self.value", o="output.dense",
    d_head_attr="attention_head_size",
    core="self",
    probs_index=2,
    head_count_attrs=("num_attention_heads",),
    width_attrs=("all_head_size",),  # its forward merges the heads to all_head_size
    probs_argument=("output_attentions", 3),
)
LUKE_ENTITY_AWARE = replace(LUKE, head_rows=tuple((f"self.{name}", ("attention_head_size",)) for name in _LUKE_QUERIES))


def luke(config: Any) -> Family:
    """LUKE's extra query projections exist only with ``use_entity_aware_attention`` (its default)."""
    return LUKE_ENTITY_AWARE if getattr(config, "use_entity_aware_attention", True) else LUKE


def xlm(config: Any) -> Family:
    """XLM and FlauBERT: a causal checkpoint (``causal``, a triangular mask) is a decoder."""
    return XLM_CAUSAL if getattr(config, "causal", False) else XLM


def bert_like(config: Any) -> Family:
    """BERT-style models with ``is_decoder`` (BertLMHeadModel, RobertaForCausalLM) attend causally, and
    with ``add_cross_attention`` hold a cross-attention per layer: their layers are a decoder's (the
    encoder's entry called them enc_self: found by the session-22 family sweep)."""
    return BERT_LIKE_DECODER if getattr(config, "is_decoder", False) else BERT_LIKE


# BigBird with block-sparse attention (BigBirdForMaskedLM and the other heads, transformers 5.24, models/big_bird):
# encoder.layer.N.attention, BERT's layout (self.query/key/value, output.dense), outside the attention interface:
# BigBirdBlockSparseAttention returns (context, dense map) always, the map as transformers builds it not the weights
# its forward applied (headlab.adapters.big_bird.sparse_probs reads them). BigBirdModel pads the tokens to a multiple
# of block_size first; its forward would swap the attention modules for full ones on short inputs, which the guard
# installed on it refuses before the forward runs (headlab.adapters.big_bird). The forward views the projections as
# [.., num_attention_heads, attention_head_size] and merges them back by -1: a pruned layer runs it as it is.
# With attention_type='original_full' BigBird is found by run-time discovery (its BigBirdSelfAttention, BERT's).
def _install_big_bird_guard(model: Any) -> None:
    from headlab.adapters.big_bird import install_guard

    install_guard(model)


def _big_bird_sparse_probs(core: Any, args: tuple, kwargs: dict, output: Any) -> Any:
    from headlab.adapters.big_bird import sparse_probs

    return sparse_probs(core, args, kwargs, output)


BIG_BIRD_SPARSE = Family(
    name="big_bird-block-sparse",
    patterns=(("enc_self", r"(?:^|\.)encoder\.layer\.(\d+)\.attention$"),),
    q="self.query", k="self.key", v="self.value", o="output.dense",
    d_head_attr="attention_head_size",
    core="self",
    head_count_attrs=("num_attention_heads",),
    probs_reader=_big_bird_sparse_probs,
    padded_by="BigBirdModel",
    install=_install_big_bird_guard,
)


# BigBird-Pegasus (BigBirdPegasusForConditionalGeneration, transformers 5.24, models/bigbird_pegasus): its encoder's
# layers.N.self_attn is BigBirdPegasusEncoderAttention, BigBird's attention (self: BigBirdPegasusBlockSparseAttention, a
# copy of BigBird's, or BigBirdPegasusSelfAttention with attention_type='original_full', which returns (context,
# probabilities) always too) and its output projection ``output``; BigBirdPegasusEncoder pads and switches as
# BigBirdModel does (the same guard). Its decoder's self_attn and encoder_attn are BART's (q_proj/k_proj/v_proj/
# out_proj through the attention interface). BigBirdPegasusForCausalLM holds the decoder only.
_BIGBIRD_PEGASUS_DECODER = replace(
    BART_LIKE, name="bigbird_pegasus-decoder",
    patterns=(("dec_self", r"(?:^|\.)decoder\.layers\.(\d+)\.self_attn$"),
              ("dec_cross", r"(?:^|\.)decoder\.layers\.(\d+)\.encoder_attn$")))
BIGBIRD_PEGASUS = replace(
    BIG_BIRD_SPARSE, name="bigbird_pegasus-block-sparse",
    patterns=(("enc_self", r"(?:^|\.)encoder\.layers\.(\d+)\.self_attn$"),), o="output",
    padded_by="BigBirdPegasusEncoder", parts=(_BIGBIRD_PEGASUS_DECODER,))
BIGBIRD_PEGASUS_FULL = replace(BIGBIRD_PEGASUS, name="bigbird_pegasus-full", probs_reader=None, padded_by="",
                               install=None)


def bigbird_pegasus(config: Any) -> Family:
    """BigBird-Pegasus's entry: its encoder block-sparse (its config's default) or full."""
    return BIGBIRD_PEGASUS if getattr(config, "attention_type", "original_full") == "block_sparse" \
        else BIGBIRD_PEGASUS_FULL


def big_bird(config: Any) -> Family | None:
    """Block-sparse BigBird's entry; None (run-time discovery) with full attention."""
    return BIG_BIRD_SPARSE if getattr(config, "attention_type", "original_full") == "block_sparse" else None


def gpt_bigcode(config: Any) -> Family:
    return _gpt_bigcode("q|k|v" if getattr(config, "multi_query", False) else "per-head")


def xlnet_probs(core: Any, args: tuple, kwargs: dict, output: Any) -> Any:
    """XLNet's ``[batch, heads, q, k]`` probabilities: ``XLNetRelativeAttention`` returns them third, with
    ``output_attentions``, as ``einsum("bnij->ijbn", attn_prob)`` (``XLNetModel`` permutes them back so)."""
    return output[2].permute(2, 3, 0, 1)


def _xlnet_points(model: Any) -> None:
    from headlab.adapters.xlnet import install_points  # torch: not at the command line's start-up

    install_points(model)


# XLNet (XLNetLMHeadModel, XLNetForSequenceClassification, transformers 5.24; fam31d's reading): transformer.layer.N.
# rel_attn (XLNetRelativeAttention) applies its bare parameters q, k, v, o, r ((d_model, n_head, d_head)) with
# torch.einsum, time-first [seq, batch, ...]; every per-head quantity is the slice [:, h, :] of q, k, v, o, r and
# seg_embed and [h, :] of r_w_bias, r_r_bias, r_s_bias, heads independent (ac, bd after rel_shift_bnij, ef, softmax per
# head). headlab installs identity points at the queries, keys, values and heads' outputs (headlab.adapters.xlnet) and
# covers the content stream only (no mems, no target_mapping/perm_mask query stream: refused while its hooks are on).
# attn_type='bi' only: 'uni' (causal, and failing in transformers on padded batches) is refused (_xlnet).
# The probabilities come with output_attentions (the 9th argument, by keyword), [q, k, batch, heads].
XLNET = Family(
    name="xlnet",
    patterns=(("enc_self", r"(?:^|\.)layer\.(\d+)\.rel_attn$"),),
    q="headlab_q", k="headlab_k", v="headlab_v", o="headlab_o",
    d_head_attr="d_head",
    head_count_attrs=("n_head",),
    probs_index=2,
    probs_argument=("output_attentions", 8),
    probs_reader=xlnet_probs,
    time_first=True,
    output_norms=("layer_norm",),  # post_attention's LayerNorm(attention output + h), over d_model
    head_parameters=(("q", 1), ("k", 1), ("v", 1), ("o", 1), ("r", 1), ("seg_embed", 1),
                     ("r_w_bias", 0), ("r_r_bias", 0), ("r_s_bias", 0)),
    install=_xlnet_points,
)


def deepseek_v4_probs(core: Any, args: tuple, kwargs: dict, output: Any) -> Any:
    """DeepSeek-V4's map over the input's tokens from ``DeepseekV4Attention``'s output (transformers 5.24, its
    forward read): its eager attention returns ``[batch, heads, q, keys + entries]``, the softmax over [the tokens'
    keys | the compressor's entries | the head's sink] without the sink's column. The tokens' keys are the columns of
    the mask the layer was called with (built for the keys before the entries were appended, and extended by the
    compressor's block bias after): those columns are the map; what a row of it lacks to one is the mass on the
    compressed entries and the sink, left out as the sinks' share of any sink type (:data:`ATTENTION_SINKS`).
    Refused without a tensor mask (no causal mask on the entries: transformers' forward pads none) and over a cache
    of earlier tokens (a map over more keys than queries: not one pass's tokens)."""
    import torch

    from headlab.errors import HeadlabError

    probs = output[1]
    mask = kwargs.get("attention_mask", args[3] if len(args) > 3 else None)
    if not isinstance(mask, torch.Tensor) or probs is None:
        raise HeadlabError(f"{type(core).__name__}: called without a tensor attention mask (or returned no weights), "
                           "so headlab cannot tell the tokens' keys from the compressed entries appended after them")
    tokens = int(mask.shape[-1])
    if tokens != probs.shape[2] or probs.shape[-1] < tokens:
        raise HeadlabError(f"{type(core).__name__}: {probs.shape[2]} queries over {tokens} token keys (a cache of "
                           "earlier tokens): headlab reads maps over one forward pass's tokens; run without a cache")
    return probs[..., :tokens]


DEEPSEEK_V4 = Family(
    name="deepseek-v4",
    patterns=(("dec_self", r"(?:^|\.)layers\.(\d+)\.self_attn$"),),
    # q_b_proj viewed [.., -1, head_dim] (head h: rows h * head_dim ..); one key-value head (kv_proj), both key and
    # value, shared by every head; the heads' outputs, rotated back per query on their rope slice (a rotation of
    # each head's own features), reshaped [batch, seq, o_groups, heads / o_groups x head_dim] into the grouped
    # o_a_proj (DeepseekV4GroupedLinear: group g reads heads g x heads / o_groups ..), then o_b_proj
    q=None, k=None, v=None, o="o_a_proj", d_head_attr="head_dim", kv_heads=1, shared_kv=True,
    head_rows=(("q_b_proj", ("head_dim",)),),
    head_vectors=("sinks",),
    probs_reader=deepseek_v4_probs,
    appended_keys="compressed key-value entries (its compressor's, appended after the tokens' keys in its "
                  "compressed_sparse_attention and heavily_compressed_attention layers)",
    head_count_attrs=("num_heads",), kv_groups_attr="num_key_value_groups", output_after="o_b_proj")


def pegasus_x_probs(core: Any, args: tuple, kwargs: dict, output: Any) -> Any:
    """PEGASUS-X's encoder map over the tokens from ``PegasusXGlobalLocalAttention``'s output (transformers 5.24, its
    forward read): ``output[2]["local"]`` is ``[batch, heads, blocks, block_size, num_global_tokens + block_size]``, the
    softmax of each token over [the learned global tokens | its own block's tokens]. The tokens it was called on are
    the encoder's, padded to a multiple of block_size (cut back by ``Family.padded_by``), and in a staggered layer
    (``stagger_blocks_this_layer``) with block_size / 2 masked slots more before and after them, which shift every
    token's block by half a block: ``core.headlab_stagger`` (set by :func:`_pegasus_x_marks`) says by how many slots.
    Token ``q``'s row holds its probabilities over the tokens of its block (``(q + stagger) // block_size``), zeros
    outside it (not one of its keys); what the row lacks to one is its mass on the global tokens, left out as a sink's
    share is. A masked key has probability exactly 0 (a finfo.min score beside the global tokens' unmasked ones). The
    global tokens' own rows (``output[2]["global"]``, over [global | every token]) are not rows of input tokens: left
    out."""
    import torch

    from headlab.errors import HeadlabError

    probs = output[2]["local"] if isinstance(output, tuple) and len(output) > 2 and isinstance(output[2], dict) \
        else None
    offset = getattr(core, "headlab_stagger", None)
    if probs is None or not isinstance(offset, int):
        raise HeadlabError(f"{type(core).__name__}: returned no local probabilities, or its layer's staggering is "
                           "unknown (headlab.adapters.attention_blocks marks it)")
    batch, heads, blocks, size, width = probs.shape
    n = blocks * size - 2 * offset  # the encoder's tokens, padded to a multiple of block_size
    positions = torch.arange(n, device=probs.device) + offset  # where each token sits in the layer's padded input
    rows = probs.reshape(batch, heads, blocks * size, width)[:, :, positions]
    columns = (width - size + positions % size).expand(batch, heads, n, n)  # key k's column in its own block
    same = (positions // size)[:, None] == (positions // size)[None, :]
    return torch.where(same, rows.gather(-1, columns), torch.zeros((), dtype=probs.dtype, device=probs.device))


def _pegasus_x_marks(model: Any) -> None:
    """Marks each encoder attention of PEGASUS-X with how many slots its layer pads its input with before the first
    token (``block_size // 2`` where the layer staggers its blocks, else 0), which :func:`pegasus_x_probs` reads: an
    attribute the forward never reads."""
    for module in model.modules():
        if type(module).__name__ == "PegasusXEncoderLayer":
            module.self_attn.headlab_stagger = module.block_size // 2 if module.stagger_blocks_this_layer else 0


# PEGASUS-X (PegasusXForConditionalGeneration, google/pegasus-x-*, transformers 5.24, models/pegasus_x; session 40,
# branch pegx): the decoder's self_attn and encoder_attn are PegasusXAttention, BART's layout through the attention
# interface (a part). The encoder's layers.N.self_attn is PegasusXGlobalLocalAttention, outside the interface, bias-free
# q_proj/k_proj/v_proj/out_proj viewed [.., num_heads, head_dim]: the tokens (padded to a multiple of block_size by the
# encoder, and by block_size / 2 more each side in every other layer) attend per block over [num_global_tokens
# learned global tokens | their block]; the global tokens (embed_global, their own states from layer to layer) over
# [global | every token], through the same projections. It always returns (tokens' output, global tokens' output,
# {"global": .., "local": ..}): out_proj runs twice, on the global tokens' heads first, then on the tokens'. Masking a
# head at out_proj's input therefore removes it from both, as pruning does. Its forward merges the heads to the
# input's width: a pruned layer takes PRUNED_FORWARDS["pegasus-x"]; one with no head left returns out_proj's (absent)
# bias for the tokens and for the global tokens (portable_code.SECOND_STREAMS). LRP holds q and k constant (both
# streams' scores), sums a head's relevance over both runs of out_proj (output_calls) and keeps what reaches the global
# tokens' embedding as a bias's (LEARNED_TOKENS).
LEARNED_TOKENS: dict[str, str] = {"PegasusXEncoder": "embed_global"}
"""Modules (by class) whose child embedding gives learned tokens that are not input tokens but run through the layers
beside them (PEGASUS-X's encoder: ``embed_global``, its global tokens): LRP counts the relevance that reaches them as
a bias's (a constant of the model), so that conservation holds (:mod:`headlab.importance.lrp`)."""

LEARNED_STREAMS: dict[str, str] = {"ProphetNetDecoderLayer": "self_attn.ngram"}
"""Layers (by class) whose input holds, after the tokens' rows, streams of as many rows each that are no tokens
(ProphetNet's decoder: its ``ngram`` predicting streams, each row a learned ``ngram_embeddings`` row plus a position's
embedding), with the attribute (path from the layer) holding how many: where such a layer is a stack's first, LRP
counts the relevance reaching those rows at the stack's cut as a bias's (a constant of the model), the tokens' rows as
the input embeddings (:mod:`headlab.importance.lrp`)."""

PEGASUS_X_DECODER = replace(BART_LIKE, name="pegasus-x-decoder", patterns=BART_LIKE.patterns[1:])
PEGASUS_X = Family(
    name="pegasus-x",
    patterns=(("enc_self", r"(?:^|\.)encoder\.layers\.(\d+)\.self_attn$"),),
    q="q_proj", k="k_proj", v="v_proj", o="out_proj",
    d_head_attr="head_dim",
    head_count_attrs=("num_heads",),
    probs_index=2,
    probs_reader=pegasus_x_probs,
    padded_by="PegasusXEncoder",
    pruned_forward="pegasus-x",
    install=_pegasus_x_marks,
    output_calls=2,
    parts=(PEGASUS_X_DECODER,),
)


def prophetnet_probs(core: Any, args: tuple, kwargs: dict, output: Any) -> Any:
    """ProphetNet's encoder self-attention and decoder cross-attention map (``ProphetNetAttention``, BART's old attention,
    transformers 5.24, its forward read): asked for them (``output_attentions``), it returns its scores with the mask
    added, before the softmax, not the probabilities; this is the same softmax of the same tensor its forward takes
    (``nn.functional.softmax(attn_weights, dim=-1)``), so equal to its probabilities bit for bit. A cross-attention's
    queries are the decoder's ``1 + ngram`` streams stacked ``[main | predicting 1 | ...]`` (``core.headlab_streams``,
    set by :func:`headlab.adapters.prophetnet.install`): the rows of the main stream, the first ``1 / streams``, are
    the map over the target tokens, as the decoder self-attention's map is the main stream's (:data:`PROPHETNET`)."""
    import torch

    from headlab.errors import HeadlabError

    weights = output[1] if isinstance(output, tuple) and len(output) > 1 else None
    streams = getattr(core, "headlab_streams", None)
    if not isinstance(weights, torch.Tensor) or weights.dim() != 4 or not isinstance(streams, int) or \
            weights.shape[2] % streams:
        raise HeadlabError(f"{type(core).__name__}: returned no attention scores [batch, heads, q, k] whose queries "
                           "are its model's streams (headlab.adapters.attention_blocks marks how many)")
    return torch.nn.functional.softmax(weights, dim=-1)[:, :, :weights.shape[2] // streams]


def _prophetnet_install(model: Any) -> None:
    from headlab.adapters.prophetnet import install  # torch: not at the command line's start-up

    install(model)


# ProphetNet (ProphetNetForConditionalGeneration, microsoft/prophetnet-large-uncased*, transformers 5.24,
# models/prophetnet; session 41, branch prophetnet; XLM-ProphetNet left transformers before 5.24). The encoder's
# layers.N.self_attn and the decoder's layers.N.cross_attn are ProphetNetAttention (a part, :data:`PROPHETNET_ATTENTION`).
# The decoder's layers.N.self_attn is ProphetNetNgramSelfAttention: the decoder runs its tokens as a main stream and
# config.ngram predicting streams (ngram_embeddings + the next position's embedding, no token), stacked [main | pred 1
# | ...] along the sequence, through one set of projections (query_proj, key_proj, value_proj, out_proj, viewed [..,
# num_attn_heads, head_dim]); the main stream attends causally over its own tokens, predicting stream i over [the main
# stream's tokens | its own stream] (2 x length keys), each adding relative-position scores projected from its hidden
# states (relative_pos_embeddings). It returns (output, main stream's probabilities [batch, heads, q, k], predicting
# streams' [batch, ngram, heads, q, 2q]) and runs out_proj twice, on the main stream's heads ([batch, 1, q, width])
# and on the predicting streams' ([batch, ngram, q, width]): masking a head at out_proj's input removes it from every
# stream (output_calls). The map analysed is the main stream's: one softmax per head over the target tokens, the
# stream every layer's keys and values at the tokens come from. The next-token logits come from the first predicting
# stream (ProphetNetForConditionalGeneration.forward: logits = lm_head(last_hidden_state_ngram)[:, 0]), whose query
# at position t attends over [main stream's tokens 0..t | itself]: its map, and the other predicting streams' (which
# reach logits_ngram only), are not analysed; importance measured by masking (ablation, gradients of gates) and LRP
# (a head's relevance summed over out_proj's two runs) covers the whole head, every stream. headlab.adapters.prophetnet
# (Family.install) hands a float64 model float64 masks and refuses padded target batches. Pruning: the encoder's and
# the cross-attention's take PRUNED_FORWARDS["prophetnet-attention"]; the decoder self-attention's
# PRUNED_FORWARDS["prophetnet"]: transformers' get_predict_relative_pos_embeddings gives the predicting streams' query
# of head h, stream n, position t the relative-position scores projected for another (position, stream, head) row, in
# an order that follows the head count and the length (projections ordered [batch, position, stream, head], buckets
# [stream, batch, head, position]), so relative_pos_embeddings stays whole and the pruned forward computes the scores
# for the config's heads with transformers' own methods, then takes the kept heads' (score_heads, kept_whole); a layer
# with no head left adds out_proj's bias to every stream and caches the main stream's length
# (portable_code.STACKED_STREAMS). LRP: the relative-position scores held constant
# (headlab.importance.mixer_rules.prophetnet), the predicting streams' rows at the decoder's cut kept as constants
# (LEARNED_STREAMS).
PROPHETNET_ATTENTION = Family(
    name="prophetnet-attention",
    patterns=(("enc_self", r"(?:^|\.)encoder\.layers\.(\d+)\.self_attn$"),
              ("dec_cross", r"(?:^|\.)decoder\.layers\.(\d+)\.cross_attn$")),
    q="query_proj", k="key_proj", v="value_proj", o="out_proj",
    d_head_attr="head_dim",
    head_count_attrs=("num_attn_heads",),
    probs_argument=("output_attentions", 4),
    probs_reader=prophetnet_probs,
    pruned_forward="prophetnet-attention",
)
PROPHETNET = Family(
    name="prophetnet",
    patterns=(("dec_self", r"(?:^|\.)decoder\.layers\.(\d+)\.self_attn$"),),
    q="query_proj", k="key_proj", v="value_proj", o="out_proj",
    d_head_attr="head_dim",
    head_count_attrs=("num_attn_heads",),
    extra_outputs=1,
    output_calls=2,
    install=_prophetnet_install,
    pruned_forward="prophetnet",
    kept_whole=("relative_pos_embeddings",),
    score_heads=True,
    parts=(PROPHETNET_ATTENTION,),
)
# ProphetNetForCausalLM (is_encoder_decoder False): the decoder alone, its cross_attn (add_cross_attention) attending
# to encoder_hidden_states, which headlab never passes: idle
PROPHETNET_DECODER = replace(PROPHETNET, name="prophetnet-decoder", parts=(),
                             never_fed=(("dec_cross", r"(?:^|\.)decoder\.layers\.(\d+)\.cross_attn$"),))


def prophetnet(config: Any) -> Family:
    """ProphetNet's entry: the encoder-decoder's, or the decoder alone's (``ProphetNetForCausalLM`` sets
    ``is_encoder_decoder`` False on its config)."""
    return PROPHETNET if getattr(config, "is_encoder_decoder", True) else PROPHETNET_DECODER


def merged_attention_probs(core: Any, args: tuple, kwargs: dict, output: Any) -> Any:
    """A merged attention's map over the decoder's tokens (:data:`MERGED_ATTENTION`): ``T5Gemma2MergedAttention``
    (transformers 5.24, its forward read) takes one softmax per head over ``[the decoder's keys | the encoder's]`` and
    returns that map split at the decoder's last key: ``(output, self_attn_weights, cross_attn_weights)``, the first
    being transformers' ``decoder_attentions``. That is the map; what a row of it lacks to one is the mass on the
    encoder's tokens, left out as a sink's share is (``Family.appended_keys``). Refused over a cache of earlier tokens
    (a map over more keys than queries: not one pass's tokens)."""
    from headlab.errors import HeadlabError

    probs = output[1] if isinstance(output, tuple) and len(output) > 2 else None
    if probs is None or output[2] is None:
        raise HeadlabError(f"{type(core).__name__}: returned no weights over the decoder's and the encoder's tokens")
    if probs.shape[2] != probs.shape[3]:
        raise HeadlabError(f"{type(core).__name__}: {probs.shape[2]} queries over {probs.shape[3]} decoder keys (a cache "
                           "of earlier tokens): headlab reads maps over one forward pass's tokens; run without a cache")
    return probs


MERGED_ATTENTION: dict[str, str] = {
    # session 39, branch t5g2, read in transformers 5.24 (models/t5gemma2): q_proj, k_proj, v_proj, o_proj as Gemma 3's
    # (q_norm/k_norm per head, GQA); the encoder's keys and values come from the same k_proj/v_proj (k_norm, no
    # rotation), concatenated after the decoder's; the weights returned split in two, the decoder's columns second
    "T5Gemma2MergedAttention": "the encoder's tokens (T5Gemma 2's merged attention: one softmax per head over [the "
                               "decoder's tokens | the encoder's tokens], the same heads' cross-attention)",
}
"""Attention classes whose one softmax per head spans the decoder's tokens and, appended after them, the encoder's
(``Family.appended_keys``, with what it says): analysed as ``dec_self`` blocks over the decoder's tokens
(:func:`merged_attention_probs`), the encoder's share of each row left out. No ``dec_cross`` block is made of the same
heads: headlab keys a block, its gates, masks, scores and pruning plans on (kind, layer), so two blocks of one module's
heads would let a plan switch off a head under one kind and keep it under the other, while the head is one (masking or
pruning it removes both parts at once)."""


FAMILIES: dict[str, Family] = {
    **dict.fromkeys(["marian", "bart", "mbart", "pegasus", "m2m_100", "blenderbot", "blenderbot-small"], BART_LIKE),
    **dict.fromkeys(["bert", "roberta", "xlm-roberta", "camembert", "electra", "megatron-bert", "rembert", "roformer"],
                    BERT_LIKE),
    "distilbert": DISTILBERT,
    "gpt2": GPT2,
    "gpt_neo": GPT_NEO,
    "git": GIT,
    "xglm": XGLM,
    "mpnet": MPNET,
    "gpt_neox_japanese": GPT_NEOX_JAPANESE,
    "ibert": IBERT,
    "squeezebert": SQUEEZEBERT,
    "longformer": LONGFORMER,
    "convbert": CONVBERT,
    "led": LED,
    **dict.fromkeys(["xlm", "flaubert"], XLM),
    "tapas": TAPAS,
    "fsmt": FSMT,
    "trocr": TROCR,
    "mvp": MVP,
    **dict.fromkeys(["t5", "mt5", "switch_transformers"], T5),
    "umt5": UMT5,
    "longt5": LONGT5,
    **dict.fromkeys(["llama", "qwen2", "mistral", "qwen3"], LLAMA_LIKE),
    **dict.fromkeys(["qwen3_next", "qwen3_5_text", "qwen3_5_moe_text"], QWEN3_NEXT),
    "qwen4_exp_text": QWEN4_EXP,
    "gpt_neox": GPT_NEOX,
    "phi3": PHI3,
    "phi": PHI,
    "bloom": BLOOM,
    "mpt": MPT,
    "modernbert": MODERNBERT,
    "deberta-v2": DEBERTA_V2,
    "albert": ALBERT,
    "xlnet": XLNET,
    "deepseek_v4": DEEPSEEK_V4,
    "pegasus_x": PEGASUS_X,
}
"""Model types with a declarative entry; any other goes through generic discovery."""

FUSED_ATTENTION_CLASSES: dict[str, Family] = {
    "ModernBertAttention": MODERNBERT, "Phi3Attention": PHI3,
    # Phi-4-multimodal's language model: Phi3Attention copied under its own name, forward, apply_rotary_pos_emb,
    # repeat_kv and eager_attention_forward line for line (and Phi3DecoderLayer, Phi3MLP, Phi3RMSNorm with them)
    "Phi4MultimodalAttention": PHI3,
    # models with no table entry of their own (session 29, fused29); Fuyu's language model is a Persimmon
    "CodeGenAttention": CODEGEN, "PersimmonAttention": PERSIMMON, "DbrxAttention": DBRX}
"""Attention classes of transformers (5.24: their forwards read) whose fused q/k/v projection is laid out as the
entry beside them says (a :data:`FAMILIES` one, or one kept here only: CodeGen, Persimmon, DBRX), found by run-time
discovery in a model that has no entry of its own: CodeGen, Persimmon, Fuyu (a Persimmon), DBRX, or a
multimodal wrapper's language model (ModernVBERT's ModernBERT encoder, built by ``AutoModel`` from its
``text_config``; Phi-4-multimodal's Phi-3 decoder). Discovery sees the queries, keys and values come from one
projection and ties none of them; a block of such a class (its class defined by transformers itself) takes the
entry's projections, layout and bookkeeping, so that physical pruning slices it and LRP holds its query and key
columns constant as for the tabled family."""

CONFIG_FAMILIES: dict[str, Callable[[Any], Family | None]] = {
                   "big_bird": big_bird, "bigbird_pegasus": bigbird_pegasus, "falcon": falcon,
                   "gpt_bigcode": gpt_bigcode, "openai-gpt": openai_gpt, "deberta": deberta,
                   "xlm": xlm, "flaubert": xlm, "luke": luke, "prophetnet": prophetnet,
                   # Megatron-BERT: BERT's attention (self.query/key/value, output.dense) with a pre-norm ``ln``
                   # before it and no norm in its output (MegatronBertSelfOutput adds the residual).
                   # RemBERT: BERT's attention over hidden_size (its embeddings narrower, projected up first).
                   # RoFormer: BERT's attention with rotary positions applied to q and k (and v with rotary_value)
                   # per head inside RoFormerSelfAttention, from sinusoidal_pos [1, 1, seq, head size] shared by
                   # all heads: pruning keeps them as they are
                   **dict.fromkeys(["bert", "roberta", "xlm-roberta", "camembert", "electra", "megatron-bert",
                                    "rembert", "roformer"], bert_like)}
"""Model types whose entry depends on their config (the fused layout)."""

UNSUPPORTED: dict[str, str] = {
    # session 38's sweep of wrappers: its encoder's and its denoiser's layers were both dec_self layer 0 ("two
    # modules claim"); read in transformers 5.24 (DiffusionGemmaDecoderTextAttention, DiffusionGemmaDecoderModel)
    "diffusion_gemma": "DiffusionGemma is a block-diffusion language model: an encoder reads the prompt, then a "
                       "denoiser refines a canvas of canvas_length tokens, each of its layers attending bidirectionally "
                       "over [the keys and values the encoder's layer cached | the canvas's own], so a denoiser head's "
                       "map spans two stacks' keys and its layers number from 0 beside the encoder's, which headlab's "
                       "blocks (one stack, one map over one module's keys per head) do not describe",
    "whisper": "Whisper is a speech model: its encoder reads audio features, which headlab's text inputs cannot "
               "feed (transformers would load it as WhisperForCausalLM, its encoder dropped)",
    # its audio tower's blocks and its language model's were both dec_self layer 0 ("two modules claim"), the probe
    # forward on token ids failing (skip27B)
    "voxtral_realtime": "Voxtral Realtime is a streaming speech model: its forward reads audio features "
                        "(input_features) at every step, which headlab's text inputs cannot feed",
    # wrapper28: discovery found the audio tower's attention as a running enc_self block and not the ModernBERT text
    # model's; describe_model failed (get_input_embeddings not implemented), every forward on token ids too
    **{model_type: f"{name} is a contrastive embedding model: its forward embeds text (a ModernBERT, its text_config) "
                   f"together with {media}, which headlab's text inputs cannot feed; its text model alone "
                   "(model.text_model) is a ModernBERT encoder headlab supports"
       for model_type, name, media in (
           ("pe_audio", "Perception Encoder Audio (PeAudioModel)", "audio (input_values)"),
           ("pe_video", "Perception Encoder Video (PeVideoModel)", "video (pixel_values_videos)"),
           ("pe_audio_video", "Perception Encoder Audio-Video (PeAudioVideoModel)",
            "audio and video (input_values, pixel_values_videos)"))},
    # transformers' own attention code outside the attention interface, whose module returns no
    # [batch, heads, q, k] probabilities where capture reads them: found by its projections' names, it
    # failed only at run time (docs/benchmarks.md's survey)
    **{model_type: f"{name}'s attention does not go through transformers' attention interface and returns its "
                   "attention probabilities only when asked for them (output_attentions), which headlab does not "
                   "do for a model it has no table entry for"
       for model_type, name in (("nystromformer", "Nystromformer"),
                                ("funnel", "Funnel Transformer"))},
    # the family sweep (skip27A): found no block (Funnel) / "two modules claim dec_self layer 0" (BLT)
    "blt": "BLT (Byte Latent Transformer) runs four stacks of attention, an entropy patcher, a local encoder, a global "
           "transformer over patches and a local decoder (with cross-attention between bytes and patches), each with "
           "its own layer 0: headlab numbers a model's layers per kind (enc_self, dec_self, dec_cross), in one stack",
    "mra": "MRA's multi-resolution attention approximates the attention and computes no probability map per head, "
           "which headlab's analysis reads",
    "yoso": "YOSO's hashing-based attention approximates the attention and computes no probability map per head, "
            "which headlab's analysis reads",
    # neoxjp32, read in transformers 5.24 (models/cpmant): before, "found no attention block". What an entry would
    # reuse: encoder.layers.N.self_att.self_attention (CpmAntAttention: project_q/k/v viewed [.., num_heads, dim_head],
    # attention_out, no biases, probabilities only with output_attentions, its 5th argument), and a position_bias
    # [batch, heads, q, k] computed once per pass from one relative_attention_bias (buckets x heads) and handed to every
    # layer by position, as MPNet's (alibi_argument). What it would need first: the prompt positions cut from every
    # map, per-head output and relevance, and batches left-padded with id 0. Checked on a tiny CpmAntForCausalLM: a
    # right-padded row's logits differ from the unpadded row's, a left-padded row's do not; a position's logits change
    # with a later token (its mask is bidirectional over the input: context is all ones)
    "cpmant": "CPM-Ant prepends config.prompt_length learned prompt tokens to every input inside its forward, so each "
              "layer's attention (CpmAntAttention, outside transformers' attention interface) maps [prompts | tokens] "
              "x [prompts | tokens], and output_attentions hands out only the tokens' block, whose rows do not sum to "
              "one (the rest went to the prompts); and it ignores attention_mask (CpmAntForCausalLM takes it as a "
              "dummy parameter), reading padding from the ids instead: id 0 is padding, and only on the left (the "
              "last `length` positions of a row are its tokens), so a right-padded batch is read wrongly. headlab's "
              "maps, per-head outputs and relevance are over the input's tokens, and its padded batches follow "
              "attention_mask: it has no entry that cuts the prompts out and pads as CPM-Ant reads",
    # neoxjp32, read in transformers 5.24 (models/diffllama): before, refused as "ran the attention function 2 times
    # in one pass (a module shared by several layers, or one that attends twice)", which its heads are not
    "diffllama": "DiffLlama's attention is differential (Ye et al. 2024, arXiv:2410.05258): each of its "
                 "num_attention_heads / 2 heads pairs query head i with query head i + num_attention_heads / 2 and "
                 "attends with softmax(Q1 K1^T) - lambda softmax(Q2 K2^T) (lambda learned per layer), a signed map "
                 "whose rows sum to 1 - lambda, over both halves of the values, then normalises its 2 x head_dim "
                 "outputs (groupnorm, an RMSNorm per head) before o_proj; headlab's capture and statistics read one "
                 "probability map per head (non-negative, rows summing to one), and transformers returns only the "
                 "first softmax of each pair, so headlab has no reading of a DiffLlama head's attention",
    # neoxjp32, read in transformers 5.24 (models/jetmoe): before, refused naming the getitem between the attention
    # function's output and experts.output_linear, not what that getitem is
    "jetmoe": "JetMoE's attention is a mixture of attention heads (JetMoeMoA, Zhang et al. 2022): a router sends each "
              "token to num_experts_per_tok of num_local_experts attention experts, each with its own query projection "
              "(experts.input_linear) and output projection (experts.output_linear) over keys and values all experts "
              "share (kv_proj); the attention function's num_experts_per_tok x num_key_value_heads heads are routing "
              "slots, a slot's map at a token belonging to whichever expert the router chose there, so a head there is "
              "no one set of weights, and an expert's heads attend only from the tokens routed to them: headlab has "
              "no per-head map, mask or pruning of routed attention experts",
    # neoxjp32, read in transformers 5.24 (models/hrm_text): before, refused as "ran the attention function 6 times in
    # one pass (a module shared by several layers, or one that attends twice)"
    "hrm_text": "HRM-Text (Hierarchical Reasoning Model) is recurrent within one forward pass: every layer of its "
                "L_module stack runs H_cycles x L_cycles times (its input the low-level state plus the high-level "
                "one) and every layer of its H_module stack H_cycles times, each run with a cache slot of its own, and "
                "the L runs before the last L_bp_cycles under torch.no_grad (no gradient reaches them); a head is one "
                "set of weights with a map per run, and headlab numbers a shared module's runs as depths only where a "
                "table entry says how (ALBERT's), which HRM-Text's two interleaved recurrent stacks have not",
}
"""Model types refused before any work, with what is missing."""

CORE_CLASSES_REFUSED: dict[str, str] = {
    "GPTNeoFlashAttention2": "GPT-Neo built with flash attention (attn_implementation='flash_attention_2') computes its "
                             "attention in flash-attn's kernel and returns no attention probabilities (its second "
                             "output is the heads' merged outputs), and its class is fixed when the model is built: "
                             "load the model with attn_implementation='eager'",
}
"""Attention classes of a table family refused before any work (the class is chosen when the model is built, so
switching the config's implementation, as capture does, does not reach it), with why and what to do."""


def _big_bird(config: Any) -> str | None:
    # read in transformers 5.24 (models/big_bird): BigBirdModel.__init__ switches a block-sparse model with
    # add_cross_attention to full attention (its config still says block_sparse), and its forward switches a decoder
    # given a cache; block-sparse attention itself is bidirectional (no causal mask)
    if getattr(config, "attention_type", "original_full") != "block_sparse" or not (
            getattr(config, "is_decoder", False) or getattr(config, "add_cross_attention", False)):
        return None
    return ("BigBird as a decoder (is_decoder or add_cross_attention) with block-sparse attention: its block-sparse "
            "attention attends both ways (no causal mask), and transformers switches it to full attention when it is "
            "built with cross-attention or given a cache; set attention_type to 'original_full' (in config.json, or "
            "from_pretrained(..., attention_type='original_full')) to analyse it with full attention")


def _deberta_talking_heads(config: Any) -> str | None:
    if not getattr(config, "talking_head", False):
        return None
    return ("DeBERTa (v1) with talking_head=True mixes its heads (talking-head projections: head_logits_proj mixes "
            "the heads' attention logits and head_weights_proj their attention weights, each head's output a mix "
            "of every head's), so a head is not one head to capture, mask or prune; DeBERTa (v1) without "
            "talking heads, and DeBERTa-v2, are supported")


def _ibert(config: Any) -> str | None:
    # read in transformers 5.24 (models/ibert): with quant_mode=False every Quant*/Int* module computes BERT's float
    # arithmetic (:data:`IBERT`); with quant_mode=True integer arithmetic with scaling factors
    if not getattr(config, "quant_mode", False):
        return None
    return ("I-BERT with quant_mode=True runs integer-only arithmetic (IntSoftmax, IntGELU, IntLayerNorm and the "
            "requantisation of every activation, QuantAct, with scaling factors computed from the whole layer's "
            "values), so masking or removing a head changes how the other heads' outputs are quantised, and LRP "
            "has no rule for integer rounding: neither masking, pruning nor LRP would be exact; I-BERT with "
            "quant_mode=False (BERT's arithmetic) is supported")


def _longformer_windows(config: Any) -> str | None:
    # LongformerModel._pad_to_window_size (LEDEncoder's) pads to a multiple of max(attention_window); each layer's
    # _sliding_chunks_query_key_matmul asserts the length a multiple of its own window (transformers 5.24)
    windows = config.attention_window if isinstance(config.attention_window, (list, tuple)) else []
    odd = sorted({w for w in windows if max(windows) % w})
    if not odd:
        return None
    name = "LED" if getattr(config, "model_type", None) == "led" else "Longformer"
    return (f"this {name}'s per-layer attention windows {list(windows)} do not all divide the largest, "
            f"{max(windows)}: transformers pads the tokens to a multiple of the largest only, and a layer of window "
            f"{odd[0]} then fails its own assertion (the length a multiple of its window) on most input lengths; "
            "use windows that each divide the largest")


def _xlm(config: Any) -> str | None:
    # XLMModel (and FlaubertModel) add lang_embeddings(langs) to the token embeddings where n_langs > 1 and
    # use_lang_emb; without langs they are left out, and the model runs on inputs unlike its training's
    if getattr(config, "n_langs", 1) > 1 and getattr(config, "use_lang_emb", True):
        return (f"this {type(config).__name__.removesuffix('Config')} checkpoint has language embeddings (n_langs="
                f"{config.n_langs}, use_lang_emb=True): its forward adds the embedding of each token's language "
                "(langs), which headlab's text inputs do not carry, and without it the model would run on inputs "
                "unlike its training's; XLM checkpoints without language embeddings (n_langs=1, or use_lang_emb=False "
                "as XLM-17 and XLM-100) are supported")
    if getattr(config, "asm", False):
        # XLMPredLayer with asm: AdaptiveLogSoftmaxWithLoss.log_prob(x), no output layer of logits (LRP crashed)
        return (f"this {type(config).__name__.removesuffix('Config')} model predicts words with an adaptive softmax "
                "(asm=True): its language-model head returns log-probabilities from clusters of the vocabulary "
                "(AdaptiveLogSoftmaxWithLoss), not logits of one output layer, which headlab's measures explain; "
                "XLM's and FlauBERT's released checkpoints have asm=False")
    return None


def _flaubert(config: Any) -> str | None:
    if getattr(config, "pre_norm", False):
        # FlaubertModel.forward's pre_norm branch calls its attention with cache=cache[i] on an EncoderDecoderCache
        return ("FlauBERT with pre_norm=True does not run in transformers 5.24: FlaubertModel's forward indexes its "
                "key/value cache (cache[i], an EncoderDecoderCache, which is not subscriptable) before its first "
                "attention layer, and that branch never asks its attention for probabilities (output_attentions)")
    return _xlm(config)


def _xlnet(config: Any) -> str | None:
    # read in transformers 5.24 (XLNetModel.forward, create_mask; found by xlnetuni34): attn_type="uni" adds a causal
    # mask, so the layers are a decoder's (dec_self, where XLNET says enc_self: the first query's forced weight would
    # count as a head's behaviour), but the forward adds the padding mask ([1, k, batch, 1]) in place to the causal one
    # ([q, k, 1, 1]) and fails for any batch of two or more with an attention_mask, which headlab's batches all pass
    if getattr(config, "attn_type", "bi") != "uni":
        return None
    alone = (" (and with same_length=True and no memory each query sees its own position only)"
             if getattr(config, "same_length", False) else "")
    return ("this XLNet has attn_type='uni': its layers attend causally" + alone + ", as a decoder's, where "
            "headlab's XLNet entry (written for 'bi') reads an encoder's, and transformers 5.24's "
            "XLNetModel fails on every batch of more than one sentence with an attention mask (it adds the padding "
            "mask in place to its causal mask of batch size 1), which every batch headlab runs has; XLNet with "
            "attn_type='bi' (the default) is supported")


def _mvp_prompts(config: Any) -> str | None:
    # read in transformers 5.24 (models/mvp): MvpPrompt maps prompt_length prompt ids through prompt_trans (its last
    # Linear emitting num_layers * 2 * d_model) to keys and values [2, heads, prompt_length, head_dim] per layer, which
    # MvpAttention prepends to every head's own keys and values (cat on the key axis, the mask extended by zeros)
    if not getattr(config, "use_prompt", False):
        return None
    return (f"MVP with layer-wise prompts (use_prompt=True, prompt_length={getattr(config, 'prompt_length', '?')}) "
            "prepends learned prompt keys and values to every head's keys and values in each layer (MvpPrompt), so a "
            "head's attention map spans [prompt | tokens], not the [query, key] map over the input's tokens that "
            "headlab's analysis reads, and pruning a head would have to cut its rows out of the prompt projection "
            "shared by all layers (prompt_trans, viewed as the config's head count in every layer); MVP without "
            "prompts (use_prompt=False, RUCAIBox/mvp and its task models) is supported")


def _dory(config: Any) -> str | None:
    # read in transformers 5.24 (models/dory/modeling_dory.py, DoryAttention, DoryModel, DoryLMHead); its attn_sub_norm
    # alone would be exact (SUB_NORMS: an L2 norm, unchanged by removing a head's zeros)
    loops = getattr(config, "n_recurrent_loops", None)
    recurrent = getattr(config, "n_recurrent_layers", None)
    layers = f"{recurrent} layer{'s' if recurrent != 1 else ''}"
    looped = (f"its recurrent section runs its {layers} {loops} times in one forward (n_recurrent_loops, "
              "each loop with its own copy of their key/value cache), so a head of those layers is not one layer's "
              "head and no map of theirs is one pass's; " if isinstance(loops, int) and loops > 1 and recurrent else "")
    return ("Dory (nGPT) is not analysed: " + looped + "its attention scales the queries and the output gate per channel "
            "by learned vectors of heads x head_dim entries (sqk, s_gate) that physical pruning has no slicing for; "
            "its norms are L2 norms x / sqrt(sum(x^2) + eps) (DoryL2Norm, also over each head's queries and keys) and "
            "its layers interpolate the residual stream towards the normalised update (lambda_1, lambda_2), for which "
            "LRP has no rule; its LM head scales each token's logit (logit_scale): headlab has checked none of these "
            "(the norm over the heads' outputs before o_proj, attn_sub_norm, would be exact: headlab.adapters."
            "families.SUB_NORMS)")
def _nllb_moe_routing(config: Any) -> str | None:
    # read in transformers 5.24 (models/nllb_moe, NllbMoeTop2Router.route_tokens): in evaluation mode an expert takes
    # at most ceil(moe_eval_capacity_token_fraction x the batch's tokens), counted over the whole flattened batch, the
    # rest of its tokens dropped; second_expert_policy "sampling" adds Gumbel noise to the logits, "random" drops
    # second experts at random, in evaluation mode too
    policy = getattr(config, "second_expert_policy", "all")
    if policy in ("sampling", "random"):
        return (f"NLLB-MoE with second_expert_policy={policy!r} routes tokens to their second expert at random, in "
                "evaluation mode too, so every run of the same sentence computes another model; "
                "second_expert_policy='all' (the default) is supported")
    fraction = getattr(config, "moe_eval_capacity_token_fraction", 1.0)
    if isinstance(fraction, (int, float)) and 0 < fraction < 1:
        return (f"NLLB-MoE with moe_eval_capacity_token_fraction={fraction} drops, in evaluation mode, the tokens "
                "beyond an expert's capacity, a fraction of all the batch's tokens counted over the whole batch, so "
                "a sentence's routing depends on the sentences batched with it (a right-padded tiny model's logits "
                "moved by 3e-3); with 1.0 (the default) no token is dropped and it is supported")
    return None


UNSUPPORTED_CONFIGS: dict[str, Callable[[Any], str | None]] = {"big_bird": _big_bird, "deberta": _deberta_talking_heads,
                                                               "ibert": _ibert, "xlm": _xlm, "flaubert": _flaubert,
                                                               "longformer": _longformer_windows,
                                                               "led": _longformer_windows, "mvp": _mvp_prompts,
                                                               "dory": _dory, "nllb-moe": _nllb_moe_routing,
                                                               "xlnet": _xlnet}
"""Model types refused before any work in some configurations: the config -> what is missing (None: supported)."""
