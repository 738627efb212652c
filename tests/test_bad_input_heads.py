"""Bad-input catalogue, head specs and mask files: wrong types, out of range, duplicates,
zero-head layers and kinds, a model path that does not exist, an unwritable --out."""

import json

import pytest

from headlab.adapters import attention_blocks
from headlab.cli import main
from headlab.errors import HeadlabError
from headlab.headspec import load_mask_file, parse_heads
from headlab.loading import load_model
from support.bad_input import SENTENCES, files_under, forbid_model_loading, save_tiny_marian, unwritable, world_readable_dir
from support.models import tiny_model
from support.treebank import SAMPLE_CONLLU, word_tokenizer


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_marian(tmp_path_factory.mktemp("heads-model") / "m")


@pytest.fixture(scope="module")
def blocks():
    return attention_blocks(tiny_model("marian"))


def _mask(tmp_path, data, name="mask.json"):
    path = tmp_path / name
    path.write_text(json.dumps(data) if not isinstance(data, str) else data, encoding="utf-8")
    return path


# One row per wrong mask file: its content and what the message must name besides the file.
BAD_MASKS = {
    "float-and-bool-heads": ({"enc_self": {"0": [1.7, True]}}, "enc_self: layer '0': expected a list of head numbers"),
    "string-head": ({"enc_self": {"0": ["a"]}}, "enc_self: layer '0': expected a list of head numbers"),
    "top-level-list": (["a"], "expected an object keyed by attention kind, found list"),
    "head-out-of-range": ({"enc_self": {"1": [4]}}, "layer '1': enc_self layer 1 has no head 4"),
    "negative-head": ({"enc_self": {"0": [-1]}}, "has no head -1"),
    "layer-out-of-range": ({"dec_cross": {"2": [0]}}, "dec_cross: dec_cross has no layer 2"),
    "layer-not-a-number": ({"enc_self": {"first": [0]}}, "layer 'first': a layer key is a layer number"),
    "unknown-kind": ({"encoder": {"0": [0]}}, "unknown attention kind 'encoder'"),
    "keep-matrix-values": ({"enc_self": [[1, 0.5, 1, 1], [1, 1, 1, 1]]}, "a keep-mask holds only 0 and 1"),
    "keep-matrix-layers": ({"enc_self": [[1, 0, 1, 1]]}, "enc_self mask has 1 layer; the model has 2"),
    "invalid-json": ('{"enc_self": {"0": [1,}}', "line 1: invalid JSON"),
    # regressions: "²".isdigit() is true and int("²") a ValueError (an internal error); a row that
    # is not a list was said to have "5 entries"
    "layer-superscript-digit": ({"enc_self": {"\u00b2": [0]}}, "layer '\u00b2': a layer key is a layer number"),
    "keep-matrix-row-not-a-list": ({"enc_self": [[1, 1, 1, 1], 5]}, "enc_self layer 1: expected a list of 4 0/1 "
                                                                    "entries, found 5"),
}


@pytest.mark.parametrize("row", sorted(BAD_MASKS))
def test_bad_mask_file_names_file_and_key(row, tmp_path, blocks):
    """Regression: [1.7, true] was accepted (int() without a type check) and ["a"] gave an
    error naming neither the file nor the key."""
    data, message = BAD_MASKS[row]
    path = _mask(tmp_path, data)
    with pytest.raises(HeadlabError) as error:
        parse_heads(str(path), blocks)
    assert str(error.value).startswith(f"{path}: ") and message in str(error.value)


def test_duplicates_count_once(tmp_path, blocks):
    assert load_mask_file(_mask(tmp_path, {"enc_self": {"0": [2, 1, 2, 1]}}), blocks) == {("enc_self", 0): [1, 2]}
    assert parse_heads("enc_self:0:1,1,1-2 enc_self:0:2", blocks) == {("enc_self", 0): [1, 2]}


