#!/usr/bin/env bash
# Builds the real Prometheus (v3) from the Go module pinned in go.mod/go.sum, once.
#
# Prints the path of the binary on stdout; everything else goes to stderr, so
# callers can write `DFLASH_PROMETHEUS_BIN=$(bash tools/prometheus/build.sh)`.
# The binary is cached under ${DFLASH_CACHE_DIR:-$HOME/.cache/dflash-train}/prometheus/<key>/
# where <key> hashes go.mod, go.sum and the target platform: bumping the pinned
# version builds a new binary next to the old one, an unchanged pin is a no-op.
#
# Prometheus v3.X.Y is published as the Go module version v0.30X.Y (v3.7.3 is
# v0.307.3); tests/test_stack_config.py checks that the compose image names the
# same release. The web UI's compiled assets are not part of the Go module, so
# this binary serves the HTTP API only: that is all the tests query.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
log() { echo "prometheus-build: $*" >&2; }

if ! command -v go >/dev/null 2>&1; then
  log "go is not on PATH; install Go >= $(sed -n 's/^go //p' "$here/go.mod") to build Prometheus"
  exit 1
fi

goos=$(go env GOOS)
goarch=$(go env GOARCH)
key=$({ cat "$here/go.mod" "$here/go.sum"; echo "$goos/$goarch"; } | sha256sum | cut -c1-16)
cache_root=${DFLASH_CACHE_DIR:-$HOME/.cache/dflash-train}
out_dir="$cache_root/prometheus/$key"
bin="$out_dir/prometheus"

if [ -x "$bin" ]; then
  log "cached: $bin"
  echo "$bin"
  exit 0
fi

module_version=$(cd "$here" && go list -m -f '{{.Version}}' github.com/prometheus/prometheus)
# v0.307.3 -> 3.7.3: the release the binary reports in /api/v1/status/buildinfo.
release=$(echo "$module_version" | sed -E 's/^v0\.3([0-9]{2})\.([0-9]+)$/3.\1.\2/; s/\.0([0-9])\./.\1./')
buildinfo=github.com/prometheus/common/version
mkdir -p "$out_dir"
# Build into a private name and rename: concurrent builds never see or leave a
# half-written binary.
tmp="$out_dir/prometheus.tmp.$$"
trap 'rm -f "$tmp"' EXIT
log "building prometheus $release ($module_version) for $goos/$goarch into $out_dir (first time only; minutes)"
start_s=$(date +%s)
(
  cd "$here"
  # CGO off like Prometheus's release builds: a static binary, no C toolchain needed.
  # netgo/osusergo as upstream's .promu.yml; no builtinassets (see above).
  CGO_ENABLED=0 go build -trimpath -tags netgo,osusergo -o "$tmp" \
    -ldflags "-s -w -X $buildinfo.Version=$release -X $buildinfo.Branch=release -X $buildinfo.Revision=$module_version" \
    github.com/prometheus/prometheus/cmd/prometheus
)
mv -f "$tmp" "$bin"
log "built in $(($(date +%s) - start_s)) s: $bin"
echo "$bin"
