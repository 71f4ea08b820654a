import pytest

from tests.support.fixtures import SMALL_ENGINE, fixture_dir


@pytest.fixture(scope="session")
def llama_llm():
    from jaxserve import LLM

    return LLM(fixture_dir("llama_gqa"), **SMALL_ENGINE)
