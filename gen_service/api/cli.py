"""``kvdiv serve``: load a model and serve the TGI-compatible trace API."""

from __future__ import annotations

import logging
import os
import socket
import sys

import click

__all__ = ["build_service", "serve"]

log = logging.getLogger("kvdiv.service")


def build_service(model: str | None = None, *, gguf: str | None = None, eviction: str = "full",
                  api_key: str | None = None, max_new_tokens: int = 1024, max_replicates: int = 1024,
                  max_queue: int = 16, device: str | None = None, dtype: str | None = None,
                  press: tuple[str, ...] = (), press_option: tuple[str, ...] = (), self_check: bool = True,
                  self_check_tolerance: float | None = None, **limits):
    """Model + registry + engine + app; shared by the CLI, tests and the benchmark.

    Parameters
    ----------
    model, gguf, device, dtype
        What :func:`gen_service.models.loading.load_model` loads, and where.
    eviction : str
        Default policy for TGI and OpenAI requests.
    api_key : str, optional
        Require ``Authorization: Bearer KEY``; an empty key is refused.
    press : tuple of str
        ``[NAME=]module:Class`` custom presses.
    press_option : tuple of str
        ``Class:key=value`` server-side press options (a stats folder,
        ``allow_download=true``), which requests may not set.
    self_check : bool
        Run the start-up self-check (:mod:`gen_service.serving.self_check`) before returning:
        P's decoding against the model's own forward, the tokenizer against the
        checkpoint's. ``service.self_check`` holds the result (None when skipped).
    self_check_tolerance : float, optional
        The largest |Δ log p| it allows (default by the weights' dtype).
    **limits
        Further :class:`gen_service.serving.service.ServiceConfig` fields (``max_input_bytes``,
        ``max_body_bytes``, ``body_timeout_s``, ``max_request_seconds``,
        ``memory_budget``, ...).

    Returns
    -------
    (Starlette, Service)

    Raises
    ------
    ConfigError
        For an empty API key or a bad limit, before the model is loaded.
    PolicyError
        For a malformed ``press_option``, before the model is loaded.
    SelfCheckFailed
        When the self-check finds the decoding or the tokenizer unlike the model's own.

    Examples
    --------
    >>> app, service = build_service("tiny:llama", max_new_tokens=64)  # doctest: +SKIP
    >>> service.config.max_new_tokens                                  # doctest: +SKIP
    64
    """
    # imported here, not at the top: ``kvdiv --help`` and the command's own option
    # checks must not load torch (tests/test_cli_imports.py)
    from gen_service.api.app import create_app
    from gen_service.engine.facade import Engine
    from gen_service.errors import ConfigError
    from gen_service.models.loading import load_model, pick_device
    from gen_service.presses.registry import PolicyRegistry, load_class, parse_press_option
    from gen_service.serving.service import Service, ServiceConfig

    # the configuration first: a refused key must not cost a model load
    config = ServiceConfig(eviction=eviction, max_new_tokens=max_new_tokens, max_replicates=max_replicates,
                           max_queue=max_queue, api_key=api_key, **limits)
    if config.cuda_graphs and pick_device(device).type != "cuda":   # refused before the model loads
        raise ConfigError(f"--cuda-graphs needs a CUDA device; this server would run on {pick_device(device).type}")
    extra = {}
    for target in press:
        name, _, spec = target.rpartition("=")
        cls = load_class(spec)
        extra[name or cls.__name__] = cls
    options: dict[str, dict] = {}
    for text in press_option:  # server-side press options: paths, datasets, downloads
        cls_name, key, value = parse_press_option(text)
        options.setdefault(cls_name, {})[key] = value
    lm = load_model(model, gguf=gguf, device=device, dtype=dtype)
    engine = Engine(lm, PolicyRegistry(extra, press_options=options))
    engine.batch_candidates = config.batch_candidates
    engine.fuse = config.fuse
    engine.use_cuda_graphs(config.cuda_graphs)
    service = Service(engine, config)
    if self_check:
        from gen_service.serving.self_check import run_self_check

        service.self_check = run_self_check(service, self_check_tolerance)
    return create_app(service), service


