#!/usr/bin/env bash
# Build XiaoMi/nnlib's real HVX kernels for Hexagon Linux and the maceq harness, to run under
# QEMU user-mode emulation.  See tools/nnlib/README.md.
#
#   tools/nnlib/setup.sh NNLIB [BUILD]
#
#   NNLIB  an nnlib checkout (a folder with hexagon/ and interface/), or a bare git repository
#          of XiaoMi/nnlib (then HEAD is extracted to BUILD/nnlib-src). The checkout gets three
#          small edits (patch_nnlib.py, idempotent).
#   BUILD  build folder, outside the repo (default /tmp/nnlib-build).
#
# Environment: VARIANT=v60 (default) | v65; JOBS=2; NO_INSTALL=1 skips apt/pip (tools must exist);
#              ZIGLANG_VERSION=0.17.0.
# Result: BUILD/VARIANT/nnlib_harness (static Hexagon ELF), BUILD/VARIANT/libhexagon_nn_linux.a.
# Errors: one line on stderr, exit status 1.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
die() { echo "setup.sh: $*" >&2; exit 1; }

[ $# -ge 1 ] && [ $# -le 2 ] || die "usage: setup.sh NNLIB_CHECKOUT_OR_BARE_GIT [BUILD_DIR]"
SRC_ARG="$1"
BUILD="$(realpath -m "${2:-/tmp/nnlib-build}")"
VARIANT="${VARIANT:-v60}"
JOBS="${JOBS:-2}"
ZIGLANG_VERSION="${ZIGLANG_VERSION:-0.17.0}"
case "$VARIANT" in v60|v65) ;; *) die "VARIANT must be v60 or v65 (v66 kernels use vrmpyz, which QEMU 7.2 cannot run)";; esac

