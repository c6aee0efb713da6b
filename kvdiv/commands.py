"""``kvdiv demo`` and ``kvdiv docs``: the application layer's commands.

``demo`` runs the study end to end (the one command that joins every package);
``docs`` builds a document set counted with a model's tokenizer.

The heavy imports (the server, divstats) happen inside the command, so that
``kvdiv demo --help`` stays instant.
"""

from __future__ import annotations

import sys
from pathlib import Path

import click

from kvdiv.demo import DemoConfig

_DEMO = DemoConfig()  # the demo's defaults, shown in its --help


@click.command("docs")
@click.option("--source", default="pydoc", show_default=True,
              help="'pydoc' (CPython's built-in language reference), a JSONL file (id, text) "
                   "or a folder of .txt files.")
@click.option("-o", "--out", type=click.Path(dir_okay=False, path_type=Path), required=True,
              help="JSONL file to write.")
@click.option("--target-tokens", default=256, show_default=True, type=click.IntRange(min=8),
              help="Chunk length to aim for (pydoc, or user documents with --chunk).")
@click.option("--count", type=click.IntRange(min=1), default=None,
              help="Keep this many documents (a deterministic spread over topics). Default: all.")
@click.option("--chunk/--no-chunk", default=False, show_default=True,
              help="Cut user documents at paragraph boundaries like the built-in set.")
@click.option("--tokenizer", "tokenizer_id", default="embedded", show_default=True,
              help="Count tokens with this model's tokenizer (a `kvdiv serve --model` id), or 'approx'.")
@click.option("--server", default=None, metavar="URL",
              help="Count tokens with this running server's POST /tokenize instead (no torch needed).")
@click.option("--api-key", default=None, envvar="KVDIV_API_KEY", help="Bearer token for --server.")
@click.option("--force", is_flag=True, help="Replace --out if it exists.")
def docs(source: str, out: Path, target_tokens: int, count: int | None, chunk: bool, tokenizer_id: str,
         server: str | None, api_key: str | None, force: bool) -> None:
    """Build a JSONL document set (id, text, source, n_tokens, ...)."""
    from collector import documents as D

    # A document set may be hand-curated; refuse before the (slow) tokenizer loads.
    if out.exists() and not force:
        raise click.ClickException(f"{out} exists; pass --force to replace it")

    if server is not None:
        tokenizer = D.server_token_counter(server, api_key)
    else:
        from kvdiv.demo import load_tokenizer

        tokenizer = load_tokenizer(tokenizer_id)
    try:
        items = D.load_source(source, tokenizer, target_tokens=target_tokens, chunk=chunk)
        items = D.select(items, count)
        D.write_jsonl(items, out)
    except OSError as exc:
        raise click.ClickException(f"{exc.filename or out}: {exc.strerror or exc}") from None
    except ValueError as exc:
        raise click.ClickException(str(exc)) from None
    for line in D.iter_summary(items):
        click.echo(line, err=True)
    click.echo(str(out))


@click.command("demo")
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), default=Path("runs/demo"), show_default=True)
@click.option("--docs-count", type=click.IntRange(min=2), default=None,
              help=f"Documents to collect.  [default: {_DEMO.docs_count}]")
@click.option("--replicates", "-R", type=click.IntRange(min=1), default=None,
              help=f"Replicates per request.  [default: {_DEMO.replicates}]")
@click.option("--max-new-tokens", "-T", type=click.IntRange(min=2), default=None,
              help=f"Horizon T.  [default: {_DEMO.max_new_tokens}]")
@click.option("--window", "-W", type=click.IntRange(min=1), default=None,
              help=f"Residual observation window W.  [default: {_DEMO.window}]")
@click.option("--target-tokens", type=click.IntRange(min=16), default=None,
              help=f"Document length in tokens.  [default: {_DEMO.target_tokens}]")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--server", "servers", multiple=True,
              help="Use these running servers instead of starting one (e.g. a GPU box).")
@click.option("--model", default="embedded", show_default=True, help="Model for the server the demo starts.")
@click.option("--concurrency", type=click.IntRange(min=1), default=None,
              help=f"Requests in flight per server.  [default: {_DEMO.concurrency}]")
@click.option("--api-key", default=None, envvar="KVDIV_API_KEY")
@click.option("--plan", type=click.Path(exists=True, dir_okay=False, path_type=Path), default=None,
              help="Run this plan as written (snapkv#512 substituted post hoc) instead of the derived demo plan.")
def demo(out: Path, docs_count: int | None, replicates: int | None, max_new_tokens: int | None,
         window: int | None, target_tokens: int | None, seed: int, servers: tuple[str, ...], model: str,
         concurrency: int | None, api_key: str | None, plan: Path | None) -> None:
    """The paper's study end to end: documents, server, traces, plan, report."""
    from kvdiv.demo import DemoConfig, DemoError, run_demo

    overrides = {k: v for k, v in dict(docs_count=docs_count, replicates=replicates, max_new_tokens=max_new_tokens,
                                       window=window, target_tokens=target_tokens,
                                       concurrency=concurrency).items() if v is not None}
    cfg = DemoConfig(out=out, seed=seed, servers=list(servers), model=model, api_key=api_key, plan=plan,
                     **overrides)
    try:
        run_demo(cfg)
    except DemoError as exc:
        raise click.ClickException(str(exc)) from None
    except KeyboardInterrupt:
        click.echo(f"\ninterrupted; rerun `kvdiv demo` with the same options to resume ({out} keeps "
                   "every complete request)", err=True)
        sys.exit(130)


__all__ = ["demo", "docs"]
