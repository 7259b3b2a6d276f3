"""Shared pytest set-up: the `cuda` marker skips without a GPU, every test starts from the same seed, and
`fresh_dynamo` (used by the torch.compile tests) resets Dynamo around a test."""
import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def fixed_seed():
    torch.manual_seed(0)


@pytest.fixture
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
