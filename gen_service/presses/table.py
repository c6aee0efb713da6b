"""The press table: one row per kvpress press class, everything kvdiv knows about it.

Every fact about one press lives in its :class:`PressSpec` row of :data:`PRESSES`
(in the style of ``divstats.estimands.ESTIMANDS``), and every module that needs one
reads it from here:

* the registry (``presses/registry.py``): short names (``aliases``), where an amount
  goes (``amount_field``, ``absolute``, ``sets_inner_amount``), what a server without the
  artifact refuses (``artifact``), presses that are not methods (no ``kinds``, a ``reason``),
  settings applied after construction (``attributes``, ``fixed``);
* request validation (``presses/params.py``): ``attributes`` are request-settable;
* operator artifacts (``presses/artifacts.py``): ``artifact.files``, ``artifact.loader``;
* the traits the engine asks about (``presses/traits.py``): ``decoding``, ``rerotates``,
  ``eager``, ``per_head``, ``delegates_hook``, ``row_state``, ``seed``;
* the designed refusals per model (``presses/families.py``): ``rotates_queries``,
  ``weights_first``, ``no_eager``, ``all_layers``, ``own_pass``, ``unsupported`` (and
  ``rerotates``); the self-check's compressed probe: ``window_attention``;
* ``GET /v1/policies`` (:func:`catalog`), the coverage table in docs/service.md
  (:func:`markdown_table`, checked by tests/test_presses_table.py) and the catalog test
  (tests/test_presses_catalog.py runs every ``example`` in every claimed kind on
  ``tiny:llama``).

Traits hold for subclasses too (a row's trait is its kvpress bases' as well: CAMPress
is a DecodingPress); artifacts, aliases, examples and attributes belong to the class
itself. Adding a method is one row here and one section in docs/service.md
(docs/adding-a-method.md). This module imports no other press module but the loaders,
and not kvpress: the registry's parsing and ``kvdiv --help`` must not pay for it.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from gen_service.presses.loaders import Loader, qfilters, restorekv

__all__ = ["ABSTRACT", "Alias", "Artifact", "KINDS", "PRESSES", "PressSpec", "by_name", "catalog", "lineage",
           "markdown_table"]

#: The trace kinds the catalog claims, and its test runs, for every press.
KINDS = ("coupled", "residual")
ABSTRACT = "abstract base class, not a method"
DOWNLOAD = "allow_download=true"


@dataclass(frozen=True)
class Alias:
    """A short policy name: ``name@r`` builds ``expression`` with ``defaults``."""

    name: str
    expression: str
    defaults: tuple[tuple[str, Any], ...] = ()


def _alias(name: str, expression: str, **defaults: Any) -> Alias:
    return Alias(name, expression, tuple(defaults.items()))


@dataclass(frozen=True)
class Artifact:
    """Learned weights, statistics or patterns a press fetches from the hub or the web.

    A server never downloads on a request's behalf: the operator supplies the artifact
    (``kvdiv serve --press-option Class:option``) or allows the download
    (``Class:allow_download=true``); without either, a request for the press gets a 422.

    Attributes
    ----------
    what : str
        What it is ("Q-filters for the model").
    source : str
        Where kvpress fetches it from, when known.
    option : str
        The ``--press-option`` that supplies it locally (``path=DIR``, ``stats_folder=DIR``),
        or ``allow_download=true`` when only a download can.
    files : mapping
        Option key -> the files that folder must hold, checked at server start; kvdiv
        then loads the artifact from the folder with ``loader``. Empty when the option is
        a constructor argument of the press (``stats_folder``).
    loader : callable or None
        folder -> the press's ``post_init_from_model`` reading it (:mod:`gen_service.presses.loaders`).
    variant : tuple of (str, str) or None
        (parameter, option key): with that boolean parameter true, the folder comes from
        that option instead (RestoreKV's ``kvzip_plus_normalization`` has its own adapter).
    """

    what: str
    source: str = ""
    option: str = DOWNLOAD
    files: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    loader: Loader | None = None
    variant: tuple[str, str] | None = None

    @property
    def local(self) -> bool:
        """The operator can supply it as local files (no download needed)."""
        return self.option != DOWNLOAD

    @property
    def keys(self) -> frozenset[str]:
        """The option keys that supply it locally."""
        return frozenset({*self.files, self.option.partition("=")[0]}) if self.local else frozenset()

    def need(self, press: str) -> str:
        """What a request is refused for, when the server has none."""
        text = self.what + (f" (kvpress fetches it from {self.source})" if self.source else "")
        if self.local:
            text += f": --press-option {press}:{self.option}"
        if self.variant is not None:
            text += f" ({self.variant[1]}=DIR for {self.variant[0]})"
        return text


@dataclass(frozen=True)
class PressSpec:
    """One kvpress press class and how every part of kvdiv treats it.

    Attributes
    ----------
    name : str
        The kvpress class name (``kvpress:<name>`` ids).
    example : str
        A policy id that runs on ``tiny:llama`` (the catalog test runs it); "" for none.
    kinds : tuple of str
        The trace kinds of :data:`KINDS` it runs in on a server without downloads.
    reason : str
        Why it runs in no kind (derived from ``artifact`` when it has one).
    aliases : tuple of Alias
        Short policy names for it (``snapkv``, ``adakv`` ...).
    amount_field : str
        Where ``@r`` / ``#b`` go when that is not ``compression_ratio`` (which is found in
        the constructor); "" for that default.
    absolute : bool
        ``amount_field`` holds a number of tokens kept: only ``#b`` sets it.
    sets_inner_amount : bool
        The wrapper sets its inner press's amount itself (the inner press needs none).
    artifact : Artifact or None
        What it needs from the operator.
    attributes : mapping
        Request-settable settings applied as attributes after construction, with defaults.
    fixed : mapping
        Attributes always set after construction.
    decoding : bool or str
        It also compresses while decoding; a str names the press's boolean attribute that
        turns this on.
    rerotates : bool or str
        Kept keys are re-rotated to positions 0..kept-1 (or when that attribute is true).
    eager : bool
        It scores with the attention weights: prefill under eager attention.
    per_head : bool
        It masks keys per head (no quantized cache).
    delegates_hook : bool
        Its forward hook only calls its inner presses' hooks.
    row_state : tuple of str
        Per-layer state it keeps across forwards, batch first (repeated when one row becomes R).
    seed : str
        It draws random numbers, from torch's global generator when this attribute is None
        (its prefill cannot be shared with other candidates'; traits.compresses_after_attention).
    window_attention : bool
        It scores with SnapKV's window attention (``SnapKVPress.compute_window_attention``,
        which kvdiv runs with the model's own rotary: :mod:`gen_service.presses.rotary`); the
        start-up self-check probes it (:mod:`gen_service.serving.self_check`).
    rotates_queries : bool
        It rotates queries itself with kvpress's full-width formula (cos/sin as wide as the
        head): refused where the model's rotary embedding is narrower (:mod:`gen_service.presses.families`).
    no_eager : bool
        It asserts an attention that returns no weights: refused on models that run eager attention.
    all_layers : bool
        It compresses every layer itself, outside kvpress's per-layer hooks: refused on models
        with sliding-window layers (which must stay whole).
    unsupported : tuple of str
        Model classes kvpress itself refuses the press for.
    own_pass : bool
        It scores with passes of its own through every layer (KVzip): its rotary rule holds
        even on a model where no layer is compressed.
    weights_first : bool
        It reads the attention weights where the layer returns them (eager attention) and
        rotates queries itself only otherwise: its rotary rule holds only without eager.
    """

    name: str
    example: str = ""
    kinds: tuple[str, ...] = KINDS
    reason: str = ""
    aliases: tuple[Alias, ...] = ()
    amount_field: str = ""
    absolute: bool = False
    sets_inner_amount: bool = False
    artifact: Artifact | None = None
    attributes: Mapping[str, Any] = field(default_factory=dict)
    fixed: Mapping[str, Any] = field(default_factory=dict)
    decoding: bool | str = False
    rerotates: bool | str = False
    eager: bool = False
    per_head: bool = False
    delegates_hook: bool = False
    row_state: tuple[str, ...] = ()
    seed: str = ""
    window_attention: bool = False
    rotates_queries: bool = False
    no_eager: bool = False
    all_layers: bool = False
    unsupported: tuple[str, ...] = ()
    own_pass: bool = False
    weights_first: bool = False

    def __post_init__(self) -> None:
        if not self.name.endswith("Press"):
            raise ValueError(f"{self.name}: a kvpress press class name ends in 'Press'")
        if set(self.kinds) - set(KINDS):
            raise ValueError(f"{self.name}: kinds must be among {KINDS}")
        if bool(self.example) != bool(self.kinds or self.artifact):
            raise ValueError(f"{self.name}: a press that runs (or would, with its artifact) needs an example")
        if not self.kinds and not (self.reason or self.artifact):
            raise ValueError(f"{self.name}: a press that runs in no kind needs a reason or an artifact")
        if self.absolute and not self.amount_field:
            raise ValueError(f"{self.name}: absolute needs amount_field")
        if self.artifact is not None and bool(self.artifact.files) != (self.artifact.loader is not None):
            raise ValueError(f"{self.name}: artifact files and loader go together")

    @property
    def why(self) -> str:
        """The catalog's reason: what it needs, or why it is not a method."""
        a = self.artifact
        if a is None:
            return self.reason
        if a.local:
            return (f"runs with {a.what} that the operator supplies as local files "
                    f"(`kvdiv serve --press-option {self.name}:{a.option}`); without it a 422 names what is missing")
        return (f"needs {a.what}, which only the operator can supply "
                f"(`kvdiv serve --press-option {self.name}:{DOWNLOAD}`), never a request")

    @property
    def refused(self) -> bool:
        """Never built, whatever the server has: not a method (abstract, unsupported)."""
        return not self.kinds and self.artifact is None


