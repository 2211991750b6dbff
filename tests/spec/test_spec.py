"""Distribution specs: JSON v2 round trips, the preset schema, hostile files, messages, immutability.

A spec is data: whatever a valid spec holds comes back equal (and with an equal hash) from its
file, a damaged file is refused with a SpecError saying what is wrong, and a spec never
changes after it is made, so it can be a static argument of ``jax.jit``.
"""

import copy
import dataclasses
import functools
import json
import re
import uuid
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxdd.spec.adapters import JitAdapter, MethodAdapter, ModuleForwardAdapter, PythonAdapter, resolve_reference
from jaxdd.ops import (
    AllReduceSum,
    GatherInputs,
    GatherInputsFull,
    GraphParallelPolicy,
    HaloRefreshPolicy,
    HaloStoragePolicy,
    ScatterOutputs,
    SliceOutputsOwned,
    SliceOwned,
    SpecError,
    get_op,
    register_op,
)
from jaxdd.spec import (
    DEFAULT_SHARD_FIELDS,
    FORCE_STRATEGIES,
    PRESETS,
    SPEC_DFTD3_HALO,
    SPEC_EWALD_HALO,
    SPEC_LJ_HALO,
    SPEC_MPNN_GP,
    SPEC_MPNN_HALO,
    SPEC_PME_HALO,
    SPEC_UMA_HALO,
    CompilePolicy,
    DistributionSpec,
    MLIPSpec,
    OpAdapter,
    OutputKind,
    SpecWarning,
)

SPEC_DIR = Path(__file__).resolve().parents[2] / "specs"


# --------------------------------------------------------------------------- named ops of this module


def _op_a(x):
    return 3.0 * x


def _op_b(x, y):
    return x * y


def _op_c(x):
    return jnp.sin(x)


def _op_d(x):
    return -x


OP_A = register_op("jaxddtest::op_a", _op_a)
OP_B = register_op("jaxddtest::op_b", _op_b)
OP_C = register_op("jaxddtest::op_c", _op_c)
OP_D = register_op("jaxddtest::op_d", _op_d)
OPS = (OP_A, OP_B, OP_C, OP_D)

# Importable module-level callables usable as saved helper replacements.
REPLACEMENT_REFS = (
    "jaxdd.data.segments:per_system_sum",
    "jaxdd.neighbors:edge_vectors",
    "jaxdd.neighbors:neighbor_capacity",
    "jaxdd.neighbors:neighbor_list",
    "jaxdd.neighbors:build_neighbor_list",
)

ALL_TRANSFORMS = (
    GatherInputs(),
    GatherInputsFull(),
    SliceOwned(),
    ScatterOutputs(),
    AllReduceSum(replicated_consumer=False),
    AllReduceSum(replicated_consumer=True),
    SliceOutputsOwned(),
)

# A spec using every part of the format at least once.
RICH = MLIPSpec(
    distribution=DistributionSpec(
        policy=HaloStoragePolicy(scatter_mode="local", gather_mode="local"),
        custom_ops=(
            OpAdapter(
                OP_A,
                arg_transforms={0: GatherInputs(), 1: GatherInputsFull(), 2: SliceOwned()},
                output_transforms={0: ScatterOutputs(), 1: SliceOutputsOwned()},
            ),
            OpAdapter(
                "jaxddtest::op_b",
                arg_transforms={10: AllReduceSum(replicated_consumer=True)},
                output_transforms={3: AllReduceSum()},
            ),
        ),
        third_party_helpers=(
            PythonAdapter("chem.mol", "mol_sum", "jaxdd.data.segments:per_system_sum"),
            JitAdapter("chem.jitted", "fused", "jaxdd.neighbors:edge_vectors"),
            MethodAdapter("chem.layers", "Conv", "aggregate", resolve_reference("jaxdd.neighbors:neighbor_capacity")),
            ModuleForwardAdapter("chem.layers", "Readout", "jaxdd.neighbors:neighbor_list"),
        ),
        shard_fields=("positions", "charges", "atomic_numbers"),
    ),
    output_kinds={
        "energy": OutputKind.PER_GRAPH,
        "forces": "per_node",
        "charges": OutputKind.PER_NODE,
        "mesh": OutputKind.GLOBAL,
        "legacy": OutputKind.UNKNOWN,
        "dipole": OutputKind.PER_GRAPH,
    },
    owned_only_outputs={"forces", "charges"},
    all_reduce_outputs={"dipole", "mesh"},
    system_reductions=True,
    node_energy_key="atomic_energies",
    node_virial_key="atomic_virials",
    compile=CompilePolicy(
        capacity_factor=1.75,
        growth_factor=3.0,
        max_regrowths=2,
        force_strategy="model_internal",
        stress_via_strain=True,
    ),
)


def minimal_dict(**changes):
    """The smallest valid spec file object, with top-level fields replaced."""
    data = {"version": 2, "core": {"policy": {"kind": "halo"}}}
    data.update(changes)
    return data


