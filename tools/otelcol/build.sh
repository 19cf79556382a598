#!/usr/bin/env bash
# Builds the OpenTelemetry Collector of the local stack from the Go modules pinned in
# go.mod/go.sum (main.go lists the components docker/otel-collector/config.yaml uses,
# at the release of the compose file's otelcol-contrib image), once.
#
# Prints the path of the binary on stdout; everything else goes to stderr, so
# callers can write `DFLASH_OTELCOL_BIN=$(bash tools/otelcol/build.sh)`.
# The binary is cached under ${DFLASH_CACHE_DIR:-$HOME/.cache/dflash-train}/otelcol/<key>/
# where <key> hashes main.go, go.mod, go.sum and the target platform: bumping the pinned
# version builds a new binary next to the old one, an unchanged pin is a no-op.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
log() { echo "otelcol-build: $*" >&2; }

if ! command -v go >/dev/null 2>&1; then
  log "go is not on PATH; install Go >= $(sed -n 's/^go //p' "$here/go.mod") to build the Collector"
  exit 1
fi

goos=$(go env GOOS)
goarch=$(go env GOARCH)
key=$({ cat "$here/main.go" "$here/go.mod" "$here/go.sum"; echo "$goos/$goarch"; } \
  | sha256sum | cut -c1-16)
cache_root=${DFLASH_CACHE_DIR:-$HOME/.cache/dflash-train}
out_dir="$cache_root/otelcol/$key"
bin="$out_dir/otelcol"

if [ -x "$bin" ]; then
  log "cached: $bin"
  echo "$bin"
  exit 0
fi

mkdir -p "$out_dir"
# Build into a private name and rename: concurrent builds (two test sessions)
# never see or leave a half-written binary.
tmp="$out_dir/otelcol.tmp.$$"
trap 'rm -f "$tmp"' EXIT
log "building the Collector for $goos/$goarch into $out_dir (first time only; minutes)"
start_s=$(date +%s)
(
  cd "$here"
  # CGO off like the Collector's release builds: a static binary, no C toolchain needed.
  CGO_ENABLED=0 go build -trimpath -o "$tmp" -ldflags "-s -w" .
)
mv -f "$tmp" "$bin"
log "built in $(($(date +%s) - start_s)) s: $bin"
echo "$bin"
