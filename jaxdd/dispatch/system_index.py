"""Graph indices a model builds from the batch's description: recognised by what they compute.

jraph and the codes built on it give every node row its graph with
``jnp.repeat(arange(n_graph), n_node, total_repeat_length=n)``, where ``n_node`` comes from
``jnp.diff(ptr)``, ``jnp.bincount(batch_idx)`` or a padding graph appended to either; others
write the same with cumulative sums of ``n_node``. On one device such a value is ``batch_idx``.
Under decomposition it is computed from the *global* node counts over *local* rows, so its
values are wrong for every rank's rows; the dispatch must hand the model the local
``batch_idx`` instead.

The value is recognised by evaluating it: its producing equations are run on a few made-up
batch descriptions (``ptr``, ``batch_idx``, ``atom_mask``, ``system_mask`` of systems of
different sizes), and it is the graph index when on every one it equals ``batch_idx`` on the
real rows, whatever way the model wrote it, and it changes with them (a constant is not taken).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

__all__ = ["SYSTEM_FIELDS", "probes", "is_system_index"]

#: The batch fields that describe which rows belong to which system.
SYSTEM_FIELDS = ("ptr", "batch_idx", "atom_mask", "system_mask")


def probes(n_rows: int, n_systems: int) -> list[dict[str, np.ndarray]]:
    """Made-up descriptions of ``n_systems`` systems on ``n_rows`` rows, each system at least one
    atom, with and without padding rows; fields as :class:`~jaxdd.Batch` holds them."""
    if n_systems < 1 or n_rows < n_systems:
        return []
    rng = np.random.default_rng(n_rows * 7919 + n_systems)
    spare = n_rows - n_systems
    totals = sorted({spare, spare // 2, max(spare - 3, 0)}, reverse=True)
    out = []
    for extra in totals:
        counts = np.ones(n_systems, np.int64) + rng.multinomial(extra, np.full(n_systems, 1.0 / n_systems))
        ptr = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
        batch_idx = np.full(n_rows, n_systems, np.int32)
        batch_idx[: ptr[-1]] = np.repeat(np.arange(n_systems, dtype=np.int32), counts)
        out.append(dict(ptr=ptr, batch_idx=batch_idx, atom_mask=batch_idx < n_systems,
                        system_mask=np.ones(n_systems, bool)))
    return out


def is_system_index(evaluate: Callable[[dict], np.ndarray | None], cases: list[dict]) -> bool:
    """Whether a value is the system of each row: ``evaluate(case)`` gives it for a made-up
    batch description (None when it depends on anything else); it must equal ``batch_idx`` on
    the real rows of every case, and differ between cases (so it follows them)."""
    seen = []
    for case in cases:
        value = evaluate(case)
        if value is None:
            return False
        value = np.asarray(value).reshape(-1)
        real = int(case["ptr"][-1])
        if value.shape[0] < case["batch_idx"].shape[0] or not np.array_equal(value[:real], case["batch_idx"][:real]):
            return False
        seen.append(value)
    return len(seen) > 1 and any(not np.array_equal(seen[0], v) for v in seen[1:])