_P = PressSpec


def _example(name: str) -> str:
    return f"kvpress:{name}@0.5"


def _downloaded(name: str, what: str, source: str) -> PressSpec:
    return _P(name, _example(name), kinds=(), artifact=Artifact(what, source))


#: Every press class kvpress exports, in the order of the coverage table.
PRESSES: tuple[PressSpec, ...] = (
    _P("AdaKVPress", "kvpress:AdaKVPress(SnapKVPress)@0.5", per_head=True, no_eager=True,
       aliases=(_alias("adakv", "AdaKVPress(SnapKVPress)"),)),
    _P("BasePress", kinds=(), reason=ABSTRACT),
    _P("BlockPress", "kvpress:BlockPress(KnormPress)@0.5:block_size=32", no_eager=True),
    _P("CAMPress", "kvpress:CAMPress(KnormPress)#96:compression_interval=2", amount_field="target_size",
       absolute=True, row_state=("_running_attn_sum",), rotates_queries=True, weights_first=True),
    _P("CapPress", _example("CapPress"), rotates_queries=True),
    _P("ChunkKVPress", "kvpress:ChunkKVPress(SnapKVPress)@0.5:chunk_length=8", no_eager=True,
       aliases=(_alias("chunkkv", "ChunkKVPress(SnapKVPress)"),)),
    _P("ChunkPress", "kvpress:ChunkPress(KnormPress)@0.5:chunk_length=64", no_eager=True),
    _P("CompactorPress", _example("CompactorPress"), rotates_queries=True),
    _P("ComposedPress", "kvpress:ComposedPress(SnapKVPress@0.5, ThinKPress@0.5)", delegates_hook=True),
    _P("CompressionRatioDecodingPress", "kvpress:CompressionRatioDecodingPress(KnormPress)@0.5:compression_interval=2",
       amount_field="target_compression_ratio"),
    _P("CriticalAdaKVPress", "kvpress:CriticalAdaKVPress(SnapKVPress)@0.5", per_head=True, no_eager=True,
       aliases=(_alias("critical-adakv", "CriticalAdaKVPress(SnapKVPress)"),)),
    _P("CriticalKVPress", "kvpress:CriticalKVPress(SnapKVPress)@0.5",
       aliases=(_alias("criticalkv", "CriticalKVPress(SnapKVPress)"),)),
    _P("CURPress", _example("CURPress")),
    _P("DecodingPress", "kvpress:DecodingPress(KnormPress):compression_interval=4,target_size=64",
       amount_field="target_size", absolute=True, sets_inner_amount=True, decoding=True,
       row_state=("hidden_states_buffer",), aliases=(_alias("decoding-knorm", "DecodingPress(KnormPress)"),)),
    _P("DMSPress", "kvpress:DMSPress(KnormPress):threshold=-9.0,sliding_window_size=16,decoding=true",
       sets_inner_amount=True, decoding="decoding", per_head=True, row_state=("scores_buffer",),
       aliases=(_alias("dms", "DMSPress(KnormPress)", threshold=-9.0, sliding_window_size=16),)),
    _P("DuoAttentionPress", _example("DuoAttentionPress"), kinds=(), amount_field="head_compression_ratio",
       rotates_queries=True, no_eager=True,
       artifact=Artifact("DuoAttention head patterns for the model", "GitHub")),
    _P("EntropyGatedChunkKVPress", "kvpress:EntropyGatedChunkKVPress(SnapKVPress)@0.5"),
    _P("ExpectedAttentionPress", _example("ExpectedAttentionPress"), rotates_queries=True,
       aliases=(_alias("expected-attention", "ExpectedAttentionPress"),)),
    _P("ExpectedAttentionStatsPress", _example("ExpectedAttentionStatsPress"),
       artifact=Artifact("query statistics for the model", option="stats_folder=DIR")),
    _downloaded("FastKVzipPress", "Fast-KVzip gate weights for the model", "hub repo Jang-Hyun/Fast-KVzip"),
    # FinchPress finds its observation window from a delimiter token inside the prompt; here
    # the window is given directly, so no token has to be added to the model's vocabulary.
    _P("FinchPress", "kvpress:FinchPress@0.5:window_size=32", attributes={"window_size": 64},
       fixed={"delimiter_token_id": -1}, rerotates="rerotate_keys", window_attention=True),
    _P("KeyDiffPress", _example("KeyDiffPress"), aliases=(_alias("keydiff", "KeyDiffPress"),)),
    _P("KeyRerotationPress", "kvpress:KeyRerotationPress(KnormPress)@0.5", rerotates=True),
    _P("KnormPress", _example("KnormPress"), aliases=(_alias("knorm", "KnormPress"),)),
    _P("KVComposePress", _example("KVComposePress"), eager=True, all_layers=True,
       aliases=(_alias("kvcompose", "KVComposePress"),)),
    _P("KVgradPress", _example("KVgradPress")),
    _downloaded("KVzapPress", "a KVzap scorer for the model", "hub repo nvidia/KVzap-<type>-<model>"),
    _P("KVzipPress", _example("KVzipPress"), rotates_queries=True, no_eager=True, own_pass=True,
       unsupported=("Gemma3ForCausalLM",)),
    _P("LagKVPress", "kvpress:LagKVPress@0.5:lag_size=32", aliases=(_alias("lagkv", "LagKVPress"),)),
    _P("LeverageScorePress", _example("LeverageScorePress")),
    _downloaded("LUKVPress", "an LU-KV budget curve for the model", "GitHub"),
    _P("MergingPress", "kvpress:MergingPress(KnormPress)@0.5"),
    _P("NonCausalAttnPress", _example("NonCausalAttnPress"), rotates_queries=True),
    _P("ObservedAttentionPress", _example("ObservedAttentionPress"), eager=True,
       aliases=(_alias("h2o", "ObservedAttentionPress"),)),
    _P("PerLayerCompressionPress", "kvpress:PerLayerCompressionPress(KnormPress):compression_ratios=0.3;0.7",
       amount_field="compression_ratios", sets_inner_amount=True, delegates_hook=True),
    _P("PrefillDecodingPress", "kvpress:PrefillDecodingPress(SnapKVPress@0.5, kvpress:DecodingPress(KnormPress)#96)"
                               ":compression_interval=4"),
    _P("PyramidKVPress", _example("PyramidKVPress"), aliases=(_alias("pyramidkv", "PyramidKVPress"),)),
    _P("QFilterPress", _example("QFilterPress"),
       artifact=Artifact("Q-filters for the model", "hub repo nthngdy/<model>_qfilt", "path=DIR",
                         {"path": ("config.json",)}, qfilters)),
    _P("RandomPress", "kvpress:RandomPress@0.5:seed=0", seed="seed"),
    _P("RestoreKVPress", _example("RestoreKVPress"),
       artifact=Artifact("RestoreKV weights for the model (a PEFT LoRA adapter and restore embeddings)",
                         "hub repo higokri/RestoreKV-<model>", "path=DIR",
                         {"path": ("adapter_config.json", "restore_embeddings.safetensors"),
                          "plus_path": ("adapter_config.json", "restore_embeddings.safetensors")},
                         restorekv, ("kvzip_plus_normalization", "plus_path"))),
    _P("ScorerPress", kinds=(), reason=ABSTRACT),
    _P("SimLayerKVPress", "kvpress:SimLayerKVPress:n_recent=32,lazy_threshold=0.5", window_attention=True,
       aliases=(_alias("simlayerkv", "SimLayerKVPress"),)),
    _P("SnapKVPress", _example("SnapKVPress"), window_attention=True, aliases=(_alias("snapkv", "SnapKVPress"),)),
    _P("StreamingLLMPress", _example("StreamingLLMPress"),
       aliases=(_alias("recent", "StreamingLLMPress", n_sink=0), _alias("streaming", "StreamingLLMPress", n_sink=4),
                _alias("streamingllm", "StreamingLLMPress", n_sink=4))),
    _P("ThinKPress", _example("ThinKPress"), amount_field="key_channel_compression_ratio", rotates_queries=True,
       aliases=(_alias("think", "ThinKPress"),)),
    _P("TOVAPress", _example("TOVAPress"), window_attention=True, aliases=(_alias("tova", "TOVAPress"),)),
)

