"""``AllReduceSum(replicated_consumer=True)``: the sum's backward pass has no collective.

When every rank uses the reduced value identically, every rank's cotangent is the same and
their sum over ranks is ``n_ranks`` times the rank's own: the dispatch then differentiates
the all-reduce as that scaling, without a second ``psum``. The first test shows the effect
itself (a consumer that differs between ranks sees the scaling, not the sum, so the test
fails if the field is ignored); the second that the two agree where the field is meant to
be used; the third that the backward collective is gone.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, Mesh
from jax.sharding import PartitionSpec as P

from jaxdd.dispatch import DispatchReport, Dispatcher, Kind, Layout, Runtime
from jaxdd.ops import AllReduceSum, HaloStoragePolicy, get_op, register_op
from jaxdd.spec import OpAdapter

N_RANKS, N_ROWS = 4, 3

register_op("consumertest::squares", lambda x: jnp.sum(x * x, axis=0))


def rank_losses(replicated_consumer: bool, weights):
    """A function of per-rank rows x [N_RANKS, N_ROWS, 2] → Σ_r weights[r] · Σ_ranks squares(x_r),
    with the all-reduce done by the dispatch under the given transform."""
    adapter = OpAdapter("consumertest::squares", output_transforms={0: AllReduceSum(replicated_consumer)})
    closed = jax.make_jaxpr(lambda a: get_op("consumertest::squares")(a))(jnp.zeros((N_ROWS, 2)))
    mesh = Mesh(np.asarray(jax.devices()[:N_RANKS]), ("dd",), axis_types=(AxisType.Auto,))

    def rank(xr, wr):
        rt = Runtime(None, None, ("dd",), HaloStoragePolicy(), jnp.ones(N_ROWS, bool), ops={str(adapter.op): adapter},
                     n_ranks=N_RANKS)
        (total,) = Dispatcher(rt, DispatchReport(), (N_ROWS, 0, 1)).run_closed(closed, [xr[0]], [Layout(Kind.NODE)])
        return (wr[0] * jnp.sum(total))[None]  # this rank's term of the loss

    on_ranks = jax.shard_map(rank, mesh=mesh, in_specs=(P("dd"), P("dd")), out_specs=P("dd"), check_vma=False)
    return lambda x: jnp.sum(on_ranks(x, weights))


X = jnp.arange(N_RANKS * N_ROWS * 2, dtype=jnp.float64).reshape(N_RANKS, N_ROWS, 2) / 10.0


def test_the_backward_pass_scales_this_ranks_cotangent_instead_of_summing_all():
    weights = jnp.arange(1.0, N_RANKS + 1.0)  # a consumer that differs between ranks
    grad_sum = jax.grad(rank_losses(False, weights))(X)
    grad_scaled = jax.grad(rank_losses(True, weights))(X)
    np.testing.assert_allclose(grad_sum, 2 * X * jnp.sum(weights), rtol=1e-14)
    np.testing.assert_allclose(grad_scaled, 2 * X * N_RANKS * weights[:, None, None], rtol=1e-14)


def test_with_a_replicated_consumer_both_backward_passes_agree():
    weights = jnp.full((N_RANKS,), 1.0 / N_RANKS)  # each rank's share of a replicated energy
    f_sum, f_scaled = rank_losses(False, weights), rank_losses(True, weights)
    assert float(f_sum(X)) == pytest.approx(float(f_scaled(X)), rel=1e-15)
    np.testing.assert_allclose(jax.grad(f_scaled)(X), jax.grad(f_sum)(X), rtol=1e-14)
    np.testing.assert_allclose(jax.grad(f_scaled)(X), 2 * X, rtol=1e-14)


def test_the_backward_pass_of_a_replicated_consumer_has_no_collective():
    weights = jnp.full((N_RANKS,), 1.0 / N_RANKS)

    def count_psums(replicated_consumer):
        text = str(jax.make_jaxpr(jax.grad(rank_losses(replicated_consumer, weights)))(X))
        return text.count("psum")

    assert count_psums(False) == 2  # forward sum, and its transpose
    assert count_psums(True) == 1  # forward sum only
