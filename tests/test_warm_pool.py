"""The warm pool (`colab_par.cluster.warm_pool`): engines and controller come forked from zygotes that
already imported torch and ipyparallel, the zygotes outlive every cluster, nothing a cluster
started outlives its stop, and a pool that no longer matches the environment is renewed first."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

from colab_par import Cluster
from colab_par.cluster import warm_pool
from colab_par.cluster import descendant_pids


def forked_from() -> str | None:
    import os

    return os.environ.get("COLAB_PAR_FORKED_FROM")


def _zygote(target: str) -> int:
    pool = warm_pool.shared_pool()
    return int(pool.command(target)[-2])  # the zygote pid its proxies connect to


def test_engines_and_controller_are_forked_from_the_warm_pool(cluster2):
    engine_zygote = str(_zygote("engine"))
    assert cluster2.run(forked_from) == [engine_zygote, engine_zygote]
    # the controller (not its proxy, which ipyparallel holds) is the controller zygote's child
    controller_children = descendant_pids(_zygote("controller"))
    assert controller_children & cluster2.pids, "no controller forked from the controller zygote"


def test_the_pool_outlives_a_cluster_and_keeps_none_of_its_processes():
    pool = warm_pool.shared_pool()
    assert pool.wait_ready()
    zygotes = pool.pids
    before = descendant_pids()
    forked_before = set().union(*map(descendant_pids, zygotes))  # other modules' clusters
    cluster = Cluster(n=2, backend="gloo", timeout=120.0, dashboard=False).start()
    try:
        assert not zygotes & cluster.pids  # stop() must never kill the pool
        assert cluster.run(forked_from) == [str(_zygote("engine"))] * 2
        cluster.restart()  # fresh engines, forked again from the same zygote
        assert cluster.run(forked_from) == [str(_zygote("engine"))] * 2
    finally:
        cluster.stop()
    assert pool.running and pool.pids == zygotes
    assert set().union(*map(descendant_pids, zygotes)) == forked_before  # all it forked are gone
    assert descendant_pids() - before == set()


def imported(modules: list[str]) -> list[str]:
    import sys

    return [module for module in modules if module in sys.modules]


def test_engines_forked_once_the_pool_was_idle_come_with_the_heavy_imports_made():
    """What a first `parallelize` / `from_pretrained` would import (seconds of one core each)."""
    heavy = ["colab_par.parallel", "torch._dynamo", "transformers.modeling_utils", "peft"]
    pool = warm_pool.shared_pool()
    if not pool.wait_warm(timeout=0.0):  # a fresh pool: it imports only after serving a start
        Cluster(n=1, backend="gloo", timeout=120.0, dashboard=False).start().stop()
    assert pool.wait_warm()
    cluster = Cluster(n=1, backend="gloo", timeout=120.0, dashboard=False).start()
    try:
        assert cluster.run(imported, heavy) == [heavy]
    finally:
        cluster.stop()


def changed_variable() -> str | None:
    import os

    return os.environ.get("TORCH_COLAB_PAR_TEST_CHANGED")


def test_a_changed_environment_renews_the_pool_before_a_start(monkeypatch, capsys):
    pool = warm_pool.shared_pool()
    assert pool.wait_ready()
    stale = _zygote("engine")
    monkeypatch.setenv("TORCH_COLAB_PAR_TEST_CHANGED", "1")  # torch could have read it at import
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/tmp/as-torch-sets-it")  # read while compiling only
    cluster = Cluster(n=1, backend="gloo", timeout=120.0, dashboard=False).start()
    try:
        assert "the environment changed since the warm pool started (TORCH_COLAB_PAR_TEST_CHANGED); " \
               "renewing it" in capsys.readouterr().err
        fresh = _zygote("engine")
        folder = os.path.dirname(warm_pool.shared_pool().socket_path("engine"))
        assert fresh != stale
        assert cluster.run(forked_from) == [str(fresh)]  # from a zygote that saw the variable
        assert cluster.run(changed_variable) == ["1"]
    finally:
        cluster.stop()
    monkeypatch.delenv("TORCH_COLAB_PAR_TEST_CHANGED")
    warm_pool.stop_shared_pool()  # its environment has the variable; the next test's would not
    assert not os.path.exists(folder)  # a stopped pool leaves no folder behind


# a fresh kernel: `%load_ext colab_par` starts the pool, then the notebook imports torch's compiler
# (which writes TORCHINDUCTOR_CACHE_DIR into os.environ) and sets a variable read only at run time
_FRESH_KERNEL = """
import json, os
os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
from IPython.core.interactiveshell import InteractiveShell
InteractiveShell.instance().run_line_magic("load_ext", "colab_par")
from colab_par import Cluster
from colab_par.cluster import warm_pool
pool = warm_pool.shared_pool()
assert pool.wait_ready()
zygotes = pool.pids
import torch._inductor.config
assert "TORCHINDUCTOR_CACHE_DIR" in os.environ
os.environ["COLAB_PAR_TEST_RUN_TIME"] = "seen"
with Cluster(n=1, backend="gloo", timeout=120.0, dashboard=False) as cluster:
    engine = cluster.run(lambda: [__import__("os").environ.get(name) for name in
                                  ("COLAB_PAR_FORKED_FROM", "TORCHINDUCTOR_CACHE_DIR", "COLAB_PAR_TEST_RUN_TIME")])
