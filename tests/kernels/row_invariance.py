"""Issue 26's rule for the CPU matmul kernels (session 16): greedy outputs are identical with speculative decoding
on and off only if a verify step, which runs a sequence's k + 1 tokens (S sequences: up to 64 rows) where a
decode step ran one, computes each row's result bit for bit as a one-row call does. With int8 activations a
1e-6 difference in the order K is summed flips a rounding and then a greedy near-tie, so 'close' is not
enough: np.array_equal, for row 0 and a middle row of calls of every decode and verify size."""

from collections.abc import Callable, Sequence

import numpy as np

# Calls of these rows against one-row calls: 1-2 rows (sums in registers), 3-8 (one row group), 9 (a group and
# one row), 16, 40 and 64 (verify steps: several row groups, the largest decode bucket).
ROW_COUNTS = (2, 3, 5, 8, 9, 16, 40, 64)


def assert_rows_as_alone(call: Callable[[np.ndarray], Sequence], label: str, row_counts=ROW_COUNTS) -> None:
    """`call(indices)` runs the kernel on the rows `indices` of its inputs (int array, in order) and returns its
    results [len(indices), N_i]. For each M in row_counts, rows 0 and M // 2 of the call of rows 0 .. M - 1 must
    be the bits of the one-row call of that row. Every difference is listed (columns differing per weight)."""
    alone: dict[int, list[np.ndarray]] = {}
    failures = []
    for num_rows in row_counts:
        together = [np.asarray(result) for result in call(np.arange(num_rows))]
        for row in sorted({0, num_rows // 2}):
            if row not in alone:
                alone[row] = [np.asarray(result)[0] for result in call(np.array([row]))]
            for i, (got, want) in enumerate(zip(together, alone[row], strict=True)):
                differ = int(np.sum(got[row] != want))
                if differ:
                    failures.append(f"{label}, {num_rows} rows, row {row}, result {i}: {differ} of {want.size} differ")
    assert not failures, "\n".join(failures)
