# SPDX-License-Identifier: Apache-2.0
"""One compressed table as a module: ``CompressedEmbeddingBag``, the pooled lookup behind
``CompressedEmbeddingBagCollection``, and the checks that a state dict's buffers form a table.

This file is written in the TorchScript subset (PEP 604 unions, builtin generics and f-strings all
script) because torchrec users ship inference models with ``torch.jit.script``.
"""

from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor, nn
from torchrec.modules.embedding_configs import DataType, PoolingType

from ibpembed import _C, layout
from ibpembed._ops import ops, pooled_dim
from ibpembed.codec import CompressedTable, HotRows, TableArgs
from ibpembed.layout import DTYPE_CODES
from ibpembed.tables.format import TableFileError, check_index

# Bumped whenever the meaning of the buffers changes, so an old state_dict is rejected with a
# clear error instead of decoding garbage.
STATE_VERSION = 1

POOLING_CODES: dict[PoolingType, int] = {
    PoolingType.SUM: layout.POOLING_CODES["sum"],
    PoolingType.MEAN: layout.POOLING_CODES["mean"],
}
TORCH_DTYPES: dict[DataType, torch.dtype] = {
    DataType.FP32: torch.float32,
    DataType.FP16: torch.float16,
    DataType.BF16: torch.bfloat16,
}
DATA_TYPES = {str(dtype).removeprefix("torch."): d for d, dtype in TORCH_DTYPES.items()}
_BUFFER_NAMES = ("payload", "block_base", "row_units", "bitmask", "mask", "bitval", "meta")
# The dtype of each table buffer (format.h; the order of CompressedTable's tensors).
_BUFFER_DTYPES = (torch.uint8, torch.int64, torch.uint8, torch.int32, torch.int64, torch.int64)
# Buffers that stay in host memory when the module moves to a GPU (see _apply).
_HOST_BUFFERS = ("payload", "hot_ids", "hot_dir", "hot_rows")
# The compact row layout the payload is in (format.h); a payload in another layout must be repacked.
LAYOUT_VERSION = int(_C.FORMAT_VERSION)
# Layout 2 is layout 3 with one-pattern codebooks: its state dicts load unchanged.
READABLE_LAYOUTS = (2, LAYOUT_VERSION)
# meta = [STATE_VERSION, LAYOUT_VERSION, chunk_bits, unit_bytes, num_rows, dim, dtype code]
_META_FIELDS = 7


