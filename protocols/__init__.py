"""protocols: the ``kvdiv.trace/1`` contract (xarray layout, wire records, validation,
I/O, combining and converters); see docs/contract.md.

Depends on numpy, xarray, h5netcdf, zarr and click; never imports torch, divstats or
gen_service.
Every error it raises on purpose derives from :class:`protocols.ProtocolError`.
"""

from protocols import converters, scoring
from protocols.assemble import StreamError, assemble, assemble_stream
from protocols.combine import CombineError, combine
from protocols.converters import (
    ConversionError,
    from_eval_logs,
    from_openai_logprobs,
    from_probabilities,
    residual_from_probabilities,
)
from protocols.errors import ProtocolError
from protocols.io import OutputExistsError, TraceFileError, open_traces, save_traces
from protocols.kinds import KINDS, TRACE_KINDS, WIRE_KINDS, Kind
from protocols.logit_fields import LOGIT_FIELDS, MAX_TOP_LOGPROBS, law_summaries, logit_vars, wire_logits, with_logits
from protocols.policies import (
    PolicyIdError,
    PolicySpec,
    PressTerm,
    QuantTerm,
    expand_policies,
    expand_policy_family,
    family_key,
    parse_option_value,
    parse_policy_id,
    policy_coords,
    policy_families,
)
from protocols.schema import (
    COUPLING,
    SCHEMA,
    answer_variables,
    answers_dataset,
    coupled_dataset,
    eos_ids,
    reference_dataset,
    residual_dataset,
    sampling_params,
)
from protocols.store import StoreError, TraceStoreWriter
from protocols.stream import Stream, StreamLimits, StreamReader, read_stream
from protocols.validate import TV_ZERO_ATOL, Problem, TraceValidationError, validate
from protocols.version import __version__
from protocols.wire import (
    StreamWriter,
    branch_record,
    dataset_lines,
    encode_line,
    end_record,
    error_record,
    header_record,
    prompt_digest,
    reference_step_record,
    shared_step_record,
    step_record,
)

__all__ = [
    "COUPLING", "KINDS", "SCHEMA", "WIRE_KINDS", "Kind", "CombineError", "ConversionError", "OutputExistsError",
    "StreamLimits",
    "PolicyIdError", "PolicySpec", "PressTerm", "Problem", "QuantTerm", "StoreError", "Stream", "StreamReader",
    "parse_option_value",
    "TraceFileError", "TraceStoreWriter",
    "assemble_stream",
    "prompt_digest", "read_stream",
    "ProtocolError", "StreamError", "StreamWriter", "TV_ZERO_ATOL", "TraceValidationError", "__version__",
    "assemble", "branch_record", "combine", "converters", "coupled_dataset", "dataset_lines", "encode_line",
    "end_record", "eos_ids", "error_record", "from_eval_logs", "from_openai_logprobs",
    "from_probabilities", "header_record", "open_traces",
    "parse_policy_id", "policy_coords", "expand_policies", "expand_policy_family", "family_key",
    "policy_families", "reference_dataset", "residual_dataset", "residual_from_probabilities",
    "reference_step_record",
    "sampling_params", "save_traces", "shared_step_record", "step_record", "validate",
    # logit traces (protocols.logit_fields)
    "LOGIT_FIELDS", "MAX_TOP_LOGPROBS", "law_summaries", "logit_vars", "wire_logits", "with_logits",
    # task answers (docs/contract.md "Answers")
    "TRACE_KINDS", "answer_variables", "answers_dataset", "scoring",
]
