"""The ``kvdiv`` command: a lazy dispatcher over the packages' own subcommands.

Each package owns its subcommands; they are imported only when invoked, so that
``kvdiv validate`` or ``kvdiv analyze`` never imports torch.
"""

from __future__ import annotations

import importlib
import os

import click

from kvdiv import __version__

# subcommand -> "module:attribute" of a click.Command, and its one-line help
# (shown in `kvdiv --help` without importing the module).
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "validate": ("protocols.cli:validate", "Check a traces file against kvdiv.trace/1."),
    "info": ("protocols.cli:info", "Summarise a traces file."),
    "convert": ("protocols.convert:convert", "Convert eval logs, OpenAI logprobs or kvpress results to traces."),
    "analyze": ("divstats.cli.analyze:analyze", "Estimate, test a plan and write a report."),
    "split": ("divstats.cli.analyze:split", "Show the plan's exploratory/confirmatory split."),
    "power": ("divstats.cli.power:power_command", "Power of a plan's hypotheses at a study size, from a pilot."),
    "serve": ("gen_service.api.cli:serve", "Run the TGI-compatible trace service."),
    "collect": ("kvdiv.commands:collect", "Collect traces from one or more servers (adaptive: --target-se)."),
    "pack": ("collector.cli:pack", "Assemble a collection journal into a dataset."),
    "docs": ("kvdiv.commands:docs", "Build a JSONL document set."),
    "demo": ("kvdiv.commands:demo", "Run the paper's study end to end on the embedded model."),
}


# Modules that only an extra installs -> that extra (pyproject.toml).
EXTRA_FOR: dict[str, str] = {m: "service" for m in (
    "torch", "transformers", "kvpress", "tokenizers", "accelerate", "gguf", "safetensors",
    "starlette", "uvicorn", "prometheus_client")}


class LazyGroup(click.Group):
    """A click group whose commands are imported on first use."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return list(SUBCOMMANDS)

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name not in SUBCOMMANDS:
            return None
        target, _ = SUBCOMMANDS[name]
        module_name, attr = target.split(":")
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            # A base install lacks the server's stack: say which extra brings it.
            if exc.name and exc.name.split(".")[0] in EXTRA_FOR:
                extra = EXTRA_FOR[exc.name.split(".")[0]]
                raise click.ClickException(
                    f"`kvdiv {name}` needs {exc.name}, which this install lacks: "
                    f"pip install 'kvdiv[{extra}]'") from None
            raise
        return getattr(module, attr)

    def invoke(self, ctx: click.Context) -> object:
        # The last line of defence for item "errors without tracebacks": an input error a
        # subcommand did not word itself still ends as one line (KVDIV_DEBUG=1 re-raises).
        try:
            return super().invoke(ctx)
        except (OSError, ValueError, KeyError, RecursionError) as exc:
            if os.environ.get("KVDIV_DEBUG"):
                raise
            where = f" {exc.filename}:" if isinstance(exc, OSError) and exc.filename else ""
            raise click.ClickException(f"kvdiv {ctx.invoked_subcommand}:{where} {type(exc).__name__}: {exc}") from None

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        # Help text comes from the table so `kvdiv --help` stays import-free.
        rows = [(name, short) for name, (_, short) in SUBCOMMANDS.items()]
        with formatter.section("Commands"):
            formatter.write_dl(rows)


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="kvdiv")
def main() -> None:
    """kvdiv: how and when KV-cache eviction makes an LLM drift from the full cache."""


if __name__ == "__main__":  # pragma: no cover
    main()
