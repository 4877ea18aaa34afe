import pytest


@pytest.fixture(scope="session")
def smollm2():
    from speccache_rag.models import load

    return load("smollm2-135m")
