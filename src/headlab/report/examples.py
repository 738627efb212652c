"""Attention of a few example sentences, stored compactly for the report's viewer.

Layout under ``out_dir`` (normally ``ANALYSIS_DIR/attention/``)::

    index.json            {"format": 1, "model", "scale": 255, "sentences": [{"id", "file",
                           "line", "source", "target", "target_from", "n_tokens": {side: n},
                           "blocks": ["enc_self:0", ...]}]}
    sentence-000.json     {"id", "tokens": {"source": [...], "target": [...]},
                           "blocks": {"enc_self:0": {"kind", "layer", "q": side, "k": side,
                                      "shape": [heads, q_len, k_len], "data": base64(uint8)}},
                                      (a pruned model: heads by their original index, and
                                      "removed": [head, ...] with rows of 0)
                           "gold": {...}}   (treebank sentences only: see gold_arcs)

Sentences from a treebank (:func:`write_treebank_examples`) also carry ``"treebank": "file:line
(sent_id)"`` in index.json, which lists the ones that could not be aligned under ``"skipped"``.

Each probability ``p`` is stored as ``round(255 p)`` (one byte), so a value read back as
``q / 255`` is within ``0.5 / 255`` of the captured one. Sides: ``source`` (encoder input, or
the only input of an encoder-only / decoder-only model) and ``target`` (the decoder input:
start token + target tokens but the last, i.e. teacher forcing). ``enc_self`` attends
source -> source, ``dec_self`` target -> target (source -> source for a decoder-only model),
``dec_cross`` target -> source.
"""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping, Sequence

import numpy as np
import torch

from headlab import preflight
from headlab.capture import capture_attention, eval_mode, stream_attention
from headlab.data.treebank import InMemoryTreebank, ProblemLog, Sentence, read_conllu
from headlab.errors import HeadlabError, counted
from headlab.heads import KINDS, BlockKey, atomic_write_text, renumbering_needed, to_original, write_json
from headlab.model_description import describe_model

__all__ = ["FORMAT", "SCALE", "gold_arcs", "write_attention_examples", "write_treebank_examples", "write_example",
           "write_index", "load_example", "quantize", "dequantize"]

FORMAT = 1
SCALE = 255


def quantize(probs: np.ndarray) -> np.ndarray:
    """Probabilities in [0, 1] as ``uint8`` ``round(255 p)``."""
    return np.clip(np.rint(np.asarray(probs, dtype=np.float64) * SCALE), 0, SCALE).astype(np.uint8)


def dequantize(values: np.ndarray) -> np.ndarray:
    return np.asarray(values, dtype=np.float32) / SCALE


def _sides(kind: str, seq2seq: bool) -> tuple[str, str]:
    if not seq2seq:
        return "source", "source"
    return {"enc_self": ("source", "source"), "dec_self": ("target", "target"),
            "dec_cross": ("target", "source")}[kind]


def write_example(
    out_dir: Path,
    index: int,
    tokens: Mapping[str, Sequence[str]],
    attention: Mapping[tuple[str, int], np.ndarray],
    seq2seq: bool,
    gold: dict | None = None,
    removed: Mapping[BlockKey, list[int]] | None = None,
) -> dict:
    """Store one sentence: ``attention[(kind, layer)]`` is a float array ``[heads, q_len, k_len]``
    (or one already quantised, ``uint8``); ``gold``, a treebank sentence's parse (:func:`gold_arcs`);
    ``removed``, the heads of a block that pruning removed (their rows are 0: :func:`original_attention`).

    Returns the sentence's entry for ``index.json`` (without the text fields).
    """
    blocks = {}
    for (kind, layer), probs in sorted(attention.items(), key=lambda kv: (KINDS.index(kv[0][0]), kv[0][1])):
        probs = np.asarray(probs)
        q_side, k_side = _sides(kind, seq2seq)
        expected = (len(tokens[q_side]), len(tokens[k_side]))
        if probs.ndim != 3 or probs.shape[1:] != expected:
            raise HeadlabError(f"attention {kind}:{layer} has shape {probs.shape}, expected [heads, {expected[0]}, "
                               f"{expected[1]}] for the {q_side} -> {k_side} tokens")
        blocks[f"{kind}:{layer}"] = {
            "kind": kind, "layer": int(layer), "q": q_side, "k": k_side, "shape": list(probs.shape),
            "data": base64.b64encode((probs if probs.dtype == np.uint8 else quantize(probs)).tobytes()).decode("ascii"),
        }
        if removed and removed.get((kind, layer)):
            blocks[f"{kind}:{layer}"]["removed"] = list(removed[(kind, layer)])
    name = f"sentence-{index:03d}.json"
    payload = {"format": FORMAT, "id": index, "scale": SCALE,
               "tokens": {side: [str(t) for t in toks] for side, toks in tokens.items()}, "blocks": blocks}
    if gold is not None:
        payload["gold"] = gold
    atomic_write_text(out_dir / name, json.dumps(payload, ensure_ascii=False, separators=(",", ":")) + "\n")
    return {"id": index, "file": name, "n_tokens": {side: len(t) for side, t in tokens.items()},
            "blocks": list(blocks)}


