"""The store interface every backend implements (memory, directory, redis, tiered)."""
from __future__ import annotations

from abc import ABC, abstractmethod

import json

from ..kv import ChunkKV, check_key


class KVStore(ABC):
    """Content-addressed chunk KV storage. ``get`` returns None on a miss *and* on a corrupt entry
    (after a warning); ``put`` overwrites. Implementations never unpickle anything."""

    @abstractmethod
    def get(self, key: str) -> ChunkKV | None: ...

    @abstractmethod
    def put(self, chunk: ChunkKV) -> None: ...

    @abstractmethod
    def contains(self, key: str) -> bool: ...

    @abstractmethod
    def delete(self, key: str) -> None: ...

    @abstractmethod
    def keys(self) -> list[str]: ...

    def added_since(self, cursor: int | None) -> tuple[list[str], int | None]:
        """Keys put since ``cursor`` and the cursor to pass next time (``None``: every key, and where the journal
        stands), so that a reader keeping up with the store pays for what is new, not for the whole store.
        Backends with a journal (memory, directory, Redis) answer from it; this default lists every key."""
        return self.keys(), None

    def raw(self, key: str) -> bytes | None:
        """The entry's stored bytes as they are, unchecked and never deleted (operator commands)."""
        chunk = self.get(key)
        return chunk.to_bytes() if chunk is not None else None

    def texts(self, keys: list[str]) -> dict[str, str]:
        """The chunk texts stored with ``keys`` (``meta["text"]``), as cheaply as the backend allows:
        what lets any replica find chunks another one stored inside a prompt."""
        out = {}
        for key in keys:
            chunk = self.get(key)
            if chunk is not None and isinstance(chunk.meta.get("text"), str):
                out[key] = chunk.meta["text"]
        return out

    def get_meta(self, name: str) -> dict | None:
        """A small JSON record kept beside the entries, never listed by ``keys()`` (e.g. the gate's result).
        This default lives as long as the store object; the disk and Redis stores persist it."""
        value = getattr(self, "_meta", {}).get(check_key(name))
        return json.loads(value) if value is not None else None

    def put_meta(self, name: str, value: dict) -> None:
        if not hasattr(self, "_meta"):
            self._meta: dict[str, str] = {}
        self._meta[check_key(name)] = json.dumps(value)

    def close(self) -> None:
        pass
