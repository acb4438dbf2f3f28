"""The link between trainer engines and generator engines, which live in two torch.distributed
worlds (`parallelize` builds its mesh over the whole world, so the generators cannot join the
trainers'): a third process group over both, built from torch's public c10d pieces, a
`ProcessGroupGloo` on a `TCPStore` the notebook serves (`BridgeLink` says where).

Bridge ranks: trainers 0..T-1 (their own rank), generators T..T+G-1. Messages go point to point,
each under its own tags (kind and step), so the two sides never have to agree on a global order
of operations. Sends are posted and waited later (`Posted`): a gloo send completes only once its
receiver posted the receive, and each side only ever blocks in a receive whose send the other side
posts without waiting on anything but its own earlier receives, so no cycle of waits can form.

Every wait is bounded by the group's timeout, and a side that fails closes its bridge (`close`):
its peers' pending operations then fail at once ("closed by peer") instead of at the timeout. A
gloo wait cannot be cut short from its own process (neither `abort` nor `shutdown` wakes it), only
by its peer's sockets closing, which is why every loop closes its bridge on the way out.

Nothing that crosses is unpickled: small values and each message's description are JSON (numbers,
strings, lists, dicts), tensors raw bytes with their shape and dtype by name.
"""
from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["BridgeLink", "Bridge", "BridgeClosed", "Message", "Posted", "ROLLOUT", "WEIGHTS"]

ROLLOUT, WEIGHTS = 1, 2  # message kinds, part of every tag
_PIECES = 4  # tags per message: header (sizes), description, body
_ALIGN = 16
_MAX_STEP = 2 ** 24


class BridgeClosed(RuntimeError):
    """The other side closed the bridge (it failed: its own error is the one to read) or did not
    answer within the timeout."""


@dataclass(frozen=True)
class BridgeLink:
    """Where and how to join one run's bridge: the store the notebook serves at `host`:`port`,
    the key `prefix` of this run, the sizes of both sides and the timeout of every operation."""

    host: str
    port: int
    prefix: str
    trainers: int
    generators: int
    timeout_s: float

    @property
    def size(self) -> int:
        return self.trainers + self.generators

    def generator_rank(self, index: int) -> int:
        return self.trainers + index


@dataclass
class Message:
    """What travels: small JSON-able `info` (tuples arrive as lists) and named tensors (any dtype,
    on the CPU)."""

    info: dict[str, Any]
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def tensor_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


@dataclass
class Posted:
    """Sends in flight and the buffers they read from (kept alive until waited)."""

    works: list[Any]
    buffers: list[torch.Tensor]
    what: str

    def wait(self, bridge: "Bridge") -> None:
        for work in self.works:
            bridge.waited(work, self.what)
        self.works, self.buffers = [], []


