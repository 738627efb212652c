"""Ablation: batched masked variants equal one masked pass per head."""

import numpy as np
import pytest
import torch
from sacrebleu.metrics import BLEU

from headlab import HeadlabError, attention_blocks, mask_heads
from headlab.importance import ImportanceData, compute_ablation, describe_model, translate_data
from support.models import tiny_model


def _data(seq2seq, n=5):
    g = torch.Generator().manual_seed(7)
    sources = [torch.randint(3, 99, (k,), generator=g).tolist() + [1] for k in (5, 3, 6, 4, 2, 7)[:n]]
    references = [torch.randint(3, 99, (k,), generator=g).tolist() + [1] for k in (4, 6, 2, 3, 5, 3)[:n]] if seq2seq else None
    return ImportanceData.from_ids(sources, references)


def _total_nll(model, family, data, special):
    """Summed token NLL over the data set and the token count, one sentence at a time."""
    total, count = 0.0, 0
    with torch.no_grad():
        for i, src in enumerate(data.sources):
            ids = torch.tensor([src])
            if family in ("marian", "bart", "t5"):
                ref = data.references[i]
                dec = torch.tensor([[model.config.decoder_start_token_id] + ref[:-1]])
                logits, labels = model(input_ids=ids, decoder_input_ids=dec).logits[0], torch.tensor(ref)
            elif family in ("gpt2", "llama"):
                logits, labels = model(input_ids=ids).logits[0, :-1], ids[0, 1:]
            else:
                logits, labels = model(input_ids=ids).logits[0], ids[0]
                keep = torch.tensor([int(t) not in special for t in labels])
                logits, labels = logits[keep], labels[keep]
            total += float(torch.nn.functional.cross_entropy(logits.double(), labels, reduction="sum"))
            count += len(labels)
    return total, count


@pytest.mark.parametrize("family", ["marian", "bart", "bert", "gpt2", "t5", "llama"])
def test_batched_ablation_equals_one_masked_pass_per_head(family):
    model = tiny_model(family)
    modules = list(model.modules())
    info = describe_model(model)
    data = _data(info.is_seq2seq)
    # max_rows=6 with batches of 2: three masked copies per forward call, several groups
    scores = compute_ablation(model, data, info, batch_size=2, max_rows=6)
    base, count = _total_nll(model, family, data, info.special_ids)
    assert scores.signature["base_loss"] == pytest.approx(base / count, rel=1e-5)
    blocks = attention_blocks(model)
    for block in (blocks[0], blocks[-1]):  # an encoder (or first) block, a decoder (or last) one
        for head in range(block.n_heads):
            with mask_heads(model, {block.key: [head]}):
                masked, _ = _total_nll(model, family, data, info.special_ids)
            assert scores[block.kind][block.layer, head] == pytest.approx((masked - base) / count, abs=2e-6), \
                (block.key, head)
    assert list(model.modules()) == modules  # layers stood in for by recorded outputs are back


class _IdsTokenizer:
    """Stands in for a tokenizer: a translation's text is its token ids."""

    def batch_decode(self, rows, skip_special_tokens=True):
        return [" ".join(str(t) for t in row if t not in (0, 1)) for row in rows]


def test_bleu_ablation_equals_translating_with_each_head_masked():
    model = tiny_model("marian")
    info = describe_model(model)
    data = _data(True, n=4)
    tokenizer = _IdsTokenizer()
    references = [" ".join(map(str, r[:-1])) for r in data.references]
    data.reference_texts = references
    scores = compute_ablation(model, data, info, metric="bleu", tokenizer=tokenizer, batch_size=3, max_rows=9)

    def bleu() -> float:
        translated = translate_data(model, data, info, batch_size=3)
        return BLEU().corpus_score(tokenizer.batch_decode(translated.translations), [references]).score

    base = bleu()
    assert scores.signature["base_bleu"] == pytest.approx(base)
    blocks = attention_blocks(model)
    for block in (blocks[0], blocks[-1]):  # an encoder block, a decoder block
        for head in range(block.n_heads):
            with mask_heads(model, {block.key: [head]}):
                expected = base - bleu()
            assert scores[block.kind][block.layer, head] == pytest.approx(expected, abs=1e-9)


def test_ablation_errors_are_clear():
    model = tiny_model("gpt2")
    info = describe_model(model)
    with pytest.raises(HeadlabError, match="translation"):
        compute_ablation(model, _data(False), info, metric="bleu")
    with pytest.raises(HeadlabError, match="metric"):
        compute_ablation(model, _data(False), info, metric="accuracy")
    marian = tiny_model("marian")
    with pytest.raises(HeadlabError, match="reference"):
        compute_ablation(marian, ImportanceData.from_ids(_data(True).sources), describe_model(marian), metric="bleu")
    np.testing.assert_array_equal(compute_ablation(model, _data(False, 2), info, kinds=("dec_self",))["dec_self"].shape, (2, 4))
