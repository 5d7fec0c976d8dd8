#!/usr/bin/env bash
# Packs FlashInfer's MLA decode (flashinfer-python 0.7.4, BatchMLAPagedAttentionWrapper with backend
# "fa3") for the GPU machine, which has no package registry and takes at most 64 MiB a call, into
# <project>/.flashinfer/ (4.7 MiB): the Python that `import flashinfer.mla` loads (the list
# beside this script, flashinfer_<version>_modules.txt) with a flashinfer/__init__.py of its own
# that imports nothing (the wheel's pulls in every kernel family), and the sources its SM90 MLA
# JIT compiles (data/include, cutlass, cccl, spdlog, csrc/batch_mla_* and tvm_ffi_utils.h).
# The whole wheel is 97 MiB and no wheel holds prebuilt SM90 MLA kernels: they compile on the
# GPU machine at first use (nvcc and ninja are there), a few minutes, into a JIT cache in /tmp
# that later calls on the same warm machine reuse.
#
#   profiles/flashinfer_bundle.sh            # from the project root, where pip reaches PyPI
#   device run, a second call on the warm machine (.cutedsl is ~62 MiB of the 64 alone),
#   carry [".flashinfer", ".cutedsl/activate.sh"], command starting:
#   source .cutedsl/activate.sh && source .flashinfer/activate.sh && ...
#
# activate.sh unpacks the tree once per machine into /tmp/flashinfer-site-<version> (Python's
# tarfile: no binary needed), puts it on PYTHONPATH, points FlashInfer's JIT cache at
# /tmp/flashinfer-ws (FLASHINFER_WORKSPACE_BASE), targets sm_90a, finds CUDA_HOME and a libcuda
# to link against, and never touches an index. flashinfer.mla also imports torch, apache-tvm-ffi,
# the CuTe DSL (all from .cutedsl / the image), numpy, jinja2, filelock, packaging, requests,
# tqdm, nvidia-ml-py and cuda-bindings, which the GPU machine's image has.
#
# The module list is what `import flashinfer.mla` and a plan/run of its fa3 path load, traced on
# the CPU against 0.7.4 with the device queries and the compiled module stood in for (nothing
# more loads at plan, JIT or run time), with triton absent and present (the GPU machine has it:
# fused_moe's CuTe DSL MoE then loads 29 more modules); the trimmed tree loads the same modules
# as the whole wheel either way. For another version, trace it again with
# profiles/flashinfer_trace.py (CPU) on the unpacked wheel, its __init__.py replaced by this one's.
# The two fa3 modules (BF16 and FP8 KV) compiled against this tree with nvcc 13.0 for sm_90a
# on a 2-core CPU machine in 127 and 148 s.
set -euo pipefail
ver=${FLASHINFER_VERSION:-0.7.4}
root=$(git rev-parse --show-toplevel)
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
manifest=$here/flashinfer_${ver}_modules.txt
dest=$root/.flashinfer
cache=${XDG_CACHE_HOME:-$HOME/.cache}/snapmla-device
whl=$cache/flashinfer_python-$ver-py3-none-any.whl

[[ -s $manifest ]] || { echo "flashinfer_bundle.sh: no module list $manifest for $ver" >&2; exit 1; }
if [[ ! -s $whl ]]; then
  mkdir -p "$cache"
  python3 -m pip download -q --no-deps --only-binary=:all: -d "$cache" "flashinfer-python==$ver"
fi
mkdir -p "$dest"
grep -qsx '/.flashinfer/' "$root/.git/info/exclude" || { mkdir -p "$root/.git/info"; echo '/.flashinfer/' >> "$root/.git/info/exclude"; }

python3 - "$whl" "$manifest" "$dest/flashinfer.tar.xz" "$ver" <<'PY'
import io, lzma, sys, tarfile, zipfile

whl, manifest, out, ver = sys.argv[1:]
modules = {f"flashinfer/{line.strip()}" for line in open(manifest) if line.strip()}
data = ("flashinfer/data/include/", "flashinfer/data/cutlass/include/", "flashinfer/data/cutlass/tools/util/include/",
        "flashinfer/data/cccl/", "flashinfer/data/spdlog/include/", "flashinfer/data/csrc/batch_mla_",
        "flashinfer/data/csrc/tvm_ffi_utils.h")
init = (f'"""flashinfer-python {ver}, trimmed by snapmla-cute\'s profiles/flashinfer_bundle.sh to what\n'
        'flashinfer.mla (BatchMLAPagedAttentionWrapper, backend "fa3") loads and compiles; the wheel\'s\n'
        '__init__ would import every kernel family."""\n\n'
        "from .version import __git_commit__, __git_version__, __version__  # noqa: F401\n")
