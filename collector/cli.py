"""``kvdiv collect | pack``: the collection client's command line.

Heavy imports (httpx, torch, xarray) happen inside the commands, so that
``kvdiv --help`` and ``kvdiv collect --help`` stay instant.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING

import click

from collector.documents import TEMPLATE_NAMES
from protocols import WIRE_KINDS

if TYPE_CHECKING:
    from collector.config import CollectConfig


def _split_policies(value: str) -> list[str]:
    # One grammar (protocols.policies): ids, their parameters after ':' and families
    # ("snapkv@0.9,0.7,0.5", "snapkv@0.9..0.3/0.2") expanded into their members, which
    # collector.grouped then sends in one request per document.
    from protocols.policies import PolicyIdError, expand_policies

    try:
        return expand_policies(value)
    except PolicyIdError as exc:
        raise click.BadParameter(str(exc), param_hint="--policies") from None


@click.command("collect")
@click.option("--server", "servers", multiple=True,
              help="Trace server URL (repeat to spread requests over several servers).")
@click.option("--servers-file", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="File of server URLs, one a line (# comments), re-read every few seconds: servers may "
                   "join and leave during the run. Adds to --server.")
@click.option("--wait-for-servers", type=click.FloatRange(min=0), default=300.0, show_default=True,
              help="Seconds to wait while no listed server answers before stopping (a rerun resumes).")
@click.option("--docs", "docs_file", type=click.Path(exists=True, dir_okay=False, path_type=Path), required=True,
              help="JSONL document set (see `kvdiv docs`). With `answers` (`kvdiv docs --task`), a coupled run ends "
                   "by decoding P's and Q's answers for `kvdiv pack` to score.")
@click.option("--policies", required=True,
              help="Comma-separated candidate policy ids, e.g. snapkv@0.5,recent@0.5; a family lists several "
                   "amounts of one method: snapkv@0.9,0.7,0.5 or the range snapkv@0.9..0.3/0.2 (ends included).")
@click.option("--kind", type=click.Choice(WIRE_KINDS), default="residual", show_default=True)
@click.option("--replicates", "-R", type=click.IntRange(min=1), default=8, show_default=True)
@click.option("--max-new-tokens", "-T", type=click.IntRange(min=1), default=32, show_default=True)
@click.option("--window", "-W", type=click.IntRange(min=1), default=None,
              help="Residual branches' observation window (default: T, branches run to the end).")
@click.option("--temperature", type=click.FloatRange(min=0), default=1.0, show_default=True)
@click.option("--top-k", type=click.IntRange(min=0), default=None)
@click.option("--top-p", type=click.FloatRange(min=0, max=1, min_open=True), default=None)
@click.option("--seed", type=int, required=True, help="Run seed; each request's seed derives from (seed, doc, policy).")
@click.option("--common-random-numbers/--no-common-random-numbers", "crn", default=False, show_default=True,
              help="Derive each request's seed from (seed, doc) so all policies of a document share random "
                   "numbers (lower variance of paired differences; docs/design.md).")
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), required=True,
              help="Run directory (journal and manifest); rerunning resumes it.")
@click.option("--api-key", default=None, envvar="KVDIV_API_KEY",
              help="Bearer token for the servers [env KVDIV_API_KEY].")
@click.option("--concurrency", type=click.IntRange(min=1), default=8, show_default=True,
              help="Requests in flight per server; the default fills `kvdiv serve`'s decoding batch "
                   "(--max-batch-requests 8).")
@click.option("--template", type=click.Choice(TEMPLATE_NAMES), default="summarise", show_default=True,
              help="The prompt: a chat turn (messages), or with -raw the document as raw context and the "
                   "instruction after it, for a base model without a chat template.")
@click.option("--max-attempts", type=click.IntRange(min=1), default=6, show_default=True,
              help="Tries per request before it is reported as failed.")
@click.option("--request-timeout", type=click.FloatRange(min=0, min_open=True), default=3600.0, show_default=True,
              help="Seconds one request may take in all (covers servers that drip bytes); then it is retried.")
@click.option("--progress/--no-progress", default=True, show_default=True)
@click.option("--group-candidates/--no-group-candidates", default=True, show_default=True,
              help="Send a document's policies as one multi-candidate request to servers that support it "
                   "(same journal files).")
@click.option("--top-logprobs", type=click.IntRange(0, 64), default=0, show_default=True,
              help="Also collect logit traces: P's and Q's top-K log-probabilities and KL/entropy at every step "
                   "(docs/contract.md, \"Logit traces\"; 0: none).")
@click.option("--control/--no-control", default=False, show_default=True,
              help="Add the numerical control: the policy `full` (candidate = reference) in every document's "
                   "request, batched and fused like the others; its divergence is the noise floor "
                   "(docs/report.md).")
def collect(servers: tuple[str, ...], servers_file: Path | None, wait_for_servers: float, docs_file: Path,
            policies: str, kind: str, replicates: int,
            max_new_tokens: int, window: int | None, temperature: float, top_k: int | None,
            top_p: float | None, seed: int, crn: bool, out: Path, api_key: str | None, concurrency: int,
            template: str, max_attempts: int, request_timeout: float, progress: bool,
            group_candidates: bool, control: bool, top_logprobs: int) -> None:
    """Collect traces for every (document, policy) into a resumable journal."""
    options = dict(locals())  # the command's options, before anything else is bound
    from collector.collect import collect as run_collect
    from collector.errors import CollectorError

    try:
        cfg = collect_config(**options)
        result = run_collect(cfg)
    except CollectorError as exc:
        raise click.ClickException(str(exc)) from None
    except OSError as exc:  # the --out folder or the documents file: unwritable, vanished
        raise click.ClickException(f"{exc.filename or out}: {exc.strerror or exc}") from None
    click.echo(result.summary(), err=True)
    if result.refused:   # designed refusals: rerunning cannot collect them
        click.echo("The server refuses the REFUSED policies on its model by design (docs/presses-by-family.md): "
                   "rerunning will not collect them; collect without them (--policies).", err=True)
    if result.retry_helps:
        click.echo(f"Rerun the same command to retry the failed requests; {out} keeps the rest.", err=True)
    if not result.ok:
        sys.exit(1)
    click.echo(f"complete: `kvdiv pack {out} -o {out / 'traces.nc'}`", err=True)


def collect_config(*, servers: tuple[str, ...], servers_file: Path | None, wait_for_servers: float, docs_file: Path,
                   policies: str, kind: str, replicates: int, max_new_tokens: int, window: int | None,
                   temperature: float, top_k: int | None, top_p: float | None, seed: int, crn: bool, out: Path,
                   api_key: str | None, concurrency: int, template: str, max_attempts: int, request_timeout: float,
                   progress: bool, group_candidates: bool = True, control: bool = False, top_logprobs: int = 0,
                   **_: object) -> CollectConfig:
    """The :class:`collector.collect.CollectConfig` of ``kvdiv collect``'s options (also for ``kvdiv.adaptive``)."""
    from collector.config import CollectConfig, PoolConfig, RetryConfig, Sampling

    return CollectConfig(
        servers=list(servers), docs_file=docs_file, policies=_split_policies(policies), out=out, kind=kind,
        replicates=replicates, max_new_tokens=max_new_tokens, window=window, template=template, progress=progress,
        control=control, top_logprobs=top_logprobs,
        sampling=Sampling(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, common_random_numbers=crn),
        retry=RetryConfig(max_attempts=max_attempts, request_timeout_s=request_timeout),
        pool=PoolConfig(servers_file=servers_file, concurrency=concurrency, api_key=api_key,
                        wait_for_servers_s=wait_for_servers, group_candidates=group_candidates))


