"""A misspelt keyword of the Python API (headlab.analyze(model, engin="fused")) is headlab's error
naming the option and its close match, as the command line names a misspelt flag, raised before
any work; the functions keep their signatures (headlab.options.checked_keywords)."""

import inspect
import pydoc
import re

import pytest

import headlab
import headlab.api as api
from headlab.errors import HeadlabError

NOT_CHECKED = {"attention_blocks", "load_pruned"}
"""headlab.adapters is another helper's scope (session 22): its one export is not decorated yet.
load_pruned's ``**config_overrides`` are the fields of the directory's config: checked when it is
read (test_load_pruned_refuses_a_config_override_the_config_lacks)."""


def _public_functions():
    """Every function that ``import headlab`` exports or headlab.api defines publicly, and the
    methods of Analysis that take arguments."""
    found = {}
    for name in [*headlab.__all__, *api.__all__]:
        obj = getattr(headlab, name, None) or getattr(api, name)
        if (inspect.isfunction(obj) or inspect.ismodule(obj) and callable(obj)) and name not in NOT_CHECKED:
            found[name] = obj
    for name in ("load", "save", "top_heads"):
        found[f"Analysis.{name}"] = getattr(api.Analysis, name)
    return found


FUNCTIONS = _public_functions()


def test_every_public_function_is_covered():
    # the callable packages, the one-call API and the foundation's functions
    assert {"analyze", "importance", "functions", "aggregate", "prune", "capture_attention", "mask_heads",
            "prune_heads", "save_pruned", "save_adapter", "load_adapter", "Analysis.save"} <= set(FUNCTIONS)
    assert len(FUNCTIONS) == 22  # language_model_of since session 39


@pytest.mark.parametrize("name", sorted(FUNCTIONS))
def test_a_misspelt_keyword_names_the_option_and_its_close_match(name):
    function = FUNCTIONS[name]
    parameters = [p for p in inspect.signature(function).parameters.values()
                  if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.name not in ("self", "cls")]
    misspelt = parameters[-1].name + "x"
    # No other argument: the keyword is checked before the function looks at any of them.
    with pytest.raises(HeadlabError, match=rf"unknown option '{misspelt}'; did you mean '{parameters[-1].name}'") as caught:
        function(**{misspelt: 1})
    assert isinstance(caught.value, TypeError)  # what Python raised: code that catches it still does
    assert caught.value.exit_code == 2


@pytest.mark.parametrize("name", sorted(FUNCTIONS))
def test_the_signature_is_the_functions_own(name):
    function = FUNCTIONS[name]
    real = getattr(api, name) if inspect.ismodule(function) else inspect.unwrap(function)
    expected = inspect.signature(real)
    if inspect.ismethod(function):  # Analysis.load, bound to the class
        expected = expected.replace(parameters=list(expected.parameters.values())[1:])
    assert inspect.signature(function) == expected
    assert "(*args, **keywords)" not in str(inspect.signature(function))
    if not inspect.ismodule(function):  # help() shows the parameters
        assert _flat(str(inspect.signature(function)))[:40] in _flat(pydoc.plain(pydoc.render_doc(function)))


def _flat(text: str) -> str:
    """``text`` without quotes or white space: Python 3.13's pydoc puts a long signature one parameter a line."""
    return re.sub(r"\s+", "", text.replace("'", ""))


@pytest.mark.parametrize("function, keyword, suggestion", [
    (headlab.importance, "engin", "engine"),  # through **options, to ImportanceConfig
    (headlab.importance, "lrp_target", "lrp_targets"),  # a measure's own option (a plug-in's)
    (headlab.importance, "methods", "measures"),  # ImportanceConfig's name for it: the API's is measures
    (headlab.functions, "engin", "engine"),  # through **options, to AnalysisConfig
    (headlab.aggregate, "batchsize", "batch_size"),
    (headlab.aggregate, "min_weigth", "min_weight"),
    (headlab.analyze, "engin", "engine"),
])
def test_options_passed_on_are_checked_before_any_work(function, keyword, suggestion):
    with pytest.raises(HeadlabError, match=rf"unknown option '{keyword}'; (did you mean '|it takes .*){suggestion}"):
        function(None, None, [], **{keyword: 1})


def test_options_passed_on_still_reach_the_config():
    for function, keyword in ((headlab.importance, "lrp_targets"), (headlab.importance, "engine"),
                              (headlab.functions, "engine"), (headlab.aggregate, "min_weight")):
        with pytest.raises(HeadlabError, match="model: expected a transformers model"):  # past the check
            function(None, None, [], **{keyword: 1})


def test_a_keyword_set_by_the_function_itself_is_refused():
    # it reached the config twice: "got multiple values for keyword argument 'functions'"
    with pytest.raises(HeadlabError, match="unknown option 'functions'"):
        headlab.functions(None, None, [], functions=False)


def test_load_pruned_refuses_a_config_override_the_config_lacks(tmp_path):
    from support.bad_input import save_tiny_pruned

    path = save_tiny_pruned(tmp_path / "pruned")
    # transformers dropped it without a word: loaded as if trust_remote_code had been given
    with pytest.raises(HeadlabError, match="unknown option 'trust_remote_cod'.*did you mean 'trust_remote_code'"):
        headlab.load_pruned(path, trust_remote_cod=True)
    assert headlab.load_pruned(path, dropout=0.25).config.dropout == 0.25  # a field it has: applied


def test_a_function_with_open_keywords_must_name_them():
    from headlab.options import checked_keywords

    def open_ended(**anything):
        return anything

    with pytest.raises(TypeError, match="give checked_keywords the names"):
        checked_keywords()(open_ended)


@pytest.mark.parametrize("call, expected", [
    (dict(texts=["a dog"], treebank_limit=2), "treebank_limit goes with the treebank"),
    (dict(texts=["a dog"], frequency_texts=["a dog"]), "frequency_texts goes with the rare-token heads"),
    (dict(treebank="TB", statistics=("aggregate",), frequency_texts=["a dog"]), "frequency_texts goes with"),
    (dict(treebank="TB", targets=["ein hund"]), "targets goes with the texts"),
    (dict(treebank="TB", labels=[0]), "labels goes with the texts"),
    (dict(texts=["a dog"], measures=("confidence",), lrp_targets=2), "lrp_targets goes with measure 'lrp'"),
    (dict(treebank="TB", lrp_seed=3), "lrp_seed goes with measure 'lrp' on the texts"),
])
def test_analyze_refuses_an_argument_of_a_part_it_does_not_compute(call, expected, monkeypatch):
    """Regression: headlab.analyze(model, tokenizer, texts, treebank_limit=20) without a treebank (and
    the like) computed without it and said nothing, as if it had been used."""
    import headlab.api
    from support.bad_input import WORDS
    from support.models import tiny_model
    from support.treebank import SAMPLE_CONLLU, word_tokenizer

    monkeypatch.setattr(headlab.api, "model_info", lambda *a, **k: pytest.fail("the work started"))
    monkeypatch.setattr(headlab.api, "functions", lambda *a, **k: pytest.fail("the work started"))
    monkeypatch.setattr(headlab.api, "aggregate", lambda *a, **k: pytest.fail("the work started"))
    call = {k: SAMPLE_CONLLU if v == "TB" else v for k, v in call.items()}
    with pytest.raises(HeadlabError, match=f"^analyze: {expected}.*which this call does not compute; leave it out"):
        headlab.analyze(tiny_model("marian"), word_tokenizer(WORDS), **call)
