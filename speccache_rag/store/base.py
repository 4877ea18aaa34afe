"""The store interface every backend implements (memory, directory, redis, tiered)."""
from __future__ import annotations

from abc import ABC, abstractmethod

from ..kv import ChunkKV


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

    def raw(self, key: str) -> bytes | None:
        """The entry's stored bytes as they are, unchecked and never deleted (operator commands)."""
        chunk = self.get(key)
        return chunk.to_bytes() if chunk is not None else None

    def close(self) -> None:
        pass