class CompressedEmbeddingBag(nn.Module):
    """One compressed table with the pooling of an ``nn.EmbeddingBag`` (sum or mean).

    The compressed tensors are persistent buffers (``payload``, ``block_base``, ``row_units``,
    ``bitmask``, ``mask``, ``bitval``) plus a small int64 ``meta`` buffer holding the integers the
    decoder needs, so ``state_dict`` carries the whole table. Because the payload size depends on
    the table's contents, ``load_state_dict`` replaces the buffers instead of copying into them
    (like ``load_state_dict(assign=True)``): the module then shares memory with the state dict,
    which keeps ``torch.load(..., mmap=True)`` tables paged out until rows are read.

    Parameters
    ----------
    num_embeddings, embedding_dim : table shape.
    dtype : row dtype of the source table (float32, float16 or bfloat16).
    pooling : ``PoolingType.SUM`` or ``PoolingType.MEAN``.
    table : the compressed table; None builds an empty placeholder to ``load_state_dict`` into.
    """

    # The buffers registered in __init__ (nn.Module's __getattr__ types them as Tensor | Module;
    # TorchScript reads these annotations too, and they match what it infers).
    payload: Tensor
    block_base: Tensor
    row_units: Tensor
    bitmask: Tensor
    mask: Tensor
    bitval: Tensor
    meta: Tensor
    hot_ids: Tensor
    hot_dir: Tensor
    hot_rows: Tensor

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        dtype: torch.dtype = torch.float32,
        pooling: PoolingType = PoolingType.SUM,
        table: CompressedTable | None = None,
    ) -> None:
        super().__init__()
        if pooling not in POOLING_CODES:
            raise ValueError(f"pooling must be SUM or MEAN, got {pooling}")
        if dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise TypeError(f"pooled tables must be float32, float16 or bfloat16, got {dtype}")
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.dtype = dtype
        self.pooling_code = POOLING_CODES[pooling]
        self.dtype_code = DTYPE_CODES[dtype]
        self.row_bytes = embedding_dim * dtype.itemsize
        self.chunk_bits = 0
        self.unit_bytes = 0
        # Hot-row copies (CompressedTable.with_hot_rows): a cache, so not in the state dict.
        # Empty when off; set with set_hot_rows.
        self.register_buffer("hot_ids", torch.empty(0, dtype=torch.int64), persistent=False)
        self.register_buffer("hot_dir", torch.empty(0, dtype=torch.int64), persistent=False)
        self.register_buffer("hot_rows", torch.empty(0, 0, dtype=torch.uint8), persistent=False)
        if table is None:
            for name in _BUFFER_NAMES:
                self.register_buffer(name, torch.empty(0, dtype=torch.int64))
            return
        if (table.num_rows, table.dim, table.dtype) != (num_embeddings, embedding_dim, dtype):
            raise ValueError(
                f"compressed table is {table.num_rows}x{table.dim} {table.dtype}, expected "
                f"{num_embeddings}x{embedding_dim} {dtype}"
            )
        for name in _BUFFER_NAMES[:-1]:
            self.register_buffer(name, getattr(table, name))
        meta = [STATE_VERSION, LAYOUT_VERSION, table.chunk_bits, table.unit_bytes, table.num_rows,
                table.dim]  # fmt: skip
        self.register_buffer("meta", torch.tensor([*meta, self.dtype_code], dtype=torch.int64))
        self.chunk_bits = table.chunk_bits
        self.unit_bytes = table.unit_bytes
        self._set_hot(table.hot)

    def forward(
        self, indices: Tensor, offsets: Tensor, per_sample_weights: Tensor | None = None
    ) -> Tensor:
        """Pooled rows: [B, D] float32 for int64 ``indices`` [nnz] and ``offsets`` [B + 1].

        The op itself rejects out-of-range ids and malformed offsets; the collection checks them
        earlier so that no kernel runs for a bad batch.
        """
        if self.chunk_bits == 0:
            raise RuntimeError(
                "CompressedEmbeddingBag has no table: build it with a CompressedTable or "
                "load_state_dict into it"
            )
        tier_dir: Tensor | None = None
        tier_rows: Tensor | None = None
        if self.hot_ids.numel() > 0:
            tier_dir, tier_rows = self.hot_dir, self.hot_rows
        return ops.lookup_pooled(
            *self.op_args(),
            indices,
            offsets,
            per_sample_weights,
            self.dtype_code,
            self.pooling_code,
            tier_dir,
            tier_rows,
        )

    def op_args(self) -> TableArgs:
        """The buffers as every op takes them, as ``CompressedTable.op_args`` (scriptable)."""
        return TableArgs(
            self.payload,
            self.block_base,
            self.row_units,
            self.bitmask,
            self.mask,
            self.bitval,
            self.chunk_bits,
            self.row_bytes,
            self.unit_bytes,
            self.num_embeddings,
        )

    def _apply(self, fn: Callable[[Tensor], Tensor], recurse: bool = True) -> nn.Module:
        """Moves like any module, except that on a GPU the rows stay in host memory.

        The CUDA kernels read compressed rows zero-copy over PCIe from page-locked host memory
        and need only the index, bitmask and masks on the device, so ``.cuda()`` / ``.to(gpu)``
        pins the payload (a copy into page-locked memory, unless it is pinned already) instead
        of copying the table into GPU memory. Hot-row copies, a CPU-lookup cache the CUDA
        kernels do not read, stay on the host as well. Move the module before scripting it: a
        scripted module's ``.to()`` (and loading tensors that are already on a GPU) moves every
        buffer, the payload into GPU memory.
        """
        probe = torch.empty(0, dtype=torch.int64, device=self.block_base.device)
        # Only real host rows stay behind: a payload already on a device, or a meta placeholder
        # (to_empty), moves like any buffer.
        if fn(probe).device.type != "cuda" or self.payload.device.type != "cpu":
            return super()._apply(fn, recurse)
        host = {name: self._buffers.pop(name) for name in _HOST_BUFFERS}
        try:
            super()._apply(fn, recurse)
        finally:
            self._buffers.update(host)
        if not self.payload.is_pinned():
            self._buffers["payload"] = self.payload.pin_memory()
        return self

    @torch.jit.unused
    def set_hot_rows(self, ids: Tensor) -> int:
        """Keep decoded copies of rows ``ids`` for CPU lookups (replacing earlier ones; empty
        ``ids`` drops them); see ``CompressedTable.with_hot_rows``. Returns the rows cached.

        CPU modules only: the CUDA kernels decode every row on the GPU and ignore the tier.
        """
        if self.block_base.device.type != "cpu":
            raise RuntimeError(
                "a decoded tier serves CPU lookups; this table's index is on "
                f"{self.block_base.device}"
            )
        hot = self.compressed_table().with_hot_rows(ids).hot
        self._set_hot(hot)
        return 0 if hot is None else hot.count

    def _set_hot(self, hot: HotRows | None) -> None:
        if hot is None:
            self.hot_ids = torch.empty(0, dtype=torch.int64)
            self.hot_dir = torch.empty(0, dtype=torch.int64)
            self.hot_rows = torch.empty(0, 0, dtype=torch.uint8)
        else:
            self.hot_ids, self.hot_dir, self.hot_rows = hot.ids, hot.directory, hot.rows

    def compressed_table(self) -> CompressedTable:
        """The buffers as a ``CompressedTable`` (for ``gather``, ``decompress`` and sizes)."""
        if self.chunk_bits == 0:
            raise RuntimeError("CompressedEmbeddingBag has no table yet")
        hot = None
        if self.hot_ids.numel() > 0:
            hot = HotRows(self.hot_ids, self.hot_dir, self.hot_rows)
        return CompressedTable(
            payload=self.payload,
            block_base=self.block_base,
            row_units=self.row_units,
            bitmask=self.bitmask,
            mask=self.mask,
            bitval=self.bitval,
            chunk_bits=self.chunk_bits,
            num_rows=self.num_embeddings,
            dim=self.embedding_dim,
            dtype=self.dtype,
            unit_bytes=self.unit_bytes,
            hot=hot,
        )

    def _load_from_state_dict(
        self,
        state_dict: dict[str, Tensor],
        prefix: str,
        local_metadata: dict,
        strict: bool,
        missing_keys: list[str],
        unexpected_keys: list[str],
        error_msgs: list[str],
    ) -> None:
        # NOTE: nn.Module's loader copies into same-shaped buffers; a compressed payload's size
        # depends on the table's contents, so the buffers are replaced instead.
        present = {
            name: state_dict[prefix + name] for name in _BUFFER_NAMES if prefix + name in state_dict
        }
        missing_keys.extend(prefix + name for name in _BUFFER_NAMES if name not in present)
        if strict:
            unexpected_keys.extend(
                key
                for key in state_dict
                if key.startswith(prefix)
                and "." not in key[len(prefix) :]
                and key[len(prefix) :] not in _BUFFER_NAMES
            )
        if len(present) != len(_BUFFER_NAMES):
            return
        meta = present["meta"]
        if meta.dtype != torch.int64 or meta.numel() != _META_FIELDS:
            error_msgs.append(f"{prefix}meta: expected {_META_FIELDS} int64 values")
            return
        version, layout, chunk_bits, unit_bytes, num_rows, dim, dtype_code = meta.tolist()
        if version != STATE_VERSION:
            error_msgs.append(
                f"{prefix}meta: state version {version} is not supported (this build reads "
                f"version {STATE_VERSION})"
            )
            return
        if layout not in READABLE_LAYOUTS:
            error_msgs.append(
                f"{prefix}meta: rows are in compact layout version {layout}, this build decodes "
                f"versions {READABLE_LAYOUTS}; compress the table again"
            )
            return
        expected = (self.num_embeddings, self.embedding_dim, self.dtype_code)
        if (num_rows, dim, dtype_code) != expected:
            error_msgs.append(
                f"{prefix}meta: state holds a {num_rows}x{dim} table of dtype code {dtype_code}, "
                f"this module expects {expected[0]}x{expected[1]} of dtype code {expected[2]}"
            )
            return
        problem = _table_problem(present, chunk_bits, unit_bytes, num_rows, dim, self.dtype)
        if problem is not None:
            error_msgs.append(f"{prefix}{problem}")
            return
        for name, tensor in present.items():
            self._buffers[name] = tensor.detach()
        self.chunk_bits = chunk_bits
        self.unit_bytes = unit_bytes
        self._set_hot(None)  # copies of the previous rows

    def extra_repr(self) -> str:
        pooling = "sum" if self.pooling_code == POOLING_CODES[PoolingType.SUM] else "mean"
        return f"{self.num_embeddings}, {self.embedding_dim}, dtype={self.dtype}, mode={pooling}"


