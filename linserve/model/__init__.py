"""The model side of linserve: checkpoint loading (``loader``), one module per architecture
family (``architectures/``), the shared layers (``layers/``), recurrent state (``state``),
sampling and the native kernels (``kernels/``). Nothing here imports :mod:`linserve.server`."""
