#!/usr/bin/env bash
# Compile AND link the whole extension (csrc/sources.txt + csrc/sources_cuda.txt) against a
# CUDA build of torch, without a GPU, so that a CUDA build break fails CI even though the
# tests run on a CPU torch. Uses only torch/include and a few torch/lib libraries taken
# from the wheel (cached), nvcc/g++ with the flags torch.utils.cpp_extension uses, and
# checks the result: no undefined symbols, CUDA kernels registered, device code present.
#
#   ZL_TORCH_CUDA_WHEEL   the torch wheel (default: torch 2.14.1 cu130 in /opt/pypi-more/files)
#   CUDA_HOME             the CUDA toolkit (default: from nvcc on PATH, else /usr/local/cuda)
#   ZL_CUDA_ARCHS         default "80 90"
#   ZL_REQUIRE_CUDA_BUILD 1: a missing wheel or nvcc is an error; else it is a SKIP (exit 0)
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
start=$SECONDS

WHEEL=${ZL_TORCH_CUDA_WHEEL:-/opt/pypi-more/files/torch-2.14.1-cp311-cp311-manylinux_2_28_x86_64.whl}
if [[ -z "${CUDA_HOME:-}" ]]; then
  # Where the toolkit's include/ and lib64/ are: /usr/local/cuda, else beside nvcc on PATH
  # (which may be a wrapper script elsewhere).
  if [[ -x /usr/local/cuda/bin/nvcc ]]; then CUDA_HOME=/usr/local/cuda
  elif command -v nvcc >/dev/null; then CUDA_HOME=$(dirname "$(dirname "$(readlink -f "$(command -v nvcc)")")")
  else CUDA_HOME=/usr/local/cuda; fi
fi
NVCC=$CUDA_HOME/bin/nvcc

skip() {
  if [[ "${ZL_REQUIRE_CUDA_BUILD:-0}" == "1" ]]; then
    echo "check_cuda_build: FAILED: $1 (ZL_REQUIRE_CUDA_BUILD=1)" >&2
    exit 1
  fi
  echo "check_cuda_build: SKIPPED: $1"
  exit 0
}
[[ -f "$WHEEL" ]] || skip "CUDA torch wheel not found at $WHEEL (set ZL_TORCH_CUDA_WHEEL)"
[[ -x "$NVCC" ]] || skip "nvcc not found at $NVCC (set CUDA_HOME)"
command -v ninja >/dev/null || skip "ninja not found"

# --- torch headers and libraries from the wheel, extracted once per wheel
CACHE=${XDG_CACHE_HOME:-$HOME/.cache}/zero_lifetime/$(basename "$WHEEL" .whl)
if [[ ! -f "$CACHE/.complete" ]]; then
  echo "check_cuda_build: extracting torch/include and torch/lib from $(basename "$WHEEL") into $CACHE"
  rm -rf "$CACHE" && mkdir -p "$CACHE"
  python3 - "$WHEEL" "$CACHE" <<'EOF'
import sys, zipfile
wheel, dest = sys.argv[1:]
libs = {f"torch/lib/lib{name}.so" for name in
        ("c10", "c10_cuda", "torch", "torch_cpu", "torch_cuda", "torch_python")}
with zipfile.ZipFile(wheel) as z:
    members = [n for n in z.namelist()
               if n.startswith("torch/include/") or n in libs or n == "torch/utils/cpp_extension.py"]
    z.extractall(dest, members)
EOF
  touch "$CACHE/.complete"
fi
TORCH=$CACHE/torch
echo "check_cuda_build: torch files ready ($((SECONDS - start)) s)"

