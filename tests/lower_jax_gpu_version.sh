#!/usr/bin/env bash
# The Pallas kernels' CUDA lowering (Mosaic GPU and Triton) under the GPU machine's jax (0.11.2), on this CPU:
# its Mosaic GPU layout inference differs from 0.10.2's (a shared-memory column read lowered on 0.10.2 and was
# refused only on the GPU, twenty-sixth session; reproduced here in the thirty-sixth). jax 0.11.2 needs Python
# 3.12, which pyenv has on these machines. Run from the repository root before spending device time on a kernel
# change:
#     bash tests/lower_jax_gpu_version.sh   # the lowering tests (test_moe_wgmma.py, test_cuda_lowering.py), slow too,
#                                           # and test_kda_tma.py (its kernels need 0.11's interpreter)
#     bash tests/lower_jax_gpu_version.sh -k 'lower and routed'   # pytest arguments; a -k replaces the default's
# The venv is made once in $VENV (default /tmp/v312, about 2 minutes).
set -eu
JAX_VERSION=${JAX_VERSION:-0.11.2}
VENV=${VENV:-/tmp/v312}
if [ -z "${PYTHON312:-}" ]; then  # the first that runs (pyenv's shim may exist without the version selected)
  for c in python3.12 "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.12*/bin/python; do
    if "$c" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))' 2>/dev/null; then PYTHON312=$c; break; fi
  done
fi
[ -n "${PYTHON312:-}" ] || { echo "no Python 3.12 found: set PYTHON312" >&2; exit 1; }
if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON312" -m venv "$VENV"
  "$VENV/bin/pip" install -q "jax==$JAX_VERSION" "jaxlib==$JAX_VERSION"
  "$VENV/bin/pip" install -q -e '.[test]'
fi
"$VENV/bin/python" -c "import jax, sys; v = jax.__version__; print('jax', v); sys.exit(v != '$JAX_VERSION')" \
  || { echo "$VENV has another jax; remove it or set VENV" >&2; exit 1; }
"$VENV/bin/python" -m pytest -q -p no:cacheprovider -m "slow or not slow" \
  tests/test_moe_wgmma.py tests/test_cuda_lowering.py tests/test_kda_tma.py -k "lower or kda_tma" "$@"
