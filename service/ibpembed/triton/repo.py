# SPDX-License-Identifier: Apache-2.0
"""Writing a Triton model repository that serves a packed table set (``ibpembed triton-repo``).

Layout, for a model named ``ibpembed``::

    REPO/ibpembed/config.pbtxt          inputs and outputs per feature, pooling, device
    REPO/ibpembed/<N>/model.py          imports ibpembed.triton.model (the Python-backend model)
    REPO/ibpembed/<N>/table_set.json    {"tables": "<table set directory>"}

Triton model version N serves the table set that ``<N>/table_set.json`` names: adding a table
set as version N+1 (``--version``) and letting Triton load it (``--model-control-mode=poll`` or
a load request) rolls the model over to the new tables, the way Triton rolls any model over
(``version_policy``: the latest version by default). Every version shares the one config, so a
new table set must have the same features, dims and dtypes; a table set that changes them is a
new model (another ``--name``).

Per feature ``f`` the model takes ``f__ids`` (INT64 [-1], samples back to back), ``f__lengths``
(INT32 [-1], ids per sample) and, optionally, ``f__weights`` (FP32 [-1]), and answers
``f__pooled`` (FP32 [B, D]) for SUM / MEAN or ``f__rows`` ([nnz, D] in the table's dtype, bit
for bit) for NONE. Every input is optional in the config, so a request may carry any subset of
the features; the model itself names a missing ``__ids`` or ``__lengths`` input.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from ibpembed.tables.manifest import Manifest, read_manifest

POOLINGS = ("sum", "mean", "none")
# The table dtypes Triton has a type for (pooling NONE returns rows in these).
TRITON_DTYPES: dict[str, str] = {
    "float32": "TYPE_FP32",
    "float16": "TYPE_FP16",
    "bfloat16": "TYPE_BF16",
    "uint8": "TYPE_UINT8",
    "int8": "TYPE_INT8",
    "int32": "TYPE_INT32",
    "int64": "TYPE_INT64",
}
FLOAT_DTYPES = ("float32", "float16", "bfloat16")
# fbgemm row-wise int8 rows start with an fp16 scale and bias; pooling drops them.
INT8_ROWWISE_HEADER_BYTES = 4
TABLE_SET_FILE = "table_set.json"
MODEL_FILE = "model.py"
CONFIG_FILE = "config.pbtxt"

MODEL_PY = """\
# Written by `ibpembed triton-repo`. The model is ibpembed.triton.model.TritonPythonModel: it
# loads the table set this version's table_set.json names, with the same TableStore and
# LookupEngine as `ibpembed serve`. Triton needs ibpembed importable (see deploy/triton/).
import os
import sys

# Triton's Python stub starts its interpreter without applying PYTHONPATH: put those entries
# first here, so an ibpembed outside site-packages (a checkout, a mounted volume) is the one used.
for _entry in reversed(os.environ.get("PYTHONPATH", "").split(os.pathsep)):
    if _entry and _entry not in sys.path[:1]:
        sys.path.insert(0, _entry)

from ibpembed.triton.model import TritonPythonModel  # noqa: E402

__all__ = ["TritonPythonModel"]
"""


class RepositoryError(ValueError):
    """A table set that cannot be served as asked, or a repository it does not fit."""


def check_model_name(name: str) -> str:
    """``name`` if it is one directory name; a RepositoryError otherwise, since the model's
    directory is ``REPO/name``: a separator or ``..`` would write outside the repository."""
    if name in ("", ".", "..") or Path(name).name != name:
        raise RepositoryError(
            f"model name must be one directory name (no path separator, not '.' or '..'), "
            f"got {name!r}"
        )
    return name


@dataclass(frozen=True)
class FeatureIO:
    """One feature's tensors in the model's config.

    Attributes
    ----------
    feature, table : the feature and the table that serves it.
    dim : width of each output row (a pooled row-wise int8 row loses its 4 header bytes).
    dtype : the output's dtype name (``float32`` when pooled, the table's for NONE).
    """

    feature: str
    table: str
    dim: int
    dtype: str

    @property
    def ids(self) -> str:
        return f"{self.feature}__ids"

    @property
    def lengths(self) -> str:
        return f"{self.feature}__lengths"

    @property
    def weights(self) -> str:
        return f"{self.feature}__weights"

    def output(self, pooling: str) -> str:
        return f"{self.feature}__rows" if pooling == "none" else f"{self.feature}__pooled"


def poolable(dtype: str, quant: str | None) -> bool:
    """Whether rows of this kind pool to float32 (int4 and plain int8 rows are bytes)."""
    return dtype in FLOAT_DTYPES or quant == "int8_rowwise"


def feature_ios(
    manifest: Manifest, pooling: str, features: Sequence[str] | None = None
) -> list[FeatureIO]:
    """The features a model over ``manifest`` serves, sorted by name.

    ``features`` None: every feature whose table can answer ``pooling``. Named features must
    exist and be able to.

    Raises
    ------
    RepositoryError
        for an unknown feature or one whose table cannot be pooled.
    """
    if pooling not in POOLINGS:
        raise RepositoryError(f"pooling must be one of {POOLINGS}, got {pooling!r}")
    wanted = sorted(manifest.features) if features is None else list(features)
    ios = []
    for feature in wanted:
        if feature not in manifest.features:
            raise RepositoryError(
                f"feature '{feature}' is not in the table set (it has {sorted(manifest.features)})"
            )
        table = manifest.features[feature]
        entry = manifest.tables[table]
        if pooling == "none":
            if entry.dtype not in TRITON_DTYPES:
                raise RepositoryError(f"table '{table}': no Triton type for dtype {entry.dtype}")
            ios.append(FeatureIO(feature, table, entry.dim, entry.dtype))
            continue
        if not poolable(entry.dtype, entry.quant):
            if features is None:
                continue  # raw-byte tables (int4, plain int8) only answer NONE
            raise RepositoryError(
                f"feature '{feature}': table '{table}' holds {entry.dtype} rows "
                f"(quant={entry.quant}), which cannot be pooled; use --pooling none"
            )
        header = INT8_ROWWISE_HEADER_BYTES if entry.quant == "int8_rowwise" else 0
        ios.append(FeatureIO(feature, table, entry.dim - header, "float32"))
    if not ios:
        raise RepositoryError(f"the table set has no feature a {pooling!r} model can serve")
    return sorted(ios, key=lambda io: io.feature)


def render_config(
    name: str, ios: Sequence[FeatureIO], pooling: str, device: str = "cpu", instances: int = 1
) -> str:
    """The model's ``config.pbtxt`` (Triton's protobuf text format)."""
    inputs = []
    outputs = []
    for io in ios:
        for input_name, dtype in ((io.ids, "TYPE_INT64"), (io.lengths, "TYPE_INT32"),
                                  (io.weights, "TYPE_FP32")):  # fmt: skip
            inputs.append(
                f'  {{ name: "{input_name}" data_type: {dtype} dims: [ -1 ] optional: true }}'
            )
        outputs.append(
            f'  {{ name: "{io.output(pooling)}" data_type: {TRITON_DTYPES[io.dtype]} '
            f"dims: [ -1, {io.dim} ] }}"
        )
    kind = "KIND_GPU" if device.startswith("cuda") else "KIND_CPU"
    sep = ",\n"
    return f"""# Written by `ibpembed triton-repo`; every version of this model shares it.
