"""A chunk's KV cache, its content key and its (pickle-free) serialized form."""
from __future__ import annotations

import hashlib
import json
import re
import sys
import zlib
from array import array
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:            # keys need no torch: the remote client computes them without it
    import torch

# Bump when the meaning of stored tensors changes (layout, rotation convention, sink handling).
KV_LAYOUT_VERSION = 1
# Keys become file names and Redis keys: nothing that could climb out of a directory, hide, or hold NUL.
KEY_RE = re.compile(r"[0-9A-Za-z_-]{2,200}")
META_KEY_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}")
MAX_HEADER_BYTES = 16 << 20         # token ids + text of a long chunk are well under this


class CorruptEntry(ValueError):
    """A stored entry failed its integrity check; callers treat it as a miss."""


def check_key(key: object) -> str:
    """``key`` if it is a safe chunk key (2–200 characters of [0-9A-Za-z_-]), else ValueError."""
    if not isinstance(key, str) or not KEY_RE.fullmatch(key):
        raise ValueError(f"invalid chunk key {str(key)[:80]!r}: expected 2-200 characters of [0-9A-Za-z_-]")
    return key


@dataclass
class ChunkKV:
    """K before RoPE and V of one chunk, computed alone: ``k``, ``v``: [layers, kv_heads, tokens, head_dim]."""

    key: str
    token_ids: list[int]
    k: torch.Tensor
    v: torch.Tensor
    meta: dict = field(default_factory=dict)   # JSON-serializable extras (text, fingerprint, ...)

    @property
    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() + self.v.numel() * self.v.element_size()

    def to_bytes(self) -> bytes:
        """safetensors blob; the JSON metadata rides in its header, with a checksum over the tensors."""
        check_key(self.key)
        bad = [m for m in self.meta if not isinstance(m, str) or not META_KEY_RE.fullmatch(m)
               or m in ("key", "token_ids", "layout", "checksum")]
        if bad:
            raise ValueError(f"invalid metadata names {[str(m)[:40] for m in bad]}: expected identifiers "
                             "other than key, token_ids, layout and checksum")
        k, v = self.k.contiguous(), self.v.contiguous()
        meta = {"key": self.key, "token_ids": self.token_ids, "layout": KV_LAYOUT_VERSION,
                "checksum": _checksum(k, v), **self.meta}
        header = json.dumps(meta)
        if len(header) > MAX_HEADER_BYTES:
            raise ValueError(f"metadata of {len(header)} bytes exceeds {MAX_HEADER_BYTES}")
        from safetensors.torch import save as st_save

        return st_save({"k": k, "v": v}, metadata={"json": header})

    @classmethod
    def from_bytes(cls, blob: bytes, expect_key: str | None = None) -> "ChunkKV":
        from safetensors.torch import load as st_load

        meta = read_meta(blob)
        try:
            tensors = st_load(blob)
            k, v = tensors["k"], tensors["v"]
        except Exception as e:  # safetensors/json raise assorted types on damaged input
            raise CorruptEntry(f"unreadable KV entry: {e}") from e
        stored = meta.pop("checksum", None)
        if not isinstance(stored, str) or stored != _checksum(k, v, like=stored):
            raise CorruptEntry("KV entry checksum mismatch")
        if meta.pop("layout", None) != KV_LAYOUT_VERSION:
            raise CorruptEntry("KV entry has another layout version")
        key, token_ids = meta.pop("key"), meta.pop("token_ids")
        if expect_key is not None and key != expect_key:
            raise CorruptEntry(f"KV entry holds key {key[:12]}…, expected {expect_key[:12]}…")
        if k.shape != v.shape or k.shape[2] != len(token_ids):
            raise CorruptEntry("KV entry shapes do not match its tokens")
        return cls(key=key, token_ids=token_ids, k=k, v=v, meta=meta)


