"""Every C++ source and header the CPU kernels are built from at first use (pallas_kernels/cpu_library.py) is in
the package data, so that an installed wheel (not only a checkout) builds them: a missing one would leave every
CPU kernel unbuilt and the engine on the jax.numpy references."""

import fnmatch
import os
import tomllib

from pallas_kernels import cpu_library

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_every_kernel_source_is_package_data():
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        package_data = tomllib.load(f)["tool"]["setuptools"]["package-data"]
    for path in cpu_library.SOURCES + cpu_library.HEADERS:
        relative = os.path.relpath(path, ROOT)
        package, name = os.path.dirname(relative).replace(os.sep, "."), os.path.basename(relative)
        patterns = package_data.get(package, [])
        assert any(fnmatch.fnmatch(name, pattern) for pattern in patterns), f"{relative} is not in package-data"
