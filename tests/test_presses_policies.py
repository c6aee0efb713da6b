"""Policy ids: the composition grammar (protocols) and the checks the service makes
before anything streams (PolicyRegistry.build)."""

from __future__ import annotations

import math

import pytest

from gen_service.errors import PolicyError
from gen_service.presses.registry import ModelInfo, PolicyRegistry
from protocols import PolicyIdError, parse_policy_id, policy_coords

INFO = ModelInfo(max_context=2048, num_layers=2)


@pytest.fixture(scope="module")
def registry() -> PolicyRegistry:
    return PolicyRegistry(entry_points_group=None)


def test_grammar_nests_wrappers_and_keeps_amounts_per_press() -> None:
    spec = parse_policy_id("kvpress:ComposedPress(SnapKVPress@0.5, kvpress:ThinKPress@0.25):0.window_size=8")
    assert spec.name == "kvpress:ComposedPress(SnapKVPress@0.5, kvpress:ThinKPress@0.25)"
    assert math.isnan(spec.retention) and spec.params == {"0.window_size": 8}
    a, b = spec.press.args
    assert (a.class_name, a.retention, b.class_name, b.retention) == ("SnapKVPress", 0.5, "ThinKPress", 0.25)
    spec = parse_policy_id("kvpress:DecodingPress(KnormPress)#64:compression_interval=4")
    assert spec.budget == 64 and spec.press.args[0].name == "KnormPress"
    assert policy_coords("kvpress:AdaKVPress(SnapKVPress)@0.5") == ("kvpress:AdaKVPress(SnapKVPress)", 0.5, -1)
    assert parse_policy_id("x:r=0.2;0.6").params == {"r": "0.2;0.6"}


@pytest.mark.parametrize("bad", ["snapkv#3000000000", "snapkv@0", "snapkv@1.5", "snapkv@nan", "a(b", "a)", "a(b,)",
                                 "full@0.5", "full:x=1", "x:a=1,a=2", "x:=1", "x@0.5:k", "A(" * 12 + "B" + ")" * 12,
                                 "x" * 2000, 3])
def test_grammar_refuses(bad) -> None:
    with pytest.raises(PolicyIdError):
        parse_policy_id(bad)


@pytest.mark.parametrize("policy_id, press, check", [
    ("snapkv@0.5:window_size=8", "SnapKVPress", lambda p: p.window_size == 8 and p.compression_ratio == 0.5),
    ("recent@0.5", "StreamingLLMPress", lambda p: p.n_sink == 0),
    ("streaming@0.5", "StreamingLLMPress", lambda p: p.n_sink == 4),
    ("adakv@0.5:alpha_safeguard=0.1,window_size=16", "AdaKVPress",
     lambda p: p.alpha_safeguard == 0.1 and p.press.window_size == 16 and p.compression_ratio == 0.5),
    ("kvpress:ChunkKVPress(SnapKVPress)@0.5:chunk_length=8", "ChunkKVPress", lambda p: p.chunk_length == 8),
    ("kvpress:DecodingPress(KnormPress):compression_interval=4,target_size=64", "DecodingPress",
     lambda p: (p.compression_interval, p.target_size) == (4, 64)),
    ("kvpress:DecodingPress(KnormPress)#64", "DecodingPress", lambda p: p.target_size == 64),
    ("kvpress:ComposedPress(SnapKVPress@0.5, ThinKPress@0.75)", "ComposedPress",
     lambda p: p.presses[0].compression_ratio == 0.5 and p.presses[1].key_channel_compression_ratio == 0.25),
    ("kvpress:PerLayerCompressionPress(KnormPress):compression_ratios=0.2;0.6", "PerLayerCompressionPress",
     lambda p: p.compression_ratios == [0.2, 0.6]),
    ("kvpress:PerLayerCompressionPress(KnormPress)@0.5", "PerLayerCompressionPress",
     lambda p: p.compression_ratios == [0.5, 0.5]),
    ("kvpress:KVComposePress@0.5:agg_task=mean", "KVComposePress", lambda p: p.agg_task == "mean"),
    ("kvpress:RandomPress@0.5:seed=3", "RandomPress", lambda p: p.seed == 3),
    ("kvpress:FinchPress@0.5:window_size=16", "FinchPress", lambda p: p.window_size == 16 and p.rerotate_keys),
    ("kvpress:PrefillDecodingPress(SnapKVPress@0.5, DecodingPress(KnormPress)#64):compression_interval=2",
     "PrefillDecodingPress", lambda p: p.decoding_press.compression_interval == 2),
])
def test_build_makes_the_press(registry: PolicyRegistry, policy_id: str, press: str, check) -> None:
    plan = registry.build(policy_id, INFO).plan(200)
    assert type(plan.press).__name__ == press and check(plan.press)


def test_budget_ratio_per_prompt(registry: PolicyRegistry) -> None:
    plan = registry.build("snapkv#40", INFO).plan(100)
    assert plan.expected_kept == 40
    plan = registry.build("snapkv#40", INFO).plan(30)
    assert plan.press is None and "kept whole" in plan.note


