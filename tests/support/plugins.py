"""A plug-in of each kind, the worked example of CONTRIBUTING.md (tests/test_plugins.py checks that
CONTRIBUTING.md shows this code as it is here, and runs it through ``headlab analyze``).

Each is what one new module of headlab would hold: an importance measure with one option, a head
statistic with a label group, and a report section that reads a file of its own. In the package
each would be registered by one line in its registry; here :func:`registered` registers all three
for the length of a ``with`` block.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from html import escape
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from headlab.adapters import attention_blocks
from headlab.data.alignment import AttentionView
from headlab.data.inputs import ImportanceData
from headlab.errors import HeadlabError
from headlab.functions.registry import STATISTICS
from headlab.functions.statistic import Labels, Statistic, empty_labels
from headlab.heads import HeadScores, head_scores, read_json
from headlab.importance.common import block_scores
from headlab.importance.measure import ImportanceMeasure
from headlab.importance.registry import MEASURES
from headlab.model_description import ModelInfo
from headlab.options import option
from headlab.plugins import Output
from headlab.report.collect import Collected
from headlab.report.section import Section
from headlab.report.sections import SECTIONS


# --8<-- [start:measure]
@dataclass(frozen=True)
class OutNormOptions:
    power: float = option(2.0, "out-norm: the order p of the norm of each head's output columns", range="(0, inf)")


class OutNorm(ImportanceMeasure):
    """A head's share of the output projection: the p-norm of its columns of W_o."""

    name = "out_norm"  # the registry key, the stage of analyze and importance/out_norm.json
    tables = {"out_norm": ("Output-projection norm", "p-norm of each head's columns of the output projection")}
    Options = OutNormOptions  # --out-norm-power in `headlab importance` and `headlab analyze`

    def score(self, model: nn.Module, data: ImportanceData, info: ModelInfo, *, batch_size: int = 32,
              kinds: tuple[str, ...] | None = None, progress: bool = False, tokenizer: Any = None) -> HeadScores:
        per_block = {}
        for block in attention_blocks(model):
            weight = block.o.weight if isinstance(block.o, nn.Linear) else block.o.weight.T  # [d_model, heads x d]
            columns = weight.detach().float().reshape(weight.shape[0], block.n_heads, block.d_head)
            per_block[block.key] = torch.linalg.vector_norm(columns, ord=self.options.power, dim=(0, 2)).numpy()
        # block_scores: a pruned model's heads at their original indices, the removed ones NaN
        scores = block_scores(attention_blocks(model), per_block, kinds)
        return HeadScores(scores, self.name, info.name, {"n_sentences": len(data)})
# --8<-- [end:measure]


# --8<-- [start:statistic]
@dataclass(frozen=True)
class FirstTokenOptions:
    per_layer: int = option(1, "first-token: heads labelled in each layer, those attending most to the first token",
                            range="[1, inf)")


class FirstTokenResult:
    def __init__(self, share: HeadScores, per_layer: int) -> None:
        self.share, self.per_layer = share, per_layer

    def write(self, directory: Path) -> list[Path]:
        return [self.share.save(Path(directory) / "first_token" / "share.json")]

    def markdown(self) -> list[str]:
        return ["## First-token heads", "", f"{len(self.describe_heads())} heads attend most to the first token "
                "in their layer.", ""]

    def labels(self) -> Labels:
        labels = empty_labels(self.share)
        for kind in self.share.kinds:
            for layer, row in enumerate(self.share[kind]):
                for head in np.argsort(-row, kind="stable")[: self.per_layer]:
                    labels[(kind, layer, int(head))].append("first-token")
        return labels

    def describe_heads(self) -> list[str]:
        return [f"first-token {kind} layer {layer} head {head}" for (kind, layer, head), names
                in self.labels().items() if names]


class FirstTokenStats:
    """The mean attention weight on a sentence's first token, per head (a streaming statistic)."""

    def __init__(self, options: FirstTokenOptions) -> None:
        self.options = options
        self.sums: dict[tuple[str, int], torch.Tensor] = {}
        self.rows: dict[tuple[str, int], int] = {}

    def update(self, view: AttentionView) -> None:
        probs = view.probs  # [batch, heads, rows, keys]
        key = view.block.key
        self.sums[key] = self.sums.get(key, 0) + probs[..., 0].sum(dim=(0, 2)).double()
        self.rows[key] = self.rows.get(key, 0) + probs.shape[0] * probs.shape[2]

    def result(self, *, model: str = "", signature: dict | None = None) -> FirstTokenResult:
        per_block = {key: (total / self.rows[key]).cpu().numpy() for key, total in self.sums.items()}
        share = head_scores(per_block, "first_token_share", model, signature or {})
        return FirstTokenResult(share, self.options.per_layer)


FIRST_TOKEN = Statistic(
    lambda config, frequencies, options: FirstTokenStats(options), title="first-token heads",
    Options=FirstTokenOptions, option_prefix="first_token_",  # --first-token-per-layer
    label_group="first_token", label_pattern="first-token",
    outputs=(Output("first_token/share.json", "First-token share", "mean attention weight on the first token"),))
# --8<-- [end:statistic]


# --8<-- [start:section]
def _read_share(directory: Path, note: Callable[[str], None]) -> dict | None:
    path = directory / "functions" / "first_token" / "share.json"
    if not path.is_file():
        return None
    try:
        return read_json(path, "first-token shares")
    except HeadlabError as error:
        note(str(error))
        return None


def _render(c: Collected) -> str:
    document = c.sections.get("first_token")
    heads = sorted(key for key, labels in c.labels.items() if "first-token" in labels)
    if not document:
        return '<p class="note">No first-token statistic in the analysis directory.</p>'
    return (f'<p class="caption">{escape(str(document.get("method")))}: {len(heads)} heads attend most to the '
            f'first token in their layer.</p><ul>' + "".join(f"<li>{escape(h)}</li>" for h in heads) + "</ul>")


FIRST_TOKEN_SECTION = Section("first_token", "First-token heads", "First token", _render,
                              stages=("functions",), collect=_read_share)
# --8<-- [end:section]


@contextmanager
def registered() -> Iterator[None]:
    """The three plug-ins in their registries, for the length of the block."""
    with ExitStack() as stack:
        stack.enter_context(MEASURES.registered("out_norm", OutNorm))
        stack.enter_context(STATISTICS.registered("first_token", FIRST_TOKEN))
        stack.enter_context(SECTIONS.registered("first_token", FIRST_TOKEN_SECTION))
        yield
