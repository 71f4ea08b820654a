"""GPT-OSS's config as the Hub writes it, and YaRN rope against transformers' own frequencies
(tests/fixtures/gpt_oss_yarn_frequencies.json, recorded by tests/support/make_fixtures.py yarn)."""

import json
import os

import numpy as np
import pytest

from jaxserve.models import ModelConfig
from jaxserve.models.layers import rope_attention_factor, rope_inverse_frequencies
from tests.support.fixtures import FIXTURES

with open(os.path.join(FIXTURES, "gpt_oss_yarn_frequencies.json")) as f:
    YARN_CASES = json.load(f)["cases"]


@pytest.mark.parametrize("name", sorted(YARN_CASES))
def test_yarn_frequencies_match_transformers(name):
    case = YARN_CASES[name]
    config = ModelConfig.from_hf_dict(case["config"])
    theta, scaling = config.layer_rope(0)
    assert scaling.rope_type == "yarn"
    found = rope_inverse_frequencies(config.rotary_dim, theta, scaling, config.context_length)
    np.testing.assert_allclose(found, np.asarray(case["inv_freq"], np.float32), rtol=2e-7, atol=0)
    assert rope_attention_factor(scaling) == pytest.approx(case["attention_factor"], rel=1e-12)


def test_yarn_keeps_mscale_for_deepseek_and_reads_outer_original_length():
    deepseek = ModelConfig.from_hf_dict(YARN_CASES["deepseek_v3"]["config"]).rope_scaling
    assert (deepseek.mscale, deepseek.mscale_all_dim, deepseek.truncate) == (1.0, 1.0, True)
    odd = ModelConfig.from_hf_dict(YARN_CASES["odd_short"]["config"]).rope_scaling
    assert odd.original_max_position_embeddings == 64 and (odd.beta_fast, odd.beta_slow) == (8.0, 2.0)
