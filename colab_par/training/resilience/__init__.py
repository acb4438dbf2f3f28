"""Losing an engine without losing steps: state that lives in the engines' memory, not on disk.

  rank_copy.py  a rank's whole training state on the host (`RankCopy`), taken from and put back
                into a model, optimizer and Trainer, and as bytes for the network
  peers.py      moving copies between ranks over a gloo group (to a buddy, from a replica)
  memory.py     what each engine keeps for recovery: its live Trainer at the last whole step, and
                in-memory snapshots (its own and its buddy's) every K steps
  recover.py    after an engine was replaced, the ranks agree where each one's state comes from
                (a live replica: no step lost; else a snapshot: the steps since it; else disk)

Disk checkpoints (training/checkpoint*.py) stay the long-term record; these make the common loss,
one engine, cheap. The Trainer uses them under `Checkpoints(on_failure="restart")`.
"""