# --------------------------------------------------------------------------- strategies

policies = st.one_of(
    st.builds(
        HaloStoragePolicy,
        scatter_mode=st.sampled_from(["halo_correction", "local"]),
        gather_mode=st.sampled_from(["halo_read", "local"]),
    ),
    st.just(HaloRefreshPolicy()),
    st.just(GraphParallelPolicy()),
)
transforms = st.sampled_from(ALL_TRANSFORMS)
transform_maps = st.dictionaries(st.integers(0, 12), transforms, max_size=4)


@st.composite
def op_adapters(draw):
    ops = draw(st.lists(st.sampled_from(OPS), unique=True, max_size=len(OPS)))
    return tuple(
        OpAdapter(draw(st.sampled_from([op, op.name])), draw(transform_maps), draw(transform_maps)) for op in ops
    )


dotted_names = st.lists(st.from_regex(r"[a-z_][a-z0-9_]{0,6}", fullmatch=True), min_size=1, max_size=3).map(".".join)
identifiers = st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,8}", fullmatch=True)
replacements = st.sampled_from(REPLACEMENT_REFS + tuple(resolve_reference(r) for r in REPLACEMENT_REFS))
helper_adapters = st.one_of(
    st.builds(PythonAdapter, dotted_names, identifiers, replacements),
    st.builds(JitAdapter, dotted_names, identifiers, replacements),
    st.builds(MethodAdapter, dotted_names, identifiers, identifiers, replacements),
    st.builds(ModuleForwardAdapter, dotted_names, identifiers, replacements),
)
output_keys = st.text(min_size=1, max_size=12)
compile_policies = st.builds(
    CompilePolicy,
    capacity_factor=st.one_of(st.floats(1.0, 1e12), st.integers(1, 1000)),
    growth_factor=st.one_of(st.floats(1.0, 1e12, exclude_min=True), st.integers(2, 1000)),
    max_regrowths=st.integers(1, 10**6),
    force_strategy=st.sampled_from(FORCE_STRATEGIES),
    stress_via_strain=st.just(True),
)


@st.composite
def specs(draw):
    distribution = DistributionSpec(
        policy=draw(policies),
        custom_ops=draw(op_adapters()),
        third_party_helpers=tuple(draw(st.lists(helper_adapters, max_size=4, unique_by=lambda h: h.target))),
        shard_fields=draw(
            st.one_of(st.just(DEFAULT_SHARD_FIELDS), st.lists(st.sampled_from(["charges", "masses", "velocities"]),
                                                               unique=True).map(lambda f: ("positions", "atomic_numbers", *f)))
        ),
    )
    kinds = draw(st.dictionaries(output_keys, st.sampled_from(list(OutputKind) + [k.value for k in OutputKind])))
    keys = draw(st.lists(output_keys, unique=True, max_size=6))
    where = draw(st.lists(st.sampled_from(["owned", "reduced", "neither"]), min_size=len(keys), max_size=len(keys)))
    owned = {k for k, w in zip(keys, where) if w == "owned"}
    # An owned-only output is per-atom: its declared kind, if any, is PER_NODE.
    kinds = {k: (OutputKind.PER_NODE if k in owned else v) for k, v in kinds.items()}
    return MLIPSpec(
        distribution=distribution,
        output_kinds=kinds,
        owned_only_outputs=owned,
        all_reduce_outputs={k for k, w in zip(keys, where) if w == "reduced"},
        system_reductions=True,
        node_energy_key=draw(st.none() | output_keys),
        node_virial_key=draw(st.none() | output_keys),
        compile=draw(st.none() | compile_policies),
    )


# --------------------------------------------------------------------------- 1. round trips


@settings(max_examples=150)
@given(spec=specs())
def test_any_spec_survives_save_and_load_equal_with_equal_hash(spec, tmp_path_factory):
    path = spec.save(tmp_path_factory.mktemp("spec") / "spec.json")
    loaded = MLIPSpec.load(path)
    assert loaded == spec
    assert hash(loaded) == hash(spec)


@settings(max_examples=150)
@given(spec=specs())
def test_any_spec_survives_to_dict_and_from_dict(spec):
    loaded = MLIPSpec.from_dict(spec.to_dict())
    assert loaded == spec
    assert hash(loaded) == hash(spec)


@settings(max_examples=150)
@given(spec=specs())
def test_any_spec_survives_to_json_and_from_json(spec):
    text = spec.to_json()
    loaded = MLIPSpec.from_json(text)
    assert loaded == spec
    assert hash(loaded) == hash(spec)
    assert loaded.to_json() == text


