"""The generated parts of docs/reproduction.md, and how they are spliced into it.

The document is prose written by hand with generated blocks between markers::

    <!-- BEGIN generated:sec4 -->
    ... (rewritten by `python -m reproduction --docs-only`) ...
    <!-- END generated:sec4 -->

:func:`render_blocks` makes every block from the result files (through the claims) and the
config (the commands); :func:`update_document` replaces the blocks' contents and leaves the
prose alone. ``reproduction/tests/test_reproduce_docs.py`` renders the blocks from the committed result files
and checks that the document holds exactly them.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from headlab import HeadlabError
from headlab.resume import SkipStage
from reproduction.claims import Claim
from reproduction.config import ReproduceConfig
from reproduction.results import ModelResults
from reproduction.stages import STAGES, Context, stage_commands
from reproduction.vig import claim_vig, vig_models

__all__ = ["render_blocks", "vig_claim", "update_document", "read_blocks", "BLOCK"]

BLOCK = re.compile(r"<!-- BEGIN generated:(?P<name>[\w.\-]+) -->\n(?P<body>.*?)<!-- END generated:(?P=name) -->",
                   re.DOTALL)

STAGE_ORDER = tuple(name for name in STAGES if name != "report")
PYTHON_STAGES = {"specialisation": "reproduction.specialisation", "hypotheses": "reproduction.significance"}


def _cell(value: str) -> str:
    return value.replace("|", "\\|")


def _verdict(text: str) -> str:
    head, _, rest = text.partition(":")
    if head in ("holds", "partly", "does not hold", "no difference", "inconclusive", "not testable", "not run"):
        return f"**{head}**" + (f":{rest}" if rest else "")
    return text


def _claim_block(claim: Claim, models: list[str], config: ReproduceConfig) -> str:
    lines = [f"*Stages:* {', '.join(f'`{s}`' for s in claim.stages)} "
             f"(`python -m reproduction --stages {','.join(claim.stages)},report`).", ""] if claim.stages else []
    for note in claim.notes:
        lines += [note, ""]
    lines.append("| check | paper | " + " | ".join(models) + " |")
    lines.append("|---|---|" + "---|" * len(models))
    for check in claim.checks:
        cells = []
        for model in models:
            cell = check.cells.get(model)
            if cell is None:
                cells.append("")
            elif cell.verdict == "-":
                cells.append(_cell(cell.value))
            elif not cell.value:
                cells.append(_cell(_verdict(cell.verdict)))
            else:
                cells.append(_cell(cell.value) + " — " + _cell(_verdict(cell.verdict)))
        label = check.label + (f" <br>*criterion: {check.criterion}*" if check.criterion else "")
        lines.append(f"| {_cell(label)} | {_cell(check.paper)} | " + " | ".join(cells) + " |")
    for model in models:
        if model in claim.details or model in claim.figures:
            lines += ["", f"**{model}**", ""]
            lines += claim.details.get(model, [])
            if model in claim.figures:
                name = f"reproduction-{model}-{claim.figures[model]}.png"
                lines += ([""] if claim.details.get(model) else []) + [f"![{claim.title}, {model}](img/{name})"]
    return "\n".join(lines) + "\n"


# The title's test (issue 35): experiments/heavy_lifting_lm.py report writes it; its rules were
# committed before the runs in experiments/heavy_lifting_lm.md.
HEAVY_LIFTING = Path(__file__).resolve().parents[1] / "docs" / "results" / "heavy-lifting" / "results.json"
# The plan's step after an inconclusive H1: every run at each k again for two epochs (H1 on them).
HEAVY_LIFTING_EPOCH2 = HEAVY_LIFTING.parent / "epoch2" / "results.json"
# The same test on the translation encoder (decoder frozen) and the fair Table 2: experiments/heavy_lifting_nmt.py
# report writes it; its rules: experiments/heavy_lifting_nmt.md.
HEAVY_LIFTING_NMT = HEAVY_LIFTING.parents[1] / "heavy-lifting-nmt" / "results.json"
# The document that opens with those rows: they test other models (english-lm, multi30k-en-de) and
# link relative to docs/, so another config's report (experiments/news-reproduce.json) leaves them out.
MAIN_DOC = HEAVY_LIFTING.parents[2] / "reproduction.md"


def _nmt_rows(path: Path) -> list[str]:
    """The translation rows of the title's test: H1 (gates against k random and least specialised encoder heads,
    decoder frozen) and H3 (pruned against from scratch with the full model's recipe), verdicts as the report gives;
    those of the plan's stage 2 beside it (``stage-2/results.json``: every run of H1 continued to 1,728 updates, H3's
    encoder point with them; ``report --stage 2 --out .../stage-2``) where it exists, which the plan decides on."""
    stage2 = path.parent / "stage-2" / "results.json"
    later = stage2.is_file()
    results = ("[results.md](results/heavy-lifting-nmt/results.md), stage 2, every run continued to 1,728 updates: "
               "[stage-2/results.md](results/heavy-lifting-nmt/stage-2/results.md)" if later else
               "[results.md](results/heavy-lifting-nmt/results.md)")
    test = ("| multi30k-en-de | the same with the decoder frozen: the gated encoder against k random or least-specialised "
            "encoder heads, same fine-tuning (rules: [heavy_lifting_nmt.md](../experiments/heavy_lifting_nmt.md), results: "
            f"{results}) | k random heads (3 seeds), the k least specialised |")
    if not path.is_file():
        return [f"{test} not run (no results.json) |"]
    result = json.loads((stage2 if later else path).read_text(encoding="utf-8"))
    h1, h3 = result["h1_verdict"], result["h3_verdict"]
    missing = f": {', '.join(result['missing'])}" if result.get("missing") else ""
    at = "stage 2: " if later else ""
    return [f"{test} {_cell(h1['verdict'])} ({at}{h1['why']}) |",
            "| multi30k-en-de | Table 2, fair: pruned against the same heads trained from scratch with the full model's "
            f"recipe | from scratch, {len(result['h3'])} points | {_cell(h3['verdict'])} ({at}{h3['why']}{missing}) |"]


def _title_rows(path: Path = HEAVY_LIFTING, epoch2: Path = HEAVY_LIFTING_EPOCH2,
                nmt: Path = HEAVY_LIFTING_NMT) -> list[str]:
    """The first rows of the summary: does the title's claim hold, per model, with its controls."""
    lines = ["The title's claim, specialised heads do the heavy lifting (rules fixed before the runs: "
             "[heavy_lifting_lm.md](../experiments/heavy_lifting_lm.md), results: "
             "[results.md](results/heavy-lifting/results.md)):", "",
             "| model | test | controls | verdict |", "|---|---|---|---|"]
    if not path.is_file():
        return lines + ["| english-lm | the three tests | - | not run (no results.json) |"]
    result = json.loads(path.read_text(encoding="utf-8"))
    h1, h2, h3 = result["h1"], result["h2"], result["h3"]
    epochs = "one epoch"
    if epoch2.is_file():  # the second epoch supersedes the first for the trained comparisons
        second = json.loads(epoch2.read_text(encoding="utf-8"))
        h1, epochs = second["h1"], "two epochs, the plan's step after one"  # H2 and H3 stand on the first
        lines[0] = lines[0].replace("):", ", [second epoch](results/heavy-lifting/epoch2/results.md)):")
        result = second
    lead = [row["newstest2019"]["difference"] for row in h1["comparisons"]]
    h1_detail = (f" (gates - control on newstest2019 from {min(lead):+.3f} to {max(lead):+.3f} nats" if lead else "")
    if lead and "h1_without_settling" in result:
        h1_detail += f"; with every run taken as settled: {result['h1_without_settling']['verdict']}"
    h1_detail += ")" if lead else ""
    kept = ", ".join(f"{row['primary']['labelled_kept']} of 6 kept at {row['kept']} heads"
                     for row in sorted(h2["rows"], key=lambda row: -row["kept"]) if row["run"].startswith("gates-keep"))
    p3 = " / ".join(f"{h3[name]['p']:.2f}" for name in ("newstest2019", "ewt-test") if name in h3)
    lines += [
        f"| english-lm | H1: the gated model beats both controls at 24, 12 and 6 heads, same fine-tuning ({epochs}) | "
        f"k random heads (3 seeds), the k least specialised | {_cell(h1['verdict'])}{h1_detail} |",
        f"| english-lm | H2: the gates keep the 6 labelled (specialised) heads more often than chance | "
        f"hypergeometric chance | {_cell(h2['verdict'])} ({kept}) |",
        f"| english-lm | H3: removing the 6 labelled heads costs more than removing 6 random heads | "
        f"39 random sets, no fine-tuning | {_cell(h3['verdict'])} (p = {p3}) |",
        *_nmt_rows(nmt), ""]
    return lines


