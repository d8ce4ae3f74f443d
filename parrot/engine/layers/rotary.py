"""Rotary position embedding (RoPE) with a precomputed table, in the *interleaved* (GGUF / Meta) layout.

Layout: within a head, dims (2i, 2i+1) form the i-th rotating pair, as in the original LLaMA and in GGUF files
(llama.cpp permutes HF's half-split Q/K rows into this order). The GGUF loader keeps that order and the
safetensors loader permutes HF weights into it. Attention is invariant to a permutation of head dims applied to
both q and k, so the KV cache simply stores keys in this layout. Rotating a pair is one complex multiply:

    (x_2i + j x_2i+1) * (cos(p w_i) + j sin(p w_i)) * mscale

Scaling variants (see parrot.engine.files.config): linear (p / factor), llama3 (frequency smoothing), yarn (ramped
interpolation + attention factor ``mscale``), freq_factors (llama.cpp ``rope_freqs``: w_i / f_i), longrope
(Phi-3: w_i / short_i below ``original_max_position_embeddings``, w_i / long_i from there, times ``mscale``). The
longrope table is per position (the KV cache never needs re-rotating); transformers instead switches a whole
forward to the long factors once its longest position passes the original length, so the two agree while a
sequence stays within that length, and past it only on the positions beyond it.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from parrot.engine.files.config import ModelConfig, validate_rope_scaling


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> tuple[Tensor, float]:
    """Inverse frequencies w_i (float64 [head_dim/2]) and the cos/sin multiplier for ``scaling``."""
    validate_rope_scaling(scaling)
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if scaling is None:
        return inv_freq, 1.0
    kind = scaling["type"]
    if kind == "linear":
        return inv_freq / float(scaling["factor"]), 1.0
    if kind == "freq_factors":
        factors = torch.tensor(scaling["factors"], dtype=torch.float64)
        if factors.numel() != inv_freq.numel():
            raise ValueError(f"rope freq_factors has {factors.numel()} entries, expected {inv_freq.numel()}")
        return inv_freq / factors, 1.0
    if kind == "llama3":
        return _llama3_inv_freq(inv_freq, scaling), 1.0
    if kind == "yarn":
        return _yarn_inv_freq(inv_freq, head_dim, theta, scaling)
    if kind == "longrope":  # the short factors; RotaryEmbedding switches to the long ones past the original length
        return inv_freq / _factors(scaling["short_factor"], inv_freq), float(scaling["attention_factor"])
    raise ValueError(f"unsupported rope scaling type {kind!r}")


def _factors(values, inv_freq: Tensor) -> Tensor:
    factors = torch.tensor(values, dtype=torch.float64)
    if factors.numel() != inv_freq.numel():
        raise ValueError(f"rope factors have {factors.numel()} entries, expected {inv_freq.numel()}")
    return factors


def _llama3_inv_freq(inv_freq: Tensor, s: dict) -> Tensor:
    factor, low, high = float(s["factor"]), float(s["low_freq_factor"]), float(s["high_freq_factor"])
    old_len = float(s["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    # long wavelengths are divided by factor, short ones kept, the band between interpolated smoothly
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, smoothed, scaled)


def _yarn_inv_freq(inv_freq: Tensor, dim: int, base: float, s: dict) -> tuple[Tensor, float]:
    factor = float(s["factor"])
    orig = float(s["original_max_position_embeddings"])
    beta_fast, beta_slow = float(s.get("beta_fast") or 32), float(s.get("beta_slow") or 1)
    attention_factor = s.get("attention_factor")
    if attention_factor is None:
        def mscale(scale: float, m: float = 1.0) -> float:
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0
        m, m_all = s.get("mscale"), s.get("mscale_all_dim")
        attention_factor = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(orig / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp  # 1: keep the original frequency, 0: interpolate (divide by factor)
    inv = (inv_freq / factor) * (1 - extrapolation) + inv_freq * extrapolation
    return inv, float(attention_factor)


INITIAL_POSITIONS = 8192


class RotaryEmbedding(nn.Module):
    """Holds ``freqs_cis`` (complex64 [positions, head_dim/2]) for the positions seen so far: it starts at
    INITIAL_POSITIONS and doubles (up to max_position_embeddings) when a longer context asks for more, so a model
    with a 128k-position window does not build and keep rows no request reaches. Rotate q and k
    together in one call."""

    def __init__(self, config: ModelConfig, device: torch.device | str = "cpu", *, local: bool = False) -> None:
        """``local``: the table of sliding-window layers in families that rotate them with their own base
        (``config.local_rope_theta``, unscaled: Gemma-3); else ``rope_theta`` with ``rope_scaling``."""
        super().__init__()
        self.head_dim = config.head_dim
        if local and config.local_rope_theta is None:
            raise ValueError(f"{config.arch} has no local RoPE base (local_rope_theta)")
        theta, self._scaling = (config.local_rope_theta, None) if local else (config.rope_theta, config.rope_scaling)
        self._inv_freq, self._mscale = rope_inv_freq(config.head_dim, theta, self._scaling)
        self.max_positions = config.max_position_embeddings
        self.register_buffer("freqs_cis", self._rows(0, min(INITIAL_POSITIONS, self.max_positions)).to(device),
                             persistent=False)

    def _rows(self, start: int, end: int) -> Tensor:
        pos = torch.arange(start, end, dtype=torch.float64)
        angles = torch.outer(pos, self._inv_freq)  # float64 so large positions keep their phase accurately
        scaling = self._scaling
        if scaling is not None and scaling["type"] == "longrope":
            base = self._inv_freq * _factors(scaling["short_factor"], self._inv_freq)
            orig = int(scaling["original_max_position_embeddings"])
            long = pos >= orig
            angles[long] = torch.outer(pos[long], base / _factors(scaling["long_factor"], base))
        return torch.polar(torch.full_like(angles, self._mscale), angles).to(torch.complex64)

    def table(self, positions: Tensor) -> Tensor:
        """Per-token rotations for ``positions`` [T] -> complex [T, 1, head_dim/2] (broadcast over heads).
        Positions must be < max_position_embeddings (the engine enforces the context length)."""
        have = self.freqs_cis.shape[0]
        if positions.numel() and have < self.max_positions and int(positions.max()) >= have:
            need = min(self.max_positions, max(2 * have, int(positions.max()) + 1))
            self.freqs_cis = torch.cat([self.freqs_cis, self._rows(have, need).to(self.freqs_cis.device)])
        return self.freqs_cis.index_select(0, positions).unsqueeze(1)

    @staticmethod
    def apply(x: Tensor, rot: Tensor) -> Tensor:
        """Rotate ``x`` [T, heads, head_dim] (last dim contiguous, any row stride) -> new contiguous tensor in
        x's dtype. Complex math runs in float32 (bf16 inputs are upcast once)."""
        t, h, d = x.shape
        xc = torch.view_as_complex(x.float().view(t, h, d // 2, 2))
        return torch.view_as_real(xc * rot).view(t, h, d).to(x.dtype)