def test_rich_spec_survives_save_and_load(tmp_path):
    loaded = MLIPSpec.load(RICH.save(tmp_path / "rich.json"))
    assert loaded == RICH
    assert hash(loaded) == hash(RICH)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_preset_survives_save_and_load(name, tmp_path):
    preset = PRESETS[name]
    loaded = MLIPSpec.load(preset.save(tmp_path / f"{name}.json"))
    assert loaded == preset
    assert hash(loaded) == hash(preset)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_preset_to_json_is_its_file_byte_for_byte(name):
    assert PRESETS[name].to_json().encode("utf-8") == (SPEC_DIR / f"{name}.json").read_bytes()


def test_presets_are_the_named_spec_constants():
    assert dict(PRESETS) == {
        "mpnn_halo": SPEC_MPNN_HALO,
        "lj_halo": SPEC_LJ_HALO,
        "uma_halo": SPEC_UMA_HALO,
        "ewald_halo": SPEC_EWALD_HALO,
        "pme_halo": SPEC_PME_HALO,
        "dftd3_halo": SPEC_DFTD3_HALO,
        "mpnn_gp": SPEC_MPNN_GP,
    }


# --------------------------------------------------------------------------- 2. preset schema

STANDARD_KINDS = [
    ["atomic_energies", "per_node"],
    ["energy", "per_graph"],
    ["forces", "per_node"],
    ["stress", "per_graph"],
]


def test_mpnn_halo_to_dict_is_exactly_the_schema():
    assert SPEC_MPNN_HALO.to_dict() == {
        "version": 2,
        "core": {
            "policy": {"kind": "halo", "scatter_mode": "halo_correction", "gather_mode": "halo_read"},
            "custom_ops": [],
            "third_party_helpers": [],
        },
        "system_reductions": True,
        "node_energy_key": None,
        "node_virial_key": None,
        "owned_only_outputs": [],
        "all_reduce_outputs": [],
        "output_kinds": STANDARD_KINDS,
        "compile": None,
    }


def test_to_dict_writes_key_lists_and_output_kinds_sorted():
    data = RICH.to_dict()
    assert data["owned_only_outputs"] == ["charges", "forces"]
    assert data["all_reduce_outputs"] == ["dipole", "mesh"]
    assert [k for k, _ in data["output_kinds"]] == sorted(RICH.output_kinds)


def test_uma_halo_differs_from_mpnn_halo_only_by_local_scatter():
    expected = SPEC_MPNN_HALO.to_dict()
    expected["core"]["policy"]["scatter_mode"] = "local"
    assert SPEC_UMA_HALO.to_dict() == expected


def test_mpnn_gp_is_graph_parallel_with_owned_only_forces_from_global_energy():
    data = SPEC_MPNN_GP.to_dict()
    assert data["core"] == {"policy": {"kind": "graph_parallel"}, "custom_ops": [], "third_party_helpers": []}
    assert data["owned_only_outputs"] == ["atomic_energies", "forces"]
    assert data["all_reduce_outputs"] == []
    assert data["output_kinds"] == STANDARD_KINDS
    assert data["compile"]["force_strategy"] == "framework_from_global_energy"
    assert SPEC_MPNN_GP.compile == CompilePolicy(force_strategy="framework_from_global_energy")


@pytest.mark.parametrize("name", ["lj_halo", "ewald_halo", "pme_halo", "dftd3_halo"])
def test_halo_presets_other_than_uma_are_the_mpnn_halo_data(name):
    assert PRESETS[name] == SPEC_MPNN_HALO
    assert PRESETS[name].to_dict() == SPEC_MPNN_HALO.to_dict()


# --------------------------------------------------------------------------- 3. hostile files


def test_every_truncation_of_a_spec_file_is_refused_with_spec_error(tmp_path):
    text = RICH.to_json()
    path = tmp_path / "truncated.json"
    complete = len(text.rstrip())  # the object's closing brace; only the trailing newline may go
    for n in range(complete):
        path.write_text(text[:n], encoding="utf-8")
        with pytest.raises(SpecError) as info:
            MLIPSpec.load(path)
        assert str(info.value), n


INTERESTING_STRINGS = (
    "",
    "halo",
    "local",
    "graph_parallel",
    "per_node",
    "all_reduce_sum",
    "jaxddtest::op_a",
    "jaxddtest::missing",
    "noseparator",
    "jaxdd.data.segments:per_system_sum",
    "jaxdd.data.segments:nope",
    "no.such.module:fn",
    ".relative:fn",
    "jaxdd.spec:SPEC_VERSION",
    "model_internal",
    "0",
    "01",
    "-1",
    "\u00b2",
    "\u0661",
    "\ud800",
)
json_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.integers(min_value=10**300, max_value=10**400) | st.integers(min_value=-(10**400), max_value=-(10**300)),
    st.floats(),
    st.sampled_from([1e308, -1e308, 5e-324, 0.5, 1.0, 2.0]),
    st.text(max_size=10),
    st.sampled_from(INTERESTING_STRINGS),
)
json_keys = st.text(max_size=8) | st.sampled_from(INTERESTING_STRINGS + ("version", "core", "type", "kind", "op"))
json_values = st.recursive(
    json_scalars,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(json_keys, inner, max_size=3),
    max_leaves=8,
)


