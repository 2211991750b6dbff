"""The compiled FFI kernels against their jnp references, their derivatives, and their ops.

Kernels must equal the references to 1e-12 (float64) and 1e-5 (float32) relative to the
largest entry, pass ``jax.test_util.check_grads`` in reverse mode, refuse wrong inputs
before calling the kernel, work inside ``shard_map`` with ``check_vma=True``, and fail
with a build instruction when the library is missing.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, Mesh
from jax.sharding import PartitionSpec as P
from ase.neighborlist import neighbor_list as ase_neighbor_list
from jax.test_util import check_grads

from jaxdd import ffi
from jaxdd.ffi import _library
from jaxdd.ops import SpecError, get_op, register_op
from jaxdd.data.systems import fcc_lattice

pytestmark = pytest.mark.skipif(not ffi.available(), reason="compiled kernels not built (pip install -e .)")

CUTOFF = 2.5
SIGMA = np.array([[1.0, 1.1], [1.1, 1.2]])
EPSILON = np.array([[1.0, 0.8], [0.8, 0.6]])
RTOL = {np.float64: 1e-12, np.float32: 1e-5}


@functools.lru_cache(maxsize=None)
def lj_system(half_list=False, dtype=np.float64):
    """108 atoms of a rattled LJ fcc crystal (a = 1.68 σ), two types: (positions, shifts, cells,
    senders, receivers, mask, types), the COO list (r_c = 2.5 σ) from ASE with 10 padding edges
    at the end (mask False, index n)."""
    atoms = fcc_lattice(3, 1.6796)
    atoms.rattle(0.05, seed=3)
    n = len(atoms)
    i, j, shift = ase_neighbor_list("ijS", atoms, CUTOFF)
    if half_list:  # each pair once: the one with i < j, or with the positive image shift
        keep = (i < j) | ((i == j) & np.array([tuple(v) > (0, 0, 0) for v in shift], bool))
        i, j, shift = i[keep], j[keep], shift[keep]
    pad = 10
    receivers = np.concatenate([i, np.full(pad, n)]).astype(np.int32)
    senders = np.concatenate([j, np.full(pad, n)]).astype(np.int32)
    shifts = np.concatenate([shift, np.zeros((pad, 3))]).astype(np.int32)
    mask = np.arange(len(senders)) < len(i)
    types = np.random.default_rng(0).integers(0, 2, n).astype(np.int32)
    return (jnp.asarray(atoms.positions, dtype), jnp.asarray(shifts), jnp.asarray(np.asarray(atoms.cell)[None], dtype),
            jnp.asarray(senders), jnp.asarray(receivers), jnp.asarray(mask), jnp.asarray(types))


def lj_kwargs(types, half_list=False, shift=True):
    return dict(cutoff=CUTOFF, types=types, shift=shift, half_list=half_list)


# The references compiled (an eager autodiff pass is slow).
lj_reference = jax.jit(ffi.lennard_jones_reference, static_argnames=("cutoff", "shift", "half_list"))
attention_reference = jax.jit(ffi.attention_message_reference)


def assert_rel_close(got, want, rtol):
    got, want = np.asarray(got), np.asarray(want)
    scale = max(float(np.max(np.abs(want))), 1e-300)
    assert float(np.max(np.abs(got - want))) <= rtol * scale, (float(np.max(np.abs(got - want))), scale)


# ----------------------------------------------------------------------------- kernel 1: LJ


@pytest.mark.parametrize("half_list", [False, True], ids=["full", "half"])
@pytest.mark.parametrize("dtype", [np.float64, np.float32], ids=["f64", "f32"])
def test_lj_kernel_equals_its_jnp_reference(half_list, dtype):
    pos, shifts, cells, s, r, mask, types = lj_system(half_list, dtype)
    sig, eps = SIGMA.astype(dtype), EPSILON.astype(dtype)
    got = ffi.lennard_jones(pos, shifts, cells, s, r, mask, sig, eps, **lj_kwargs(types, half_list))
    want = lj_reference(pos, shifts, cells, s, r, mask, sig, eps, **lj_kwargs(types, half_list))
    for g, w in zip(got, want):  # energies, forces, virial
        assert g.dtype == dtype
        assert_rel_close(g, w, RTOL[dtype])


def test_lj_kernel_full_and_half_lists_give_the_same_totals():
    full = ffi.lennard_jones(*lj_system(False)[:6], SIGMA, EPSILON, **lj_kwargs(lj_system(False)[6]))
    half = ffi.lennard_jones(*lj_system(True)[:6], SIGMA, EPSILON, **lj_kwargs(lj_system(True)[6], True))
    assert_rel_close(jnp.sum(half[0]), jnp.sum(full[0]), 1e-12)
    assert_rel_close(half[1], full[1], 1e-12)
    assert_rel_close(jnp.sum(half[2], axis=0), jnp.sum(full[2], axis=0), 1e-12)


def assert_same_sums(got, want, rtol):
    """The same bits on a CPU; on a GPU, whose kernel adds forces with float atomics in the
    order threads arrive, equal to ``rtol`` relative to the largest entry."""
    if next(iter(got.devices())).platform == "cpu":
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    else:
        assert_rel_close(got, want, rtol)


def test_lj_kernel_reads_shifts_of_zero_rows_as_no_image_shifts():
    """A rank's list has no image shifts; [0, 3] says so and must equal zeros, in value and gradient."""
    import ase.build

    atoms = ase.build.bulk("Ar", "fcc", a=1.6796, cubic=True).repeat((3, 3, 3))  # open cluster: no images
    atoms.rattle(0.05, seed=4)
    i, j = ase_neighbor_list("ij", atoms, CUTOFF)  # pbc False: every shift is zero
    pos = jnp.asarray(atoms.positions)
    args = (jnp.eye(3)[None], jnp.asarray(j, jnp.int32), jnp.asarray(i, jnp.int32), jnp.ones(len(i), bool), 1.0, 1.0)
    none = jnp.zeros((0, 3), jnp.int32)
    zeros = jnp.zeros((len(i), 3), jnp.int32)
    for got, want in zip(ffi.lennard_jones(pos, none, *args, cutoff=CUTOFF), ffi.lennard_jones(pos, zeros, *args,
                                                                                             cutoff=CUTOFF)):
        assert_same_sums(got, want, 1e-12)
    grad = lambda sh: jax.grad(lambda p, c: jnp.sum(ffi.lennard_jones(p, sh, c, *args[1:], cutoff=CUTOFF)[0]),  # noqa: E731
                               argnums=(0, 1))(pos, args[0])
    for got, want in zip(grad(none), grad(zeros)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-12, atol=1e-12)
    ref = lj_reference(pos, none, *args, cutoff=CUTOFF)
    assert_rel_close(ref[1], ffi.lennard_jones(pos, none, *args, cutoff=CUTOFF)[1], 1e-12)


