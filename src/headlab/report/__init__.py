"""The HTML report of an analysis directory, with an attention viewer.

Two entry points, used by ``headlab analyze``:

* :func:`write_attention_examples` captures the attention of a few sentences and stores it,
  quantised to ``uint8``, under ``ANALYSIS_DIR/attention/`` (see :mod:`headlab.report.examples`);
* :func:`build_report` reads everything an analysis directory holds (any file may be missing)
  and writes ``ANALYSIS_DIR/index.html`` (see :mod:`headlab.report.build`).

The data format and what the report shows are described in docs/report.md.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

__all__ = ["build_report", "write_attention_examples", "load_example"]


def write_attention_examples(
    model,
    tokenizer,
    sources: Sequence[str],
    targets: Sequence[str] | None,
    out_dir: Path,
    max_sentences: int = 20,
) -> list[str]:
    """Capture and store the attention of up to ``max_sentences`` sentences under ``out_dir``.

    For an encoder-decoder model the decoder is teacher-forced on ``targets`` (or, without
    targets, on the model's own greedy translation), giving ``enc_self``, ``dec_self`` and
    ``dec_cross``. Returns the written paths relative to ``out_dir``'s parent.
    """
    from headlab.report.examples import write_attention_examples as _write

    return _write(model, tokenizer, sources, targets, Path(out_dir), max_sentences=max_sentences)


def load_example(path: Path):
    """One stored sentence as ``(tokens, {(kind, layer): float array [heads, q, k]})``."""
    from headlab.report.examples import load_example as _load

    return _load(Path(path))


def build_report(analysis_dir: Path) -> Path:
    """Write ``analysis_dir/index.html`` from whatever the directory holds; return its path."""
    from headlab.report.build import build_report as _build

    return _build(Path(analysis_dir))
