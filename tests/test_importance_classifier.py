"""Fine-tuned sequence classifiers (issue 15, item 6; Michel et al.'s own setting): a tiny BERT
fine-tuned here on a toy task it learns (is the word "yes" in the text?), then scored from a
labelled TSV by `headlab importance` and `headlab analyze`; ablation and gradient importance
on the task loss checked against direct computations written here."""

from __future__ import annotations

import csv
import json
import random

import pytest
import torch
import transformers as tf
from tokenizers import processors

from headlab import HeadScores, attention_blocks, gates_attached
from headlab.cli import main
from headlab.data.inputs import make_batches, read_labelled_data
from headlab.errors import HeadlabError
from headlab.gates import ConstantGates, ScalarGates
from headlab.importance.common import forward_logits
from headlab.importance.registry import MEASURES
from headlab.importance.registry import tables as registered_tables
from headlab.loading import load_model, load_tokenizer
from headlab.model_description import describe_model
from support.treebank import word_tokenizer

WORDS = ["yes", "the", "a", "cat", "dog", "runs", "sleeps", "big", "small", "red", "blue", "sees", "house", "tree"]


def _texts(n: int, seed: int) -> list[tuple[str, int]]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        words = [rng.choice(WORDS[1:]) for _ in range(rng.randint(3, 6))]
        if i % 2:
            words[rng.randrange(len(words))] = "yes"
        out.append((" ".join(words), int("yes" in words)))
    return out