def _summary_block(claims: list[Claim], models: list[str], vig: Claim, vig_names: list[str], *,
                   title_rows: bool = True) -> str:
    lines = (_title_rows() if title_rows else []) + ["Voita et al. 2019:", ""] + _summary_rows(claims, models)
    lines += ["", "Vig and Belinkov 2019" + ("" if vig_names else " (no model has aggregate files yet)") + ":", ""]
    lines += _summary_rows([vig], vig_names)
    return "\n".join(lines) + "\n"


def _summary_rows(claims: list[Claim], models: list[str]) -> list[str]:
    lines = ["| section | check |" + "".join(f" {m} |" for m in models), "|---|---|" + "---|" * len(models)]
    for claim in claims:
        for check in claim.checks:
            if not check.criterion:  # a number without a verdict
                continue
            verdicts = [check.cells[m].verdict if m in check.cells else "" for m in models]
            short = [v.split(":")[0] if v != "-" else "" for v in verdicts]
            lines.append(f"| [{claim.key}](#{_anchor(claim.title)}) | {_cell(check.label)} |" +
                         "".join(f" {v} |" for v in short))
    return lines


def _anchor(title: str) -> str:
    text = re.sub(r"[^\w\- ]", "", title.lower()).strip()
    return text.replace(" ", "-")


