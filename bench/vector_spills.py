"""Innermost loops of the CPU kernels' library that move vector registers through the stack (x86 only).

Session 49 found the small matmul's [N, K] walks at 6 and 8 rows running at half their speed: GCC left a loop over
the accumulator array un-unrolled, so the array lived in memory and every step along K stored all 24 accumulators
(cpu_matmul_few_rows.h NkStreamRows). Nothing in the results shows it (the bits are the same), only the time, and
only at some template arguments. This lists, per function of the built library (objdump), the innermost loop with
the most vector stores to / loads from %rsp or %rbp among those doing multiply-adds, most first. Some are by design
(16 AVX2 registers cannot hold a tile's results: cpu_int8_dot_tiles.h TiledJ); a loop with as many stores as
multiply-adds is the pattern above.

    .venv/bin/python bench/vector_spills.py [--path avx512|avx2|portable] [--top 40] [--filter NAME]
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

MULTIPLY_ADD = re.compile(r"^(vfn?madd\w*|vdpbf16ps|vpdpbusds?|vpdpwssds?|vpmaddwd|vpmaddubsw)\s")
STACK_STORE = re.compile(r"^vmov\w*\s+%[xyz]mm\d+,-?(0x[0-9a-f]+)?\((%rsp|%rbp)")
STACK_LOAD = re.compile(r"^\w+\s+-?(0x[0-9a-f]+)?\((%rsp|%rbp)[^)]*\),%[xyz]mm")
FUNCTION = re.compile(r"^([0-9a-f]+) <(.*)>:$")
INSTRUCTION = re.compile(r"^\s+([0-9a-f]+):\s+(.*)$")
JUMP = re.compile(r"^j\w+\s+([0-9a-f]+)\s")


def functions(library: str) -> dict[str, list[tuple[int, str]]]:
    listing = subprocess.run(
        ["objdump", "-d", "--no-show-raw-insn", "-C", library], capture_output=True, text=True, check=True
    ).stdout
    found: dict[str, list[tuple[int, str]]] = {}
    current = None
    for line in listing.splitlines():
        if match := FUNCTION.match(line):
            current = found.setdefault(match.group(2), [])
        elif (match := INSTRUCTION.match(line)) and current is not None:
            current.append((int(match.group(1), 16), match.group(2)))
    return found


def worst_loop(instructions: list[tuple[int, str]]) -> tuple[int, int, int] | None:
    """(multiply-adds, stack stores, stack loads) of the innermost loop (a backward jump's range holding no other)
    with multiply-adds and the most stack traffic."""
    if not instructions:
        return None
    start = instructions[0][0]
    loops = [
        (int(m.group(1), 16), at)
        for at, text in instructions
        if (m := JUMP.match(text)) and start <= int(m.group(1), 16) < at
    ]
    worst = None
    for low, high in loops:
        if any(
            low <= other_low and other_high <= high and (other_low, other_high) != (low, high)
            for other_low, other_high in loops
        ):
            continue
        body = [text for at, text in instructions if low <= at <= high]
        counts = (
            sum(bool(MULTIPLY_ADD.match(t)) for t in body),
            sum(bool(STACK_STORE.match(t)) for t in body),
            sum(bool(STACK_LOAD.match(t)) for t in body),
        )
        if counts[0] >= 4 and counts[1] + counts[2] >= 2 and (worst is None or sum(counts[1:]) > sum(worst[1:])):
            worst = counts
    return worst


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--path", default=None, help="the kernel path's library (default: this CPU's)")
    parser.add_argument("--top", type=int, default=40)
    parser.add_argument("--filter", default="", help="only functions whose name contains this")
    args = parser.parse_args()
    from pallas_kernels import cpu_library

    library = cpu_library.load(args.path)
    if library is None:
        raise SystemExit("no CPU kernel library for this path")
    rows = []
    for name, instructions in functions(library._name).items():
        if args.filter in name and (counts := worst_loop(instructions)):
            rows.append((counts, name))
    rows.sort(key=lambda row: -(row[0][1] + row[0][2]))
    print(f"{library._name}: {len(rows)} functions with vector stack traffic in an innermost multiply-add loop")
    for (multiply_adds, stores, loads), name in rows[: args.top]:
        print(f"multiply-adds {multiply_adds:4d}  stores {stores:4d}  loads {loads:4d}  {name[:160]}")


if __name__ == "__main__":
    main()
