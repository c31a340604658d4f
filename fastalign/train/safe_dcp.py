"""Reading a ``torch.distributed.checkpoint`` (DCP) checkpoint without unpickling code.

Why: DCP keeps its ``.metadata`` as a pickle (read with ``pickle.load``) and a state's non-tensor values
(the optimizer's ``param_groups``, ...) as ``torch.save`` bytes, which its default planner loads with
``weights_only=False``. A checkpoint from anyone else (downloaded, shared storage) could then run code
at ``resume_from_checkpoint``. Here the metadata is first read by an unpickler that constructs only
DCP's own metadata classes, torch's sizes, dtypes and layouts, and paths (``check_metadata``), and the
non-tensor values are loaded with ``weights_only=True`` (``SafeLoadPlanner``): plain data and tensors.
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner

#: DCP's metadata file in a checkpoint directory (``torch.distributed.checkpoint.filesystem``'s name).
METADATA = ".metadata"
#: module → the names an unpickler of DCP metadata may construct (None: any class the module defines).
_ALLOWED = {
    "torch.distributed.checkpoint.metadata": None,
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},  # a layout looked up by its name
    "torch": {"Size"},  # and the dtypes (``_allowed``)
    "pathlib": {"Path", "PosixPath", "WindowsPath", "PurePath", "PurePosixPath", "PureWindowsPath"},
    "collections": {"OrderedDict"},
}


class UnsafeCheckpointError(ValueError):
    """A checkpoint file that would construct something other than checkpoint data when read."""


def _allowed(module: str, name: str) -> bool:
    if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
        return True
    names = _ALLOWED.get(module, set())
    if names is None:
        return isinstance(getattr(__import__(module, fromlist=[name]), name, None), type)
    return name in names


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if not _allowed(module, name):
            raise UnsafeCheckpointError(f"{module}.{name}")
        return super().find_class(module, name)


def check_metadata(directory: str | Path):
    """Read ``directory``'s DCP metadata with an unpickler that builds only checkpoint metadata: a
    one-line ``UnsafeCheckpointError`` names anything else it would construct (nothing of it runs).
    Returns it (a ``Metadata``), or None where there is none."""
    path = Path(directory) / METADATA
    try:
        with path.open("rb") as file:
            return _MetadataUnpickler(file).load()
    except UnsafeCheckpointError as error:
        raise UnsafeCheckpointError(
            f"checkpoint {Path(directory)}: {METADATA} would construct {error}, which is not checkpoint "
            "metadata: refused (unpickling it could run code)"
        ) from None
    except FileNotFoundError:
        return None
    except (pickle.UnpicklingError, EOFError, AttributeError, ImportError, ValueError) as error:
        raise UnsafeCheckpointError(
            f"checkpoint {Path(directory)}: {METADATA} cannot be read: {str(error).splitlines()[0]}"
        ) from None


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, its non-tensor values loaded with ``weights_only=True`` (plain data
    and tensors; anything else is an ``UnsafeCheckpointError``) before the default planner places them."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        data = value.read()
        try:
            torch.load(io.BytesIO(data), weights_only=True)
        except pickle.UnpicklingError as error:
            raise UnsafeCheckpointError(
                f"checkpoint value {read_item.dest_index.fqn!r} is not plain data: refused (unpickling it "
                f"could run code): {str(error).splitlines()[0]}"
            ) from None
        super().load_bytes(read_item, io.BytesIO(data))