_BY_NAME = {p.name: p for p in PRESSES}


def by_name(name: str) -> PressSpec | None:
    """The row of the press class called ``name``, or None (a custom press)."""
    return _BY_NAME.get(name)


def lineage(cls: type) -> Iterator[PressSpec]:
    """The rows of ``cls`` and of its kvpress bases, nearest first.

    A trait of a base holds for its subclasses (CAMPress is a DecodingPress); only
    kvpress's own classes have rows, so a custom class named like one does not match.
    """
    for base in cls.__mro__:
        spec = _BY_NAME.get(base.__name__)
        if spec is not None and base.__module__.split(".")[0] == "kvpress":
            yield spec


def catalog() -> list[dict[str, object]]:
    """The table as JSON-ready dicts (``GET /v1/policies`` → ``presses``)."""
    return [{"name": p.name, "example": p.example, "coupled": "coupled" in p.kinds,
             "residual": "residual" in p.kinds, "reason": p.why,
             "artifact": f"{p.name}:{p.artifact.option}" if p.artifact is not None and p.artifact.local else "",
             "aliases": [a.name for a in p.aliases]} for p in PRESSES]


def markdown_table() -> str:
    """The coverage table as Markdown, with counts (docs/service.md, "Eviction policies")."""
    def yes(kind: str, p: PressSpec) -> str:
        return "yes" if kind in p.kinds else "no"

    rows = ["| press | aliases | example policy id | coupled | residual | reason |", "|---|---|---|---|---|---|"]
    for p in PRESSES:
        aliases = ", ".join(f"`{a.name}`" for a in p.aliases)
        ex = f"`{p.example}`" if p.example else ""
        rows.append(f"| {p.name} | {aliases} | {ex} | {yes('coupled', p)} | {yes('residual', p)} | {p.why} |")
    both = sum(set(KINDS) <= set(p.kinds) for p in PRESSES)
    local = sum(set(KINDS) <= set(p.kinds) and p.artifact is not None for p in PRESSES)
    rows += ["", f"{both} of {len(PRESSES)} press classes run in both kinds ({local} of them only with an artifact "
                 f"the operator supplies); {sum('coupled' in p.kinds for p in PRESSES)} coupled, "
                 f"{sum('residual' in p.kinds for p in PRESSES)} residual."]
    return "\n".join(rows)
