"""The one error tree of colibri.

Every error a user can cause or meet is a :class:`ColibriError`. Lower-level exceptions (OSError,
json errors, io_uring failures) are mapped at one boundary with ``raise ... from exc`` so that
the message says what went wrong, where, and what to do.
"""

from __future__ import annotations

__all__ = [
    "ColibriError",
    "ConfigError",
    "ContainerError",
    "ConversionError",
    "ExpertLayoutError",
    "FormatError",
    "KVFileError",
    "ModelError",
    "OptionsError",
    "ReadError",
    "SafetensorsError",
    "StorageError",
    "TensorNotFoundError",
    "UnknownQuantFormatError",
    "UsageFileError",
]


class ColibriError(Exception):
    """Root of every error colibri raises on purpose."""


class StorageError(ColibriError):
    """Something about bytes on disk."""


class SafetensorsError(StorageError):
    """A shard is not valid safetensors (bad header, truncated, extents outside the file)."""


class ContainerError(StorageError):
    """A model directory is incomplete or inconsistent."""


class ConfigError(ContainerError):
    """config.json (or another JSON side file) is missing, malformed or lacks a needed key."""


class TensorNotFoundError(ContainerError):
    """A tensor the architecture needs is absent from every shard."""


class FormatError(ContainerError):
    """A tensor's bytes match no known storage format."""


class UnknownQuantFormatError(FormatError):
    """A quantization format name is not one colibri knows."""


class ExpertLayoutError(ContainerError):
    """An expert's matrices are not adjacent in one shard, so one read cannot fetch it."""


class ConversionError(StorageError):
    """`coli convert` cannot proceed (bad source, option mismatch on resume, no disk space)."""


class ReadError(StorageError):
    """An expert read failed at the OS level (mapped from OSError / io_uring errors)."""


class UsageFileError(StorageError):
    """A `.coli_usage` file is damaged or belongs to another model."""


class KVFileError(StorageError):
    """A `.coli_kv` file is damaged or belongs to another model."""


class OptionsError(ColibriError, ValueError):
    """An engine option (``EngineOptions`` / ``open_model`` keyword) has a value it cannot take."""


class ModelError(ColibriError):
    """The runtime cannot build or run the model (unsupported architecture, bad inputs)."""
