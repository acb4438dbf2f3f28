"""What the warm pool (`colab_par/cluster/warm_pool.py`) costs in memory: its zygotes' resident (RSS) and
unique (USS: freed if the pool stopped) memory, ready and then after the idle imports it makes once
it has served a first start. Forked engines share the zygotes' pages copy-on-write, so USS is what
the pool itself adds to the host. Run: python benchmarks/warm_pool_memory.py (about 30 s)."""
from __future__ import annotations

import time

import psutil

from colab_par.cluster import Cluster
from colab_par.cluster.warm_pool import pool_pids, shared_pool, stop_shared_pool


def footprint() -> dict[str, tuple[float, float]]:
    """(RSS, USS) in MB of each pool process, by its command line's last word (engine/controller)."""
    found = {}
    for pid in sorted(pool_pids()):
        process = psutil.Process(pid)
        memory = process.memory_full_info()
        found[f"{process.cmdline()[-1]} ({pid})"] = (memory.rss / 1e6, memory.uss / 1e6)
    return found


def show(title: str, found: dict[str, tuple[float, float]]) -> None:
    print(f"{title}:")
    for name, (rss, uss) in found.items():
        print(f"  {name:<28} RSS {rss:7.1f} MB   USS {uss:7.1f} MB")
    print(f"  {'total':<28} RSS {sum(r for r, _ in found.values()):7.1f} MB   "
          f"USS {sum(u for _, u in found.values()):7.1f} MB")


def main() -> None:
    pool = shared_pool()
    assert pool is not None, "the warm pool is switched off (COLAB_PAR_WARM_POOL=0)"
    started = time.perf_counter()
    assert pool.wait_ready(), "the warm pool did not become ready"
    print(f"pool ready in {time.perf_counter() - started:.1f} s")
    show("ready (before any start)", footprint())
    with Cluster(n=2):
        pass
    assert pool.wait_warm(), "the pool did not finish its idle imports"
    show("after a first start and the idle imports", footprint())
    stop_shared_pool()


if __name__ == "__main__":
    main()
