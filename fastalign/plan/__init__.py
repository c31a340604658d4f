"""The memory planner behind ``fastalign plan``: GPU and host memory of a training run, term by term,
from the model's shapes and what the engine keeps (see ``fastalign.plan.planner``)."""

from fastalign.plan.planner import (
    CUDA_CONTEXT_BYTES,
    METHODS,
    MemoryPlan,
    Term,
    bits_per_param,
    format_bytes,
    longest_sequence,
    parse_memory,
    plan_memory,
)
from fastalign.plan.shapes import (
    BUILTIN_SHAPES,
    ModelShape,
    PlanError,
    builtin_config,
    load_config,
    resolve_model,
    shape_from_config,
    shape_names,
)

__all__ = [
    "BUILTIN_SHAPES",
    "CUDA_CONTEXT_BYTES",
    "METHODS",
    "MemoryPlan",
    "ModelShape",
    "PlanError",
    "Term",
    "bits_per_param",
    "builtin_config",
    "format_bytes",
    "load_config",
    "longest_sequence",
    "parse_memory",
    "plan_memory",
    "resolve_model",
    "shape_from_config",
    "shape_names",
]
