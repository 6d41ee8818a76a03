from pergrad.v1 import tensor_pb2 as _tensor_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Reduction(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    REDUCTION_NONE: _ClassVar[Reduction]
    REDUCTION_NORMS: _ClassVar[Reduction]
    REDUCTION_CLIPPED_SUM: _ClassVar[Reduction]
    REDUCTION_MOMENTS: _ClassVar[Reduction]
    REDUCTION_DOT: _ClassVar[Reduction]
    REDUCTION_PROJECT: _ClassVar[Reduction]

class ProjectionKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PROJECTION_KIND_RADEMACHER: _ClassVar[ProjectionKind]
    PROJECTION_KIND_GAUSSIAN: _ClassVar[ProjectionKind]
REDUCTION_NONE: Reduction
REDUCTION_NORMS: Reduction
REDUCTION_CLIPPED_SUM: Reduction
REDUCTION_MOMENTS: Reduction
REDUCTION_DOT: Reduction
REDUCTION_PROJECT: Reduction
PROJECTION_KIND_RADEMACHER: ProjectionKind
PROJECTION_KIND_GAUSSIAN: ProjectionKind

class ListModelsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListModelsResponse(_message.Message):
    __slots__ = ("models",)
    MODELS_FIELD_NUMBER: _ClassVar[int]
    models: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, models: _Optional[_Iterable[str]] = ...) -> None: ...

class GetModelInfoRequest(_message.Message):
    __slots__ = ("model",)
    MODEL_FIELD_NUMBER: _ClassVar[int]
    model: str
    def __init__(self, model: _Optional[str] = ...) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("name", "model_version", "variables", "input", "labels", "loss", "num_classes", "server", "weights_id", "inputs", "limits", "plan", "plan_id", "loss_dtype", "optimizer", "routes", "lora", "keras_version")
    NAME_FIELD_NUMBER: _ClassVar[int]
    MODEL_VERSION_FIELD_NUMBER: _ClassVar[int]
    VARIABLES_FIELD_NUMBER: _ClassVar[int]
    INPUT_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    NUM_CLASSES_FIELD_NUMBER: _ClassVar[int]
    SERVER_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_ID_FIELD_NUMBER: _ClassVar[int]
    INPUTS_FIELD_NUMBER: _ClassVar[int]
    LIMITS_FIELD_NUMBER: _ClassVar[int]
    PLAN_FIELD_NUMBER: _ClassVar[int]
    PLAN_ID_FIELD_NUMBER: _ClassVar[int]
    LOSS_DTYPE_FIELD_NUMBER: _ClassVar[int]
    OPTIMIZER_FIELD_NUMBER: _ClassVar[int]
    ROUTES_FIELD_NUMBER: _ClassVar[int]
    LORA_FIELD_NUMBER: _ClassVar[int]
    KERAS_VERSION_FIELD_NUMBER: _ClassVar[int]
    name: str
    model_version: int
    variables: _containers.RepeatedCompositeFieldContainer[_tensor_pb2.TensorSpec]
    input: _tensor_pb2.TensorSpec
    labels: _tensor_pb2.TensorSpec
    loss: str
    num_classes: int
    server: str
    weights_id: str
    inputs: _containers.RepeatedCompositeFieldContainer[_tensor_pb2.TensorSpec]
    limits: ServerLimits
    plan: str
    plan_id: str
    loss_dtype: _tensor_pb2.DataType
    optimizer: str
    routes: _containers.RepeatedScalarFieldContainer[str]
    lora: str
    keras_version: str
    def __init__(self, name: _Optional[str] = ..., model_version: _Optional[int] = ..., variables: _Optional[_Iterable[_Union[_tensor_pb2.TensorSpec, _Mapping]]] = ..., input: _Optional[_Union[_tensor_pb2.TensorSpec, _Mapping]] = ..., labels: _Optional[_Union[_tensor_pb2.TensorSpec, _Mapping]] = ..., loss: _Optional[str] = ..., num_classes: _Optional[int] = ..., server: _Optional[str] = ..., weights_id: _Optional[str] = ..., inputs: _Optional[_Iterable[_Union[_tensor_pb2.TensorSpec, _Mapping]]] = ..., limits: _Optional[_Union[ServerLimits, _Mapping]] = ..., plan: _Optional[str] = ..., plan_id: _Optional[str] = ..., loss_dtype: _Optional[_Union[_tensor_pb2.DataType, str]] = ..., optimizer: _Optional[str] = ..., routes: _Optional[_Iterable[str]] = ..., lora: _Optional[str] = ..., keras_version: _Optional[str] = ...) -> None: ...

