#!/bin/sh
# The official OpenAI SDKs the SDK tests run (tests/integration/test_sdk_node.py, test_sdk_go.py), installed at
# their locked versions: npm's `openai` and `zod` from tests/sdk/node/package-lock.json into
# tests/sdk/node/node_modules, Go's `openai-go` from tests/sdk/go/go.sum, the check program built into
# .local/go/bin. The download and build caches are the user's (under $XDG_CACHE_HOME or ~/.cache, as uv's
# is), not the checkout's: a fresh clone on a machine that built the program once builds it in seconds,
# not the minute of CPU compiling openai-go costs on two cores. Called by `make test` (target `sdk`) and by the tests themselves;
# a second run with nothing changed does nothing. Usage: tests/sdk/install.sh [node] [go]
set -eu
cd "$(dirname "$0")/../.."
ROOT=$(pwd)
LOCAL="$ROOT/.local"
CACHE="${XDG_CACHE_HOME:-$HOME/.cache}/tokenmill"

install_node() {
    dir=tests/sdk/node
    stamp="$dir/node_modules/.package-lock.json"
    if [ -f "$stamp" ] && [ ! "$dir/package-lock.json" -nt "$stamp" ]; then
        return 0
    fi
    command -v npm >/dev/null || { echo "install.sh: npm is not installed (Node 20+ is needed)" >&2; exit 1; }
    npm ci --prefix "$dir" --cache "$CACHE/npm" --no-audit --no-fund --loglevel=error
}

find_go() {
    for candidate in "$(command -v go 2>/dev/null || true)" /usr/local/go/bin/go /usr/lib/go/bin/go; do
        if [ -n "$candidate" ] && [ -x "$candidate" ]; then
            echo "$candidate"
            return 0
        fi
    done
    # Debian's Go, as `make browser` installs Chromium; a Go of 1.21 or later fetches the toolchain go.mod
    # names through the module proxy by itself (GOTOOLCHAIN=auto).
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q golang-go >/dev/null 2>&1 \
        || (apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q golang-go >/dev/null) \
        || { echo "install.sh: no Go toolchain, and apt-get could not install one" >&2; exit 1; }
    command -v go
}

install_go() {
    GO=$(find_go)
    export GOPATH="$CACHE/go" GOMODCACHE="$CACHE/go/mod" GOCACHE="$CACHE/go/build" GOFLAGS=-modcacherw \
        GOTOOLCHAIN=auto
    bin="$LOCAL/go/bin/sdkcheck"
    if [ -x "$bin" ] && [ -z "$(find tests/sdk/go -newer "$bin" -type f)" ]; then
        return 0
    fi
    mkdir -p "$LOCAL/go/bin"
    (cd tests/sdk/go && "$GO" mod verify >/dev/null && "$GO" build -trimpath -o "$bin" .)
}

[ $# -gt 0 ] || set -- node go
for what in "$@"; do
    case "$what" in
        node) install_node ;;
        go) install_go ;;
        *) echo "install.sh: unknown part '$what' (node, go)" >&2; exit 2 ;;
    esac
done
