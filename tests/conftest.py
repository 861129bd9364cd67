from pathlib import Path

import pytest
from hypothesis import settings

# Deterministic property tests: the same examples (and so the same seeds) on every run.
settings.register_profile("specstack", derandomize=True, deadline=None, print_blob=True)
settings.load_profile("specstack")


def pytest_addoption(parser):
    parser.addoption("--device", default="cpu", help="device of the synthetic models in the greedy and distribution tests (make gpu-check: cuda)")


GPU_DURATIONS = Path(__file__).with_name("gpu-durations.txt")


def pytest_collection_modifyitems(config, items):
    """With ``--device cuda`` (make gpu-check) the tests start slowest first, by the seconds each took on a
    GPU (``tests/gpu-durations.txt``: the ``--durations`` lines of a check's logs), so that the cap cuts off
    quick tests rather than half-run slow ones."""
    import torch

    if torch.device(config.getoption("--device")).type != "cuda" or not GPU_DURATIONS.exists():
        return
    from specstack.gpu_check import recorded_seconds, slowest_first

    items[:] = slowest_first(items, recorded_seconds(GPU_DURATIONS.read_text().splitlines()), name=lambda item: item.nodeid)


@pytest.fixture(scope="session")
def device(request) -> str:
    """Where the synthetic models of the greedy and sampled-distribution tests keep their KV cache and
    probabilities (``pytest --device cuda`` runs those tests on a GPU)."""
    import torch

    name = request.config.getoption("--device")
    if torch.device(name).type == "cuda" and not torch.cuda.is_available():
        pytest.skip("--device cuda needs a CUDA GPU")
    return name


@pytest.fixture(scope="session", autouse=True)
def _a_share_of_the_cores():
    """Under pytest-xdist (``make test`` runs TEST_WORKERS processes), each worker's torch takes its
    share of the cores: two workers with every core each would oversubscribe them."""
    import os

    import torch

    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // workers))
    yield


@pytest.fixture
def registry():
    from specstack import Registry

    return Registry.create(entry_points=False)


@pytest.fixture(autouse=True)
def _one_thread_for_tiny_tensors(request):
    """Synthetic models work on tensors of a few elements, where a second intra-op thread only adds
    synchronisation (and on a busy 2-core machine costs 20x); real-model tests keep the worker's share
    of the cores. Either way the test leaves the worker as it found it: a command run in-process with
    ``--threads N`` (demo, training) sets torch's threads for the whole process, and a worker left at
    every core beside another worker oversubscribes the CPU for every test after it."""
    import torch

    threads = torch.get_num_threads()
    if not request.node.get_closest_marker("real_model"):
        torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def threads() -> str:
    """This worker's share of the cores, as a command-line value: what a test passes to ``--threads``
    (or ``--set threads=``) so that the command it runs does not take the other workers' cores."""
    import torch

    return str(torch.get_num_threads())
