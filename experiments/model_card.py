"""Regenerate the tables of a bundled model's card (language or translation model) from its result files.

    .venv/bin/python experiments/model_card.py models/english-lm
    .venv/bin/python experiments/model_card.py models/multi30k-en-de
"""

import json
import sys
from pathlib import Path

from headlab.lm.card import render_card_blocks as render_lm_card
from headlab.nmt.card import render_card_blocks as render_nmt_card
from headlab.pipeline.profiles import replace_block

model = Path(sys.argv[1])
config = json.loads((model / "config.json").read_text(encoding="utf-8"))
render = render_nmt_card if config.get("is_encoder_decoder") else render_lm_card
card = model / "README.md"
text = card.read_text(encoding="utf-8")
for name, body in render(model).items():
    text = replace_block(text, name, body)
card.write_text(text, encoding="utf-8")
print(f"updated {card}")