# Every input from the robustness probe (issue 10): each is refused before streaming,
# naming the field where there is one.
@pytest.mark.parametrize("policy_id, field, words", [
    ("snapkv@0.5:window_size=abc", "window_size", "integer"),
    ("recent@0.5:n_sink=abc", "n_sink", "integer"),
    ("snapkv@0.5:window_size=0", "window_size", "outside"),
    ("snapkv@0.5:window_size=-5", "window_size", "outside"),
    ("snapkv@0.5:window_size=1.5", "window_size", "integer"),
    ("snapkv@0.5:window_size=nan", "window_size", "integer"),
    ("snapkv@0.5:window_size=true", "window_size", "integer"),
    ("snapkv@0.5:kernel_size=0", "kernel_size", "outside"),
    ("snapkv@0.5:kernel_size=abc", "kernel_size", "integer"),
    ("recent@0.5:n_sink=-5", "n_sink", "outside"),
    ("snapkv@0.5:window_size=100000", "window_size", "context"),
    ("kvpress:ScorerPress@0.5", "press", "abstract"),
    ("kvpress:FinchPress@0.5:window_size=0", "window_size", "outside"),
    ("snapkv#4096", "budget", "context"),
    ("kvpress:ExpectedAttentionStatsPress@0.5:stats_folder=/etc", "press", "--press-option"),
    ("kvpress:ExpectedAttentionPress@0.5:stats_folder=/etc", "stats_folder", "no parameter"),
    ("kvpress:KVzapPress@0.5", "press", "--press-option"),
    ("kvpress:QFilterPress@0.5", "press", "--press-option"),
    ("kvpress:DuoAttentionPress@0.5", "press", "--press-option"),
    ("snapkv@0.5:compression_ratio=0.3", "compression_ratio", "@<retention>"),
    ("snapkv@0.5:bogus=1", "bogus", "no parameter"),
    ("kvpress:AdaKVPress@0.5", "press", "inner press"),
    ("kvpress:ComposedPress(SnapKVPress, KnormPress)@0.5", "press", "takes no"),
    ("kvpress:ComposedPress(SnapKVPress@0.5, PyramidKVPress@0.5):window_size=8", "window_size", "several"),
    ("kvpress:DecodingPress(KnormPress)@0.5", "press", "#<budget>"),
    ("kvpress:KVComposePress@0.5:agg_task=/etc/passwd", "agg_task", "one of"),
    ("kvpress:PerLayerCompressionPress(KnormPress):compression_ratios=0.2", "compression_ratios", "per layer"),
    ("snapkv", "press", "@<retention>"),
    ("nope@0.5", "press", "unknown"),
    ("kvpress:Nope@0.5", "press", "unknown"),
])
def test_build_refuses_with_the_field(registry: PolicyRegistry, policy_id: str, field: str, words: str) -> None:
    with pytest.raises(PolicyError) as err:
        registry.build(policy_id, INFO)
    assert err.value.field == field and words in str(err.value), str(err.value)


def test_int32_budget_refused_before_anything(registry: PolicyRegistry) -> None:
    with pytest.raises(PolicyError, match="2147483647"):
        registry.build("snapkv#3000000000")


def test_server_side_options_supply_artifacts_never_requests() -> None:
    reg = PolicyRegistry(entry_points_group=None,
                         press_options={"ExpectedAttentionStatsPress": {"stats_folder": "/srv/stats"}})
    policy = reg.build("kvpress:ExpectedAttentionStatsPress@0.5", INFO)
    assert policy.root.kwargs["stats_folder"] == "/srv/stats"
    with pytest.raises(PolicyError, match="server-side"):
        reg.build("kvpress:ExpectedAttentionStatsPress@0.5:stats_folder=/etc", INFO)


def test_custom_press_registration_and_names() -> None:
    from kvpress import KnormPress

    reg = PolicyRegistry({"knorm2": KnormPress}, entry_points_group=None)
    assert reg.build("knorm2@0.5").press_name == "KnormPress"
    assert "knorm2" in reg.names() and "adakv" in reg.names()


class _BackwardSet(set):
    """A set that iterates in the reverse of its own order: another process's hash seed."""

    def __iter__(self):
        return iter(list(super().__iter__())[::-1])


HASH_SEED_POLICIES = ("kvpress:DecodingPress(KnormPress):compression_interval=4,target_size=64",
                      "snapkv@0.5:window_size=8,kernel_size=3")


def test_reported_params_do_not_depend_on_the_hash_seed() -> None:
    """The header reports a plan's params and its digest covers them: their order must
    be the same in every process (it once followed a set's PYTHONHASHSEED order).

    Here every shown-parameter set iterated backwards gives the same params; and one
    process under a fixed hash seed (1: it ordered these params differently from seed 2
    before the fix) reports what this one, under its own seed, does."""
    import os
    import subprocess
    import sys

    from gen_service.presses.registry import ModelInfo, PolicyRegistry

    r = PolicyRegistry(entry_points_group=None)
    info = ModelInfo(max_context=2048, num_layers=2)
    here = []
    for pid in HASH_SEED_POLICIES:
        want = list(r.build(pid, info).plan(64).params)
        policy = r.build(pid, info)
        assert len(policy.root.shown) >= 2, pid        # an order to get wrong
        policy.root.shown = _BackwardSet(policy.root.shown)
        assert list(policy.root.shown) != list(set(policy.root.shown))
        assert list(policy.plan(64).params) == want, pid
        here.append(want)
    code = ("import sys\n"
            "from gen_service.presses.registry import ModelInfo, PolicyRegistry\n"
            "r = PolicyRegistry(entry_points_group=None)\n"
            "info = ModelInfo(max_context=2048, num_layers=2)\n"
            "for pid in sys.argv[1:]:\n"
            "    print(list(r.build(pid, info).plan(64).params))\n")
    out = subprocess.run([sys.executable, "-c", code, *HASH_SEED_POLICIES], env={**os.environ, "PYTHONHASHSEED": "1"},
                         capture_output=True, text=True, check=True, timeout=600).stdout
    assert out == "".join(f"{p}\n" for p in here), (out, here)
