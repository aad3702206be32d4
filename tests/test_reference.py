"""kvlab's loops against the real releases' own generate(): 4.40.1, 4.42.4 and the installed 5.x.

Each release runs in its own subprocess (kvlab.lab.reference); kvlab's loop runs here. The same seed
builds the same weights and prompt on both sides, so memory and tokens can be compared point by point.
"""

import functools
import json

import pytest
import torch
import transformers

from kvlab import releases, theory
from kvlab.configs import build_config
from kvlab.decoding import decoding
from kvlab.lab import reference
from kvlab.lab.point import run_point
from kvlab.lab.reference import weights_digest
from kvlab.loops import generate
from kvlab.models import assert_varied, build_model
from kvlab.planner.params import normalize
from kvlab.releases import INSTALLED, ReferenceInstallError, install_reference, measure_references
from kvlab.schema import REFERENCES

# Small enough for a 2-core CPU (one subprocess per release runs all of its points), long enough that
# the peak falls in decoding, where the loops differ, rather than in the prompt's forward.
SIZE = dict(batch=2, prompt=16, new=32)
BEAMS = 3
CONFIGS = {"mha": "", "gqa": "num_key_value_heads=2"}
DTYPES = ("float32", "bfloat16")
STRATEGIES = ("greedy", "beam")
# Each release's generate() and the kvlab (cache, loop) that claims to reproduce it.
PAIRS = {
    "4.40.1": (None, dict(cache="tuple", loop="v4.40")),
    "4.42.4": (None, dict(cache="dynamic", loop="v4.42")),
    "5.x-dynamic": (None, dict(cache="dynamic", loop="v5")),
    "5.x-static": ("static", dict(cache="static", loop="v5")),
}
POINTS = [
    dict(dtype=dtype, config=config, strategy=strategy)
    for dtype in DTYPES
    for config in CONFIGS
    for strategy in STRATEGIES
]
# `make test` checks these two per release (MHA fp32 greedy, GQA bf16 beam: every loop difference acts in one
# of them); `make test-all` the other six too. Each group is one subprocess per release.
QUICK = [POINTS[0], POINTS[-1]]
# transformers' own StaticCache: the 5.x-dynamic pair covers the installed release in make test.
SLOW_PAIRS = ("5.x-static",)


# Each release's tests on one pytest-xdist worker (--dist loadgroup), where its subprocess (real_records) runs once.
PAIR_PARAMS = [
    pytest.param(p, marks=[pytest.mark.xdist_group(f"release-{p}")] + [pytest.mark.slow] * (p in SLOW_PAIRS))
    for p in PAIRS
]


def release_of(pair: str) -> str:
    return INSTALLED if pair.startswith("5.x") else pair


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@functools.lru_cache(maxsize=None)
def install_error(version: str) -> str | None:
    """Install once per session; the reason pip could not (e.g. no package index reachable), if any."""
    try:
        install_reference(version)
    except ReferenceInstallError as error:
        return str(error)
    return None


@functools.lru_cache(maxsize=None)
def kvlab_digest(config: str, dtype: str) -> str:
    return weights_digest(build_model("toy", CONFIGS[config], "cpu", dtype))


def real_records(pair: str, quick: bool = True) -> dict:
    """The QUICK points of one release (or the others), measured in one subprocess:
    {(dtype, config, strategy): record}."""
    return _real_records(pair, quick)  # one cache key however it is called: lru_cache tells (pair) from (pair, True)


@functools.lru_cache(maxsize=None)
def _real_records(pair: str, quick: bool) -> dict:
    cache_implementation, _ = PAIRS[pair]
    if install_error(release_of(pair)):
        pytest.skip(install_error(release_of(pair)))
    points = [p for p in POINTS if (p in QUICK) == quick]
    records = measure_references(
        release_of(pair),
        [
            dict(
                SIZE,
                dtype=p["dtype"],
                overrides=CONFIGS[p["config"]],
                strategy=p["strategy"],
                num_beams=BEAMS,
                cache_implementation=cache_implementation,
            )
            for p in points
        ],
    )
    return {(p["dtype"], p["config"], p["strategy"]): record for p, record in zip(points, records)}


