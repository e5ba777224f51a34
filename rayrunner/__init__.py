"""rayrunner: many LLMs behind one OpenAI-compatible endpoint on Ray Serve, loaded and unloaded on demand."""

from rayrunner.client import MultiModelBuilder, Runner
from rayrunner.errors import (
    AliasConflictError,
    InvalidRequestError,
    InvalidSpecError,
    ModelAlreadyLoadedError,
    ModelAlreadyUnloadedError,
    ModelExistsError,
    ModelLoadError,
    ModelNotFoundError,
    ModelReloadingError,
    RayRunnerError,
    UnsupportedRequestError,
)
from rayrunner.models.architectures import Architecture, EmbeddingArchitecture, MultimodalArchitecture
from rayrunner.models.which import Which
from rayrunner.protocol import ChatCompletionRequest, CompletionRequest, EmbeddingRequest

__all__ = [
    "AliasConflictError",
    "Architecture",
    "ChatCompletionRequest",
    "CompletionRequest",
    "EmbeddingArchitecture",
    "EmbeddingRequest",
    "InvalidRequestError",
    "InvalidSpecError",
    "ModelAlreadyLoadedError",
    "ModelAlreadyUnloadedError",
    "ModelExistsError",
    "ModelLoadError",
    "ModelNotFoundError",
    "ModelReloadingError",
    "MultiModelBuilder",
    "MultimodalArchitecture",
    "RayRunnerError",
    "Runner",
    "UnsupportedRequestError",
    "Which",
]
