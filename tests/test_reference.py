"""The legacy emulation against the real transformers 4.40.1 generate(), on the same configs."""

import subprocess

import pytest

from kvlab.experiment import run_point
from kvlab.models import build_model
from kvlab.reference import install_legacy_transformers, measure_legacy_generate


@pytest.fixture(scope="module")
def legacy_transformers():
    try:
        return install_legacy_transformers()
    except (subprocess.CalledProcessError, OSError) as error:  # e.g. no package index reachable
        pytest.skip(f"transformers 4.40.1 cannot be installed here: {error}")


@pytest.mark.parametrize("overrides", ["", "num_key_value_heads=2"], ids=["mha", "gqa"])
def test_legacy_emulation_matches_transformers_4_40_1(legacy_transformers, overrides):
    point = dict(batch=8, prompt=64, new=256)
    real = measure_legacy_generate("toy", overrides or None, **point)
    assert real["transformers_version"] == "4.40.1"
    emulated = run_point(build_model("toy", overrides), overrides=overrides, cache="legacy", pattern="legacy",
                         **point)
    assert emulated["overhead_bytes"] == pytest.approx(real["overhead_bytes"], rel=0.05)
    # ... and the fix really is a fix: the in-place cache needs about half.
    fixed = run_point(build_model("toy", overrides), overrides=overrides, cache="inplace", pattern="fixed", **point)
    assert real["overhead_bytes"] / fixed["overhead_bytes"] > 1.7
