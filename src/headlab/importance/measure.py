"""The extension point of importance: one :class:`ImportanceMeasure` subclass per measure.

A measure says what it needs (capability flags, as captum's ``Attribution`` classes do), holds
its own options in a dataclass, and scores every head into one
:class:`~headlab.heads.HeadScores`. The registry (:data:`headlab.importance.registry.MEASURES`)
lists them; ``headlab importance``, the ``analyze`` stages, the report and ``reproduce`` take
their lists from it, and the flags of ``importance`` and ``analyze``, the scores' signature and
the stage keys come from its ``Options`` (:mod:`headlab.plugins`). Adding a measure: a module with
its subclass (and its test), and one line in the registry (CONTRIBUTING.md).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from torch import nn

from headlab.compiled import uncompiled
from headlab.data.inputs import ImportanceData
from headlab.gates import mask_heads, measuring
from headlab.heads import HeadScores, HeadSpec
from headlab.importance.common import masked_signature, original_mask
from headlab.model_description import ModelInfo
from headlab.plugins import OptionSpec, ReportPart, build_options, option_specs

__all__ = ["ImportanceMeasure", "NoOptions", "MASK_INSTEAD", "NO_LM_HEAD", "NO_NEXT_TOKEN"]

NO_LM_HEAD = "the model has no language-model head (no logits to explain, no loss to differentiate)"
MASK_INSTEAD = ("give mask= to the measure's run (headlab.importance.MEASURES[name]().run) or to run_importance, "
                "which score the model with those heads switched off and blank them in the tables")
"""How to measure with heads masked, said where a measure's function is refused a model with gates attached."""
NO_NEXT_TOKEN = ("every sentence is one token, and a language model's loss is on predicting each next token, which "
                 "a one-token sentence does not have (give sentences of two tokens or more)")


@dataclass(frozen=True)
class NoOptions:
    """The options of a measure that has none of its own."""


class ImportanceMeasure:
    """One way to score every head of a model on prepared data."""

    name: ClassVar[str]
    """Registry key, ``--method`` value and the name of the HeadScores file it writes."""
    tables: ClassVar[dict[str, tuple[str, str]]]
    """Every HeadScores table it writes: method name -> (title, caption) for the report."""
    needs_lm_head: ClassVar[bool] = False
    """It explains logits or differentiates a loss, so the model needs a language-model head."""
    reads_translation: ClassVar[bool] = False
    """A translation model's decoder runs on the model's own translation (confidence, LRP)."""
    uses_loss: ClassVar[bool] = False
    """It scores a loss: against the reference when there is one, else the model's own output."""
    on_request: ClassVar[bool | str] = False
    """Slow: ``headlab analyze`` runs it only when asked (``--<name>``; a string: that flag's help)."""
    report: ClassVar[tuple[ReportPart, ...]] = ()
    """What the report shows of it beside its heatmaps, drawn by its own module (:class:`~headlab.plugins.ReportPart`)."""
    Options: ClassVar[type] = NoOptions
    """A frozen dataclass of the measure's own settings: fields made with
    :func:`headlab.options.option` (help, ``range``, ``choices``; ``flag`` where the flag is not
    ``--<name>-<field>``; ``signed=False`` where it changes no number), checked in ``__post_init__``."""

    def __init__(self, options: Any = None) -> None:
        self.options = self.Options() if options is None else options

    @classmethod
    def option_specs(cls) -> list[OptionSpec]:
        """The measure's options as flags and config keywords (``--lrp-targets``: LRP's ``targets``)."""
        return option_specs(cls.name, cls.Options, f"{cls.name}_")

    @classmethod
    def options_from(cls, config: Any) -> Any:
        """The measure's options from a config: a mapping ``{dest: value}``, or an object whose
        attributes are the dests (``ImportanceConfig.lrp_strategy`` fills LRP's ``strategy``)."""
        specs = cls.option_specs()
        if isinstance(config, Mapping):
            return build_options(cls.Options, specs, config)
        return build_options(cls.Options, specs, {s.dest: getattr(config, s.dest) for s in specs
                                                  if hasattr(config, s.dest)})

    @classmethod
    def caption_note(cls, signature: Mapping[str, Any]) -> str:
        """What the report adds to the caption of a map from the map's signature ("": nothing)."""
        return ""

    def unavailable(self, info: ModelInfo, data: ImportanceData) -> str | None:
        """Why the measure cannot run on this model and data; None when it can."""
        if self.needs_lm_head and not info.has_lm_head:
            return NO_LM_HEAD
        # One-token sentences are skipped and counted; with nothing else the loss has no token.
        if self.uses_loss and info.arch == "causal" and all(len(ids) < 2 for ids in data.sources):
            return NO_NEXT_TOKEN
        return None

    def unsupported(self, model: nn.Module) -> str | None:
        """Why the measure cannot run on this model's modules (found before any work); None when it can."""
        return None

    def score(self, model: nn.Module, data: ImportanceData, info: ModelInfo, *, batch_size: int = 32,
              kinds: tuple[str, ...] | None = None, progress: bool = False, tokenizer: Any = None) -> HeadScores:
        """The measure's HeadScores over ``data`` (``kinds``: only these attention kinds); by
        default the first of :meth:`score_tables`. A subclass defines one of the two."""
        return self.score_tables(model, data, info, batch_size=batch_size, kinds=kinds, progress=progress,
                                 tokenizer=tokenizer)[0]

    def score_tables(self, model: nn.Module, data: ImportanceData, info: ModelInfo, **options: Any) -> list[HeadScores]:
        """Every table of :attr:`tables`, in order; by default :meth:`score`'s one table."""
        if type(self).score is ImportanceMeasure.score:
            raise NotImplementedError(f"{type(self).__name__} defines neither score nor score_tables")
        return [self.score(model, data, info, **options)]

    def run(self, model: nn.Module, data: ImportanceData, info: ModelInfo, *, mask: HeadSpec | None = None,
            **options: Any) -> list[HeadScores]:
        """:meth:`score_tables` of the model with the heads of ``mask`` switched off
        (:func:`~headlab.gates.mask_heads`, composed with the measure's own gates): the scores
        of the masked model, in which those heads are NaN, as a pruned model's removed heads are.
        ``mask`` is in the current numbering, as ``mask_heads`` takes it; the tables name a pruned
        model's heads by their original index, and so blank the masked heads' original indices, which their
        signature records (``options["mask"]``, as :func:`~headlab.importance.run_importance` writes it).
        A model with gates attached before the call (inside ``mask_heads``) is refused before any work
        (:func:`~headlab.gates.measuring`): the tables would be the gated model's, none of its heads blanked."""
        model = uncompiled(model)  # torch.compile's wrapper: its model (headlab.compiled)
        with measuring(model, self.name, instead="give mask= (run's), whose heads the tables blank"):
            if not mask:
                return self.score_tables(model, data, info, **options)
            with mask_heads(model, mask):
                tables = self.score_tables(model, data, info, **options)
        removed = original_mask(model, mask)
        return [masked_signature(table, removed) for table in tables]  # blanked, and the signature says so
