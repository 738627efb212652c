"""Raw text to Universal Dependencies parses (``headlab parse``), with a spaCy pipeline.

The syntactic head test (:mod:`headlab.functions.syntactic`) needs dependency trees of the text
a model reads. The paper parsed its own in-domain text with CoreNLP; :func:`parse_text_file`
does the same with a spaCy pipeline trained on UD English EWT (``models/ewt-parser``, recipe in
``experiments/parser/``), writing CoNLL-U that :func:`headlab.data.treebank.read_conllu` reads.

spaCy is an optional dependency (the ``parse`` extra); it is imported only when a parse runs.
"""

from headlab.parse.core import (
    ParseReport,
    check_pipeline_dir,
    import_spacy,
    load_pipeline,
    parse_lines,
    parse_text_file,
    to_conllu,
)

__all__ = ["ParseReport", "check_pipeline_dir", "import_spacy", "load_pipeline", "parse_lines", "parse_text_file",
           "to_conllu"]
