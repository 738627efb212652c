"""Collect what each model's heads do into docs/results/profiles/ and docs/functions.md.

    .venv/bin/python experiments/model_profiles.py            # collect from runs/profiles/*, render
    .venv/bin/python experiments/model_profiles.py NAME ...   # collect only these models, render all
    .venv/bin/python experiments/model_profiles.py --docs-only # render from docs/results/profiles/

Each model of experiments/profiles.json is analysed by the command it lists (run by
experiments/profiles.sh); this script reads those analysis directories (functions and aggregate
results), writes one small profile JSON per model and regenerates the block "model-profiles"
of docs/functions.md. tests/test_profiles.py fails if the document and the JSON files differ.
"""

import argparse
import json
from pathlib import Path

from headlab.errors import HeadlabError
from headlab.nmt.export import exported_epoch
from headlab.pipeline.profiles import collect_profile, render_profiles, replace_block

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "results" / "profiles"
DOC = ROOT / "docs" / "functions.md"

parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
parser.add_argument("names", nargs="*", help="collect only these models (default: every model with an analysis); "
                    "an analysis left from earlier weights is then not collected by mistake")
parser.add_argument("--docs-only", action="store_true", help="render from the committed profiles only")
args = parser.parse_args()


def describe(model: dict) -> str:
    """The model's description, with {updates} and {epochs} of the exported epoch: the record of
    train_metrics.json's epoch (the last of an average) in train_history.json, else the last."""
    if "{" not in model["description"]:
        return model["description"]
    directory = ROOT / model["model"]
    history = json.loads((directory / "train_history.json").read_text())
    epoch = exported_epoch(directory)
    record = next((row for row in history if row["epoch"] == epoch), history[-1])
    return model["description"].format(updates=f"{record['step']:,}", epochs=record["epoch"])


models = json.loads((ROOT / "experiments" / "profiles.json").read_text())["models"]
if not args.docs_only:
    RESULTS.mkdir(parents=True, exist_ok=True)
    unknown = set(args.names) - {m["name"] for m in models}
    if unknown:
        parser.error(f"not in experiments/profiles.json: {', '.join(sorted(unknown))}")
    for model in models:
        if args.names and model["name"] not in args.names:
            continue
        analysis = ROOT / model["analysis"]
        if not (analysis / "functions" / "summary.json").is_file():
            print(f"skipping {model['name']}: no analysis in {analysis} (run experiments/profiles.sh)")
            continue
        try:
            profile = collect_profile(analysis, model["name"], describe(model))
        except HeadlabError as error:  # a killed or failed analysis (manifest.json does not vouch for it)
            print(f"skipping {model['name']}: {error}")
            continue
        profile["command"] = model["command"]
        (RESULTS / f"{model['name']}.json").write_text(json.dumps(profile, indent=1) + "\n")
        print(f"wrote {RESULTS / (model['name'] + '.json')}")
profiles = [json.loads((RESULTS / f"{m['name']}.json").read_text()) for m in models
            if (RESULTS / f"{m['name']}.json").is_file()]
DOC.write_text(replace_block(DOC.read_text(), "model-profiles", render_profiles(profiles)))
print(f"rendered {len(profiles)} profiles into {DOC}")