REPO_ROOT="$(cd "$HERE/../.." && pwd)"
case "$BUILD/" in "$REPO_ROOT"/*) die "build folder $BUILD is inside the repo; pick one outside it";; esac
if [ ! -f "$SRC_ARG/hexagon/hexagon_nn_c_srcs.txt" ] && [ ! -f "$SRC_ARG/HEAD" ] && [ ! -e "$SRC_ARG/.git" ]; then
    die "$SRC_ARG is neither an nnlib checkout (hexagon/hexagon_nn_c_srcs.txt) nor a git repository"
fi
mkdir -p "$BUILD" || die "cannot create build folder $BUILD"

# ---- 1. toolchain ---------------------------------------------------------------------------
APT_PKGS=(clang-19 lld-19 llvm-19 qemu-user-static make python3-venv)
need_apt=()
command -v clang-19 >/dev/null || need_apt+=(clang-19)
command -v ld.lld-19 >/dev/null || need_apt+=(lld-19)
command -v llvm-ar-19 >/dev/null || need_apt+=(llvm-19)
command -v qemu-hexagon-static >/dev/null || need_apt+=(qemu-user-static)
command -v make >/dev/null || need_apt+=(make)
python3 -c 'import venv, ensurepip' 2>/dev/null || need_apt+=(python3-venv)
if [ ${#need_apt[@]} -gt 0 ]; then
    [ "${NO_INSTALL:-0}" = 1 ] && die "missing: ${need_apt[*]} (apt-get install ${APT_PKGS[*]})"
    SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"
    echo "setup.sh: installing ${need_apt[*]} with apt-get" >&2
    { $SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need_apt[@]}"; } \
        >"$BUILD/apt.log" 2>&1 || die "apt-get install ${need_apt[*]} failed (see $BUILD/apt.log)"
fi
for t in clang-19 ld.lld-19 llvm-ar-19 qemu-hexagon-static make; do
    command -v "$t" >/dev/null || die "$t not found after install"
done

VENV="$BUILD/zigvenv"
if ! "$VENV/bin/python" -m ziglang version >/dev/null 2>&1; then
    [ "${NO_INSTALL:-0}" = 1 ] && die "zig not found in $VENV (pip install ziglang==$ZIGLANG_VERSION)"
    python3 -m venv "$VENV" >"$BUILD/pip.log" 2>&1 || die "python3 -m venv $VENV failed (see $BUILD/pip.log)"
    "$VENV/bin/pip" install -q "ziglang==$ZIGLANG_VERSION" >>"$BUILD/pip.log" 2>&1 \
        || die "pip install ziglang==$ZIGLANG_VERSION failed (see $BUILD/pip.log)"
fi
ZIG="$VENV/bin/python -m ziglang"
echo "setup.sh: zig $($ZIG version), $(clang-19 --version | head -1), $(qemu-hexagon-static --version | head -1)"
export ZIG_GLOBAL_CACHE_DIR="$BUILD/zig-cache" ZIG_LOCAL_CACHE_DIR="$BUILD/zig-cache"

# ---- 2. nnlib source ------------------------------------------------------------------------
if [ -f "$SRC_ARG/hexagon/hexagon_nn_c_srcs.txt" ]; then
    NNLIB="$(cd "$SRC_ARG" && pwd)"
elif git --git-dir="$SRC_ARG" rev-parse --verify -q HEAD >/dev/null 2>&1; then
    NNLIB="$BUILD/nnlib-src"
    if [ ! -f "$NNLIB/hexagon/hexagon_nn_c_srcs.txt" ]; then
        mkdir -p "$NNLIB"
        git --git-dir="$SRC_ARG" archive HEAD | tar -x -C "$NNLIB" || die "cannot extract $SRC_ARG into $NNLIB"
    fi
    echo "setup.sh: nnlib $(git --git-dir="$SRC_ARG" rev-parse --short HEAD) extracted to $NNLIB"
else
    die "$SRC_ARG is neither an nnlib checkout (hexagon/hexagon_nn_c_srcs.txt) nor a git repository"
fi
case "$NNLIB/" in "$REPO_ROOT"/*) die "nnlib checkout $NNLIB is inside the repo; keep it outside";; esac
python3 "$HERE/patch_nnlib.py" "$NNLIB" || exit 1

# ---- 3. build ------------------------------------------------------------------------------
START=$(date +%s)
make -s -f "$HERE/Makefile" NNLIB="$NNLIB" BUILD="$BUILD" VARIANT="$VARIANT" ZIG="$ZIG" -j"$JOBS" all \
    >"$BUILD/build-$VARIANT.log" 2>&1 || { tail -20 "$BUILD/build-$VARIANT.log" >&2; die "build failed (see $BUILD/build-$VARIANT.log)"; }
HARNESS="$BUILD/$VARIANT/nnlib_harness"
[ -x "$HARNESS" ] || die "build produced no $HARNESS"
echo "setup.sh: built $HARNESS in $(( $(date +%s) - START ))s"

# ---- 4. smoke test: QuantizedAdd_8p8to8 on 1x1x1x4 under QEMU ---------------------------------
T="$BUILD/smoke"; rm -rf "$T"; mkdir -p "$T/out"
python3 - "$T" <<'EOF'
import struct, sys
d = sys.argv[1]
open(f"{d}/a.bin", "wb").write(bytes([0, 64, 128, 255]))
open(f"{d}/b.bin", "wb").write(bytes([255, 128, 64, 0]))
for n, v in (("mn", -1.0), ("mx", 1.0), ("omn", -2.0), ("omx", 2.0)):
    open(f"{d}/{n}.bin", "wb").write(struct.pack("<f", v))
open(f"{d}/spec.txt", "w").write("""const 2 1 1 1 1 mn.bin
const 3 1 1 1 1 mx.bin
const 4 1 1 1 1 omn.bin
const 5 1 1 1 1 omx.bin
input 10
feed 1 1 1 1 4 a.bin
feed 1 1 1 1 4 b.bin
node 11 QuantizedAdd_8p8to8 NA 8 10:0 10:1 2:0 3:0 2:0 3:0 4:0 5:0 3 1:1:1:1:4 4:1:1:1:1 4:1:1:1:1
output 11:0 4
output 11:1 4
output 11:2 4
""")
EOF
qemu-hexagon-static -cpu v67 "$HARNESS" "$T/spec.txt" "$T/out" >"$T/stdout.txt" 2>&1 \
    || die "smoke test failed under qemu-hexagon-static (see $T/stdout.txt, $T/out/result.txt)"
grep -q "^execute ok" "$T/out/result.txt" || die "smoke test: execute did not succeed (see $T/out/result.txt)"
echo "setup.sh: smoke test ok: QuantizedAdd_8p8to8 -> $(od -An -tu1 "$T/out/out0.bin" | xargs)"
echo "setup.sh: done. export NNLIB_HARNESS=$HARNESS; python3 $HERE/run.py"
