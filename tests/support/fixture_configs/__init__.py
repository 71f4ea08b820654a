"""The tiny checkpoints make_fixtures.py builds, one module per family: name -> (seed, model type, overrides)."""

from tests.support.fixture_configs import gemma, gpt_oss, llama, mixtral, phi3, qwen

MODELS = {**llama.MODELS, **mixtral.MODELS, **qwen.MODELS, **gemma.MODELS, **phi3.MODELS, **gpt_oss.MODELS}
