"""Errors raised by kimik3-jax. Every message names the file, tensor, field or argument at fault."""


class K3Error(Exception):
    """Base class: a problem with user input that the user can fix."""


class ConfigError(K3Error, ValueError):
    """A config.json field is missing, malformed, inconsistent or unsupported."""


class CheckpointError(K3Error):
    """A checkpoint directory, shard, index or tensor is missing or does not match the config."""


class MXFP4Error(CheckpointError, ValueError):
    """Packed MXFP4 data with a wrong shape, dtype or an invalid (NaN) scale byte."""


class TokenizerError(K3Error):
    """Tokenizer files missing or malformed."""


class TokenizerArgumentError(TokenizerError, ValueError):
    """A tokenizer function was called with an argument it cannot use (the message names it)."""