print(json.dumps({"same_pool": warm_pool.shared_pool() is pool and pool.pids == zygotes,
                  "engine_zygote": int(pool.command("engine")[-2]), "engine": engine[0],
                  "cache_dir": os.environ["TORCHINDUCTOR_CACHE_DIR"]}))
"""


def test_what_torch_sets_in_the_environment_never_renews_the_pool():
    done = subprocess.run([sys.executable, "-c", _FRESH_KERNEL], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "environment changed" not in done.stderr, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["same_pool"]
    # forked from the pool's engine zygote, with the notebook's environment as it is now
    assert seen["engine"] == [str(seen["engine_zygote"]), seen["cache_dir"], "seen"]


def test_a_cluster_outlives_the_pool_it_was_forked_from():
    """The pool stopped (or renewed) under a running cluster: each proxy stands for its engine to
    the end, so the launcher never takes a live engine for gone and the stop is prompt."""
    cluster = Cluster(n=2, backend="gloo", timeout=120.0, dashboard=False).start()
    try:
        zygotes = warm_pool.pool_pids()
        forked = set().union(*map(descendant_pids, zygotes))  # the engines and the controller
        proxies = descendant_pids() - zygotes - forked
        warm_pool.stop_shared_pool()
        time.sleep(0.5)  # time for a proxy that read end-of-file to exit, as they did before
        assert proxies <= descendant_pids(), "a proxy exited while its engine lived on"
        assert cluster.run(forked_from) != [None, None]
    finally:
        started = time.monotonic()
        cluster.stop()
    assert time.monotonic() - started < 5.0
    assert not cluster.pids & descendant_pids()


def test_switched_off_by_the_environment(monkeypatch):
    monkeypatch.setenv("COLAB_PAR_WARM_POOL", "0")
    assert warm_pool.shared_pool() is None


def _gone_soon(path: str, seconds: float = 10.0) -> bool:
    deadline = time.monotonic() + seconds
    while os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not os.path.exists(path)


def test_a_pool_whose_owner_died_leaves_no_folder_behind():
    """Its owner killed (no atexit, as a crashed kernel): the zygotes read end-of-file on stdin,
    exit and take their folder with them."""
    owner = subprocess.run(
        [sys.executable, "-c", "import os; from colab_par import warm_pool; p = warm_pool.WarmPool().start(); "
         "assert p.wait_ready(); print(os.path.dirname(p.socket_path('engine')), flush=True); os._exit(0)"],
        capture_output=True, text=True, timeout=120, check=True)
    assert _gone_soon(owner.stdout.strip())
