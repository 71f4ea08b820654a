"""Llama 3.1-style rotary scaling from a GGUF file's `rope_freqs` tensor.

llama.cpp's converter does not store Llama 3's rope_scaling (factor, low/high_freq_factor,
original_max_position_embeddings); it stores what they compute: one divisor per rotary frequency
(1 for high frequencies, `factor` for low ones, a smooth blend between). The blend is linear in
1 / wavelength, so the parameters can be read back from the divisors, up to choices that change no
divisor; candidates are recomputed and kept only when they reproduce the tensor.
"""

from __future__ import annotations

import math

import numpy as np

RTOL = 1e-5


def llama3_rope_scaling(rope_freqs: np.ndarray, rope_theta: float, head_dim: int) -> dict | None:
    """Hugging Face's rope_scaling dict that reproduces rope_freqs (None: no scaling at all).
    Raises ValueError when no Llama 3 scaling does."""
    divisors = np.asarray(rope_freqs, np.float64).reshape(-1)
    wavelengths = 2 * math.pi * rope_theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    if len(divisors) != len(wavelengths):
        raise ValueError(f"rope_freqs has {len(divisors)} entries, the rotary dimension needs {len(wavelengths)}")
    factor = float(divisors.max())
    if np.allclose(divisors, 1.0, rtol=RTOL):
        return None
    for candidate in _candidates(divisors, wavelengths, factor):
        if np.allclose(llama3_divisors(candidate, wavelengths), divisors, rtol=RTOL):
            return candidate
    raise ValueError(
        "rope_freqs matches no Llama 3 rotary scaling (factor, low/high frequency factors, original context length)"
    )


def llama3_divisors(scaling: dict, wavelengths: np.ndarray) -> np.ndarray:
    """convert_hf_to_gguf.py's rope factors for a Llama 3 rope_scaling."""
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    context = scaling["original_max_position_embeddings"]
    smooth = (context / wavelengths - low) / (high - low)
    blended = 1 / ((1 - smooth) / factor + smooth)
    return np.where(wavelengths < context / high, 1.0, np.where(wavelengths > context / low, factor, blended))


def _scaling(factor: float, low: float, high: float, context: float) -> dict:
    return dict(
        rope_type="llama3",
        factor=factor,
        low_freq_factor=low,
        high_freq_factor=high,
        original_max_position_embeddings=int(round(context)),
    )


def _candidates(divisors: np.ndarray, wavelengths: np.ndarray, factor: float):
    # smooth = context / wavelength / (high - low) - low / (high - low) on the blended frequencies
    blended = (divisors > 1 + RTOL) & (divisors < factor * (1 - RTOL))
    smooth = (1 / divisors[blended] - 1 / factor) / (1 - 1 / factor)
    inverse = 1 / wavelengths[blended]
    if blended.sum() >= 2:  # the line through the blended points; low_freq_factor 1 fixes the rest
        slope, intercept = np.polyfit(inverse, smooth, 1)
        if slope > 0 and intercept < 0:
            span = -1 / intercept
            yield _scaling(factor, 1.0, 1.0 + span, slope * span)
    # Llama 3's own low_freq_factor 1 and high_freq_factor 4, with the context length from one blended
    # point, or any length between the last unscaled and the first fully scaled wavelength.
    if blended.any():
        yield _scaling(factor, 1.0, 4.0, wavelengths[blended][0] * (3 * smooth[0] + 1))
    else:
        unscaled, scaled = wavelengths[divisors <= 1 + RTOL], wavelengths[divisors >= factor * (1 - RTOL)]
        if len(unscaled) and len(scaled):
            yield _scaling(factor, 1.0, 4.0, math.floor(scaled.min()))
