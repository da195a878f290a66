#!/usr/bin/env bash
# Build llama.cpp's `llama-server` from the llama.cpp tree vendored in the llama-cpp-python 0.3.36
# source distribution, and install it as <repo>/.venv/bin/llama-server. No arguments.
# Needs cmake >= 3.14 and a C/C++ compiler; the only download is the sdist, from PyPI.
# Compiles at the lowest priority with 2 jobs (a shared machine); takes minutes.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$REPO/.venv"
VER=0.3.36
# a fresh private work folder (mktemp -d: mode 0700, an unpredictable name), removed on exit
WORK="$(mktemp -d "${TMPDIR:-/tmp}/socllm-lcp.XXXXXXXX")"
trap 'rm -rf "$WORK"' EXIT
SRC="$WORK/llama_cpp_python-$VER/vendor/llama.cpp"
BUILD="$WORK/build"

# 1. the sdist (source only, no dependencies), unpacked under $WORK
"$VENV/bin/pip" download --no-binary :all: --no-deps "llama-cpp-python==$VER" -d "$WORK"
tar xzf "$WORK/llama_cpp_python-$VER.tar.gz" -C "$WORK"

# 2. configure: static libs, -march=native, only what the server needs.
#    LLAMA_USE_PREBUILT_UI=OFF: otherwise the build downloads the web UI from Hugging Face
#    (the server then runs without the embedded UI; the HTTP API is unaffected).
#    LLAMA_OPENSSL=OFF: no HTTPS needed for a local server. LLAMA_CURL is a no-op in this tree
#    (deprecated, ignored); kept so an older tree does not pull in libcurl.
nice -n 19 cmake -S "$SRC" -B "$BUILD" \
  -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF -DGGML_NATIVE=ON -DLLAMA_CURL=OFF \
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_APP=OFF \
  -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON \
  -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF \
  -DGGML_BUILD_TESTS=OFF -DGGML_BUILD_EXAMPLES=OFF
nice -n 19 cmake --build "$BUILD" --config Release --target llama-server -j2

# 3. install into the venv and check it runs
install -m 755 "$BUILD/bin/llama-server" "$VENV/bin/llama-server"
"$VENV/bin/llama-server" --version
