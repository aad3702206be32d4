import pytest
import torch

from kvlab.models import build_model


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