def test_prune_apply_says_when_a_head_is_named_twice(model_dir, tmp_path, capsys):
    """Regression (audit31): "enc_self:0:1,1" (meant: 1,2) removed one head, said only as "removed 1 head": a head
    named twice is still removed once (ranges may overlap on purpose), and the command now says so."""
    from headlab.headspec import repeated_heads

    assert repeated_heads("enc_self:0:1,1 enc_self:0:1-2 dec_cross:1:0", None) == ["enc_self:0:1"]
    assert repeated_heads("enc_self:0:1,2 dec_cross:1:0", None) == []
    assert main(["prune", "apply", str(model_dir), "--heads", "enc_self:0:1,1", "--out", str(tmp_path / "p")]) == 0
    captured = capsys.readouterr()
    assert "headlab prune: --heads names enc_self:0:1 more than once; each head is removed once" in captured.err
    assert "removed 1 head;" in captured.out
    assert main(["prune", "apply", str(model_dir), "--heads", "enc_self:0:1,2", "--out", str(tmp_path / "q")]) == 0
    assert "more than once" not in capsys.readouterr().err


def test_prune_apply_says_when_a_mask_file_names_a_head_twice(model_dir, tmp_path, capsys):
    """Regression (resume31): a mask file's {"0": [1, 1]} was deduplicated without the note a typed spec gets."""
    from headlab.headspec import repeated_heads

    mask = _mask(tmp_path, {"enc_self": {"0": [1, 1, 2]}, "dec_cross": [[1, 0, 1, 1]] * 2})
    assert repeated_heads(str(mask), None) == ["enc_self:0:1"]
    assert main(["prune", "apply", str(model_dir), "--heads", str(mask), "--out", str(tmp_path / "p")]) == 0
    assert "--heads names enc_self:0:1 more than once; each head is removed once" in capsys.readouterr().err


def test_spaces_around_commas_and_dashes_of_a_typed_spec(blocks):
    """Regression (qa6): "enc_self:0:1, 2" said "bad head index ''" (the space split it into two
    items); a space around an item's comma or dash now belongs to that item."""
    expected = {("enc_self", 0): [1, 2], ("dec_cross", 1): [0, 1, 2]}
    for spec in ("enc_self:0:1, 2 dec_cross:1:0 - 2", "enc_self:0:1 ,2; dec_cross:1:0 -2", "enc_self:0:1,2 dec_cross:1:0-2"):
        assert parse_heads(spec, blocks) == expected
    with pytest.raises(HeadlabError, match="a comma with no head index after or before it in 'enc_self:0:1,'"):
        parse_heads("enc_self:0:1,", blocks)


@pytest.mark.parametrize("spec,message", [
    ("enc_self:0:4", "enc_self layer 0 has no head 4 (its heads are 0..3)"),
    ("enc_self:0:2-9", "has no head 4"),
    ("enc_self:5:0", "enc_self has no layer 5"),
    ("enc_self:0:1,x", "cannot read 'enc_self:0:1,x'"),
    ("enc_self:0:1,,2", "a comma with no head index after or before it in 'enc_self:0:1,,2'"),
    ("enc_self:0:3-1", "bad range '3-1'"),
    ("enc_self:0", "cannot read 'enc_self:0'"),
    ("", "empty head spec"),
])
def test_bad_typed_spec(spec, message, blocks):
    with pytest.raises(HeadlabError, match="^--heads") as error:
        parse_heads(spec, blocks)
    assert message in str(error.value)


@pytest.mark.parametrize("heads,message", [([1.7], "head 1.7 is not an integer"),
                                           ([True], "head True is not an integer"),
                                           (["1"], "head '1' is not an integer")])
def test_python_head_specs_refuse_what_is_not_an_integer(heads, message):
    """Regression: prune_heads, mask_heads and headlab.prune took head 1.7, True and "1" for head 1
    (int() without a type check), as mask files once did: another head than the one meant."""
    import headlab
    from headlab import mask_heads, prune_heads

    for call in (lambda m, spec: prune_heads(m, spec), lambda m, spec: mask_heads(m, spec).__enter__(),
                 lambda m, spec: headlab.prune(m, spec)):
        model = tiny_model("marian")
        with pytest.raises(HeadlabError, match=f"enc_self layer 0: {message}"):
            call(model, {("enc_self", 0): heads})
        assert [b.n_heads for b in attention_blocks(model)][0] == 4
    with pytest.raises(HeadlabError, match="layer 0.5 is not an integer"):
        prune_heads(tiny_model("marian"), {("enc_self", 0.5): [1]})
    import numpy as np
    import torch

    model = tiny_model("marian")  # integers of numpy and torch are integers
    assert prune_heads(model, {("enc_self", np.int64(0)): [np.int64(1), torch.tensor(2)]}) == {("enc_self", 0): [0, 3]}


