# linserve: OpenAI-compatible server for linear-attention LMs (CPU).
# Build:  docker build -t linserve .
# Run:    docker run -p 8000:8000 linserve
# Config: environment variables LINSERVE_* (see `linserve serve --help`), e.g.
#         -e LINSERVE_WEIGHTS=/app/weights/softmax -e LINSERVE_SESSION_STORE=redis://redis:6379/0

FROM python:3.11-slim AS build
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
WORKDIR /src
# A C++ compiler for the fused decode step's kernel; only this stage has one.
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends g++ \
 && rm -rf /var/lib/apt/lists/*
# CPU-only torch: from wheels/ if a wheel is there, else from the PyTorch CPU index. A CUDA
# build fails the image (grep reads the whole list: under pipefail, `grep -q` stopping at the
# first match would fail `pip list` with SIGPIPE and hide that match).
COPY wheels/ /wheels/
RUN python3 -m venv /opt/venv \
 && /opt/venv/bin/pip install --retries 1 --timeout 10 --find-links /wheels \
      --extra-index-url "${TORCH_INDEX_URL}" "torch==2.13.0" \
 && if /opt/venv/bin/pip list 2>/dev/null | grep -i nvidia >/dev/null; then echo "CUDA packages found" >&2; exit 1; fi
COPY pyproject.toml README.md ./
COPY linserve/ linserve/
RUN /opt/venv/bin/pip install --find-links /wheels /src
# Prebuild the kernels for four CPU levels (not -march=native: the image moves); at start
# the best one this CPU runs is loaded (linserve/model/kernels: LINSERVE_KERNEL_DIR), so a
# CPU without AVX2 gets the baseline build instead of an illegal instruction, one with AVX512-BF16 gets
# the bf16 dot-product GEMM, and one with AMX its tiles.
RUN for arch in x86-64-v4-amx x86-64-v4-bf16 x86-64-v3 x86-64; do \
      PATH=/opt/venv/bin:$PATH LINSERVE_KERNEL_ARCH=$arch linserve build-kernels "/opt/kernels/$arch" \
      && test -f "/opt/kernels/$arch/linserve_kernels.so" || exit 1; \
    done

FROM python:3.11-slim
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    LINSERVE_HOST=0.0.0.0 \
    LINSERVE_PORT=8000 \
    LINSERVE_WEIGHTS=/app/weights/linear \
    LINSERVE_KERNEL_DIR=/opt/kernels
RUN useradd --create-home --uid 10001 --shell /usr/sbin/nologin app
COPY --from=build /opt/venv /opt/venv
COPY --from=build /opt/kernels/x86-64-v4-amx/linserve_kernels.so /opt/kernels/x86-64-v4-amx/
COPY --from=build /opt/kernels/x86-64-v4-bf16/linserve_kernels.so /opt/kernels/x86-64-v4-bf16/
COPY --from=build /opt/kernels/x86-64-v3/linserve_kernels.so /opt/kernels/x86-64-v3/
COPY --from=build /opt/kernels/x86-64/linserve_kernels.so /opt/kernels/x86-64/
WORKDIR /app
COPY --chown=app:app weights/ /app/weights/
USER 10001
EXPOSE 8000
HEALTHCHECK --interval=15s --timeout=3s --start-period=60s --retries=3 \
  CMD ["python3", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health/live', timeout=2)"]
CMD ["linserve", "serve"]
