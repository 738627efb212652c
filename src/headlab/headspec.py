"""Head specs a person can type, and JSON mask files.

Typed: items ``KIND:LAYER:HEADS`` separated by spaces or semicolons, where HEADS is a comma
list of indices and ranges (spaces around its commas and dashes allowed), or ``*`` for every head::

    enc_self:0:1,2  enc_self:3:0-5  dec_cross:5:*

JSON: either ``{"enc_self": {"0": [1, 2]}}`` (heads to remove per layer), or a keep-matrix
``{"enc_self": [[1, 0, 1, ...], ...]}`` with layer outer, head inner, 0 = remove (the form of
Michel et al.'s and Voita et al.'s masks). A HeadScores-style ``{"scores": {...}}`` wrapper
around either form is accepted too.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from headlab.adapters import AttentionBlock, find_block
from headlab.errors import HeadlabError, counted
from headlab.heads import check_kind, read_json

_ITEM = re.compile(r"^(?P<kind>[a-z_]+):(?P<layer>\d+):(?P<heads>\*|[\d,\-]+)$")


def _check_heads(heads: list[int], block: AttentionBlock, where: str) -> None:
    for head in heads:
        if not 0 <= head < block.n_heads:
            have = f"its heads are 0..{block.n_heads - 1}" if block.n_heads else "it has no heads left"
            raise HeadlabError(f"{where}: {block.kind} layer {block.layer} has no head {head} ({have})")


def is_mask_file(text: str) -> bool:
    """Whether a ``--heads`` value names a JSON mask file rather than a typed spec."""
    return text.endswith(".json") or Path(text).is_file()


def _items(text: str) -> list[str]:
    """The ``KIND:LAYER:HEADS`` items of a typed spec, separated by spaces or semicolons."""
    text = re.sub(r"\s*([,-])\s*", r"\1", text)  # "1, 2" and "1 - 3" are one item's heads, as "1,2" and "1-3"
    return [item for item in re.split(r"[;\s]+", text.strip()) if item]


def whole_layers(text: str) -> frozenset[tuple[str, int]] | None:
    """The layers a typed spec names whole (``KIND:LAYER:*``); None for a mask file."""
    if is_mask_file(text):
        return None
    matches = (_ITEM.match(item) for item in _items(text))
    return frozenset((check_kind(m["kind"]), int(m["layer"])) for m in matches if m and m["heads"] == "*")


def parse_heads(text: str, blocks: list[AttentionBlock] | None) -> dict[tuple[str, int], list[int]]:
    """Parse a typed spec or, if ``text`` names a ``.json`` file, a mask file.

    Every head named must exist in ``blocks``; a head named twice is removed once. ``blocks``
    None checks the spec's form only (a pruned model's heads are known once its weights are read):
    the heads of ``*`` are then left out of the result.
    """
    if is_mask_file(text):
        if blocks is None:
            read_json(Path(text), "mask file")  # a missing or unreadable file: before the weights load
            return {}
        return load_mask_file(text, blocks)
    return {key: sorted(set(value)) for key, value in _typed_spec(text, blocks).items() if value}


def repeated_heads(text: str, blocks: list[AttentionBlock] | None) -> list[str]:
    """The heads a typed spec or a mask file's ``{layer: [heads]}`` lists name more than once (``enc_self:0:1``), for
    a note: :func:`parse_heads` removes each once, so "1,1" where "1,2" was meant removes one head, not two."""
    if is_mask_file(text):
        data = read_json(Path(text), "mask file")
        if isinstance(data, dict) and "scores" in data:
            data = data["scores"]
        named: dict = {}
        for kind, value in (data.items() if isinstance(data, dict) else ()):
            if isinstance(value, dict):  # a keep-matrix has one entry per head: nothing to repeat
                named.update({(kind, layer): heads for layer, heads in value.items() if isinstance(heads, list)})
        return repeated_in(named)
    return repeated_in(_typed_spec(text, blocks))


def repeated_in(spec: dict) -> list[str]:
    """``KIND:LAYER:HEAD`` of each head that ``spec`` (``{(kind, layer): [head, ...]}``) lists more than once."""
    repeated = []
    for key, heads in spec.items():
        heads = list(heads) if isinstance(heads, (list, tuple)) else []
        where = ":".join(str(part) for part in (key if isinstance(key, tuple) else (key,)))
        repeated += [f"{where}:{head}" for head in sorted(set(heads), key=str) if heads.count(head) > 1]
    return repeated


def repeated_note(repeated: list[str], what: str) -> str:
    """The note on heads named more than once (the CLI's and the API's words)."""
    shown = ", ".join(repeated[:5]) + (" ..." if len(repeated) > 5 else "")
    return f"{what} names {shown} more than once; each head is removed once"


def _typed_spec(text: str, blocks: list[AttentionBlock] | None) -> dict[tuple[str, int], list[int]]:
    """A typed spec's heads per block as named, repeats kept."""
    spec: dict[tuple[str, int], list[int]] = {}
    items = _items(text)
    if not items:
        raise HeadlabError("--heads: empty head spec")
    for item in items:
        match = _ITEM.match(item)
        if not match:
            raise HeadlabError(f"--heads: cannot read {item!r}; expected KIND:LAYER:HEADS, e.g. enc_self:0:1,2 or dec_cross:5:*")
        try:
            kind, layer = check_kind(match["kind"]), int(match["layer"])
            block = find_block(blocks, kind, layer) if blocks is not None else None
        except HeadlabError as error:
            raise HeadlabError(f"--heads {item!r}: {error}") from None
        heads = spec.setdefault((kind, layer), [])
        if match["heads"] == "*":
            heads.extend(range(block.n_heads) if block is not None else ())
            continue
        for part in match["heads"].split(","):
            if "-" in part:
                start, _, end = part.partition("-")
                if not (start.isdigit() and end.isdigit()) or int(end) < int(start):
                    raise HeadlabError(f"--heads: bad range {part!r} in {item!r}")
                heads.extend(range(int(start), int(end) + 1))
            elif part.isdigit():
                heads.append(int(part))
            elif not part:  # "1,,2" or a trailing comma: "bad head index ''" did not say where
                raise HeadlabError(f"--heads: a comma with no head index after or before it in {item!r}")
            else:
                raise HeadlabError(f"--heads: bad head index {part!r} in {item!r}")
        if block is not None:
            _check_heads(heads, block, f"--heads {item!r}")
    return spec


