"""The demo's documents and its budget N: built once per run directory, reused on resume.

The study's document set (``kvdiv.demo_spec.DEMO_STUDY.documents``: CPython's language
reference) is chunked with the first model's tokenizer, ``docs_count`` documents are
chosen half in each of the plan's splits (:func:`select_balanced`), and N of
``snapkv#N`` is half their median prompt (:func:`budget_for`). ``demo.json`` keeps the
settings that decided the traces, so a rerun with other sizes is refused rather than
mixed in. :func:`load_tokenizer` also serves ``kvdiv docs``.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from collector import documents as D
from kvdiv.demo_plan import shipped_plan
from kvdiv.demo_spec import DEMO_STUDY, DemoConfig, DemoError, demo_policies

__all__ = ["CHAT_OVERHEAD_TOKENS", "budget_for", "load_tokenizer", "prepare_documents", "prompt_length",
           "select_balanced"]

# Tokens the chat template adds around the user turn (ChatML: role markers, newlines).
CHAT_OVERHEAD_TOKENS = 8


def load_tokenizer(model_id: str | None = None) -> Any | None:
    """The tokenizer of a model id as ``kvdiv serve --model`` understands it, without its weights.

    ``approx`` gives None (the tokenizer-free count). The embedded SmolLM2 reads the
    server's dequantised cache when a server has started once (fast), else parses the
    GGUF (~8 s on 2 cores).
    """
    if model_id == "approx":
        return None
    from transformers.utils import logging as hf_logging

    from gen_service.models import loading  # the service's loader: ids mean the same thing here

    # Counting whole topics before chunking exceeds model_max_length by design; the
    # "sequence length is longer than the maximum" warning would only alarm users.
    hf_logging.set_verbosity_error()

    return loading.load_tokenizer(model_id)


def prompt_length(tokenizer: Any | None) -> Callable[[list[dict[str, str]]], int]:
    """Tokens the server will prefill for chat ``messages``.

    With a chat template this is exact (SmolLM2's template adds a default system
    turn of ~20 tokens); otherwise the user turn plus a small allowance.
    """
    if tokenizer is not None and getattr(tokenizer, "chat_template", None):
        def exact(messages: list[dict[str, str]]) -> int:
            ids = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
            return len(ids if isinstance(ids, list) else ids["input_ids"])
        return exact
    count = D.token_counter(tokenizer)
    return lambda messages: sum(count(m["content"]) for m in messages) + CHAT_OVERHEAD_TOKENS


def budget_for(docs: Sequence[D.Document], template: str,
               length: Callable[[list[dict[str, str]]], int]) -> int:
    """N for ``snapkv#N``: half the median prompt length (document, template and chat turn)."""
    prompts = [length(D.render_messages(d, template)) for d in docs]
    return max(1, int(round(statistics.median(prompts) / 2)))


def select_balanced(docs: Sequence[D.Document], count: int, plan: Any) -> list[D.Document]:
    """``count`` documents, half in each of the plan's splits (confirmatory first when odd).

    The plan assigns documents by a salted hash of their ids, so a plain subset of
    14 may hold only 4 confirmatory documents, too few for any test to reject.
    Choosing by id alone, before any trace exists, leaves the split and the tests
    as prespecified; within each half the choice is D.select's stable spread.
    """
    from divstats import assign_split, load_plan

    spec = load_plan(plan)
    ranked = sorted(docs, key=D.select_key)
    labels = dict(zip([d.id for d in ranked], assign_split([d.id for d in ranked], spec.salt,
                                                           spec.confirmatory_fraction), strict=True))
    want = {"confirmatory": (count + 1) // 2, "exploratory": count // 2}
    chosen: set[str] = set()
    for doc in ranked:
        if want.get(labels[doc.id], 0) > 0:
            want[labels[doc.id]] -= 1
            chosen.add(doc.id)
    return [d for d in docs if d.id in chosen]


def prepare_documents(cfg: DemoConfig, say: Callable[[str], None]) -> tuple[Path, int]:
    """``documents.jsonl`` and the budget N in ``cfg.out``: built once, then reused so that reruns resume.

    Raises
    ------
    DemoError
        ``cfg.out`` holds a demo with other settings (each difference named).
    """
    settings_path = cfg.out / "demo.json"
    docs_path = cfg.out / "documents.jsonl"
    if settings_path.exists() and docs_path.exists():
        saved = json.loads(settings_path.read_text(encoding="utf-8"))
        if saved["sizes"] != cfg.sizes():
            diffs = [f"{k}: {saved['sizes'].get(k)!r} there, {v!r} now" for k, v in cfg.sizes().items()
                     if saved["sizes"].get(k) != v]
            raise DemoError(f"{cfg.out} holds a demo with other settings ({'; '.join(diffs)}). "
                            "Rerun with the same options to resume it, or pass a new --out.")
        say(f"      reusing {docs_path} ({saved['n_docs']} documents, snapkv#{saved['budget']})")
        return docs_path, int(saved["budget"])
    # one document set for every model (traces combine along model only over the same
    # documents), chunked with the first model's tokenizer
    say(f"      loading the {cfg.models[0]} tokenizer and chunking pydoc_data.topics to ~{cfg.target_tokens} tokens")
    tokenizer = load_tokenizer(cfg.models[0])
    docs = select_balanced(D.load_source(DEMO_STUDY.documents, tokenizer, target_tokens=cfg.target_tokens),
                           cfg.docs_count, cfg.plan or shipped_plan())
    budget = budget_for(docs, cfg.template, prompt_length(tokenizer))
    D.write_jsonl(docs, docs_path)
    settings = {"sizes": cfg.sizes(), "budget": budget, "n_docs": len(docs), "policies": demo_policies(budget)}
    settings_path.write_text(json.dumps(settings, indent=2) + "\n", encoding="utf-8")
    for line in D.iter_summary(docs):
        say(f"      {line}")
    return docs_path, budget
