"""A scaling model toward large machines, from measured per-rank work.

    python bench/scaling_model.py [--quick] [--png docs/scaling.png] [--json PATH]

1. Measures, for LJ, SchNet, NequIP and MACE under the halo and the node-block
   (graph-parallel) strategies, one force evaluation's per-rank work on 2 virtual CPU
   devices from XLA: flops and bytes accessed of the per-device program (cost analysis) and
   its collectives (count and bytes, read from the optimised HLO), with the rows each rank
   holds (owned + ghost capacity), float32.
2. Turns them into coefficients per row (flops, bytes), per ghost row (halo bytes) or per
   atom of the system (all-gathered bytes) and predicts a step's time on H200 GPUs:
   compute = max(flops / peak, bytes / HBM bandwidth) (a roofline), communication =
   messages × latency + bytes / link bandwidth (NVLink within 8 GPUs, InfiniBand across
   nodes). Ghost rows of a cubic block of n atoms at density ρ with shell W: ρ((L + 2W)³ − L³),
   L = (n/ρ)^(1/3). Weak scaling at 1,000,000 atoms per GPU (1 → 1,024 GPUs) and strong
   scaling of 10,000,000 atoms; a PNG plot of both.
3. Validates the model where it can be measured: the same prediction with this CPU's own
   constants (a matmul's flop rate and a copy's bandwidth on one core, measured here) for
   one evaluation (prepared inputs, the device program alone) on 1 and on 2 pinned devices
   of larger systems, beside the measured times (child processes pinned to 1 and 2 cores),
   with the prediction error.

The model leaves out what XLA's cost analysis does not see (kernel launch overheads, the
neighbour search's data-dependent work, overlap of communication with compute); the
validation line says how far that puts it from a measurement.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

#: NVIDIA H200 SXM: fp32 (non-tensor) peak, HBM3e bandwidth, NVLink per GPU, InfiniBand
#: NDR per GPU, and per-message latencies (NCCL-level, typical).
H200 = dict(flops=67e12, hbm=4.8e12, nvlink=900e9, ib=400e9 / 8, lat_nvlink=8e-6, lat_ib=15e-6, per_node=8)

MODELS = ("lj", "schnet", "nequip", "mace")
STRATEGIES = ("halo", "graph_partition")


def set_device_count(n: int) -> None:
    os.environ["JAX_NUM_CPU_DEVICES"] = str(n)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")


def build(name: str, quick: bool, large: bool = False):
    """(model, ase atoms, density per Å³ or σ³, cutoff) of one model's test system; ``large``:
    the validation's, big enough that a call's fixed overheads do not dominate."""
    import numpy as np

    from jaxdd.data.systems import fcc_lattice, lj_melt

    if name == "lj":
        from jaxdd.models.lj import LennardJones

        atoms = lj_melt((6 if quick else 10) if large else (4 if quick else 6), temperature=1.0)
        return LennardJones(1.0, 1.0, 2.5), atoms, 0.8442, 2.5
    atoms = fcc_lattice((4 if quick else 5) if large else (3 if quick else 4), 5.26, symbol="Ar")
    atoms.rattle(0.05, seed=1)
    rho = len(atoms) / atoms.get_volume()
    if name == "schnet":
        from jaxdd.models.mpnn import SchNet

        return SchNet((18,), 5.0, features=32, n_interactions=3, dtype=np.float32), atoms, rho, 5.0
    if name == "nequip":
        from jaxdd.models.nequip import NequIP

        return NequIP((18,), 5.0, dtype=np.float32), atoms, rho, 5.0
    from jaxdd.models.mace import MACE

    return MACE(species=(18,), r_max=5.0, dtype=np.float32), atoms, rho, 5.0


def mesh_of(n):
    import jax
    import numpy as np
    from jax.sharding import AxisType, Mesh

    return Mesh(np.asarray(jax.devices()[:n]), ("dd",), axis_types=(AxisType.Auto,))


def measure(name: str, strategy: str, quick: bool, n_ranks: int = 2, large: bool = False) -> dict:
    """Per-rank work of one force evaluation on ``n_ranks`` devices. Node blocks are measured
    on 1 rank too: their work has a part per owned atom and a part per atom of the system
    (the gathered neighbour search), told apart by the two."""
    import numpy as np

    import jaxdd
    from timing import collectives, cost

    model, atoms, rho, cutoff = build(name, quick, large)
    data = jaxdd.AtomicData.from_ase(atoms, dtype=np.float32)
    # The jnp neighbour search, as on GPUs today: XLA's cost analysis sees it (a compiled
    # CPU kernel would be a custom call it cannot count).
    dm = jaxdd.DistributedModel(model, jaxdd.DomainConfig(cutoff, mesh=mesh_of(n_ranks), grid=(n_ranks, 1, 1),
                                                          strategy=strategy, neighbor_backend="jnp"))
    dm(data, ("energy", "forces"))
    compiled = dm.lower(data, ("energy", "forces")).compile()
    c = cost(compiled)
    coll = collectives(compiled)
    caps = dm.capacities
    ghosts = int(sum(caps.exchange)) if strategy == "halo" else 0
    out = dict(model=name, strategy=strategy, atoms=len(atoms), ranks=n_ranks, density=rho,
               ghost_width=float(dm.ghost_width) if strategy == "halo" else 0.0,
               owned_rows=int(caps.owned), ghost_rows=ghosts, flops=c["flops"], bytes=c["bytes"],
               messages=int(sum(n for n, _ in coll.values())), comm_bytes=int(sum(b for _, b in coll.values())))
    if strategy == "graph_partition" and n_ranks > 1:
        one = measure(name, strategy, quick, 1, large)
        out.update(flops_one=one["flops"], bytes_one=one["bytes"])
    return out


def coefficients(m: dict) -> dict:
    """Work per row, and communication per ghost row (halo) or per system atom (node
    blocks, whose work is ``a`` per owned row plus ``c`` per system atom: from 1 and P ranks)."""
    if m["strategy"] == "halo":
        rows = m["owned_rows"] + m["ghost_rows"]
        return dict(flops_row=m["flops"] / rows, bytes_row=m["bytes"] / rows, flops_atom=0.0, bytes_atom=0.0,
                    messages=m["messages"], comm_ghost=m["comm_bytes"] / max(m["ghost_rows"], 1))
    n_sys, n_own = m["ranks"] * m["owned_rows"], m["owned_rows"]
    out = dict(messages=m["messages"], comm_atom=m["comm_bytes"] / max(n_sys, 1))
    for key in ("flops", "bytes"):
        # one rank: (a + c)·N; P ranks: a·N/P + c·N.
        a = max((m[key + "_one"] - m[key]) / max(n_sys - n_own, 1), 0.0)
        c = max(m[key] - a * n_own, 0.0) / n_sys
        out[key + "_row"], out[key + "_atom"] = a, c
    return out


def ghost_rows(n: float, rho: float, width: float, ranks: int) -> float:
    """Ghost rows of a cubic block of ``n`` atoms (one rank owns everything: none)."""
    if ranks <= 1:
        return 0.0
    side = (n / rho) ** (1 / 3)
    return rho * ((side + 2 * width) ** 3 - side**3)


def step_time(m: dict, n_per_rank: float, ranks: int, hw: dict) -> dict:
    """Predicted seconds of one force evaluation (compute, communication, total)."""
    k = coefficients(m)
    if m["strategy"] == "halo":
        g = ghost_rows(n_per_rank, m["density"], m["ghost_width"], ranks)
        rows = n_per_rank + g
        comm_bytes = k["comm_ghost"] * g
    else:
        rows = n_per_rank
        comm_bytes = k["comm_atom"] * n_per_rank * ranks if ranks > 1 else 0.0
    n_sys = n_per_rank * ranks
    compute = max((k["flops_row"] * rows + k["flops_atom"] * n_sys) / hw["flops"],
                  (k["bytes_row"] * rows + k["bytes_atom"] * n_sys) / hw["hbm"])
    if ranks <= 1:
        comm = 0.0
    else:
        across = ranks > hw["per_node"]
        link = hw["ib"] if across else hw["nvlink"]
        latency = hw["lat_ib"] if across else hw["lat_nvlink"]
        comm = k["messages"] * latency + comm_bytes / link
    return dict(compute=compute, comm=comm, total=compute + comm)


# ---------------------------------------------------------------------- CPU validation


def cpu_constants() -> dict:
    from timing import call_times

    """This CPU core's float32 flop rate (a jitted matmul) and memory bandwidth (a copy)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    a = jnp.asarray(np.random.default_rng(0).random((1024, 1024), np.float32))
    mm = jax.jit(lambda x: x @ x)
    flops = 2 * 1024**3 / min(call_times(lambda: mm(a), 5))
    big = jnp.zeros(16 * 1024 * 1024, jnp.float32)
    cp = jax.jit(lambda x: x + 1.0)
    bandwidth = 2 * big.nbytes / min(call_times(lambda: cp(big), 5))
    return dict(flops=flops, hbm=bandwidth, nvlink=bandwidth / 2, ib=bandwidth / 2, lat_nvlink=20e-6,
                lat_ib=20e-6, per_node=64)


