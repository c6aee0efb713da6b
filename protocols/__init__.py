"""protocols: the ``kvdiv.trace/1`` contract (xarray layout, wire records, validation,
I/O, combining and converters); see docs/contract.md.

Depends on numpy, xarray, h5netcdf, zarr and click; never imports torch, divstats or
gen_service.
"""

from importlib.metadata import PackageNotFoundError, version

try:  # one version source: the installed distribution's metadata
    __version__ = version("kvdiv")
except PackageNotFoundError:  # a source tree that was never installed
    __version__ = "0+unknown"

from protocols import converters
from protocols.assemble import StreamError, assemble
from protocols.combine import CombineError, combine
from protocols.converters import ConversionError, from_eval_logs, from_probabilities, residual_from_probabilities
from protocols.io import open_traces, save_traces
from protocols.policies import PolicyIdError, PolicySpec, parse_policy_id, policy_coords
from protocols.schema import (
    COUPLING,
    KINDS,
    SCHEMA,
    coupled_dataset,
    reference_dataset,
    residual_dataset,
    sampling_params,
)
from protocols.store import StoreError, TraceStoreWriter
from protocols.validate import TV_ZERO_ATOL, Problem, TraceValidationError, validate
from protocols.wire import (
    StreamWriter,
    branch_record,
    dataset_lines,
    encode_line,
    end_record,
    error_record,
    header_record,
    shared_step_record,
    step_record,
)

