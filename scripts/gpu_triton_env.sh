#!/usr/bin/env bash
# On the lent GPU machine (no network, Python 3.12 with CUDA torch preinstalled): make .venv the way
# backend.deploy.local_server expects it, from files carried in .tri/ or the folder TRI names (scripts/gpu_pieces.sh
# makes them; scripts/gpu_setup.sh install unpacks them into /tmp/gpu/tri):
#   triton-gpu.tar.xz   pytriton/tritonserver + nvidia_pytriton.libs from the nvidia-pytriton 0.7.0 wheel
#   wheels: numpy 1.26.4 (the Python backend of 2.51 needs numpy 1.x), tritonclient 2.51.0,
#   python-rapidjson and protobuf 4.25 (tritonclient.grpc needs them)
# NIXL (and vLLM) must already be installed with --target /tmp/site (scripts/gpu_setup.sh install).
set -euo pipefail
cd "$(dirname "$0")/.."
TRI=${TRI:-.tri}
PYV=$(python3 -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
python3 -m venv --system-site-packages .venv
SP=.venv/lib/python$PYV/site-packages
tar xJf "$TRI/triton-gpu.tar.xz" -C "$SP"
cp "$SP/pytriton/tritonserver/python_backend_stubs/$PYV/triton_python_backend_stub" "$SP/pytriton/tritonserver/backends/python/"
.venv/bin/python -m pip install -q --no-index --no-deps --no-compile "$TRI"/*.whl
# numpy: the Python backend stub of 2.51 is built for numpy 1.x (with 2.x its BYTES tensors come out
# garbled and the stub dies); the machine's scipy 1.18 is built for 2.x and uses np.long/np.ulong, which
# 1.26 lacks: alias them at start-up (this environment only).
echo 'import numpy as _np; _np.long = _np.int_; _np.ulong = _np.uint' > "$SP/epd_numpy_compat.pth"
# the machine's python3 may itself be a venv (torch lives there): its site-packages go after ours
BASE_SP=$(python3 -c 'import site; print(site.getsitepackages()[0])')
printf '%s\n%s\n%s\n' "$PWD" /tmp/site "$BASE_SP" > "$SP/epd.pth"
.venv/bin/python -c "import numpy, torch, nixl._api, tritonclient.grpc; print('gpu env ok: numpy', numpy.__version__, 'torch', torch.__version__, torch.cuda.is_available())"