# --- flags as torch.utils.cpp_extension builds a CUDAExtension
# The C++ ABI the wheel was built with (std::__cxx11 symbols, mangled "cxx11", mean 1).
# (grep without -q: an early exit would SIGPIPE nm and fail the pipeline under pipefail)
if nm -D --defined-only "$TORCH/lib/libc10.so" | grep cxx11 >/dev/null; then ABI=1; else ABI=0; fi
# nvcc's torch-specific flags, read from the wheel's own cpp_extension.py.
mapfile -t NVCC_TORCH_FLAGS < <(python3 - "$TORCH/utils/cpp_extension.py" <<'EOF'
import ast, sys
tree = ast.parse(open(sys.argv[1]).read())
for node in tree.body:
    if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "COMMON_NVCC_FLAGS" for t in node.targets):
        print("\n".join(ast.literal_eval(node.value)))
EOF
)
PY_INCLUDE=$(python3 -c "import sysconfig; print(sysconfig.get_paths()['include'])")
PY_LIBDIR=$(python3 -c "import sysconfig; print(sysconfig.get_config_var('LIBDIR'))")
PY_LDVERSION=$(python3 -c "import sysconfig; print(sysconfig.get_config_var('LDVERSION'))")
# A fixed build hash: the real one changes with every source edit, which would make ninja
# recompile everything (this module is never loaded, only checked).
BUILD_HASH=-DZL_BUILD_HASH=zlh_check_cuda_build
INCLUDES="-I$ROOT/csrc -I$TORCH/include -I$TORCH/include/torch/csrc/api/include -I$CUDA_HOME/include -I$PY_INCLUDE"
DEFINES="-DTORCH_API_INCLUDE_EXTENSION_H -DTORCH_EXTENSION_NAME=_C -D_GLIBCXX_USE_CXX11_ABI=$ABI $BUILD_HASH"
# torch >= 2.10 headers need C++20 (cpp_extension passes -std=c++20 to both compilers).
CXXFLAGS="-O2 -fPIC -fopenmp -std=c++20 -Wall -Werror=return-type $DEFINES $INCLUDES"
GENCODE=""
for arch in ${ZL_CUDA_ARCHS:-80 90}; do GENCODE+=" -gencode=arch=compute_$arch,code=sm_$arch"; done
NVCCFLAGS="-O3 -std=c++20 ${NVCC_TORCH_FLAGS[*]} --compiler-options '-fPIC' $GENCODE $DEFINES $INCLUDES"

# --- compile (ninja: parallel, incremental with header dependencies) and link
# One build directory per checkout in the cache: a re-run recompiles only what changed.
OUT=$CACHE/build-$(echo -n "$ROOT" | sha256sum | cut -c1-12)
mkdir -p "$OUT"
rm -f "$OUT/_C.so"
read_sources() { grep -v -e '^[[:space:]]*#' -e '^[[:space:]]*$' "csrc/$1" | sed 's/[[:space:]]*$//'; }
{
  echo "rule cxx"
  echo "  command = ${CXX:-c++} -MMD -MF \$out.d $CXXFLAGS -c \$in -o \$out"
  echo "  depfile = \$out.d"
  echo "  deps = gcc"
  echo "rule nvcc"
  echo "  command = $NVCC -MD -MF \$out.d $NVCCFLAGS -c \$in -o \$out"
  echo "  depfile = \$out.d"
  echo "  deps = gcc"
  echo "rule link"
  echo "  command = ${CXX:-c++} -shared -fopenmp \$in -o \$out -Wl,--no-undefined -L$TORCH/lib -lc10 -lc10_cuda -ltorch -ltorch_cpu -ltorch_cuda -ltorch_python -L$CUDA_HOME/lib64 -lcudart -L$PY_LIBDIR -lpython$PY_LDVERSION -Wl,--allow-shlib-undefined"
  objects=""
  for src in $(read_sources sources.txt); do
    obj="obj/${src//\//_}.o"; objects+=" $obj"
    echo "build $obj: cxx $ROOT/csrc/$src"
  done
  for src in $(read_sources sources_cuda.txt); do
    obj="obj/${src//\//_}.o"; objects+=" $obj"
    echo "build $obj: nvcc $ROOT/csrc/$src"
  done
  echo "build _C.so: link$objects"
} > "$OUT/build.ninja"
compile_start=$SECONDS
if ! ninja -C "$OUT" >"$OUT/log" 2>&1; then
  tail -n 60 "$OUT/log" >&2
  echo "check_cuda_build: FAILED: compiling/linking against $(basename "$WHEEL") ($((SECONDS - start)) s)" >&2
  exit 1