def write_index(out_dir: Path, entries: list[dict], model: str = "", skipped: list[dict] | None = None) -> Path:
    index: dict = {"format": FORMAT, "model": model, "scale": SCALE, "sentences": entries}
    if skipped is not None:  # treebank sentences that could not be aligned
        index["skipped"] = skipped
    return write_json(out_dir / "index.json", index, ensure_ascii=False)


def load_example(path: Path) -> tuple[dict[str, list[str]], dict[tuple[str, int], np.ndarray]]:
    """Read one ``sentence-NNN.json``: tokens per side and dequantised attention per block."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
        attention = {}
        for block in data["blocks"].values():
            raw = np.frombuffer(base64.b64decode(block["data"]), dtype=np.uint8)
            attention[(block["kind"], int(block["layer"]))] = dequantize(raw.reshape(block["shape"]))
        return data["tokens"], attention
    except FileNotFoundError as error:
        raise HeadlabError(f"{path}: no such attention example") from error
    except (KeyError, TypeError, ValueError) as error:
        raise HeadlabError(f"{path}: not an attention example file ({error})") from error


def _quantized_attention(model, inputs: dict, query_chunk: int) -> dict[tuple[str, int], np.ndarray]:
    """Every block's attention for one sentence, ``uint8`` ``[heads, q_len, k_len]`` (see
    :func:`quantize`), filled chunk by chunk from headlab's own attention function."""
    maps: dict[tuple[str, int], np.ndarray] = {}

    def on_chunk(block, chunk) -> None:
        if chunk.start == 0:
            maps[block.key] = np.empty((chunk.probs.shape[1], chunk.q_len, chunk.k_len), dtype=np.uint8)
        maps[block.key][:, chunk.start:chunk.stop] = quantize(chunk.full()[0].float().cpu().numpy())

    with torch.no_grad(), stream_attention(model, on_chunk, query_chunk=query_chunk):
        model(**inputs)
    return maps


def _encode(tokenizer, text: str, max_length: int, target: bool = False) -> list[int]:
    key = "text_target" if target else "text"
    return list(tokenizer(**{key: text}, truncation=True, max_length=max_length)["input_ids"])


def write_attention_examples(
    model,
    tokenizer,
    sources: Sequence[str],
    targets: Sequence[str] | None,
    out_dir: Path,
    max_sentences: int = 20,
    max_new_tokens: int | None = None,
    query_chunk: int | None = None,
    max_length: int | None = None,
) -> list[str]:
    """Capture and store the attention of up to ``max_sentences`` sentences under ``out_dir``.

    For an encoder-decoder model the decoder is teacher-forced on ``targets`` (or, without
    targets, on the model's own greedy translation), giving ``enc_self``, ``dec_self`` and
    ``dec_cross``. Returns the written paths relative to ``out_dir``'s parent. One sentence per
    forward pass (no padding, so nothing has to be cut away), under ``torch.no_grad`` in eager
    attention; with ``query_chunk``, through headlab's own attention function
    (:func:`headlab.capture.stream_attention`), each chunk of query rows quantised as it arrives,
    so no block's float map exists (the stored maps, one byte a weight, remain). ``max_length``:
    sentences cut to it, as the statistics cut them (default: the model's limit)."""
    if targets is not None and len(targets) != len(sources):
        raise HeadlabError(f"{counted(len(sources), 'source sentence')} but {counted(len(targets), 'target')}")
    info = _prepare(model, tokenizer, out_dir, max_sentences, query_chunk, max_length)
    items = ((line, source.strip(), None, None) for line, source in enumerate(sources, start=1) if source.strip())
    return _write_all(model, tokenizer, info, items, targets, Path(out_dir), max_sentences, max_new_tokens, query_chunk)