def test_cli_counts_removed_heads_right_and_refuses_wrong_types(model_dir, tmp_path, capsys):
    """Regression: {"enc_self": {"0": [1.7, true]}} exited 0 with "removed 2 heads" while one
    head was removed."""
    bad = _mask(tmp_path, {"enc_self": {"0": [1.7, True]}})
    assert main(["prune", str(model_dir), "--heads", str(bad), "--out", str(tmp_path / "bad")]) == 2
    assert f"{bad}: enc_self: layer '0'" in capsys.readouterr().err
    assert files_under(tmp_path / "bad") == set()
    dup = _mask(tmp_path, {"enc_self": {"0": [1, 1]}}, "dup.json")
    assert main(["prune", str(model_dir), "--heads", str(dup), "--out", str(tmp_path / "dup")]) == 0
    assert "removed 1 head;" in capsys.readouterr().out
    pruned = load_model(str(tmp_path / "dup"))
    assert [b.n_heads for b in attention_blocks(pruned) if b.kind == "enc_self"] == [3, 4]


def test_zero_head_layer_and_kind(model_dir, tmp_path, capsys):
    """A layer pruned to zero heads stays usable (listing, analysis) and names no head any more;
    a kind the model lacks is refused by name."""
    out = tmp_path / "zero"
    assert main(["prune", str(model_dir), "--heads", "enc_self:0:* dec_cross:1:*", "--out", str(out)]) == 0
    capsys.readouterr()
    assert main(["heads", str(out), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["kind"], r["layer"]) for r in rows if r["n_heads"] == 0] == [("enc_self", 0), ("dec_cross", 1)]
    assert main(["prune", str(out), "--heads", "enc_self:0:0", "--out", str(tmp_path / "again")]) == 2
    assert "enc_self:0: head 0 already removed; that layer has no heads left" in capsys.readouterr().err
    conllu = tmp_path / "tb.conllu"
    conllu.write_text(SAMPLE_CONLLU, encoding="utf-8")
    assert main(["functions", str(out), "--conllu", str(conllu), "--out", str(tmp_path / "f"), "--no-progress",
                 "--no-figures"]) == 0
    capsys.readouterr()
    bert = tmp_path / "bert"
    tiny_model("bert").save_pretrained(bert)
    words = [w for s in SENTENCES for w in s.split()]
    word_tokenizer(words, style="bert").save_pretrained(bert)
    data = tmp_path / "data.txt"
    data.write_text("\n".join(SENTENCES) + "\n", encoding="utf-8")
    assert main(["importance", str(bert), "--data", str(data), "--out", str(tmp_path / "i"), "--kinds", "dec_self",
                 "--no-progress"]) == 2
    assert "--kinds dec_self: the model has no dec_self heads (it has enc_self)" in capsys.readouterr().err
    assert files_under(tmp_path / "i") == set()


def test_model_path_that_does_not_exist(tmp_path, capsys):
    """Regression: `headlab heads models/nonexistent` answered "Repo id must be in the form..."."""
    assert main(["heads", "models/nonexistent"]) == 2
    assert "models/nonexistent: no such model directory, and not a model id" in capsys.readouterr().err
    assert main(["heads", str(tmp_path)]) == 2
    assert f"{tmp_path}: a directory without config.json" in capsys.readouterr().err


def _refused_before_loading(model, spec, message, tmp_path, capsys) -> None:
    """`prune apply MODEL --heads SPEC` (``bad.json``: a missing mask file) is exit 2 with ``message``, nothing written."""
    code = main(["prune", "apply", str(model), "--heads", spec if spec != "bad.json" else str(tmp_path / spec),
                 "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 2 and message in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("spec,message", [("enc_self:0:7", "enc_self layer 0 has no head 7"),
                                          ("dec_cross:5:0", "dec_cross has no layer 5"),
                                          ("bad.json", "no such mask file")])
def test_prune_refuses_a_head_the_model_lacks_before_loading(spec, message, model_dir, tmp_path, capsys, monkeypatch):
    """Regression: the spec was checked against the loaded model, after reading every weight
    (minutes for a large checkpoint); the structure built from the config (no weights) has the heads."""
    forbid_model_loading(monkeypatch)
    _refused_before_loading(model_dir, spec, message, tmp_path, capsys)


