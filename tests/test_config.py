"""EngineConfig's groups, the flat option names that LLM and `engine:` sections use, and config files'
sections (jaxserve/config.py, jaxserve/config_sections.py, jaxserve/server/config_file.py)."""

import dataclasses
import re
import subprocess
import sys

import pytest

from jaxserve.config import CacheConfig, EngineConfig, EngineRole, SchedulerConfig
from jaxserve.host.request import FinishReason
from jaxserve.router.config import load_router_config
from jaxserve.server.config_file import load_config


def test_every_option_has_one_group_and_a_unique_name():
    names = EngineConfig.option_names()
    grouped = [
        f.name
        for group in ("cache", "scheduler", "parallel", "compile", "disagg")
        for f in dataclasses.fields(getattr(EngineConfig(), group))
    ]
    assert len(grouped) == len(set(grouped))
    assert {"page_size": "cache", "max_num_seqs": "scheduler", "role": "disagg", "dtype": None}.items() <= names.items()


def test_from_options_routes_flat_names_into_groups():
    config = EngineConfig.from_options(page_size=32, max_num_seqs=8, tensor_parallel_size=2, role="decode", seed=7)
    assert config.cache == CacheConfig(page_size=32)
    assert config.scheduler == SchedulerConfig(max_num_seqs=8)
    assert config.parallel.tensor_parallel_size == 2 and config.seed == 7
    assert config.disagg.role is EngineRole.DECODE
    assert config.with_options(page_size=8, max_num_seqs=2).cache.page_size == 8
    assert config.with_options(max_num_seqs=2).cache.page_size == 32  # the rest kept
    with pytest.raises(ValueError, match=r"unknown engine options \['max_num_seq'\]"):
        EngineConfig.from_options(max_num_seq=4)
    with pytest.raises(ValueError, match="repeat what the cache group sets"):
        EngineConfig.from_options(cache={"page_size": 8}, page_size=16)


def test_validation_spans_groups():
    with pytest.raises(ValueError, match="prefill_token_buckets must be multiples of prefill_query_block"):
        EngineConfig.from_options(prefill_token_buckets=(24,), prefill_query_block=16)
    with pytest.raises(ValueError, match="swap_space"):
        EngineConfig.from_options(swap_space=1.0, data_parallel_size=2)
    # the host tier only receives evicted prefix-cache pages: without the cache it was silently left empty
    with pytest.raises(ValueError, match="swap_space .* needs enable_prefix_caching"):
        EngineConfig.from_options(swap_space=1.0, enable_prefix_caching=False)
    with pytest.raises(ValueError, match="role must be both, prefill or decode"):
        EngineConfig.from_options(role="neither")
    with pytest.raises(ValueError, match="unknown cache option 'max_num_seqs'"):
        EngineConfig(cache={"max_num_seqs": 4})  # type: ignore[arg-type]


def test_config_file_sections_mirror_the_groups(tmp_path):
    path = tmp_path / "serve.yaml"
    path.write_text(
        "model: {path: tiny-random, dtype: bfloat16}\n"
        "cache: {page_size: 32, enable_prefix_caching: false}\n"
        "scheduler: {max_num_seqs: 4}\n"
        "engine: {seed: 3, max_model_len: 256}\n"
    )
    config = load_config(str(path), ["compile.attention_impl=reference", "disagg.role=prefill"]).engine
    assert (config.cache.page_size, config.cache.enable_prefix_caching) == (32, False)
    assert (config.scheduler.max_num_seqs, config.scheduler.max_model_len, config.seed) == (4, 256, 3)
    assert config.compile.attention_impl == "reference" and config.disagg.role == "prefill"
    assert config.dtype == "bfloat16"
    with pytest.raises(ValueError, match="unknown config key cache.max_num_seqs"):
        load_config(str(path), ["cache.max_num_seqs=2"])
    # --set replaces the file's value wherever the file put it; the file itself may set an option once
    assert load_config(str(path), ["engine.max_num_seqs=2"]).engine.scheduler.max_num_seqs == 2
    assert load_config(str(path), ["scheduler.max_model_len=128"]).engine.scheduler.max_model_len == 128
    assert (
        load_config(str(path), ["engine.max_model_len=64", "scheduler.max_model_len=96"]).engine.scheduler.max_model_len
        == 96
    )
    twice = tmp_path / "twice.yaml"
    twice.write_text("engine: {max_num_seqs: 4}\nscheduler: {max_num_seqs: 8}\n")
    with pytest.raises(ValueError, match="scheduler.max_num_seqs and engine.max_num_seqs are the same option"):
        load_config(str(twice))
    with pytest.raises(ValueError, match="the dtype is model.dtype"):
        load_config(None, ["engine.dtype=float32"])
    with pytest.raises(ValueError, match="config section 'cache' must be a mapping"):
        path.write_text("cache: [1, 2]\n")
        load_config(str(path))


