"""A model's fingerprint (engine/fingerprint.py) names the model, not the engine serving it: the router
opens the checkpoint without an engine's max_model_len and must find the replicas' fingerprints equal."""

import dataclasses

from jaxserve.engine.fingerprint import model_fingerprint
from jaxserve.loading.model_source import open_model
from jaxserve.models.config import RopeScaling
from tests.support.fixtures import fixture_dir


def test_the_engines_context_length_is_not_part_of_the_model():
    source = open_model(fixture_dir("llama_gqa"))
    served = dataclasses.replace(source, config=source.config.with_context_length(128))
    assert model_fingerprint(served) == model_fingerprint(source)
    other = dataclasses.replace(source, config=dataclasses.replace(source.config, rope_theta=1234.0))
    assert model_fingerprint(other) != model_fingerprint(source)


def test_longrope_counts_which_factors_the_length_picked():
    source = open_model(fixture_dir("llama_gqa"))
    half = source.config.head_dim // 2
    scaling = RopeScaling(
        rope_type="longrope",
        original_max_position_embeddings=64,
        short_factor=(1.0,) * half,
        long_factor=(2.0,) * half,
    )
    longrope = dataclasses.replace(source, config=dataclasses.replace(source.config, rope_scaling=scaling))

    def at(length):
        return model_fingerprint(dataclasses.replace(longrope, config=longrope.config.with_context_length(length)))

    assert at(32) == at(64) != at(65) == at(512)