def worker(spec: str) -> int:
    """In a child pinned to ``ranks`` cores: this CPU's constants, the measured work and the
    measured time of one evaluation."""
    kw = json.loads(spec)
    set_device_count(kw["ranks"])  # before JAX is imported (it reads the count once)
    from timing import call_times

    import numpy as np

    import jaxdd

    import jax

    model, atoms, _, cutoff = build(kw["model"], kw["quick"], large=True)
    data = jaxdd.AtomicData.from_ase(atoms, dtype=np.float32)
    dm = jaxdd.DistributedModel(model, jaxdd.DomainConfig(cutoff, mesh=mesh_of(kw["ranks"]),
                                                          grid=(kw["ranks"], 1, 1), strategy="halo",
                                                          neighbor_backend="jnp"))
    inputs = dm.prepare(data, ("energy", "forces"))  # the host's partition and plan, outside the timing
    apply = jax.jit(dm.apply)
    seconds = statistics.median(call_times(lambda: apply(model, inputs)["forces"], 7))
    m = measure(kw["model"], "halo", kw["quick"], kw["ranks"], large=True) if kw["ranks"] > 1 else None
    print(json.dumps(dict(seconds=seconds, constants=cpu_constants() if kw["ranks"] == 1 else None,
                          measured=m, atoms=len(atoms))), flush=True)
    return 0


