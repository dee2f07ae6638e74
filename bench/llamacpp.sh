#!/usr/bin/env bash
# llama.cpp beside this server, for comparisons only (never run by CI).
#
# The source is the llama.cpp vendored whole in the llama-cpp-python==0.3.36 sdist from PyPI.
# Everything goes under $LLAMACPP_DIR (default ~/.cache/linserve-llamacpp), outside the project:
#   bash bench/llamacpp.sh build                     # llama-bench, llama-server, llama-quantize
#   bash bench/llamacpp.sh convert HF_DIR OUT.gguf TYPE   # TYPE: f32 | bf16 | f16 | q8_0
#   bash bench/llamacpp.sh quantize IN.gguf OUT.gguf TYPE # TYPE: Q4_0, Q8_0, ...
#   bash bench/llamacpp.sh bin NAME                  # prints the path of a built program
# `convert` uses llama.cpp's own convert_hf_to_gguf.py in a venv of its own (over the project's
# torch and transformers, with the vendored gguf-py), so nothing is installed into the project's venv.
set -euo pipefail
DIR=${LLAMACPP_DIR:-$HOME/.cache/linserve-llamacpp}
VERSION=0.3.36
SRC=$DIR/llama_cpp_python-$VERSION/vendor/llama.cpp
BUILD=$DIR/build

fetch_source() {
  mkdir -p "$DIR"
  if [ ! -d "$SRC" ]; then
    pip download --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$DIR" -q
    tar xzf "$DIR/llama_cpp_python-$VERSION.tar.gz" -C "$DIR"
  fi
}

build() {
  fetch_source
  # Without AMX unless LLAMACPP_AMX=1: on a Sapphire Rapids VM that lists amx_tile, this
  # version's AMX Q8_0 kernel (tinygemm_kernel_amx) died of an invalid opcode at its first
  # tileloadd in every batched product (llama-server at startup, llama-bench -p); its
  # AVX-512 kernels then serve, as ours run AVX-512 without AMX.
  local flags=""
  if [ "${LLAMACPP_AMX:-0}" != 1 ]; then flags="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"; fi
  cmake -S "$SRC" -B "$BUILD" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
    -DCMAKE_C_FLAGS="$flags" -DCMAKE_CXX_FLAGS="$flags" \
    -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF
  cmake --build "$BUILD" -j "$(nproc)" --target llama-bench llama-server llama-quantize
}

convert_venv() {
  local venv=$DIR/venv
  if [ ! -x "$venv/bin/python" ]; then
    # the project's torch 2.13.0 CPU and transformers seen through, so nothing is fetched
    # twice; the vendored gguf-py installed in the venv shadows any other gguf
    python -m venv --system-site-packages "$venv"
    # run from the project's own venv, --system-site-packages sees the base interpreter's
    # packages, not the venv's: a .pth file adds the project's (after the venv's own)
    local here theirs
    here=$(python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    theirs=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    echo "$here" > "$theirs/linserve-project.pth"
    "$venv/bin/pip" install -q numpy sentencepiece protobuf
    "$venv/bin/pip" install -q "$SRC/gguf-py"
  fi
  echo "$venv/bin/python"
}

case "${1:-}" in
  build) build ;;
  convert)
    fetch_source
    py=$(convert_venv)
    # --no-mtp: Qwen3.5's benchmark checkpoints carry no multi-token-prediction head (the
    # flag exists for Qwen's families only); one whose config counts MTP layers keeps them.
    # LINSERVE_GGUF_PRE=gpt-2: name the tokenizer's pre-tokenizer (bench/gguf_pre_shim.py)
    # Arguments after the type go to the converter (--mmproj: the vision tower's file, for
    # which --no-mtp is not taken).
    extra=("${@:5}")
    if grep -q '"model_type": "qwen3_5' "$2/config.json" &&
       ! grep -Eq '"mtp_num_hidden_layers": [1-9]' "$2/config.json" &&
       [[ " ${extra[*]} " != *" --mmproj "* ]]; then extra+=(--no-mtp); fi
    if [ -n "${LINSERVE_GGUF_PRE:-}" ]; then
      "$py" "$(dirname "$0")/gguf_pre_shim.py" "$SRC" "$2" --outfile "$3" --outtype "$4" "${extra[@]}"
    else
      "$py" "$SRC/convert_hf_to_gguf.py" "$2" --outfile "$3" --outtype "$4" "${extra[@]}"
    fi ;;
  quantize) "$BUILD/bin/llama-quantize" "$2" "$3" "$4" ;;
  bin) echo "$BUILD/bin/$2" ;;
  *) sed -n '2,12p' "$0"; exit 2 ;;
esac
