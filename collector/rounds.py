"""The rounds of an adaptive collection, packed into one dataset along ``replicate``.

Round 0 (the pilot, or the whole of a run with a fixed R) asks R replicates of every
(document, policy); each later round k >= 1 asks every pair its own number, its
*allocation* (0: no request), recorded in ``rounds/<k>/allocation.json``
(``collector.journal``). A ``kvdiv.trace/1`` dataset is rectangular, so the packed
dataset gives round k a block of B_k replicate slots, B_k being the round's largest
allocation, the same block for every pair; a pair asked fewer replicates has the
rest of its block filled with *absent* replicates (NaN TVs, token -1, branch step 0:
"nothing observed", docs/contract.md §1), which every estimator skips. Padding is
allowed for residual traces only (coupled trajectories are complete by contract),
so adaptive collections are residual.

What the packed dataset adds:

- coordinate ``round`` (replicate): the round each replicate slot belongs to. Its
  presence marks an adaptive collection, whose round 0 informed the allocation of
  the later rounds; ``divstats`` therefore leaves round 0 out of every estimate
  (docs/design.md, "Spending further replicates where they pay").
- coordinates over (doc, policy, request_round), one entry per round:
  ``round_replicates`` (replicates asked), ``round_seed`` (the request's seed, -1 when
  not asked), ``round_elapsed_s`` (NaN when not asked). The per-request coordinates
  of a plain run (``seed``, ``elapsed_s``, ``stream_sha256``...) describe round 0.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from collector.checks import asked_replicates
from collector.journal import Journal
from protocols import absent_value

__all__ = ["RoundLayout", "pad_replicates", "stack_rounds"]


@dataclass(frozen=True)
class RoundLayout:
    """Where each round's replicates go along ``replicate``.

    Attributes
    ----------
    params : dict
        The run's parameters (the manifest's ``params``; ``replicates`` is round 0's R).
    allocations : dict
        round k >= 1 -> doc -> policy -> replicates asked in that round.

    Examples
    --------
    >>> lay = RoundLayout({"replicates": 2}, {1: {"d": {"a": 3, "b": 1}}})
    >>> lay.rounds, lay.widths, lay.round_of_slot().tolist()
    ((0, 1), (2, 3), [0, 0, 1, 1, 1])
    """

    params: dict[str, Any]
    allocations: dict[int, dict[str, dict[str, int]]]

    @classmethod
    def from_journal(cls, journal: Journal, params: Mapping[str, Any]) -> RoundLayout:
        """The layout of a run: round 0 from ``params``, later rounds from their recorded allocations."""
        allocations = {}
        for k in journal.rounds():
            record = journal.for_round(k).read_allocation()
            if record is not None:
                allocations[k] = record["replicates"]
        return cls(dict(params), allocations)

    @property
    def adaptive(self) -> bool:
        """True when the run has later rounds."""
        return bool(self.allocations)

    @property
    def rounds(self) -> tuple[int, ...]:
        return (0, *sorted(self.allocations))

    @property
    def widths(self) -> tuple[int, ...]:
        """Replicate slots of each round (round 0: R; round k: its largest allocation)."""
        later = [max((r for row in self.allocations[k].values() for r in row.values()), default=0)
                 for k in sorted(self.allocations)]
        return (int(self.params["replicates"]), *later)

    def round_params(self, k: int) -> dict[str, Any]:
        """The parameters round k's requests answer (``collector.checks.header_problems``)."""
        if k == 0:
            return dict(self.params)
        return {**self.params, "round": k, "allocation": self.allocations[k]}

    def asked(self, k: int, doc_id: str, policy: str) -> int:
        """Replicates round k asked of (doc_id, policy)."""
        return asked_replicates(self.round_params(k), doc_id, policy)

    def round_of_slot(self) -> np.ndarray:
        """The ``round`` coordinate: the round of each replicate slot (int32)."""
        return np.repeat(np.array(self.rounds, dtype=np.int32), self.widths)


