"""KIVI asymmetric low-bit quantization (keys per channel, values per token) and bit packing.

A group shares one (scale, zero): code = clamp(round((x − zero) / scale), 0, 2^b − 1), x̂ = code·scale + zero.
For b ≥ 2, zero = min and scale = (max − min)/(2^b − 1). SpeCache's 1-bit variant reconstructs the quarter
points instead: zero = (3·min + max)/4, scale = (max − min)/2 — there (x − zero)/scale reaches 1.5 at the
maximum, which rounds to 2: the clamp is what keeps it a 1-bit code.
"""
from __future__ import annotations

import torch

EPS = 1e-6        # a constant group has max = min: its scale would be 0 (0/0 codes)


def quantize(x: torch.Tensor, bits: int, dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One (scale, zero) per slice of ``x`` along ``dim`` (kept as a size-1 dim) → (uint8 codes, scale, zero).

    scale and zero are stored in ``x``'s dtype; the codes are computed against the stored values, so the
    error bounds hold for what is dequantized."""
    lo, hi = x.amin(dim, keepdim=True).float(), x.amax(dim, keepdim=True).float()
    if bits == 1:
        zero, scale = (3 * lo + hi) / 4, (hi - lo) / 2
    else:
        zero, scale = lo, (hi - lo) / (2 ** bits - 1)
    scale, zero = scale.clamp_min(EPS).to(x.dtype), zero.to(x.dtype)
    codes = ((x.float() - zero.float()) / scale.float()).round_().clamp_(0, 2 ** bits - 1).to(torch.uint8)
    return codes, scale, zero


def dequantize(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (codes.float() * scale.float() + zero.float()).to(dtype)


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 codes < 2^bits [..., n] → [..., n·bits/8] bytes, code j of a byte in bits [j·b, (j+1)·b)."""
    per = 8 // bits
    if codes.shape[-1] % per:
        raise ValueError(f"the last dim ({codes.shape[-1]}) must be a multiple of {per} to pack {bits}-bit codes")
    c = codes.reshape(*codes.shape[:-1], -1, per)
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=codes.device)
    return (c << shifts).sum(-1, dtype=torch.uint8)


def unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=packed.device)
    codes = (packed[..., None] >> shifts) & (2 ** bits - 1)
    return codes.reshape(*packed.shape[:-1], -1)
