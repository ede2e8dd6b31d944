from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Pooling(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    POOLING_UNSPECIFIED: _ClassVar[Pooling]
    POOLING_SUM: _ClassVar[Pooling]
    POOLING_MEAN: _ClassVar[Pooling]
    POOLING_NONE: _ClassVar[Pooling]

class DType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DTYPE_UNSPECIFIED: _ClassVar[DType]
    DTYPE_FLOAT32: _ClassVar[DType]
    DTYPE_FLOAT16: _ClassVar[DType]
    DTYPE_BFLOAT16: _ClassVar[DType]
    DTYPE_UINT8: _ClassVar[DType]
    DTYPE_INT8: _ClassVar[DType]
    DTYPE_INT32: _ClassVar[DType]
    DTYPE_INT64: _ClassVar[DType]

class RegionKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    REGION_KIND_UNSPECIFIED: _ClassVar[RegionKind]
    REGION_KIND_SYSTEM_SHM: _ClassVar[RegionKind]
    REGION_KIND_CUDA_IPC: _ClassVar[RegionKind]
POOLING_UNSPECIFIED: Pooling
POOLING_SUM: Pooling
POOLING_MEAN: Pooling
POOLING_NONE: Pooling
DTYPE_UNSPECIFIED: DType
DTYPE_FLOAT32: DType
DTYPE_FLOAT16: DType
DTYPE_BFLOAT16: DType
DTYPE_UINT8: DType
DTYPE_INT8: DType
DTYPE_INT32: DType
DTYPE_INT64: DType
REGION_KIND_UNSPECIFIED: RegionKind
REGION_KIND_SYSTEM_SHM: RegionKind
REGION_KIND_CUDA_IPC: RegionKind

class FeatureInput(_message.Message):
    __slots__ = ("name", "ids", "lengths", "weights")
    NAME_FIELD_NUMBER: _ClassVar[int]
    IDS_FIELD_NUMBER: _ClassVar[int]
    LENGTHS_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    name: str
    ids: bytes
    lengths: bytes
    weights: bytes
    def __init__(self, name: _Optional[str] = ..., ids: _Optional[bytes] = ..., lengths: _Optional[bytes] = ..., weights: _Optional[bytes] = ...) -> None: ...

class LookupRequest(_message.Message):
    __slots__ = ("request_id", "pooling", "features", "output_dtype", "output_region", "input_region", "table_version")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    POOLING_FIELD_NUMBER: _ClassVar[int]
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_DTYPE_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_REGION_FIELD_NUMBER: _ClassVar[int]
    INPUT_REGION_FIELD_NUMBER: _ClassVar[int]
    TABLE_VERSION_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    pooling: Pooling
    features: _containers.RepeatedCompositeFieldContainer[FeatureInput]
    output_dtype: DType
    output_region: OutputRegion
    input_region: InputRegion
    table_version: int
    def __init__(self, request_id: _Optional[str] = ..., pooling: _Optional[_Union[Pooling, str]] = ..., features: _Optional[_Iterable[_Union[FeatureInput, _Mapping]]] = ..., output_dtype: _Optional[_Union[DType, str]] = ..., output_region: _Optional[_Union[OutputRegion, _Mapping]] = ..., input_region: _Optional[_Union[InputRegion, _Mapping]] = ..., table_version: _Optional[int] = ...) -> None: ...

class OutputRegion(_message.Message):
    __slots__ = ("name", "offset", "byte_size")
    NAME_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    BYTE_SIZE_FIELD_NUMBER: _ClassVar[int]
    name: str
    offset: int
    byte_size: int
    def __init__(self, name: _Optional[str] = ..., offset: _Optional[int] = ..., byte_size: _Optional[int] = ...) -> None: ...

class InputRegion(_message.Message):
    __slots__ = ("name", "offset", "num_ids", "batch_sizes", "weighted")
    NAME_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    NUM_IDS_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZES_FIELD_NUMBER: _ClassVar[int]
    WEIGHTED_FIELD_NUMBER: _ClassVar[int]
    name: str
    offset: int
    num_ids: _containers.RepeatedScalarFieldContainer[int]
    batch_sizes: _containers.RepeatedScalarFieldContainer[int]
    weighted: bool
    def __init__(self, name: _Optional[str] = ..., offset: _Optional[int] = ..., num_ids: _Optional[_Iterable[int]] = ..., batch_sizes: _Optional[_Iterable[int]] = ..., weighted: _Optional[bool] = ...) -> None: ...

class FeatureOutput(_message.Message):
    __slots__ = ("name", "dtype", "shape", "values", "region_offset")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    REGION_OFFSET_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: DType
    shape: _containers.RepeatedScalarFieldContainer[int]
    values: bytes
    region_offset: int
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[_Union[DType, str]] = ..., shape: _Optional[_Iterable[int]] = ..., values: _Optional[bytes] = ..., region_offset: _Optional[int] = ...) -> None: ...