def _quiet_libraries() -> None:
    # transformers' per-tensor progress bars and hub warnings drown the ready line
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        hf_logging.set_verbosity_error()
    except ImportError:
        pass
    # kvpress warns "Model ... not tested" at every press it applies: once per prefill,
    # dozens of identical lines a minute for Gemma 3; the first says it all
    press_log = logging.getLogger("kvpress.presses.base_press")
    if not any(isinstance(f, _Once) for f in press_log.filters):
        press_log.addFilter(_Once())


class _Once(logging.Filter):
    """Pass each distinct message once."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: set[str] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if message in self.seen:
            return False
        self.seen.add(message)
        return True


@click.command("serve")
@click.option("--model", default="embedded", show_default=True,
              help="embedded or smollm2-135m (SmolLM2-135M-Instruct GGUF), gemma3-270m (Gemma 3 270M base GGUF), "
                   "tiny:llama, tiny:qwen2, random:llama-1b or random:llama-8b (benchmarks), a local dir or a hub id.")
@click.option("--gguf", type=click.Path(exists=True, dir_okay=False), default=None, help="Load this GGUF file.")
@click.option("--eviction", default="full", show_default=True,
              help="Default policy for TGI requests (parameters.eviction overrides).")
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", default=8080, show_default=True, type=int, help="0 picks a free port.")
@click.option("--api-key", envvar="KVDIV_API_KEY", default=None,
              help="Require 'Authorization: Bearer KEY' (all but /health); an empty key refuses to start. "
                   "Env: KVDIV_API_KEY.")
@click.option("--max-new-tokens", default=1024, show_default=True, type=int, help="Largest T a request may ask.")
@click.option("--max-replicates", default=1024, show_default=True, type=int,
              help="Largest R per trace request (the memory budget may allow fewer).")
@click.option("--memory-budget", default=None, metavar="BYTES|FRACTION",
              help="Memory a trace request may use beyond the weights: bytes (8GiB) or a fraction of the free "
                   "memory at start (0.5). Default 0.8. Requests estimated above it get 422 with the numbers.")
@click.option("--max-queue", default=16, show_default=True, type=int,
              help="Requests queued or running before answering 429.")
@click.option("--device", default="auto", show_default=True, help="auto, cpu, cuda, cuda:1 ...")
@click.option("--dtype", default="auto", show_default=True, help="auto (bf16 on CUDA, fp32 on CPU), float32, bfloat16.")
@click.option("--press", multiple=True, metavar="[NAME=]module:Class",
              help="Register a custom press class as policy NAME (default: the class name). Repeatable.")
@click.option("--press-option", multiple=True, metavar="Class:key=value",
              help="Server-side press option a request may not set (a stats folder, a local artifact folder "
                   "such as RestoreKVPress:path=DIR, allow_download=true). Repeatable.")
@click.option("--max-input-bytes", default=1 << 20, show_default=True, type=click.IntRange(1),
              help="Largest prompt text (inputs / messages, UTF-8 bytes), checked before tokenising.")
@click.option("--max-body-bytes", default=1 << 20, show_default=True, type=click.IntRange(1),
              help="Largest request body.")
@click.option("--body-timeout", default=10.0, show_default=True, type=click.FloatRange(0, min_open=True),
              help="Seconds a client has to send its request body (408 after).")
@click.option("--max-request-seconds", default=None, type=click.FloatRange(0, min_open=True),
              help="Wall time of one request's model work (default: 600 on the CPU, none on CUDA; inf: none). "
                   "A trace request estimated to take longer is refused up front (422); a stream past it ends "
                   "with an error record.")
@click.option("--max-candidates", default=64, show_default=True, type=click.IntRange(1, 64),
              help="Candidates one /v1/traces request may hold (`candidates`); 1 turns multi-candidate requests off.")
@click.option("--batch-candidates/--no-batch-candidates", default=True, show_default=True,
              help="Stack the candidates' forwards of a multi-candidate request (traces equal separate requests' "
                   "to rounding); off: every forward alone, bit-identical to separate requests.")
@click.option("--fuse", type=click.Choice(["auto", "on", "off"]), default="auto", show_default=True,
              help="P's and Q's decoding forwards as one batch: auto times both ways on the first step of each "
                   "shape and keeps the faster (/info reports it).")
@click.option("--cuda-graphs/--no-cuda-graphs", default=False, show_default=True,
              help="Capture the stacked decoding forward as a CUDA graph and replay it at each step "
                   "(static shapes; CUDA only, refused on another device).")
@click.option("--max-batch-requests", default=None, type=click.IntRange(1),
              help="Concurrent /v1/traces requests decoded in one batch (continuous batching; traces equal each "
                   "request's alone to rounding); 1: one request at a time. Default: by device, what was "
                   "measured faster (CPU 1, CUDA 8; /info says which and why).")
@click.option("--self-check/--no-self-check", default=True, show_default=True,
              help="Before accepting requests, check that P's decoding equals the model's own forward (a prompt "
                   "longer than its longest sliding window, 16 steps, stacked and batched) and that the tokenizer "
                   "is the checkpoint's; refuse to start on a mismatch. /info reports it.")
@click.option("--self-check-tolerance", default=None, type=click.FloatRange(0, min_open=True),
              help="Largest |log p difference| (nats) the self-check allows [default: 1e-3 in float32, 0.25 bf16].")
@click.option("--log-level", default="info", show_default=True)
def serve(model, gguf, eviction, host, port, api_key, max_new_tokens, max_replicates, memory_budget, max_queue,
          device, dtype, press, press_option, max_input_bytes, max_body_bytes, body_timeout, max_request_seconds,
          max_candidates, batch_candidates, fuse, cuda_graphs, max_batch_requests, self_check, self_check_tolerance,
          log_level):
    """Run the TGI-compatible trace service (POST /generate, /v1/traces, ...)."""
    # Before torch loads OpenMP: its default busy-waiting threads collapse when the
    # cores are shared (a 576x1536 matmul went from 0.25 ms to 16 ms on 2 busy cores).
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    import uvicorn  # here, as everything below: ``kvdiv serve --help`` loads nothing heavy

    from gen_service.errors import ConfigError

    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    _quiet_libraries()
    try:
        from gen_service.serving.admission import parse_budget

        app, service = build_service(model, gguf=gguf, eviction=eviction, api_key=api_key,
                                     max_new_tokens=max_new_tokens, max_replicates=max_replicates,
                                     max_queue=max_queue, device=device, dtype=dtype, press=press,
                                     press_option=press_option,
                                     max_input_bytes=max_input_bytes, max_body_bytes=max_body_bytes,
                                     body_timeout_s=body_timeout, max_request_seconds=max_request_seconds,
                                     memory_budget=parse_budget(memory_budget), max_candidates=max_candidates,
                                     batch_candidates=batch_candidates, fuse=fuse, cuda_graphs=cuda_graphs,
                                     max_batch_requests=max_batch_requests, self_check=self_check,
                                     self_check_tolerance=self_check_tolerance)
    except ConfigError as exc:
        raise click.ClickException(str(exc)) from exc
    except ModuleNotFoundError as exc:  # a base install: the model stack is the [service] extra
        raise click.ClickException(f"`kvdiv serve` needs {exc.name}, which this install lacks: "
                                   f"pip install 'kvdiv[service]'") from None
    except Exception as exc:
        raise click.ClickException(f"could not start: {exc}") from exc
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        raise click.ClickException(f"cannot bind {host}:{port}: {exc}") from exc
    bound = sock.getsockname()[1]
    url = f"http://{'[' + host + ']' if ':' in host else host}:{bound}"
    lm = service.engine.lm
    config = uvicorn.Config(app, log_level=log_level.lower(), access_log=False, timeout_graceful_shutdown=2)
    server = uvicorn.Server(config)
    # The ready line is printed (and flushed) once uvicorn is accepting: scripts wait for it.
    _orig_startup = server.startup

    async def startup(sockets=None):
        await _orig_startup(sockets=sockets)
        click.echo(f"kvdiv serve ready: {url} model={lm.name} device={lm.device.type} "
                   f"eviction={eviction}", err=False)
        sys.stdout.flush()

    server.startup = startup  # type: ignore[method-assign]
    server.run(sockets=[sock])