def test_the_committed_excerpts_are_the_releases_own_lines():
    """Lessons 02 and A4 diff data/reference/pr30536_excerpts.json: it must be what the releases' files hold."""
    for version in releases.RELEASES:
        if install_error(version):
            pytest.skip(install_error(version))
    committed = json.loads((releases.ROOT / "data" / "reference" / "pr30536_excerpts.json").read_text())
    assert committed == releases.cut_excerpts(), "the releases' lines moved: python scripts/pr_excerpts.py"


@pytest.mark.parametrize("version", list(releases.RELEASES))
def test_release_folder_installs_once(version, monkeypatch):
    if install_error(version):
        pytest.skip(install_error(version))
    target, pins = releases.RELEASES[version]
    assert (target / f"transformers-{version}.dist-info").is_dir()
    monkeypatch.setattr(releases.subprocess, "run", None)  # the second call must not run pip
    assert install_reference(version) == target
    if version == "4.42.4":
        assert "numpy==1.26.4" in pins and (target / "numpy-1.26.4.dist-info").is_dir()  # it refuses numpy 2


def test_unreachable_index_is_a_clear_error_after_saying_what_it_installs(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(releases.RELEASES, "4.40.1", (tmp_path / "tf", ("transformers==4.40.1",)))
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_CONFIG_FILE", "/dev/null")  # no find-links from a config file either
    with pytest.raises(ReferenceInstallError, match="pip could not install transformers==4.40.1") as error:
        install_reference("4.40.1")
    assert len(str(error.value).splitlines()) == 1
    assert capsys.readouterr().err.startswith(f"installing transformers==4.40.1 into {tmp_path / 'tf'}")


def test_bad_input_fails_before_any_subprocess():
    with pytest.raises(ValueError, match="choose one of: 4.40.1, 4.42.4, installed"):
        install_reference("4.41.0")
    with pytest.raises(ValueError, match="choose one of: greedy, beam"):
        measure_references(INSTALLED, [dict(strategy="sample")])
    with pytest.raises(ValueError, match="only has its default cache"):
        measure_references("4.42.4", [dict(cache_implementation="static")])
    with pytest.raises(ValueError, match="unknown preset"):
        measure_references(INSTALLED, [dict(preset="nope")])


def test_a_reference_point_takes_a_config_json_as_kvlab_does(tmp_path):
    """--kind reference takes what --preset takes: the installed release's own generate() of a config.json, beside
    kvlab's dynamic/v5 of the same file."""
    build_config("toy").to_json_file(tmp_path / "config.json")
    point = dict(preset=str(tmp_path), batch=1, prompt=16, new=4, timing=False)
    ours = run_point(**point)
    real = run_point(kind="reference", cache="dynamic", loop="v5", **point)
    assert real["transformers_version"] == transformers.__version__
    assert real["overhead_bytes"] == pytest.approx(ours["overhead_bytes"], rel=0.01)


@pytest.mark.parametrize("pair", PAIR_PARAMS)
def test_each_release_runs_and_reports_its_version(pair):
    records = real_records(pair)
    expected = transformers.__version__ if release_of(pair) == INSTALLED else pair
    assert {record["transformers_version"] for record in records.values()} == {expected}
    for record in records.values():
        assert record["meter"] == "cpu-allocator" and record["overhead_bytes"] > 0
        assert len(record["tokens"]) == SIZE["batch"] and {len(row) for row in record["tokens"]} == {SIZE["new"]}


@pytest.mark.parametrize("pair", PAIR_PARAMS)
def test_every_release_builds_kvlabs_weights(pair):
    """Same seed, same init order: each release's from_config gives build_model's weights, bit for bit."""
    for (dtype, config, _), record in real_records(pair).items():
        assert record["weights_sha256"] == kvlab_digest(config, dtype), (dtype, config)


@pytest.mark.parametrize(
    "point",
    [p if p in QUICK else pytest.param(p, marks=pytest.mark.slow) for p in POINTS],
    ids=lambda p: f"{p['dtype']}-{p['config']}-{p['strategy']}",
)
@pytest.mark.parametrize("pair", PAIR_PARAMS)
def test_kvlab_loop_matches_the_release(pair, point):
    """The issue's bar: kvlab's loop peaks within 1 % of the release's own generate(), and decodes its tokens."""
    real = real_records(pair, point in QUICK)[(point["dtype"], point["config"], point["strategy"])]
    _, design = PAIRS[pair]
    overrides = CONFIGS[point["config"]]
    model = build_model("toy", overrides, "cpu", point["dtype"])
    ours = run_point(
        model,
        preset="toy",
        overrides=overrides,
        dtype=point["dtype"],
        strategy=point["strategy"],
        num_beams=BEAMS,
        device="cpu",
        **design,
        **SIZE,
    )
    assert ours["overhead_bytes"] == pytest.approx(real["overhead_bytes"], rel=0.01)

    assert weights_digest(model) == real["weights_sha256"]  # else equal tokens could not be asked for
    if point["dtype"] == "bfloat16" and point["strategy"] == "beam":
        # bf16 beam scores tie exactly (same bf16 logit, same parent beam) at the last kept rank every few
        # steps, and each release breaks such ties in its own topk order: 4.42.4, 5.x dynamic and 5.x static
        # already disagree among themselves here, so no loop can be held to one release's tokens.
        return
    prompt = torch.randint(
        0, model.config.vocab_size, (SIZE["batch"], SIZE["prompt"]), generator=torch.Generator().manual_seed(0)
    )
    out = generate(model, prompt, SIZE["new"], strategy=decoding(point["strategy"], BEAMS), **design)
    rows = out.tokens[::BEAMS] if point["strategy"] == "beam" else out.tokens  # the best beam comes first
    assert_varied(real["tokens"])
    assert rows[:, SIZE["prompt"] :].tolist() == real["tokens"]


@functools.lru_cache(maxsize=None)
def showcase(name: str, kind: str) -> dict:
    """One point of SHOWCASE, run by kvlab's loop (kind kvlab) or by its release's own generate() (reference)."""
    point = reference.SHOWCASE[name]
    version, _ = REFERENCES[(point["cache"], point["loop"])]
    if install_error(version):
        pytest.skip(install_error(version))
    return run_point(kind=kind, **reference.SHOWCASE_COMMON, **point)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(reference.SHOWCASE))
