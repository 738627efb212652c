"""Translation and scoring: one output line per input line, order kept, sacreBLEU signatures."""

import pytest
import torch

from headlab.cli import main
from headlab.errors import HeadlabError
from headlab.nmt.bleu import compute_scores
from headlab.nmt.model import load_translation_model
from headlab.nmt.train import train
from headlab.nmt.translate import translate
from headlab.training.config import TrainConfig
from support.nmt import tiny_corpus, tiny_marian, tiny_tokenizer


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny model trained for a few dozen steps (so it emits words and </s>), saved as best/."""
    torch.set_num_threads(1)
    corpus = tiny_corpus()
    tokenizer = tiny_tokenizer(corpus)
    model = tiny_marian(tokenizer)
    out = tmp_path_factory.mktemp("run")
    config = TrainConfig(out_dir=str(out), max_tokens=400, lr=3e-3, warmup_steps=5, max_epochs=4,
                         progress=False, valid_batch_size=10)
    train(model, tokenizer, corpus, corpus.subset(10), config)
    return model, tokenizer, out / "best", corpus


def test_one_output_per_input_with_empty_lines_in_order(trained):
    model, tokenizer, _, corpus = trained
    sentences = [corpus.sources[0], "", corpus.sources[5], "   ", corpus.sources[17], corpus.sources[2]]
    for beam in (1, 4):
        batched = translate(model, tokenizer, sentences, beam=beam, batch_size=3)
        assert len(batched) == len(sentences)
        assert batched[1] == "" and batched[3] == ""
        one_by_one = [translate(model, tokenizer, [s], beam=beam)[0] for s in sentences]
        assert batched == one_by_one
    assert translate(model, tokenizer, []) == []
    assert translate(model, tokenizer, ["", ""]) == ["", ""]
    with pytest.raises(ValueError):
        translate(model, tokenizer, ["x"], beam=0)


def test_output_is_detokenized_text(trained):
    model, tokenizer, _, corpus = trained
    output = translate(model, tokenizer, corpus.sources[:5], beam=1)
    assert all("▁" not in line and "</s>" not in line and "<pad>" not in line for line in output)
    assert any(line for line in output)


def test_saved_best_model_loads_and_translates_the_same(trained):
    model, tokenizer, best, corpus = trained
    assert load_translation_model(best).config._attn_implementation == "sdpa"
    final = load_translation_model(best.parent / "epochs" / "epoch-004")  # the weights the run ended with
    assert translate(final, tokenizer, corpus.sources[:4], beam=2) == translate(model, tokenizer, corpus.sources[:4], beam=2)


def test_cli_translate_and_bleu(trained, tmp_path, capsys):
    _, _, best, corpus = trained
    source = tmp_path / "in.en"
    source.write_text(f"{corpus.sources[0]}\n\n{corpus.sources[1]}\n", encoding="utf-8")
    output = tmp_path / "out.de"
    assert main(["nmt", "translate", "--model", str(best), "--input", str(source), "--output", str(output),
                 "--beam", "1"]) == 0
    lines = output.read_text(encoding="utf-8").split("\n")
    assert len(lines) == 4 and lines[1] == "" and lines[3] == ""  # 3 lines + final newline

    assert main(["nmt", "bleu", "--hyp", str(output), "--ref", str(source)]) == 0
    printed = capsys.readouterr().out
    assert "BLEU = " in printed and "nrefs:1|case:mixed|eff:no|tok:13a|smooth:exp|version:" in printed
    assert "chrF2 = " in printed


def test_cli_errors_are_clean(tmp_path, capsys):
    (tmp_path / "x").write_text("a sentence\n")
    assert main(["nmt", "translate", "--model", str(tmp_path), "--input", str(tmp_path / "x")]) == 2
    assert "no tokenizer" in capsys.readouterr().err
    hyp, ref = tmp_path / "h", tmp_path / "r"
    hyp.write_text("a\nb\n")
    ref.write_text("a\n")
    assert main(["nmt", "bleu", "--hyp", str(hyp), "--ref", str(ref)]) == 2
    assert "2 hypotheses but 1 reference:" in capsys.readouterr().err  # one: not "1 references"


def test_scores_match_sacrebleu_conventions():
    refs = ["Ein Hund läuft über die Wiese.", "Zwei Männer spielen Fußball."]
    perfect = compute_scores(refs, refs)
    assert perfect.bleu == pytest.approx(100.0) and perfect.chrf == pytest.approx(100.0)
    assert perfect.bleu_signature.startswith("nrefs:1|case:mixed|eff:no|tok:13a|smooth:exp")
    assert perfect.chrf_signature.startswith("nrefs:1|case:mixed|eff:yes|nc:6|nw:0|space:no")
    assert compute_scores(["Ein Hund.", ""], refs).bleu < 50
    with pytest.raises(HeadlabError):
        compute_scores([], [])


def test_export_writes_a_from_pretrained_directory(trained, tmp_path, capsys):
    from transformers import AutoTokenizer, MarianMTModel

    model, tokenizer, best, corpus = trained
    run = best.parent
    target = tmp_path / "exported"
    assert main(["nmt", "export", "--run", str(run), "--to", str(target), "--checkpoint", "epoch-4"]) == 0
    loaded = MarianMTModel.from_pretrained(str(target))
    assert AutoTokenizer.from_pretrained(str(target)).get_vocab() == tokenizer.get_vocab()
    assert translate(loaded, tokenizer, corpus.sources[:3], beam=1) == translate(model, tokenizer, corpus.sources[:3], beam=1)
    assert main(["nmt", "export", "--run", str(run), "--to", str(target)]) == 2
    assert "--overwrite" in capsys.readouterr().err
    assert main(["nmt", "export", "--run", str(run), "--to", str(target), "--overwrite", "--dtype", "float16"]) == 0
    assert MarianMTModel.from_pretrained(str(target)).model.shared.weight.dtype == torch.float16
    assert main(["nmt", "export", "--run", str(run), "--to", str(tmp_path / "x"), "--checkpoint", "epoch-9"]) == 2
    assert "no checkpoint" in capsys.readouterr().err


def test_average_command_writes_an_exportable_checkpoint(trained, tmp_path, capsys):
    from headlab.training.loop import average_checkpoints

    _, _, best, _ = trained
    run = best.parent
    epochs = sorted((run / "epochs").glob("epoch-*"))
    assert main(["nmt", "average", "--run", str(run), "--last", "2", "--overwrite"]) == 0
    averaged = run / "averaged-last2"
    expected = average_checkpoints(epochs[-2:])
    model = load_translation_model(averaged)
    for name, value in model.state_dict().items():
        if name in expected:
            assert torch.equal(value, expected[name]), name
    assert main(["nmt", "export", "--run", str(run), "--checkpoint", "averaged-last2", "--to", str(tmp_path / "m")]) == 0
    assert main(["nmt", "average", "--run", str(run), "--last", "99"]) == 2
    assert "cannot average the last 99" in capsys.readouterr().err
    assert main(["nmt", "average", "--run", str(run), "--last", "0"]) == 2
    assert "--last must be at least 1, got 0" in capsys.readouterr().err
