"""The surface a user meets: the README's Python example runs as written, the lesson needs none of the extras, and
the installed `kvlab` command runs a command once."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from kvlab import theory
from kvlab.configs import build_config

ROOT = Path(__file__).resolve().parents[1]
# What only the extras bring (pyproject.toml: lab, notebooks, jupyter, ray); torch and transformers bring the rest.
EXTRAS_ONLY = (
    "papermill",
    "nbformat",
    "ipykernel",
    "pandas",
    "psutil",
    "matplotlib",
    "seaborn",
    "ipywidgets",
    "jupyterlab",
    "ray",
)
# Run before the example: each of those modules then fails to import, and looks absent to transformers' checks
# (importlib.util.find_spec gives None), as where the extras are not installed.
WITHOUT_EXTRAS = f"import sys\nsys.modules.update(dict.fromkeys({EXTRAS_ONLY!r}))\n"


def readme_example() -> str:
    """The Python block of the README's "Using kvlab" section, as a reader copies it."""
    section = (ROOT / "README.md").read_text().split("## Using kvlab", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def run_python(code: str, tmp_path: Path) -> str:
    """`code` in a fresh interpreter, from a folder outside the checkout, on the CPU; its output."""
    script = tmp_path / "example.py"
    script.write_text(code)
    result = subprocess.run(
        [sys.executable, str(script)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env={"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(ROOT)},
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def test_readme_example_runs_as_written_without_the_extras(tmp_path):
    """The five public names, used as the README shows; its measured overheads are the theory's (the README's
    0.08 % for stored points), and transformers' own generate() decodes the same tokens into kvlab's cache."""
    output = run_python(WITHOUT_EXTRAS + readme_example(), tmp_path)
    assert re.search(r"^prealloc/v5 +[0-9.]+ .* yes ", output, re.M), output  # predict's table, with "fits"
    config = build_config("llama2-7b-twin")
    printed = re.findall(
        r"^(\w+)/(v[0-9.]+): ([0-9.]+) MiB at the peak .*, ([0-9.]+) of it inside kernels", output, re.M
    )
    assert [(cache, loop) for cache, loop, *_ in printed] == [("tuple", "v4.40"), ("dynamic", "v5")], output
    for cache, loop, mib, kernels in printed:
        predicted = theory.predict_overhead(
            config, batch=1, prompt=300, new=40, dtype="bfloat16", cache=cache, loop=loop
        )
        # The theory counts tensors; a kernel's own scratch (a bf16 matmul's) depends on the CPU's kernel library.
        assert (float(mib) - float(kernels)) * 2**20 == pytest.approx(predicted, rel=1e-3), (cache, loop)
    assert "same tokens as transformers' generate(): True" in output


@pytest.mark.parametrize(
    "command",
    [[str(Path(sys.executable).parent / "kvlab")], [sys.executable, "-m", "kvlab"]],
    ids=["console-script", "python-m"],
)
def test_the_installed_command_runs_a_command_once(command, tmp_path):
    result = subprocess.run(
        [*command, "predict", "--preset", "toy", "--batch", "1", "--prompt", "8", "--new", "2"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.count("toy: llama, 4 layers") == 1, result.stdout


def test_the_command_line_needs_no_extra_to_predict_and_names_the_extra_a_sweep_needs(tmp_path):
    predict = run_python(
        WITHOUT_EXTRAS + "from kvlab.cli import main\n"
        "main(['predict', '--preset', 'toy', '--batch', '1', '--prompt', '8', '--new', '2'])\n",
        tmp_path,
    )
    assert predict.count("toy: llama, 4 layers") == 1
    sweep = subprocess.run(
        [
            sys.executable,
            "-c",
            WITHOUT_EXTRAS + "from kvlab.cli import main\n"
            "main(['sweep', 'cpu-batch', '--grid', 'preset=toy', '--out', 'out'])\n",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), "CUDA_VISIBLE_DEVICES": ""},
    )
    assert sweep.returncode == 1 and "pip install 'kvlab[lab]'" in sweep.stderr, sweep.stderr[-2000:]


README_MAX_BYTES = 12 * 1024  # a newcomer reads it in two minutes; depth lives in docs/
HEADLINE_LINES = 40  # the headline figure shows before the reader scrolls far
IMAGE_MAX_BYTES = 150 * 1024
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def _slug(heading: str) -> str:
    """GitHub's anchor for a Markdown heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link keeps its text
    text = re.sub(r"[^\w\- ]", "", text.lower())
    return text.replace(" ", "-")


def test_readme_is_short_and_shows_its_headline_figure_first():
    readme = ROOT / "README.md"
    size = len(readme.read_bytes())
    assert size <= README_MAX_BYTES, f"README.md is {size:,} bytes; at most {README_MAX_BYTES:,} (move depth to docs/)"
    head = readme.read_text().splitlines()[:HEADLINE_LINES]
    images = [m.group(1) for line in head for m in LINK.finditer(line) if m.group(0).startswith("!")]
    assert images, f"no image link in README.md's first {HEADLINE_LINES} lines"
    for image in images:
        path = ROOT / image
        assert path.is_file(), f"README's image {image} is not committed"
        assert path.stat().st_size < IMAGE_MAX_BYTES, f"{image}: {path.stat().st_size:,} bytes"


@pytest.mark.parametrize("page", ["README.md", *sorted(p.relative_to(ROOT).as_posix() for p in ROOT.glob("docs/*.md"))])
def test_every_relative_link_of_the_readme_and_docs_points_at_something_that_exists(page):
    """What left the README for docs/ stays reachable: every relative link (and its #anchor) resolves."""
    source = ROOT / page
    text = re.sub(r"```.*?```", "", source.read_text(), flags=re.S)  # code blocks hold no links
    broken = []
    for target in LINK.findall(text):
        if re.match(r"[a-z]+:", target):  # https:, mailto: ...: sources, not checked offline
            continue
        path, _, anchor = target.partition("#")
        resolved = (source.parent / path).resolve() if path else source
        if not resolved.exists():
            broken.append(target)
        elif anchor and resolved.suffix == ".md":
            headings = re.findall(r"^#+ (.+)$", resolved.read_text(), re.M)
            if anchor not in {_slug(h) for h in headings}:
                broken.append(target)
    assert not broken, f"{page}: broken links {broken}"


def test_the_headline_figure_is_drawn_from_committed_data(tmp_path):
    """scripts/headline_figure.py reads data/cpu and data/design: <= 4.41 at two caches, every later design at one."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("headline_figure", ROOT / "scripts" / "headline_figure.py")
    figure = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(figure)
    values = {(v["cache"], v["loop"]): v for v in figure.headline_values()}
    assert values["tuple", "v4.40"]["ratio"] == pytest.approx(2.0, abs=0.01)
    assert values["tuple", "v4.40"]["h200_ratio"] == pytest.approx(2.0, abs=0.01)
    for design in [("dynamic", "v4.42"), ("dynamic", "v5"), ("prealloc", "v5")]:
        assert 1.0 < values[design]["ratio"] < 1.02, design
    assert values["dynamic", "v5"]["h200_ratio"] == pytest.approx(values["dynamic", "v5"]["ratio"], abs=0.001)
    pytest.importorskip("matplotlib")
    drawn = figure.draw(tmp_path / "headline.png")
    assert 0 < drawn.stat().st_size < IMAGE_MAX_BYTES