class ServerLimits(_message.Message):
    __slots__ = ("max_batch", "max_request_bytes", "max_inflight_examples", "max_inflight_bytes", "max_coalesced_batch")
    MAX_BATCH_FIELD_NUMBER: _ClassVar[int]
    MAX_REQUEST_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_INFLIGHT_EXAMPLES_FIELD_NUMBER: _ClassVar[int]
    MAX_INFLIGHT_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_COALESCED_BATCH_FIELD_NUMBER: _ClassVar[int]
    max_batch: int
    max_request_bytes: int
    max_inflight_examples: int
    max_inflight_bytes: int
    max_coalesced_batch: int
    def __init__(self, max_batch: _Optional[int] = ..., max_request_bytes: _Optional[int] = ..., max_inflight_examples: _Optional[int] = ..., max_inflight_bytes: _Optional[int] = ..., max_coalesced_batch: _Optional[int] = ...) -> None: ...

class GetWeightsRequest(_message.Message):
    __slots__ = ("model",)
    MODEL_FIELD_NUMBER: _ClassVar[int]
    model: str
    def __init__(self, model: _Optional[str] = ...) -> None: ...

class WeightsHeader(_message.Message):
    __slots__ = ("model", "model_version", "tensors", "new_version", "weights_id")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    MODEL_VERSION_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    NEW_VERSION_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_ID_FIELD_NUMBER: _ClassVar[int]
    model: str
    model_version: int
    tensors: _containers.RepeatedCompositeFieldContainer[_tensor_pb2.TensorSpec]
    new_version: int
    weights_id: str
    def __init__(self, model: _Optional[str] = ..., model_version: _Optional[int] = ..., tensors: _Optional[_Iterable[_Union[_tensor_pb2.TensorSpec, _Mapping]]] = ..., new_version: _Optional[int] = ..., weights_id: _Optional[str] = ...) -> None: ...

class WeightsMessage(_message.Message):
    __slots__ = ("header", "chunk")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    header: WeightsHeader
    chunk: _tensor_pb2.TensorChunk
    def __init__(self, header: _Optional[_Union[WeightsHeader, _Mapping]] = ..., chunk: _Optional[_Union[_tensor_pb2.TensorChunk, _Mapping]] = ...) -> None: ...

class SetWeightsResponse(_message.Message):
    __slots__ = ("model", "model_version", "weights_id")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    MODEL_VERSION_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_ID_FIELD_NUMBER: _ClassVar[int]
    model: str
    model_version: int
    weights_id: str
    def __init__(self, model: _Optional[str] = ..., model_version: _Optional[int] = ..., weights_id: _Optional[str] = ...) -> None: ...

class GradientsRequest(_message.Message):
    __slots__ = ("model", "model_version", "inputs", "labels", "request_id", "reduction", "variables", "max_norm", "noise_multiplier", "seed", "reference", "dim", "projection", "wire_dtype", "weights_id", "named_inputs", "inline_result", "chunk")
    class ReferenceEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: _tensor_pb2.Tensor
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ...) -> None: ...
    class NamedInputsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: _tensor_pb2.Tensor
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ...) -> None: ...
    MODEL_FIELD_NUMBER: _ClassVar[int]
    MODEL_VERSION_FIELD_NUMBER: _ClassVar[int]
    INPUTS_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    REDUCTION_FIELD_NUMBER: _ClassVar[int]
    VARIABLES_FIELD_NUMBER: _ClassVar[int]
    MAX_NORM_FIELD_NUMBER: _ClassVar[int]
    NOISE_MULTIPLIER_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    REFERENCE_FIELD_NUMBER: _ClassVar[int]
    DIM_FIELD_NUMBER: _ClassVar[int]
    PROJECTION_FIELD_NUMBER: _ClassVar[int]
    WIRE_DTYPE_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_ID_FIELD_NUMBER: _ClassVar[int]
    NAMED_INPUTS_FIELD_NUMBER: _ClassVar[int]
    INLINE_RESULT_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    model: str
    model_version: int
    inputs: _tensor_pb2.Tensor
    labels: _tensor_pb2.Tensor
    request_id: int
    reduction: Reduction
    variables: _containers.RepeatedScalarFieldContainer[str]
    max_norm: float
    noise_multiplier: float
    seed: int
    reference: _containers.MessageMap[str, _tensor_pb2.Tensor]
    dim: int
    projection: ProjectionKind
    wire_dtype: _tensor_pb2.DataType
    weights_id: str
    named_inputs: _containers.MessageMap[str, _tensor_pb2.Tensor]
    inline_result: bool
    chunk: _tensor_pb2.TensorChunk
    def __init__(self, model: _Optional[str] = ..., model_version: _Optional[int] = ..., inputs: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., labels: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., request_id: _Optional[int] = ..., reduction: _Optional[_Union[Reduction, str]] = ..., variables: _Optional[_Iterable[str]] = ..., max_norm: _Optional[float] = ..., noise_multiplier: _Optional[float] = ..., seed: _Optional[int] = ..., reference: _Optional[_Mapping[str, _tensor_pb2.Tensor]] = ..., dim: _Optional[int] = ..., projection: _Optional[_Union[ProjectionKind, str]] = ..., wire_dtype: _Optional[_Union[_tensor_pb2.DataType, str]] = ..., weights_id: _Optional[str] = ..., named_inputs: _Optional[_Mapping[str, _tensor_pb2.Tensor]] = ..., inline_result: _Optional[bool] = ..., chunk: _Optional[_Union[_tensor_pb2.TensorChunk, _Mapping]] = ...) -> None: ...