def _paths(tree, prefix=()):
    yield prefix
    if isinstance(tree, dict):
        for key, value in tree.items():
            yield from _paths(value, prefix + (key,))
    elif isinstance(tree, list):
        for i, value in enumerate(tree):
            yield from _paths(value, prefix + (i,))


def _at(tree, path):
    for step in path:
        tree = tree[step]
    return tree


@st.composite
def mutated_spec_dicts(draw):
    data = {"root": draw(st.sampled_from([RICH, SPEC_MPNN_GP, SPEC_MPNN_HALO])).to_dict()}
    for _ in range(draw(st.integers(1, 3))):
        path = draw(st.sampled_from(list(_paths(data["root"], ("root",)))))
        action = draw(st.sampled_from(["replace", "delete", "add"]))
        node = _at(data, path)
        if action == "delete" and isinstance(node, dict) and node:
            del node[draw(st.sampled_from(sorted(node)))]
        elif action == "add" and isinstance(node, dict):
            node[draw(json_keys)] = draw(json_values)
        else:
            _at(data, path[:-1])[path[-1]] = draw(json_values)
    return data["root"]


@settings(max_examples=400)
@given(data=mutated_spec_dicts())
def test_mutated_spec_object_loads_or_raises_spec_error_only(data):
    shown = copy.deepcopy(data)
    try:
        spec = MLIPSpec.from_dict(data)
    except SpecError as exc:
        assert str(exc), f"empty SpecError message for {shown!r}"
    except BaseException as exc:  # noqa: BLE001 - the property under test
        pytest.fail(f"from_dict raised {type(exc).__name__}: {exc} for {shown!r}")
    else:
        assert isinstance(spec, MLIPSpec)


@settings(max_examples=300)
@given(raw=st.binary(max_size=64) | st.binary(max_size=16).map(lambda b: b"\xff\xfe" + b + b"\x80\xc3"))
def test_random_bytes_are_refused_with_spec_error(raw):
    with pytest.raises(SpecError) as info:
        MLIPSpec.from_json(raw)
    assert str(info.value)


def test_invalid_utf8_file_is_refused_with_spec_error(tmp_path):
    path = tmp_path / "latin1.json"
    path.write_bytes(SPEC_MPNN_HALO.to_json().replace('"energy"', '"\u00e9nergie"').encode("latin-1"))
    with pytest.raises(SpecError, match=re.escape(str(path))):
        MLIPSpec.load(path)


@pytest.mark.parametrize(
    "text",
    ["[" * 100_000, '{"version":' * 100_000, "[" * 100_000 + "]" * 100_000],
    ids=["open-arrays", "open-objects", "closed-arrays"],
)
def test_deeply_nested_json_is_a_spec_error_not_recursion_error(text):
    with pytest.raises(SpecError):
        MLIPSpec.from_json(text)


def test_deeply_nested_value_in_a_spec_object_is_a_spec_error():
    deep = []
    for _ in range(100_000):
        deep = [deep]
    with pytest.raises(SpecError) as info:
        MLIPSpec.from_dict(minimal_dict(version=deep))
    assert str(info.value)


# --------------------------------------------------------------------------- 4. messages


@pytest.mark.parametrize("version", [1, 3, "2", None, True])
def test_unknown_version_is_refused_naming_it(version):
    with pytest.raises(SpecError, match=r"unsupported spec version " + re.escape(json.dumps(version))):
        MLIPSpec.from_dict(minimal_dict(version=version))


def test_missing_version_is_refused():
    with pytest.raises(SpecError, match=r"missing field\(s\) \['version'\]"):
        MLIPSpec.from_dict({"core": {"policy": {"kind": "halo"}}})


def test_unknown_policy_kind_is_named():
    with pytest.raises(SpecError, match="unknown policy kind 'spiral'"):
        MLIPSpec.from_dict(minimal_dict(core={"policy": {"kind": "spiral"}}))


def test_unknown_transform_type_is_named():
    adapter = {"op": "jaxddtest::op_a", "arg_transforms": {"0": {"type": "teleport"}}}
    core = {"policy": {"kind": "halo"}, "custom_ops": [adapter]}
    with pytest.raises(SpecError, match="unknown transform type 'teleport'"):
        MLIPSpec.from_dict(minimal_dict(core=core))


def test_unknown_output_kind_is_named_in_a_file():
    with pytest.raises(SpecError, match="unknown output kind 'per_edge'"):
        MLIPSpec.from_dict(minimal_dict(output_kinds=[["forces", "per_edge"]]))


def test_unknown_output_kind_is_named_by_the_constructor():
    with pytest.raises(SpecError, match=r"output kind of 'forces'.*'per_edge'"):
        MLIPSpec(output_kinds={"forces": "per_edge"})


