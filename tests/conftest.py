import gc
import os
import sys

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
os.environ["HF_HUB_OFFLINE"] = "1"  # tests never download from a model hub
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402
import torch  # noqa: E402

from tests.native import integer_kernel, native_kernel  # noqa: E402,F401 - the fixtures behind needs_native, needs_integer

# Tiny models gain nothing from intra-op threads, and on a shared 2-core machine threads that wait
# for each other make every small matmul orders of magnitude slower.
torch.set_num_threads(1)

EXIT_STATUS = pytest.StashKey[int]()


@pytest.fixture(autouse=True)
def collect_garbage_on_the_gui_thread(request):
    """Qt tests run worker threads; an automatic cyclic collection that starts on one of them can
    delete Qt objects off the GUI thread and crash (it did once, in CI). As in the app (pyqtgraph's
    GarbageCollector), such tests collect on the main thread only."""
    if not {"qtbot", "qapp"} & set(request.fixturenames):
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.collect()
        gc.enable()


def pytest_sessionfinish(session, exitstatus):
    session.config.stash[EXIT_STATUS] = int(exitstatus)


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    """Leave with pytest's own verdict once every plugin has finished, so that a crash while the
    interpreter finalises Qt, torch and tokenizers cannot turn a green run red. The one seen (CI,
    2026-11-30: "none_dealloc") was PySide6 6.12.0 losing references to None, which pyproject.toml now
    excludes (tests/test_app_qt_runtime.py); nothing a test checks happens after this point."""
    if EXIT_STATUS in config.stash:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(config.stash[EXIT_STATUS])
