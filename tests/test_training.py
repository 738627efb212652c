"""The training engine below the features (headlab.training): what it asks of its callers, and
that every loss is the one cross-entropy."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from headlab.errors import HeadlabError
from headlab.nmt.train import train as train_translation
from headlab.nmt.train import validate_translation
from headlab.training.config import TrainConfig
from headlab.training.corpus import collate, encode_corpus
from headlab.training.loop import train
from headlab.training.losses import causal_lm_loss, label_smoothed_loss, next_token_labels, token_loss
from support.nmt import tiny_marian


def test_the_engine_refuses_validation_data_without_a_validation_before_any_work(corpus, tokenizer, tmp_path):
    """The engine knows no BLEU (translation's, headlab.nmt.train): validation data without a
    validate_fn is refused before the output directory is touched."""
    model = tiny_marian(tokenizer)
    out = tmp_path / "run"
    with pytest.raises(HeadlabError, match="validate_fn"):
        train(model, tokenizer, corpus.subset(8), corpus.subset(4), TrainConfig(out_dir=str(out), max_steps=1))
    assert not out.exists()


def test_translation_training_validates_by_bleu_by_default(corpus, tokenizer, tmp_path):
    model = tiny_marian(tokenizer)
    result = train_translation(model, tokenizer, corpus.subset(16), corpus.subset(4),
                               TrainConfig(out_dir=str(tmp_path / "run"), max_epochs=1, max_tokens=200, progress=False))
    assert {"valid_bleu", "valid_chrf", "valid_loss"} <= set(result.history[0])
    assert validate_translation.__module__ == "headlab.nmt.train"


def test_every_loss_is_token_loss(corpus, tokenizer):
    model = tiny_marian(tokenizer).eval()
    encoded = encode_corpus(tokenizer, corpus.subset(4))
    batch = collate(encoded, [0, 1, 2, 3], tokenizer.pad_token_id, model.config.decoder_start_token_id)
    config = TrainConfig(label_smoothing=0.1)
    loss, n = label_smoothed_loss(model, batch, config)
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                   decoder_input_ids=batch["decoder_input_ids"]).logits
    expected = F.cross_entropy(logits.reshape(-1, logits.size(-1)), batch["labels"].reshape(-1), ignore_index=-100,
                               label_smoothing=0.1, reduction="sum")
    assert n == int((batch["labels"] != -100).sum())
    torch.testing.assert_close(loss, expected)
    torch.testing.assert_close(token_loss(logits, batch["labels"], 0.1)[0], expected)


def test_the_lm_loss_predicts_each_next_token_of_the_text_or_of_shifted_labels():
    """One causal LM loss: on a batch of text (prune train) with next_token_labels, and on a batch
    whose labels are shifted already (lm train's collate_lm), the same next-token sums; smoothed
    only when the config says so."""
    vocab, ids = 7, torch.tensor([[1, 2, 3, 0], [4, 5, 0, 0]])
    mask = (ids != 0).long()
    logits = torch.randn(2, 4, vocab, generator=torch.Generator().manual_seed(0))

    class Model(torch.nn.Module):
        def forward(self, input_ids, attention_mask, use_cache=False):
            return type("Out", (), {"logits": logits[:, : input_ids.shape[1]]})()

    labels = next_token_labels(ids, mask)
    assert labels.tolist() == [[2, 3, -100], [5, -100, -100]]
    loss, n = causal_lm_loss(Model(), {"input_ids": ids, "attention_mask": mask, "labels": labels},
                             TrainConfig(label_smoothing=0.0))
    targets = [(0, 0, 2), (0, 1, 3), (1, 0, 5)]  # (row, position, next token) of the real tokens
    expected = sum(-torch.log_softmax(logits[r, p], -1)[t] for r, p, t in targets)
    assert n == 3
    torch.testing.assert_close(loss, expected)
    # the same text collated as lm train does (inputs without the last token, labels shifted): the same loss
    shifted = {"input_ids": ids[:, :-1], "attention_mask": mask[:, :-1], "labels": labels}
    torch.testing.assert_close(causal_lm_loss(Model(), shifted, TrainConfig(label_smoothing=0.0))[0], expected)
    smoothed = causal_lm_loss(Model(), shifted, TrainConfig(label_smoothing=0.1))[0]
    torch.testing.assert_close(smoothed, token_loss(logits[:, :3], labels, 0.1)[0])
    assert not torch.equal(smoothed, expected)


def test_prune_trains_a_causal_lm_on_the_unsmoothed_next_token_loss():
    """prune train --loss causal_lm: the next-token loss of the batch's text, bit for bit the sum it
    always was (logits but the last against the inputs shifted by one), whatever --label-smoothing says."""
    from headlab.pruning.train import _next_token_loss

    vocab, ids = 11, torch.tensor([[1, 2, 3, 4, 0], [4, 5, 6, 0, 0]])
    mask = (ids != 0).long()
    logits = torch.randn(2, 5, vocab, generator=torch.Generator().manual_seed(1))

    class Model(torch.nn.Module):
        def forward(self, input_ids, attention_mask, use_cache=False):
            return type("Out", (), {"logits": logits})()

    loss, n = _next_token_loss(Model(), {"input_ids": ids, "attention_mask": mask, "labels": ids},
                               TrainConfig(label_smoothing=0.1))
    before = F.cross_entropy(logits[:, :-1].reshape(-1, vocab).float(),
                             ids[:, 1:].masked_fill(mask[:, 1:] == 0, -100).reshape(-1), ignore_index=-100,
                             reduction="sum")
    assert n == 5 and torch.equal(loss, before)
