"""How long `python -m workbench compare` takes on a 200-run sweep, how big its page is, and how
soon the page is usable in Chromium.

Four real fits on synthetic blobs (AFL; FedAvg over 30 rounds, a learning curve of 30 points;
Ditto personalized over 10 rounds; GH-OFL with three heads) are each copied into 50 run folders
whose configs differ in α, seed and learning rate, as a sweep's would: the runs' files have the
sizes of real ones (their numbers repeat, which costs `compare` nothing). The end-to-end time is
the command as a user runs it (a fresh process, imports included), the median over repeats.

    python benchmarks/compare.py [--runs 200] [--repeats 5] [--out benchmarks/results/compare.md]
"""
from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import load_average, machine_line, write_report

ROOT = Path(__file__).resolve().parents[1]
FITS = {
    "afl": [],
    "fedavg": ["--model=FedAvg", "--model.num_rounds=30"],
    "ditto": ["--model=Ditto", "--model.num_rounds=10", "--data.personalized=true"],
    "ghofl": ["--model=GHOFL", "--model.heads=[nb_diag,lda,qda]"],
}
ALPHAS = (0.05, 0.1, 0.5, 1.0, 10.0)
LRS = (0.01, 0.03, 0.1, 0.3, 1.0)
PAGE_CHECK = """
const { chromium } = require("playwright-core");
(async () => {
  const browser = await chromium.launch({ executablePath: "/usr/bin/chromium", headless: true,
                                          args: ["--no-sandbox"] });
  const page = await browser.newPage({ viewport: { width: 1400, height: 900 } });
  const start = Date.now();
  await page.goto("file://" + process.argv[1]);
  await page.waitForSelector('body[data-ready="1"]', { timeout: 60000 });
  const ready = Date.now() - start;
  const t = Date.now();
  await page.click('fieldset[data-filter="method"] input');  // a filter: table and figures drawn again
  await page.waitForTimeout(0);
  const filtered = Date.now() - t;
  console.log(JSON.stringify({ ready, filtered }));
  await browser.close();
})();
"""


def fit_originals(folder: Path) -> dict[str, Path]:
    """One real run folder per FITS entry, written by the command line."""
    from workbench.__main__ import main

    base = ["--config", str(ROOT / "configs/synthetic_afl.yaml"), "--trainer.enable_progress_bar=false",
            "--wandb=disabled", f"--run_dir={folder}"]
    for name, flags in FITS.items():
        assert main(["fit", *base, *flags, f"--run_name={name}"]) == 0, name
    return {name: folder / name / "version_0" for name in FITS}


def write_sweep(originals: dict[str, Path], runs: int, folder: Path) -> None:
    """`runs` run folders, copies of the originals with the settings a sweep would vary."""
    kinds = list(originals)
    for i in range(runs):
        kind = kinds[i % len(kinds)]
        alpha, lr, seed = ALPHAS[i // len(kinds) % len(ALPHAS)], LRS[i // 20 % len(LRS)], i // 100
        target = folder / f"{kind},alpha={alpha},lr={lr},seed={seed}" / "version_0"
        shutil.copytree(originals[kind], target, ignore=shutil.ignore_patterns("*.ckpt"))
        config = target / "config.yaml"
        text = config.read_text().replace("alpha: 0.5", f"alpha: {alpha}")
        text = text.replace("    seed: 0", f"    seed: {seed}", 1).replace("      lr: 0.05", f"      lr: {lr}")
        config.write_text(text)


def page_times(page: Path) -> dict[str, float] | None:
    """Milliseconds until the page is drawn and to redraw after a filter, in headless Chromium (None
    without chromium and playwright-core)."""
    if not Path("/usr/bin/chromium").exists() or shutil.which("node") is None:
        return None
    result = subprocess.run(["node", "-e", PAGE_CHECK, str(page)], capture_output=True, text=True, timeout=300)
    if result.returncode != 0:
        return None
    import json

    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=str(ROOT / "benchmarks/results/compare.md"))
    args = parser.parse_args()
    load_at_start = load_average()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        write_sweep(fit_originals(tmp / "fits"), args.runs, tmp / "sweep")
        seconds = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            subprocess.run([sys.executable, "-m", "workbench", "compare", str(tmp / "sweep"), "--out",
                            str(tmp / "report")], check=True, capture_output=True)
            seconds.append(time.perf_counter() - start)
        from workbench.report import find_runs
        from workbench.report.dashboard import build
        from workbench.report.page import plotly_js, render

        start = time.perf_counter()
        found = find_runs([tmp / "sweep"])
        read_s = time.perf_counter() - start
        data = build(found)
        build_s = time.perf_counter() - start - read_s
        render(data)
        render_s = time.perf_counter() - start - read_s - build_s
        page = tmp / "report" / "index.html"
        size = page.stat().st_size
        bundle = len(plotly_js()[0].encode())
        browser = page_times(page)
    lines = [
        f"# `compare` of a {args.runs}-run sweep",
        "",
        f"`python benchmarks/compare.py --runs {args.runs} --repeats {args.repeats}`: {args.runs} run folders "
        f"(copies of 4 real fits: AFL, FedAvg over 30 rounds, Ditto personalized over 10, GH-OFL with three heads; "
        "α, seed and learning rate varied in their configs).",
        "",
        "| what | value |",
        "|---|---|",
        f"| `python -m workbench compare` end to end (fresh process), median of {args.repeats} | "
        f"{statistics.median(seconds):.2f} s (min {min(seconds):.2f}, max {max(seconds):.2f}) |",
        f"| in process: reading the run folders | {read_s:.2f} s |",
        f"| in process: the dashboard's data (groups, fronts, table) | {build_s:.2f} s |",
        f"| in process: writing the page | {render_s:.2f} s |",
        f"| the page | {size / 1e6:.2f} MB, of which plotly.js {bundle / 1e6:.2f} MB |",
    ]
    if browser is not None:
        lines += [f"| headless Chromium at 1400 px: until drawn (table and seven figures) | {browser['ready']} ms |",
                  f"| headless Chromium: redrawn after a filter click | {browser['filtered']} ms |"]
    else:
        lines.append("| headless Chromium | not measured (needs /usr/bin/chromium and node's playwright-core) |")
    lines += ["", machine_line("compare runs on one core", load_at_start)]
    write_report(lines, args.out)


if __name__ == "__main__":
    main()