class Bridge:
    """This process's member of the bridge group (module docstring); `close` it on the way out."""

    def __init__(self, link: BridgeLink, rank: int):
        self.link, self.rank = link, rank
        timeout = timedelta(seconds=link.timeout_s)
        try:
            self.store = dist.PrefixStore(link.prefix, dist.TCPStore(link.host, link.port, is_master=False,
                                                                      timeout=timeout))
            self.group: Any = dist.ProcessGroupGloo(self.store, rank, link.size, timeout)
        except RuntimeError as error:  # said as the bridge's, not as this cluster's own world broken
            raise BridgeClosed(f"bridge rank {rank} could not join the bridge at {link.host}:{link.port}: the run "
                               "stopped (the other side failed: its error says why), or not every engine of "
                               f"both sides joined within {link.timeout_s:.0f}s") from error
        self.sent_bytes: dict[int, int] = {ROLLOUT: 0, WEIGHTS: 0}  # tensor bytes posted, by kind
        self.in_flight: list[Posted] = []

    def close(self) -> None:
        """Drop the group and the sends still in flight (each holds the group's connections): its
        sockets close, so a peer waiting on this rank fails now."""
        for posted in self.in_flight:
            posted.works, posted.buffers = [], []
        self.in_flight, self.group = [], None

    # ---- small values through the store ---------------------------------------------------------------
    def put(self, key: str, value: Any) -> None:
        self._through_store(lambda: self.store.set(key, json.dumps(value)), f"publishing {key!r}")

    def get(self, key: str) -> Any:
        """`key`'s value, waiting (at most the timeout) until another rank `put` it."""
        return json.loads(self._through_store(lambda: self.store.get(key), f"reading {key!r}"))

    def _through_store(self, operation: Any, what: str) -> Any:
        try:
            return operation()
        except RuntimeError as error:  # the notebook closed the store: the run stopped
            raise BridgeClosed(f"bridge rank {self.rank}, {what}: the run stopped (the other side failed: its "
                               f"error says why), or nothing came within {self.link.timeout_s:.0f}s") from error

    # ---- messages -------------------------------------------------------------------------------------
    def post(self, message: Message, dst: int, kind: int, step: int) -> Posted:
        """Start sending `message` to bridge rank `dst` under (`kind`, `step`); returns at once."""
        tensors = {name: t.detach().cpu().contiguous() for name, t in message.tensors.items()}
        described = [[name, list(t.shape), str(t.dtype).removeprefix("torch.")] for name, t in tensors.items()]
        encoded = json.dumps({"info": message.info, "tensors": described}).encode()
        description = torch.frombuffer(bytearray(encoded), dtype=torch.uint8)
        body = torch.cat([_padded_bytes(t) for t in tensors.values()]) if tensors else torch.zeros(0, dtype=torch.uint8)
        buffers = [torch.tensor([description.numel(), body.numel()], dtype=torch.int64), description, body]
        base = _tag(kind, step)
        works = [self.group.send([buffer], dst, base + piece) for piece, buffer in enumerate(buffers)]
        self.sent_bytes[kind] += message.tensor_bytes
        posted = Posted(works, buffers, f"sending {_what(kind, step)} to bridge rank {dst}")
        self.in_flight = [p for p in self.in_flight if p.works] + [posted]
        return posted

    def receive(self, src: int, kind: int, step: int) -> Message:
        """The message bridge rank `src` posts under (`kind`, `step`); waits at most the timeout."""
        base, what = _tag(kind, step), f"receiving {_what(kind, step)} from bridge rank {src}"
        header = torch.zeros(2, dtype=torch.int64)
        self.waited(self.group.recv([header], src, base), what)
        description, body = torch.empty(int(header[0]), dtype=torch.uint8), torch.empty(int(header[1]), dtype=torch.uint8)
        self.waited(self.group.recv([description], src, base + 1), what)
        self.waited(self.group.recv([body], src, base + 2), what)
        decoded = json.loads(description.numpy().tobytes())
        tensors, offset = {}, 0
        for name, shape, dtype_name in decoded["tensors"]:
            dtype = getattr(torch, dtype_name, None)
            if not isinstance(dtype, torch.dtype):
                raise BridgeClosed(f"bridge rank {self.rank}, {what}: tensor {name!r} has no dtype {dtype_name!r}")
            size = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
            tensors[name] = body[offset:offset + size].view(dtype).reshape(shape)
            offset += -(-size // _ALIGN) * _ALIGN
        return Message(decoded["info"], tensors)

    def waited(self, work: Any, what: str) -> None:
        """`work.wait()`, its failure said as the bridge's: closed by the other side or timed out."""
        started = time.monotonic()
        try:
            work.wait()
        except RuntimeError as error:
            if self.group is None:
                raise BridgeClosed(f"bridge rank {self.rank} left the bridge while {what}") from error
            late = time.monotonic() - started >= self.link.timeout_s * 0.99
            why = (f"nothing came within the bridge's timeout of {self.link.timeout_s:.0f}s" if late else
                   "the other side closed the bridge: its own error says why")
            # the backend's words only in the cause: in the message, the trainers' or generators'
            # cluster would take them for its own world broken and re-form it
            raise BridgeClosed(f"bridge rank {self.rank}, {what}: {why}") from error


def _tag(kind: int, step: int) -> int:
    if not 0 <= step < _MAX_STEP:
        raise ValueError(f"step {step} is outside the bridge's tag space (0..{_MAX_STEP - 1})")
    return (kind * _MAX_STEP + step) * _PIECES


def _what(kind: int, step: int) -> str:
    return f"rollout {step}" if kind == ROLLOUT else f"weights of version {step}"


def _padded_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor`'s bytes, padded to a multiple of `_ALIGN` so that every tensor's slice of the
    received body starts aligned for its dtype (a view, no copy)."""
    raw = tensor.reshape(-1).view(torch.uint8)
    return torch.cat([raw, raw.new_zeros(-raw.numel() % _ALIGN)])