def pinned(model: str, ranks: int, quick: bool) -> dict:
    from timing import run_pinned

    return run_pinned(__file__, dict(model=model, ranks=ranks, quick=quick), ranks)[0]


def validation(quick: bool, models=("lj", "schnet")) -> list[dict]:
    """Predicted against measured evaluation time on 1 and 2 pinned CPU devices (LJ and
    SchNet of ``models``: the quick ones to run twice more)."""
    rows = []
    for model in [m for m in ("lj", "schnet") if m in models]:
        one, two = pinned(model, 1, quick), pinned(model, 2, quick)
        hw, m = one["constants"], two["measured"]
        n = one["atoms"]
        for ranks, run in ((1, one), (2, two)):
            per_rank = n / ranks
            if ranks == 1:  # no ghosts, no messages: the work of all rows on one device
                k = coefficients(m)
                predicted = step_time(m, n, 1, hw)["total"]
            else:  # the measured rank's own rows (a 2-rank slab decomposition, not a cube)
                k = coefficients(m)
                rows_2 = m["owned_rows"] + m["ghost_rows"]
                predicted = (max(k["flops_row"] * rows_2 / hw["flops"], k["bytes_row"] * rows_2 / hw["hbm"])
                             + k["messages"] * hw["lat_nvlink"] + m["comm_bytes"] / hw["nvlink"])
            rows.append(dict(model=model, ranks=ranks, atoms=n, atoms_per_rank=per_rank, measured=run["seconds"],
                             predicted=predicted, error=predicted / run["seconds"] - 1))
    return rows


# ---------------------------------------------------------------------- main


