"""Probes of a Model's KV cache for the tests: a cell's position and the layers it holds valid K/V for, the cells the
last batch was given, removing cells. The runtime's internals (specee_kv_* in csrc/include/specee.h, the bindings'
Context), read here rather than carried by the public Model."""

from __future__ import annotations

from typing import Sequence

import numpy as np

import specee


def kv_cell_pos(model: specee.Model, cell: int) -> int:
    """The position a cell holds, -1 for a free cell."""
    return model._ctx.kv_cell_pos(cell)


def kv_cell_valid(model: specee.Model, cell: int, layer: int) -> bool:
    """Whether the cell holds real K/V in that layer (an early exit's skipped layers do not)."""
    return model._ctx.kv_cell_valid(cell, layer)


def kv_batch_cells(model: specee.Model) -> np.ndarray:
    """The KV cells given to the tokens of the last batch."""
    return model._ctx.kv_batch_cells()


def kv_remove_cells(model: specee.Model, cells: Sequence[int] | np.ndarray) -> int:
    """Drops those cells; returns how many were removed."""
    return model._ctx.kv_remove_cells(np.ascontiguousarray(cells, dtype=np.int32).reshape(-1))
