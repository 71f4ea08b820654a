"""A float [K, N] weight stored in column panels for the CPU kernel: w[k, n] at panels[n // P, k, n % P], P =
PANEL_COLUMNS, the last panel zero-padded past N (cpu_matmul_panels.h says why: one row of x reads G panels as G
long runs side by side, which the hardware prefetchers follow where a [K, N] weight's column strips lose 10-17%).

A weight type of its own, as QuantizedWeight is: a Linear's kernel param holds ColumnPanels in place of its
array, the CPU kernel's entry serves it (cpu.py) and XLA's dots contract its panels where they lie (reference.py).
`matrix()` gives the [K, N] array back (checkpoints, adapters' shapes).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

PANEL_COLUMNS = 16  # cpu_matmul_panels.h's kPanelColumns


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ColumnPanels:
    """A [K, N] weight as [ceil(N / P), K, P] panels."""

    panels: jax.Array | np.ndarray  # [ceil(N / P), K, P], the weight's dtype
    columns: int = dataclasses.field(metadata=dict(static=True), default=0)  # N

    def __getitem__(self, index):
        """`param[...]` (how modules read a param's value) is the weight itself."""
        if index is not Ellipsis:
            raise TypeError("a ColumnPanels weight is read whole (param[...]), not indexed")
        return self

    @property
    def shape(self) -> tuple[int, int]:
        """The logical [K, N] shape, as the weight it stands for."""
        return (self.panels.shape[1], self.columns)

    @property
    def dtype(self):
        return self.panels.dtype

    @property
    def ndim(self) -> int:
        return 2

    @property
    def nbytes(self) -> int:
        return int(self.panels.nbytes)

    def matrix(self):
        """The [K, N] weight."""
        count, depth, width = self.panels.shape
        return self.panels.transpose(1, 0, 2).reshape(depth, count * width)[:, : self.columns]


def to_panels(weight) -> ColumnPanels:
    """A [K, N] array (numpy or jax) as ColumnPanels, on the same device."""
    depth, columns = weight.shape
    count = -(-columns // PANEL_COLUMNS)
    padded = jnp.pad(weight, ((0, 0), (0, count * PANEL_COLUMNS - columns))) if columns % PANEL_COLUMNS else weight
    panels = jnp.asarray(padded).reshape(depth, count, PANEL_COLUMNS).transpose(1, 0, 2)
    return ColumnPanels(panels, columns)


def is_panels(weight) -> bool:
    return isinstance(weight, ColumnPanels)


def matmul(rows, weight: ColumnPanels):
    """rows [M, K] @ the weight -> float32 [M, N] by XLA's dot over the panels as they lie (the reference's)."""
    num_rows = rows.shape[0]
    y = jax.lax.dot_general(rows, weight.panels, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    return y.reshape(num_rows, weight.panels.shape[0] * PANEL_COLUMNS)[:, : weight.columns]
