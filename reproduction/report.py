"""The report stage: collect the small results, compute the claims, write the document and figures.

``python -m reproduction --docs-only`` runs only the last two steps, from the committed result files.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

from headlab.heads import atomic_write_text
from reproduction.claims import Claim, compute_claims
from reproduction.config import ReproduceConfig
from reproduction.render import render_blocks, update_document, vig_claim
from reproduction.results import ModelResults, collect_results

__all__ = ["load_results", "write_report", "claims_json", "document_template"]


def load_results(config: ReproduceConfig) -> dict[str, ModelResults]:
    split = config.prune.get("eval_split", "test")
    parsed = config.parse_split
    return {m.name: ModelResults(config.results(m), m.name,
                                 references=config.data_file(split, m.tgt) if split in config.data else None,
                                 train_history=config.path(m.path) / "train_history.json",
                                 model_dir=config.path(m.path),
                                 parsed_text=config.rel(config.data_file(parsed, m.src)) if parsed in config.data else None)
            for m in config.models}


def claims_json(claims: list[Claim]) -> dict:
    """Every check's numbers and verdicts, for scripts (``<results_dir>/claims.json``)."""
    return {
        "claims": [
            {"key": c.key, "title": c.title, "statement": c.statement, "stages": c.stages,
             "checks": [{"label": k.label, "paper": k.paper, "criterion": k.criterion,
                         "models": {m: {"value": cell.value, "verdict": cell.verdict} for m, cell in k.cells.items()}}
                        for k in c.checks]}
            for c in claims
        ]
    }


def document_template(names: list[str]) -> str:
    """A bare document with one marker pair per block (when the configured document does not exist)."""
    parts = ["# Reproduction of Voita et al. 2019", ""]
    for name in names:
        parts += [f"## {name}", "", f"<!-- BEGIN generated:{name} -->", f"<!-- END generated:{name} -->", ""]
    return "\n".join(parts)


def write_report(config: ReproduceConfig, models: list[str] | None = None, *, collect: bool = True,
                 figures: bool = True, log: Callable[[str], None] = print) -> list[Path]:
    """Collect (unless ``collect=False``) the results of ``models`` (default: all); then render
    every model of the config into the document, ``claims.json`` and the figures."""
    written: list[Path] = []
    if collect:
        for entry in config.models:
            if models is None or entry.name in models:
                written += collect_results(config, entry, log=log)
    results = load_results(config)
    claims = compute_claims(results)
    blocks = render_blocks(config, claims, results)
    doc = config.path(config.doc)
    text = doc.read_text(encoding="utf-8") if doc.is_file() else document_template(list(blocks))
    new = update_document(text, blocks, str(doc))
    if not doc.is_file() or new != text:
        atomic_write_text(doc, new)
        written.append(doc)
    path = config.results() / "claims.json"
    data = json.dumps(claims_json([*claims, vig_claim(config)[0]]), indent=1, ensure_ascii=False) + "\n"
    if not path.is_file() or path.read_text(encoding="utf-8") != data:
        atomic_write_text(path, data)
        written.append(path)
    if figures:
        from reproduction.figures import save_figures

        written += save_figures(claims, results, config.path(config.img_dir))
    log(f"wrote {doc} ({len(blocks)} generated blocks) and {path}")
    return written
