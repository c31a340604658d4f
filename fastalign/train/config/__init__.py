"""The training configuration: one flat set of options named as in TRL / transformers'
``TrainingArguments``, so YAML keys and ``--name value`` flags carry over from those tools.

- ``fields``: ``TrainConfig`` (each key's doc is the comment beside its field), the values keys take, and
  ``options_from``, how an objective reads its typed options from a config once.
- ``parse``: ``load_config`` (defaults, a YAML file, then flags) and ``save_config``.
- ``checks``: the value and cross-key checks every loaded config passes (``check_config`` for one built
  in code).
- ``docs``: the keys' docs, read from the comments beside the fields (``--help`` and docs/options/).
"""

from fastalign.train.config.checks import check_config, refuse_unread
from fastalign.train.config.fields import (
    ATTN_IMPLEMENTATIONS,
    DTYPES,
    GENERATION_ENGINES,
    LR_SCHEDULERS,
    MODEL_INIT_KEYS,
    MODEL_INIT_OWN,
    OPTIMIZERS,
    REPORT_TO,
    SAMPLING_STRATEGIES,
    SHARED_DEFAULTS,
    STRATEGIES,
    ConfigError,
    TrainConfig,
    field_names,
    model_option,
    options_from,
    set_keys,
)
from fastalign.train.config.parse import load_config, save_config

__all__ = [
    "ATTN_IMPLEMENTATIONS",
    "DTYPES",
    "GENERATION_ENGINES",
    "LR_SCHEDULERS",
    "MODEL_INIT_KEYS",
    "MODEL_INIT_OWN",
    "OPTIMIZERS",
    "REPORT_TO",
    "SAMPLING_STRATEGIES",
    "SHARED_DEFAULTS",
    "STRATEGIES",
    "ConfigError",
    "TrainConfig",
    "check_config",
    "field_names",
    "load_config",
    "model_option",
    "options_from",
    "refuse_unread",
    "save_config",
    "set_keys",
]