# The table arguments that come from meta (row_bytes through its dim and dtype): a problem with
# one of them is meta's.
_META_INTS = ("chunk_bits", "unit_bytes", "row_bytes", "num_rows")


def _table_problem(
    buffers: dict[str, Tensor],
    chunk_bits: int,
    unit_bytes: int,
    num_rows: int,
    dim: int,
    dtype: torch.dtype,
) -> str | None:
    """Why ``buffers`` (a state dict's, meta's ints) do not form a table the decoder can read,
    starting with the name of the buffer at fault; None when they do.

    The checks are the codec's: the op's own (dtypes, shapes, masks and codebooks, the index
    against the payload) on the candidate tensors, then the loader's structural checks of the
    index (``ibpembed.tables.format``), so a bad state dict fails here, not at the first forward.
    """
    for name, expected in zip(_BUFFER_NAMES[:-1], _BUFFER_DTYPES, strict=True):
        tensor = buffers[name]
        if tensor.dtype != expected or tensor.dim() != 1:
            shape = list(tensor.shape)
            return f"{name}: expected a 1-D {expected} tensor, got {tensor.dtype} of shape {shape}"
    # The checks run on the host (the tensors of a GPU module's state dict are copied there,
    # except the payload: only its size is checked, and a host payload is not read).
    host = {name: buffers[name].cpu() for name in _BUFFER_NAMES[1:-1]}
    row_bytes = dim * dtype.itemsize
    shape_problem = _C.table_shape_problem(
        **host, chunk_bits=chunk_bits, row_bytes=row_bytes, unit_bytes=unit_bytes,
        num_rows=num_rows,
    )  # fmt: skip
    if shape_problem is not None:
        arg, problem = shape_problem  # e.g. ("row_units", "row_units must have 1024 entries, ...")
        return f"meta: {problem}" if arg in _META_INTS else problem
    payload = buffers["payload"]
    if payload.device.type != "cpu":
        if not payload.is_contiguous():
            return "payload: must be contiguous"
        payload = torch.empty(payload.numel(), dtype=torch.uint8)
    table = CompressedTable(
        payload=payload, block_base=host["block_base"], row_units=host["row_units"],
        bitmask=host["bitmask"], mask=host["mask"], bitval=host["bitval"], chunk_bits=chunk_bits,
        num_rows=num_rows, dim=dim, dtype=dtype, unit_bytes=unit_bytes,
    )  # fmt: skip
    try:
        table.gather(torch.empty(0, dtype=torch.int64))  # checks the table, reads no row
        if num_rows > 0:
            check_index(Path("state dict"), table)
    except TableFileError as exc:
        return f"{exc.section}: {exc.problem}"
    except (ValueError, RuntimeError) as exc:
        # The op's checks past the shapes (contiguity, masks within the chunk width, the index
        # against the payload) name the buffer at fault; the first line is the message.
        return str(exc).splitlines()[0]
    return None


