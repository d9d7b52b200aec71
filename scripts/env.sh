# Sourced by the scripts: where the virtual environment and the build live. No side effects beyond exports.
KERNMAP_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
KERNMAP_HOME="${KERNMAP_HOME:-$HOME/.cache/kernmap}"
KERNMAP_LOCK_HASH="$(sha256sum "$KERNMAP_ROOT/requirements.lock" | cut -c1-16)"
KERNMAP_VENV="${KERNMAP_VENV:-$KERNMAP_HOME/venv-$KERNMAP_LOCK_HASH}"
KERNMAP_PRESET="${KERNMAP_PRESET:-release}"
KERNMAP_BUILD="$KERNMAP_ROOT/build/$KERNMAP_PRESET"
export KERNMAP_ROOT KERNMAP_HOME KERNMAP_VENV KERNMAP_PRESET KERNMAP_BUILD
export KERNMAP_LIBRARY="$KERNMAP_BUILD/libkernmap.so"
export PYTHONPATH="$KERNMAP_ROOT/python${PYTHONPATH:+:$PYTHONPATH}"
export PATH="$KERNMAP_VENV/bin:$PATH"
export CCACHE_DIR="${CCACHE_DIR:-$KERNMAP_HOME/ccache}"
# Paths relative to the checkout, so a fresh clone reuses the cache of another.
export CCACHE_BASEDIR="${CCACHE_BASEDIR:-$KERNMAP_ROOT}"
export CCACHE_NOHASHDIR=1
