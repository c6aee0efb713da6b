"""protocols.validate: one test per rule, each on a dataset broken in exactly that way."""

from __future__ import annotations

import numpy as np
import pytest
import xarray as xr
from hypothesis import given, settings
from hypothesis import strategies as st

from protocols import TraceValidationError, validate
from protocols.examples import example_dataset
from protocols.schema import coupled_dataset, reference_dataset, residual_dataset

NAN = np.nan


def coupled_base() -> xr.Dataset:
    """2 docs x 2 policies x 3 replicates x T=6, V=5, EOS=4; a mismatch run and an EOS ending."""
    x = np.ones((2, 2, 3, 6), dtype=int)
    y = x.copy()
    tv = np.full(x.shape, 0.1)
    x[..., 1, 2:], y[..., 1, 2:], tv[..., 1, 2:] = 2, 3, 0.5          # replicate 1 diverges at step 3
    x[..., 2, 3:] = 4                                                 # replicate 2: x ends at step 4,
    y[..., 2, 4:] = 4                                                 # y at step 5,
    tv[..., 2, 5] = 0.0                                               # both ended before step 6
    return coupled_dataset(tv, x, y, vocab_size=5, eos_token_id=4, docs=["d0", "d1"],
                           policies=["snapkv@0.5", "recent@0.5"], split=["exploratory", ""])


def residual_base() -> xr.Dataset:
    """1 doc x 2 policies x 3 replicates x T=6, W=2, EOS=4."""
    stv = np.array([[0, .2, .3, .1, .1, .1], [0, .2, .5, 1, NAN, NAN], [0, 0, 0, 0, 0, 0]])
    stok = np.array([[1, 1, 1, 1, 1, 1], [1, 1, 1, -1, -1, -1], [1, 1, 4, 4, 4, 4]])
    bstep = np.array([3, 4, 0])
    btv = np.full((3, 6), NAN)
    bx = np.full((3, 6), -1)
    by = np.full((3, 6), -1)
    btv[0, :3], bx[0, :3], by[0, :3] = [.3, .2, .1], [2, 2, 2], [3, 3, 3]   # K = min(2, 6-3) = 2
    btv[1, :3], bx[1, :3], by[1, :3] = [1, .4, 0], [2, 4, 4], [3, 4, 4]     # both EOS at age 1
    rep = lambda a: np.stack([a, a])[None]                                  # noqa: E731
    return residual_dataset(rep(stv), rep(stok), rep(bstep), rep(btv), rep(bx), rep(by), vocab_size=5,
                            window=2, eos_token_id=4, docs=["d0"], policies=["snapkv@0.5", "snapkv#512"])


def reference_base() -> xr.Dataset:
    x = np.array([[1, 2, 3, 4, 4], [1, 1, 1, 1, 1]])
    lp = np.array([[-.5, -.5, -.5, -.1, 0], [-.2, -.2, -.2, -.2, -.2]])
    lq = np.array([[-.7, -np.inf, -.3, -.2, 0], [-.2, -.1, -.2, -.3, -.2]])
    return reference_dataset(x[None, None], lp[None, None], lq[None, None], vocab_size=5, eos_token_id=4,
                             docs=["d0"], policies=["snapkv@0.5"])


BASES = {"coupled": coupled_base, "residual": residual_base, "reference": reference_base}


def broken(kind: str, edit) -> xr.Dataset:
    ds = BASES[kind]().copy(deep=True)
    out = edit(ds)
    return ds if out is None else out


def setv(name, value, **idx):
    def edit(ds):
        ds[name].loc[idx] = value
    return edit


def setattr_(name, value):
    def edit(ds):
        ds.attrs[name] = value
    return edit


def test_bases_are_valid():
    for make in BASES.values():
        ds = make()
        assert validate(ds) is ds


