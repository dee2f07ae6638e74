"""``python -m linserve.model.kernels build DIR``: compile the native kernels into DIR."""

from linserve.model.kernels import main

main()