def _checksum(k: torch.Tensor, v: torch.Tensor, like: str | None = None) -> str:
    """What catches a torn or damaged entry (not tampering: whoever can write an entry can write its checksum):
    CRC-32, ~3x faster to read than SHA-256, and every query reads its chunks' entries. ``like``: the stored
    checksum to compare with; a bare hex digest is the SHA-256 that entries written before carry."""
    import torch

    data = [t.contiguous().view(torch.uint8).numpy() for t in (k, v)]   # their buffers, not copies
    if like is None or like.startswith("crc32:"):
        crc = 0
        for d in data:
            crc = zlib.crc32(d, crc)
        return f"crc32:{crc:08x}"
    h = hashlib.sha256()
    for d in data:
        h.update(d)
    return h.hexdigest()


# The safetensors header holds tensor names, shapes and our JSON metadata (escaped, so up to ~2x its size).
HEADER_LIMIT = 2 * MAX_HEADER_BYTES


def read_meta(blob: bytes) -> dict:
    """The JSON metadata of a stored entry, from its header alone: ``blob`` may stop right after the header
    (8-byte length + header), so callers can read a file's head only. Bad bounds or JSON → CorruptEntry."""
    n = int.from_bytes(blob[:8], "little") if len(blob) >= 8 else 0
    if not 0 < n <= min(len(blob) - 8, HEADER_LIMIT):
        raise CorruptEntry("KV entry header length is out of bounds")
    try:
        meta = json.loads(json.loads(blob[8:8 + n])["__metadata__"]["json"])
    except Exception as e:  # json raises assorted types on damaged input
        raise CorruptEntry(f"unreadable KV entry header: {e}") from e
    if not isinstance(meta, dict):
        raise CorruptEntry("KV entry metadata is not an object")
    return meta


def _ids_bytes(token_ids) -> bytes:
    """Token ids as little-endian int64, the bytes every key has hashed."""
    ids = array("q", [int(t) for t in token_ids])
    if sys.byteorder != "little":
        ids.byteswap()
    return ids.tobytes()


def chunk_key(fingerprint: str, token_ids: list[int], context_ids: list[int] = ()) -> str:
    """Content address of a chunk's KV: the model fingerprint plus the exact token ids, and for a chunk
    prefilled after ingestion-time context (``neighbors.py``) that context's token ids."""
    h = hashlib.sha256(fingerprint.encode())
    h.update(_ids_bytes(token_ids))
    if context_ids:
        h.update(b"context")
        h.update(_ids_bytes(context_ids))
    return h.hexdigest()


def check_salt(cache_salt: str | None) -> str | None:
    """``cache_salt`` if it is None or a non-empty string, else ValueError."""
    if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
        raise ValueError(f"cache_salt must be a non-empty string, got {cache_salt!r}")
    return cache_salt


def tenant_fingerprint(fingerprint: str, cache_salt: str | None) -> str:
    """The fingerprint a request's chunk keys are made with: the model's, or for a ``cache_salt`` (vLLM's
    per-request field; a tenant) one derived from both — so chunks are shared within a salt and never across,
    and a key reveals nothing to whoever lacks the salt."""
    if check_salt(cache_salt) is None:
        return fingerprint
    return hashlib.sha256(f"{fingerprint}|cache_salt={cache_salt}".encode()).hexdigest()


def model_fingerprint(model, tokenizer, sink: str) -> str:
    """Identity of everything that makes a chunk's KV what it is: weights, tokenizer, dtype, layout, sink.

    Weights are identified by a strided sample of every parameter (full hashing of a 1.5B model
    costs seconds; a sample changes with any real change of checkpoint or quantization).
    """
    h = hashlib.sha256()
    for name, p in model.named_parameters():
        flat = p.detach().reshape(-1)
        sample = flat[:: max(1, flat.numel() // 4096)][:4096]
        h.update(f"{name}:{tuple(p.shape)}:{p.dtype}".encode())
        h.update(sample.float().numpy().tobytes())
    backend = getattr(tokenizer, "backend_tokenizer", None)
    vocab = backend.to_str() if backend is not None else json.dumps(tokenizer.get_vocab(), sort_keys=True)
    h.update(hashlib.sha256(vocab.encode()).digest())
    h.update(f"dtype={next(model.parameters()).dtype};layout={KV_LAYOUT_VERSION};sink={sink}".encode())
    if sink == "prefix":                    # the prefix itself is part of every key
        from .prompt import sink_token_ids

        h.update(_ids_bytes(sink_token_ids(tokenizer, sink)))
    return h.hexdigest()
