"""``kvdiv docs | collect | pack | demo``: the collection jobs' command line.

Heavy imports (httpx, torch, xarray) happen inside the commands, so that
``kvdiv --help`` and ``kvdiv collect --help`` stay instant.
"""

from __future__ import annotations

import sys
from pathlib import Path

import click

from gen_service.demo import DemoConfig
from gen_service.documents import TEMPLATES

_DEMO = DemoConfig()  # the demo's defaults, shown in its --help


def _split_policies(value: str) -> list[str]:
    # Policy ids may carry parameters after ':' ("snapkv@0.5:window_size=64") but
    # never a comma outside them, except between parameters: split only where the
    # next piece starts a new id, i.e. does not look like "key=value".
    pieces = [p.strip() for p in value.split(",") if p.strip()]
    ids: list[str] = []
    for piece in pieces:
        if ids and "=" in piece and ":" not in piece and "@" not in piece and "#" not in piece:
            ids[-1] += "," + piece
        else:
            ids.append(piece)
    return ids


@click.command("docs")
@click.option("--source", default="pydoc", show_default=True,
              help="'pydoc' (CPython's built-in language reference), a JSONL file (id, text) or a folder of .txt files.")
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
def docs(source: str, out: Path, target_tokens: int, count: int | None, chunk: bool, tokenizer_id: str) -> None:
    """Build a JSONL document set (id, text, source, n_tokens, ...)."""
    from gen_service import documents as D

    tokenizer = D.load_tokenizer(tokenizer_id)
    try:
        items = D.load_source(source, tokenizer, target_tokens=target_tokens, chunk=chunk)
    except (OSError, ValueError) as exc:
        raise click.ClickException(str(exc)) from None
    items = D.select(items, count)
    D.write_jsonl(items, out)
    for line in D.iter_summary(items):
        click.echo(line, err=True)
    click.echo(str(out))


@click.command("collect")
@click.option("--server", "servers", multiple=True, required=True,
              help="Trace server URL (repeat to spread requests over several servers).")
@click.option("--docs", "docs_file", type=click.Path(exists=True, dir_okay=False, path_type=Path), required=True,
              help="JSONL document set (see `kvdiv docs`).")
@click.option("--policies", required=True, help="Comma-separated candidate policy ids, e.g. snapkv@0.5,recent@0.5.")
@click.option("--kind", type=click.Choice(["coupled", "residual"]), default="residual", show_default=True)
@click.option("--replicates", "-R", type=click.IntRange(min=1), default=8, show_default=True)
@click.option("--max-new-tokens", "-T", type=click.IntRange(min=1), default=32, show_default=True)
@click.option("--window", "-W", type=click.IntRange(min=1), default=None,
              help="Residual branches' observation window (default: T, branches run to the end).")
@click.option("--temperature", type=click.FloatRange(min=0), default=1.0, show_default=True)
@click.option("--top-k", type=click.IntRange(min=0), default=None)
@click.option("--top-p", type=click.FloatRange(min=0, max=1, min_open=True), default=None)
@click.option("--seed", type=int, required=True, help="Run seed; each request's seed derives from (seed, doc, policy).")
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), required=True,
              help="Run directory (journal and manifest); rerunning resumes it.")
@click.option("--api-key", default=None, envvar="KVDIV_API_KEY", help="Bearer token for the servers [env KVDIV_API_KEY].")
@click.option("--concurrency", type=click.IntRange(min=1), default=2, show_default=True,
              help="Requests in flight per server.")
@click.option("--template", type=click.Choice(sorted(TEMPLATES)), default="summarise", show_default=True)
@click.option("--max-attempts", type=click.IntRange(min=1), default=6, show_default=True,
              help="Tries per request before it is reported as failed.")
@click.option("--progress/--no-progress", default=True, show_default=True)
def collect(servers: tuple[str, ...], docs_file: Path, policies: str, kind: str, replicates: int,
            max_new_tokens: int, window: int | None, temperature: float, top_k: int | None,
            top_p: float | None, seed: int, out: Path, api_key: str | None, concurrency: int,
            template: str, max_attempts: int, progress: bool) -> None:
    """Collect traces for every (document, policy) into a resumable journal."""
    from gen_service.collector import CollectConfig, collect as run_collect
    from gen_service.journal import ManifestMismatch

    try:
        cfg = CollectConfig(servers=list(servers), docs_file=docs_file, policies=_split_policies(policies),
                            out=out, kind=kind, replicates=replicates, max_new_tokens=max_new_tokens,
                            window=window, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                            template=template, api_key=api_key, concurrency=concurrency,
                            max_attempts=max_attempts, progress=progress)
        result = run_collect(cfg)
    except (ValueError, ManifestMismatch) as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(result.summary(), err=True)
    if not result.ok:
        click.echo(f"Rerun the same command to retry the failed requests; {out} keeps the rest.", err=True)
        sys.exit(1)
    click.echo(f"complete: `kvdiv pack {out} -o {out / 'traces.nc'}`", err=True)


@click.command("pack")
@click.argument("run_dir", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("-o", "--out", type=click.Path(path_type=Path), required=True, help="traces.nc or traces.zarr")
@click.option("--drop-incomplete", is_flag=True, help="Leave out documents lacking a policy instead of failing.")
def pack(run_dir: Path, out: Path, drop_incomplete: bool) -> None:
    """Assemble a collection's complete requests into one validated traces file."""
    from gen_service.collector import PackError, pack_run, save_dataset

    try:
        ds = pack_run(run_dir, drop_incomplete=drop_incomplete)
        save_dataset(ds, out)
    except PackError as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(f"{out}: {ds.sizes['doc']} documents × {ds.sizes['policy']} policies × "
               f"{ds.sizes['replicate']} replicates, kind {ds.attrs['kind']}, T={ds.attrs['horizon']}", err=True)


@click.command("demo")
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), default=Path("runs/demo"), show_default=True)
@click.option("--docs-count", type=click.IntRange(min=2), default=None, help=f"Documents to collect.  [default: {_DEMO.docs_count}]")
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
    from gen_service.demo import DemoConfig, DemoError, run_demo

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


__all__ = ["collect", "demo", "docs", "pack"]
