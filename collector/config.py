"""A collection's parameters: :class:`CollectConfig` and the small records it groups.

``CollectConfig`` holds what a run collects (servers, documents, policies, the trace
kind and its R, T and W, the prompt template, the output folder) and four frozen
records for the rest, each read by the part of the collector it configures:

=====================  =================================================================
record                 fields
=====================  =================================================================
:class:`Sampling`      temperature, top_k, top_p, seed, common_random_numbers
:class:`RetryConfig`   max_attempts, backoff_s, backoff_max_s, read_timeout_s,
                       request_timeout_s
:class:`PoolConfig`    servers_file, concurrency, api_key, servers_poll_s,
                       wait_for_servers_s, server_backoff_s, server_backoff_max_s,
                       group_candidates
:class:`RoundConfig`   index, allocation (a later round of an adaptive collection)
=====================  =================================================================

Every field keeps the name it had when ``CollectConfig`` was flat (only the round's
``round_index`` became ``RoundConfig.index``), and :meth:`CollectConfig.flat` builds
a config from those flat names, as ``kvdiv collect``'s options give them. What the
journal stores (:meth:`CollectConfig.params`, the resume contract) is unchanged, so
journals written by the flat config resume.

The records are checked together: a config that cannot work raises one
:class:`~collector.errors.ConfigError` naming every problem, with the command-line
flags.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from collector.checks import asked_replicates
from collector.documents import TEMPLATE_NAMES
from collector.errors import ConfigError
from protocols import MAX_TOP_LOGPROBS, WIRE_KINDS, Kind

__all__ = ["CONTROL_POLICY", "CollectConfig", "PoolConfig", "RetryConfig", "RoundConfig", "Sampling"]

#: The numerical control's policy id: the candidate that is the reference (``collect --control``).
CONTROL_POLICY = "full"


@dataclass(frozen=True)
class Sampling:
    """How tokens are drawn, and the run seed every request's seed derives from.

    Attributes
    ----------
    temperature, top_k, top_p : float, int or None, float or None
        Sampling (temperature 0: greedy).
    seed : int
        The run seed (``collector.checks.derive_seed``).
    common_random_numbers : bool
        Derive each request's seed from (seed, document) instead of (seed, document,
        policy): every policy of a document draws the same random numbers.
    """

    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int = 0
    common_random_numbers: bool = False

    def problems(self) -> list[str]:
        return ["--temperature must be >= 0"] if self.temperature < 0 else []


@dataclass(frozen=True)
class RetryConfig:
    """Tries per request, the backoff between them, and the time one try may take.

    Attributes
    ----------
    max_attempts : int
        Tries per request before it is reported as failed.
    backoff_s, backoff_max_s : float
        First and longest wait before a retry (doubling, with full jitter).
    read_timeout_s : float
        Longest silence while reading a response.
    request_timeout_s : float or None
        Longest whole request (None: no limit); a multi-candidate request gets it once per policy.
    """

    max_attempts: int = 6
    backoff_s: float = 0.5
    backoff_max_s: float = 30.0
    read_timeout_s: float = 600.0
    request_timeout_s: float | None = 3600.0

    def problems(self) -> list[str]:
        if self.request_timeout_s is not None and not self.request_timeout_s > 0:
            return ["--request-timeout must be > 0 seconds"]
        return []

    def backoff(self, attempt: int, retry_after: float | None) -> float:
        """Seconds to wait after failed try ``attempt``: at least the server's ``Retry-After``."""
        # Full jitter: spreads retries of requests that failed together (one 429 burst).
        cap = min(self.backoff_max_s, self.backoff_s * 2 ** (attempt - 1))
        return max(random.uniform(0.5 * cap, cap), retry_after or 0.0)


@dataclass(frozen=True)
class PoolConfig:
    """How the servers are used: slots, authentication, the servers file, outages, grouping.

    Attributes
    ----------
    servers_file : Path, optional
        A file of server URLs, one a line, re-read every ``servers_poll_s`` seconds
        during the run (servers may join and leave); used with ``CollectConfig.servers``.
    concurrency : int
        Requests in flight per server.
    api_key : str, optional
        Bearer token for the servers.
    servers_poll_s : float
        How often ``servers_file`` is re-read.
    wait_for_servers_s : float
        How long the run waits while no listed server answers before it stops
        (the requests left stay incomplete for a rerun).
    server_backoff_s, server_backoff_max_s : float
        First and longest time a server that stops answering is out of rotation.
    group_candidates : bool
        Send a document's policies as the candidates of one request to a server that
        advertises ``trace_candidates`` (collector/grouped.py); the journal gets the
        same per-(document, policy) files. Off: one request per (document, policy).
    """

    servers_file: Path | None = None
    concurrency: int = 1
    api_key: str | None = None
    servers_poll_s: float = 2.0
    wait_for_servers_s: float = 300.0
    server_backoff_s: float = 1.0
    server_backoff_max_s: float = 60.0
    group_candidates: bool = True

    def __post_init__(self) -> None:
        if self.servers_file is not None:
            object.__setattr__(self, "servers_file", Path(self.servers_file))

    def problems(self) -> list[str]:
        if not self.wait_for_servers_s >= 0 or not self.servers_poll_s > 0 or not self.server_backoff_s > 0:
            return ["--wait-for-servers must be >= 0 seconds, the servers file's poll interval and the "
                    "server backoff > 0"]
        return []


