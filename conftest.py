"""The fast lane: ``pytest -m "not slow"`` runs every capability's quick tests in under three
minutes on the 2-core CI machine; ``pytest`` runs everything (CI's command).

A test is slow where its file marks it (``@pytest.mark.slow``) or where it is listed in
``SLOW`` below: the end-to-end tests that train, launch ranks or export for more than a few
seconds, chosen from ``pytest --durations=0`` on the 2-core machine (the figure beside each
file is what its listed tests took there). Listing them here, rather than in each test file,
keeps the test files themselves as they were. Every capability keeps at least one fast test:
a lane that would leave a test file with none is refused at collection.
"""

import pytest

SLOW: dict[str, tuple[str, ...]] = {}
# A capability whose file marks every test slow keeps one in the lane, by its full id.
FAST: dict[str, tuple[str, ...]] = {
    "test_hangs.py": ("test_a_rank_that_exits_or_hangs_is_named_within_the_timeout[exit-rank 1 has exited]",),
}


@pytest.hookimpl(tryfirst=True)  # before -m deselects
def pytest_collection_modifyitems(config, items):
    for item in items:
        path, _, name = item.nodeid.partition("::")
        file = path.rsplit("/", 1)[-1]
        if name.split("[")[0] in SLOW.get(file, ()):
            item.add_marker(pytest.mark.slow)
        if name in FAST.get(file, ()):
            item.own_markers[:] = [m for m in item.own_markers if m.name != "slow"]
    if "not slow" not in (config.getoption("markexpr") or ""):
        return
    files: dict[str, bool] = {}
    for item in items:
        path = item.nodeid.partition("::")[0]
        files[path] = files.get(path, False) or item.get_closest_marker("slow") is None
    bare = sorted(path for path, fast in files.items() if not fast)
    if bare and len(files) >= 10:  # (the whole suite, not a file or two picked by hand)
        raise pytest.UsageError(f"the fast lane would leave no test of {', '.join(bare)}; keep one fast")
