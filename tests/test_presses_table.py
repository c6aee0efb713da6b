"""The press table (gen_service/presses/table.py): one row per kvpress press class, the
lists every other module reads derived from it, and docs/service.md's copy of it.

Fast: no model. tests/test_presses_catalog.py runs each row's example on tiny:llama.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from gen_service.presses.artifacts import LOCAL_ARTIFACTS
from gen_service.presses.params import ATTRIBUTE_PARAMS
from gen_service.presses.registry import ALIASES, PolicyRegistry
from gen_service.presses.table import PRESSES, Artifact, PressSpec, by_name, catalog, lineage, markdown_table
from gen_service.presses.traits import (
    ROW_STATE,
    acts_while_decoding,
    compresses_after_attention,
    rerotates,
    wants_eager,
)
from protocols import parse_policy_id

DOCS = Path(__file__).resolve().parents[1] / "docs" / "service.md"
BEGIN, END = "<!-- press-table:begin -->", "<!-- press-table:end -->"


def test_one_row_per_exported_press() -> None:
    import kvpress

    names = [p.name for p in PRESSES]
    assert len(names) == len(set(names))
    assert set(names) == {n for n in kvpress.__all__ if n.endswith("Press")}
    both = [p for p in PRESSES if set(p.kinds) == {"coupled", "residual"}]
    assert len(both) >= 40, len(both)  # 46 − 2 abstract − 4 needing an artifact nobody supplies here
    assert {p.name for p in both if p.artifact} == {"RestoreKVPress", "QFilterPress", "ExpectedAttentionStatsPress"}


def test_the_derived_lists_are_the_rows() -> None:
    assert ALIASES == {a.name: (a.expression, dict(a.defaults)) for p in PRESSES for a in p.aliases}
    assert len(ALIASES) == sum(len(p.aliases) for p in PRESSES)   # no alias twice
    assert set(LOCAL_ARTIFACTS) == {"QFilterPress", "RestoreKVPress"}
    assert set(ATTRIBUTE_PARAMS) == {"FinchPress"} and ATTRIBUTE_PARAMS["FinchPress"]["window_size"].kind == "int"
    assert set(ROW_STATE) == {"hidden_states_buffer", "scores_buffer", "_running_attn_sum"}
    assert [p["name"] for p in catalog()] == [p.name for p in PRESSES]


def test_each_alias_names_its_rows_class() -> None:
    for p in PRESSES:
        for a in p.aliases:
            term = parse_policy_id(a.expression).press
            assert term is not None and term.name == p.name, a


@pytest.mark.parametrize("policy, decoding, rotated, eager", [
    ("kvpress:CAMPress(KnormPress)#96", True, False, False),          # a DecodingPress subclass: inherits the trait
    ("kvpress:DMSPress(KnormPress):threshold=-9.0", False, False, False),
    ("kvpress:DMSPress(KnormPress):threshold=-9.0,decoding=true", True, False, False),  # the attribute switches it
    ("kvpress:FinchPress@0.5", False, True, False),
    ("kvpress:KeyRerotationPress(KnormPress)@0.5", False, True, False),
    ("h2o@0.5", False, False, True),
    ("snapkv@0.5", False, False, False),
])
def test_traits_come_from_the_rows(policy: str, decoding: bool, rotated: bool, eager: bool) -> None:
    press = PolicyRegistry(entry_points_group=None).build(policy).plan(200).press
    assert (acts_while_decoding(press), rerotates(press), wants_eager(press)) == (decoding, rotated, eager)


@pytest.mark.parametrize("policy, after_attention", [
    ("kvpress:RandomPress@0.5", False),            # the row's seed attribute is None: torch's global generator
    ("kvpress:RandomPress@0.5:seed=0", True),
    ("kvpress:ComposedPress(SnapKVPress@0.5, KnormPress@0.5)", True),   # a delegating hook
    ("kvpress:DecodingPress(KnormPress)#64", False),
])
def test_shared_prefill_reads_the_rows(policy: str, after_attention: bool) -> None:
    press = PolicyRegistry(entry_points_group=None).build(policy).plan(200).press
    assert compresses_after_attention(press) is after_attention


def test_lineage_is_nearest_first_and_kvpress_only() -> None:
    import kvpress

    assert [s.name for s in lineage(kvpress.CAMPress)] == ["CAMPress", "DecodingPress", "BasePress"]

    class KnormPress(kvpress.BasePress):   # a custom class named like a kvpress one
        pass

    assert [s.name for s in lineage(KnormPress)] == ["BasePress"]


def test_refusals_name_the_row() -> None:
    reg = PolicyRegistry(entry_points_group=None)
    with pytest.raises(Exception, match="abstract base class"):
        reg.build("kvpress:ScorerPress@0.5")
    with pytest.raises(Exception, match=r"KVzapPress needs a KVzap scorer.*kvpress fetches it from hub repo"):
        reg.build("kvpress:KVzapPress@0.5")
    with pytest.raises(Exception, match="QFilterPress:path=DIR"):
        reg.build("kvpress:QFilterPress@0.5")


@pytest.mark.parametrize("row, words", [
    (dict(name="Foo"), "ends in 'Press'"),
    (dict(name="FooPress"), "needs an example"),
    (dict(name="FooPress", kinds=(), example=""), "needs a reason"),
    (dict(name="FooPress", example="kvpress:FooPress@0.5", kinds=("reference",)), "kinds"),
    (dict(name="FooPress", example="kvpress:FooPress@0.5", absolute=True), "absolute needs"),
    (dict(name="FooPress", example="kvpress:FooPress@0.5", artifact=Artifact("w", option="path=DIR",
                                                                              files={"path": ("a",)})), "loader"),
])
def test_a_bad_row_is_refused(row: dict, words: str) -> None:
    with pytest.raises(ValueError, match=words):
        PressSpec(**row)


def test_every_press_with_a_trait_is_described_in_the_docs() -> None:
    """Adding a method is a row and a section: a row that is more than a plain scorer
    (a trait, an artifact, attributes, its own amount field) is named in docs/service.md's
    prose about policies, outside the generated table."""
    text = DOCS.read_text()
    section = text[text.index("## Eviction policies"):text.index("## HTTP API")]
    prose = section.replace(section[section.index(BEGIN):section.index(END)], "")
    plain = PressSpec("XPress", "x")
    special = [p for p in PRESSES if p.kinds and any(getattr(p, f) != getattr(plain, f) for f in (
        "amount_field", "artifact", "attributes", "decoding", "rerotates", "eager", "per_head", "row_state"))]
    missing = [p.name for p in special if not re.search(rf"\b{p.name.removesuffix('Press')}", prose)]
    assert not missing, missing


def test_docs_carry_the_generated_table() -> None:
    """Set KVDIV_WRITE_DOCS=1 to rewrite the table in docs/service.md."""
    text = DOCS.read_text()
    table = f"{BEGIN}\n{markdown_table()}\n{END}"
    head, _, rest = text.partition(BEGIN)
    _, _, tail = rest.partition(END)
    current = f"{BEGIN}{rest.partition(END)[0]}{END}"
    if os.environ.get("KVDIV_WRITE_DOCS") and current != table:
        DOCS.write_text(head + table + tail)
        return
    assert current == table, "docs/service.md press table is stale: rerun with KVDIV_WRITE_DOCS=1"
    assert by_name("SnapKVPress") is PRESSES[[p.name for p in PRESSES].index("SnapKVPress")]
