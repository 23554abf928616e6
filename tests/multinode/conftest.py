"""Fixtures for multi-node tests on simulated nodes (see testbed.py).

Every test under tests/multinode/ is marked `multinode`. Select them with `pytest -m multinode`,
leave them out with `-m "not multinode"`.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from . import testbed as _tb

HERE = Path(__file__).parent
# the session's test bed while it is up, so `no_testbed` can take it down and bring it back
_ACTIVE: dict[str, _tb.Testbed] = {}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if HERE in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.multinode)


@pytest.fixture(scope="session")
def testbed() -> Iterator[_tb.Testbed]:
    """Simulated nodes (2, or $NBTRAIN_TESTBED_NODES) for the whole session, removed at its end.

    Skips, saying why, where network namespaces cannot be made (not root, no `ip`, unshare fails).
    A left-over test bed from a crashed run is removed first. Parallel sessions take turns.
    """
    reason = _tb.unavailable_reason()
    if reason:
        pytest.skip(reason)
    n = int(os.environ.get("NBTRAIN_TESTBED_NODES", "2"))
    with _tb.session_lock():
        bed = _tb.up(n)
        _ACTIVE["bed"] = bed
        try:
            yield bed
        finally:
            _ACTIVE.pop("bed", None)
            _tb.down()


@pytest.fixture(scope="module")
def testbed4(testbed: _tb.Testbed) -> Iterator[_tb.Testbed]:
    """At least 4 simulated nodes for one module: the session's test bed, brought up again with 4
    nodes where it has fewer (nodes 1-2 keep their names and addresses), and back after the module."""
    if len(testbed.nodes) >= 4:
        yield testbed
        return
    _tb.down()
    try:
        yield _tb.up(4)
    finally:
        _tb.down()
        _tb.up(len(testbed.nodes))
        testbed._pids.clear()  # new sshd processes


@pytest.fixture
def no_testbed() -> Iterator[None]:
    """Nothing of a test bed on the machine, for tests of `up`/`down` themselves.

    The session's test bed, if one is up, is taken down for the test and brought back after it.
    """
    reason = _tb.unavailable_reason()
    if reason:
        pytest.skip(reason)
    bed = _ACTIVE.get("bed")
    if bed is None:
        with _tb.session_lock():
            _tb.down()
            try:
                yield
            finally:
                _tb.down()
        return
    _tb.down()
    try:
        yield
    finally:
        _tb.down()
        _tb.up(len(bed.nodes))
        bed._pids.clear()  # new sshd processes
