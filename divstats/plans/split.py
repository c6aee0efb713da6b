"""The document split of a plan (docs/statistics.md §8): exploratory and confirmatory documents.

A plan fixes the split before the data are seen: a document is confirmatory iff a salted
sha256 of its id, read as a uniform number, falls below the plan's confirmatory fraction
(:func:`assign_split`), so the split depends on the document alone, never on which other
documents a study holds.  :func:`split_table` sets it beside the split labels a dataset
carries and :func:`split_disagreement_note` says where they disagree (the plan's split is
the one used).  ``kvdiv split`` prints it (docs/plans.md).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import pandas as pd

from divstats.errors import PlanError
from divstats.plans.format import Plan

__all__ = ["assign_split", "split_disagreement_note", "split_table", "split_uniform"]



def split_uniform(doc_id: str, salt: str) -> float:
    """sha256(salt + ":" + doc_id) read as a uniform number in [0, 1).

    Parameters
    ----------
    doc_id : str
        The document id.
    salt : str
        The plan's salt.

    Returns
    -------
    float
        The first 8 bytes of the digest as a big-endian integer, divided by 2**64.

    Examples
    --------
    >>> 0 <= split_uniform("doc0", "kvdiv-paper-v1") < 1
    True
    """
    digest = hashlib.sha256(f"{salt}:{doc_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2.0 ** 64


def assign_split(doc_ids: Sequence[str], salt: str, confirmatory_fraction: float = 0.5) -> list[str]:
    """The authoritative split: confirmatory iff the salted hash falls below the fraction.

    Parameters
    ----------
    doc_ids : sequence of str
        Document ids (anything else is converted with ``str``).
    salt : str
        The plan's salt.
    confirmatory_fraction : float
        The plan's confirmatory fraction.

    Returns
    -------
    list of str
        ``"confirmatory"`` or ``"exploratory"`` per document, in order.

    Examples
    --------
    >>> assign_split(["a", "b"], "s", 1.0)
    ['confirmatory', 'confirmatory']
    """
    return ["confirmatory" if split_uniform(str(d), salt) < confirmatory_fraction else "exploratory"
            for d in doc_ids]


def split_table(doc_ids: Sequence[str], plan: Plan, dataset_split: Sequence[str] | None = None) -> pd.DataFrame:
    """doc → plan split, the dataset's split label (if any) and whether they agree.

    Parameters
    ----------
    doc_ids : sequence of str
        Document ids.
    plan : Plan
        The plan whose salt and fraction define the split.
    dataset_split : sequence of str, optional
        The data's own split labels; a blank label means "not assigned" and is
        not a disagreement.

    Returns
    -------
    pandas.DataFrame
        Columns ``doc``, ``split``, ``dataset_split``, ``agrees``.

    Raises
    ------
    PlanError
        When ``dataset_split`` does not hold one label per document.

    Examples
    --------
    >>> from divstats.plans.format import load_plan
    >>> t = split_table(["doc0"], load_plan("paper"), ["exploratory"])
    >>> t.columns.tolist()
    ['doc', 'split', 'dataset_split', 'agrees']
    """
    ids = [str(d) for d in doc_ids]
    table = pd.DataFrame({"doc": ids, "split": assign_split(ids, plan.salt, plan.confirmatory_fraction)})
    ds_split = [str(s) for s in dataset_split] if dataset_split is not None else [""] * len(ids)
    if len(ds_split) != len(ids):
        raise PlanError(f"{len(ds_split)} split labels for {len(ids)} documents")
    table["dataset_split"] = ds_split
    table["agrees"] = [(s == "" or s == p) for s, p in zip(ds_split, table["split"], strict=True)]
    return table


def split_disagreement_note(table: pd.DataFrame, limit: int = 5) -> str | None:
    """A sentence describing disagreements with the dataset's split labels, or None.

    Parameters
    ----------
    table : pandas.DataFrame
        A :func:`split_table`.
    limit : int
        How many disagreeing documents to name.

    Returns
    -------
    str or None
        None when every label agrees (or is blank).

    Examples
    --------
    >>> from divstats.plans.format import load_plan
    >>> split_disagreement_note(split_table(["doc0"], load_plan("paper"))) is None
    True
    """
    bad = table.loc[~table["agrees"]]
    if bad.empty:
        return None
    examples = ", ".join(f"{r.doc} (data: {r.dataset_split}, plan: {r.split})" for r in bad.head(limit).itertuples())
    return (f"{len(bad)} of {len(table)} documents carry a dataset split label that disagrees with the "
            f"plan's hash split; the plan's split was used (e.g. {examples}).")