@pytest.mark.parametrize("half_list", [False, True], ids=["full", "half"])
@pytest.mark.parametrize("dtype", [np.float64, np.float32], ids=["f64", "f32"])
def test_lj_kernel_without_shifts_gives_the_bits_of_the_pass_that_reads_them(half_list, dtype):
    """A list with no image shifts takes a vector pass on CPUs that have one; it must keep the
    same pairs and give the same bits as the scalar pass, padding edges scattered through the
    list (mask off, indices out of range) and a length that is no multiple of the vector."""
    import ase.build

    atoms = ase.build.bulk("Ar", "fcc", a=1.6796, cubic=True).repeat((3, 3, 3))  # open cluster: no images
    atoms.rattle(0.05, seed=5)
    i, j = ase_neighbor_list("ij", atoms, CUTOFF + 0.3)  # a skin: pairs beyond the cutoff too
    if half_list:
        i, j = i[i < j], j[i < j]
    n, e = len(atoms), len(i)
    rng = np.random.default_rng(1)
    mask = rng.random(e) > 0.1
    i, j = i.astype(np.int32), j.astype(np.int32)
    i[rng.random(e) < 0.02] = n  # padding by index: receiver or sender out of range
    j[rng.random(e) < 0.02] = -1
    keep = slice(0, e - 3)  # not a multiple of 4 (or 8)
    pos = jnp.asarray(atoms.positions, dtype)
    types = jnp.asarray(rng.integers(0, 2, n), jnp.int32)
    args = (jnp.asarray(j[keep]), jnp.asarray(i[keep]), jnp.asarray(mask[keep]), SIGMA.astype(dtype),
            EPSILON.astype(dtype))
    cells = jnp.eye(3, dtype=dtype)[None]
    none = jnp.zeros((0, 3), jnp.int32)
    zeros = jnp.zeros((len(i[keep]), 3), jnp.int32)
    kw = lj_kwargs(types, half_list)
    vector = ffi.lennard_jones(pos, none, cells, *args, **kw)
    scalar = ffi.lennard_jones(pos, zeros, cells, *args, **kw)
    for got, want in zip(vector, scalar):
        assert_same_sums(got, want, RTOL[dtype])
    assert float(jnp.abs(vector[1]).sum()) > 0