# -- one op for a whole collection's forward --------------------------------------------------
#
# Every check that reads the ids or lengths, and the per-key slicing their values decide, lives
# inside this op, so a graph of the collection (torch.export, torch.compile(fullgraph=True),
# torch.fx) holds one opaque node whose fake kernel states the output shape, instead of
# data-dependent control flow no single graph can hold. Defined in Python (the checks raise the
# collection's Python errors), it dispatches like any op: TorchScript and exported programs call
# it once ``ibpembed.torchrec`` is imported.
torch.library.define(
    "ibpembed::pooled_collection",
    "(Tensor[] payload, Tensor[] block_base, Tensor[] row_units, Tensor[] bitmask, "
    "Tensor[] mask, Tensor[] bitval, Tensor[] hot_dir, Tensor[] hot_rows, int[] chunk_bits, "
    "int[] row_bytes, int[] unit_bytes, int[] num_rows, int[] dtype, int[] pooling, "
    "Tensor values, Tensor lengths, Tensor? weights, SymInt stride, int num_keys, "
    "int[] output_key, int[] output_table, str[] feature_names, str[] table_names) -> Tensor",
)

_NO_LIMIT = 9223372036854775807  # ids of keys no table reads are never out of range


def _pooled_collection(
    payload: list[Tensor],
    block_base: list[Tensor],
    row_units: list[Tensor],
    bitmask: list[Tensor],
    mask: list[Tensor],
    bitval: list[Tensor],
    hot_dir: list[Tensor],
    hot_rows: list[Tensor],
    chunk_bits: list[int],
    row_bytes: list[int],
    unit_bytes: list[int],
    num_rows: list[int],
    dtype: list[int],
    pooling: list[int],
    values: Tensor,
    lengths: Tensor,
    weights: Tensor | None,
    stride: int,
    num_keys: int,
    output_key: list[int],
    output_table: list[int],
    feature_names: list[str],
    table_names: list[str],
) -> Tensor:
    """Pooled [stride, sum of dims] fp32: output j pools KJT key ``output_key[j]`` with table
    ``output_table[j]``. The whole batch is checked before any kernel runs."""
    if lengths.dim() != 1:
        raise ValueError(f"KJT lengths must be 1-D (keys x batch), got shape {list(lengths.shape)}")
    if lengths.numel() != num_keys * stride:
        raise ValueError(
            f"KJT lengths has {lengths.numel()} entries, expected {num_keys} keys x "
            f"batch {stride} = {num_keys * stride}"
        )
    if lengths.numel() > 0 and int(lengths.min()) < 0:
        raise ValueError(f"KJT lengths must be non-negative, got {int(lengths.min())}")
    total = int(lengths.sum()) if lengths.numel() > 0 else 0
    if total != values.numel():
        raise ValueError(f"KJT lengths sum to {total} but there are {values.numel()} values")
    if weights is not None and weights.numel() != values.numel():
        raise ValueError(f"KJT has {weights.numel()} weights for {values.numel()} values")
    per_key = [0] * num_keys
    if stride > 0:
        per_key = lengths.view(num_keys, stride).sum(1).tolist()
    offsets = [0]
    for n in per_key:
        offsets.append(offsets[-1] + n)
    if values.numel() > 0:
        # One pass over all ids against each key's limit; the loop only names the culprit.
        limits = [_NO_LIMIT] * num_keys
        for k, t in zip(output_key, output_table, strict=True):
            limits[k] = min(limits[k], num_rows[t])
        per_id_limit = torch.repeat_interleave(
            torch.tensor(limits, dtype=torch.int64, device=values.device),
            torch.tensor(per_key, dtype=torch.int64, device=values.device),
        )
        if bool(((values < 0) | (values >= per_id_limit)).any()):
            for j, (k, t) in enumerate(zip(output_key, output_table, strict=True)):
                ids = values[offsets[k] : offsets[k + 1]]
                bad = (ids < 0) | (ids >= num_rows[t])
                if ids.numel() > 0 and bool(bad.any()):
                    pos = int(torch.nonzero(bad)[0, 0])
                    raise IndexError(
                        f"feature '{feature_names[j]}' (table '{table_names[t]}'): id "
                        f"{int(ids[pos])} at position {pos} is out of range for a table of "
                        f"{num_rows[t]} rows"
                    )
    # Every key's bag offsets at once ([keys, B + 1]): the per-feature tensor ops of a batch
    # cost more than its lookups on small tables.
    per_bag = lengths.reshape(num_keys, stride)
    bag_offsets = torch.cat([per_bag.new_zeros(num_keys, 1), per_bag.cumsum(1)], dim=1)
    pooled = []
    for k, t in zip(output_key, output_table, strict=True):
        start, end = offsets[k], offsets[k + 1]
        bag_weights = None if weights is None else weights[start:end]
        hot = hot_rows[t].numel() > 0  # a tier of every row has an empty directory
        pooled.append(
            ops.lookup_pooled(
                payload[t],
                block_base[t],
                row_units[t],
                bitmask[t],
                mask[t],
                bitval[t],
                chunk_bits[t],
                row_bytes[t],
                unit_bytes[t],
                num_rows[t],
                values[start:end],
                bag_offsets[k],
                bag_weights,
                dtype[t],
                pooling[t],
                hot_dir[t] if hot else None,
                hot_rows[t] if hot else None,
            )
        )
    if not pooled:
        return values.new_empty((stride, 0), dtype=torch.float32)
    return torch.cat(pooled, dim=1)


for _device in ("cpu", "cuda"):
    torch.library.impl("ibpembed::pooled_collection", _device)(_pooled_collection)


@torch.library.register_fake("ibpembed::pooled_collection")
def _pooled_collection_fake(
    payload,
    block_base,
    row_units,
    bitmask,
    mask,
    bitval,
    hot_dir,
    hot_rows,
    chunk_bits,
    row_bytes,
    unit_bytes,
    num_rows,
    dtype,
    pooling,
    values,
    lengths,
    weights,
    stride,
    num_keys,
    output_key,
    output_table,
    feature_names,
    table_names,
) -> Tensor:
    torch._check(lengths.shape[0] == num_keys * stride)
    width = sum(pooled_dim(dtype[t], row_bytes[t]) for t in output_table)
    return block_base[0].new_empty((stride, width), dtype=torch.float32)
