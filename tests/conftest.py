"""Shared real clusters: starting ipyparallel engines costs seconds, so tests reuse them.

Tests that break engines on purpose (kill, stuck collectives) start their own cluster instead.
"""
from __future__ import annotations

import pytest
from IPython.core.displaypub import CapturingDisplayPublisher
from IPython.core.interactiveshell import InteractiveShell

from colab_par import Cluster


def _started(n: int):
    cluster = Cluster(n=n, backend="gloo", timeout=120.0, dashboard=False)
    cluster.start()
    return cluster


@pytest.fixture(scope="session")
def cluster2():
    cluster = _started(2)
    yield cluster
    cluster.stop()


@pytest.fixture(scope="session")
def cluster4():
    cluster = _started(4)
    yield cluster
    cluster.stop()


@pytest.fixture
def captured():
    """An IPython shell whose display messages are recorded instead of sent to a frontend."""
    shell = InteractiveShell.instance()
    previous = shell.display_pub
    shell.display_pub = CapturingDisplayPublisher()
    yield shell.display_pub.outputs
    shell.display_pub = previous