def gold_arcs(sentence: Sentence, word_of_token: Sequence[int]) -> dict:
    """A treebank sentence's gold parse on its displayed tokens (the ``gold`` field of
    ``sentence-NNN.json``): each word's token span ``[first, last]`` (None for a word cut off by
    truncation) and each arc ``[dependent token, governor token, deprel]`` between the words'
    first tokens, the token that stands for a word as query and as key (the ``first`` word
    pooling of :mod:`headlab.data.alignment`). An arc with a word cut off is left out."""
    spans: dict[int, list[int]] = {}
    for token, word in enumerate(int(w) for w in word_of_token):
        if word >= 0:
            spans.setdefault(word, [token, token])[1] = token
    arcs = [[spans[dependent][0], spans[governor][0], label] for governor, dependent, label in sentence.arcs()
            if dependent in spans and governor in spans]
    root = [spans[i][0] for i, head in enumerate(sentence.heads) if head < 0 and i in spans]
    return {"side": "source", "where": sentence.where, "words": list(sentence.words), "upos": list(sentence.upos),
            "heads": list(sentence.heads), "deprels": list(sentence.deprels),
            "spans": [spans.get(i) for i in range(len(sentence))], "arcs": arcs, "root": root,
            "n_arcs": sum(1 for head in sentence.heads if head >= 0)}


def write_treebank_examples(
    model,
    tokenizer,
    treebank: "str | Path | InMemoryTreebank | Iterable[Sentence | None]",
    targets: Sequence[str] | None,
    out_dir: Path,
    max_sentences: int = 20,
    max_new_tokens: int | None = None,
    query_chunk: int | None = None,
    limit: int | None = None,
    max_length: int | None = None,
) -> list[str]:
    """:func:`write_attention_examples` on the first ``max_sentences`` sentences of a treebank
    that can be aligned (:func:`headlab.data.alignment.align_sentences`, words joined by spaces as
    the head functions join them), each stored with its gold parse on the displayed tokens
    (:func:`gold_arcs`), so that the viewer can overlay the gold arcs on a head's attention.
    ``treebank``: a CoNLL-U file or :class:`~headlab.data.treebank.InMemoryTreebank` (its first
    ``limit`` sentences; a malformed one is skipped in its place), or sentences already read.
    ``targets[i]`` is the reference translation of sentence ``i`` (a ``None`` sentence keeps its
    place, as :func:`~headlab.data.treebank.read_conllu` yields with ``keep_place``). A sentence
    that cannot be aligned is left out and listed in index.json's ``skipped``."""
    from headlab.data.alignment import AlignmentError, align_sentences

    info = _prepare(model, tokenizer, out_dir, max_sentences, query_chunk, max_length)
    skipped: list[dict] = []
    if isinstance(treebank, (str, Path, InMemoryTreebank)):
        sentences: Iterable[Sentence | None] = read_conllu(treebank, problems=ProblemLog(), limit=limit,
                                                           keep_place=True)
    else:
        sentences = list(treebank)[:limit]

    def items() -> Iterator[tuple[int, str, list[int], dict]]:
        for n, sentence in enumerate(sentences):
            if sentence is None or not len(sentence):
                continue
            aligned = align_sentences(tokenizer, [sentence.words], max_length=info.max_length)[0]
            if isinstance(aligned, AlignmentError):
                skipped.append({"where": sentence.where, "reason": str(aligned)})
                continue
            gold = gold_arcs(sentence, aligned.word_of_token.tolist())
            yield n + 1, " ".join(sentence.words), list(aligned.input_ids), gold

    if targets is not None:
        targets = list(targets)
    return _write_all(model, tokenizer, info, items(), targets, Path(out_dir), max_sentences, max_new_tokens,
                      query_chunk, skipped)


