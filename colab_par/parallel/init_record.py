"""Record how a model initialises itself on the meta device, then replay it one tensor at a time.

Shard-first initialisation needs every rank to end up with its slice of the weights a one-process
build would have made, without any rank ever holding the whole model. We record instead of
re-implementing each model's init: while the model is built (or its `reset_parameters` run) on the
meta device, a dispatch mode logs every aten op on meta tensors, and for each random op the CPU
generator's state just before it. Later `value(name)` replays only the ops that produced that one
tensor, on the CPU, in its own dtype, so the full tensor exists for one parameter at a time.

Exactness: random ops are replayed from the generator state they saw, and to make that state the
one a normal build would reach, each random op is also run once while recording (on a temporary
tensor, freed at once). The weights therefore equal a CPU build with the same seed, whatever order
or scheme the model's init uses (per-module `reset_parameters`, a root-level re-init, HF
`post_init`, views such as a zeroed padding row, buffers computed from `arange`).
"""
from __future__ import annotations

import contextlib
import contextvars
import functools
import zlib
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from colab_par import compat
from colab_par.compat import tree_map
from colab_par.memory_tiers.host_heap import trim_host_heap

__all__ = ["InitRecord", "record_build", "record_reset", "named_state", "tie_groups", "retie",
           "UninitialisedError", "drawing_random_values"]

# In-place ops that overwrite every element without reading the old values: replay can start there.
_OVERWRITES = {"uniform_", "normal_", "fill_", "zero_", "random_", "exponential_", "geometric_",
               "cauchy_", "log_normal_", "copy_", "bernoulli_"}
# torch.nn.init functions that return at once on a meta tensor (no op, no RNG drawn): while
# recording they are replaced by ones that log the call itself and draw from the generator.
_META_SKIPPING_INITS = ("trunc_normal_", "orthogonal_", "dirac_", "sparse_")
_OVERWRITES |= set(_META_SKIPPING_INITS)
# Ops that only allocate: their values are garbage until something writes them.
_ALLOCATIONS = {"empty", "empty_strided", "new_empty", "new_empty_strided", "empty_like"}
# Set inside `drawing_random_values()`: random ops draw even where the recording was told not to.
_DRAW_ANYWAY: contextvars.ContextVar[bool] = contextvars.ContextVar("colab_par_draw_anyway", default=False)


class UninitialisedError(ValueError):
    """A tensor that nothing initialises on the meta device (its values would be garbage)."""


@dataclass(frozen=True)
class _Ref:
    """A tensor argument: a view (size, stride, offset) of one version of a recorded storage."""
    storage: int
    version: int
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    dtype: torch.dtype


@dataclass
class _Call:
    """One aten call; `rng` is the generator state it started from (random ops only)."""
    func: Any
    args: tuple
    kwargs: dict
    rng: tuple[torch.Generator, torch.Tensor] | None = None
    output: int = 0  # which output is the storage's value (ops returning several tensors)
    target: _Ref | None = None  # in-place ops: the view written to


@dataclass
class _Storage:
    numel: int
    dtype: torch.dtype
    versions: list[_Call | None] = field(default_factory=list)  # None: allocated, never written


