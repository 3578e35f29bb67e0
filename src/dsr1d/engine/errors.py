"""Errors of the engine package that need no torch (the llama.cpp path imports only these)."""


class ModelError(Exception):
    """The model cannot be served; the message says why and what to do."""
