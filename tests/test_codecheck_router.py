"""ROUTER001 and the router sites: a mixture-of-experts router scoring its experts in 16 bits is found in the
styles teams write routers in (Linen, NNX, Haiku, plain functions; softmax, sigmoid, top-k), its type read
only from what the code says; LSTM gates, SwiGLU gates, attention scores and float32 routers are left alone."""

from __future__ import annotations

import textwrap

import pytest

from migration.codecheck import check_source, check_sources
from migration.codecheck.findings import CodeCheck

HEAD = "import jax\nimport jax.numpy as jnp\nfrom flax import linen as nn\nfrom flax import nnx\n"

SIXTEEN_BITS = {
    "linen-compact": """
        class MoeLayer(nn.Module):
            num_experts: int = 8

            @nn.compact
            def __call__(self, x):
                router_logits = nn.Dense(self.num_experts, dtype=jnp.bfloat16)(x)
                weights, experts = jax.lax.top_k(jax.nn.softmax(router_logits), 2)
                return weights, experts
        """,
    "nnx-layer-built-in-bf16": """
        class SparseMoe(nnx.Module):
            def __init__(self, d, e, rngs):
                self.router = nnx.Linear(d, e, dtype=jnp.bfloat16, rngs=rngs)

            def __call__(self, x):
                logits = self.router(x)
                probs = jax.nn.softmax(logits, axis=-1)
                return jax.lax.top_k(probs, 2)
        """,
    "deepseek-sigmoid-cast": """
        class DeepseekMoE(nn.Module):
            def __call__(self, x, w):
                gate_scores = jnp.einsum("td,de->te", x, w).astype(jnp.bfloat16)
                return jax.nn.sigmoid(gate_scores)
        """,
    "function-string-dtype": """
        def route(x, router_w):
            return jax.nn.softmax(jnp.dot(x, router_w).astype("float16"))
        """,
    "preferred-element-type": """
        def route_tokens(x, w_router):
            routing_logits = jnp.einsum("btd,de->bte", x, w_router, preferred_element_type=jnp.bfloat16)
            return jax.lax.top_k(routing_logits, 2)
        """,
}

FLOAT32_OR_NOT_SAID = {
    "maxtext-style-cast": """
        class MoeBlock(nn.Module):
            @nn.compact
            def __call__(self, x):
                gate_logits = nn.Dense(8, dtype=jnp.bfloat16, name="gate")(x)
                probs = jax.nn.softmax(gate_logits.astype(jnp.float32), axis=-1)
                return jax.lax.top_k(probs, 2)
        """,
    "cast-after-the-softmax-is-still-a-float32-softmax": """
        def route(router_logits):
            return jax.nn.softmax(router_logits.astype(jnp.float32)).astype(jnp.bfloat16)
        """,
    "float32-router-layer": """
        class SparseMoe(nnx.Module):
            def __init__(self, d, e, rngs):
                self.router = nnx.Linear(d, e, dtype=jnp.float32, rngs=rngs)

            def __call__(self, x):
                return jax.nn.softmax(self.router(x.astype(jnp.float32)))
        """,
    "bf16-activations-are-not-the-routers-type": """
        def route(x, router_w):
            x = x.astype(jnp.bfloat16)
            router_logits = jnp.einsum("td,de->te", x, router_w)
            return jax.nn.softmax(router_logits)
        """,
    "haiku-no-dtype": """
        import haiku as hk

        def moe(x):
            router_logits = hk.Linear(8, name="router")(x)
            return jax.nn.softmax(router_logits)
        """,
}

NOT_ROUTERS = {
    "lstm-gates": """
        class LSTMCell(nn.Module):
            def __call__(self, gates):
                gates = gates.astype(jnp.bfloat16)
                return jax.nn.sigmoid(gates)
        """,
    "swiglu-gate-in-an-expert": """
        class ExpertMlp(nn.Module):
            def __call__(self, x, gate_w, up_w):
                gate = (x @ gate_w).astype(jnp.bfloat16)
                return jax.nn.silu(gate) * (x @ up_w)
        """,
    "attention-scores": """
        class Attention(nn.Module):
            def __call__(self, scores):
                return jax.nn.softmax(scores.astype(jnp.bfloat16))
        """,
    "gate-outside-expert-code": """
        def highway(x, gate_logits):
            return jax.nn.softmax(gate_logits.astype(jnp.bfloat16))
        """,
}


def source(body: str) -> str:
    return HEAD + textwrap.dedent(body)


@pytest.mark.parametrize("name", sorted(SIXTEEN_BITS))
def test_a_router_scored_in_16_bits_is_found_once(name):
    text = source(SIXTEEN_BITS[name])
    found = [f for f in check_source(text) if f.rule == "ROUTER001"]
    assert len(found) == 1, found
    assert found[0].severity == "warning" and "16 bits" in found[0].message
    assert "float32" in found[0].replacement
    check = check_sources([("moe.py", text)])
    assert [s.dtype for s in check.routers] == ["16-bit"] and check.routers[0].line == found[0].line


@pytest.mark.parametrize("name", sorted(FLOAT32_OR_NOT_SAID))
def test_a_float32_router_or_one_whose_type_the_code_does_not_say_is_not_reported(name):
    text = source(FLOAT32_OR_NOT_SAID[name])
    assert [f for f in check_source(text) if f.rule == "ROUTER001"] == []
    check = check_sources([("moe.py", text)])
    expected = "not said" if name in ("haiku-no-dtype", "bf16-activations-are-not-the-routers-type") else "float32"
    assert [s.dtype for s in check.routers] == [expected]


@pytest.mark.parametrize("name", sorted(NOT_ROUTERS))
def test_gates_and_scores_that_are_no_router_are_no_site(name):
    text = source(NOT_ROUTERS[name])
    assert [f for f in check_source(text) if f.rule == "ROUTER001"] == []
    assert check_sources([("x.py", text)]).routers == ()


def test_the_sites_travel_with_the_check():
    check = check_sources([("a.py", source(SIXTEEN_BITS["linen-compact"])),
                           ("b.py", source(FLOAT32_OR_NOT_SAID["maxtext-style-cast"]))])
    assert [(s.file, s.dtype) for s in check.routers] == [("a.py", "16-bit"), ("b.py", "float32")]
    assert CodeCheck.from_dict(check.to_dict()) == check
    assert CodeCheck.from_dict({k: v for k, v in check.to_dict().items() if k != "routers"}).routers == ()
