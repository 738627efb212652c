"""Helpers shared by the tests (fixtures live in tests/conftest.py):

* :mod:`support.models` - tiny random models of every supported family, built from configs;
* :mod:`support.nmt` - a tiny Marian model and tokenizer trained on 300 Multi30k pairs;
* :mod:`support.treebank` - CoNLL-U samples, word/BPE tokenizers, forced attention patterns;
* :mod:`support.bad_input` - saved tiny models, unwritable directories, no-model-loading guards;
* :mod:`support.report` - a synthetic analysis directory for the report tests.
"""
