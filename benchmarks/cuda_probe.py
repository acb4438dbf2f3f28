"""The machine's CUDA GPUs, asked in a child process.

A benchmark's driver starts engines that each own a GPU. Any CUDA call in the driver itself
(`torch.cuda.is_available`, a device name, `mem_get_info`) initialises CUDA there, and a context
or allocator reservation would then sit on the engines' GPUs for the whole run, taking memory
they measure and plan with. The child exits before any engine starts, and the driver never
touches CUDA (`torch.cuda.is_initialized()` stays False there: `gpu_check` checks it).
"""
from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass

__all__ = ["Gpus", "probe"]

_CHILD = """
import json, sys
import torch
free_of = [int(i) for i in sys.argv[1:]]
count = torch.cuda.device_count() if torch.cuda.is_available() else 0
print(json.dumps({"names": [torch.cuda.get_device_name(i) for i in range(count)],
                  "free": {i: torch.cuda.mem_get_info(i)[0] for i in free_of if i < count}}))
"""


@dataclass(frozen=True)
class Gpus:
    """The GPUs this process may use: their names, and the free bytes of those asked for."""

    names: list[str]
    free: dict[int, int]

    @property
    def count(self) -> int:
        return len(self.names)


def probe(free_of: tuple[int, ...] = (), timeout: float = 120.0) -> Gpus:
    """The GPUs' names and, for the devices `free_of` only, their free memory (that needs a
    context, so only the devices a run will use are touched, and only in the child)."""
    done = subprocess.run([sys.executable, "-c", _CHILD, *map(str, free_of)], capture_output=True,
                          text=True, timeout=timeout)
    if done.returncode:
        raise RuntimeError(f"the CUDA probe failed: {done.stderr.strip().splitlines()[-1:]}")
    answer = json.loads(done.stdout.strip().splitlines()[-1])
    return Gpus(answer["names"], {int(index): free for index, free in answer["free"].items()})