fi
echo "check_cuda_build: compiled and linked $(read_sources sources.txt | wc -l) C++ + $(read_sources sources_cuda.txt | wc -l) CUDA sources in $((SECONDS - compile_start)) s"

# --- the CUDA half must really be in the module
fail() { echo "check_cuda_build: FAILED: $1" >&2; exit 1; }
symbols=$(nm -C "$OUT/_C.so")
for name in bucket_fill_cuda gather_copy_out_cuda copy_plan_inline_kernel copy_plan_table_kernel "zero_lifetime::ops::check_bucket_fill"; do
  grep -q "$name" <<<"$symbols" || fail "symbol $name missing from the CUDA build"
done
grep -Eq "TORCH_LIBRARY_IMPL_(static_)?init_zero_lifetime_CUDA" <<<"$symbols" ||
  fail "no TORCH_LIBRARY_IMPL(zero_lifetime, CUDA) registration in the CUDA build"
if command -v "$CUDA_HOME/bin/cuobjdump" >/dev/null; then
  for arch in ${ZL_CUDA_ARCHS:-80 90}; do
    "$CUDA_HOME/bin/cuobjdump" --list-elf "$OUT/_C.so" | grep -q "sm_$arch" || fail "no sm_$arch device code"
  done
fi
# Every copy kernel must store with 16-byte vector stores: nvcc once compiled them to one
# store per element (4-8x the store instructions, about a third of the bandwidth on an H100),
# and whether it merges them depends on the code inlined around them. The PTX of each arch
# says which.
PTX_NVCCFLAGS=$(sed -E 's/-gencode=arch=compute_[0-9a-z]+,code=sm_[0-9a-z]+//g' <<<"$NVCCFLAGS")
for arch in ${ZL_CUDA_ARCHS:-80 90}; do
  for src in $(read_sources sources_cuda.txt); do
    eval "$NVCC $PTX_NVCCFLAGS -arch=sm_$arch -ptx $ROOT/csrc/$src -o $OUT/kernels.ptx" ||
      fail "nvcc -ptx of $src for sm_$arch"
    python3 - "$OUT/kernels.ptx" "$src (sm_$arch)" <<'EOF_PTX' || fail "a copy kernel of $src has no 16-byte vector store on sm_$arch (see above)"
import re, sys
ptx, src = open(sys.argv[1]).read(), sys.argv[2]
entries = [(m.group(1), m.end()) for m in re.finditer(r"\.entry\s+(\S+)\(", ptx)]
bad = []
for k, (name, start) in enumerate(entries):
    body = ptx[start:entries[k + 1][1] if k + 1 < len(entries) else len(ptx)]
    if not re.search(r"\bst\.global(\.\w+)*\.v4\.", body):
        bad.append(name)
print(f"check_cuda_build: {len(entries) - len(bad)} of {len(entries)} kernels of {src} store 16-byte vectors")
for name in bad:
    print(f"check_cuda_build:   no vector store in {name}", file=sys.stderr)
sys.exit(1 if bad or not entries else 0)
EOF_PTX
  done
done
needed=$(readelf -d "$OUT/_C.so" | grep NEEDED)
for lib in libc10_cuda libcudart; do
  grep -q "$lib" <<<"$needed" || fail "module does not link $lib"
done
echo "check_cuda_build: OK: extension builds against $(basename "$WHEEL") with CUDA kernels (total $((SECONDS - start)) s)"
