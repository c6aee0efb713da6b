"""Policy families (sweeps): the grammar, its errors, grouping and order, and the collector's --policies."""

from __future__ import annotations

import pytest

from protocols.policies import (
    PolicyIdError,
    expand_policies,
    expand_policy_family,
    family_key,
    policy_families,
)


@pytest.mark.parametrize(("text", "members"), [
    ("snapkv@0.9,0.7,0.5,0.3", ["snapkv@0.9", "snapkv@0.7", "snapkv@0.5", "snapkv@0.3"]),
    ("snapkv@0.9..0.3/0.2", ["snapkv@0.9", "snapkv@0.7", "snapkv@0.5", "snapkv@0.3"]),
    ("snapkv@0.3..0.9/0.3", ["snapkv@0.3", "snapkv@0.6", "snapkv@0.9"]),
    ("snapkv#512..128/128", ["snapkv#512", "snapkv#384", "snapkv#256", "snapkv#128"]),
    ("snapkv#64,32", ["snapkv#64", "snapkv#32"]),
    ("kvpress:AdaKVPress(SnapKVPress)@0.5,0.25:alpha_safeguard=0.1",
     ["kvpress:AdaKVPress(SnapKVPress)@0.5:alpha_safeguard=0.1",
      "kvpress:AdaKVPress(SnapKVPress)@0.25:alpha_safeguard=0.1"]),
    ("snapkv@0.5,0.25+quant:kivi@4", ["snapkv@0.5+quant:kivi@4", "snapkv@0.25+quant:kivi@4"]),
    ("snapkv@0.5", ["snapkv@0.5"]),
    ("full", ["full"]),
])
def test_expand_family(text: str, members: list[str]) -> None:
    assert list(expand_policy_family(text)) == members


@pytest.mark.parametrize(("text", "match"), [
    ("snapkv@0.9,1.5", "outside"),
    ("snapkv@0.9,,0.5", "empty amount"),
    ("snapkv@0.9..0.3/0", "must be > 0"),
    ("snapkv@0.9..0.3/0.25", "whole steps"),
    ("snapkv@0.9..0.3/x", "start..stop/step"),
    ("snapkv#512..100/128", "whole steps"),
    ("snapkv#10..0.5/0.5", "whole tokens"),
    ("snapkv@0.5,0.5", "repeats"),
    ("snapkv@0.001..0.999/0.001", "more than"),
    ("snapkv#x,3", "not an integer"),
])
def test_family_errors(text: str, match: str) -> None:
    with pytest.raises(PolicyIdError, match=match):
        expand_policy_family(text)


def test_expand_policies_and_collector_split() -> None:
    from collector.cli import _split_policies

    assert expand_policies("snapkv@0.9,0.5, recent@0.9..0.5/0.4,snapkv#128,full") == [
        "snapkv@0.9", "snapkv@0.5", "recent@0.9", "recent@0.5", "snapkv#128", "full"]
    # parameters still join their id; after parameters a number cannot continue the family
    assert _split_policies("snapkv@0.9,0.5:window_size=64,n_sink=0,recent@0.5") == [
        "snapkv@0.9:window_size=64,n_sink=0", "snapkv@0.5:window_size=64,n_sink=0", "recent@0.5"]
    import click
    with pytest.raises(click.BadParameter, match="outside"):
        _split_policies("snapkv@0.9,2")


def test_families_grouped_and_ordered() -> None:
    ids = ["full", "snapkv@0.3", "recent@0.5", "snapkv@0.9", "snapkv#64", "snapkv#128", "snapkv@0.6:window_size=8",
           "quant:kivi@2", "my tool"]
    fams = policy_families(ids)
    assert fams == {"snapkv@*": ("snapkv@0.9", "snapkv@0.3"), "recent@*": ("recent@0.5",),
                    "snapkv#*": ("snapkv#128", "snapkv#64"), "snapkv@*:window_size=8": ("snapkv@0.6:window_size=8",)}
    assert list(policy_families(ids, min_members=2)) == ["snapkv@*", "snapkv#*"]
    # the achieved retention, where a press decides it, orders the family
    assert policy_families(["a@0.5", "a@0.4"], kept={"a@0.5": 0.30, "a@0.4": 0.35})["a@*"] == ("a@0.4", "a@0.5")
    assert family_key("quant:kivi@2") == "" and family_key("snapkv") == ""


def test_grouped_request_carries_the_family() -> None:
    # a document's budgets go in one multi-candidate request (collector.grouped)
    from collector.grouped import group_body

    bodies = [{"inputs": "x", "candidate": p, "parameters": {"seed": i, "max_new_tokens": 4}}
              for i, p in enumerate(expand_policy_family("snapkv@0.9..0.3/0.2"))]
    body = group_body(bodies)
    assert body["candidates"] == ["snapkv@0.9", "snapkv@0.7", "snapkv@0.5", "snapkv@0.3"]


def test_kv_kept_follows_the_id_not_a_wrong_coordinate() -> None:
    import xarray as xr

    from divstats.estimation.sweeps import ACHIEVED_RETENTION, kv_kept, sweep_families

    # a server that wrote 0.5 for every candidate must not reorder the family
    ds = xr.Dataset(coords={"policy": ["a@0.5", "a@0.9", "a#64", "tool-x"], "retention": ("policy", [0.5] * 4),
                            "budget": ("policy", [-1] * 4), "prompt_tokens": ("doc", [128, 256])})
    assert kv_kept(ds).values.tolist() == [0.5, 0.9, 0.375, 0.5]
    assert sweep_families(ds) == {"a@*": ("a@0.9", "a@0.5")}
    # the achieved retention, where recorded, is what the press kept (the hook for trace headers)
    ds[ACHIEVED_RETENTION] = ("policy", [0.45, float("nan"), 0.3, float("nan")])
    assert kv_kept(ds).values.tolist() == [0.45, 0.9, 0.3, 0.5]
