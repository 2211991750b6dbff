"""Benchmark: XLA's CPU scatter-add by row width, the reason ``edge_vectors``' gradient adds rows of four.

    python bench/scatter_rows.py [--edges 834615] [--rows 48379] [--repeat 20] [--all-cores]

Forces from autodiff end in a scatter-add of one ``[E, 3]`` array of edge gradients into
``[n_atoms, 3]`` rows, by receiver (sorted: a rank's list comes grouped by receiver) and by
sender (scattered). This times ``jax.ops.segment_sum`` of ``[E, w]`` float32 rows for widths
1 to 4, receiver-sorted and random indices, fastest of ``--repeat`` jitted calls, the
process pinned to one core (``--all-cores`` lifts that). The default sizes are a rank's
edge slots and rows in ``bench/md_lj.py``'s two-device run. The reference is the width-4 row
of the same run: ``edge_vectors`` reads positions as rows of four in its derivative, so its
gradient scatters rows of four, and the figure to beat is width 3 over width 4.
"""

from __future__ import annotations

import argparse
import os
import sys
import time


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--edges", type=int, default=834_615, help="edge rows scattered (default 834,615)")
    p.add_argument("--rows", type=int, default=48_379, help="rows scattered into (default 48,379)")
    p.add_argument("--repeat", type=int, default=20, help="timed calls; the fastest is reported (default 20)")
    p.add_argument("--all-cores", action="store_true", help="do not pin the process to one core")
    args = p.parse_args(argv)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from timing import check_args

    check_args(p, args, positive=("edges", "rows", "repeat"))
    if not args.all_cores and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})  # before JAX starts its threads
    import jax
    import jax.numpy as jnp
    import numpy as np

    rng = np.random.default_rng(0)
    owned = max(1, args.rows // 3)  # receivers are the owned rows, the first third or so
    indices = {"receiver-sorted": np.sort(rng.integers(0, owned, args.edges)).astype(np.int32),
               "random": rng.integers(0, args.rows, args.edges).astype(np.int32)}
    scatter = jax.jit(lambda g, i: jax.ops.segment_sum(g, i, args.rows))

    def fastest(g, i) -> float:
        scatter(g, i).block_until_ready()
        best = float("inf")
        for _ in range(args.repeat):
            t0 = time.perf_counter()
            scatter(g, i).block_until_ready()
            best = min(best, time.perf_counter() - t0)
        return best * 1e3

    print(f"segment_sum of [{args.edges:,}, w] float32 into [{args.rows:,}, w], fastest of {args.repeat} calls, "
          f"{'all cores' if args.all_cores else 'one core'}")
    print(f"{'indices':>16} {'w=1 ms':>8} {'w=2 ms':>8} {'w=3 ms':>8} {'w=4 ms':>8} {'w=3 / w=4':>10}")
    for name, idx in indices.items():
        idx = jnp.asarray(idx)
        ms = [fastest(jnp.asarray(rng.normal(size=(args.edges, w)).astype(np.float32)), idx) for w in (1, 2, 3, 4)]
        print(f"{name:>16} " + " ".join(f"{m:>8.2f}" for m in ms) + f" {ms[2] / ms[3]:>9.2f}x", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
