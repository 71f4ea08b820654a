import pytest

from tests.support.fixtures import DERIVED_BUCKETS, fixture_dir


@pytest.fixture(scope="session")
def llama_llm():
    from jaxserve import LLM

    # the derived decode buckets (1, 4, 8): e.g. seeded sampling alone and in a crowd runs different executables
    return LLM(fixture_dir("llama_gqa"), **DERIVED_BUCKETS)
