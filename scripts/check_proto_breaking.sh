#!/usr/bin/env bash
# The v1 API stays backward compatible: `buf breaking` compares proto/ with proto/ as of a
# landed commit (PROTO_BASE, default fe0b80b) under the FILE rules of proto/buf.yaml, and
# exits non-zero on a breaking change (a field removed, renumbered, renamed or retyped, a
# message, enum value, RPC or package renamed...). Additive changes pass. `./dev test` runs it.
#
# buf comes from npm's @bufbuild/buf, pinned with its integrity hashes in
# scripts/proto_breaking/package-lock.json, and is installed on first use (and again when
# the lockfile changes) into .ci/tools/buf (gitignored; nothing system-wide). Needs npm.
# The base commit must be in the clone (a full clone; `git fetch --unshallow` otherwise).
#
#   scripts/check_proto_breaking.sh                 # against fe0b80b
#   PROTO_BASE=<commit> scripts/check_proto_breaking.sh
#   scripts/check_proto_breaking.sh --proto DIR     # check DIR instead of proto/ (a scratch copy)
set -euo pipefail
cd "$(dirname "$0")/.."
base=${PROTO_BASE:-fe0b80b}
proto=proto
if [ "${1:-}" = "--proto" ]; then proto=$2; fi
pins=scripts/proto_breaking
tools=.ci/tools/buf
buf="$tools/node_modules/.bin/buf"

if ! { [ -x "$buf" ] && cmp -s "$pins/package-lock.json" "$tools/package-lock.json"; }; then
  if ! command -v npm >/dev/null 2>&1; then
    echo "[proto] npm is needed to install buf (@bufbuild/buf); install Node.js and npm" >&2
    exit 1
  fi
  echo "[proto] installing buf ($pins/package-lock.json) into $tools" >&2
  rm -rf "$tools" && mkdir -p "$tools"
  cp "$pins/package.json" "$pins/package-lock.json" "$tools/"
  if ! (cd "$tools" && npm ci --ignore-scripts --no-audit --no-fund --loglevel=error >&2); then
    rm -rf "$tools"
    echo "[proto] could not install buf with npm" >&2
    exit 1
  fi
fi

if ! git rev-parse -q --verify "$base^{commit}" >/dev/null; then
  echo "[proto] base commit $base is not in this clone (shallow? run: git fetch --unshallow)" >&2
  exit 1
fi
# The base's proto/ as files: works in any clone or worktree, without buf cloning the repository.
against=$(mktemp -d)
trap 'rm -rf "$against"' EXIT
git archive "$base" proto | tar -x -C "$against"
if ! "$buf" breaking "$proto" --against "$against/proto" --error-format text; then
  echo "[proto] breaking change in $proto/ against $base (see above); v1 clients must keep working:" \
       "add fields and messages instead, reserve what you remove" >&2
  exit 1
fi
echo "[proto] no breaking change against $base" >&2
