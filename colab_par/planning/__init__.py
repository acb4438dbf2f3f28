"""Pure Python, no cluster: memory, communication and time estimates, devices, FLOPs, plan()."""