def plot(path: Path, measured: list[dict]) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    gpus = [2**k for k in range(11)]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    for m in measured:
        label = f"{m['model']} ({'halo' if m['strategy'] == 'halo' else 'node blocks'})"
        style = "-" if m["strategy"] == "halo" else "--"
        t1 = step_time(m, 1e6, 1, H200)["total"]
        ax1.plot(gpus, [t1 / step_time(m, 1e6, p, H200)["total"] for p in gpus], style, marker="o", ms=3,
                 label=label)
        ax2.plot(gpus, [step_time(m, 1e7 / p, p, H200)["total"] for p in gpus], style, marker="o", ms=3,
                 label=label)
    ax1.set(xscale="log", xlabel="H200 GPUs", ylabel="weak-scaling efficiency", ylim=(0, 1.05),
            title="1,000,000 atoms per GPU")
    ax2.set(xscale="log", yscale="log", xlabel="H200 GPUs", ylabel="predicted seconds per force evaluation",
            title="10,000,000 atoms in all")
    for ax in (ax1, ax2):
        ax.axvline(8, color="grey", lw=0.8, ls=":")
        ax.grid(alpha=0.3)
    ax2.legend(fontsize=7)
    fig.suptitle("jaxdd scaling model (XLA cost analysis of measured per-rank programs, H200 constants)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    return True


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["--worker"]:
        return worker(argv[1])
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="smaller systems (a smoke run)")
    p.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, of {','.join(MODELS)}")
    p.add_argument("--png", type=Path, default=None, help="write the plot here (needs matplotlib)")
    p.add_argument("--json", type=Path, default=None, help="write the figures as JSON here")
    p.add_argument("--no-validation", action="store_true", help="skip the pinned CPU measurements")
    args = p.parse_args(argv)
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    if not models or any(m not in MODELS for m in models):
        p.error(f"--models must list some of {','.join(MODELS)}, got {args.models!r}")
    set_device_count(2)

    print("1. Per-rank work of one force evaluation, 2 CPU devices, float32 (XLA cost analysis)")
    print(f"{'model':>8} {'strategy':>16} {'atoms':>6} {'rows':>10} {'Mflop':>9} {'MB accessed':>11} "
          f"{'messages':>8} {'comm kB':>8}")
    measured = []
    for name in models:
        for strategy in STRATEGIES:
            m = measure(name, strategy, args.quick)
            measured.append(m)
            print(f"{name:>8} {strategy:>16} {m['atoms']:>6} {m['owned_rows']:>5}+{m['ghost_rows']:<4} "
                  f"{m['flops'] / 1e6:>9.1f} {m['bytes'] / 1e6:>11.1f} {m['messages']:>8} "
                  f"{m['comm_bytes'] / 1e3:>8.1f}", flush=True)

    print("\n2. Predicted seconds per force evaluation on H200 GPUs (compute + communication)")
    gpus = (1, 8, 64, 1024)
    print(f"{'model':>8} {'strategy':>16} " + " ".join(f"{'weak ' + str(g):>11}" for g in gpus)
          + " " + " ".join(f"{'strong ' + str(g):>11}" for g in gpus))
    predictions = []
    for m in measured:
        weak = [step_time(m, 1e6, g, H200) for g in gpus]
        strong = [step_time(m, 1e7 / g, g, H200) for g in gpus]
        predictions.append(dict(model=m["model"], strategy=m["strategy"], gpus=gpus, weak=weak, strong=strong))
        print(f"{m['model']:>8} {m['strategy']:>16} " + " ".join(f"{w['total']:>11.2e}" for w in weak) + " "
              + " ".join(f"{s['total']:>11.2e}" for s in strong))
    print("weak: 1,000,000 atoms per GPU; strong: 10,000,000 atoms in all. Node blocks all-gather every "
          "layer's features of the whole system, so their communication grows with the GPU count.")

    rows = []
    if not args.no_validation:
        print("\n3. Validation on this CPU: one evaluation on 1 and 2 devices pinned to 1 and 2 cores")
        rows = validation(args.quick, models)
        for r in rows:
            print(f"{r['model']:>8} {r['ranks']} device(s), {r['atoms']} atoms: measured {r['measured'] * 1e3:8.2f} ms, "
                  f"predicted {r['predicted'] * 1e3:8.2f} ms, prediction error {r['error']:+.0%}")
    if args.png is not None:
        print(f"\nplot: {args.png}" if plot(args.png, measured) else "\nplot: matplotlib is not installed")
    if args.json is not None:
        from timing import write_record

        write_record(args.json, dict(benchmark="scaling_model", hardware=H200, measured=measured,
                                     predictions=predictions, validation=rows, quick=args.quick))
    return 0


if __name__ == "__main__":
    sys.exit(main())
