"""The real redis-server helpers tests use (the binary comes from .ci/run's apt-get)."""
from speccache_rag.bench.servers import free_port, start_redis, stop  # noqa: F401

NO_REDIS_PY = "the 'redis' extra is not installed: pip install 'speccache-rag[redis]'"
