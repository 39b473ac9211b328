#!/usr/bin/env bash
# Download, on a machine with network, the wheels an offline GPU machine needs to run zfctl into
# .whl/ (git-ignored through .git/info/exclude), for Python 3.12 on x86-64 Linux:
#
#   scripts/fetch_gpu_wheels.sh [NAME==VERSION ...]
#
# Then bring .whl/ along; `make gpu-check` (scripts/gpu_check.py) installs it with
# `pip install --no-index --no-deps --target`. The list is zfctl's run-time dependencies
# (pyproject.toml) and theirs that the GPU image (torch 2.11, transformers, typer, rich, PyYAML,
# safetensors, tokenizers, pyarrow, pandas, pytest, ...) does not hold: cffi and pycparser (the
# native CPU-Adam build and its binding), datasets with dill and multiprocess (data preparation),
# and xxhash (checkpoint digests; the image has one, this pins the tested version). Versions are
# those the development venv tests with. Give NAME==VERSION arguments for anything else
# scripts/gpu_check.py reports missing there.
#
# Idempotent: a pinned wheel already in .whl/ is not fetched again (nor is the network asked),
# and other versions of the same packages are removed (two versions stop the whole install).
# Offline, it exits 1 with one line. PY=python3 by default (any Python with pip: the flags
# below ask for 3.12 wheels whatever runs pip).
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PY:-python3}
PINNED=(cffi==2.1.1 pycparser==3.12 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 xxhash==4.1.0 "$@")
DEST=.whl
for spec in "${PINNED[@]}"; do
  case "$spec" in ?*==?*) ;; *) echo "fetch_gpu_wheels: $spec: give NAME==VERSION" >&2; exit 2;; esac
done
mkdir -p "$DEST"
if git rev-parse --git-dir > /dev/null 2>&1 && ! git check-ignore -q "$DEST/"; then
  exclude=$(git rev-parse --git-path info/exclude)
  mkdir -p "$(dirname "$exclude")"
  echo "/$DEST/" >> "$exclude"  # never committed; the device tool still carries it when asked
fi

# One name per wheel file: `Foo-Bar` and `foo_bar` are the same distribution.
norm() { echo "$1" | tr 'A-Z-.' 'a-z__'; }

fetched=() present=()
for spec in "${PINNED[@]}"; do
  name=$(norm "${spec%%==*}") version=${spec#*==}
  have=""
  for f in "$DEST"/*.whl; do
    [ -e "$f" ] || continue
    base=$(basename "$f")
    [ "$(norm "${base%%-*}")" = "$name" ] || continue
    rest=${base#*-}
    if [ "${rest%%-*}" = "$version" ]; then have=$base; else rm -f "$f"; fi
  done
  if [ -n "$have" ]; then present+=("$have"); continue; fi
  # Binary wheels only (nothing is built there), for CPython 3.12 on manylinux x86-64; pure-Python
  # packages come as py3-none-any (or py312-none-any), which every --platform accepts.
  if ! log=$("$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
      --platform manylinux1_x86_64 --timeout 15 --retries 1 -d "$DEST" "$spec" 2>&1); then
    why=$(printf '%s\n' "$log" | grep -v '^WARNING' | grep -v '^ *$' | tail -n 1)
    echo "fetch_gpu_wheels: could not download $spec from PyPI (offline, or no 3.12 x86-64 wheel): ${why:-pip failed}" >&2
    exit 1
  fi
  fetched+=("$spec")
done

echo "fetched: ${fetched[*]:-nothing}; already in $DEST/: ${#present[@]} wheel(s)"
ls -1 "$DEST"/*.whl
echo "total: $(du -ch "$DEST"/*.whl | tail -n 1 | cut -f1) (the device tool carries 64 MiB at most)"
