"""The demo's pass-key study: does compression change the answer? (docs/collector.md, "The demo").

Beside the drift of the main study, the demo asks SmolLM2 for pass keys: about 30
RULER-style ``passkey`` documents near 500 tokens (``kvdiv docs --task passkey``, the
needle depths spread evenly), collected as ``coupled`` traces, greedy (temperature 0, the
leaderboards' setting), R = 1, long enough to finish the answer (T = 12), under
``snapkv@0.5``, ``recent@0.5``, ``snapkv@0.3`` and the control ``full``. The collector
decodes P's and each Q's answer and ``kvdiv pack`` scores them (``x_score``,
``y_score``); the headline prints an answers table per policy.

The table's statistics are divstats' (``compare_answers_dataset``: the paired
difference with its interval over documents, McNemar's exact test, the flips).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from collector import documents as D
from collector.collect import CollectConfig, collect
from collector.pack import pack_run, save_dataset

__all__ = ["PASSKEY_POLICIES", "PasskeyStudy", "answers_headline", "collect_passkey"]

#: The policies the pass-key study compares with the full model (and the control ``full``).
PASSKEY_POLICIES = ("snapkv@0.5", "recent@0.5", "snapkv@0.3")


@dataclass(frozen=True)
class PasskeyStudy:
    """The pass-key study's sizes (docs/collector.md, "The demo")."""

    docs: int = 30
    target_tokens: int = 500
    max_new_tokens: int = 12      # "The pass key is 48213." is 11 SmolLM2 tokens, the key from the 6th
    replicates: int = 1           # greedy: every replicate is the same
    temperature: float = 0.0
    control: bool = True
    model: str = "smollm2-135m"   # the model studied (the demo's chat model)


def collect_passkey(study: PasskeyStudy, root: Path, urls: list[str], *, seed: int = 0, api_key: str | None = None,
                    concurrency: int = 8, progress: bool = True, stop_reason: Callable[[], str | None] | None = None,
                    say: Callable[[str], None] = print) -> Path:
    """Collect and pack the pass-key study into ``root/passkey.nc``; a rerun resumes it.

    Parameters
    ----------
    study : PasskeyStudy
        Sizes.
    root : Path
        Its folder (documents, journal, traces).
    urls : list of str
        Servers of ``study.model``.
    seed, api_key, concurrency, progress, stop_reason
        As for :class:`collector.collect.CollectConfig` and :func:`collector.collect.collect`.
    say : callable
        Progress lines.

    Returns
    -------
    Path
        The packed traces (``coupled``, with the answer variables).

    Raises
    ------
    RuntimeError
        Requests that failed (a rerun retries them).
    """
    from collector.tasks import task_documents
    from kvdiv.demo_documents import load_tokenizer

    t0 = time.monotonic()
    docs_path = root / "documents.jsonl"
    if not docs_path.exists():
        docs = task_documents("passkey", study.docs, target_tokens=study.target_tokens,
                              tokenizer=load_tokenizer(study.model), seed=seed)
        D.write_jsonl(docs, docs_path)
    say(f"      pass keys: {study.docs} docs of ~{study.target_tokens} tokens × {', '.join(PASSKEY_POLICIES)}"
        + (" + the control full" if study.control else "") + f", greedy, T={study.max_new_tokens}")
    result = collect(CollectConfig.flat(
        servers=urls, docs_file=docs_path, policies=list(PASSKEY_POLICIES), out=root / "journal", kind="coupled",
        replicates=study.replicates, max_new_tokens=study.max_new_tokens, temperature=study.temperature,
        seed=seed, template="qa", api_key=api_key, concurrency=concurrency, progress=progress,
        control=study.control), stop_reason=stop_reason)
    say(f"      {result.summary()}")
    if not result.ok:
        raise RuntimeError(f"{len(result.failed)} pass-key requests failed; rerun the same command to retry them "
                           f"({root / 'journal'} keeps every complete request)")
    out = save_dataset(pack_run(root / "journal", progress=False), root / "passkey.nc", overwrite=True)
    say(f"      pass keys collected and packed in {time.monotonic() - t0:.0f} s")
    return out


def answers_headline(ds: Any, *, seed: int = 0) -> str:
    """The printed answers table: per policy P's and Q's accuracy, Q − P with its 95% interval
    over documents, the test's p (McNemar's exact test on greedy 0/1 answers) and lost/gained.

    The numbers are ``divstats.compare_answers_dataset``'s, laid out by
    ``divstats.report.answer_tables.answers_text_table`` (docs/statistics.md §12).

    Parameters
    ----------
    ds : xarray.Dataset
        The pass-key traces (with ``x_score`` and ``y_score``).
    seed : int
        Seeds the permutation test where McNemar's does not apply.

    Returns
    -------
    str
        A title line and the table, indented for the headline.

    Raises
    ------
    DivstatsError
        Traces without scores.
    """
    from divstats import compare_answers_dataset
    from divstats.report.answer_tables import answers_text_table

    table = compare_answers_dataset(ds, seed=seed)
    title = (f"  does it change the answer? {ds.sizes['doc']} pass-key documents, "
             f"{'greedy' if _greedy(ds) else 'sampled'}; P = the full model, Q = the policy; "
             "lost: P right and Q wrong, gained: the reverse")
    return "\n".join(["", title, *("  " + line for line in answers_text_table(table).splitlines())])


def _greedy(ds: Any) -> bool:
    from protocols import sampling_params

    return float(sampling_params(ds).get("temperature", 1.0)) == 0.0