@dataclass(frozen=True)
class RoundConfig:
    """Which round of an adaptive collection this is (``kvdiv collect --target-se``).

    Attributes
    ----------
    index : int
        0 for the run's first (or only) round; k >= 1 for a later round, which needs
        ``allocation``.
    allocation : mapping, optional
        doc id -> policy -> replicates for round ``index`` (0 or absent: no request for
        that pair); recorded in the journal before the round starts.
    """

    index: int = 0
    allocation: Mapping[str, Mapping[str, int]] | None = None

    def problems(self, policies: list[str]) -> list[str]:
        if self.index < 0:
            return [f"round_index must be >= 0, not {self.index}"]
        if (self.index > 0) != (self.allocation is not None):
            return ["a later round (round_index >= 1) needs an allocation, and only a later round takes one"]
        if self.allocation is None:
            return []
        unknown = sorted({p for row in self.allocation.values() for p in row} - set(policies))
        bad = [f"{d} × {p}: {r!r}" for d, row in self.allocation.items() for p, r in row.items()
               if not isinstance(r, int) or isinstance(r, bool) or r < 0]
        return ([f"the allocation names policies not in the run: {unknown}"] if unknown else []) + (
            [f"allocated replicates must be integers >= 0: {', '.join(bad[:5])}"] if bad else [])


#: The records of a config: CollectConfig field -> record class.
RECORDS: dict[str, type] = {"sampling": Sampling, "retry": RetryConfig, "pool": PoolConfig, "round": RoundConfig}
#: Flat field name (the config before it was nested, ``kvdiv collect``'s options) -> (record, its field).
FLAT_NAMES: dict[str, tuple[str, str]] = {
    **{f.name: (record, f.name) for record, cls in RECORDS.items() for f in dataclasses.fields(cls)},
    "round_index": ("round", "index"),
}
del FLAT_NAMES["index"]


