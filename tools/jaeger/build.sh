#!/usr/bin/env bash
# Builds the real Jaeger (v2) from the Go module pinned in go.mod/go.sum, once.
#
# Prints the path of the binary on stdout; everything else goes to stderr, so
# callers can write `DFLASH_JAEGER_BIN=$(bash tools/jaeger/build.sh)`.
# The binary is cached under ${DFLASH_CACHE_DIR:-$HOME/.cache/dflash-train}/jaeger/<key>/
# where <key> hashes go.mod, go.sum and the target platform: bumping the pinned
# version builds a new binary next to the old one, an unchanged pin is a no-op.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
log() { echo "jaeger-build: $*" >&2; }

if ! command -v go >/dev/null 2>&1; then
  log "go is not on PATH; install Go >= $(sed -n 's/^go //p' "$here/go.mod") to build Jaeger"
  exit 1
fi

goos=$(go env GOOS)
goarch=$(go env GOARCH)
key=$({ cat "$here/go.mod" "$here/go.sum"; echo "$goos/$goarch"; } | sha256sum | cut -c1-16)
cache_root=${DFLASH_CACHE_DIR:-$HOME/.cache/dflash-train}
out_dir="$cache_root/jaeger/$key"
bin="$out_dir/jaeger"

if [ -x "$bin" ]; then
  log "cached: $bin"
  echo "$bin"
  exit 0
fi

# The version the binary reports (`jaeger version`, /api/... build info) comes from
# the `tool` line's module version in go.mod, not from a git checkout.
version=$(cd "$here" && go list -m -f '{{.Version}}' github.com/jaegertracing/jaeger)
buildinfo=github.com/jaegertracing/jaeger/internal/version
mkdir -p "$out_dir"
# Build into a private name and rename: concurrent builds (two test sessions)
# never see or leave a half-written binary.
tmp="$out_dir/jaeger.tmp.$$"
trap 'rm -f "$tmp"' EXIT
log "building jaeger $version for $goos/$goarch into $out_dir (first time only; minutes)"
start_s=$(date +%s)
(
  cd "$here"
  # CGO off like Jaeger's release builds: a static binary, no C toolchain needed.
  CGO_ENABLED=0 go build -trimpath -o "$tmp" \
    -ldflags "-s -w -X $buildinfo.latestVersion=$version" \
    github.com/jaegertracing/jaeger/cmd/jaeger
)
mv -f "$tmp" "$bin"
log "built in $(($(date +%s) - start_s)) s: $bin"
echo "$bin"
