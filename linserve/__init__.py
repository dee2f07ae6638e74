"""linserve: an OpenAI-compatible text-generation server for models with constant-size
recurrent state (linear attention, Gated DeltaNet, Mamba and their hybrids).

- :mod:`linserve.model`: checkpoints, architectures, layers and native kernels;
- :mod:`linserve.server`: the HTTP API, the engine process, sessions and caches;
- :mod:`linserve.cli`: the ``linserve`` command (``linserve serve [MODEL] [flags]``).

Imports point one way: ``server`` uses ``model``, never the reverse.
"""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("linserve")
except PackageNotFoundError:  # running from a checkout that was never installed
    __version__ = "0.0.0"