def test_unregistered_op_is_named_with_the_advice_to_import_its_module():
    core = {"policy": {"kind": "halo"}, "custom_ops": [{"op": "nobody::fused"}]}
    with pytest.raises(SpecError, match=r"'nobody::fused' is not registered; import the module") as info:
        MLIPSpec.from_dict(minimal_dict(core=core))
    assert "'nobody'" in str(info.value)


def test_unregistered_op_is_refused_by_op_adapter():
    with pytest.raises(SpecError, match="'nobody::fused' is not registered"):
        OpAdapter("nobody::fused")


def test_malformed_json_names_the_file_line_and_column(tmp_path):
    path = tmp_path / "broken.json"
    path.write_text('{\n  "version": 2\n  "core": {}\n}\n', encoding="utf-8")
    with pytest.raises(SpecError, match=re.escape(f"{path}: malformed JSON at line 3 column 3")):
        MLIPSpec.load(path)


def test_key_both_owned_only_and_all_reduced_is_refused_by_the_constructor():
    with pytest.raises(SpecError, match=r"\['stress'\] are both owned-only and all-reduced"):
        MLIPSpec(owned_only_outputs={"forces", "stress"}, all_reduce_outputs={"stress"})


def test_key_both_owned_only_and_all_reduced_is_refused_in_a_file():
    data = minimal_dict(owned_only_outputs=["stress"], all_reduce_outputs=["energy", "stress"])
    with pytest.raises(SpecError, match=r"\['stress'\] are both owned-only and all-reduced"):
        MLIPSpec.from_dict(data)


def test_output_without_declared_kind_warns_naming_it():
    with pytest.warns(SpecWarning, match=r"\['polarisability'\] have no declared OutputKind"):
        SPEC_MPNN_HALO.check_outputs(["energy", "forces", "polarisability"])


def test_output_without_declared_kind_is_an_error_when_strict():
    with pytest.raises(SpecError, match=r"\['polarisability'\] have no declared OutputKind"):
        SPEC_MPNN_HALO.check_outputs(["energy", "polarisability"], strict=True)


def test_check_outputs_is_silent_when_every_output_has_a_kind(recwarn):
    SPEC_MPNN_HALO.check_outputs(["energy", "forces", "stress", "atomic_energies"], strict=True)
    SPEC_MPNN_HALO.check_outputs(["energy", "forces"])
    assert not [w for w in recwarn if issubclass(w.category, SpecWarning)]


def test_unknown_top_level_field_is_named():
    with pytest.raises(SpecError, match=r"unknown field\(s\) \['fancy_option'\]"):
        MLIPSpec.from_dict(minimal_dict(fancy_option=True))


def test_missing_core_is_named():
    with pytest.raises(SpecError, match=r"missing field\(s\) \['core'\]"):
        MLIPSpec.from_dict({"version": 2})


def test_two_adapters_for_one_op_are_refused():
    with pytest.raises(SpecError, match=r"\['jaxddtest::op_a'\] more than once"):
        DistributionSpec(custom_ops=(OpAdapter(OP_A), OpAdapter("jaxddtest::op_a", {0: SliceOwned()})))


def test_two_adapters_for_one_op_are_refused_in_a_file():
    core = {"policy": {"kind": "halo"}, "custom_ops": [{"op": "jaxddtest::op_c"}, {"op": "jaxddtest::op_c"}]}
    with pytest.raises(SpecError, match=r"\['jaxddtest::op_c'\] more than once"):
        MLIPSpec.from_dict(minimal_dict(core=core))


def test_two_helpers_for_one_target_are_refused():
    with pytest.raises(SpecError, match=r"\['chem.mol.mol_sum'\] more than once"):
        DistributionSpec(
            third_party_helpers=(
                PythonAdapter("chem.mol", "mol_sum", "jaxdd.data.segments:per_system_sum"),
                JitAdapter("chem.mol", "mol_sum", "jaxdd.neighbors:edge_vectors"),
            )
        )


def test_helper_replacement_in_a_missing_module_names_the_module():
    with pytest.raises(SpecError, match=r"'no.such.module:fn': cannot import module 'no.such.module'"):
        PythonAdapter("chem.mol", "mol_sum", "no.such.module:fn")


def test_helper_replacement_missing_from_its_module_names_the_attribute():
    with pytest.raises(SpecError, match=r"module 'jaxdd.data.segments' has no attribute 'nope'"):
        JitAdapter("chem.mol", "mol_sum", "jaxdd.data.segments:nope")


def test_unresolvable_helper_replacement_in_a_file_names_the_reference():
    helper = {"kind": "python", "module_path": "chem.mol", "attr_name": "mol_sum", "replacement": "no.such.module:fn"}
    core = {"policy": {"kind": "halo"}, "third_party_helpers": [helper]}
    with pytest.raises(SpecError, match=r"third_party_helpers\[0\].*cannot import module 'no.such.module'"):
        MLIPSpec.from_dict(minimal_dict(core=core))