def test_lj_kernel_forces_are_minus_the_energy_gradient_of_the_reference():
    pos, shifts, cells, s, r, mask, types = lj_system()
    _, forces, _ = ffi.lennard_jones(pos, shifts, cells, s, r, mask, SIGMA, EPSILON, **lj_kwargs(types))
    grad = jax.grad(lambda p: jnp.sum(lj_reference(p, shifts, cells, s, r, mask, SIGMA, EPSILON,
                                                                  **lj_kwargs(types))[0]))(pos)
    assert_rel_close(forces, -grad, 1e-12)


def test_lj_op_gradients_pass_check_grads():
    pos, shifts, cells, s, r, mask, types = lj_system()
    pos = pos[:40]  # fewer atoms, fewer finite differences: edges past row 40 are padding
    keep = (s < 40) & (r < 40) & mask

    def energies(p, h, sig, eps):
        return ffi.lennard_jones(p, shifts, h, s, r, keep, sig, eps, **lj_kwargs(types[:40]))[0]

    check_grads(energies, (pos, cells, jnp.asarray(SIGMA), jnp.asarray(EPSILON)), order=1, modes=("rev",))


def test_lj_op_forces_and_virial_are_differentiable():
    pos, shifts, cells, s, r, mask, types = lj_system()
    pos = pos[:40]
    keep = (s < 40) & (r < 40) & mask

    def forces_and_virial(p, h):
        _, f, w = ffi.lennard_jones(p, shifts, h, s, r, keep, SIGMA, EPSILON, **lj_kwargs(types[:40]))
        return f, w

    check_grads(forces_and_virial, (pos, cells), order=1, modes=("rev",))


# ---------------------------------------------------------------------- kernel 2: attention


def attention_inputs(dtype=np.float64, features=5):
    pos, _, _, s, r, mask, _ = lj_system(False, dtype)
    n = pos.shape[0]
    rng = np.random.default_rng(1)
    q, k, v = (jnp.asarray(rng.standard_normal((n, features)), dtype) for _ in range(3))
    w = jnp.where(mask, jnp.asarray(rng.uniform(size=mask.shape), dtype), 0.0).astype(dtype)
    return q, k, v, w, s, r


@pytest.mark.parametrize("dtype", [np.float64, np.float32], ids=["f64", "f32"])
def test_attention_kernel_equals_its_jnp_reference(dtype):
    args = attention_inputs(dtype)
    got = ffi.attention_message(*args)
    assert got.dtype == dtype
    assert_rel_close(got, attention_reference(*args), RTOL[dtype])


def test_attention_vjp_kernel_equals_the_reference_gradient():
    q, k, v, w, s, r = attention_inputs()
    ct = jnp.asarray(np.random.default_rng(2).standard_normal(q.shape))

    def loss(fn):
        return lambda *a: jnp.sum(fn(*a, s, r) * ct)

    got = jax.grad(loss(ffi.attention_message), argnums=(0, 1, 2, 3))(q, k, v, w)
    want = jax.grad(loss(attention_reference), argnums=(0, 1, 2, 3))(q, k, v, w)
    for g, x in zip(got, want):
        assert_rel_close(g, x, 1e-12)


def test_attention_op_gradients_pass_check_grads():
    q, k, v, w, s, r = attention_inputs(features=3)
    check_grads(lambda q, k, v, w: ffi.attention_message(q, k, v, w, s, r), (q, k, v, w), order=1, modes=("rev",))


