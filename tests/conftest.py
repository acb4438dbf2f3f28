"""Shared real clusters: starting ipyparallel engines costs seconds, so the tests of a module reuse
them (fresh engines per module: one crashed engine fails one module, not the rest of the run, and
no engine carries hundreds of layouts' state); and the Jupyter kernel the notebook tests run.

Tests that break engines on purpose (kill, stuck collectives) start their own cluster instead.
"""
from __future__ import annotations

import json
import sys

import pytest
from notebook_run import KERNEL, run, with_losses_printed
from IPython.core.displaypub import CapturingDisplayPublisher
from IPython.core.interactiveshell import InteractiveShell

from colab_par import Cluster


def _started(n: int):
    cluster = Cluster(n=n, backend="gloo", timeout=120.0, dashboard=False)
    cluster.start()
    return cluster


@pytest.fixture(scope="module")
def cluster2():
    cluster = _started(2)
    yield cluster
    cluster.stop()


@pytest.fixture(scope="module")
def cluster4():
    cluster = _started(4)
    yield cluster
    cluster.stop()


@pytest.fixture(scope="module")
def cluster8():
    """Eight gloo engines (3d and 2.5d grids, dp over a 2d grid): tiny models keep them feasible
    on two cores."""
    cluster = _started(8)
    yield cluster
    cluster.stop()


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as patch:
        yield patch


@pytest.fixture(scope="module")
def kernel_path(tmp_path_factory, monkeypatch_module):
    """A Jupyter kernel of this interpreter, for nbclient (`notebook_run.KERNEL`)."""
    root = tmp_path_factory.mktemp("jupyter")
    spec = root / "kernels" / KERNEL
    spec.mkdir(parents=True)
    (spec / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "colab_par tests", "language": "python"}))
    monkeypatch_module.setenv("JUPYTER_PATH", str(root))
    return root


@pytest.fixture(scope="session")
def executed_notebooks(tmp_path_factory):
    """name -> that notebook run once a session (needs `kernel_path`), with a last cell printing
    every step's loss: the notebook tests and the export tests read the same run."""
    runs = {}

    def executed(name: str):
        if name not in runs:
            runs[name] = run(with_losses_printed(name), tmp_path_factory.mktemp(name))
        return runs[name]
    return executed


@pytest.fixture
def captured():
    """An IPython shell whose display messages are recorded instead of sent to a frontend."""
    shell = InteractiveShell.instance()
    previous = shell.display_pub
    shell.display_pub = CapturingDisplayPublisher()
    yield shell.display_pub.outputs
    shell.display_pub = previous


@pytest.fixture(scope="module")
def shell():
    """This process's one IPython shell, with the colab_par extension loaded."""
    ip = InteractiveShell.instance()  # the one shell of this process, whoever made it first
    ip.run_line_magic("load_ext", "colab_par")
    return ip


@pytest.fixture
def on_cluster(shell, cluster2):
    """The shell's magics talking to the shared two-engine cluster; its last errors cleared after."""
    from colab_par.notebook import magics

    magics.use_cluster(cluster2)
    yield shell
    cluster2.clear_errors()
    magics._default = None  # the cluster2 fixture owns the cluster's lifetime


@pytest.fixture
def shell_on(on_cluster, captured):
    """`on_cluster` with display messages recorded (`captured`)."""
    return on_cluster


@pytest.fixture
def slow_replacement(monkeypatch):
    """A dead engine's replacement is ready 2 s later than this machine's warm pool makes it (a
    real cluster's takes longer still), so survivors that can train on always get to: the tests of
    degraded training do not race the replacement."""
    import time

    from colab_par.cluster.faults import Faults

    start = Faults._start_in_place

    def later(self, dead):
        time.sleep(2.0)
        return start(self, dead)
    monkeypatch.setattr(Faults, "_start_in_place", later)
