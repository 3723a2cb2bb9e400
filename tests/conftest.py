"""The suite's layout: one folder per concern (engine/, models/, kernels/, server/, http/, images/,
grammars/, cluster/, benchmarks/), shared helpers beside this file. Markers (pyproject.toml): ``slow``
(left out of the fast subset, ``pytest -m "not slow"``), ``browser``, ``cluster`` and ``gpu``; a test
marked ``gpu`` is skipped on a machine without CUDA."""
import os

import pytest

# Models are local directories: never reach for a hub (this machine has none).
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def pytest_collection_modifyitems(config, items):
    gpu = [item for item in items if item.get_closest_marker("gpu")]
    if gpu:
        import torch

        if not torch.cuda.is_available():
            for item in gpu:
                item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))
