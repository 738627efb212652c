"""The HTML report: its size, and its load time in headless Chromium.

For an analysis directory (default ``runs/demo``, written by ``headlab demo``) the report is
rebuilt (``headlab.report.build_report``, timed), then opened ``--repeats`` times in a fresh
page of headless Chromium (Debian's ``chromium``, driven by Playwright). Per load:

* ``load``: navigation start to the end of the load event (Navigation Timing);
* ``render``: navigation start to the report's ``headlab-rendered`` mark (heatmaps drawn,
  viewer set up) and until the viewer has drawn its first head (``body[data-rendered]``);
* ``click``: a click on a heatmap cell until the viewer shows that head (Playwright's click,
  with its scrolling and actionability checks);
* ``model view`` / ``head view``: the in-page time to switch the viewer to that view and draw it.

Medians are printed, with the report's size (index.html plus attention/*.js when the
attention data is not inlined).

    python benchmarks/bench_report.py                       # runs/demo
    python benchmarks/bench_report.py DIR --repeats 10
    python benchmarks/bench_report.py --stand-in /tmp/report-bench
    python benchmarks/bench_report.py runs/demo --screenshot docs/img/report-screenshot.png

``--synthetic 24x16 --synthetic 32x32`` writes synthetic analysis directories of a decoder-only
model of that many layers x heads (every file the report reads, all 18 POS tags, exemplars,
``--sentences`` attention examples of ``--tokens`` tokens; ``tests/support/report.py``'s
``build_large_dir``) and measures each, adding the time to draw the model view and the head view.

    python benchmarks/bench_report.py --synthetic 24x16 --synthetic 32x32 --work /tmp/report-scale

``--stand-in DIR`` first writes a demo-sized stand-in analysis directory, for when no demo run
exists: the bundled model's attention on the first 20 Multi30k test sentences
(``write_attention_examples``) and the importance results kept in
docs/results/importance-multi30k (6 + 6 layers, 8 heads: the demo's shapes), plus the head
functions and aggregate statistics in runs/functions-multi30k-en-de when that directory exists.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking",
        "--disable-component-update", "--disable-sync"]


def stand_in(directory: Path, sentences: int) -> Path:
    import torch

    from headlab.data.parallel import read_lines
    from headlab.heads import atomic_write_text
    from headlab.loading import load_model, load_tokenizer
    from headlab.report import write_attention_examples

    torch.set_num_threads(1)
    directory.mkdir(parents=True, exist_ok=True)
    results = ROOT / "docs" / "results" / "importance-multi30k"
    (directory / "importance").mkdir(exist_ok=True)
    for path in results.glob("*.json"):
        shutil.copy(path, directory / "importance" / path.name)
    functions = ROOT / "runs" / "functions-multi30k-en-de"  # `headlab functions --aggregate` output, if kept
    figures = []
    if functions.is_dir():
        shutil.copytree(functions, directory / "functions", dirs_exist_ok=True,
                        ignore=shutil.ignore_patterns("aggregate"))
        shutil.copytree(functions / "aggregate", directory / "aggregate", dirs_exist_ok=True)
        (directory / "figures").mkdir(exist_ok=True)
        for png in sorted(functions.glob("*.png")):
            shutil.copy(png, directory / "figures" / png.name)
            figures.append({"name": png.stem, "title": png.stem.replace("_", " "), "caption": "from " +
                            str(functions.relative_to(ROOT)), "png": f"figures/{png.name}", "svg": None})
    model_dir = ROOT / "models" / "multi30k-en-de"
    model, tokenizer = load_model(str(model_dir)), load_tokenizer(str(model_dir))
    sources = list(read_lines(ROOT / "data" / "multi30k" / "test_2016_flickr.en.gz"))[:sentences]
    targets = list(read_lines(ROOT / "data" / "multi30k" / "test_2016_flickr.de.gz"))[:sentences]
    start = time.perf_counter()
    outputs = write_attention_examples(model, tokenizer, sources, targets, directory / "attention", sentences)
    seconds = time.perf_counter() - start
    # a row per stage with its files, as analyze records them: the report reads no file of a stage
    # that the manifest does not list as done (headlab.report.vouched)
    from headlab.report.vouched import stage_of

    copied: dict[str, list[str]] = {}
    for top in ("importance", "functions", "aggregate", "figures"):
        for path in sorted(p for p in (directory / top).rglob("*") if p.is_file()):
            relative = path.relative_to(directory).as_posix()
            copied.setdefault(stage_of(relative) or top, []).append(relative)
    stages = [{"name": name, "status": "done", "reason": "copied (stand-in)", "seconds": None, "outputs": files}
              for name, files in copied.items()]
    manifest = {"headlab_version": "0.1.0", "model": "multi30k-en-de (stand-in)", "source": "test_2016_flickr.en.gz",
                "target": "test_2016_flickr.de.gz", "conllu": None, "created": time.strftime("%Y-%m-%dT%H:%M:%SZ"),
                "stages": [*stages, {"name": "attention", "status": "done", "reason": None, "seconds": round(seconds, 2),
                                     "outputs": outputs}],
                "figures": figures}
    atomic_write_text(directory / "manifest.json", json.dumps(manifest, indent=1))
    print(f"stand-in: {len(outputs) - 1} sentences of attention in {seconds:.1f} s -> {directory}")
    return directory


def measure(directory: Path, repeats: int, executable: str, screenshot: str | None = None) -> dict:
    from playwright.sync_api import sync_playwright

    from headlab.report import build_report

    start = time.perf_counter()
    report = build_report(directory)
    build_s = time.perf_counter() - start
    size = report.stat().st_size
    inlined = report.read_text(encoding="utf-8").count('id="headlab-attention-')
    sidecars = sum(p.stat().st_size for p in (directory / "attention").glob("*.js"))
    loads, renders, firsts, clicks = [], [], [], []
    views: dict[str, list[float]] = {}
    with sync_playwright() as playwright, tempfile.TemporaryDirectory() as profile:
        context = playwright.chromium.launch_persistent_context(profile, executable_path=executable, headless=True,
                                                                args=ARGS, viewport={"width": 1280, "height": 900})
        errors: list[str] = []
        for _ in range(repeats):
            page = context.new_page()
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
            page.goto(report.resolve().as_uri(), wait_until="load")
            page.wait_for_selector("body[data-rendered='1']")
            first = page.evaluate("performance.now()")
            timing = page.evaluate("""() => {
                const nav = performance.getEntriesByType('navigation')[0];
                const mark = performance.getEntriesByName('headlab-rendered')[0];
                return {load: nav.loadEventEnd, render: mark ? mark.startTime : null};
            }""")
            loads.append(timing["load"])
            renders.append(timing["render"])
            firsts.append(first)
            cell = page.locator("svg.hm rect.cell").last
            if cell.count():
                kind, layer, head = (cell.get_attribute(a) for a in ("data-kind", "data-layer", "data-head"))
                start = time.perf_counter()
                cell.click()
                page.wait_for_function(
                    f"""() => {{ const v = document.getElementById('viewer').dataset;
                    return v.kind === '{kind}' && v.layer === '{layer}' && v.head === '{head}'; }}""")
                clicks.append((time.perf_counter() - start) * 1000)
            if page.locator("input[name=v-view][value=model]").count() and page.locator("#v-left span").count():
                for view in ("model", "heads", "lines"):  # in-page time: the views draw synchronously on change
                    views.setdefault(view, []).append(page.evaluate(
                        f"""() => {{ const t = performance.now();
                        document.querySelector('input[name=v-view][value={view}]').click();
                        return performance.now() - t; }}"""))
            if screenshot and _ == repeats - 1:  # the last page, the clicked head in the viewer
                page.evaluate("window.scrollTo(0, 0)")
                page.screenshot(path=screenshot, full_page=True)
                page.locator("#viewer").screenshot(path=screenshot.replace(".png", "-viewer.png"))
            page.close()
        context.close()
    median = lambda xs: round(statistics.median(xs), 1) if xs and None not in xs else None  # noqa: E731
    return {
        "directory": str(directory), "build_s": round(build_s, 3), "index_html_bytes": size,
        "attention_js_bytes": sidecars, "repeats": repeats, "load_ms": median(loads),
        "rendered_mark_ms": median(renders), "viewer_drawn_ms": median(firsts), "click_to_head_ms": median(clicks),
        "model_view_ms": median(views.get("model", [])), "head_view_ms": median(views.get("heads", [])),
        "inlined_sentences": inlined, "errors": errors,
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("directory", nargs="?", default=str(ROOT / "runs" / "demo"), help="analysis directory")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--stand-in", metavar="DIR", help="write a demo-sized stand-in analysis directory and use it")
    parser.add_argument("--screenshot", metavar="PNG", help="save a full-page screenshot (and PNG-viewer.png)")
    parser.add_argument("--sentences", type=int, default=20, help="stand-in: attention examples")
    parser.add_argument("--chromium", default=os.environ.get("HEADLAB_CHROMIUM") or shutil.which("chromium")
                        or "/usr/bin/chromium")
    parser.add_argument("--synthetic", metavar="LxH", action="append", default=[],
                        help="measure a synthetic LAYERSxHEADS directory (repeatable), e.g. 32x32")
    parser.add_argument("--tokens", type=int, default=20, help="synthetic: tokens per attention example")
    parser.add_argument("--work", default=None, help="synthetic: where to write the directories (default: a tmp dir)")
    args = parser.parse_args(argv)
    if not Path(args.chromium).is_file():
        print(f"no Chromium at {args.chromium} (apt-get install chromium)", file=sys.stderr)
        return 2
    if args.synthetic:
        return synthetic(args)
    directory = stand_in(Path(args.stand_in), args.sentences) if args.stand_in else Path(args.directory)
    if not directory.is_dir():
        print(f"{directory}: no analysis directory (run `make demo`, or use --stand-in DIR)", file=sys.stderr)
        return 2
    result = measure(directory, args.repeats, args.chromium, args.screenshot)
    print(json.dumps(result, indent=1))
    total = (result["index_html_bytes"] + result["attention_js_bytes"]) / 1e6
    print(f"\n| {directory.name} | {total:.2f} MB | {result['build_s']:.2f} s | {result['load_ms']} ms | "
          f"{result['viewer_drawn_ms']} ms | {result['click_to_head_ms']} ms |")
    return 1 if result["errors"] else 0


def synthetic(args) -> int:
    sys.path.insert(0, str(ROOT / "tests"))  # the synthetic directory's builder, shared with the browser test
    from support.report import build_large_dir

    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="report-scale-"))
    rows, failed = [], False
    for shape in args.synthetic:
        try:
            n_layers, n_heads = (int(x) for x in shape.lower().split("x"))
        except ValueError:
            print(f"--synthetic {shape}: expected LAYERSxHEADS, e.g. 32x32", file=sys.stderr)
            return 2
        directory = work / f"synthetic-{n_layers}x{n_heads}"
        if directory.exists():
            shutil.rmtree(directory)
        build_large_dir(directory, n_layers, n_heads, sentences=args.sentences, n_tokens=args.tokens)
        result = measure(directory, args.repeats, args.chromium,
                         args.screenshot.replace(".png", f"-{shape}.png") if args.screenshot else None)
        print(json.dumps(result, indent=1))
        failed |= bool(result["errors"])
        rows.append(f"| {n_layers} x {n_heads} | {result['index_html_bytes'] / 1e6:.2f} MB "
                    f"({result['inlined_sentences']} of {args.sentences} sentences inlined) | "
                    f"{result['attention_js_bytes'] / 1e6:.2f} MB | {result['build_s']:.2f} s | {result['load_ms']} ms | "
                    f"{result['rendered_mark_ms']} ms | {result['click_to_head_ms']} ms | {result['model_view_ms']} ms | "
                    f"{result['head_view_ms']} ms |")
    print("\n| model | index.html | attention/*.js (on demand) | build | load | rendered | click to head | "
          "model view | head view |\n|---|---|---|---|---|---|---|---|---|")
    print("\n".join(rows))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
