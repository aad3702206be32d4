import pytest
import torch

from kvlab.models import build_model

# `make test` runs two pytest-xdist workers (--dist loadgroup). A module fixture is built once per worker that runs
# one of its tests: the tests of each costly one share a group, so it is built once (a Colab-like virtual
# environment, a minute of decoding).
COSTLY_FIXTURES = {"cache_dominated", "twin_records", "probed", "records", "t5", "colab"}


def pytest_collection_modifyitems(items):
    for item in items:
        for name in sorted(COSTLY_FIXTURES & set(item.fixturenames)):
            item.add_marker(pytest.mark.xdist_group(f"{item.module.__name__}.{name}"))


@pytest.fixture(scope="session")
def toy():
    return build_model("toy")


@pytest.fixture(scope="session")
def toy_gqa():
    return build_model("toy", ["num_key_value_heads=2"])


@pytest.fixture
def prompt():
    return torch.randint(0, 1000, (3, 12), generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="session")
def toy_bf16():
    return build_model("toy", ["num_key_value_heads=2"], dtype="bfloat16")