@pytest.mark.parametrize("ref", ["per_system_sum", "a:b:c", ":fn", "jaxdd.data.segments:"])
def test_malformed_helper_reference_is_refused(ref):
    with pytest.raises(SpecError, match="'module:qualname' reference"):
        PythonAdapter("chem.mol", "mol_sum", ref)


def test_lambda_replacement_is_allowed_but_cannot_be_saved(tmp_path):
    spec = SPEC_MPNN_HALO.with_helpers(PythonAdapter("chem.mol", "mol_sum", lambda v, i, n: v))
    with pytest.raises(SpecError, match="cannot be saved"):
        spec.to_dict()
    path = tmp_path / "lambda.json"
    with pytest.raises(SpecError, match="cannot be saved"):
        spec.save(path)
    assert not path.exists()


@pytest.mark.parametrize(
    "field, value",
    [
        ("capacity_factor", 0.5),
        ("capacity_factor", float("nan")),
        ("growth_factor", 1.0),
        ("growth_factor", float("inf")),
        ("max_regrowths", 0),
        ("max_regrowths", 2.5),
        ("force_strategy", "guess"),
        ("stress_via_strain", 1),
    ],
)
def test_bad_compile_policy_value_is_refused_naming_the_field(field, value):
    with pytest.raises(SpecError, match=f"CompilePolicy.{field} must be"):
        CompilePolicy(**{field: value})


def test_bad_compile_policy_value_in_a_file_is_refused_naming_the_field():
    with pytest.raises(SpecError, match="CompilePolicy.growth_factor must be"):
        MLIPSpec.from_dict(minimal_dict(compile={"growth_factor": 1.0}))


@pytest.mark.parametrize("field", ["scatter_mode", "gather_mode"])
def test_bad_halo_mode_is_refused_naming_the_field(field):
    with pytest.raises(SpecError, match=f"HaloStoragePolicy.{field} must be one of .*got 'nope'"):
        HaloStoragePolicy(**{field: "nope"})


@pytest.mark.parametrize("name", ["noseparator", "a::", "::b", "a::b::c", "1ns::op", "ns:op", ""])
def test_malformed_op_name_is_refused(name):
    with pytest.raises(SpecError, match="op name must look like 'namespace::op'"):
        register_op(name, _op_a)


def test_registering_a_different_function_under_a_taken_name_needs_replace():
    name = f"jaxddtest::taken_{uuid.uuid4().hex}"
    first = register_op(name, _op_a)
    assert register_op(name, _op_a) == first  # the same function again: allowed
    with pytest.raises(SpecError, match=f"{name!r} is already registered .*replace=True"):
        register_op(name, _op_d)
    assert get_op(name).fn is _op_a
    register_op(name, _op_d, replace=True)
    assert get_op(name).fn is _op_d


def test_save_into_a_missing_directory_is_a_spec_error(tmp_path):
    path = tmp_path / "no" / "such" / "dir" / "spec.json"
    with pytest.raises(SpecError, match=re.escape(f"cannot write spec file {path}")):
        SPEC_MPNN_HALO.save(path)


def test_load_of_a_missing_file_is_a_spec_error(tmp_path):
    path = tmp_path / "absent.json"
    with pytest.raises(SpecError, match=re.escape(f"cannot read spec file {path}")):
        MLIPSpec.load(path)


# --------------------------------------------------------------------------- 5. immutable, hashable


def test_equal_specs_loaded_separately_compile_once_as_static_jit_args(tmp_path):
    path = RICH.save(tmp_path / "rich.json")
    first, second = MLIPSpec.load(path), MLIPSpec.load(path)
    assert first is not second
    traces = []

    @functools.partial(jax.jit, static_argnums=1)
    def scaled(x, spec):
        traces.append(spec)
        return x * len(spec.output_kinds)

    assert float(scaled(1.0, first)) == float(scaled(1.0, second)) == 6.0
    assert len(traces) == 1


def test_different_specs_are_different_static_jit_args():
    traces = []

    @functools.partial(jax.jit, static_argnums=1)
    def scaled(x, spec):
        traces.append(spec)
        return x * len(spec.output_kinds)

    scaled(1.0, SPEC_MPNN_HALO)
    scaled(1.0, SPEC_UMA_HALO)
    assert len(traces) == 2


@pytest.mark.parametrize(
    "obj, field",
    [
        (RICH, "system_reductions"),
        (RICH, "compile"),
        (RICH.distribution, "policy"),
        (RICH.distribution.policy, "scatter_mode"),
        (RICH.compile, "growth_factor"),
        (RICH.distribution.custom_ops[0], "arg_transforms"),
        (RICH.distribution.third_party_helpers[0], "replacement"),
        (AllReduceSum(), "replicated_consumer"),
        (OP_A, "fn"),
    ],
    ids=lambda x: x if isinstance(x, str) else type(x).__name__,
)
def test_setting_an_attribute_raises(obj, field):
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(obj, field, None)