class InitRecord:
    """The recorded init of one model: `value(name)` rebuilds that parameter or buffer."""

    def __init__(self) -> None:
        self._storages: dict[int, _Storage] = {}
        self._keep: list[torch.Tensor] = []  # meta tensors alive while recording: keys stay unique
        self.names: dict[str, _Ref | torch.Tensor] = {}  # real tensors (built off meta) as they are
        self._tied: dict[_Ref, list[str]] = {}

    # ---- recording -----------------------------------------------------------------------------
    def _key(self, tensor: torch.Tensor) -> int:
        key = compat.storage_key(tensor)
        if key not in self._storages:
            self._storages[key] = _Storage(tensor.untyped_storage().nbytes() // tensor.element_size(),
                                           tensor.dtype, [None])
            self._keep.append(tensor)
        return key

    def ref(self, tensor: torch.Tensor) -> _Ref:
        key = self._key(tensor)
        return _Ref(key, len(self._storages[key].versions) - 1, tuple(tensor.shape), tuple(tensor.stride()),
                    tensor.storage_offset(), tensor.dtype)

    def _arg(self, value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return self.ref(value) if value.is_meta else value.detach().clone()
        if isinstance(value, torch.device) and value.type == "meta":
            return torch.device("cpu")
        return value

    def record(self, func: Any, args: tuple, kwargs: dict, outputs: Any, rng: Any) -> None:
        """Log `func` after the meta kernel ran: new versions for what it wrote, new storages for
        what it created."""
        schema = compat.op_schema(func)
        written = [a for a, spec in zip(args, schema.arguments)
                   if spec.alias_info is not None and spec.alias_info.is_write and isinstance(a, torch.Tensor)]
        written += [v for k, v in kwargs.items() if isinstance(v, torch.Tensor)
                    and any(s.name == k and s.alias_info is not None and s.alias_info.is_write
                            for s in schema.arguments)]
        written = [t for t in written if t.is_meta]
        call_args, call_kwargs = tree_map(self._arg, args), tree_map(self._arg, kwargs)
        for tensor in written:
            target = self.ref(tensor)  # the version before this write
            self._storages[target.storage].versions.append(
                _Call(func, call_args, call_kwargs, rng, target=target))
        if written:
            return
        if any(ret.alias_info is not None for ret in schema.returns):
            return  # a view: its geometry is captured where it is used
        outs = outputs if isinstance(outputs, (tuple, list)) else (outputs,)
        for index, out in enumerate(outs):
            if isinstance(out, torch.Tensor) and out.is_meta:
                key = compat.storage_key(out)
                made = None if _op_name(func) in _ALLOCATIONS else _Call(func, call_args, call_kwargs, rng,
                                                                       output=index)
                self._storages[key] = _Storage(out.untyped_storage().nbytes() // out.element_size(), out.dtype,
                                               [made])
                self._keep.append(out)

    def record_init_function(self, function: Callable, tensor: torch.Tensor, args: tuple, kwargs: dict,
                             rng: Any) -> None:
        """Log a whole torch.nn.init call on `tensor` (see _META_SKIPPING_INITS)."""
        target = self.ref(tensor)
        call = _Call(_InitFunction(function), (target, *args), dict(kwargs), rng, target=target)
        self._storages[target.storage].versions.append(call)

    def name_tensors(self, model: nn.Module) -> None:
        """Remember which storage view each state name (tied names included) and buffer is."""
        for name, tensor in named_state(model):
            self.names[name] = self.ref(tensor) if tensor.is_meta else tensor.detach()
            if tensor.is_meta:
                self._tied.setdefault(self.names[name], []).append(name)
        self._keep.clear()

    def keep_under(self, prefix: str) -> None:
        """Rename the recorded state names from a wrapper's to its submodule's at `prefix` (a PEFT
        model's "base_model.model."), dropping names outside it."""
        self.names = {name[len(prefix):]: ref for name, ref in self.names.items() if name.startswith(prefix)}
        self._tied = {ref: [name[len(prefix):] for name in names if name.startswith(prefix)]
                      for ref, names in self._tied.items()}

    def fingerprint(self) -> int:
        """A checksum of the generator states the init started from: equal on ranks that
        recorded the same init."""
        states = [call.rng[1] for storage in self._storages.values() for call in storage.versions
                  if call is not None and call.rng is not None]
        return zlib.crc32(b"".join(state.numpy().tobytes() for state in states[:1] + states[-1:]))

    def aliases(self, name: str) -> list[str]:
        """`name` first, then every other name of the same tensor (tied weights)."""
        ref = self.names[name]
        if isinstance(ref, torch.Tensor):
            return [name]
        return [name] + [other for other in self._tied[ref] if other != name]

    # ---- replay --------------------------------------------------------------------------------
    def value(self, name: str) -> torch.Tensor:
        """The full tensor `name` as the recorded init made it (CPU, its own dtype)."""
        ref = self.names[name]
        return ref if isinstance(ref, torch.Tensor) else self._view(ref)

    def uninitialised(self) -> list[str]:
        """Names whose storage was allocated but never written."""
        return [name for name, ref in self.names.items()
                if isinstance(ref, _Ref) and self._start(ref.storage, ref.version) is None]

    def _view(self, ref: _Ref) -> torch.Tensor:
        flat = self._storage_value(ref.storage, ref.version)
        if flat.dtype != ref.dtype:
            flat = flat.view(ref.dtype)
        return flat.as_strided(ref.size, ref.stride, ref.offset)

    def _start(self, key: int, version: int) -> int | None:
        """The latest version <= `version` replay can start from (a creation or a full overwrite)."""
        storage = self._storages[key]
        for v in range(version, -1, -1):
            call = storage.versions[v]
            if call is None:
                return None
            if call.target is None or (_op_name(call.func) in _OVERWRITES and _covers(call.target, storage)):
                return v
        return None

    def _storage_value(self, key: int, version: int) -> torch.Tensor:
        storage = self._storages[key]
        start = self._start(key, version)
        if start is None:
            return torch.empty(storage.numel, dtype=storage.dtype, device="cpu")
        flat = None
        for v in range(start, version + 1):
            call = storage.versions[v]
            if call.target is None:
                out = self._run(call)
                out = out[call.output] if isinstance(out, (tuple, list)) else out
                flat = torch.empty(0, dtype=out.dtype, device=out.device).set_(out.untyped_storage())
            else:
                if flat is None:
                    flat = torch.empty(storage.numel, dtype=storage.dtype, device="cpu")
                target = call.target
                view = (flat if flat.dtype == target.dtype else flat.view(target.dtype)).as_strided(
                    target.size, target.stride, target.offset)
                self._run(call, target=view)
        return flat

    def _run(self, call: _Call, target: torch.Tensor | None = None) -> Any:
        def resolve(value: Any) -> Any:
            if isinstance(value, _Ref):
                return target if (target is not None and value == call.target) else self._view(value)
            return value

        args, kwargs = tree_map(resolve, call.args), tree_map(resolve, call.kwargs)
        if call.rng is None:
            return call.func(*args, **kwargs)
        generator, state = call.rng
        after = generator.get_state()
        generator.set_state(state)
        try:
            return call.func(*args, **kwargs)
        finally:
            generator.set_state(after)


class _InitFunction:
    """A torch.nn.init function as a recorded call (named like the aten ops, see `_op_name`)."""

    def __init__(self, function: Callable):
        self.function = function

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with torch.no_grad():
            return self.function(*args, **kwargs)


def _op_name(func: Any) -> str:
    """"uniform_" for aten::uniform_ (any overload) and for torch.nn.init.uniform_ alike."""
    return func.function.__name__ if isinstance(func, _InitFunction) else func.overloadpacket.__name__


@contextlib.contextmanager
def _recording_meta_skipping_inits(record: InitRecord, draw: bool) -> Iterator[None]:
    originals = {name: getattr(nn.init, name) for name in _META_SKIPPING_INITS}

    def recorded(original: Callable) -> Callable:
        @functools.wraps(original)
        def init(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
            if not tensor.is_meta:
                return original(tensor, *args, **kwargs)
            generator = kwargs.get("generator") or torch.default_generator
            record.record_init_function(original, tensor, args, kwargs, (generator, generator.get_state()))
            if draw or _DRAW_ANYWAY.get():
                original(torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu"), *args, **kwargs)
                trim_host_heap()
            return tensor
        return init

    for name, original in originals.items():
        setattr(nn.init, name, recorded(original))
    try:
        yield
    finally:
        for name, original in originals.items():
            setattr(nn.init, name, original)


def _covers(target: _Ref, storage: _Storage) -> bool:
    numel = 1
    for size in target.size:
        numel *= size
    return target.offset == 0 and numel == storage.numel and target.dtype == storage.dtype


def named_state(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Every parameter and buffer under every name it has (tied names and non-persistent buffers
    included)."""
    named = list(model.named_parameters(remove_duplicate=False))
    named += list(model.named_buffers(remove_duplicate=False))
    return [(name, tensor) for name, tensor in named if tensor is not None]


class _Recorder(compat.torch_dispatch_mode()):
    def __init__(self, record: InitRecord, draw: bool):
        super().__init__()
        self.record, self.draw = record, draw

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if not _touches_meta(func, args, kwargs):
            return func(*args, **kwargs)
        rng = None
        if torch.Tag.nondeterministic_seeded in func.tags:
            generator = kwargs.get("generator") or torch.default_generator
            rng = (generator, generator.get_state())
        outputs = func(*args, **kwargs)
        self.record.record(func, args, kwargs, outputs, rng)
        if rng is not None and (self.draw or _DRAW_ANYWAY.get()):
            self._advance(func, args, kwargs, rng)
        return outputs

    def _advance(self, func: Any, args: tuple, kwargs: dict, rng: Any) -> None:
        """Run the random op once for real, so the generator moves on exactly as in a normal build."""
        generator, state = rng
        generator.set_state(state)

        def real(value: Any) -> Any:
            if isinstance(value, torch.Tensor) and value.is_meta:
                return torch.empty(value.shape, dtype=value.dtype, device="cpu")  # values do not move the RNG
            if isinstance(value, torch.device) and value.type == "meta":
                return torch.device("cpu")
            return value

        func(*tree_map(real, args), **tree_map(real, kwargs))
        trim_host_heap()


def _touches_meta(func: Any, args: tuple, kwargs: dict) -> bool:
    found = False

    def check(value: Any) -> Any:
        nonlocal found
        if (isinstance(value, torch.Tensor) and value.is_meta) or (
                isinstance(value, torch.device) and value.type == "meta"):
            found = True
        return value

    tree_map(check, (args, kwargs))
    return found


class _OnMeta(TorchFunctionMode):
    """Like `torch.device("meta")`, except that empty tensors stay on the CPU: libraries probe
    `torch.tensor([]).device` to skip initialising under a meta context (transformers does), and
    the recording needs that init to run."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func not in compat.device_constructors() or kwargs.get("device") is not None:
            return func(*args, **kwargs)
        out = func(*args, **{**kwargs, "device": "meta"})
        if isinstance(out, torch.Tensor) and out.numel() == 0:
            return func(*args, **kwargs)
        return out


@contextlib.contextmanager
def drawing_random_values() -> Iterator[None]:
    """Inside a factory recorded with ``draw=False``: this part's random ops draw for real, so the
    generator moves on as in a normal build (adapters added to a model whose weights a checkpoint
    fills get the values a one-process build with the same seed would give them)."""
    token = _DRAW_ANYWAY.set(True)
    try:
        yield
    finally:
        _DRAW_ANYWAY.reset(token)


def record_build(factory: Callable[[], nn.Module], *, draw: bool = True) -> tuple[nn.Module, InitRecord]:
    """Build `factory()` on the meta device, recording its initialisation.

    `draw=False` skips running each random op while recording (the cost of a whole random init):
    for weights a checkpoint then replaces, whose random values nobody reads. Random tensors
    replayed from such a record are the same on every rank but not a normal build's."""
    record = InitRecord()
    with _OnMeta(), _Recorder(record, draw), _recording_meta_skipping_inits(record, draw):
        model = factory()
    if not isinstance(model, nn.Module):
        raise TypeError(f"the model factory returned {type(model).__name__}, not an nn.Module")
    record.name_tensors(model)
    _refuse_uninitialised(model, record, factory=True)
    _refuse_plain_tensor_attributes(model)
    return model, record


def record_reset(model: nn.Module) -> InitRecord:
    """Record the init a meta model would get from a normal build: each module's
    `reset_parameters()`, children before parents (the order their constructors ran), and a
    Hugging Face model's `init_weights()` where its constructor ends (`post_init`)."""
    record = InitRecord()
    ties = tie_groups(model)
    _untie(model, ties)  # when the constructors ran, the tied modules still had their own weights
    with _Recorder(record, True), _recording_meta_skipping_inits(record, True), torch.no_grad():
        for module in _post_order(model):
            reset = compat.module_reset(module)
            if reset is not None:
                reset()
            if callable(getattr(module, "post_init", None)) and callable(getattr(module, "init_weights", None)):
                module.init_weights()
    retie(model, ties)
    record.name_tensors(model)
    _refuse_uninitialised(model, record, factory=False)
    _refuse_plain_tensor_attributes(model)
    return record


def tie_groups(model: nn.Module) -> list[list[str]]:
    """Names of each parameter or buffer that several modules share, in registration order."""
    groups: dict[int, list[str]] = {}
    for name, tensor in named_state(model):
        groups.setdefault(id(tensor), []).append(name)
    return [names for names in groups.values() if len(names) > 1]


def retie(model: nn.Module, groups: list[list[str]]) -> None:
    """Point every name of each group at the tensor under its first name (the module registered
    first owns it, as `self.head.weight = self.embed.weight` leaves it)."""
    for names in groups:
        first = _tensor_at(model, names[0])
        for name in names[1:]:
            _set_tensor(model, name, first)


def _untie(model: nn.Module, groups: list[list[str]]) -> None:
    for names in groups:
        first = _tensor_at(model, names[0])
        for name in names[1:]:
            fresh = torch.empty_like(first, device="meta")
            _set_tensor(model, name, nn.Parameter(fresh, first.requires_grad)
                        if isinstance(first, nn.Parameter) else fresh)


def _tensor_at(model: nn.Module, name: str) -> torch.Tensor:
    owner, _, attr = name.rpartition(".")
    return getattr(model.get_submodule(owner), attr)


def _set_tensor(model: nn.Module, name: str, tensor: torch.Tensor) -> None:
    owner, _, attr = name.rpartition(".")
    setattr(model.get_submodule(owner), attr, tensor)  # stays a parameter, or a buffer as persistent as it was


def _post_order(module: nn.Module) -> list[nn.Module]:
    order: list[nn.Module] = []
    for child in module.children():
        order += _post_order(child)
    return order + [module]


def _refuse_uninitialised(model: nn.Module, record: InitRecord, *, factory: bool) -> None:
    missing = record.uninitialised()
    if not missing:
        return
    name = missing[0]
    owner_name, _, attr = name.rpartition(".")
    owner = model.get_submodule(owner_name)
    if factory:
        raise UninitialisedError(
            f"{name} is allocated but never initialised by the model factory (module "
            f"{owner_name or 'root'} of class {type(owner).__name__}, tensor {attr!r}); fill it in "
            f"{type(owner).__name__}.__init__ (e.g. nn.init.normal_) or its reset_parameters()"
            + (f"; {len(missing) - 1} more like it" if len(missing) > 1 else ""))
    raise UninitialisedError(
        f"the meta model's {name} has no initial values: module {owner_name or 'root'} "
        f"({type(owner).__name__}) has no reset_parameters() that sets {attr!r}. Add "
        f"`def reset_parameters(self)` to {type(owner).__name__} filling {attr!r} as its __init__ does, "
        "or pass parallelize a zero-argument factory (e.g. `lambda: MyModel(config)`) so the kit "
        "replays the constructor itself"
        + (f"; {len(missing) - 1} more like it: {', '.join(missing[1:4])}" if len(missing) > 1 else ""))


def _refuse_plain_tensor_attributes(model: nn.Module) -> None:
    """A tensor kept as a plain attribute has no state name to fill it by, and `to_empty` would
    leave it on meta, to fail at the first forward."""
    for name, module in model.named_modules():
        for attr, value in vars(module).items():
            if isinstance(value, torch.Tensor) and value.is_meta:
                where = f"{name}.{attr}" if name else attr
                raise UninitialisedError(
                    f"{where} is a tensor {type(module).__name__} keeps as a plain attribute (not a "
                    "parameter or buffer), so shard-first initialisation cannot fill it; register it "
                    "with self.register_buffer(name, tensor, persistent=False), or build the model "
                    "normally (not on meta, not from a factory)")