name: "{name}"
backend: "python"
# Requests carry whole jagged batches (ids back to back, lengths per sample): Triton must not
# add a batch dimension of its own.
max_batch_size: 0
input [
{sep.join(inputs)}
]
output [
{sep.join(outputs)}
]
instance_group [ {{ kind: {kind} count: {instances} }} ]
parameters [
  {{ key: "pooling" value: {{ string_value: "{pooling}" }} }},
  {{ key: "device" value: {{ string_value: "{device}" }} }}
]
version_policy: {{ latest: {{ num_versions: 1 }} }}
"""


def write_repository(
    tables: str | os.PathLike[str],
    output: str | os.PathLike[str],
    *,
    name: str = "ibpembed",
    version: int | None = None,
    pooling: str = "sum",
    device: str = "cpu",
    instances: int = 1,
    features: Sequence[str] | None = None,
) -> Path:
    """Add table set ``tables`` to model ``name`` of Triton repository ``output``.

    Parameters
    ----------
    tables : a packed table set (``ibpembed pack``); recorded by absolute path (mount it at
        the same path where Triton runs, or edit ``table_set.json``: a relative path there is
        read relative to the version directory).
    version : the Triton model version; default one past the highest present (1 when new).
    pooling : ``sum``, ``mean`` or ``none``: the model's pooling (requests may switch between
        sum and mean with a ``pooling`` request parameter; the output dtype is fixed).
    device : ``cpu`` or ``cuda[:k]`` for the engine.
    instances : model instances (each loads the table set memory-mapped; the pages are shared).
    features : the features to serve; default all that ``pooling`` can answer.

    Returns
    -------
    The version directory written.

    Raises
    ------
    RepositoryError
        for a ``tables`` that is not a directory, a ``name`` that is not one directory name, a
        version that exists already, or a table set whose features, dims or dtypes differ from
        the config earlier versions were written with.
    TableSetError
        for a directory that is not a table set.
    """
    check_model_name(name)
    if instances < 1:
        raise RepositoryError(f"instances must be >= 1, got {instances}")
    source = Path(tables).resolve()
    if not source.is_dir():  # else read as a table set without a manifest: a misleading error
        what = "not a directory" if source.exists() else "no such directory"
        raise RepositoryError(f"{tables}: {what}")
    manifest = read_manifest(source)
    ios = feature_ios(manifest, pooling, features)
    config = render_config(name, ios, pooling, device, instances)
    model_dir = Path(output) / name
    config_path = model_dir / CONFIG_FILE
    existing = sorted(int(p.name) for p in model_dir.glob("*") if p.is_dir() and p.name.isdigit())
    if config_path.exists() and config_path.read_text() != config:
        raise RepositoryError(
            f"{config_path} was written for other features, dims, dtypes or settings than "
            f"{source} gives: serve this table set as another model (--name)"
        )
    if version is None:
        version = existing[-1] + 1 if existing else 1
    if version < 1:
        raise RepositoryError(f"version must be >= 1, got {version}")
    version_dir = model_dir / str(version)
    if version_dir.exists():
        raise RepositoryError(f"{version_dir} exists already")
    version_dir.mkdir(parents=True)
    config_path.write_text(config)
    (version_dir / MODEL_FILE).write_text(MODEL_PY)
    (version_dir / TABLE_SET_FILE).write_text(json.dumps({"tables": str(source)}, indent=1) + "\n")
    return version_dir


def table_set_of(version_dir: str | os.PathLike[str]) -> Path:
    """The table set a version directory serves (its ``table_set.json``).

    Raises
    ------
    RepositoryError
        when the file is missing or malformed.
    """
    path = Path(version_dir) / TABLE_SET_FILE
    try:
        body = json.loads(path.read_text())
        tables = body["tables"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise RepositoryError(f"{path}: cannot read the table set's location ({exc})") from None
    if not isinstance(tables, str):
        raise RepositoryError(f"{path}: 'tables' must be a path, got {tables!r}")
    return Path(version_dir) / tables  # an absolute path replaces the version directory