# ------------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda a: {**a, "positions": a["positions"].astype(jnp.float16)}, "positions must be float32 or float64"),
        (lambda a: {**a, "positions": a["positions"][:, :2]}, "positions must have shape [?, 3]"),
        (lambda a: {**a, "senders": a["senders"].astype(jnp.int64)}, "senders must be int32"),
        (lambda a: {**a, "receivers": a["receivers"][:-1]}, "receivers must have shape"),
        (lambda a: {**a, "mask": a["mask"].astype(jnp.int32)}, "mask must be bool"),
        (lambda a: {**a, "shifts": a["shifts"].astype(jnp.float64)}, "shifts must be int32"),
        (lambda a: {**a, "cells": a["cells"][:, :2]}, "cells must have shape [?, 3, 3]"),
        (lambda a: {**a, "sigma": np.ones((3, 2))}, "sigma must have shape [3, 3]"),
    ],
    ids=["positions-dtype", "positions-shape", "senders-dtype", "receivers-shape", "mask-dtype", "shifts-dtype",
         "cells-shape", "sigma-shape"],
)
def test_lj_kernel_refuses_wrong_inputs_naming_the_argument(change, message):
    pos, shifts, cells, s, r, mask, types = lj_system()
    args = dict(positions=pos, shifts=shifts, cells=cells, senders=s, receivers=r, mask=mask, sigma=SIGMA,
                epsilon=EPSILON)
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("?", r"\?")):
        ffi.lennard_jones(**change(args), **lj_kwargs(types))


def test_attention_kernel_refuses_values_of_another_shape():
    q, k, v, w, s, r = attention_inputs()
    with pytest.raises(ValueError, match=r"attention_message: v must have shape \[108, 5\]"):
        ffi.attention_message(q, k, v[:, :4], w, s, r)


def test_missing_library_fails_the_kernel_call_with_build_instructions(monkeypatch):
    monkeypatch.setattr(_library, "_registered", {})
    monkeypatch.setenv("JAXDD_KERNELS_LIBRARY", "")
    q, k, v, w, s, r = attention_inputs(features=7)  # a shape not compiled before: the call really traces
    with pytest.raises(ffi.KernelLibraryError, match=r"not built; build it .*pip install -e \."):
        ffi.attention_message(q, k, v, w, s, r)


def test_a_library_without_a_declared_kernel_names_the_missing_handler(monkeypatch):
    monkeypatch.setattr(_library, "_declared", dict(_library._declared))
    _library.declare("no_such_kernel")
    with pytest.raises(ffi.KernelLibraryError, match=r"has no handler jaxdd_no_such_kernel_f32 .*pip install -e \."):
        _library.ensure_registered(("no_such_kernel",))
    with pytest.raises(ValueError, match="was not declared"):
        _library.ensure_registered(("never_declared",))


_WITHOUT_LIBRARY = r"""
import json, sys
import jax.numpy as jnp
import jaxdd, jaxdd.ffi
from jaxdd.spec import MLIPSpec
from jaxdd.models.lj import LennardJones
from jaxdd.data.systems import fcc_lattice
spec = MLIPSpec.from_json(sys.argv[1])  # names jaxdd_ffi::lj_pair: resolved on load
energy = jaxdd.compute(LennardJones(), jaxdd.AtomicData.from_ase(fcc_lattice(2, 1.6796)), outputs=("energy",))
print(json.dumps({"ops": [a.op.name for a in spec.distribution.custom_ops], "energy": float(energy["energy"][0]),
                  "available": jaxdd.ffi.available()}))
try:
    jaxdd.ffi.lennard_jones(jnp.zeros((2, 3)), jnp.zeros((1, 3), jnp.int32), jnp.eye(3), jnp.zeros(1, jnp.int32),
                            jnp.zeros(1, jnp.int32), jnp.ones(1, bool), 1.0, 1.0, cutoff=2.5)
except jaxdd.ffi.KernelLibraryError as exc:
    print("ERROR", exc)
"""


