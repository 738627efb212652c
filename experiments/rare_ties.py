"""Count the sentences the rare-token test's tie rule (audit33) takes out, without a forward pass.

Since audit33 a sentence whose tokens all share one training count no longer qualifies for the
rare-token test (each token would be "the rarest"). Whether a committed result changes depends on
the data and the tokenizer only: this script streams a treebank through the same alignment as
``headlab functions`` (the model's tokenizer, its maximum length, the batches' SideBatches; the
model is loaded for its length only) and prints the qualifying sentences under the rule before and
after the change, each sentence it takes out (its tokens and their count: a one-token sentence
counts no query token, a query must reach two tokens, so it changes no share), the qualifying
sentences whose least frequent token never occurs in the training text (and of those, the ones where
several such tokens tie), and the mean share of "rarest" and "two rarest" positions per qualifying
sentence (what a head whose maximum fell on a random token would score).

    PYTHONPATH=src python experiments/rare_ties.py MODEL --conllu FILE --train-text FILE [...] [--limit N]
"""

import argparse
import json
from itertools import islice
from pathlib import Path

import torch

from headlab.data.frequencies import TokenFrequencies
from headlab.data.treebank import TreebankCounts
from headlab.functions.analysis import RunReport, _batched, _examples, _model_inputs, _prepare
from headlab.functions.config import AnalysisConfig
from headlab.functions.rare_tokens import rare_token_masks
from headlab.loading import load_model, load_tokenizer
from headlab.model_description import model_max_length


def count_ties(model_dir: str | Path, conllu: str | Path, train_text: list[str], limit: int | None = None,
               top_frequent: int = 500) -> dict:
    """The counts the module docstring lists, for ``model_dir``'s tokenizer on ``conllu`` (its first ``limit``
    sentences) with the token counts of ``train_text`` (``--train-text``, each file once)."""
    model, tokenizer = load_model(str(model_dir)), load_tokenizer(str(model_dir))
    frequencies = TokenFrequencies.from_corpus(tokenizer, train_text)
    counts = torch.from_numpy(frequencies.counts.copy())
    top = torch.from_numpy(frequencies.top_mask(top_frequent))
    config = AnalysisConfig()
    max_length = model_max_length(model, tokenizer, config.max_length)
    seq2seq = bool(getattr(model.config, "is_encoder_decoder", False))
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    report = RunReport(analysed=[], max_length=max_length)
    stream = _examples(conllu, None, None, report.problems, {"source": TreebankCounts(), "target": TreebankCounts()})
    if limit is not None:
        stream = islice(stream, limit)
    n = old_n = new_n = never_seen = never_seen_tied = 0
    shares = {"before": torch.zeros(2, dtype=torch.float64), "after": torch.zeros(2, dtype=torch.float64)}
    taken_out: list[dict] = []
    index = 0
    for raw in _batched(stream, config.batch_size):
        items = _prepare(raw, index, tokenizer, config, max_length, report)
        index += len(raw)
        if not items:
            continue
        current: dict = {}
        _model_inputs(items, tokenizer, pad_id, 0, seq2seq, max_length, current, torch.device("cpu"))
        side = current["source"]
        eligible, rarest, two_rarest = rare_token_masks(side, counts, top)
        token_counts = counts[side.token_ids.clamp(0, counts.numel() - 1)].double().masked_fill(
            ~side.token_mask, float("inf"))  # [B, T]
        least = side.token_ids.gather(1, token_counts.sort(dim=1, stable=True)[1][:, :1]).squeeze(1)
        old = side.token_mask.any(1) & ~top[least.clamp(0, counts.numel() - 1)]  # the rule before audit33
        n += side.batch_size
        old_n += int(old.sum())
        new_n += int(eligible.sum())
        # a random token's chance of being the rarest / one of the two rarest: their share of the sentence's tokens
        length = side.token_mask.sum(1).clamp(min=1).double()
        chance = torch.stack([rarest.sum(1) / length, two_rarest.sum(1) / length])  # [2, B]
        shares["before"] += chance[:, old].sum(1)
        shares["after"] += chance[:, eligible].sum(1)
        unseen = eligible & (token_counts.min(1).values == 0)  # the least frequent token never in the training text
        never_seen += int(unseen.sum())
        never_seen_tied += int((unseen & (rarest.sum(1) > 1)).sum())
        for b in torch.nonzero(old & ~eligible).flatten().tolist():
            tokens = side.token_ids[b][side.token_mask[b]].tolist()
            taken_out.append({"sentence": items[b][1].sent_id, "tokens": tokenizer.convert_ids_to_tokens(tokens),
                              "count": int(counts[tokens[0]])})
    return {"model": str(model_dir), "train_text": [str(path) for path in train_text], "sentences": n,
            "unaligned": report.n_unaligned, "eligible_before": old_n, "eligible_after": new_n,
            "eligible_after_least_count_0": never_seen, "of_those_tied": never_seen_tied,
            "mean_share_rarest_two_rarest": {"before": (shares["before"] / max(old_n, 1)).tolist(),
                                             "after": (shares["after"] / max(new_n, 1)).tolist()},
            "taken_out": taken_out}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model")
    parser.add_argument("--conllu", required=True)
    parser.add_argument("--train-text", action="append", required=True)
    parser.add_argument("--limit", type=int, default=None, help="the first N sentences (--conllu-limit)")
    parser.add_argument("--top-frequent", type=int, default=500)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    result = count_ties(args.model, args.conllu, args.train_text, args.limit, args.top_frequent)
    print(json.dumps(result, indent=1, ensure_ascii=False))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
