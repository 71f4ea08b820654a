"""The page pool is read and written in place: a step's cost follows the context it attends to, never
the size of the pool."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import ragged_paged_attention, resolve_attention_impl, write_kv_pages
from pallas_kernels.paged_attention import cpu, pallas_gpu, pallas_tpu
from tests.kernels.steps import ragged_step


def _consumers(function, args, names):
    """The primitives that consume each of the named inputs inside a jitted function's jaxpr."""
    closed = jax.make_jaxpr(function)(*args)
    (outer,) = closed.jaxpr.eqns  # the jit
    inner = outer.params["jaxpr"].jaxpr
    inputs = dict(zip(names, inner.invars))
    return {
        name: [eqn.primitive.name for eqn in inner.eqns if any(v is var for v in eqn.invars)]
        for name, var in inputs.items()
    }, inner


@pytest.mark.parametrize("kernel", [pallas_gpu, pallas_tpu])
def test_kernels_read_the_page_pool_in_place(kernel):
    """K/V pages go straight into the kernel: no gather, copy or reshape of the pool before it."""
    args = ragged_step(np.random.default_rng(0), 16, 64, 4, jnp.float32, 1)
    consumers, _ = _consumers(
        lambda *a: kernel.ragged_paged_attention(*a, query_block=1), args, ["q", "k_pages", "v_pages"]
    )
    assert consumers["k_pages"] == ["pallas_call"] and consumers["v_pages"] == ["pallas_call"]


def test_write_kernel_updates_pages_in_place():
    pages = jnp.zeros((4, 8, 2, 64))
    k = jnp.ones((8, 2, 64))
    consumers, inner = _consumers(
        pallas_gpu.write_kv_pages, (pages, pages, k, k, jnp.zeros(8, jnp.int32)), ["k_pages", "v_pages"]
    )
    assert consumers == {"k_pages": ["pallas_call"], "v_pages": ["pallas_call"]}
    (call,) = [eqn for eqn in inner.eqns if eqn.primitive.name == "pallas_call"]
    assert dict(call.params["input_output_aliases"]) == {3: 0, 4: 1}  # outputs alias the donated pages


POOL_SHAPE = (96, 8, 2, 32)  # [num_pages, page_size, K, D]: no other array of the step has this shape
INSTRUCTION = re.compile(
    r"^\s*(?:ROOT\s+)?%(?P<name>[\w.\-]+) = (?P<type>.+?) (?P<op>[a-z][\w\-]*)\((?P<operands>[^)]*)\)"
)
STRUCTURAL = {"parameter", "tuple", "get-tuple-element"}  # name buffers, move no data


def _ops_over_the_pool(hlo_text: str) -> list[str]:
    """Every instruction of a compiled module (fused computations included) that takes a pool-shaped
    operand, of any dtype, as 'opcode' or 'custom-call:target'; structural ones left out."""
    shapes, consumers = {}, []
    for line in hlo_text.splitlines():
        match = INSTRUCTION.match(line)
        if not match:
            continue
        array = re.fullmatch(r"\w+\[([\d,]*)\](\{[\d,]*\})?", match["type"])
        shapes[match["name"]] = tuple(int(d) for d in array[1].split(",") if d) if array else None
        operands = re.findall(r"%([\w.\-]+)", match["operands"])
        if match["op"] not in STRUCTURAL and any(shapes.get(name) == POOL_SHAPE for name in operands):
            target = re.search(r'custom_call_target="([^"]+)"', line)
            consumers.append(f"{match['op']}:{target[1]}" if target else match["op"])
    return consumers


def _compiled_step(step, dtype) -> str:
    """The compiled HLO of `step` over donated pools of POOL_SHAPE, decoding 4 tokens."""
    num_pages, page_size, num_kv_heads, head_dim = POOL_SHAPE
    pool = jax.ShapeDtypeStruct(POOL_SHAPE, dtype)
    tokens = lambda heads: jax.ShapeDtypeStruct((4, heads, head_dim), dtype)
    int32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)
    args = (
        pool,
        pool,
        tokens(4 * num_kv_heads),
        tokens(num_kv_heads),
        tokens(num_kv_heads),
        int32(4),
        int32(4, 6),
        int32(4),
        int32(4),
    )
    return jax.jit(step, donate_argnums=(0, 1)).lower(*args).compile().as_text()


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
def test_a_cpu_step_touches_the_pool_only_in_its_kernels(dtype):
    """XLA:CPU widens 16-bit gathers and scatters to float32 over their whole operand, and hoists the
    widening of the pool out of the attention loop: the reference's step converted the whole pool
    (and back) every step. What "auto" picks on the CPU hands the donated pools to the write and
    attention kernels only: no convert, copy or fusion over them."""
    impl = resolve_attention_impl("auto", "cpu", dtype)
    assert impl == "cpu"

    def step(k_pages, v_pages, q, k, v, kv_indices, page_table, token_seq_ids, positions):
        k_pages, v_pages = write_kv_pages(k_pages, v_pages, k, v, kv_indices, impl=impl)
        out = ragged_paged_attention(
            q, k_pages, v_pages, page_table, token_seq_ids, positions, query_block=1, impl=impl
        )
        return out, k_pages, v_pages

    consumers = _ops_over_the_pool(_compiled_step(step, dtype))
    assert sorted(consumers) == [f"custom-call:{cpu.ATTENTION_TARGET}", f"custom-call:{cpu.WRITE_TARGET}"]


def test_the_pool_check_sees_a_conversion_of_the_pool():
    def step(k_pages, v_pages, q, *rest):
        return q, (k_pages.astype(jnp.float32) * 2).astype(k_pages.dtype), v_pages

    assert _ops_over_the_pool(_compiled_step(step, jnp.bfloat16))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_the_cpu_write_leaves_pages_it_was_not_given_as_they_were(dtype):
    """Without donation XLA hands the kernel a copy to write: the caller's pages stay as they were."""
    pages = jnp.asarray(np.random.default_rng(0).standard_normal((4, 8, 2, 16)), dtype)
    before = np.asarray(pages, np.float32)
    rows, kv_indices = jnp.ones((3, 2, 16), dtype), jnp.asarray([9, 10, 31], jnp.int32)
    for write in (cpu.write_kv_pages, jax.jit(cpu.write_kv_pages)):
        k_pages, _ = write(pages, pages, rows, rows, kv_indices)
        np.testing.assert_array_equal(np.asarray(pages, np.float32), before)
        assert np.all(np.asarray(k_pages, np.float32).reshape(32, 2, 16)[[9, 10, 31]] == 1)


def test_the_cpu_write_is_in_place_when_the_pages_are_donated():
    pages = jnp.zeros((4, 8, 2, 16), jnp.bfloat16)
    pointer = pages.unsafe_buffer_pointer()
    write = jax.jit(cpu.write_kv_pages, donate_argnums=(0, 1))
    k_pages, _ = write(
        pages,
        jnp.zeros_like(pages),
        jnp.ones((1, 2, 16), jnp.bfloat16),
        jnp.ones((1, 2, 16), jnp.bfloat16),
        jnp.asarray([5], jnp.int32),
    )
    assert k_pages.unsafe_buffer_pointer() == pointer
