"""Shared helpers for the head-function, aggregate and treebank tests (no tests in here).

Tiny tokenizers are built in memory with ``tokenizers`` (never downloaded); the sample
treebank is hand-written so that every test can count on its arcs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

from headlab.data.alignment import align_sentences, build_side_batch
from headlab.data.treebank import read_conllu

# Four sentences: nsubj, obj, amod, advmod arcs; a multiword token ("don't") and an empty node.
SAMPLE_CONLLU = """\
# sent_id = s1
# text = The old dog quickly chased a red ball.
1\tThe\tthe\tDET\tDT\t_\t3\tdet\t_\t_
2\told\told\tADJ\tJJ\t_\t3\tamod\t_\t_
3\tdog\tdog\tNOUN\tNN\t_\t5\tnsubj\t_\t_
4\tquickly\tquickly\tADV\tRB\t_\t5\tadvmod\t_\t_
5\tchased\tchase\tVERB\tVBD\t_\t0\troot\t_\t_
6\ta\ta\tDET\tDT\t_\t8\tdet\t_\t_
7\tred\tred\tADJ\tJJ\t_\t8\tamod\t_\t_
8\tball\tball\tNOUN\tNN\t_\t5\tobj\t_\tSpaceAfter=No
9\t.\t.\tPUNCT\t.\t_\t5\tpunct\t_\t_

# sent_id = s2
# text = Cats don't sleep here.
1\tCats\tcat\tNOUN\tNNS\t_\t4\tnsubj\t_\t_
2-3\tdon't\t_\t_\t_\t_\t_\t_\t_\t_
2\tdo\tdo\tAUX\tVBP\t_\t4\taux\t_\t_
3\tn't\tnot\tPART\tRB\t_\t4\tadvmod\t_\t_
4\tsleep\tsleep\tVERB\tVB\t_\t0\troot\t_\t_
5\there\there\tADV\tRB\t_\t4\tadvmod\t_\tSpaceAfter=No
6\t.\t.\tPUNCT\t.\t_\t4\tpunct\t_\t_

# sent_id = s3
# text = Birds sing and fish swim.
1\tBirds\tbird\tNOUN\tNNS\t_\t2\tnsubj\t_\t_
2\tsing\tsing\tVERB\tVBP\t_\t0\troot\t_\t_
3\tand\tand\tCCONJ\tCC\t_\t5\tcc\t_\t_
4\tfish\tfish\tNOUN\tNNS\t_\t5\tnsubj\t_\t_
4.1\tswim\tswim\tVERB\tVBP\t_\t_\t_\t5:conj\t_
5\tswim\tswim\tVERB\tVBP\t_\t2\tconj\t_\tSpaceAfter=No
6\t.\t.\tPUNCT\t.\t_\t2\tpunct\t_\t_