def load_mask_file(path: str | Path, blocks: list[AttentionBlock]) -> dict[tuple[str, int], list[int]]:
    """Read a JSON mask file (see the module docstring); every error names the file and the key."""
    path = Path(path)
    data = read_json(path, "mask file")
    if isinstance(data, dict) and "scores" in data:
        data = data["scores"]
    if not isinstance(data, dict):
        raise HeadlabError(f"{path}: expected an object keyed by attention kind, found {type(data).__name__}")
    spec: dict[tuple[str, int], list[int]] = {}
    for kind, value in data.items():
        try:
            check_kind(kind)
        except HeadlabError as error:
            raise HeadlabError(f"{path}: {error}") from None
        if isinstance(value, dict):
            for layer, heads in value.items():
                where = f"{path}: {kind}: layer {layer!r}"
                if not (isinstance(layer, str) and re.fullmatch(r"[0-9]+", layer)):  # not str.isdigit: "²"
                    raise HeadlabError(f"{where}: a layer key is a layer number, e.g. \"0\"")
                if not isinstance(heads, list) or not all(type(h) is int for h in heads):
                    raise HeadlabError(f"{where}: expected a list of head numbers (integers), found {json.dumps(heads)}")
                try:
                    block = find_block(blocks, kind, int(layer))
                except HeadlabError as error:
                    raise HeadlabError(f"{path}: {kind}: {error}") from None
                _check_heads(heads, block, where)
                spec[(kind, int(layer))] = sorted(set(heads))
        elif isinstance(value, list):
            n_layers = sum(1 for b in blocks if b.kind == kind)
            if len(value) != n_layers:
                raise HeadlabError(f"{path}: {kind} mask has {counted(len(value), 'layer')}; the model has {n_layers}")
            for layer, row in enumerate(value):
                block = find_block(blocks, kind, layer)
                if not isinstance(row, list):
                    raise HeadlabError(f"{path}: {kind} layer {layer}: expected a list of {block.n_heads} 0/1 "
                                       f"entries, found {json.dumps(row)}")
                if len(row) != block.n_heads:
                    raise HeadlabError(
                        f"{path}: {kind} layer {layer} mask has {counted(len(row), 'entry', 'entries')}; "
                        f"the layer has {counted(block.n_heads, 'head')}"
                    )
                if any(type(v) not in (int, float, bool) or v not in (0, 1) for v in row):
                    raise HeadlabError(f"{path}: {kind} layer {layer}: a keep-mask holds only 0 and 1, found {json.dumps(row)}")
                spec[(kind, layer)] = [h for h, keep in enumerate(row) if not keep]
        else:
            raise HeadlabError(f"{path}: {kind}: expected a keep-matrix or {{layer: [heads]}}")
    return {key: heads for key, heads in spec.items() if heads}