def test_a_fresh_process_without_the_library_loads_specs_and_runs_the_jnp_path(tmp_path):
    from jaxdd.models.lj_kernel import SPEC_LJ_KERNEL_HALO

    env = dict(os.environ, JAXDD_KERNELS_LIBRARY="", JAX_PLATFORMS="cpu", JAX_NUM_CPU_DEVICES="1")
    proc = subprocess.run([sys.executable, "-c", _WITHOUT_LIBRARY, SPEC_LJ_KERNEL_HALO.to_json()], env=env,
                          capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    result = json.loads(lines[0])
    assert result["ops"] == ["jaxdd_ffi::lj_pair"] and result["available"] is False
    assert result["energy"] < 0
    assert lines[1].startswith("ERROR jaxdd's compiled kernels") and "pip install -e ." in lines[1]


# ------------------------------------------------------------------------ named ops, shard_map


def test_lj_op_is_named_and_resolves_by_name():
    assert get_op("jaxdd_ffi::lj_pair") is ffi.LJ_OP and ffi.LJ_OP.differentiable
    assert get_op("jaxdd_ffi::attention_message") is ffi.ATTENTION_OP
    pos, shifts, cells, s, r, mask, types = lj_system()
    jaxpr = jax.make_jaxpr(lambda p: ffi.lennard_jones(p, shifts, cells, s, r, mask, SIGMA, EPSILON,
                                                       **lj_kwargs(types)))(pos)
    names = [e.params.get("name") for e in jaxpr.jaxpr.eqns]
    assert "jaxdd_ffi::lj_pair" in names


_seen_cotangents = []


def _twice_and_thrice(x):
    return 2.0 * x, 3.0 * x


def _recording_backward(residuals, cts):
    _seen_cotangents.append(tuple(c is None for c in cts))
    ct2, ct3 = cts
    return (0.0 if ct2 is None else 20.0 * ct2) + (0.0 if ct3 is None else 30.0 * ct3),


def test_register_op_with_bwd_uses_that_rule_and_marks_unused_outputs_none():
    op = register_op("ffitest::twice_and_thrice", _twice_and_thrice, bwd=_recording_backward)
    _seen_cotangents.clear()
    assert float(jax.grad(lambda x: op(x)[0])(1.0)) == 20.0  # the rule, not the derivative of fn
    assert _seen_cotangents[-1] == (False, True)
    assert float(jax.grad(lambda x: jnp.sum(jnp.stack(op(x))))(1.0)) == 50.0
    assert _seen_cotangents[-1] == (False, False)


def test_register_op_refuses_fwd_without_bwd():
    with pytest.raises(SpecError, match="fwd without bwd"):
        register_op("ffitest::half_rule", _twice_and_thrice, fwd=lambda x: (_twice_and_thrice(x), x))


@pytest.mark.parametrize("kernel", ["lj", "attention"])
def test_kernel_gradient_inside_shard_map_with_vma_checks(kernel):
    ranks = min(4, len(jax.devices()))  # 4 virtual CPU devices; one GPU is one
    mesh = Mesh(np.asarray(jax.devices()[:ranks]), ("dd",), axis_types=(AxisType.Auto,))
    if kernel == "lj":
        pos, shifts, cells, s, r, mask, types = lj_system()

        def energy(x):
            return jnp.sum(ffi.lennard_jones(x, shifts, cells, s, r, mask, SIGMA, EPSILON, **lj_kwargs(types))[0])
    else:
        pos, k, v, w, s, r = attention_inputs()

        def energy(x):
            return jnp.sum(ffi.attention_message(x, k, v, w, s, r) ** 2)

    def rank(x):  # each rank its own scaled copy; the energies summed over ranks
        scale = 1.0 + 0.01 * jax.lax.axis_index("dd")
        return jax.grad(lambda y: jax.lax.psum(energy(y[0] * scale), "dd"))(x)

    got = jax.shard_map(rank, mesh=mesh, in_specs=P("dd"), out_specs=P("dd"), check_vma=True)(
        jnp.stack([pos] * ranks))
    for i in range(ranks):
        want = jax.grad(lambda y: energy(y * (1.0 + 0.01 * i)))(pos)
        assert_rel_close(got[i], want, 1e-12)