def test_output_kinds_mapping_cannot_be_changed():
    with pytest.raises(TypeError):
        RICH.output_kinds["energy"] = OutputKind.GLOBAL
    with pytest.raises(AttributeError):
        RICH.output_kinds.extra = 1
    assert RICH.kind_of("energy") is OutputKind.PER_GRAPH


def test_key_sets_are_frozen():
    assert isinstance(RICH.owned_only_outputs, frozenset)
    assert isinstance(RICH.all_reduce_outputs, frozenset)


def _unchanged(spec, before_json):
    return spec.to_json() == before_json


def test_with_policy_returns_a_new_spec_and_leaves_the_original():
    before = SPEC_MPNN_HALO.to_json()
    new = SPEC_MPNN_HALO.with_policy(GraphParallelPolicy())
    assert new.policy == GraphParallelPolicy()
    assert new.output_kinds == SPEC_MPNN_HALO.output_kinds
    assert SPEC_MPNN_HALO.policy == HaloStoragePolicy()
    assert _unchanged(SPEC_MPNN_HALO, before)


def test_with_output_kinds_returns_a_new_spec_and_leaves_the_original():
    before = SPEC_MPNN_HALO.to_json()
    new = SPEC_MPNN_HALO.with_output_kinds(dipole="per_graph", energy=OutputKind.GLOBAL)
    assert new.kind_of("dipole") is OutputKind.PER_GRAPH
    assert new.kind_of("energy") is OutputKind.GLOBAL
    assert new.kind_of("forces") is OutputKind.PER_NODE
    assert SPEC_MPNN_HALO.kind_of("dipole") is OutputKind.UNKNOWN
    assert SPEC_MPNN_HALO.kind_of("energy") is OutputKind.PER_GRAPH
    assert _unchanged(SPEC_MPNN_HALO, before)


def test_with_all_reduce_and_without_all_reduce_return_new_specs():
    before = SPEC_MPNN_HALO.to_json()
    reduced = SPEC_MPNN_HALO.with_all_reduce("stress", "dipole")
    assert reduced.all_reduce_outputs == {"stress", "dipole"}
    restored = reduced.without_all_reduce("dipole")
    assert restored.all_reduce_outputs == {"stress"}
    assert reduced.all_reduce_outputs == {"stress", "dipole"}
    assert SPEC_MPNN_HALO.all_reduce_outputs == frozenset()
    assert _unchanged(SPEC_MPNN_HALO, before)


def test_with_all_reduce_refuses_an_owned_only_key():
    with pytest.raises(SpecError, match="both owned-only and all-reduced"):
        SPEC_MPNN_GP.with_all_reduce("forces")


def test_with_owned_only_returns_a_new_spec_and_leaves_the_original():
    before = SPEC_MPNN_HALO.to_json()
    new = SPEC_MPNN_HALO.with_owned_only("forces")
    assert new.owned_only_outputs == {"forces"}
    assert SPEC_MPNN_HALO.owned_only_outputs == frozenset()
    assert _unchanged(SPEC_MPNN_HALO, before)


def test_with_compile_field_change_starts_from_the_default_policy():
    before = SPEC_MPNN_HALO.to_json()
    new = SPEC_MPNN_HALO.with_compile(growth_factor=2.0)
    assert new.compile == CompilePolicy(growth_factor=2.0)
    assert SPEC_MPNN_HALO.compile is None
    assert _unchanged(SPEC_MPNN_HALO, before)


def test_with_compile_field_change_keeps_the_other_fields():
    before = RICH.to_json()
    new = RICH.with_compile(growth_factor=2.0)
    assert new.compile == dataclasses.replace(RICH.compile, growth_factor=2.0)
    assert RICH.compile.growth_factor == 3.0
    assert _unchanged(RICH, before)


def test_with_custom_ops_replaces_the_adapter_for_the_same_op():
    spec = SPEC_MPNN_HALO.with_custom_ops(OpAdapter(OP_A, {0: GatherInputs()}), OpAdapter(OP_B))
    before = spec.to_json()
    new = spec.with_custom_ops(OpAdapter("jaxddtest::op_a", {0: SliceOwned()}))
    by_op = {a.op.name: a for a in new.distribution.custom_ops}
    assert sorted(by_op) == ["jaxddtest::op_a", "jaxddtest::op_b"]
    assert by_op["jaxddtest::op_a"].arg_transforms == {0: SliceOwned()}
    assert spec.distribution.custom_ops[0].arg_transforms == {0: GatherInputs()}
    assert _unchanged(spec, before)


