"""The units of an FSDP2-sharded model, read one at a time: what the rollout's replicas (`parallel.py`,
`tensor_parallel.py`) sync from. A unit (a decoder layer, or the root for what lies outside them) all-gathers its own
parameters in one collective; reading a sharded model unit by unit costs one all-gather per layer instead of one per
weight, and holds one layer whole at a time."""

from __future__ import annotations

from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Callable, Iterable, Iterator, Sequence

import torch
from torch import nn

# A context in which a sync may read the given parameter shards (`ParkedState.lend`: parked ones are brought back
# for the block); `no_lend`: they are on the device already
Lend = Callable[[Iterable[torch.Tensor]], AbstractContextManager]


def no_lend(tensors: Iterable[torch.Tensor]) -> AbstractContextManager:
    return nullcontext()


def by_unit(sharded: nn.Module, names: Sequence[str], base: nn.Module | None = None) -> list[tuple[nn.Module | None,
                                                                                           list[str]]]:
    """`names` (qualified in `base`, a module inside `sharded`; default `sharded` itself) grouped by the FSDP2 unit
    that all-gathers them, the deepest unit above each: every decoder layer's in module order, then the root's
    (`sharded`) last; one group under None where `sharded` is not sharded."""
    from torch.distributed.fsdp import FSDPModule

    if not isinstance(sharded, FSDPModule):
        return [(None, list(names))]
    base = sharded if base is None else base
    units = {n: m for n, m in base.named_modules() if isinstance(m, FSDPModule) and m is not sharded}
    groups: dict[str, list[str]] = {k: [] for k in units}
    root: list[str] = []
    for name in names:
        owner = max((k for k in units if name.startswith(f"{k}.")), key=len, default=None)
        (groups[owner] if owner is not None else root).append(name)
    return [(units[k], v) for k, v in groups.items() if v] + ([(sharded, root)] if root else [])


def own_parameters(unit: nn.Module) -> list[torch.Tensor]:
    """The parameters an FSDP2 unit all-gathers: its module's, less those of the units nested in it."""
    from torch.distributed.fsdp import FSDPModule

    nested = {id(p) for m in unit.modules() if m is not unit and isinstance(m, FSDPModule) for p in m.parameters()}
    return [p for p in unit.parameters() if id(p) not in nested]


@contextmanager
def gathered(unit: nn.Module | None, lend: Lend = no_lend) -> Iterator[None]:
    """Inside: FSDP2 unit `unit`'s own parameters whole on every rank from one all-gather (a collective), their
    shards read within `lend` (parked ones lent back for this unit alone); resharded after. None: nothing."""
    if unit is None:
        yield
        return
    with lend(own_parameters(unit)):
        unit.unshard()
        try:
            yield
        finally:
            unit.reshard()
