"""What every figure of the report shares: an Agg canvas, panels per model, colours, the band over documents.

Figures are built without pyplot on an Agg canvas (:func:`new_figure`), so they render
headless and importing this module never changes the user's matplotlib backend.

Bands and error bars describe uncertainty *across documents* (the unit of
inference): the document mean ± z · SD_docs / √n_docs, falling back to the Monte
Carlo SE when there is a single document (:func:`doc_band`). Panels are split by
``model`` when the data hold several models (:func:`model_values`, :func:`panel_row`).
What each figure shows is :mod:`divstats.report.figures`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import xarray as xr
from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from scipy import stats

__all__ = ["PALETTE", "add_legend", "doc_band", "model_values", "new_figure", "panel_row", "policy_colors",
           "set_title"]

#: The colours every figure cycles through (matplotlib's tab10), in this order.
PALETTE = ("#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2",
           "#7f7f7f", "#bcbd22", "#17becf")



def policy_colors(policies: Sequence[str]) -> dict[str, str]:
    """A stable colour per policy (in dataset order), shared by every figure.

    Parameters
    ----------
    policies : sequence of str
        Policy ids in dataset order.

    Returns
    -------
    dict of str to str
        Policy → hex colour.

    Examples
    --------
    >>> policy_colors(["a", "b"])
    {'a': '#1f77b4', 'b': '#d62728'}
    """
    return {str(p): PALETTE[i % len(PALETTE)] for i, p in enumerate(policies)}


def model_values(ds: xr.Dataset | xr.DataArray) -> list[Any]:
    """The models to draw a panel for: the ``model`` coordinate's values, or ``[None]`` without one.

    Parameters
    ----------
    ds : xarray.Dataset or xarray.DataArray
        The figure's data.

    Returns
    -------
    list
        One entry per panel (``None``: the data have no ``model`` dim).

    Examples
    --------
    >>> import xarray as xr
    >>> len(model_values(xr.Dataset(coords={"model": ["a", "b"]}))), model_values(xr.Dataset())
    (2, [None])
    """
    return list(ds["model"].values) if "model" in ds.dims else [None]


def new_figure(width: float, height: float) -> Figure:
    """A pyplot-free Figure on an Agg canvas: headless, and the global backend is left alone.

    Parameters
    ----------
    width, height : float
        Size in inches.

    Returns
    -------
    matplotlib.figure.Figure
        With the constrained layout.

    Examples
    --------
    >>> new_figure(6.4, 4.2).get_size_inches().tolist()
    [6.4, 4.2]
    """
    fig = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def panel_row(n: int, width: float = 6.4, height: float = 4.2, sharey: bool = True) -> tuple[Figure, list]:
    """A figure with ``n`` panels side by side (one per model), each ``width`` x ``height``.

    Parameters
    ----------
    n : int
        Panels.
    width, height : float
        One panel's size in inches.
    sharey : bool
        Whether the panels share the y axis.

    Returns
    -------
    (matplotlib.figure.Figure, list of matplotlib.axes.Axes)

    Examples
    --------
    >>> fig, axes = panel_row(2)
    >>> len(axes), fig.get_size_inches().tolist()
    (2, [12.8, 4.2])
    """
    fig = new_figure(width * n if n > 1 else width, height)
    axes = fig.subplots(1, n, sharey=sharey, squeeze=False)[0]
    return fig, list(axes)



def doc_band(values: xr.DataArray, se: xr.DataArray | None = None, level: float = 0.95,
             dim: str = "doc") -> tuple[xr.DataArray, xr.DataArray, xr.DataArray]:
    """(mean, low, high) over documents: mean ± z·SD_docs/√n (MC SE if one document).

    Parameters
    ----------
    values : xarray.DataArray
        Per-document values.
    se : xarray.DataArray, optional
        Their Monte Carlo SEs (used with a single document).
    level : float
        Band level.
    dim : str
        The document dim.

    Returns
    -------
    (xarray.DataArray, xarray.DataArray, xarray.DataArray)
        Mean, low and high, ``dim`` reduced.

    Examples
    --------
    >>> import xarray as xr
    >>> m, lo, hi = doc_band(xr.DataArray([1.0, 2.0, 3.0], dims="doc"))
    >>> float(m), bool(lo < m < hi)
    (2.0, True)
    """
    z = stats.norm.ppf(0.5 + level / 2)
    mean = values.mean(dim, skipna=True)
    n = values.notnull().sum(dim)
    if values.sizes[dim] > 1:
        half = z * values.std(dim, ddof=1, skipna=True) / np.sqrt(n.where(n > 0))
    elif se is not None:
        half = z * se.squeeze(dim, drop=True)
    else:
        half = xr.zeros_like(mean)
    return mean, mean - half, mean + half


def set_title(ax: Axes, text: str, model: Any) -> None:
    """A panel's title, naming its model when there is one.

    Parameters
    ----------
    ax : matplotlib.axes.Axes
        The panel.
    text : str
        The title.
    model : Any
        The panel's model (``None``: the data have no ``model`` dim).

    Examples
    --------
    >>> fig, (ax,) = panel_row(1)
    >>> set_title(ax, "Survival", "m"); ax.get_title()
    'Survival — m'
    """
    ax.set_title(text if model is None else f"{text} — {model}", fontsize=11)


def add_legend(ax: Axes, n: int) -> None:
    """A small frameless legend, only where something is labelled.

    Parameters
    ----------
    ax : matplotlib.axes.Axes
        The panel.
    n : int
        Entries expected (0: no legend).

    Examples
    --------
    >>> fig, (ax,) = panel_row(1)
    >>> add_legend(ax, 1); ax.get_legend() is None
    True
    """
    # only where something is labelled: matplotlib warns "No artists with labels found" otherwise
    if n and ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8, frameon=False, loc="best")