def test_the_router_loads_its_sections_with_the_same_loader(tmp_path):
    path = tmp_path / "router.yaml"
    path.write_text("model: {path: tiny-random}\nreplicas: ['127.0.0.1:1']\n")
    config = load_router_config(str(path), ["router.port=7000"])
    assert config.router.port == 7000
    with pytest.raises(ValueError, match="unknown config key router.prot"):
        load_router_config(str(path), ["router.prot=1"])
    with pytest.raises(ValueError, match="unknown config key 'engine.page_size'"):
        load_router_config(str(path), ["engine.page_size=1"])


def test_finish_reasons_travel_as_plain_strings():
    import json

    assert json.dumps({"finish_reason": FinishReason.LENGTH}) == '{"finish_reason": "length"}'
    assert FinishReason.STOP == "stop" and str(FinishReason.ABORT) == "abort"


def test_default_prefill_buckets_are_at_most_a_third_padding():
    from jaxserve.config import Buckets

    engine = EngineConfig.from_options(max_num_batched_tokens=512, prefill_query_block=16)
    buckets = Buckets.derive(engine, max_model_len=1024).prefill_tokens
    assert buckets == (64, 128, 192, 256, 384, 512)
    for tokens in range(129, 513):  # a 160-190-token prompt fits 192, not 256
        bucket = Buckets.fit(tokens, buckets)
        assert bucket - tokens <= bucket / 3


def test_quantization_none_is_the_default_as_vllm_spells_it():
    from jaxserve.config import EngineConfig

    assert EngineConfig.from_options(quantization=None).quantization == "none"