def test_prune_refuses_unwritable_out_before_loading(capsys, monkeypatch):
    with world_readable_dir() as root:
        model = save_tiny_marian(root / "model")
        forbid_model_loading(monkeypatch)
        with unwritable(root / "ro") as ro:
            code = main(["prune", str(model), "--heads", "enc_self:0:1", "--out", str(ro / "pruned")])
        assert code == 2
        assert f"--out {ro / 'pruned'}: cannot write in {ro}" in capsys.readouterr().err
        assert files_under(ro) == set()


def test_prune_overwrite_replaces_the_directory_whole(model_dir, tmp_path, capsys, monkeypatch):
    """Regression: `prune apply --overwrite` wrote into the old directory, so its files that the
    new model does not write stayed, and a failure part-way left a mix of old and new files.
    Regression (issue 32): it then replaced the directory whole, a file of the user's in it
    included; now it takes the directory lock and writes like functions' --out (headlab.outdir):
    a user's file is refused, also with --overwrite, and only headlab's listed files are replaced."""
    import headlab.surgery

    out = tmp_path / "pruned"
    assert main(["prune", str(model_dir), "--heads", "enc_self:0:1", "--out", str(out)]) == 0
    assert ".headlab/files.json" in files_under(out)
    (out / "notes.txt").write_text("the user's")
    capsys.readouterr()
    assert main(["prune", str(model_dir), "--heads", "enc_self:0:2", "--out", str(out), "--overwrite"]) == 2
    assert "holds files headlab did not write (notes.txt)" in capsys.readouterr().err
    assert (out / "notes.txt").read_text() == "the user's"
    (out / "notes.txt").unlink()
    (out / "pruned_heads.py").write_text("# a stale copy")  # a file headlab wrote, changed
    old = {name: (out / name).read_bytes() for name in files_under(out)}
    save_pruned = headlab.surgery.save_pruned

    def full_disk(model, path):
        save_pruned(model, path)  # the weights are written, then the disk fills up
        raise OSError(28, "No space left on device", str(path))

    monkeypatch.setattr(headlab.surgery, "save_pruned", full_disk)
    assert main(["prune", str(model_dir), "--heads", "enc_self:0:2", "--out", str(out), "--overwrite"]) == 1
    assert "No space left on device" in capsys.readouterr().err
    assert {name: (out / name).read_bytes() for name in files_under(out)} == old  # untouched
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pruned"]  # no temporary directory left
    assert not list((out / ".headlab").glob("incoming-*"))
    monkeypatch.setattr(headlab.surgery, "save_pruned", save_pruned)
    assert main(["prune", str(model_dir), "--heads", "enc_self:0:2", "--out", str(out), "--overwrite"]) == 0
    fresh = tmp_path / "fresh"
    assert main(["prune", str(model_dir), "--heads", "enc_self:0:2", "--out", str(fresh)]) == 0
    assert files_under(out) == files_under(fresh) and "notes.txt" not in files_under(out)
    assert (out / "model.safetensors").read_bytes() == (fresh / "model.safetensors").read_bytes()
    assert [b.n_heads for b in attention_blocks(load_model(str(out))) if b.kind == "enc_self"] == [3, 4]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fresh", "pruned"]


