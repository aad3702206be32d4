import pytest
import torch

from kvlab.planner.sources import build_model  # presets, and the config.json folders of the sliding fixtures

# `make test` runs two pytest-xdist workers (--dist loadgroup). The tests of each costly fixture (a Colab-like virtual
# environment, a minute of decoding) share a group, so one worker builds it, once: session-scoped, so tests of another
# module run in between do not tear it down. (pytest 9.2 silently breaks the groups: requirements.lock pins 9.1.1.)
COSTLY_FIXTURES = {"cache_dominated", "twin_records", "probed", "records", "t5", "colab", "releases_text"}


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the groups
def pytest_collection_modifyitems(items):
    for item in items:
        for name in sorted(COSTLY_FIXTURES & set(item.fixturenames)):
            item.add_marker(pytest.mark.xdist_group(f"{item.module.__name__}.{name}"))
    # The notebooks (10-70 s each) first: the longest work handed out first, the two workers finish together.
    items.sort(key=lambda item: item.originalname != "test_notebook_executes_with_tiny_parameters")


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


# A toy with a sliding window of 16 on every layer (Mistral's layout), from a config.json as a user would pass one:
# prompts longer than the window and generations that slide it many times take seconds.
SLIDING_TOY = dict(
    model_type="mistral",
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=1000,
    max_position_embeddings=8192,
    sliding_window=16,
    initializer_range=0.1,
)  # 0.1: varied tokens, as kvlab's presets


@pytest.fixture(scope="session")
def sliding_config(tmp_path_factory):
    import json

    path = tmp_path_factory.mktemp("sliding") / "config.json"
    path.write_text(json.dumps(SLIDING_TOY))
    return str(path)


@pytest.fixture(scope="session")
def sliding_toy(sliding_config):
    return build_model(sliding_config)


@pytest.fixture(scope="session")
def sliding_toy_bf16(sliding_config):
    return build_model(sliding_config, dtype="bfloat16")


@pytest.fixture(scope="module")
def one_thread():
    """One torch thread for a module: memory barely depends on it (CPU flash attention's scratch, one block per
    thread, which the meter and the theory both count for the threads set), and OpenMP threads spin-wait: on a shared
    2-core machine two threads spinning against other processes make a decode ~20x slower (bf16 crawls)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
