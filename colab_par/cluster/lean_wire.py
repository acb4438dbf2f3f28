"""The direct channel's lean call messages: one small header and the pickled call, signed.

A Jupyter message is four JSON documents (header, parent, metadata, content) built and checked by
traitlets-heavy session code: most of a trivial call's CPU on both ends. A call here is
``[MARKER, header, signature, *payload]``: the header is ``msg_id \\0 session \\0 kind`` in a
request and ``msg_id \\0 status \\0 output-follows`` in a reply, in ASCII; the payload is
ipyparallel's own apply buffers (`pack_apply_message` / `serialize_object`) or a cell's code, an
error's payload one JSON document (name, value, IPython's traceback, engine info); the signature
is the session's HMAC over header and payload (the cluster's key: whoever lacks it cannot run
code on an engine).
"""
from __future__ import annotations

import hmac
import json
from collections import OrderedDict
from typing import Any, Sequence

__all__ = ["MARKER", "APPLY", "EXECUTE", "is_lean", "frames", "opened", "error_payload", "error_from", "ReplayGuard"]

MARKER = b"colab_par.call/1"  # an ipyparallel message starts with identities and b"<IDS|MSG>"
APPLY, EXECUTE = "apply", "execute"  # a request's kind: a function call, or a cell (UTF-8 code)


def is_lean(parts: Sequence[Any]) -> bool:
    """Whether `parts` (the frames after the sender's identity) are a lean message."""
    first = parts[0] if parts else b""
    return (first.bytes if hasattr(first, "bytes") else first) == MARKER


def _signature(auth: hmac.HMAC | None, header: bytes, payload: Sequence[Any]) -> bytes:
    if auth is None:
        return b""
    digest = auth.copy()
    digest.update(header)
    for part in payload:
        digest.update(part)
    return digest.hexdigest().encode()


def frames(auth: hmac.HMAC | None, fields: Sequence[str], payload: Sequence[Any]) -> list[Any]:
    """The frames of one message: `fields` (no NUL in them) and `payload` (bytes-like), signed."""
    header = "\0".join(fields).encode()
    return [MARKER, header, _signature(auth, header, payload), *payload]


def opened(auth: hmac.HMAC | None, parts: Sequence[Any],
           guard: "ReplayGuard | None" = None) -> tuple[list[str], list[Any]] | None:
    """(fields, payload) of a lean message, or None when its signature is wrong (or, with a
    `guard`, was seen before)."""
    raw = [part.buffer if hasattr(part, "buffer") else part for part in parts]
    if len(raw) < 3:
        return None
    header, signature, payload = bytes(raw[1]), bytes(raw[2]), raw[3:]
    if not hmac.compare_digest(signature, _signature(auth, header, payload)):
        return None
    if guard is not None and not guard.fresh(signature):
        return None
    return header.decode().split("\0"), payload


def error_payload(reply: dict[str, Any], completed: float) -> list[bytes]:
    """An error reply's payload (`do_apply`'s reply content) and when it failed (engine clock)."""
    return [json.dumps({"ename": reply.get("ename", "Error"), "evalue": reply.get("evalue", ""),
                        "traceback": reply.get("traceback") or [],
                        "engine_info": reply.get("engine_info") or {}, "completed": completed}).encode()]


def error_from(payload: Sequence[Any]) -> dict[str, Any]:
    return json.loads(bytes(payload[0]))


class ReplayGuard:
    """Refuses a signature seen before (a captured request sent again), remembering the last `size`."""

    def __init__(self, size: int = 1 << 14):
        self._seen: OrderedDict[bytes, None] = OrderedDict()
        self._size = size

    def fresh(self, signature: bytes) -> bool:
        if not signature:  # an unsigned cluster (empty key) has nothing to compare
            return True
        if signature in self._seen:
            return False
        self._seen[signature] = None
        if len(self._seen) > self._size:
            self._seen.popitem(last=False)
        return True
