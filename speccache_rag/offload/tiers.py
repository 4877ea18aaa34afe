"""One layer's KV in two tiers, behind one counted ``fetch``.

host: the full-precision K (after RoPE) and V — pinned CPU memory when the model runs on CUDA, plain RAM
on CPU. resident: the KIVI copy (keys per channel in blocks of ``group`` tokens, values per token in groups
of ``group`` channels, packed), the newest tokens at full precision (keys until a block of ``residual``
fills, values the last ``residual``), and a fetch buffer of ``topk`` full-precision rows per KV head.
On CPU both tiers are RAM: what this measures is bytes, not time.
"""
from __future__ import annotations

from concurrent.futures import Future

import torch

from ..config import OffloadConfig
from .kivi import dequantize, pack, quantize, unpack


class LayerTiers:
    def __init__(self, k: torch.Tensor, v: torch.Tensor, cfg: OffloadConfig, capacity: int, length: int | None = None):
        """k, v: [kv_heads, n, head_dim], the prefilled cache; room for ``capacity`` tokens in all. With
        ``length``, k and v are buffers of at least ``capacity`` rows of which the first ``length`` are
        filled: on CPU they become the host tier as they are (no copy)."""
        if length is not None:
            if k.shape[1] < capacity:
                raise ValueError(f"buffers of {k.shape[1]} rows cannot hold capacity {capacity}")
            buffers, k, v = (k, v), k[:, :length], v[:, :length]
        kvh, n, d = k.shape
        per_byte = 8 // cfg.bits
        self.vgroup = min(cfg.group, d)       # a head narrower than a group is one value group
        if d % self.vgroup or d % per_byte:
            raise ValueError(f"head_dim {d} must be a multiple of the value group ({self.vgroup}) and of {per_byte}")
        if capacity < n:
            raise ValueError(f"capacity {capacity} < {n} prefilled tokens")
        self.cfg, self.dtype, self.device = cfg, k.dtype, k.device
        self.kvh, self.d = kvh, d
        if length is not None and k.device.type == "cpu":
            self.host_k, self.host_v = buffers
        else:
            pin = k.device.type == "cuda"
            self.host_k = torch.empty((kvh, capacity, d), dtype=k.dtype, pin_memory=pin)
            self.host_v = torch.empty((kvh, capacity, d), dtype=k.dtype, pin_memory=pin)
            self.host_k[:, :n], self.host_v[:, :n] = k.to("cpu"), v.to("cpu")
        alloc = dict(dtype=k.dtype, device=k.device)
        self.kc = torch.empty((kvh, capacity, d // per_byte), dtype=torch.uint8, device=k.device)
        self.vc = torch.empty_like(self.kc)
        self.ks = torch.empty((kvh, capacity // cfg.group, d), **alloc)
        self.kz = torch.empty_like(self.ks)
        self.vs = torch.empty((kvh, capacity, d // self.vgroup), **alloc)
        self.vz = torch.empty_like(self.vs)
        self.kr = torch.empty((kvh, cfg.residual, d), **alloc)
        self.vr = torch.empty_like(self.kr)
        self.fk = torch.empty((kvh, min(cfg.topk, capacity), d), **alloc)
        self.fv = torch.empty_like(self.fk)
        self.fetched = torch.empty((kvh, 0), dtype=torch.long, device=k.device)
        self.fetched_bytes = 0
        self._pending: Future | None = None
        self._stream = self._copied = None    # CUDA: the side stream of the copies, and the last one's event
        self.n = self.nk = self.nv = 0        # tokens held; of which keys, values at low precision
        self._prefill(k, v)

    # ---- quantization layouts ------------------------------------------------------------------
    def _quantize_keys(self, k: torch.Tensor, start: int) -> None:
        """k [kvh, T, d] (T a multiple of group) → codes at token ``start``, one scale per channel per block."""
        g, t = self.cfg.group, k.shape[1]
        codes, scale, zero = quantize(k.reshape(self.kvh, t // g, g, self.d), self.cfg.bits, dim=2)
        self.kc[:, start:start + t] = pack(codes.reshape(self.kvh, t, self.d), self.cfg.bits)
        self.ks[:, start // g:(start + t) // g] = scale[:, :, 0]
        self.kz[:, start // g:(start + t) // g] = zero[:, :, 0]

    def _quantize_values(self, v: torch.Tensor, start: int) -> None:
        t, gv = v.shape[1], self.vgroup
        codes, scale, zero = quantize(v.reshape(self.kvh, t, self.d // gv, gv), self.cfg.bits, dim=3)
        self.vc[:, start:start + t] = pack(codes.reshape(self.kvh, t, self.d), self.cfg.bits)
        self.vs[:, start:start + t] = scale[..., 0]
        self.vz[:, start:start + t] = zero[..., 0]

    def _prefill(self, k: torch.Tensor, v: torch.Tensor) -> None:
        n, r = k.shape[1], self.cfg.residual
        self.nk, self.nv, self.n = n // r * r, max(0, n - r), n
        if self.nk:
            self._quantize_keys(k[:, :self.nk], 0)
        if self.nv:
            self._quantize_values(v[:, :self.nv], 0)
        self.kr[:, :n - self.nk] = k[:, self.nk:]
        self.vr[:, :n - self.nv] = v[:, self.nv:]

    def append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """One token's k, v [kvh, d]: host, and the full-precision windows (which quantize as they fill)."""
        n, r = self.n, self.cfg.residual
        if n >= self.host_k.shape[1]:
            raise ValueError(f"the offloaded cache is full ({n} tokens)")
        self.host_k[:, n], self.host_v[:, n] = k.to("cpu"), v.to("cpu")
        self.kr[:, n - self.nk] = k
        if n + 1 - self.nk == r:              # a full block of keys: quantize it per channel
            self._quantize_keys(self.kr, self.nk)
            self.nk += r
        if n - self.nv == r:                  # the value window is full: its oldest token leaves it
            self._quantize_values(self.vr[:, :1], self.nv)
            self.nv += 1
            self.vr[:, :-1] = self.vr[:, 1:].clone()
        self.vr[:, n - self.nv] = v
        self.n = n + 1

    # ---- reads ---------------------------------------------------------------------------------
    def dequantized(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The low-bit cache with the full-precision windows: K, V [kvh, n, d]."""
        g, gv, nk, nv, n = self.cfg.group, self.vgroup, self.nk, self.nv, self.n
        k = torch.empty((self.kvh, n, self.d), dtype=self.dtype, device=self.device)
        v = torch.empty_like(k)
        if nk:
            codes = unpack(self.kc[:, :nk], self.cfg.bits).reshape(self.kvh, nk // g, g, self.d)
            k[:, :nk] = dequantize(codes, self.ks[:, :nk // g, None], self.kz[:, :nk // g, None],
                                   self.dtype).reshape(self.kvh, nk, self.d)
        if nv:
            codes = unpack(self.vc[:, :nv], self.cfg.bits).reshape(self.kvh, nv, self.d // gv, gv)
            v[:, :nv] = dequantize(codes, self.vs[:, :nv, :, None], self.vz[:, :nv, :, None],
                                   self.dtype).reshape(self.kvh, nv, self.d)
        k[:, nk:] = self.kr[:, :n - nk]
        v[:, nv:] = self.vr[:, :n - nv]
        return k, v

    def mixed(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The dequantized cache with the rows fetched last step overwritten by their full-precision copies."""
        k, v = self.dequantized()
        self.wait()
        if self.fetched.shape[1]:
            idx = self.fetched[..., None].expand(-1, -1, self.d)
            j = self.fetched.shape[1]
            k.scatter_(1, idx, self.fk[:, :j])
            v.scatter_(1, idx, self.fv[:, :j])
        return k, v

    # ---- the one transfer ----------------------------------------------------------------------
    def fetch(self, idx: torch.Tensor) -> None:
        """Copy the host rows ``idx`` [kvh, j] (j ≤ topk) into the fetch buffer, counting the bytes."""
        j = idx.shape[1]
        rows = idx.to("cpu")[..., None].expand(-1, -1, self.d)
        if self.device.type == "cuda":
            self._fetch_cuda(rows, j)
        else:
            self.fk[:, :j].copy_(self.host_k.gather(1, rows))
            self.fv[:, :j].copy_(self.host_v.gather(1, rows))
        self.fetched = idx
        self.fetched_bytes += 2 * idx.numel() * self.d * self.host_k.element_size()

    def _fetch_cuda(self, rows: torch.Tensor, j: int) -> None:
        """Gather into pinned staging buffers, then copy on a side stream that the next read waits for.
        (Not run on this project's CPU machines: no GPU was lent to test it.)"""
        if self._stream is None:
            self._stream = torch.cuda.Stream(device=self.device)
            self._stage_k = torch.empty(self.fk.shape, dtype=self.dtype, pin_memory=True)
            self._stage_v = torch.empty(self.fk.shape, dtype=self.dtype, pin_memory=True)
        elif self._copied is not None:
            self._copied.synchronize()        # the last copy out of the staging buffers is done
        torch.gather(self.host_k, 1, rows, out=self._stage_k[:, :j])
        torch.gather(self.host_v, 1, rows, out=self._stage_v[:, :j])
        self._stream.wait_stream(torch.cuda.current_stream(self.device))   # the last step read fk
        with torch.cuda.stream(self._stream):
            self.fk[:, :j].copy_(self._stage_k[:, :j], non_blocking=True)
            self.fv[:, :j].copy_(self._stage_v[:, :j], non_blocking=True)
            self._copied = torch.cuda.Event()
            self._copied.record(self._stream)

    def fetch_async(self, idx: torch.Tensor, pool) -> None:
        self.wait()
        self._pending = pool.submit(self.fetch, idx)

    def wait(self) -> None:
        if self._pending is not None:
            self._pending.result()
            self._pending = None
        if self._copied is not None:          # CUDA: the compute stream waits for the copy, the host does not
            torch.cuda.current_stream(self.device).wait_event(self._copied)

    # ---- bytes ---------------------------------------------------------------------------------
    def resident_bytes(self) -> int:
        """Measured from the resident tensors: the used codes and scales, the windows, the fetch buffer."""
        g, nk, nv = self.cfg.group, self.nk, self.nv
        used = [self.kc[:, :nk], self.ks[:, :nk // g], self.kz[:, :nk // g],
                self.vc[:, :nv], self.vs[:, :nv], self.vz[:, :nv], self.kr, self.vr, self.fk, self.fv]
        return sum(t.nbytes for t in used)


def resident_bytes_formula(n: int, kv_heads: int, head_dim: int, cfg: OffloadConfig, elem: int,
                           capacity: int) -> int:
    """Resident bytes of one layer holding ``n`` of ``capacity`` tokens (elements of ``elem`` bytes)."""
    r, g, gv = cfg.residual, cfg.group, min(cfg.group, head_dim)
    nk, nv = n // r * r, max(0, n - r)
    codes = (nk + nv) * head_dim * cfg.bits // 8
    scales = 2 * (nk // g * head_dim + nv * (head_dim // gv)) * elem
    windows = 2 * r * head_dim * elem + 2 * min(cfg.topk, capacity) * head_dim * elem
    return kv_heads * (codes + scales + windows)