@click.command("pack")
@click.argument("run_dir", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("-o", "--out", type=click.Path(path_type=Path), required=True, help="traces.nc or traces.zarr")
@click.option("--drop-incomplete", is_flag=True, help="Leave out documents lacking a policy instead of failing.")
@click.option("--overwrite", is_flag=True,
              help="Replace an existing --out, but only a traces file or store that kvdiv wrote.")
@click.option("--append", is_flag=True,
              help="Add the run's documents that --out does not hold yet (packed earlier from the same run).")
@click.option("--allow-mixed-numerics", is_flag=True,
              help="Pack traces whose numerics (dtype, fused or separate P+Q forwards, device) differ; "
                   "refused by default, since their divergences are not comparable.")
@click.option("--drop-policy", "drop_policies", multiple=True, metavar="ID",
              help="Leave the run's policy ID out (repeatable), e.g. one the server refused for this model; "
                   "recorded in the dataset's attrs and the run's manifest.")
def pack(run_dir: Path, out: Path, drop_incomplete: bool, overwrite: bool, append: bool,
         allow_mixed_numerics: bool, drop_policies: tuple[str, ...]) -> None:
    """Assemble a collection's complete requests into one validated traces file, document by document."""
    from collector.errors import CollectorError
    from collector.pack import pack_to

    try:
        if out.suffix not in (".nc", ".zarr"):  # before the work, not after
            raise click.ClickException(f"{out}: the output must end in .nc or .zarr")
        if append and overwrite:
            raise click.ClickException("--append adds to --out and --overwrite replaces it: choose one")
        result = pack_to(run_dir, out, append=append, overwrite=overwrite, drop_incomplete=drop_incomplete,
                         allow_mixed_numerics=allow_mixed_numerics, drop_policies=drop_policies)
    except CollectorError as exc:
        raise click.ClickException(str(exc)) from None
    except OSError as exc:
        raise click.ClickException(f"{exc.filename or out}: {exc.strerror or exc}") from None
    click.echo(result.summary(), err=True)


__all__ = ["collect", "collect_config", "pack"]