@pytest.mark.parametrize("kind", ["coupled", "residual", "reference"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_simulated_examples_are_valid(kind, seed):
    validate(example_dataset(kind, seed=seed, horizon=12, replicates=16, window=3, disjoint=0.1))


D0 = dict(doc="d0", policy="snapkv@0.5")

CASES = {
    # --- attributes and layout
    "schema unknown": ("coupled", setattr_("schema", "kvdiv.trace/0"), "'schema'"),
    "kind unknown": ("coupled", setattr_("kind", "crude"), "'kind'"),
    "attr missing": ("coupled", lambda ds: ds.attrs.pop("producer") and None, "'producer' is missing"),
    "horizon not int": ("coupled", setattr_("horizon", "6"), "'horizon'"),
    "vocab_size too small": ("coupled", setattr_("vocab_size", 1), "'vocab_size'"),
    "sampling not json": ("coupled", setattr_("sampling", "{temperature"), "'sampling'"),
    "model not str": ("coupled", setattr_("model", 3), "'model'"),
    "eos outside vocab": ("coupled", setattr_("eos_token_id", 5), "'eos_token_id'"),
    "coupling unknown": ("coupled", setattr_("coupling", "independent"), "'coupling'"),
    "coupled window": ("coupled", setattr_("window", 3), "'window'"),
    "reference window": ("reference", setattr_("window", 2), "'window'"),
    "residual window > T": ("residual", setattr_("window", 7), "'window'"),
    "duplicate doc": ("coupled", lambda ds: ds.assign_coords(doc=["d0", "d0"]), "coordinate 'doc': duplicate"),
    "duplicate policy": ("coupled", lambda ds: ds.assign_coords(policy=["a@0.5", "a@0.5"]),
                         "coordinate 'policy': duplicate"),
    "bad split": ("coupled", lambda ds: ds.assign_coords(split=("doc", np.array(["train", ""], dtype=object))),
                  "coordinate 'split'"),
    "per-doc coord missing": ("coupled", lambda ds: ds.drop_vars("prompt_tokens"), "'prompt_tokens'"),
    "step coord": ("coupled", lambda ds: ds.assign_coords(step=np.arange(6, dtype=np.int32)), "'step'"),
    "age length": ("residual", lambda ds: ds.isel(age=slice(0, 4)), "'age'"),
    "variable missing": ("coupled", lambda ds: ds.drop_vars("y_token"), "'y_token' is missing"),
    "dims": ("coupled", lambda ds: ds.assign(x_token=ds.x_token.rename(step="t")), "'x_token' has dims"),
    "dtype tv": ("coupled", lambda ds: ds.assign(tv=ds.tv.astype(np.float64)), "'tv' has dtype float64"),
    "dtype token": ("reference", lambda ds: ds.assign(x_token=ds.x_token.astype(np.int64)),
                    "'x_token' has dtype int64"),
    # --- values
    "tv > 1": ("coupled", setv("tv", 1.3, replicate=0, step=2, **D0), "tv[doc='d0', policy='snapkv@0.5', "
                                                                       "replicate=0, step=2] = 1.3"),
    "tv NaN in coupled": ("coupled", setv("tv", NAN, replicate=0, step=2, **D0), "tv: 1 value(s) missing"),
    "shared_tv < 0": ("residual", setv("shared_tv", -0.1, replicate=0, step=2, **D0), "shared_tv"),
    "token >= V": ("coupled", setv("y_token", 7, replicate=0, step=1, **D0), "y_token"),
    "token -1 in reference": ("reference", setv("x_token", -1, replicate=1, step=5, **D0), "x_token"),
    "branch token < -1": ("residual", setv("branch_y_token", -2, replicate=0, age=1, **D0), "branch_y_token"),
    "mismatch at tv 0": ("coupled", setv("tv", 0.0, replicate=1, step=4, **D0), "where x_token != y_token"),
    "mismatch at tiny tv": ("coupled", setv("tv", 5e-8, replicate=1, step=4, **D0), "where x_token != y_token"),
    "branch mismatch at tv 0": ("residual", setv("branch_tv", 0.0, replicate=0, age=1, **D0),
                                "branch_tv: 1 value(s) <= 1e-07"),
    "branch age 0 equal": ("residual", setv("branch_y_token", 2, replicate=0, age=0, **D0),
                           "branch_x_token: 1 value(s) equal to branch_y_token at age 0"),
    # --- EOS
    "x not absorbing": ("coupled", setv("x_token", 1, replicate=2, step=6, **D0), "x_token: 1 value(s) not EOS"),
    "y not absorbing": ("coupled", setv("y_token", 1, replicate=2, step=6, **D0), "y_token: 1 value(s) not EOS"),
    "tv after both EOS": ("coupled", setv("tv", 0.2, replicate=2, step=6, **D0), "tv: 1 value(s) nonzero after"),
    "reference not absorbing": ("reference", setv("x_token", 2, replicate=0, step=5, **D0), "x_token"),
    "logq after EOS": ("reference", setv("x_logq", -0.3, replicate=0, step=5, **D0), "x_logq: 1 value(s) nonzero"),
    "shared not absorbing": ("residual", setv("shared_token", 1, replicate=2, step=6, **D0), "shared_token"),
    "shared tv after EOS": ("residual", setv("shared_tv", 0.1, replicate=2, step=5, **D0), "shared_tv: 1 value(s) "
                                                                                          "nonzero after the shared"),
    "branch not absorbing": ("residual", setv("branch_x_token", 2, replicate=1, age=2, **D0), "branch_x_token"),
    "branch tv after both EOS": ("residual", setv("branch_tv", 0.1, replicate=1, age=2, **D0),
                                 "branch_tv: 1 value(s) nonzero after both"),
    # --- reference log-probabilities
    "logp not finite": ("reference", setv("x_logp", -np.inf, replicate=1, step=2, **D0), "x_logp: 1 value(s) not fin"),
    "logq NaN": ("reference", setv("x_logq", NAN, replicate=1, step=2, **D0), "x_logq: 1 value(s) NaN"),
    "logp positive": ("reference", setv("x_logp", 0.5, replicate=1, step=2, **D0), "x_logp: 1 value(s) > 0"),
    # --- survival path
    "shared NaN then observed": ("residual", setv("shared_tv", NAN, replicate=0, step=5, **D0),
                                 "shared_tv: 1 value(s) observed after an earlier NaN"),
    "shared observed after stop": ("residual", setv("shared_tv", 0.3, replicate=1, step=5, **D0),
                                   "shared_token: 1 value(s) -1 while the survival path is running"),
    "shared token after stop": ("residual", setv("shared_token", 2, replicate=1, step=5, **D0),
                                "shared_token: 1 value(s) observed where shared_tv is NaN"),
    "shared token at stop": ("residual", setv("shared_token", 2, replicate=1, step=4, **D0),
                             "shared_token: 1 value(s) not -1 at the step where"),
    "shared token missing": ("residual", setv("shared_token", -1, replicate=0, step=2, **D0),
                             "shared_token: 1 value(s) -1 while"),
    "shared stop at tv < 1": ("residual", setv("shared_tv", 0.9, replicate=1, step=4, **D0),
                              "shared_tv: 1 value(s) < 1 at the step where the survival path stopped"),
    "shared stop at T with tv < 1": ("residual", setv("shared_token", -1, replicate=0, step=6, **D0),
                                     "shared_tv: 1 value(s) < 1 at the step where"),
    # --- branch masks
    "branch_step > T": ("residual", setv("branch_step", 7, replicate=0, **D0), "branch_step: 1 value(s) outside 0..6"),
    "branch age missing": ("residual", setv("branch_tv", NAN, replicate=0, age=2, **D0),
                           "branch_tv: 1 value(s) missing where observed is required"),
    "branch beyond window": ("residual", setv("branch_x_token", 2, replicate=0, age=3, **D0),
                             "branch_x_token: 1 value(s) observed where it must be unobserved"),
    "branch without branch_step": ("residual", setv("branch_step", 0, replicate=0, **D0), "branch_tv: 3 value(s) "
                                                                                          "observed where"),
    "branch_step at tv 0": ("residual", setv("shared_tv", 0.0, replicate=0, step=3, **D0),
                            "branch_step: 1 value(s) at a step where the shared path"),
    "branch age 0 at tv 0": ("residual", setv("branch_tv", 0.0, replicate=0, age=0, **D0),
                             "branch_tv: 1 value(s) 0 at age 0"),
    "branch_tv[0] != shared_tv[t*]": ("residual", setv("branch_tv", 0.25, replicate=0, age=0, **D0),
                                      "branch_tv: 1 value(s) at age 0 differs"),
    "no branch although possible": ("residual", setv("shared_tv", 0.2, replicate=2, step=1, **D0),
                                    "branch_step: 1 value(s) 0 although"),
}


@pytest.mark.parametrize("name", list(CASES))
def test_rule(name):
    kind, edit, needle = CASES[name]
    ds = broken(kind, edit)
    with pytest.raises(TraceValidationError) as info:
        validate(ds)
    assert any(needle in p for p in info.value.problems), info.value.problems


def test_every_problem_is_listed_at_once():
    ds = coupled_base().copy(deep=True)
    ds.attrs["window"] = 2
    ds.tv.loc[dict(doc="d1", policy="recent@0.5", replicate=0, step=1)] = 2.0
    ds.y_token.loc[dict(doc="d0", policy="snapkv@0.5", replicate=0, step=3)] = 9
    with pytest.raises(TraceValidationError) as info:
        validate(ds, source="(x.nc)")
    probs = info.value.problems
    assert len(probs) >= 3
    assert any(p.startswith("attribute 'window'") for p in probs)
    assert any("tv[doc='d1', policy='recent@0.5', replicate=0, step=1] = 2" in p for p in probs)
    assert any(p.startswith("y_token:") for p in probs)
    assert "(x.nc)" in str(info.value) and isinstance(info.value, ValueError)


def test_count_and_first_example():
    ds = coupled_base().copy(deep=True)
    ds.tv.values[1, 1, 0, 2:] = 1.5
    with pytest.raises(TraceValidationError) as info:
        validate(ds)
    (p,) = [p for p in info.value.problems if "outside" in p]
    assert p.startswith("tv: 4 value(s) outside [0, 1]") and "replicate=0, step=3] = 1.5" in p


def test_no_eos_skips_eos_rules():
    ds = coupled_base()
    ds.attrs["eos_token_id"] = -1
    ds.x_token.values[0, 0, 2, 5] = 1           # would break absorption if 4 were EOS
    ds.y_token.values[0, 0, 2, 5] = 1
    validate(ds)


def test_tv_atol_can_be_exact():
    ds = coupled_base().copy(deep=True)
    ds.tv.loc[dict(D0, replicate=1, step=4)] = 5e-8
    with pytest.raises(TraceValidationError):
        validate(ds)
    validate(ds, tv_atol=0.0)
    ds.tv.loc[dict(D0, replicate=1, step=4)] = 0.0
    with pytest.raises(TraceValidationError, match="<= 0 where x_token != y_token"):
        validate(ds, tv_atol=0.0)


def test_tiny_tv_with_equal_tokens_is_fine():
    ds = coupled_base().copy(deep=True)
    ds.tv.values[0, 0, 0, :] = 1e-9             # rounding noise where tokens agree is no problem
    validate(ds)


def test_branch_point_at_tiny_tv_is_fine():
    # t* is drawn given divergence: a TV of 1e-9 there is legitimate, unlike a coupled mismatch.
    ds = residual_base().copy(deep=True)
    ds.shared_tv.loc[dict(D0, replicate=0, step=3)] = 1e-9
    ds.branch_tv.loc[dict(D0, replicate=0, age=0)] = 1e-9
    validate(ds)


def test_survival_path_float_tolerance():
    ds = residual_base().copy(deep=True)
    ds.shared_tv.loc[dict(D0, replicate=1, step=4)] = np.float32(0.99999994)   # rounded TV of 1: may stop
    ds.branch_tv.loc[dict(D0, replicate=1, age=0)] = np.float32(0.99999994)
    validate(ds)
    ds = residual_base().copy(deep=True)
    ds.shared_tv.loc[dict(D0, replicate=0, step=4)] = 1.0   # rounds to 1 but overlap left: path goes on
    validate(ds)


def test_model_dim_with_per_model_vocab():
    a, b = coupled_base(), coupled_base()
    ds = xr.concat([a, b], dim="model").assign_coords(
        model=["m1", "m2"], vocab_size=("model", [5, 9]), eos_token_id=("model", [4, 8]))
    ds.attrs["vocab_size"] = 9
    ds.x_token.values[1, 0, 0, 0, 0] = 7        # legal for m2 (V=9); now differs from y: tv 0.1 > 0
    validate(ds)
    ds.x_token.values[0, 0, 0, 0, 0] = 7        # illegal for m1 (V=5)
    with pytest.raises(TraceValidationError, match=r"x_token\[model='m1'"):
        validate(ds)


def test_error_pickles():
    import pickle

    with pytest.raises(TraceValidationError) as info:
        validate(broken("coupled", setattr_("window", 2)))
    again = pickle.loads(pickle.dumps(info.value))
    assert again.problems == info.value.problems and str(again) == str(info.value)


def test_not_a_dataset():
    with pytest.raises(TypeError):
        validate({"tv": 1})


@settings(max_examples=40, deadline=None)
@given(kind=st.sampled_from(["coupled", "residual", "reference"]), seed=st.integers(0, 10**6),
       T=st.integers(1, 10), W=st.integers(0, 10), V=st.integers(2, 6), eos=st.sampled_from([None, 0, 1]),
       disjoint=st.sampled_from([0.0, 0.3, 1.0]))
def test_simulated_traces_always_validate(kind, seed, T, W, V, eos, disjoint):
    """No false alarms: honest traces (including TV-1 stops and early EOS) pass every rule."""
    ds = example_dataset(kind, docs=2, policies=2, replicates=6, horizon=T, window=min(W, T), vocab_size=V,
                         eos_token_id=None if eos is None or eos >= V else eos, disjoint=disjoint, seed=seed)
    validate(ds)