@dataclass
class CollectConfig:
    """Everything ``collect`` needs; the fields in :meth:`params` are the resume contract.

    Attributes
    ----------
    servers : list of str
        Trace server URLs; requests are spread over them (more may come from
        ``pool.servers_file``).
    docs_file, out : Path
        The JSONL documents and the run directory.
    policies : list of str
        Candidate policy ids (the reference is ``full``).
    kind, replicates, max_new_tokens, window : str, int, int, int or None
        Trace kind, R, T and W (W defaults to T; reference traces have none: W = 0).
    template : str
        The prompt template.
    progress : bool
        Show a progress bar on stderr.
    sampling : Sampling
        Temperature, top-k, top-p, the run seed, common random numbers.
    retry : RetryConfig
        Tries per request, backoff and timeouts.
    pool : PoolConfig
        Slots per server, authentication, the servers file, outages, grouping.
    round : RoundConfig
        The round of an adaptive collection (0: the first or only one).
    top_logprobs : int
        k of the logit traces to ask for (0: none; at most 64): P's and Q's top-k
        log-probabilities and KL/entropy at every step (docs/contract.md, "Logit traces").
    control : bool
        Also collect the numerical control: the policy ``full`` (candidate = reference)
        is appended to ``policies``, so it runs in every document's grouped request
        through the same batching, fusion and stacking as the real candidates. Its
        divergence is the numerical noise floor (``divstats.noise_floor``); the
        journal records ``control`` in its parameters.

    Raises
    ------
    ConfigError
        Listing every parameter that cannot work.

    Examples
    --------
    >>> cfg = CollectConfig(servers=["http://127.0.0.1:8080/"], docs_file="d.jsonl", policies=["snapkv@0.5"],
    ...                     out="runs/x", max_new_tokens=8, sampling=Sampling(seed=1))
    >>> cfg.servers, cfg.effective_window, cfg.sampling.seed
    (['http://127.0.0.1:8080'], 8, 1)
    >>> CollectConfig.flat(servers=["http://x"], docs_file="d.jsonl", policies=["a"], out="o", seed=1) == \\
    ...     CollectConfig(servers=["http://x"], docs_file="d.jsonl", policies=["a"], out="o", sampling=Sampling(seed=1))
    True
    """

    servers: list[str]
    docs_file: Path
    policies: list[str]
    out: Path
    kind: str = "residual"
    replicates: int = 8
    max_new_tokens: int = 32
    window: int | None = None
    template: str = "summarise"
    progress: bool = True
    sampling: Sampling = field(default_factory=Sampling)
    retry: RetryConfig = field(default_factory=RetryConfig)
    pool: PoolConfig = field(default_factory=PoolConfig)
    round: RoundConfig = field(default_factory=RoundConfig)
    control: bool = False
    top_logprobs: int = 0

    def __post_init__(self) -> None:
        self.servers = [s.rstrip("/") for s in self.servers]
        self.policies = list(self.policies)
        if self.control and CONTROL_POLICY not in self.policies:
            self.policies.append(CONTROL_POLICY)
        self.docs_file, self.out = Path(self.docs_file), Path(self.out)
        problems = self._problems()
        if problems:
            raise ConfigError("; ".join(problems))

    @classmethod
    def flat(cls, **fields: Any) -> CollectConfig:
        """A config from flat field names: ``CollectConfig``'s own and its records' (:data:`FLAT_NAMES`).

        This is the form of ``kvdiv collect``'s options (``collector.cli.collect_config``)
        and of ``CollectConfig`` before it was nested.

        Raises
        ------
        TypeError
            A name that is no field.
        ConfigError
            Listing every parameter that cannot work.

        Examples
        --------
        >>> cfg = CollectConfig.flat(servers=["http://x"], docs_file="d.jsonl", policies=["a"], out="o",
        ...                          seed=3, max_attempts=2, round_index=0)
        >>> cfg.sampling.seed, cfg.retry.max_attempts, cfg.round.index
        (3, 2, 0)
        """
        records: dict[str, dict[str, Any]] = {name: {} for name in RECORDS}
        own: dict[str, Any] = {}
        for name, value in fields.items():
            if name in FLAT_NAMES:
                record, key = FLAT_NAMES[name]
                records[record][key] = value
            else:
                own[name] = value
        return cls(**own, **{name: RECORDS[name](**kw) for name, kw in records.items()})

    def for_round(self, index: int, allocation: Mapping[str, Mapping[str, int]] | None) -> CollectConfig:
        """This config for round ``index`` of an adaptive collection, with its allocation."""
        return dataclasses.replace(self, round=RoundConfig(index, allocation))

    def _problems(self) -> list[str]:
        problems = []
        if not self.servers and self.pool.servers_file is None:
            problems.append("at least one --server or a --servers-file is needed")
        if not self.policies:
            problems.append("at least one policy is needed")
        if len(set(self.policies)) != len(self.policies):
            problems.append(f"duplicate policies in {self.policies}")
        if self.kind not in WIRE_KINDS:
            problems.append(f"--kind must be one of {WIRE_KINDS}, not {self.kind!r}")
        if self.template not in TEMPLATE_NAMES:
            problems.append(f"--template must be one of {list(TEMPLATE_NAMES)}, not {self.template!r}")
        if min(self.replicates, self.max_new_tokens, self.pool.concurrency, self.retry.max_attempts) < 1:
            problems.append("--replicates, --max-new-tokens, --concurrency and attempts must be >= 1")
        if self.window is not None and not 1 <= self.window <= self.max_new_tokens:
            problems.append(f"--window must be in 1..{self.max_new_tokens}, not {self.window}")
        if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            problems.append(f"--top-logprobs must be in 0..{MAX_TOP_LOGPROBS}, not {self.top_logprobs}")
        if self.kind == Kind.COUPLED and self.window not in (None, self.max_new_tokens):
            problems.append("--window applies to residual traces (coupled traces run to the horizon)")
        if self.kind == Kind.REFERENCE and self.window is not None:
            problems.append("--window applies to residual traces (reference traces observe nothing after "
                            "divergence)")
        return (problems + self.sampling.problems() + self.retry.problems() + self.round.problems(self.policies)
                + self.pool.problems())

    def round_params(self, params: Mapping[str, Any]) -> dict[str, Any]:
        """The run's parameters as this round's requests must answer them (round and allocation added)."""
        if not self.round.index:
            return dict(params)
        return {**params, "round": self.round.index,
                "allocation": {d: dict(row) for d, row in (self.round.allocation or {}).items()}}

    def replicates_for(self, doc_id: str, policy: str) -> int:
        """R asked of (doc_id, policy) in this round (0: not requested)."""
        return asked_replicates(self.round_params({"replicates": self.replicates}), doc_id, policy)

    def params(self, docs_sha256: str) -> dict[str, Any]:
        """The parameters that decide the traces' values (compared on resume and by ``pack``).

        The flat form the journal has always stored, whatever record a field now lives in.
        """
        s = self.sampling
        return {
            "policies": list(self.policies), "kind": self.kind, "replicates": self.replicates,
            "max_new_tokens": self.max_new_tokens, "window": self.effective_window,
            "temperature": s.temperature, "top_k": s.top_k, "top_p": s.top_p,
            "seed": s.seed, "template": self.template, "docs_sha256": docs_sha256,
            "reference": "full",
            # only when on, so journals written before the option existed still resume
            **({"common_random_numbers": True} if s.common_random_numbers else {}),
            **({"control": CONTROL_POLICY} if self.control else {}),
            **({"top_logprobs": self.top_logprobs} if self.top_logprobs else {}),
        }

    @property
    def effective_window(self) -> int:
        """W as the headers carry it: 0 for reference traces, else ``window`` or T."""
        if self.kind == Kind.REFERENCE:
            return 0
        return self.max_new_tokens if self.window is None else self.window
