"""Common random numbers in the collector: one seed per document, shared by its policies."""

from __future__ import annotations

from pathlib import Path

from collector import documents as D
from collector.collect import CollectConfig, derive_seed, request_body

POLICIES = ["snapkv@0.5", "recent@0.5", "snapkv@0.9"]


def _cfg(**kw) -> CollectConfig:
    return CollectConfig.flat(servers=["http://x"], docs_file=Path("d.jsonl"), policies=POLICIES, out=Path("o"), seed=3,
                              **kw)


def test_common_random_numbers_share_the_seed_across_policies_only():
    doc, other = D.Document("d1", "text"), D.Document("d2", "text")
    crn = _cfg(common_random_numbers=True)
    seeds = {request_body(crn, doc, p)["parameters"]["seed"] for p in POLICIES}
    assert seeds == {derive_seed(3, "d1", None)}
    assert request_body(crn, other, POLICIES[0])["parameters"]["seed"] != seeds.pop()
    independent = _cfg()
    assert len({request_body(independent, doc, p)["parameters"]["seed"] for p in POLICIES}) == 3


def test_the_option_is_recorded_only_when_on():
    # journals written before the option existed (no key) resume unchanged
    assert "common_random_numbers" not in _cfg().params("sha")
    assert _cfg(common_random_numbers=True).params("sha")["common_random_numbers"] is True
