"""Every press class kvpress exports: an example policy id, whether it runs in coupled
and residual traces, and why not when it does not. Presses that run only with an
artifact the operator supplies (``artifact``: the ``--press-option`` that names it) say
so in ``reason``.

This table is what ``GET /v1/policies`` serves and what docs/service.md shows; a test
(tests/test_presses_catalog.py) runs every example in both kinds on ``tiny:llama`` and
checks each claim, and regenerates the docs table.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

__all__ = ["PressEntry", "CATALOG", "catalog", "markdown_table"]

ABSTRACT = "abstract base class, not a method"


@dataclass(frozen=True)
class PressEntry:
    """One row of the coverage table."""

    name: str
    example: str
    coupled: bool = True
    residual: bool = True
    reason: str = ""
    artifact: str = ""       # the server-side option that supplies its artifact, when it needs one


def _local(name: str, what: str, option: str = "path=DIR") -> PressEntry:
    return PressEntry(name, f"kvpress:{name}@0.5", True, True,
                      f"runs with {what} that the operator supplies as local files "
                      f"(`kvdiv serve --press-option {name}:{option}`); without it a 422 names what is missing",
                      f"{name}:{option}")


def _artifact(name: str, what: str, option: str = "allow_download=true") -> PressEntry:
    return PressEntry(name, f"kvpress:{name}@0.5", False, False,
                      f"needs {what}, which only the operator can supply "
                      f"(`kvdiv serve --press-option {name}:{option}`), never a request")


CATALOG: tuple[PressEntry, ...] = (
    PressEntry("AdaKVPress", "kvpress:AdaKVPress(SnapKVPress)@0.5"),
    PressEntry("BasePress", "", False, False, ABSTRACT),
    PressEntry("BlockPress", "kvpress:BlockPress(KnormPress)@0.5:block_size=32"),
    PressEntry("CAMPress", "kvpress:CAMPress(KnormPress)#96:compression_interval=2"),
    PressEntry("CapPress", "kvpress:CapPress@0.5"),
    PressEntry("ChunkKVPress", "kvpress:ChunkKVPress(SnapKVPress)@0.5:chunk_length=8"),
    PressEntry("ChunkPress", "kvpress:ChunkPress(KnormPress)@0.5:chunk_length=64"),
    PressEntry("CompactorPress", "kvpress:CompactorPress@0.5"),
    PressEntry("ComposedPress", "kvpress:ComposedPress(SnapKVPress@0.5, ThinKPress@0.5)"),
    PressEntry("CompressionRatioDecodingPress",
               "kvpress:CompressionRatioDecodingPress(KnormPress)@0.5:compression_interval=2"),
    PressEntry("CriticalAdaKVPress", "kvpress:CriticalAdaKVPress(SnapKVPress)@0.5"),
    PressEntry("CriticalKVPress", "kvpress:CriticalKVPress(SnapKVPress)@0.5"),
    PressEntry("CURPress", "kvpress:CURPress@0.5"),
    PressEntry("DecodingPress", "kvpress:DecodingPress(KnormPress):compression_interval=4,target_size=64"),
    PressEntry("DMSPress", "kvpress:DMSPress(KnormPress):threshold=-9.0,sliding_window_size=16,decoding=true"),
    _artifact("DuoAttentionPress", "DuoAttention head patterns for the model"),
    PressEntry("EntropyGatedChunkKVPress", "kvpress:EntropyGatedChunkKVPress(SnapKVPress)@0.5"),
    PressEntry("ExpectedAttentionPress", "kvpress:ExpectedAttentionPress@0.5"),
    _local("ExpectedAttentionStatsPress", "query statistics for the model", "stats_folder=DIR"),
    _artifact("FastKVzipPress", "Fast-KVzip gate weights for the model"),
    PressEntry("FinchPress", "kvpress:FinchPress@0.5:window_size=32"),
    PressEntry("KeyDiffPress", "kvpress:KeyDiffPress@0.5"),
    PressEntry("KeyRerotationPress", "kvpress:KeyRerotationPress(KnormPress)@0.5"),
    PressEntry("KnormPress", "kvpress:KnormPress@0.5"),
    PressEntry("KVComposePress", "kvpress:KVComposePress@0.5"),
    PressEntry("KVgradPress", "kvpress:KVgradPress@0.5"),
    _artifact("KVzapPress", "a KVzap scorer for the model"),
    PressEntry("KVzipPress", "kvpress:KVzipPress@0.5"),
    PressEntry("LagKVPress", "kvpress:LagKVPress@0.5:lag_size=32"),
    PressEntry("LeverageScorePress", "kvpress:LeverageScorePress@0.5"),
    _artifact("LUKVPress", "an LU-KV budget curve for the model"),
    PressEntry("MergingPress", "kvpress:MergingPress(KnormPress)@0.5"),
    PressEntry("NonCausalAttnPress", "kvpress:NonCausalAttnPress@0.5"),
    PressEntry("ObservedAttentionPress", "kvpress:ObservedAttentionPress@0.5"),
    PressEntry("PerLayerCompressionPress", "kvpress:PerLayerCompressionPress(KnormPress):compression_ratios=0.3;0.7"),
    PressEntry("PrefillDecodingPress",
               "kvpress:PrefillDecodingPress(SnapKVPress@0.5, kvpress:DecodingPress(KnormPress)#96)"
               ":compression_interval=4"),
    PressEntry("PyramidKVPress", "kvpress:PyramidKVPress@0.5"),
    _local("QFilterPress", "Q-filters for the model"),
    PressEntry("RandomPress", "kvpress:RandomPress@0.5:seed=0"),
    _local("RestoreKVPress", "RestoreKV weights for the model (a PEFT LoRA adapter and restore embeddings)"),
    PressEntry("ScorerPress", "", False, False, ABSTRACT),
    PressEntry("SimLayerKVPress", "kvpress:SimLayerKVPress:n_recent=32,lazy_threshold=0.5"),
    PressEntry("SnapKVPress", "kvpress:SnapKVPress@0.5"),
    PressEntry("StreamingLLMPress", "kvpress:StreamingLLMPress@0.5"),
    PressEntry("ThinKPress", "kvpress:ThinKPress@0.5"),
    PressEntry("TOVAPress", "kvpress:TOVAPress@0.5"),
)


def catalog() -> list[dict[str, object]]:
    """The table as JSON-ready dicts (``GET /v1/policies`` → ``presses``)."""
    return [asdict(e) for e in CATALOG]


def markdown_table() -> str:
    """The table as Markdown, with counts (docs/service.md)."""
    rows = ["| press | example policy id | coupled | residual | reason |", "|---|---|---|---|---|"]
    for e in CATALOG:
        ex = f"`{e.example}`" if e.example else ""
        rows.append(f"| {e.name} | {ex} | {'yes' if e.coupled else 'no'} | {'yes' if e.residual else 'no'} "
                    f"| {e.reason} |")
    both = sum(e.coupled and e.residual for e in CATALOG)
    local = sum(e.coupled and e.residual and bool(e.artifact) for e in CATALOG)
    rows.append("")
    rows.append(f"{both} of {len(CATALOG)} press classes run in both kinds ({local} of them only with an artifact "
                f"the operator supplies); {sum(e.coupled for e in CATALOG)} coupled, "
                f"{sum(e.residual for e in CATALOG)} residual.")
    return "\n".join(rows)