# sent_id = s4
# text = A very big zebra ate green grass slowly.
1\tA\ta\tDET\tDT\t_\t4\tdet\t_\t_
2\tvery\tvery\tADV\tRB\t_\t3\tadvmod\t_\t_
3\tbig\tbig\tADJ\tJJ\t_\t4\tamod\t_\t_
4\tzebra\tzebra\tNOUN\tNN\t_\t5\tnsubj\t_\t_
5\tate\teat\tVERB\tVBD\t_\t0\troot\t_\t_
6\tgreen\tgreen\tADJ\tJJ\t_\t7\tamod\t_\t_
7\tgrass\tgrass\tNOUN\tNN\t_\t5\tobj\t_\t_
8\tslowly\tslowly\tADV\tRB\t_\t5\tadvmod\t_\tSpaceAfter=No
9\t.\t.\tPUNCT\t.\t_\t5\tpunct\t_\t_
"""


def sample_sentences(tmp_path):
    path = tmp_path / "sample_sentences.conllu"
    path.write_text(SAMPLE_CONLLU, encoding="utf-8")
    return list(read_conllu(path))


def tiny_lm_on_sample(root) -> None:
    """A tiny headlab LM saved in ``root/lm`` (BPE on SAMPLE_CONLLU's words), with ``root/tb.conllu`` (the sample
    treebank) and ``root/text.txt`` (its words, one line): what ``headlab analyze`` needs."""
    from headlab.lm.model import LMConfig, build_lm_config, create_lm
    from headlab.nmt.tokenizer import train_tokenizer

    words = [line.split("\t")[1] for line in SAMPLE_CONLLU.splitlines() if line and line[0].isdigit()]
    tokenizer = train_tokenizer([" ".join(words)] * 3, vocab_size=80, min_frequency=1, bos=True)
    model = create_lm(build_lm_config(LMConfig(d_model=16, ffn_dim=32, layers=2, n_heads=2, max_positions=64),
                                      tokenizer), seed=0)
    model.save_pretrained(root / "lm")
    tokenizer.save_pretrained(root / "lm")
    (root / "tb.conllu").write_text(SAMPLE_CONLLU, encoding="utf-8")
    (root / "text.txt").write_text(" ".join(words) + "\n", encoding="utf-8")


def word_tokenizer(words, *, style: str = "marian", max_vocab: int = 99) -> PreTrainedTokenizerFast:
    """One token per word (WordLevel), with the special tokens of a model family.

    ``marian``: <pad>=0 </s>=1 <unk>=2, EOS appended. ``bert``: [PAD]=0 [UNK]=1 [CLS]=2 [SEP]=3,
    [CLS] A [SEP]. ``gpt2``: <|endoftext|>=0 as pad/eos/unk, nothing added.
    """
    if style == "marian":
        specials = ["<pad>", "</s>", "<unk>"]
    elif style == "bert":
        specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]"]
    else:
        specials = ["<|endoftext|>"]
    vocab = {token: i for i, token in enumerate(specials)}
    for word in words:
        if word not in vocab and len(vocab) < max_vocab:
            vocab[word] = len(vocab)
    unk = {"marian": "<unk>", "bert": "[UNK]", "gpt2": "<|endoftext|>"}[style]
    tok = Tokenizer(models.WordLevel(vocab, unk_token=unk))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    if style == "marian":
        tok.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
        return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", unk_token="<unk>")
    if style == "bert":
        tok.post_processor = processors.TemplateProcessing(
            single="[CLS] $A [SEP]", special_tokens=[("[CLS]", 2), ("[SEP]", 3)])
        return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]",
                                       cls_token="[CLS]", sep_token="[SEP]")
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<|endoftext|>", eos_token="<|endoftext|>",
                                   unk_token="<|endoftext|>")


def bpe_tokenizer(texts, vocab_size: int = 60) -> PreTrainedTokenizerFast:
    """A small SentencePiece-style BPE (Metaspace "▁"), EOS appended: words split into subwords."""
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<pad>", "</s>", "<unk>"],
                                  show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", unk_token="<unk>")


@dataclass(frozen=True)
class FakeBlock:
    """What the statistics read from an AttentionBlock."""

    kind: str
    layer: int
    n_heads: int

    @property
    def key(self):
        return (self.kind, self.layer)


TREEBANK_TEXTS = [line[len("# text = "):] for line in SAMPLE_CONLLU.splitlines() if line.startswith("# text = ")]


def save_marian_for_treebank(path, texts) -> None:
    """The tiny random Marian of support.models with a subword tokenizer (headlab's own trainer)
    fitted to ``texts`` plus the sample treebank's sentences and words, saved together at ``path``."""
    from headlab.nmt.tokenizer import train_tokenizer
    from support.models import tiny_model

    words = " ".join(line.split("\t")[1] for line in SAMPLE_CONLLU.splitlines() if line and line[0].isdigit())
    tokenizer = train_tokenizer(list(texts) + TREEBANK_TEXTS + [words], vocab_size=90, min_frequency=1)
    tiny_model("marian").save_pretrained(path)
    tokenizer.save_pretrained(path)


def side_batch(sentences, tokenizer, start_index: int = 0, max_length: int | None = None):
    """A SideBatch for ``sentences`` (all must align); ``side.lengths`` holds real token counts."""
    alignments = align_sentences(tokenizer, [s.words for s in sentences], max_length=max_length)
    for alignment in alignments:
        assert not isinstance(alignment, Exception), alignment
    items = [(s, a, start_index + i) for i, (s, a) in enumerate(zip(sentences, alignments))]
    side = build_side_batch(items, tokenizer.pad_token_id)
    side.lengths = [len(a) for a in alignments]
    return side, alignments


def uniform_probs(side, n_heads: int) -> torch.Tensor:
    """Uniform attention over each sentence's real tokens (specials included), padding zero."""
    B, T = side.token_ids.shape
    probs = torch.zeros(B, n_heads, T, T)
    for b, n in enumerate(side.lengths):
        probs[b, :, :n, :n] = 1.0 / n
    return probs


def first_tokens(side, b):
    """``{word: index of its first token}`` in sentence ``b``."""
    found = {}
    for t, w in enumerate(side.token_word[b].tolist()):
        if w >= 0 and w not in found:
            found[w] = t
    return found


def force_word_targets(probs, side, head: int, targets):
    """In ``head``, every token of word ``i`` puts all its attention on the first token of word
    ``targets[b][i]``; ``None`` (and every special token) sends it all to the sentence's last
    real token (the EOS). Returns a new tensor."""
    probs = probs.clone()
    T = probs.shape[-1]
    for b, n in enumerate(side.lengths):
        first = first_tokens(side, b)
        eos = n - 1
        for t in range(n):
            w = int(side.token_word[b, t])
            target = targets[b][w] if w >= 0 else None
            row = torch.zeros(T)
            row[eos if target is None else first[target]] = 1.0
            probs[b, head, t] = row
    return probs


class ForcedAttention:
    """Force what one head of a real model's block reports as its attention probabilities.

    A forward pre-hook on the model keeps the batch's ``input_ids``; a forward hook on the
    block's attention core (registered before :func:`headlab.capture_attention` adds its own,
    so it runs first) replaces head ``head``'s probabilities with ``pattern(ids, T)``, a
    ``[B, T, T]`` tensor. Use as a context manager around the analysis, on the eager path
    (``engine="eager"``: the fused default never returns the module's probabilities).
    """

    def __init__(self, model, block, head: int, pattern) -> None:
        self.model, self.block, self.head, self.pattern = model, block, head, pattern
        self.ids = None
        self.handles = []

    def __enter__(self):
        def keep_ids(module, args, kwargs):
            self.ids = kwargs.get("input_ids", args[0] if args else None)

        def force(module, args, output):
            index = self.block.family.probs_index
            probs = output[index].clone()
            probs[:, self.head] = self.pattern(self.ids, probs.shape[-1]).to(probs.dtype)
            return (*output[:index], probs, *output[index + 1:])

        self.handles = [
            self.model.register_forward_pre_hook(keep_ids, with_kwargs=True),
            self.block.core.register_forward_hook(force),
        ]
        return self

    def __exit__(self, *exc):
        for handle in self.handles:
            handle.remove()


def token_pattern(ids, T, pad_id: int, choose):
    """``[B, T, T]``: token ``t`` of row ``b`` attends fully to ``choose(row_ids, t)``; rows of
    padding attend to position 0."""
    B = ids.shape[0]
    out = torch.zeros(B, T, T)
    for b in range(B):
        row = ids[b].tolist()
        n = len(row)
        while n and row[n - 1] == pad_id:
            n -= 1
        for t in range(T):
            target = choose(row[:n], t) if t < n else 0
            out[b, t, target] = 1.0
    return out
