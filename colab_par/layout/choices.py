"""The layouts the rules accept, enumerated: what the planner searches and the picker offers.

Neither knows a rule: `valid_layouts` chooses one field at a time (in `FIELDS` order) and runs each
rule as soon as the fields it reads are chosen, so the search stays fast on thousands of ranks.
"""
from __future__ import annotations

from types import SimpleNamespace
from typing import Any, Callable, Iterable, Iterator, Union

from colab_par.layout.rules import RULES, Rule, rule_sizes
from colab_par.layout.terms import DEGREES, FIELDS, NAMED_VALUES, LayoutError, default_microbatches, divisors
from colab_par.layout.tier_options import MemoryTiers
from colab_par.layout.value import Layout, check_domain

# a field's candidate values, or a function of the fields chosen before it to them
Choices = Union[Iterable[Any], Callable[[Any], Iterable[Any]]]


def _default_choices(world: int, sizes: dict[str, int]) -> dict[str, Choices]:
    """Every value of every field, bounded by the world and the model / batch where a field has no
    bound of its own: virtual stages divide the layers (1 or 2 without a model), microbatch counts
    divide the global batch (only the default count without a batch)."""
    layers, batch = sizes.get("n_layer"), sizes.get("global_batch")
    # ep only where asked for (ep=(1, 2)): the planner asks in its search space
    return {**{name: divisors(world) for name in DEGREES}, **NAMED_VALUES, "ep": (1,),
            "offload": (False, True), "sequence_parallel": (False, True), "compile": (False, True),
            "tiers": (MemoryTiers(),),
            "tp_depth": [d for d in divisors(world) if d < world],
            "virtual_stages": divisors(layers) if layers else (1, 2),
            "microbatches": (None, *divisors(batch)) if batch else (None,)}


def valid_layouts(world_size: int, model_config: Any = None, *, device: Any = None,
                  global_batch: int | None = None, **choices: Choices) -> Iterator[Layout]:
    """Every Layout over `world_size` ranks that `validate` accepts, each once.

    `choices` narrow a field to some values, e.g. ``zero=(2, 3)``, or to a function of the fields
    chosen before it in `FIELDS` (``microbatches=lambda l: (l.pp, 2 * l.pp)``); None stands for
    the default microbatch count. Each rule runs as soon as the fields it reads are chosen, so the
    search stays fast on thousands of ranks.
    """
    if world_size is None:
        raise LayoutError("valid_layouts needs world_size, e.g. valid_layouts(8)")
    sizes = rule_sizes(world_size, model_config, global_batch)
    unknown = set(choices) - set(FIELDS)
    if unknown:
        raise LayoutError(f"unknown layout field(s) {', '.join(sorted(unknown))}; choose from "
                          f"{', '.join(FIELDS)}")
    grid = {**_default_choices(world_size, sizes), **choices}
    position = {name: i for i, name in enumerate(FIELDS)}
    due: dict[str, list[Rule]] = {name: [] for name in FIELDS}
    for fields, rule in RULES:
        due[max(fields, key=position.__getitem__)].append(rule)

    def search(depth: int, chosen: dict[str, Any]) -> Iterator[Layout]:
        if depth == len(FIELDS):
            yield Layout(**chosen)
            return
        name = FIELDS[depth]
        partial = SimpleNamespace(**chosen)
        options = grid[name](partial) if callable(grid[name]) else grid[name]
        if name == "microbatches":  # resolve the default count once, then drop repeats
            options = dict.fromkeys(default_microbatches(chosen["pp"])
                                    if m is None else m for m in options)
        for value in options:
            check_domain(name, value)
            step = SimpleNamespace(**chosen, **{name: value})
            try:
                for rule in due[name]:
                    rule(step, world_size, sizes, device)
            except LayoutError:
                continue
            yield from search(depth + 1, {**chosen, name: value})

    return search(0, {})


def field_options(world_size: int, model_config: Any = None, *, device: Any = None,
                  global_batch: int | None = None, **choices: Iterable[Any]) -> dict[str, list[Any]]:
    """For each field, the values that appear in at least one valid layout (a picker's options);
    `choices` set a field's candidate values as in `valid_layouts` (e.g. ``ep=(1, 2, 4)``)."""
    grid = {**_default_choices(world_size, rule_sizes(world_size, model_config, global_batch)), **choices}
    options: dict[str, list[Any]] = {}
    for name in FIELDS:
        options[name] = [value for value in grid[name] if value is not None and next(valid_layouts(
            world_size, model_config, device=device, global_batch=global_batch,
            **{**choices, name: (value,)}), None) is not None]
    return options