def original_attention(model, attention: dict[BlockKey, np.ndarray]
                       ) -> tuple[dict[BlockKey, np.ndarray], dict[BlockKey, list[int]] | None]:
    """A physically pruned model's attention ``[heads, q_len, k_len]`` per block with its heads by
    their original index, as the report's tables name them (rows of 0 for removed heads), and the
    removed heads per block; a model whose heads are its original ones: as it is, and None."""
    from headlab.adapters import attention_blocks
    from headlab.surgery import original_heads

    numbering = {block.key: original_heads(block) for block in attention_blocks(model) if block.key in attention}
    if not renumbering_needed(numbering):
        return attention, None
    removed = {key: [h for h in range(n) if h not in kept] for key, (kept, n) in numbering.items()}
    return to_original(attention, numbering, 0), removed


def _prepare(model, tokenizer, out_dir: Path, max_sentences: int, query_chunk: int | None, max_length: int | None):
    """The checks before any work; the model's description."""
    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise HeadlabError(f"{out_dir}: exists and is not a directory")
    if max_sentences < 0:
        raise HeadlabError(f"max_sentences must be >= 0, got {max_sentences}")
    preflight.query_chunk(query_chunk)
    return describe_model(model, tokenizer, max_length=max_length)


def _write_all(model, tokenizer, info, items: Iterable[tuple[int, str, list[int] | None, dict | None]],
               targets: Sequence[str] | None, out_dir: Path, max_sentences: int, max_new_tokens: int | None,
               query_chunk: int | None, skipped: list[dict] | None = None) -> list[str]:
    """Capture and store each ``(line, text, token ids or None, gold parse or None)`` of ``items``
    (``line`` is 1-based, the place of ``targets``' reference) until ``max_sentences`` are written."""
    seq2seq = info.is_seq2seq
    device = next(model.parameters()).device
    out_dir.mkdir(parents=True, exist_ok=True)
    for stale in out_dir.glob("sentence-*.json"):
        stale.unlink()
    entries: list[dict] = []
    written: list[Path] = []
    with eval_mode(model):
        for line, source, ids, gold in items:
            if len(entries) >= max_sentences:
                break
            target = targets[line - 1] if targets is not None else None
            if target is not None and seq2seq and not target.strip():
                continue
            if ids is None:
                ids = _encode(tokenizer, source, info.max_length)
            inputs: dict[str, Any] = {"input_ids": torch.tensor([ids], device=device),
                                      "attention_mask": torch.ones(1, len(ids), dtype=torch.long, device=device)}
            tokens = {"source": tokenizer.convert_ids_to_tokens(ids)}
            target_from = None
            if seq2seq:
                start = info.decoder_start_id if info.decoder_start_id is not None else info.pad_id
                if target is not None:
                    target_ids = _encode(tokenizer, target.strip(), info.max_length, target=True)
                    target_from = "reference"
                else:
                    with torch.no_grad():
                        limit = max_new_tokens or min(info.max_length, 2 * len(ids) + 10)
                        generated = model.generate(**inputs, max_new_tokens=limit, max_length=None,  # no warning
                                                   do_sample=False, num_beams=1)
                    target_ids = [int(t) for t in generated[0].tolist()[1:]]
                    target_from = "translation"
                decoder_ids = ([start] + target_ids[:-1])[: info.max_length]
                inputs["decoder_input_ids"] = torch.tensor([decoder_ids], device=device)
                inputs["use_cache"] = False  # teacher-forced (FSMT builds its causal mask only without a cache)
                tokens["target"] = tokenizer.convert_ids_to_tokens(decoder_ids)
            if query_chunk is None:
                with torch.no_grad(), capture_attention(model) as record:
                    model(**inputs)
                attention = {key: probs[0].float().cpu().numpy() for key, probs in record.items()}
            else:
                attention = _quantized_attention(model, inputs, query_chunk)
            attention, removed = original_attention(model, attention)
            entry = write_example(out_dir, len(entries), tokens, attention, seq2seq, gold, removed)
            entry.update({"line": line, "source": source, "target": target.strip() if target else None,
                          "target_from": target_from})
            if gold is not None:
                entry["treebank"] = gold["where"]
            if target_from == "translation":
                entry["target"] = tokenizer.decode(target_ids, skip_special_tokens=True)
            entries.append(entry)
            written.append(out_dir / entry["file"])
    name = getattr(getattr(model, "config", None), "name_or_path", "") or ""
    written.append(write_index(out_dir, entries, str(name), skipped))
    return [str(path.relative_to(out_dir.parent)) for path in written]
