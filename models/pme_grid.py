"""The PME charge grid: B-spline spreading onto a periodic mesh, the smooth-PME reciprocal
energy, and its distributed form (mesh halo exchange and a distributed 3-D FFT).

(The "mesh" here is the charge grid of particle-mesh Ewald, not a device mesh; this module
was called ``jaxdd.mesh`` before, which remains as a deprecated alias.)

Single device, everything here is plain JAX: :func:`spread` puts per-atom values on a
``[S, K1, K2, K3]`` mesh with cardinal B-splines, :func:`pme_energy` spreads, FFTs with
``jnp.fft`` and sums the Ewald influence function over the mesh.

:func:`pme_energy` is a verb (a named ``jax.jit``, ``"jaxdd::pme_energy"``, like those of
:mod:`jaxdd.dispatch.intent`) whose dispatch rule this module registers
(:func:`jaxdd.dispatch.register_rule`): under :class:`~jaxdd.DistributedModel` it runs as
:func:`distributed_pme_energy`, which never holds the whole mesh on a rank:

1. the mesh is cut into blocks by the rank grid ``(Px, Py, Pz)`` of the spatial partition,
   rank ``(i, j, k)`` owning mesh points ``[i K1/Px, (i+1) K1/Px) × ...``, the block its owned
   atoms lie in;
2. each rank spreads its owned atoms onto a window of its block plus the B-spline stencil
   (``order`` points below, 1 above, along the axes the grid cuts), then the window's rows
   that belong to other blocks are sent to their owners (``ppermute``, axis by axis, so
   corners travel in two or three hops) and added there: the *mesh halo* exchange;
3. the 3-D FFT runs as three 1-D FFTs, each after an ``all_to_all`` transpose inside the
   group of ranks that share the other two block coordinates, so that the transformed
   axis is whole on every rank (z, then y, then x);
4. each rank evaluates the influence function on its own block of wave vectors and sums;
   the ranks' sums are all-reduced.

Per-rank mesh memory is O(K1 K2 K3 / P) plus the stencil surface. Every step is linear
or elementwise, so forces and stress come from JAX's transposes of the same collectives.
The mesh must divide by the grid (:func:`mesh_problems`); PME chooses auto sizes that do.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from ..data.checks import integral
from ..dispatch import Decision, Kind, Layout, register_rule
from ..ops import GraphParallelPolicy, register_op

__all__ = ["bspline_weights", "bspline_moduli", "check_order", "spread", "pme_energy", "pme_sum", "influence",
           "distributed_pme_energy", "pme_energy_rule", "mesh_problems", "spread_op"]


# --------------------------------------------------------------------------- B-splines


def bspline_weights(u, order: int):
    """Cardinal B-spline weights of scaled coordinates ``u [..., 3]`` (mesh units).

    Args:
      u: [..., 3] scaled fractional coordinates K·frac.
      order: the B-spline order p.

    Returns:
      ``(base [..., 3] int32, w [..., 3, order])``: the value spread onto mesh point
      ``base - j`` along an axis has weight ``w[..., j] = M_order(u - base + j)``.
    """
    base = jnp.floor(u)
    t = (u - base)[..., None]
    # M_2(t + j) for j = 0, 1, then M_n(x) = (x M_{n-1}(x) + (n - x) M_{n-1}(x - 1)) / (n - 1):
    # every term is positive, so the recursion is stable in float32 too.
    w = jnp.concatenate([t, 1.0 - t], axis=-1)
    for n in range(3, order + 1):
        j = jnp.arange(n, dtype=u.dtype)
        x = t + j
        this = jnp.concatenate([w, jnp.zeros_like(t)], axis=-1)  # M_{n-1}(t + j)
        below = jnp.concatenate([jnp.zeros_like(t), w], axis=-1)  # M_{n-1}(t + j - 1)
        w = (x * this + (n - x) * below) / (n - 1)
    return base.astype(jnp.int32), w


def bspline_moduli(size: int, order: int) -> np.ndarray:
    """|b(m)|² of smooth PME (Essmann et al. 1995, eq. 4.4) for m = 0 .. size-1 (numpy, float64).

    Args:
      size: the mesh points K along the axis.
      order: the B-spline order p.

    Returns:
      [size] float64 moduli.
    """
    vals = _bspline_integer_values(order)  # M_order(k + 1), k = 0 .. order-2
    m = np.arange(size)[:, None]
    k = np.arange(order - 1)[None, :]
    denom = np.abs(np.sum(vals[None, :] * np.exp(2j * np.pi * m * k / size), axis=1)) ** 2
    return 1.0 / denom


def _bspline_integer_values(order: int) -> np.ndarray:
    """M_order(k) at k = 1 .. order-1 (numpy)."""
    def m(n, x):
        if n == 2:
            return max(0.0, 1.0 - abs(x - 1.0))
        return (x * m(n - 1, x) + (n - x) * m(n - 1, x - 1.0)) / (n - 1)

    return np.array([m(order, float(k)) for k in range(1, order)])


def check_order(order) -> int:
    """``order`` as an int if it is a valid B-spline order (even, >= 4); else a ValueError."""
    order = integral("the B-spline order", order, minimum=4)
    if order % 2:
        raise ValueError(f"the B-spline order must be an even integer >= 4 (odd orders have zeros in their moduli), "
                         f"got {order!r}")
    return order


# --------------------------------------------------------------------------- single device


def _scatter(values, weights, rows, system, dims):
    """Σ over atoms and stencil points of values · w_x w_y w_z into a [S, *dims] mesh.

    values [n]; weights [n, 3, p]; rows [n, 3, p] int mesh indices already inside ``dims``;
    system [n] int in [0, S).
    """
    d1, d2, d3 = dims
    w = (values[:, None, None, None] * weights[:, 0, :, None, None] * weights[:, 1, None, :, None]
         * weights[:, 2, None, None, :])  # [n, p, p, p]
    flat = (((system[:, None, None, None] * d1 + rows[:, 0, :, None, None]) * d2 + rows[:, 1, None, :, None]) * d3
            + rows[:, 2, None, None, :])
    return w.reshape(-1), flat.reshape(-1)


def spread(values, weights, base, system, n_systems: int, shape):
    """Values [n] (e.g. charges, e) spread on a periodic ``[n_systems, *shape]`` mesh.

    Args:
      values: [n] values to spread (e.g. charges, e).
      weights, base: from :func:`bspline_weights`.
      system: [n] int system of each row.
      n_systems: S.
      shape: the mesh (K1, K2, K3).

    Returns:
      [n_systems, *shape] mesh.
    """
    shape = tuple(int(k) for k in shape)
    p = weights.shape[-1]
    j = jnp.arange(p, dtype=base.dtype)
    k = jnp.asarray(shape, base.dtype)
    rows = jnp.mod(base[:, :, None] - j, k[:, None])
    w, flat = _scatter(values, weights, rows, system, shape)
    mesh = jax.ops.segment_sum(w, flat, num_segments=n_systems * math.prod(shape))
    return mesh.reshape((n_systems,) + shape)


def _signed(m, size: int):
    return jnp.where(m <= size // 2, m, m - size)


def influence(m1, m2, m3, recip, volume, alpha, moduli):
    """Smooth-PME influence function on wave-vector indices (per axis, int arrays).

    G(m) = exp(-π² |m|² / α²) / |m|² · |b1(m1)|² |b2(m2)|² |b3(m3)|² / (2π V), and 0 at m = 0,
    with m = m1 b1 + m2 b2 + m3 b3 (b_a the rows of ``recip``).

    Args:
      m1, m2, m3: int wave-vector indices along each axis.
      recip: [S, 3, 3] reciprocal vectors as rows (Å⁻¹, without 2π).
      volume: [S] Å³.
      alpha: Ewald splitting α (Å⁻¹).
      moduli: (|b1|² [K1], |b2|² [K2], |b3|² [K3]) from :func:`bspline_moduli`.

    Returns:
      [S, len(m1), len(m2), len(m3)] (Å).
    """
    b1, b2, b3 = (jnp.asarray(b) for b in moduli)
    s1, s2, s3 = (_signed(m, b.shape[0]).astype(recip.dtype) for m, b in zip((m1, m2, m3), moduli))
    gram = jnp.einsum("sai,sbi->sab", recip, recip)
    x = s1[None, :, None, None]
    y = s2[None, None, :, None]
    z = s3[None, None, None, :]
    g = gram[:, :, :, None, None, None]
    msq = (g[:, 0, 0] * x * x + g[:, 1, 1] * y * y + g[:, 2, 2] * z * z
           + 2 * (g[:, 0, 1] * x * y + g[:, 0, 2] * x * z + g[:, 1, 2] * y * z))
    zero = (s1[:, None, None] == 0) & (s2[None, :, None] == 0) & (s3[None, None, :] == 0)
    safe = jnp.where(zero[None], 1.0, msq)
    bsq = (b1[m1][:, None, None] * b2[m2][None, :, None] * b3[m3][None, None, :]).astype(recip.dtype)
    g = jnp.exp(-(math.pi ** 2) * safe / alpha ** 2) / safe * bsq[None] / (2 * math.pi * volume[:, None, None, None])
    return jnp.where(zero[None], 0.0, g)


def pme_sum(mesh, recip, volume, alpha, moduli):
    """Σ_m G(m) |F(Q)(m)|² per system [S] (e²/Å) of a full mesh ``[S, K1, K2, K3]``.

    Args:
      mesh: [S, K1, K2, K3] spread charges (e).
      recip, volume, alpha, moduli: as for :func:`pme_energy`.

    Returns:
      [S] sums (e²/Å).
    """
    # Three 1-D transforms, in the order the distributed FFT takes them (the same numbers,
    # and XLA's cost analysis counts them alike).
    f = jnp.fft.fft(jnp.fft.fft(jnp.fft.fft(mesh, axis=3), axis=2), axis=1)
    k1, k2, k3 = (b.shape[0] for b in moduli)
    g = influence(jnp.arange(k1), jnp.arange(k2), jnp.arange(k3), recip, volume, alpha, moduli)
    return jnp.sum(g * (f.real ** 2 + f.imag ** 2), axis=(1, 2, 3))


def _pme_energy(values, weights, base, system, recip, volume, alpha, b1, b2, b3):
    moduli = (b1, b2, b3)
    shape = tuple(b.shape[0] for b in moduli)
    mesh = spread(values, weights, base, system, recip.shape[0], shape)
    return pme_sum(mesh, recip, volume, alpha, moduli)


_pme_energy.__name__ = _pme_energy.__qualname__ = "jaxdd::pme_energy"
_pme_energy_verb = jax.jit(_pme_energy)


def pme_energy(values, weights, base, system, recip, volume, alpha, moduli):
    """Smooth-PME reciprocal sum Σ_m G(m) |F(Q)(m)|² per system, [S] (e²/Å; times the
    Coulomb constant it is the reciprocal energy).

    A verb: under decomposition the mesh is distributed.

    Args:
      values: [n] charges (e; zero for rows to leave out).
      weights, base: [n, 3, p], [n, 3] from :func:`bspline_weights` of the scaled coordinates K·frac.
      system: [n] int in [0, S).
      recip: [S, 3, 3] reciprocal vectors as rows (Å⁻¹, no 2π).
      volume: [S] Å³.
      alpha: Ewald splitting α (Å⁻¹).
      moduli: (|b1|² [K1], |b2|² [K2], |b3|² [K3]), whose lengths are the mesh shape.

    Returns:
      [S] sums (e²/Å).
    """
    b1, b2, b3 = (jnp.asarray(b, recip.dtype) for b in moduli)
    return _pme_energy_verb(values, weights, base, system, recip, volume, jnp.asarray(alpha, recip.dtype), b1, b2, b3)


def _spread_full(values, weights, base, system, template):
    return template + spread(values, weights, base, system, template.shape[0], template.shape[1:])


#: The replicated-mesh kernel of the PyTorch system's PME, as a named op: per-atom values
#: (positions 0-3) spread onto the full mesh ``template`` [S, K1, K2, K3] (position 4; its
#: values are added to). Its spec adapter slices the atom inputs to owned rows and
#: all-reduces the mesh, which every rank then transforms whole.
spread_op = register_op("jaxdd_mesh::spread", _spread_full)


# --------------------------------------------------------------------------- distributed


def mesh_problems(shape, grid) -> list[str]:
    """Why a mesh ``shape`` (K1, K2, K3) cannot be distributed over a rank ``grid`` (empty if it can).

    Blocks need K_a divisible by P_a; the transposes split K2 by Px and by Py·Pz, and K3 by Py·Pz.

    Args:
      shape: the mesh (K1, K2, K3).
      grid: the ranks (Px, Py, Pz).

    Returns:
      The problems as sentences; empty if the mesh can be distributed.
    """
    k1, k2, k3 = shape
    px, py, pz = grid
    need = [(k1, px, "mesh[0]", "Px"), (k2, py * pz * px // math.gcd(py * pz, px), "mesh[1]", "lcm(Px, Py*Pz)"),
            (k3, py * pz, "mesh[2]", "Py*Pz")]
    return [f"{name} = {k} is not a multiple of {what} = {d}" for k, d, name, what in need if k % d]


def _rank_of(c, grid):
    return (c[0] * grid[1] + c[1]) * grid[2] + c[2]


def _coords(grid):
    return [(i, j, k) for i in range(grid[0]) for j in range(grid[1]) for k in range(grid[2])]


def _shift_perm(grid, axis: int, d: int):
    perm = []
    for c in _coords(grid):
        t = list(c)
        t[axis] = (t[axis] + d) % grid[axis]
        perm.append((_rank_of(c, grid), _rank_of(t, grid)))
    return perm


def _fold(window, axis: int, start, size: int, block: int, n_blocks: int, g, grid, grid_axis: int, axes, p: int):
    """Rows of a window (``window.shape[axis]`` rows from mesh row ``start``, periodic in
    ``size``) summed into the owners' blocks of ``block`` rows; returns this rank's block.

    The window of the rank at block ``g`` along this axis starts at ``g * block - p``: its
    rows can belong to block g and to the blocks a few places away, one ``ppermute`` each."""
    x = jnp.moveaxis(window, axis, 0)
    width = x.shape[0]
    row = jnp.mod(start + jnp.arange(width), size)
    owner = row // block
    local = row - owner * block
    shift = jnp.mod(owner - g, n_blocks)
    # The shifts any rank can need, from its static window geometry.
    shifts = sorted({int(((((gg * block - p + i) % size) // block) - gg) % n_blocks)
                     for gg in range(n_blocks) for i in range(width)})
    out = None
    for d in shifts:
        part = jnp.where((shift == d).reshape((-1,) + (1,) * (x.ndim - 1)), x, 0.0)
        chunk = jax.ops.segment_sum(part, local, num_segments=block)
        if d:
            chunk = jax.lax.ppermute(chunk, axes, _shift_perm(grid, grid_axis, d))
        out = chunk if out is None else out + chunk
    return jnp.moveaxis(out, 0, axis)


def _transpose(x, split_axis: int, concat_axis: int, groups, axes):
    if len(groups[0]) == 1:
        return x
    return jax.lax.all_to_all(x, axes, split_axis, concat_axis, axis_index_groups=groups, tiled=True)


def distributed_pme_energy(runtime, values, weights, base, system, recip, volume, alpha, b1, b2, b3):
    """:func:`pme_energy` on one rank of a decomposition (inside ``shard_map``); see the module docstring.

    Args:
      runtime: the dispatch's :class:`~jaxdd.dispatch.Runtime` (rank grid, mesh axes, owned rows).
      values, weights, base, system: as for :func:`pme_energy`, this rank's local rows; only
        owned rows are spread.
      recip: [S, 3, 3] reciprocal vectors as rows (Å⁻¹, no 2π).
      volume: [S] Å³.
      alpha: Ewald splitting α (Å⁻¹).
      b1, b2, b3: the moduli |b_a|² [K_a] of each axis.

    Returns:
      The same [S] sums on every rank.
    """
    if isinstance(runtime.policy, GraphParallelPolicy) or runtime.layout is None:
        raise ValueError("the distributed PME mesh follows the spatial domains; under graph parallelism use "
                         "PME(distributed_fft=False) (a replicated mesh)")
    grid = tuple(int(g) for g in runtime.layout.grid)
    moduli = (b1, b2, b3)
    shape = tuple(int(b.shape[0]) for b in moduli)
    problems = mesh_problems(shape, grid)
    if problems:
        raise ValueError(f"the PME mesh {shape} does not fit the rank grid {grid}: " + "; ".join(problems)
                         + ". Pass PME(mesh=...) with sizes that divide, leave mesh=None, or use distributed_fft=False")
    owned = runtime.row_mask(Kind.NODE, values.shape[0]) & (values != 0)
    values = jnp.where(owned, values, 0.0)
    if grid == (1, 1, 1):  # one rank holds the whole mesh: the single-device computation
        return _pme_energy(values, weights, base, system, recip, volume, alpha, b1, b2, b3)
    axes = runtime.axis_names
    px, py, pz = grid
    n_sys = recip.shape[0]
    p = weights.shape[-1]
    blocks = tuple(k // g for k, g in zip(shape, grid))
    r = jax.lax.axis_index(axes)
    g = (r // (py * pz), (r // pz) % py, r % pz)

    # 1. spread owned atoms onto this rank's window: block plus p rows below and 1 above
    # along cut axes; an axis not cut (one block) is whole and periodic.
    cut = tuple(n > 1 for n in grid)
    start = tuple(g[a] * blocks[a] - p if cut[a] else 0 for a in range(3))
    width = tuple(c + p + 1 if cut[a] else c for a, c in enumerate(blocks))
    j = jnp.arange(p, dtype=base.dtype)
    unclipped = jnp.stack([base[:, a, None] - j - start[a] if cut[a] else jnp.mod(base[:, a, None] - j, shape[a])
                           for a in range(3)], axis=1)  # [n, 3, p]
    rows = jnp.clip(unclipped, 0, jnp.asarray(width, base.dtype)[:, None] - 1)
    # An owned atom further than a mesh row outside its block (an MD loop that lets atoms
    # wander before they migrate) would be spread onto clipped rows: say so with NaN instead.
    strays = jnp.any(owned[:, None, None] & (rows != unclipped))
    strays = jax.lax.psum(strays.astype(jnp.int32), axes) > 0
    w, flat = _scatter(values, weights, rows, jnp.clip(system, 0, n_sys - 1), width)
    window = jax.ops.segment_sum(w, flat, num_segments=n_sys * math.prod(width)).reshape((n_sys,) + width)

    # 2. mesh halo: window rows of other blocks to their owners, axis by axis.
    for a in range(3):
        if cut[a]:
            window = _fold(window, a + 1, start[a], shape[a], blocks[a], grid[a], g[a], grid, a, axes, p)
    f = window.astype(jnp.result_type(window.dtype, jnp.complex64))

    # 3. distributed FFT: z, y, x, each made whole by a transpose within its rank group.
    z_groups = [[_rank_of((i, j_, k), grid) for k in range(pz)] for i in range(px) for j_ in range(py)]
    y_groups = [[_rank_of((i, j_, k), grid) for j_ in range(py) for k in range(pz)] for i in range(px)]
    x_groups = [[_rank_of((i, j_, k), grid) for i in range(px)] for j_ in range(py) for k in range(pz)]
    f = jnp.fft.fft(_transpose(f, 2, 3, z_groups, axes), axis=3)  # [S, c1, c2/Pz, K3]
    f = jnp.fft.fft(_transpose(f, 3, 2, y_groups, axes), axis=2)  # [S, c1, K2, K3/(Py Pz)]
    f = jnp.fft.fft(_transpose(f, 2, 1, x_groups, axes), axis=1)  # [S, K1, K2/Px, K3/(Py Pz)]

    # 4. this rank's wave vectors, then the sum over ranks.
    n2, n3 = shape[1] // px, shape[2] // (py * pz)
    m1 = jnp.arange(shape[0])
    m2 = g[0] * n2 + jnp.arange(n2)
    m3 = (g[1] * pz + g[2]) * n3 + jnp.arange(n3)
    green = influence(m1, m2, m3, recip, volume, alpha, moduli)
    total = jax.lax.psum(jnp.sum(green * (f.real ** 2 + f.imag ** 2), axis=(1, 2, 3)), axes)
    # NaN in the derivatives too (a `where` would leave the forces finite and wrong).
    return total * jnp.where(strays, jnp.nan, 1.0)


@register_rule("jaxdd::pme_energy")
def pme_energy_rule(ctx, eqn, ins) -> Decision:
    """The dispatch rule of the :func:`pme_energy` verb: per-atom inputs in, per-system sums
    out, the same on every rank; :func:`distributed_pme_energy` owns the mesh exchange and
    the distributed FFT.

    Args:
      ctx: the :class:`~jaxdd.dispatch.interpreter.Dispatcher`.
      eqn: the verb's equation.
      ins: the layout of each input.

    Returns:
      The Decision.
    """

    def apply(eqn, invals):
        return [distributed_pme_energy(ctx.runtime, *invals)]

    return Decision((Layout(Kind.GRAPH, 0),), apply, "verb.pme_energy", replicates=True)
