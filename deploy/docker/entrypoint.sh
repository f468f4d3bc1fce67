#!/bin/sh
# Entry point of the ddnn images: runs `ddnn "$@"` (so `docker run IMAGE cloud`, `... edge`).
#
# DDNN_SEED_BUNDLE=/models/NAME seeds a tier's writable bundle directory: when the bundle of
# `ddnn edge` (DDNN_EDGE_BUNDLE) or `ddnn device` (DDNN_DEVICE_BUNDLE) has no manifest.json yet
# (a fresh volume), NAME is copied there first. Over-the-air updates then swap versions in
# beside it, and a restart keeps the version it had. Nothing is installed at start.
set -eu

case "${1:-}" in
  edge) target="${DDNN_EDGE_BUNDLE:-}" ;;
  device) target="${DDNN_DEVICE_BUNDLE:-}" ;;
  *) target="" ;;
esac

if [ -n "${DDNN_SEED_BUNDLE:-}" ] && [ -n "$target" ] && [ ! -f "$target/manifest.json" ]; then
  if [ ! -f "$DDNN_SEED_BUNDLE/manifest.json" ]; then
    echo "ddnn: error: DDNN_SEED_BUNDLE=$DDNN_SEED_BUNDLE holds no manifest.json" >&2
    exit 78
  fi
  mkdir -p "$(dirname "$target")"
  rm -rf "$target" "$target.seed"
  cp -R "$DDNN_SEED_BUNDLE" "$target.seed"
  mv "$target.seed" "$target"
  echo "seeded $target from $DDNN_SEED_BUNDLE" >&2
fi

exec ddnn "$@"