@pytest.fixture(scope="module")
def classifier(tmp_path_factory):
    """A tiny BertForSequenceClassification fine-tuned until it gets the toy task right."""
    root = tmp_path_factory.mktemp("classifier")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    tokenizer = word_tokenizer(WORDS, style="bert")
    tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(  # BERT's pairs and segments
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1", special_tokens=[("[CLS]", 2), ("[SEP]", 3)])
    tokenizer.model_input_names = tokenizer.init_kwargs["model_input_names"] = [
        "input_ids", "token_type_ids", "attention_mask"]
    config = tf.BertConfig(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                           intermediate_size=37, max_position_embeddings=32, num_labels=2,
                           id2label={0: "no", 1: "yes"}, label2id={"no": 0, "yes": 1})
    model = tf.BertForSequenceClassification(config)
    train = _texts(64, seed=1)
    batch = tokenizer([t for t, _ in train], padding=True, return_tensors="pt")
    labels = torch.tensor([y for _, y in train])
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    model.train()
    for _ in range(60):
        loss = model(**batch, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()
    model.save_pretrained(root / "model")
    tokenizer.save_pretrained(root / "model")
    test = _texts(24, seed=2)
    lines = ["sentence\tlabel"] + [f"{text}\t{'yes' if y else 'no'}" for text, y in test]
    (root / "dev.tsv").write_text("\n".join(lines) + "\n", encoding="utf-8")
    torch.set_num_threads(threads)
    return root, test


def _direct_losses(model, tokenizer, test, gates=None):
    """Mean cross-entropy of the gold labels and accuracy, computed here."""
    batch = tokenizer([t for t, _ in test], padding=True, return_tensors="pt")
    labels = torch.tensor([y for _, y in test])
    with torch.no_grad():
        if gates is None:
            logits = model(**batch).logits
        else:
            with gates_attached(model, gates):
                logits = model(**batch).logits
    loss = torch.nn.functional.cross_entropy(logits, labels, reduction="none")
    return loss, (logits.argmax(-1) == labels).float().mean().item()


def test_the_classifier_learned_the_task(classifier):
    root, test = classifier
    model, tokenizer = load_model(str(root / "model")), load_tokenizer(str(root / "model"))
    assert type(model).__name__ == "BertForSequenceClassification"  # as its architectures say
    _, accuracy = _direct_losses(model, tokenizer, test)
    assert accuracy >= 0.9


def test_importance_of_a_classifier_from_a_labelled_tsv(classifier, tmp_path):
    root, test = classifier
    torch.set_num_threads(1)
    out = tmp_path / "imp"
    assert main(["importance", str(root / "model"), "--data", str(root / "dev.tsv"), "--out", str(out),
                 "--method", "all", "--batch-size", "8", "--no-progress"]) == 0
    tables = {p.stem: HeadScores.load(p) for p in out.glob("*.json") if p.stem != "agreement"}
    # --method all: every measure's tables, and a classifier's ablation also scores the accuracy
    assert set(tables) == {*registered_tables(), "ablation_accuracy"}
    model, tokenizer = load_model(str(root / "model")), load_tokenizer(str(root / "model"))
    blocks = attention_blocks(model)
    base, base_accuracy = _direct_losses(model, tokenizer, test)
    assert tables["ablation_accuracy"].signature["base_accuracy"] == pytest.approx(base_accuracy)
    assert tables["gradient"].signature["loss"].startswith("task loss")
    assert tables["lrp"].signature["target"] == "logit of the predicted class"
    for block in blocks:
        for head in range(block.n_heads):
            values = torch.ones(block.n_heads)
            values[head] = 0
            masked, accuracy = _direct_losses(model, tokenizer, test, ConstantGates({block.key: values}))
            expected = (masked.mean() - base.mean()).item()
            assert tables["ablation"][block.kind][block.layer, head] == pytest.approx(expected, abs=1e-5)
            assert tables["ablation_accuracy"][block.kind][block.layer, head] == pytest.approx(base_accuracy - accuracy)
    # Gradient importance: |dL/dg| of each text's loss alone (one backward per text), averaged.
    gates = ScalarGates({b.key: b.n_heads for b in blocks})
    expected = {b.key: torch.zeros(b.n_heads) for b in blocks}
    for text, label in test:
        inputs = tokenizer([text], return_tensors="pt")
        with gates_attached(model, gates):
            loss = torch.nn.functional.cross_entropy(model(**inputs).logits, torch.tensor([label]))
        grads = torch.autograd.grad(loss, [gates.gate(b.key) for b in blocks])
        for b, grad in zip(blocks, grads):
            expected[b.key] += grad.abs() / len(test)
    for b in blocks:
        got = torch.tensor(tables["gradient_raw"][b.kind][b.layer], dtype=torch.float32)
        torch.testing.assert_close(got, expected[b.key], rtol=1e-3, atol=1e-9)
    lrp = tables["lrp"]["enc_self"]
    assert torch.tensor(abs(lrp).sum(1)).le(1 + 1e-6).all() and abs(lrp).sum() > 0


def test_analyze_runs_end_to_end_on_a_classifier(classifier, tmp_path):
    root, test = classifier
    torch.set_num_threads(1)
    out = tmp_path / "a"
    assert main(["analyze", str(root / "model"), "--source", str(root / "dev.tsv"), "--out", str(out), "--ablation",
                 "--skip", "figures", "--no-progress", "--batch-size", "8"]) == 0
    stages = {s["name"]: s["status"] for s in json.loads((out / "manifest.json").read_text())["stages"]}
    for name in (*MEASURES, "agreement", "table", "attention", "report"):  # --ablation: every measure
        assert stages[name] == "done", (name, stages)
    with open(out / "heads.csv", newline="", encoding="utf-8") as handle:
        rows = list(csv.DictReader(handle))
    assert len(rows) == 8 and all(r["ablation_accuracy"] != "" for r in rows)
    viewer = json.loads((out / "attention" / "index.json").read_text())
    shown = [s["source"] for s in viewer["sentences"]]
    assert shown == [text for text, _ in test][: len(shown)] and shown  # the texts: no header, no label column


def test_labelled_tsv_pairs_and_errors(classifier, tmp_path):
    root, _ = classifier
    model, tokenizer = load_model(str(root / "model")), load_tokenizer(str(root / "model"))
    info = describe_model(model, tokenizer)
    assert (info.arch, info.n_labels, info.label_names) == ("classifier", 2, ("no", "yes"))
    pairs = tmp_path / "pairs.tsv"
    pairs.write_text("the cat\tsees a dog\t1\na red house\tthe tree\tno\n", encoding="utf-8")
    data = read_labelled_data(pairs, tokenizer, info)
    assert data.classes == [1, 0] and data.segments is not None
    assert data.segments[0] == [0, 0, 0, 0, 1, 1, 1, 1]  # [CLS] the cat [SEP] sees a dog [SEP]
    assert tokenizer.convert_ids_to_tokens(data.sources[0])[::3] == ["[CLS]", "[SEP]", "dog"]
    batch = next(make_batches(data, info, batch_size=2))
    assert batch.labels.tolist() == [[data.classes[i]] for i in batch.index]
    direct = tokenizer(["the cat", "a red house"], ["sees a dog", "the tree"], padding=True, return_tensors="pt")
    with torch.no_grad():
        torch.testing.assert_close(forward_logits(model, batch.inputs, info)[:, 0], model(**direct).logits[batch.index])
    for text, message in (("the cat\n", r"bad.tsv:1: expected text<TAB>label"),
                          ("the cat\tmaybe\n", r"bad.tsv:1: label 'maybe' is neither a class index"),
                          ("the cat\t7\n", r"bad.tsv:1: label 7 is outside the model's 2 classes"),
                          ("a\t1\nb\tc\t1\n", r"bad.tsv:2: 3 fields, but earlier lines have 2")):
        (tmp_path / "bad.tsv").write_text(text, encoding="utf-8")
        with pytest.raises(HeadlabError, match=message):
            read_labelled_data(tmp_path / "bad.tsv", tokenizer, info)


@pytest.mark.parametrize("family", ["gpt2", "roberta"])
def test_lrp_targets_are_the_predicted_class_logits(family):
    """The classifier head is found for other layouts too: GPT-2 scores every position and pools
    the last real token (padding on the right here), RoBERTa's head ends in out_proj."""
    from headlab.importance.lrp import head_relevance

    torch.manual_seed(0)
    if family == "gpt2":
        config = tf.GPT2Config(vocab_size=40, n_embd=32, n_layer=2, n_head=4, n_positions=32, num_labels=3,
                               pad_token_id=0)
        model = tf.GPT2ForSequenceClassification(config).eval()
    else:
        config = tf.RobertaConfig(vocab_size=40, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                  intermediate_size=37, max_position_embeddings=40, num_labels=3, pad_token_id=1)
        model = tf.RobertaForSequenceClassification(config).eval()
    info = describe_model(model)
    assert info.arch == "classifier" and info.has_lm_head
    from headlab.data.inputs import ImportanceData

    data = ImportanceData.from_ids([[5, 6, 7, 8, 9], [10, 11, 12]])
    data.classes = [0, 2]
    batch = next(make_batches(data, info, batch_size=2))
    with torch.no_grad():
        expected = model(**batch.inputs).logits.max(-1).values
    result = head_relevance(model, batch)
    torch.testing.assert_close(result.logits, expected, rtol=1e-4, atol=1e-5)
    assert all(r.shape == (2, 4) and r.abs().sum() > 0 for r in result.relevance.values())


def test_rare_token_counts_of_a_labelled_tsv_leave_out_the_labels(classifier, tmp_path, monkeypatch):
    """Regression: without --train-text, analyze counted token frequencies over the whole TSV
    lines, so the label column ("yes"/"no") and the header added to the counts."""
    import headlab.functions.analysis
    from support.treebank import SAMPLE_CONLLU

    root, test = classifier
    conllu = tmp_path / "tb.conllu"
    conllu.write_text(SAMPLE_CONLLU, encoding="utf-8")
    seen = {}

    def analyze_heads(model, tokenizer, path, *, frequencies=None, **kwargs):
        seen["frequencies"], seen["tokenizer"] = frequencies, tokenizer
        raise KeyboardInterrupt  # the counts are all this test needs

    monkeypatch.setattr(headlab.functions.analysis, "analyze_heads", analyze_heads)
    assert main(["analyze", str(root / "model"), "--source", str(root / "dev.tsv"), "--conllu", str(conllu),
                 "--out", str(tmp_path / "a"), "--no-progress", "--skip", "confidence", "lrp", "gradient",
                 "agreement", "aggregate", "table", "attention", "figures", "report"]) == 130
    frequencies, tokenizer = seen["frequencies"], seen["tokenizer"]
    vocab = tokenizer.get_vocab()
    words = [word for text, _ in test for word in text.split()]
    assert frequencies.n_lines == len(test)  # one sentence per data line; no header
    assert frequencies.counts[vocab["yes"]] == words.count("yes")  # 12 more with the label column
    assert frequencies.n_tokens == len(words)