def test_kvlab_matches_the_release_where_the_releases_differ_most(name):
    ours, real = showcase(name, "kvlab"), showcase(name, "reference")
    assert real["transformers_version"] == REFERENCES[(ours["cache"], ours["loop"])][0]
    assert ours["overhead_bytes"] == pytest.approx(real["overhead_bytes"], rel=0.01)
    if name == "logits":  # 4.42's forward upcasts every prompt position's logits to fp32: they set the peak
        assert ours["logits_at_peak_bytes"] > 0.8 * ours["overhead_bytes"]
    if name == "restart":  # the caller's tuples keep the first call's cache alive next to the growing one
        assert 1.8 < real["overhead_over_kv"] < 2


@pytest.mark.slow
def test_mistral_minimal_improvement_measured_on_both_releases_beside_theory():
    point = reference.SHOWCASE["minimal-after"]
    expected = theory.improvement_factors(
        build_config(point["preset"]),
        batch=reference.SHOWCASE_COMMON["batch"],
        prompt=point["prompt"],
        dtype=reference.SHOWCASE_COMMON["dtype"],
    )[0]
    for kind in ("kvlab", "reference"):
        factor = showcase("minimal-before", kind)["overhead_bytes"] / showcase("minimal-after", kind)["overhead_bytes"]
        assert factor == pytest.approx(expected, rel=0.01), kind


def test_a_reference_restart_passes_back_what_the_release_returned():
    for params, message in (
        (dict(cache="dynamic", loop="v4.42"), "restart_from=tuples"),
        (dict(cache="dynamic", loop="v5", restart_from="tuples"), "tuple/v4.40, or dynamic/v4.42"),
        (dict(cache="tuple", loop="v4.40", strategy="beam"), "greedy"),
        (dict(cache="tuple", loop="v4.40", restart_from="tuples", kind="kvlab"), "choose cache dynamic"),
    ):
        with pytest.raises(ValueError, match=message):
            normalize(**dict(dict(kind="reference", restart_new=4), **params))
    with pytest.raises(ValueError, match="choose one of: 4.40.1, 4.42.4"):
        measure_references(INSTALLED, [dict(restart_new=4)])
