"""The type of an array that crosses between host and device.

Step inputs are built as numpy arrays on the host and become jax.Arrays when the runner places them;
sampled results are jax.Arrays until fetched, numpy after. The pytree dataclasses that carry them
(AttentionMetadata, StepInputs, SamplingInputs, SamplerOutput) hold either.
"""

from __future__ import annotations

from typing import TypeAlias

import jax
import numpy as np

HostOrDeviceArray: TypeAlias = jax.Array | np.ndarray
