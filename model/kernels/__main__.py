"""``python -m model.kernels build DIR``: compile the native kernels into DIR."""

from model.kernels import main

main()