with zipfile.ZipFile(whl) as z:
    names = set(z.namelist())
    missing = sorted(m for m in modules if m not in names)
    if missing:
        sys.exit(f"flashinfer_bundle.sh: not in the wheel: {missing[:5]} ({len(missing)})")
    keep = sorted(n for n in names if (n in modules and n != "flashinfer/__init__.py")
                  or (n.startswith(data) and not n.endswith("/"))
                  or (".dist-info/licenses/" in n and not n.endswith("/")))
    # the licenses under flashinfer/licenses/: a dist-info folder without METADATA on the path
    # would read as a distribution without a name
    members = [("flashinfer/licenses/" + n.split(".dist-info/licenses/", 1)[1] if ".dist-info/" in n else n, z.read(n))
               for n in keep] + [("flashinfer/__init__.py", init.encode())]
raw = io.BytesIO()
with tarfile.open(fileobj=raw, mode="w", format=tarfile.PAX_FORMAT) as tar:
    for name, blob in members:
        info = tarfile.TarInfo(name)
        info.size, info.mode, info.mtime = len(blob), 0o644, 0
        tar.addfile(info, io.BytesIO(blob))
with open(out, "wb") as f:
    f.write(lzma.compress(raw.getvalue(), preset=9 | lzma.PRESET_EXTREME))
n_py = sum(name.endswith(".py") for name, _ in members)
print(f"flashinfer_bundle.sh: {len(members)} files ({n_py} Python), {len(raw.getvalue()) / 2**20:.1f} MiB unpacked")
PY

cat > "$dest/activate.sh" <<EOF
# source from the project root on the GPU machine, after .cutedsl/activate.sh (profiles/flashinfer_bundle.sh)
_fi_ver=$ver
EOF
cat >> "$dest/activate.sh" <<'EOF'
_fi_here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
_fi_site=/tmp/flashinfer-site-$_fi_ver
if [ ! -f "$_fi_site/flashinfer/version.py" ]; then
  mkdir -p "$_fi_site"
  python3 -c "import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2], filter='data')" \
    "$_fi_here/flashinfer.tar.xz" "$_fi_site" || return 1
fi
export PYTHONPATH=$_fi_site${PYTHONPATH:+:$PYTHONPATH}
# the JIT cache ($FLASHINFER_WORKSPACE_BASE/.cache/flashinfer/<version>/90a/cached_ops): in /tmp, so
# later calls on the same warm machine load the modules instead of compiling them again
export FLASHINFER_WORKSPACE_BASE=${FLASHINFER_WORKSPACE_BASE:-/tmp/flashinfer-ws}
export FLASHINFER_CUDA_ARCH_LIST=${FLASHINFER_CUDA_ARCH_LIST:-9.0a}
if [ -z "${CUDA_HOME:-}" ]; then
  if [ -x /usr/local/cuda/bin/nvcc ]; then export CUDA_HOME=/usr/local/cuda
  elif command -v nvcc >/dev/null; then CUDA_HOME=$(dirname "$(dirname "$(readlink -f "$(command -v nvcc)")")"); export CUDA_HOME
  fi
fi
# FlashInfer links its modules with -lcuda: give the linker the driver's library where the
# toolkit has no stub and no unversioned libcuda.so is on the linker's path
if ! ls "${CUDA_HOME:-/nonexistent}"/lib64/stubs/libcuda.so >/dev/null 2>&1 && ! ldconfig -p 2>/dev/null | grep -q 'libcuda\.so '; then
  _fi_cuda1=$(ldconfig -p 2>/dev/null | awk '/libcuda\.so\.1 /{print $NF; exit}')
  [ -z "$_fi_cuda1" ] && _fi_cuda1=$(ls /usr/local/nvidia/lib64/libcuda.so.1 /usr/lib/x86_64-linux-gnu/libcuda.so.1 2>/dev/null | head -1)
  if [ -n "$_fi_cuda1" ]; then
    mkdir -p "$FLASHINFER_WORKSPACE_BASE/lib" && ln -sf "$_fi_cuda1" "$FLASHINFER_WORKSPACE_BASE/lib/libcuda.so"
    export FLASHINFER_EXTRA_LDFLAGS="-L$FLASHINFER_WORKSPACE_BASE/lib${FLASHINFER_EXTRA_LDFLAGS:+ $FLASHINFER_EXTRA_LDFLAGS}"
  fi
fi
command -v ninja >/dev/null || { _fi_ninja=$(python3 -c "import ninja; print(ninja.BIN_DIR)" 2>/dev/null) && export PATH=$_fi_ninja:$PATH; }
python3 -c "import flashinfer, flashinfer.mla; from flashinfer.jit import env; print('flashinfer', flashinfer.__version__, '(flashinfer.mla only) | JIT cache', env.FLASHINFER_JIT_DIR)" \
  || echo "activate.sh: import flashinfer.mla failed (FlashInfer's columns will be absent)" >&2
echo "activate.sh: nvcc $(command -v nvcc || echo missing), CUDA_HOME=${CUDA_HOME:-unset}, ninja $(command -v ninja || echo missing)"
EOF
du -sh "$dest"; ls -la "$dest"
echo "flashinfer_bundle.sh: ready; carry [\".flashinfer\", \".cutedsl/activate.sh\"] in a call after the one that carried .cutedsl, start with: source .cutedsl/activate.sh && source .flashinfer/activate.sh &&"
