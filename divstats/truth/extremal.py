"""The explicit construction behind the sharp interval (docs/statistics.md §6).

``divstats.estimation.interval`` estimates the sharp bounds on the loss from
traces observed W steps past divergence; :func:`extremal_kernels` shows that no
narrower interval is valid by building, for any kernel pair, a pair over a tagged
alphabet with the same observed window law that attains either end.
"""

from __future__ import annotations

import numpy as np

from divstats.truth.kernels import CoupledKernels, Kernel, step_law

__all__ = ["Untag", "extremal_kernels"]


class Untag:
    """Map from the tagged alphabet of ``extremal_kernels`` back to original tokens.

    Call it on a token or an array of tokens; ``table`` is the lookup array.
    Layout for an original vocabulary of size V: shared S(v) = v, P-residual
    A(v) = V + v, Q-residual B(v) = 2V + v, neutral N(v) = 3V + v, then the fixed
    tail tokens F0 = 4V, F1 = 4V + 1, F2 = 4V + 2.  Every tag of EOS is the
    original EOS index itself, so EOS stays one absorbing token.
    """

    def __init__(self, vocab_size: int, eos: int | None) -> None:
        V = vocab_size
        table = np.concatenate([np.arange(V)] * 4 + [np.zeros(3, dtype=int)])
        non_eos = [v for v in range(V) if v != eos]
        table[4 * V] = eos if eos is not None else non_eos[0]
        table[4 * V + 1] = non_eos[0]
        table[4 * V + 2] = non_eos[1] if len(non_eos) > 1 else (eos if eos is not None else non_eos[0])
        self.table = table
        self.vocab_size = 4 * V + 3

    def __call__(self, tokens):
        return self.table[np.asarray(tokens)]


class _Extremal:
    """State shared by the two tagged kernels: the original pair and the tag layout."""

    def __init__(self, p: Kernel, q: Kernel, V: int, W: int, bound: str, eos: int | None) -> None:
        self.kern = CoupledKernels(p, q, V, eos)
        self.V, self.W, self.bound, self.eos = V, W, bound, self.kern.eos
        self.untag = Untag(V, self.eos)
        self.V2 = self.untag.vocab_size

    def _place(self, block: int, mass: np.ndarray, out: np.ndarray) -> None:
        idx = block * self.V + np.arange(self.V)
        if self.eos is not None:
            idx[self.eos] = self.eos  # EOS keeps its own index whatever the tag
        np.add.at(out, idx, mass)

    def kernel(self, history: tuple[int, ...], side: str) -> np.ndarray:
        out = np.zeros(self.V2)
        if self.eos is not None and history and history[-1] == self.eos:
            out[self.eos] = 1.0
            return out
        own_block = 1 if side == "p" else 2
        h = np.asarray(history, dtype=int)
        tagged = np.flatnonzero((h >= own_block * self.V) & (h < (own_block + 1) * self.V))
        orig = tuple(int(v) for v in self.untag(h)) if len(h) else ()
        if len(tagged) == 0:
            # before divergence both laws are computable on the shared history
            law = step_law(self.kern.p(orig), self.kern.q(orig))
            common = np.minimum(law.p, law.q)
            self._place(0, common, out)
            res = np.clip((law.p - law.q) if side == "p" else (law.q - law.p), 0.0, None)
            self._place(own_block, res, out)
            return out
        age = len(h) + 1 - (int(tagged[0]) + 1)
        if age <= self.W:
            law = self.kern.p(orig) if side == "p" else self.kern.q(orig)
            self._place(3, law, out)
            return out
        if self.bound == "lower":
            # one common token, D = 0; with an EOS it is EOS itself, so a branch facing
            # an already ended branch ends too and they agree from then on
            out[self.eos if self.eos is not None else 4 * self.V] = 1.0
        else:
            out[4 * self.V + (1 if side == "p" else 2)] = 1.0
        return out


def extremal_kernels(
    p: Kernel,
    q: Kernel,
    vocab_size: int,
    horizon: int,
    window: int,
    bound: str = "lower",
    eos: int | None = None,
) -> tuple[Kernel, Kernel, int, Untag]:
    """A kernel pair attaining one end of the sharp interval (docs/statistics.md §6).

    Returns ``(p2, q2, vocab_size2, untag)``: kernels over a tagged alphabet of
    size 4V + 3 and the map back to original tokens.  Before divergence the shared
    mass min(p, q) goes to shared-tagged tokens and each residual to its own tag,
    so each branch sees its divergence time in its own history; for ages 1..W both
    emit neutral-tagged copies of the original laws (same TVs, same coupling law);
    after age W both emit the same fixed token (``bound="lower"``: D = 0; with an
    EOS that token is EOS itself, so a branch facing an ended one also ends) or two
    different fixed tokens (``"upper"``: D = 1 unless both have already ended).
    ``exact(p2, q2, vocab_size2, horizon, window, eos)`` then gives
    loss = the endpoint with the original occurrence and window mismatch.

    Parameters
    ----------
    p, q : callable
        Kernels: a history (tuple of tokens) → probabilities over ``vocab_size`` tokens.
    vocab_size : int
        V.
    horizon : int
        T.
    window : int
        W, post-divergence steps observed.
    bound : {"lower", "upper"}
        Which end of the interval to attain.
    eos : int, optional
        Absorbing end-of-sequence token.

    Returns
    -------
    (callable, callable, int, Untag)
        ``(p2, q2, vocab_size2, untag)``.

    Raises
    ------
    ValueError
        For an unknown bound, a negative window or a horizon below 1.

    Examples
    --------
    >>> import numpy as np
    >>> p = lambda h: np.array([0.6, 0.4])
    >>> q = lambda h: np.array([0.5, 0.5])
    >>> from divstats.truth.exact import exact
    >>> p2, q2, v2, untag = extremal_kernels(p, q, 2, 4, 1, "upper")
    >>> bool(np.isclose(exact(p2, q2, v2, 4, 1).loss, exact(p, q, 2, 4, 1).loss_upper))
    True
    """
    if bound not in ("lower", "upper"):
        raise ValueError(f"bound must be 'lower' or 'upper', got {bound!r}")
    if window < 0 or horizon < 1:
        raise ValueError("need window >= 0 and horizon >= 1")
    ext = _Extremal(p, q, vocab_size, int(window), bound, eos)
    return (lambda h: ext.kernel(h, "p")), (lambda h: ext.kernel(h, "q")), ext.V2, ext.untag
