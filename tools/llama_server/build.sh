#!/usr/bin/env bash
# Builds llama.cpp's HTTP server `llama-server` (CPU only) once, from the llama.cpp
# vendored in the pinned, hash-checked PyPI sdist of llama-cpp-python.
#
# Prints the path of the binary on stdout; everything else goes to stderr, so
# callers can write `DFLASH_LLAMA_SERVER_BIN=$(bash tools/llama_server/build.sh)`.
# The binary is cached under
#   ${DFLASH_CACHE_DIR:-$HOME/.cache/dflash-train}/llama-server/<key>/llama-server
# where <key> hashes the pinned version, the sdist's sha256, the CMake flags and
# the machine (uname -m): a new pin or new flags build next to the old binary, an
# unchanged pin is a no-op.
#
# Needs: python3 with pip (only to download the sdist from PyPI), cmake >= 3.14,
# a C/C++17 compiler, and ninja or make. No network access besides PyPI: the web
# UI is not downloaded (the server runs API-only) and no HTTPS/curl is linked.
#
# DFLASH_LLAMA_NATIVE=1 builds with -march=native (GGML_NATIVE=ON): faster on the
# build machine, but the binary may not run on older CPUs. The default is portable
# (x86-64: AVX2/FMA/F16C/BMI2 baseline, as in ggml's non-native defaults).
set -euo pipefail

log() { echo "llama-server-build: $*" >&2; }

LLAMA_CPP_PYTHON_VERSION=0.3.36
LLAMA_CPP_PYTHON_SHA256=832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e
sdist_name="llama_cpp_python-$LLAMA_CPP_PYTHON_VERSION.tar.gz"

python=${PYTHON:-python3}
for tool in "$python" cmake c++ cc tar sha256sum; do
  if ! command -v "$tool" >/dev/null 2>&1; then
    log "$tool is not on PATH; llama-server needs python3 (pip), cmake, a C/C++ compiler and tar"
    exit 1
  fi
done

if command -v ninja >/dev/null 2>&1; then
  generator=Ninja
elif command -v make >/dev/null 2>&1; then
  generator="Unix Makefiles"
else
  log "neither ninja nor make is on PATH"
  exit 1
fi

native=OFF
if [ "${DFLASH_LLAMA_NATIVE:-0}" = "1" ]; then
  native=ON
fi

# Static llama/ggml libraries (one self-contained binary), CPU backend only,
# no curl/OpenSSL, no web UI download, no tests/examples.
cmake_flags=(
  -DCMAKE_BUILD_TYPE=Release
  -DBUILD_SHARED_LIBS=OFF
  -DGGML_NATIVE=$native
  -DGGML_CUDA=OFF
  -DGGML_METAL=OFF
  -DGGML_VULKAN=OFF
  -DGGML_BLAS=OFF
  -DGGML_CCACHE=OFF
  -DGGML_BACKEND_DL=OFF
  -DLLAMA_CURL=OFF
  -DLLAMA_OPENSSL=OFF
  -DLLAMA_BUILD_COMMON=ON
  -DLLAMA_BUILD_TOOLS=ON
  -DLLAMA_BUILD_SERVER=ON
  -DLLAMA_BUILD_TESTS=OFF
  -DLLAMA_BUILD_EXAMPLES=OFF
  -DLLAMA_BUILD_APP=OFF
  -DLLAMA_BUILD_UI=OFF
  -DLLAMA_USE_PREBUILT_UI=OFF
)

arch=$(uname -m)
key=$({
  echo "llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION"
  echo "sha256=$LLAMA_CPP_PYTHON_SHA256"
  printf '%s\n' "${cmake_flags[@]}"
  echo "$arch"
} | sha256sum | cut -c1-16)
cache_root=${DFLASH_CACHE_DIR:-$HOME/.cache/dflash-train}
out_dir="$cache_root/llama-server/$key"
bin="$out_dir/llama-server"

if [ -x "$bin" ]; then
  log "cached: $bin"
  echo "$bin"
  exit 0
fi

work=$(mktemp -d "${TMPDIR:-/tmp}/llama-server-build.XXXXXX")
# Build into a private name and rename: concurrent builds (two test sessions)
# never see or leave a half-written binary.
tmp="$out_dir/llama-server.tmp.$$"
trap 'rm -rf "$work" "$tmp"' EXIT
trap 'exit 130' INT
trap 'exit 143' TERM
start_s=$(date +%s)

log "downloading $sdist_name from PyPI"
# The hash in the requirement makes pip itself refuse any other file; the
# sha256sum below checks again what was written.
echo "llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION --hash=sha256:$LLAMA_CPP_PYTHON_SHA256" >"$work/requirements.txt"
if ! "$python" -m pip download --quiet --disable-pip-version-check --no-deps \
  --no-binary :all: -r "$work/requirements.txt" -d "$work/dl" >&2; then
  log "pip could not download llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION with sha256 $LLAMA_CPP_PYTHON_SHA256 (no PyPI access, or a hash mismatch: see pip's message above)"
  exit 1
fi
sdist="$work/dl/$sdist_name"
if [ ! -f "$sdist" ]; then
  log "pip did not produce $sdist_name (got: $(ls "$work/dl" 2>/dev/null | tr '\n' ' '))"
  exit 1
fi
got=$(sha256sum "$sdist" | cut -d' ' -f1)
if [ "$got" != "$LLAMA_CPP_PYTHON_SHA256" ]; then
  log "sha256 mismatch for $sdist_name: expected $LLAMA_CPP_PYTHON_SHA256, got $got; refusing to build"
  exit 1
fi

tar -xzf "$sdist" -C "$work"
src="$work/llama_cpp_python-$LLAMA_CPP_PYTHON_VERSION/vendor/llama.cpp"
if [ ! -f "$src/CMakeLists.txt" ] || [ ! -f "$src/tools/server/CMakeLists.txt" ]; then
  log "$sdist_name has no vendor/llama.cpp with tools/server; cannot build llama-server"
  exit 1
fi

log "building llama-server (llama-cpp-python $LLAMA_CPP_PYTHON_VERSION, GGML_NATIVE=$native, $arch) into $out_dir (first time only; minutes)"
jobs=$(nproc 2>/dev/null || echo 2)
(
  # The sdist ships llama.cpp's git metadata (build info: commit); never let git
  # look further up than the extracted tree.
  export GIT_CEILING_DIRECTORIES="$work"
  cmake -S "$src" -B "$work/build" -G "$generator" "${cmake_flags[@]}" >&2
  cmake --build "$work/build" --target llama-server --parallel "$jobs" >&2
)
built="$work/build/bin/llama-server"
if [ ! -x "$built" ]; then
  log "the build did not produce $built"
  exit 1
fi
# The llama/ggml libraries are static; only system libraries may be dynamic.
if command -v ldd >/dev/null 2>&1 && ldd "$built" | grep -Eq 'lib(llama|ggml|mtmd)'; then
  log "llama-server links llama/ggml shared libraries, expected a static build:"
  ldd "$built" >&2
  exit 1
fi
mkdir -p "$out_dir"
cp "$built" "$tmp"
strip "$tmp" 2>/dev/null || true
"$tmp" --version >&2
mv -f "$tmp" "$bin"
log "built in $(($(date +%s) - start_s)) s: $bin"
echo "$bin"
