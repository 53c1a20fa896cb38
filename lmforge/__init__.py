"""lmforge: a Llama model's whole life in one tool.

Public API: `lmforge.load(source, device=..., dtype=...)` and `lmforge.save(loaded, directory)`.
"""

from lmforge.version import __version__

__all__ = ["LoadedModel", "__version__", "load", "save"]


def __getattr__(name: str):
    # Lazy, so `lmforge --help` and light subcommands do not pay for importing torch.
    if name in __all__:
        from lmforge import api

        return getattr(api, name)
    raise AttributeError(f"module 'lmforge' has no attribute {name!r}")
