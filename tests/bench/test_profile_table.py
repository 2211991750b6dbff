"""Specification of ``bench/profile_table.py``: reading XLA's HLO and a trace into where a step's
time goes. A whole traced run is checked by the GPU check's smoke run (tests/bench/test_gpu_check.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import profile_table  # noqa: E402

HLO = """\
HloModule jit_advance, entry_computation_layout={(f64[519,3]{1,0})->f64[519,3]{1,0}}

%fused_computation.5 (param_0.5: f64[3492,3]) -> f64[3492,3] {
  %ppermute.20 = f64[3492,3]{1,0} parameter(0)
  ROOT %neg.1 = f64[3492,3]{1,0} negate(%ppermute.20), metadata={op_name="jit(advance)/jaxdd.model/neg"}
}

ENTRY %main.1 (Arg_0.1: f64[519,3]) -> f64[519,3] {
  %ppermute.20 = f64[3492,3]{1,0} collective-permute(%x), channel_id=1, source_target_pairs={{0,1},{1,0}}, \
metadata={op_name="jit(advance)/shard_map/while/body/jaxdd.integrate/jvp(jaxdd.model)/jaxdd.halo/ppermute" \
stack_frame_id=563}
  %while.72 = (s32[], f64[519,3]{1,0}, /*index=2*/f64[1]{0}) while(%tuple.3), condition=%cond, body=%body, \
metadata={op_name="jit(advance)/shard_map/while"}
  %ffi_call.20 = (s32[20218]{0}, s32[]) custom-call(%a, %b), custom_call_target="jaxdd_cell_list_f64", \
metadata={op_name="jit(advance)/shard_map/jaxdd.neighbors/ffi_call"}
  ROOT %copy.1 = f64[519,3]{1,0} copy(%y)
}
""".replace("\\\n", "")


@pytest.fixture
def hlo_dir(tmp_path):
    (tmp_path / "module_0044.jit_advance.cpu_after_optimizations.txt").write_text(HLO)
    (tmp_path / "module_0044.jit_advance.before_optimizations.txt").write_text("not read")
    return tmp_path


def test_each_dumped_instruction_is_found_with_its_opcode_and_op_name(hlo_dir):
    names = profile_table.hlo_names(hlo_dir)
    assert names[(44, "ffi_call.20")] == ("custom-call", "jit(advance)/shard_map/jaxdd.neighbors/ffi_call")
    assert names[(44, "while.72")][0] == "while"  # a tuple type with /*index=..*/ comments
    assert names[(44, "copy.1")] == ("copy", "")


def test_the_instruction_that_runs_wins_over_a_fused_parameter_of_the_same_name(hlo_dir):
    assert profile_table.hlo_names(hlo_dir)[(44, "ppermute.20")][0] == "collective-permute"


@pytest.mark.parametrize("op_name, row", [
    ("jit(advance)/shard_map/while/body/jaxdd.integrate/jvp(jaxdd.model)/jaxdd.halo/ppermute", "halo exchange"),
    ("jit(advance)/while/body/jaxdd.integrate/transpose(jaxdd.integrate)/jvp(jaxdd.model)/scatter-add",
     "model or pair kernel"),
    ("jit(advance)/while/body/jaxdd.integrate/pmax", "integrator"),
    ("jit(advance)/while/body/jaxdd.integrate/cond/branch_1_fun/jaxdd.neighbors/ffi_call",
     "neighbour search and sort"),
    ("jit(replanned)/shard_map/jaxdd.replan/sort", "rebuild (migration, new plan)"),
    ("jit(advance)/while/body/pmax", profile_table.OTHER),
    ("", profile_table.OTHER),
])
def test_an_operation_counts_in_its_innermost_jaxdd_scope(op_name, row):
    assert profile_table.category(op_name) == row


def test_a_folder_without_a_trace_or_hlo_is_named_with_what_to_do(tmp_path, capsys):
    with pytest.raises(FileNotFoundError, match="jax.profiler.trace"):
        profile_table.newest_trace(tmp_path)
    with pytest.raises(FileNotFoundError, match="--xla_dump_to"):
        profile_table.hlo_names(tmp_path)
    assert profile_table.main([str(tmp_path), "--hlo", str(tmp_path)]) == 1
    assert str(tmp_path) in capsys.readouterr().err


def test_the_table_has_a_row_per_part_and_their_shares():
    result = dict(rows={row: 1.0 for row in (*profile_table.SCOPES.values(), profile_table.OTHER)},
                  wall_ms=8.0, lanes=2, where="CPU device", unnamed=0)
    result["rows"][profile_table.GAPS] = 1.0
    table = profile_table.format_table(result, "LJ")
    assert table.splitlines()[0] == "LJ: 8.000 ms per step averaged over 2 CPU device(s)"
    for row in result["rows"]:
        assert row in table
    assert table.count("12.5%") == 7