def pad_replicates(ds: Any, width: int) -> Any:
    """``ds`` with ``width`` replicate slots, those beyond its own replicates absent.

    Parameters
    ----------
    ds : xarray.Dataset
        One assembled request (or any trace dataset) with replicates 0..n-1, n <= width.
    width : int
        Slots wanted.

    Returns
    -------
    xarray.Dataset
        Replicate coordinate 0..width-1; absent slots hold NaN, -1 or (``branch_step``) 0.

    Examples
    --------
    >>> from protocols.examples import example_dataset
    >>> ds = example_dataset("residual", docs=1, policies=1, replicates=2)
    >>> padded = pad_replicates(ds, 3)
    >>> padded.sizes["replicate"], int(padded["branch_step"][0, 0, 2])
    (3, 0)
    """
    n = ds.sizes["replicate"]
    if n > width:
        raise ValueError(f"{n} replicates do not fit in {width} slots")
    ds = ds.assign_coords(replicate=np.arange(n, dtype=np.int32))
    if n == width:
        return ds
    dtypes = {name: var.dtype for name, var in ds.data_vars.items() if "replicate" in var.dims}
    fill = {name: absent_value(str(name), dtype) for name, dtype in dtypes.items()}
    out = ds.reindex(replicate=np.arange(width, dtype=np.int32), fill_value=fill)
    return out.assign({name: out[name].astype(dtype) for name, dtype in dtypes.items()})  # reindex promotes


def stack_rounds(parts: Mapping[int, Any], layout: RoundLayout, doc_id: str, policy: str) -> Any:
    """One (document, policy)'s requests of every round, stacked along ``replicate`` in the run's layout.

    Parameters
    ----------
    parts : mapping
        round -> the assembled request of that round (one doc, one policy); round 0
        is required, a later round the pair was not asked in is absent.
    layout : RoundLayout
        The run's layout (the blocks' widths).
    doc_id, policy : str
        The pair (for the per-round coordinates).

    Returns
    -------
    xarray.Dataset
        Every round's block (padded to its width), replicate 0..n-1, the ``round``
        coordinate and the ``round_*`` coordinates (module docstring); the other
        per-request coordinates are round 0's.
    """
    import xarray as xr

    first = parts[0]
    blocks = [pad_replicates(parts.get(k, first.isel(replicate=slice(0, 0))), width)
              for k, width in zip(layout.rounds, layout.widths, strict=True)]
    out = xr.concat(blocks, dim="replicate", data_vars="minimal", coords="minimal", compat="override",
                    join="override", combine_attrs="override")
    n = out.sizes["replicate"]
    out = out.assign_coords(replicate=np.arange(n, dtype=np.int32), round=("replicate", layout.round_of_slot()))
    return out.assign_coords(_round_coords(parts, layout, doc_id, policy))


def _round_coords(parts: Mapping[int, Any], layout: RoundLayout, doc_id: str, policy: str) -> dict[str, Any]:
    dims = ("doc", "policy", "request_round")
    asked = [layout.asked(k, doc_id, policy) for k in layout.rounds]
    seed = [_scalar(parts.get(k), "seed", -1) for k in layout.rounds]
    elapsed = [_scalar(parts.get(k), "elapsed_s", np.nan) for k in layout.rounds]
    return {
        "request_round": ("request_round", np.array(layout.rounds, dtype=np.int32)),
        "round_replicates": (dims, np.array([[asked]], dtype=np.int32)),
        "round_seed": (dims, np.array([[seed]], dtype=np.int64)),
        "round_elapsed_s": (dims, np.array([[elapsed]], dtype=np.float64)),
    }


def _scalar(ds: Any, name: str, default: Any) -> Any:
    if ds is None or name not in ds.coords:
        return default
    return ds.coords[name].values.reshape(-1)[0]