class Error(_message.Message):
    __slots__ = ("code", "message")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    code: int
    message: str
    def __init__(self, code: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...

class LookupResponse(_message.Message):
    __slots__ = ("request_id", "features", "table_version", "error")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    TABLE_VERSION_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    features: _containers.RepeatedCompositeFieldContainer[FeatureOutput]
    table_version: int
    error: Error
    def __init__(self, request_id: _Optional[str] = ..., features: _Optional[_Iterable[_Union[FeatureOutput, _Mapping]]] = ..., table_version: _Optional[int] = ..., error: _Optional[_Union[Error, _Mapping]] = ...) -> None: ...

class ListTablesRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListTablesResponse(_message.Message):
    __slots__ = ("tables", "table_version", "versions_held")
    TABLES_FIELD_NUMBER: _ClassVar[int]
    TABLE_VERSION_FIELD_NUMBER: _ClassVar[int]
    VERSIONS_HELD_FIELD_NUMBER: _ClassVar[int]
    tables: _containers.RepeatedCompositeFieldContainer[TableInfo]
    table_version: int
    versions_held: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, tables: _Optional[_Iterable[_Union[TableInfo, _Mapping]]] = ..., table_version: _Optional[int] = ..., versions_held: _Optional[_Iterable[int]] = ...) -> None: ...

class RegisterRegionRequest(_message.Message):
    __slots__ = ("name", "kind", "shm_name", "offset", "byte_size", "cuda_ipc_handle", "device_id", "nonce")
    NAME_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    SHM_NAME_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    BYTE_SIZE_FIELD_NUMBER: _ClassVar[int]
    CUDA_IPC_HANDLE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_ID_FIELD_NUMBER: _ClassVar[int]
    NONCE_FIELD_NUMBER: _ClassVar[int]
    name: str
    kind: RegionKind
    shm_name: str
    offset: int
    byte_size: int
    cuda_ipc_handle: bytes
    device_id: int
    nonce: bytes
    def __init__(self, name: _Optional[str] = ..., kind: _Optional[_Union[RegionKind, str]] = ..., shm_name: _Optional[str] = ..., offset: _Optional[int] = ..., byte_size: _Optional[int] = ..., cuda_ipc_handle: _Optional[bytes] = ..., device_id: _Optional[int] = ..., nonce: _Optional[bytes] = ...) -> None: ...

class ChallengeRegionRequest(_message.Message):
    __slots__ = ("shm_name", "offset")
    SHM_NAME_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    shm_name: str
    offset: int
    def __init__(self, shm_name: _Optional[str] = ..., offset: _Optional[int] = ...) -> None: ...

class ChallengeRegionResponse(_message.Message):
    __slots__ = ("nonce", "expires_in_s")
    NONCE_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_IN_S_FIELD_NUMBER: _ClassVar[int]
    nonce: bytes
    expires_in_s: int
    def __init__(self, nonce: _Optional[bytes] = ..., expires_in_s: _Optional[int] = ...) -> None: ...

class RegisterRegionResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class UnregisterRegionRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class UnregisterRegionResponse(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: int
    def __init__(self, released: _Optional[int] = ...) -> None: ...

class ListRegionsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RegionInfo(_message.Message):
    __slots__ = ("name", "kind", "shm_name", "offset", "byte_size")
    NAME_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    SHM_NAME_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    BYTE_SIZE_FIELD_NUMBER: _ClassVar[int]
    name: str
    kind: RegionKind
    shm_name: str
    offset: int
    byte_size: int
    def __init__(self, name: _Optional[str] = ..., kind: _Optional[_Union[RegionKind, str]] = ..., shm_name: _Optional[str] = ..., offset: _Optional[int] = ..., byte_size: _Optional[int] = ...) -> None: ...

class ListRegionsResponse(_message.Message):
    __slots__ = ("regions",)
    REGIONS_FIELD_NUMBER: _ClassVar[int]
    regions: _containers.RepeatedCompositeFieldContainer[RegionInfo]
    def __init__(self, regions: _Optional[_Iterable[_Union[RegionInfo, _Mapping]]] = ...) -> None: ...

class DescribeTableRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class TableInfo(_message.Message):
    __slots__ = ("name", "num_rows", "dim", "dtype", "quant", "raw_bytes", "stored_bytes", "chunk_bits", "version", "row_start", "row_end", "features")
    NAME_FIELD_NUMBER: _ClassVar[int]
    NUM_ROWS_FIELD_NUMBER: _ClassVar[int]
    DIM_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    QUANT_FIELD_NUMBER: _ClassVar[int]
    RAW_BYTES_FIELD_NUMBER: _ClassVar[int]
    STORED_BYTES_FIELD_NUMBER: _ClassVar[int]
    CHUNK_BITS_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    ROW_START_FIELD_NUMBER: _ClassVar[int]
    ROW_END_FIELD_NUMBER: _ClassVar[int]
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    name: str
    num_rows: int
    dim: int
    dtype: DType
    quant: str
    raw_bytes: int
    stored_bytes: int
    chunk_bits: int
    version: int
    row_start: int
    row_end: int
    features: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, name: _Optional[str] = ..., num_rows: _Optional[int] = ..., dim: _Optional[int] = ..., dtype: _Optional[_Union[DType, str]] = ..., quant: _Optional[str] = ..., raw_bytes: _Optional[int] = ..., stored_bytes: _Optional[int] = ..., chunk_bits: _Optional[int] = ..., version: _Optional[int] = ..., row_start: _Optional[int] = ..., row_end: _Optional[int] = ..., features: _Optional[_Iterable[str]] = ...) -> None: ...