def test_every_encoder_head_pruned_then_functions_aggregate_and_importance(model_dir, tmp_path, capsys):
    """Regression (issue 32 row 8): with every encoder head pruned, `functions --aggregate` crashed
    in its figures (matplotlib: "Number of rows must be a positive integer, not 0") and
    `importance` failed in gradient and LRP (exit 1). Now: a kind left without heads is drawn as
    such beside the kinds that have heads; nothing at all to analyse or score is exit 2 up front."""
    out = tmp_path / "no-encoder"
    assert main(["prune", str(model_dir), "--heads", "enc_self:0:* enc_self:1:*", "--out", str(out)]) == 0
    conllu = tmp_path / "tb.conllu"
    conllu.write_text(SAMPLE_CONLLU, encoding="utf-8")
    both = tmp_path / "both"
    assert main(["functions", str(out), "--conllu", str(conllu), "--target-conllu", str(conllu), "--aggregate",
                 "--out", str(both), "--no-progress"]) == 0
    assert {"aggregate_enc_self.png", "functions_enc_self.png", "aggregate_dec_self.png"} <= files_under(both)
    capsys.readouterr()
    assert main(["functions", str(out), "--conllu", str(conllu), "--aggregate", "--out", str(tmp_path / "enc"),
                 "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "every enc_self head of the model was pruned; there is no head to analyse" in err and "Traceback" not in err
    assert files_under(tmp_path / "enc") == set()

    headless, data = _bert_with_every_head_pruned(tmp_path)
    capsys.readouterr()
    assert main(["importance", str(headless), "--data", str(data), "--out", str(tmp_path / "i"), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "every attention head of the model was pruned; there is no head to score" in err
    assert files_under(tmp_path / "i") == set()


def test_every_head_pruned_analyze_and_the_api_refuse_up_front(tmp_path, capsys):
    """Regression: with every head pruned, `analyze` ran every stage (confidence "done" with no
    head scored, LRP and gradient failed with torch's ValueError and RuntimeError, exit 1) and
    `headlab.importance` returned tables with no head scored. Now both refuse, as `importance` does."""
    import headlab
    from headlab.loading import load_tokenizer

    headless, data = _bert_with_every_head_pruned(tmp_path)
    capsys.readouterr()
    assert main(["analyze", str(headless), "--source", str(data), "--out", str(tmp_path / "a"), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert f"{headless}: every attention head of the model was pruned; there is no head to analyse" in err
    assert "lrp" not in err and not (tmp_path / "a" / "importance").exists()
    model, tokenizer = load_model(str(headless)), load_tokenizer(str(headless))
    with pytest.raises(HeadlabError, match="^model: every attention head of the model was pruned"):
        headlab.importance(model, tokenizer, SENTENCES, measures="confidence")
    with pytest.raises(HeadlabError, match="^model: every attention head of the model was pruned"):
        headlab.analyze(model, tokenizer, SENTENCES)


@pytest.mark.parametrize("spec,message", [(",", "--heads: cannot read ','"),
                                          ("enc_self:1:0,,1", "comma with no head index after or before it in 'enc_self:1:0,,1"),
                                          ("enc_slf:1:0", "--heads 'enc_slf:1:0': unknown attention kind"),
                                          ("bad.json", "no such mask file")])
def test_prune_of_a_pruned_model_refuses_a_malformed_spec_before_loading(spec, message, model_dir, tmp_path, capsys,
                                                                         monkeypatch):
    """Regression: on a model pruned before (its heads are in its weights), --heads was read only
    after the weights had loaded, a malformed spec (an empty comma list) with it; its form is now
    checked first, the heads it names once the weights are read."""
    pruned = tmp_path / "pruned"
    assert main(["prune", "apply", str(model_dir), "--heads", "enc_self:0:1", "--out", str(pruned)]) == 0
    capsys.readouterr()
    forbid_model_loading(monkeypatch)
    _refused_before_loading(pruned, spec, message, tmp_path, capsys)


def test_prune_of_a_pruned_model_names_heads_in_the_original_numbering(model_dir, tmp_path, capsys):
    """Regression (silent wrong head): `prune apply` on a pruned model read --heads in its current
    numbering while its heads.csv, score tables and headlab_pruning.json use the original one, so
    `enc_self:0:2` after removing head 1 removed original head 3. Pruning twice now equals pruning
    the union once; a head already removed is refused (the spec was likely in the other numbering),
    except under `*`."""
    import torch

    from headlab.surgery import load_pruned

    once, twice, union = tmp_path / "once", tmp_path / "twice", tmp_path / "union"
    assert main(["prune", "apply", str(model_dir), "--heads", "enc_self:0:1", "--out", str(once)]) == 0
    assert main(["prune", "apply", str(once), "--heads", "enc_self:0:2", "--out", str(twice)]) == 0
    assert main(["prune", "apply", str(model_dir), "--heads", "enc_self:0:1,2", "--out", str(union)]) == 0
    record = json.loads((twice / "headlab_pruning.json").read_text())
    assert record["blocks"]["enc_self"]["0"]["kept_heads"] == [0, 3]
    a, b = load_pruned(twice).eval(), load_pruned(union).eval()
    ids = torch.tensor([[5, 6, 7, 2]])
    with torch.no_grad():
        assert torch.equal(a(input_ids=ids, decoder_input_ids=ids).logits, b(input_ids=ids, decoder_input_ids=ids).logits)
    capsys.readouterr()
    assert main(["prune", "apply", str(once), "--heads", "enc_self:0:1", "--out", str(tmp_path / "again")]) == 2
    err = capsys.readouterr().err
    assert "enc_self:0: head 1 already removed; this model keeps heads 0,2,3 of that layer" in err
    assert not (tmp_path / "again").exists()
    assert main(["prune", "apply", str(once), "--heads", "enc_self:1:*", "--out", str(tmp_path / "star")]) == 0
    assert main(["prune", "apply", str(once), "--heads", "enc_self:0:4", "--out", str(tmp_path / "range")]) == 2
    assert "has no head 4" in capsys.readouterr().err


def _bert_with_every_head_pruned(tmp_path):
    """A tiny BERT saved with every head pruned by `headlab prune`, and a text file of SENTENCES."""
    bert = tmp_path / "bert"
    tiny_model("bert").save_pretrained(bert)
    word_tokenizer([w for s in SENTENCES for w in s.split()], style="bert").save_pretrained(bert)
    headless = tmp_path / "bert-pruned"
    assert main(["prune", str(bert), "--heads", "enc_self:0:* enc_self:1:*", "--out", str(headless)]) == 0
    data = tmp_path / "data.txt"
    data.write_text("\n".join(SENTENCES) + "\n", encoding="utf-8")
    return headless, data


def _tree(path):
    """Every file and folder below ``path`` (hidden ones too), relative."""
    return sorted(str(p.relative_to(path)) for p in path.rglob("*"))


def test_analyze_refused_after_loading_leaves_no_trace(tmp_path, capsys):
    """Regression: `analyze` refused once the model loaded (every head pruned) left an empty
    --out/.headlab/ (and the --out it created) behind; with the importance stages skipped also a
    manifest.json and functions/ holding only its key, and an earlier run's functions/ was deleted
    (--force, or results of other inputs). Now a refused run leaves no trace: a new --out is not
    created, one that existed stays as it was, byte for byte."""
    headless, data = _bert_with_every_head_pruned(tmp_path)
    conllu = tmp_path / "tb.conllu"
    conllu.write_text(SAMPLE_CONLLU, encoding="utf-8")
    empty, mine = tmp_path / "empty", tmp_path / "mine"
    empty.mkdir()
    mine.mkdir()
    (mine / "notes.txt").write_text("mine\n")
    functions = ["--conllu", str(conllu), "--skip", "importance,attention,figures,report"]
    earlier = tmp_path / "earlier"  # an earlier run's results (of the model before pruning)
    assert main(["analyze", str(tmp_path / "bert"), "--source", str(data), "--out", str(earlier), "--no-progress",
                 *functions]) == 0
    assert (earlier / "functions" / "summary.json").is_file()
    runs = [(tmp_path / "new", []), (empty, []), (mine, ["--force"]), (tmp_path / "new-skip", functions),
            (earlier, functions), (earlier, [*functions, "--force"])]
    for out, extra in runs:
        content = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} if out.exists() else None
        before = _tree(out) if out.exists() else None
        capsys.readouterr()
        assert main(["analyze", str(headless), "--source", str(data), "--out", str(out), "--no-progress",
                     *extra]) == 2, out
        assert "there is no head to analyse" in capsys.readouterr().err
        assert (_tree(out) if out.exists() else None) == before, out
        assert ({p: p.read_bytes() for p in out.rglob("*") if p.is_file()} if out.exists() else None) == content
    assert (mine / "notes.txt").read_text() == "mine\n"


def test_a_command_refused_under_the_lock_leaves_a_pre_existing_out_as_it_was(tmp_path, capsys):
    """Regression: `functions` / `importance` refused once the model loaded (every head pruned),
    after taking --out's lock, left an empty --out/.headlab/ in an --out that existed (one it made
    was removed). Now a refused run leaves no trace: --out stays as it was, byte for byte, also one
    holding an earlier run's results (--overwrite)."""
    headless, data = _bert_with_every_head_pruned(tmp_path)
    conllu = tmp_path / "tb.conllu"
    conllu.write_text(SAMPLE_CONLLU, encoding="utf-8")
    empty, earlier = tmp_path / "empty", tmp_path / "earlier"
    empty.mkdir()
    assert main(["functions", str(tmp_path / "bert"), "--conllu", str(conllu), "--out", str(earlier),
                 "--no-progress"]) == 0
    runs = [("functions", ["--conllu", str(conllu)], out) for out in (tmp_path / "new", empty)]
    runs += [("functions", ["--conllu", str(conllu), "--overwrite"], earlier)]
    runs += [("importance", ["--source", str(data)], out) for out in (tmp_path / "new", empty)]
    for command, options, out in runs:
        content = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} if out.exists() else None
        before = _tree(out) if out.exists() else None
        capsys.readouterr()
        assert main([command, str(headless), *options, "--out", str(out), "--no-progress"]) == 2, (command, out)
        assert "no head" in capsys.readouterr().err
        assert (_tree(out) if out.exists() else None) == before, (command, out)
        assert ({p: p.read_bytes() for p in out.rglob("*") if p.is_file()} if out.exists() else None) == content


@pytest.mark.parametrize("killed", [False, True])
def test_analyze_refused_after_a_skipped_stage_was_set_aside_puts_it_back(killed, tmp_path, capsys):
    """Regression: `analyze --skip functions` sets aside in stale/ the functions results of an
    earlier run of other inputs (here another model) and removes their marker; when the run was
    then refused (the aggregate stage loads a model with every head pruned) they stayed in stale/
    and the marker was gone. Now the refused run leaves --out as it was, byte for byte; so too
    with the results of a run killed in the stage (no marker), set aside as unfinished."""
    headless, data = _bert_with_every_head_pruned(tmp_path)
    conllu = tmp_path / "tb.conllu"
    conllu.write_text(SAMPLE_CONLLU, encoding="utf-8")
    out = tmp_path / "out"
    skip = ["--skip", "importance,attention,figures,report"]
    assert main(["analyze", str(tmp_path / "bert"), "--source", str(data), "--conllu", str(conllu), "--out", str(out),
                 "--no-progress", *skip]) == 0
    assert (out / "functions" / "summary.json").is_file() and not (out / "stale").exists()
    if killed:
        (out / ".headlab" / "stages" / "functions.json").unlink()
    content = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    before = _tree(out)
    capsys.readouterr()
    assert main(["analyze", str(headless), "--source", str(data), "--conllu", str(conllu), "--out", str(out),
                 "--no-progress", *skip, "functions"]) == 2
    err = capsys.readouterr().err
    # set aside, then refused
    assert f"functions: skipped (--skip); its {'unfinished results' if killed else 'results of an earlier run'}" in err
    assert "there is no head to analyse" in err
    assert _tree(out) == before
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == content


def test_analyze_refused_after_stages_skipped_or_held_leaves_an_earlier_run_as_it_was(tmp_path, capsys):
    """Regression: a stage that skips this time (functions and aggregate without --conllu, the table
    with no head scored) deleted an earlier run's results and markers, and so did --skip a stage
    folder holding only its key (a killed run's); when a later stage then refused the run (attention
    loads a model with every head pruned, exit 2) they were gone, while the manifest put back said
    those stages were done. Now they wait in .headlab/held/ until the run ends, and a refused run
    leaves --out as it was, byte for byte."""
    headless, data = _bert_with_every_head_pruned(tmp_path)
    conllu = tmp_path / "tb.conllu"
    conllu.write_text(SAMPLE_CONLLU, encoding="utf-8")
    out = tmp_path / "out"
    skip = ["--skip", "importance,figures,report"]
    assert main(["analyze", str(tmp_path / "bert"), "--source", str(data), "--conllu", str(conllu), "--out", str(out),
                 "--no-progress", *skip]) == 0
    assert (out / "functions" / "summary.json").is_file() and (out / "heads.csv").is_file()
    killed = out / "prune"  # a stage folder holding only its key, as a run killed in it leaves it
    killed.mkdir()
    (killed / ".headlab-key").write_text("0123\n")
    for extra in ([], ["--skip", "importance,figures,report,prune"]):
        content = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
        before = _tree(out)
        capsys.readouterr()
        assert main(["analyze", str(headless), "--source", str(data), "--out", str(out), "--no-progress", *skip,
                     *extra]) == 2
        err = capsys.readouterr().err
        assert "functions: skipped: no --conllu" in err and "there is no head to analyse" in err
        assert _tree(out) == before, extra
        assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == content
    # a run that is not refused removes them, and leaves nothing held
    capsys.readouterr()
    assert main(["analyze", str(tmp_path / "bert"), "--source", str(data), "--out", str(out), "--no-progress",
                 *skip, "prune"]) == 0
    assert not (out / "functions").exists() and not (out / "prune").exists() and not (out / "heads.csv").exists()
    assert not (out / ".headlab" / "held").exists() and not any((out / ".headlab").glob("replaced-*"))
    stages = {s["name"]: s["status"] for s in json.loads((out / "manifest.json").read_text())["stages"]}
    assert stages["functions"] == stages["aggregate"] == "skipped" and stages["attention"] == "done"
