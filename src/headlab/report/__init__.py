"""The HTML report of an analysis directory, with an attention viewer.

Two entry points, used by ``headlab analyze``:

* :func:`write_attention_examples` captures the attention of a few sentences and stores it,
  quantised to ``uint8``, under ``ANALYSIS_DIR/attention/`` (see :mod:`headlab.report.examples`);
* :func:`build_report` reads everything an analysis directory holds (any file may be missing)
  and writes ``ANALYSIS_DIR/index.html`` (see :mod:`headlab.report.build`).

The data format and what the report shows are described in docs/report.md.
"""

from headlab._lazy import lazy_exports

_EXPORTS = {  # module -> the names it exports
    "headlab.report.build": ("build_report",),
    "headlab.report.examples": ("load_example", "write_attention_examples"),
}

__getattr__, __dir__, __all__ = lazy_exports(__name__, _EXPORTS)