class ResultTensor(_message.Message):
    __slots__ = ("field", "tensor")
    FIELD_FIELD_NUMBER: _ClassVar[int]
    TENSOR_FIELD_NUMBER: _ClassVar[int]
    field: str
    tensor: _tensor_pb2.TensorSpec
    def __init__(self, field: _Optional[str] = ..., tensor: _Optional[_Union[_tensor_pb2.TensorSpec, _Mapping]] = ...) -> None: ...

class ResultHeader(_message.Message):
    __slots__ = ("model", "model_version", "batch_size", "outputs", "server", "weights_id", "plan_id", "data")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    MODEL_VERSION_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    SERVER_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_ID_FIELD_NUMBER: _ClassVar[int]
    PLAN_ID_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    model: str
    model_version: int
    batch_size: int
    outputs: _containers.RepeatedCompositeFieldContainer[ResultTensor]
    server: str
    weights_id: str
    plan_id: str
    data: bytes
    def __init__(self, model: _Optional[str] = ..., model_version: _Optional[int] = ..., batch_size: _Optional[int] = ..., outputs: _Optional[_Iterable[_Union[ResultTensor, _Mapping]]] = ..., server: _Optional[str] = ..., weights_id: _Optional[str] = ..., plan_id: _Optional[str] = ..., data: _Optional[bytes] = ...) -> None: ...

class StepRequest(_message.Message):
    __slots__ = ("model", "model_version", "weights_id", "new_version", "batch", "gradient_sum", "learning_rate", "expected_batch_size", "chunk", "step_id")
    class GradientSumEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: _tensor_pb2.Tensor
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ...) -> None: ...
    MODEL_FIELD_NUMBER: _ClassVar[int]
    MODEL_VERSION_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_ID_FIELD_NUMBER: _ClassVar[int]
    NEW_VERSION_FIELD_NUMBER: _ClassVar[int]
    BATCH_FIELD_NUMBER: _ClassVar[int]
    GRADIENT_SUM_FIELD_NUMBER: _ClassVar[int]
    LEARNING_RATE_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    model: str
    model_version: int
    weights_id: str
    new_version: int
    batch: GradientsRequest
    gradient_sum: _containers.MessageMap[str, _tensor_pb2.Tensor]
    learning_rate: float
    expected_batch_size: float
    chunk: _tensor_pb2.TensorChunk
    step_id: str
    def __init__(self, model: _Optional[str] = ..., model_version: _Optional[int] = ..., weights_id: _Optional[str] = ..., new_version: _Optional[int] = ..., batch: _Optional[_Union[GradientsRequest, _Mapping]] = ..., gradient_sum: _Optional[_Mapping[str, _tensor_pb2.Tensor]] = ..., learning_rate: _Optional[float] = ..., expected_batch_size: _Optional[float] = ..., chunk: _Optional[_Union[_tensor_pb2.TensorChunk, _Mapping]] = ..., step_id: _Optional[str] = ...) -> None: ...

class StepResponse(_message.Message):
    __slots__ = ("model", "model_version", "weights_id", "server", "losses", "norms", "num_clipped", "gradient_norm", "update_norms")
    class UpdateNormsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    MODEL_FIELD_NUMBER: _ClassVar[int]
    MODEL_VERSION_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_ID_FIELD_NUMBER: _ClassVar[int]
    SERVER_FIELD_NUMBER: _ClassVar[int]
    LOSSES_FIELD_NUMBER: _ClassVar[int]
    NORMS_FIELD_NUMBER: _ClassVar[int]
    NUM_CLIPPED_FIELD_NUMBER: _ClassVar[int]
    GRADIENT_NORM_FIELD_NUMBER: _ClassVar[int]
    UPDATE_NORMS_FIELD_NUMBER: _ClassVar[int]
    model: str
    model_version: int
    weights_id: str
    server: str
    losses: _tensor_pb2.Tensor
    norms: _tensor_pb2.Tensor
    num_clipped: int
    gradient_norm: float
    update_norms: _containers.ScalarMap[str, float]
    def __init__(self, model: _Optional[str] = ..., model_version: _Optional[int] = ..., weights_id: _Optional[str] = ..., server: _Optional[str] = ..., losses: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., norms: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., num_clipped: _Optional[int] = ..., gradient_norm: _Optional[float] = ..., update_norms: _Optional[_Mapping[str, float]] = ...) -> None: ...

class GradientsResponse(_message.Message):
    __slots__ = ("request_id", "header", "chunk")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    request_id: int
    header: ResultHeader
    chunk: _tensor_pb2.TensorChunk
    def __init__(self, request_id: _Optional[int] = ..., header: _Optional[_Union[ResultHeader, _Mapping]] = ..., chunk: _Optional[_Union[_tensor_pb2.TensorChunk, _Mapping]] = ...) -> None: ...
