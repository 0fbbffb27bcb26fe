"""Shared test fixtures: GPU marker handling and global-state hygiene."""

from __future__ import annotations

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _restore_torch_state():
    """Tests may change global torch state (default dtype, seeds, threads); put it back."""
    dtype = torch.get_default_dtype()
    threads = torch.get_num_threads()
    rng = torch.get_rng_state()
    yield
    torch.set_default_dtype(dtype)
    torch.set_num_threads(threads)
    torch.set_rng_state(rng)