def _timings_block(results: dict[str, ModelResults]) -> str:
    models = list(results)
    lines = ["| stage | " + " | ".join(models) + " |", "|---|" + "---:|" * len(models)]
    totals = {m: 0.0 for m in models}
    for stage in STAGE_ORDER:
        cells = []
        for m in models:
            entry = results[m].timings.get(stage)
            if entry and entry.get("seconds") is not None:
                totals[m] += entry["seconds"]
                cells.append(f"{entry['seconds'] / 60:.1f} min")
            else:
                cells.append("not run by the pipeline")
        lines.append(f"| {stage} | " + " | ".join(cells) + " |")
    lines.append("| total measured | " + " | ".join(f"{totals[m] / 60:.1f} min" if totals[m] else "—"
                                                 for m in models) + " |")
    return "\n".join(lines) + "\n"


def _commands_block(config: ReproduceConfig) -> str:
    lines = []
    for model in config.models:
        lines += [f"**{model.name}**", "", "```bash"]
        ctx = Context(config, model, dry_run=True, from_results=True)
        for stage in STAGE_ORDER:
            try:
                texts = stage_commands(ctx, stage)
            except SkipStage as reason:
                texts = [f"# {stage}: not run: {reason}"]
            if STAGES[stage].python is not None:
                module = PYTHON_STAGES.get(stage, "reproduction.stages")
                texts = [f"# {stage}: Python stage ({module}), "
                         f"run by `python -m reproduction --stages {stage}`"]
            lines += [f"# {stage}"] + texts
        lines += ["```", ""]
    return "\n".join(lines)


def vig_claim(config: ReproduceConfig) -> tuple[Claim, list[str]]:
    """Vig and Belinkov's findings for every model with aggregate files, and those models."""
    directories = vig_models(config.results())
    return claim_vig(directories), list(directories)


def render_blocks(config: ReproduceConfig, claims: list[Claim], results: dict[str, ModelResults]) -> dict[str, str]:
    """Every generated block of the document, by name."""
    models = list(results)
    vig, vig_names = vig_claim(config)
    main_doc = config.path(config.doc).resolve() == MAIN_DOC.resolve()
    blocks = {"summary": _summary_block(claims, models, vig, vig_names, title_rows=main_doc),
              "timings": _timings_block(results),
              "commands": _commands_block(config)}
    for claim in claims:
        blocks[claim.key] = _claim_block(claim, models, config)
    blocks[vig.key] = _claim_block(vig, vig_names, config)
    return blocks


def read_blocks(text: str) -> dict[str, str]:
    return {m.group("name"): m.group("body") for m in BLOCK.finditer(text)}


def update_document(text: str, blocks: dict[str, str], source: str = "document") -> str:
    """Replace the body of every generated block; a block without its markers is an error."""
    present = read_blocks(text)
    missing = [name for name in blocks if name not in present]
    if missing:
        raise HeadlabError(f"{source}: no markers for generated blocks {', '.join(missing)} "
                           f"(add '<!-- BEGIN generated:NAME -->' / '<!-- END generated:NAME -->')")

    def replace(match: re.Match) -> str:
        name = match.group("name")
        body = blocks.get(name, match.group("body"))
        return f"<!-- BEGIN generated:{name} -->\n{body}<!-- END generated:{name} -->"

    return BLOCK.sub(replace, text)