def test_vllm_engine_argument_names_map_onto_jaxserve_options():
    config = EngineConfig.from_options(
        block_size=32,
        kv_cache_dtype="fp8",
        enable_lora=True,
        max_lora_rank=8,
        speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 5},
        trust_remote_code=True,
        enforce_eager=True,
    )
    assert (config.cache.page_size, config.cache.kv_dtype) == (32, "float8_e4m3")
    assert (config.lora.max_adapters, config.lora.max_rank) == (1, 8)
    assert (config.speculative.method, config.speculative.num_speculative_tokens) == ("ngram", 3)
    assert config.speculative.prompt_lookup_max == 5
    draft = EngineConfig.from_options(speculative_config={"model": "self", "quantization": "int4"}, max_loras=3)
    assert (draft.speculative.method, draft.speculative.draft_quantization) == ("draft", "int4")
    assert draft.lora.max_adapters == 3
    assert EngineConfig.from_options(speculative_config=None).speculative.method is None
    assert EngineConfig.from_options(kv_cache_dtype="bfloat16").cache.kv_dtype == "bfloat16"


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(gpu_memory_utilization=0.9), "kv_cache_memory_gib"),
        (dict(tokenizer="x"), "tokenizer"),
        (dict(kv_cache_dtype="fp8_e5m2"), "kv_cache_dtype 'fp8_e5m2'"),
        (dict(block_size=16, page_size=16), "page_size given twice"),
        (dict(speculative_config={"method": "eagle"}), "unknown speculative method 'eagle'"),
        (dict(speculative_config={"draft_tensor_parallel_size": 2}), "draft_tensor_parallel_size"),
        (dict(speculative_config="ngram"), "must be a dict"),
        (dict(max_num_seq=4), "unknown engine options"),
    ],
)
def test_vllm_names_jaxserve_cannot_honour_are_refused_with_a_pointer(options, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig.from_options(**options)


def test_a_preset_with_an_engine_section_takes_overrides_of_its_options_by_group_name():
    """configs/default.yaml sets max_model_len under engine:; --set scheduler.max_model_len was refused as a
    second setting of the same option."""
    config = load_config("configs/default.yaml", ["scheduler.max_model_len=1024"]).engine
    assert config.scheduler.max_model_len == 1024


def test_a_set_value_that_is_not_yaml_is_kept_as_the_string_given():
    """A jinja template (or '@keys', backticks) is not valid YAML: --set crashed with a ScannerError."""
    for template in ("{% for m in messages %}{{ m.content }}{% endfor %}", "{{ messages }}"):
        assert load_config(None, [f"server.chat_template={template}"]).server.chat_template == template
    assert load_config(None, ["server.api_keys=@keys"]).server.api_keys == "@keys"
    assert load_config(None, ["model.path=`x`"]).model.path == "`x`"
    assert load_config(None, ["server.port=6000"]).server.port == 6000  # YAML still where it is YAML


@pytest.mark.parametrize(
    "override, message",
    [
        ("model.path=null", "model.path must be a string, got None"),
        ("cache.page_size=16.5", "cache.page_size must be an integer, got 16.5"),
        ("cache.num_pages=10.5", "cache.num_pages must be an integer or null, got 10.5"),
        ("scheduler.max_num_seqs=8.0", "scheduler.max_num_seqs must be an integer, got 8.0"),
        ("scheduler.max_num_seqs=true", "scheduler.max_num_seqs must be an integer, got True"),
        ("scheduler.max_logprobs=1.5", "scheduler.max_logprobs must be an integer, got 1.5"),
        ("scheduler.overlap_steps=maybe", "scheduler.overlap_steps must be true or false, got 'maybe'"),
        ("engine.seed=abc", "engine.seed must be an integer, got 'abc'"),
        ("engine.seed=1.5", "engine.seed must be an integer, got 1.5"),
        ("engine.show_progress=abc", "engine.show_progress must be true or false"),
        ("compile.compilation_cache_dir=123", "compile.compilation_cache_dir must be a string or null, got 123"),
        ('cache.enable_prefix_caching="false"', "cache.enable_prefix_caching must be true or false, got 'false'"),
        ("cache.kv_cache_memory_gib=-1", "cache.kv_cache_memory_gib must be >= 0, got -1"),
        ("cache.kv_cache_memory_gib=0", "cache.kv_cache_memory_gib must be > 0"),
        ("cache.kv_cache_memory_gib=abc", "cache.kv_cache_memory_gib must be a finite number or null, got 'abc'"),
        ("cache.session_ttl=.nan", "cache.session_ttl must be a finite number, got nan"),
        ("lora.max_adapters=true", "lora.max_adapters must be an integer or null, got True"),
        ("parallel.device_ids=[a]", "parallel.device_ids must be a list of integers or null"),
        ("server.drain_timeout=.nan", "server.drain_timeout must be a finite number, got nan"),
        ("server.drain_timeout=.inf", "server.drain_timeout must be a finite number, got inf"),
        ("server.port=true", "server.port must be an integer, got True"),
        ("compile.attention_impl=flash", "compile.attention_impl must be one of auto, reference, cpu, pallas"),
        (
            "server.host=[localhost]",
            "server.host must be a string, got ['localhost'] (YAML reads [...] and {...} as a list or mapping: quote",
        ),
        ("server.max_queued_requests=2.5", "server.max_queued_requests must be an integer, got 2.5"),
        ("server.max_stop_strings=1.5", "server.max_stop_strings must be an integer, got 1.5"),
        ("server.max_prompt_bytes=-1", "server.max_prompt_bytes must be >= 0, got -1"),
        ("distributed.peer_timeout=abc", "distributed.peer_timeout must be a finite number, got 'abc'"),
    ],
)
def test_a_value_of_the_wrong_type_is_refused_naming_the_option(override, message):
    """Each was accepted, then crashed later with a traceback or was applied wrongly (a "false" string kept
    prefix caching on, -1 GiB left one usable page, nan seconds of drain)."""
    with pytest.raises(ValueError, match=re.escape(message)):
        load_config(None, [override])


def test_values_of_the_right_type_in_every_form_the_code_takes_still_pass():
    import numpy as np

    config = EngineConfig.from_options(
        page_size=np.int64(8),  # numpy integers are integers
        swap_space=1,  # an integer where a number is meant
        decode_seq_buckets=[1, 4],
        page_buckets=(8, 16),
        device_ids=[0],
        role="decode",  # an enum by its value
        target_modules="q_proj",  # one string for a list of them
        seed=-1,
        quantization=None,
    )
    assert config.cache.page_size == 8 and config.compile.decode_seq_buckets == (1, 4)
    assert config.lora.target_modules == ("q_proj",) and config.disagg.role is EngineRole.DECODE
    assert dataclasses.replace(config, show_progress=False).seed == -1  # rebuilt from its own checked values
    server = load_config(None, ["server.tls={cert: a.pem, key: b.pem}", "server.http_port=null"]).server
    assert server.tls is not None and server.http_port == 0
    assert load_config(None, ["server.cors_allowed_origins='*'"]).server.cors_allowed_origins == ("*",)


def test_the_router_checks_its_sections_types_alike(tmp_path):
    listed, launched = tmp_path / "listed.yaml", tmp_path / "launched.yaml"
    listed.write_text("model: {path: tiny-random}\nreplicas: ['127.0.0.1:1']\n")
    launched.write_text("model: {path: tiny-random}\nlaunch: {num_replicas: 1}\n")
    for path, override, message in (
        (listed, "router.port=true", "router.port must be an integer, got True"),
        (listed, "router.heartbeat=.nan", "router.heartbeat must be a finite number, got nan"),
        (listed, "router.blind_window=-1", "router.blind_window must be >= 0, got -1"),
        (launched, "launch.log_dir=1", "launch.log_dir must be a string or null, got 1"),
    ):
        with pytest.raises(ValueError, match=re.escape(message)):
            load_router_config(str(path), [override])


def test_the_serve_command_exits_2_naming_a_bad_option():
    for override, message in (
        ("server.chat_template=/no/such/chat.jinja", "server.chat_template '/no/such/chat.jinja' is not a template"),
        ("cache.page_size=16.5", "cache.page_size must be an integer, got 16.5"),
    ):
        result = subprocess.run(
            [sys.executable, "-m", "jaxserve.serve", "--set", override], capture_output=True, text=True, timeout=300
        )
        assert result.returncode == 2 and f"jaxserve.serve: {message}" in result.stderr, result.stderr[-2000:]
        assert "Traceback" not in result.stderr


def test_the_attention_impls_a_config_takes_are_the_kernels():
    from jaxserve.config import ATTENTION_IMPLS
    from pallas_kernels.paged_attention import ATTENTION_IMPLS as KERNEL_IMPLS

    assert ATTENTION_IMPLS == KERNEL_IMPLS
