"""Options of an importance run, apart from the measures themselves: importing this module
costs no torch (the command line reads its help texts at start-up). The measures' own options
are declared by the measures (``ImportanceMeasure.Options``, :mod:`headlab.plugins`): a config
takes them as keywords (``ImportanceConfig(lrp_targets=4)``) and keeps them in ``options``."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from headlab.errors import HeadlabError
from headlab.importance.registry import MEASURES
from headlab.options import check_ranges
from headlab.plugins import OptionSpec, PluginOptions, check_values, plugin_options


@plugin_options
@dataclass
class ImportanceConfig(PluginOptions):
    """Options of an importance run (``headlab importance`` maps its flags onto these); the
    measures' own options (``lrp_targets``, ``metric``, ...) are keywords too, kept in ``options``."""

    methods: tuple[str, ...] = field(default=("all",), metadata={"help": f"measures to run: {', '.join(MEASURES)} or all"})
    batch_size: int = field(default=32, metadata={"help": "sentences per batch", "range": "[1, inf)"})
    beam: int = field(default=1, metadata={
        "help": "beam size of the model's translations (1 = greedy)", "range": "[1, inf)"})
    kinds: tuple[str, ...] | None = field(default=None, metadata={"help": "attention kinds to score (default: all)"})
    progress: bool = field(default=True, metadata={"help": "show progress bars"})
    options: dict[str, object] = field(default_factory=dict, metadata={
        "help": "the measures' own options by flag name (lrp_targets, metric, ...)"})

    BASE = ("batch_size", "beam")
    """Run options that a measure's options may share by naming them as their ``flag``."""

    @classmethod
    def plugin_specs(cls) -> list[OptionSpec]:
        from headlab.importance.registry import option_specs

        return [spec for spec in option_specs() if spec.dest not in cls.BASE]

    def signature_options(self) -> dict[str, object]:
        """What the scores' signature records: the run's batch size and beam, every measure's
        options that change the numbers (given or default), and the kinds."""
        values = self.option_values()
        signed = {s.dest: values[s.dest] for s in self.plugin_specs() if s.signed}
        return {"batch_size": self.batch_size, "beam": self.beam, **signed,
                "kinds": list(self.kinds) if self.kinds else None}

    def resolved_methods(self) -> list[str]:
        # The run's own fields (batch_size=2.0, beam=0, batch_size=True from Python) by their
        # declared ranges, as the measures' options below: a float batch size failed deep in the
        # pass, True was 1.
        check_ranges(self)
        chosen: list[str] = []
        for name in self.methods:
            names = list(MEASURES) if name == "all" else [name]
            for n in names:
                if n not in MEASURES:
                    raise HeadlabError(f"unknown importance method {n!r}; expected one of {', '.join(MEASURES)} or all")
                if n not in chosen:
                    chosen.append(n)
        if not chosen:  # "--method ," was "no importance measure can run on this model: " (nothing after it)
            raise HeadlabError(f"no importance method given (--method); expected some of {', '.join(MEASURES)} or all")
        check_values(self.plugin_specs(), self.options)  # declared ranges, also for a config built in Python
        for measure in MEASURES.values():
            measure.options_from(self)  # each measure checks its own options
        return chosen

    def check_options_act(self, name: Callable[[str], str], methods: str) -> None:
        """Refuse a measure's option given (not its default) when none of the chosen measures reads
        it (``--engine kernel`` with ``--method lrp``): the run went on as if it had not been given.
        ``name``: how the caller spells an option (``--engine``, ``engine=``); ``methods``: how it
        spells the choice of measures. Only for a run of the measures named here (``importance``),
        not for ``analyze``'s single-measure stages, which are given every measure's options."""
        chosen = set(self.resolved_methods())
        readers: dict[str, list[str]] = {}
        for spec in self.plugin_specs():
            readers.setdefault(spec.dest, []).append(spec.owner)
        idle = {dest: owners for dest, owners in readers.items()
                if dest in self.options and self.options[dest] != _default(self.plugin_specs(), dest)
                and not chosen & set(owners)}
        if not idle:
            return
        if len(idle) == 1:
            [(dest, owners)] = idle.items()
            measures = " or ".join(owners)
            raise HeadlabError(f"{name(dest)}: this option acts on {measures} alone, and {methods} does not run "
                               f"{'it' if len(owners) == 1 else 'them'}: add {measures} to the measures, or leave "
                               f"{name(dest)} out")
        listed = ", ".join(f"{name(dest)} ({' or '.join(owners)})" for dest, owners in idle.items())
        raise HeadlabError(f"{listed}: these options act on the measures in brackets alone, and {methods} runs none "
                           "of them: add the measures, or leave the options out")


def check_beam(beam: object, *, translates: bool, classifier: bool, arch: str, model: str, option: str) -> None:
    """Refuse a beam other than 1 for a model that makes no translation for it to search: it was
    ignored, and the scores' signature said that beam all the same. The one check of ``importance``
    (``--beam``), the API (``beam=``) and ``analyze`` (before any stage). ``arch``: the model's kind
    (``gpt2``, ``decoder``); ``option``: how the caller spells it (``--beam`` or ``beam``)."""
    if beam != 1 and not translates:
        given = f"{option} {beam}" if option.startswith("--") else f"{option}={beam}"
        kind = "sequence classifier" if classifier else f"{arch} model"
        raise HeadlabError(f"{given}: the beam of the model's translations, and {model} is a {kind} that does not "
                           f"translate; leave {option} out")


def check_ablation_metric(metric: str, *, translates: bool, classifier: bool, has_target: bool, arch: str,
                          model: str) -> None:
    """Refuse an ablation metric the model or data cannot give: BLEU without a translation model and references,
    accuracy off a sequence classifier. The one check of ``importance`` (``--method ablation``) and ``analyze``
    (``--ablation``), before the weights load; ``arch``: the model's type (``gpt2``)."""
    kind = "a sequence classifier" if classifier else "a translation model" if translates else (
        f"a {arch} model that does not translate")
    if metric == "bleu" and (not has_target or not translates):
        raise HeadlabError("--metric bleu: the ablation's BLEU needs a translation model and reference translations "
                           f"(--target); {'give --target FILE' if translates else f'{model} is {kind}'}, or use "
                           "--metric loss")
    if metric == "accuracy" and not classifier:
        raise HeadlabError(f"--metric accuracy: the ablation's accuracy is a sequence classifier's, and {model} "
                           f"is {kind}; use --metric loss{' or bleu' if translates else ''}")


def _default(specs: list[OptionSpec], dest: str) -> object:
    return next(spec.default for spec in specs if spec.dest == dest)
