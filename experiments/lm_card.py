"""Regenerate the tables of a language model's card from its result files.

    .venv/bin/python experiments/lm_card.py models/english-lm
"""

import sys
from pathlib import Path

from headlab.analyze.profiles import replace_block
from headlab.lm.card import render_card_blocks

model = Path(sys.argv[1])
card = model / "README.md"
text = card.read_text(encoding="utf-8")
for name, body in render_card_blocks(model).items():
    text = replace_block(text, name, body)
card.write_text(text, encoding="utf-8")
print(f"updated {card}")