def test_with_helpers_replaces_the_adapter_for_the_same_target():
    spec = SPEC_MPNN_HALO.with_helpers(
        PythonAdapter("chem.mol", "mol_sum", "jaxdd.data.segments:per_system_sum"),
        MethodAdapter("chem.layers", "Conv", "aggregate", "jaxdd.neighbors:edge_vectors"),
    )
    before = spec.to_json()
    new = spec.with_helpers(JitAdapter("chem.mol", "mol_sum", "jaxdd.neighbors:neighbor_capacity"))
    by_target = {h.target: h for h in new.distribution.third_party_helpers}
    assert sorted(by_target) == ["chem.layers.Conv.aggregate", "chem.mol.mol_sum"]
    assert by_target["chem.mol.mol_sum"] == JitAdapter("chem.mol", "mol_sum", "jaxdd.neighbors:neighbor_capacity")
    assert spec.distribution.third_party_helpers[0].replacement_ref == "jaxdd.data.segments:per_system_sum"
    assert _unchanged(spec, before)


# --------------------------------------------------------------------------- 6. op registry


def test_registered_op_calls_its_function():
    x = jnp.arange(3.0)
    assert jnp.array_equal(OP_A(x), 3.0 * x)
    assert jnp.array_equal(OP_B(x, x), x * x)


def test_registered_op_appears_in_a_traced_program_under_its_handle_name():
    jaxpr = jax.make_jaxpr(lambda x: OP_A(x) + 1.0)(jnp.ones(3))
    names = [eqn.params.get("name") for eqn in jaxpr.jaxpr.eqns]
    assert "jaxddtest::op_a" in names


def test_get_op_returns_the_registered_handle():
    assert get_op("jaxddtest::op_a") is OP_A
    assert get_op(OP_A) is OP_A
    assert str(OP_A) == "jaxddtest::op_a"
    assert OP_A.namespace == "jaxddtest"


def test_get_op_of_an_unregistered_name_is_a_spec_error_naming_it():
    with pytest.raises(SpecError, match="'jaxddtest::never' is not registered"):
        get_op("jaxddtest::never")


def test_op_adapter_accepts_the_handle_or_its_name():
    by_handle = OpAdapter(OP_C, {1: AllReduceSum(replicated_consumer=True)})
    by_name = OpAdapter("jaxddtest::op_c", {1: AllReduceSum(replicated_consumer=True)})
    assert by_handle == by_name
    assert hash(by_handle) == hash(by_name)
    assert by_name.op is OP_C


# ------------------------------------------------------------------ edge cases found by probing


def test_a_replacement_reference_must_name_a_callable():
    with pytest.raises(SpecError, match="not callable"):
        PythonAdapter("chem.mol", "mol_sum", "jaxdd.spec:SPEC_VERSION")


def test_a_replacement_loaded_by_reference_saves_under_the_same_reference():
    adapter = PythonAdapter("chem.mol", "mol_sum", "random:random")
    assert adapter.to_dict()["replacement"] == "random:random"


def test_a_relative_replacement_reference_is_refused():
    with pytest.raises(SpecError, match="absolute"):
        PythonAdapter("chem.mol", "mol_sum", ".foo:bar")


def test_a_huge_integer_compile_factor_is_refused_with_a_spec_error():
    with pytest.raises(SpecError, match="capacity_factor"):
        CompilePolicy(capacity_factor=10**400)


def test_positions_must_be_ascii_decimal():
    data = MLIPSpec().with_custom_ops(OpAdapter("jaxddtest::op_a")).to_dict()
    data["core"]["custom_ops"][0]["arg_transforms"] = {"1": {"type": "slice_owned"}, "\u0661": {"type": "gather_inputs"}}
    with pytest.raises(SpecError, match="ASCII decimal"):
        MLIPSpec.from_dict(data)


def test_an_op_name_with_a_trailing_newline_is_refused():
    with pytest.raises(SpecError, match="namespace::op"):
        register_op("jaxddtest::nl\n", lambda x: x)


def test_a_different_function_cannot_silently_take_a_registered_name():
    register_op("jaxddtest::twice", lambda x: x)
    with pytest.raises(SpecError, match="already registered"):
        register_op("jaxddtest::twice", lambda x: 2 * x)


def test_version_must_be_the_integer_two():
    data = SPEC_MPNN_HALO.to_dict()
    data["version"] = 2.0
    with pytest.raises(SpecError, match="unsupported spec version 2.0"):
        MLIPSpec.from_dict(data)


def test_a_newer_file_is_refused_for_its_version_before_its_fields():
    data = {**SPEC_MPNN_HALO.to_dict(), "version": 3, "new_field": 1}
    with pytest.raises(SpecError, match="unsupported spec version 3"):
        MLIPSpec.from_dict(data)


def test_non_string_output_names_and_non_text_json_are_spec_errors():
    with pytest.raises(SpecError, match="owned_only_outputs"):
        MLIPSpec(owned_only_outputs=[["a"]])
    with pytest.raises(SpecError, match="JSON text"):
        MLIPSpec.from_json(None)
