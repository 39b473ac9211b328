#!/usr/bin/env bash
# The native kernels without Python, on this machine's every path and on aarch64 under qemu-user.
#
#   native/check-arch.sh            (make check-arch; `make test` runs it after check-native)
#
# 1. Builds native/selftest.c with the release flags (CFLAGS, default: native/build.py --cflags)
#    for this machine and runs it once per ISA path; every path must print the same digests as
#    the scalar one (paths this CPU lacks are skipped, with the reason).
# 2. Cross-compiles the same sources for aarch64 (Grace/GH200, Graviton: only the scalar path,
#    which gcc -O3 vectorises to NEON), statically, runs it under qemu-aarch64 and requires
#    its digests to equal the x86 scalar ones, bit for bit. It also reports whether gcc really
#    vectorised the AdamW loop (vector fsqrt in adam_scalar).
# Step 2 needs Debian's gcc-aarch64-linux-gnu, libc6-dev-arm64-cross and qemu-user; without them
# it prints one "SKIPPED: ..." line naming what is missing and exits 0 (CI installs them in
# .ci/run when it can). Exit 1 only for a real mismatch or a failed build.
set -euo pipefail
cd "$(dirname "$0")/.."

OUT=native/build-selftest
SRC=(native/api.c native/pool.c native/kern_scalar.c native/kern_avx2.c native/kern_avx512.c native/selftest.c)
CC=${CC:-cc}
CROSS_CC=${CROSS_CC:-aarch64-linux-gnu-gcc}
# qemu runs the aarch64 driver ~5-10x slower than native (about 10 s here); bound it anyway.
QEMU_TIMEOUT=${QEMU_TIMEOUT:-300}
if [ -z "${CFLAGS:-}" ]; then
    PY=${PY:-.venv/bin/python}
    CFLAGS=$("$PY" native/build.py --cflags)
fi
mkdir -p "$OUT"

digests() { grep -v '^#' "$1"; }

# -- 1. this machine, every path ------------------------------------------------------------
"$CC" $CFLAGS -Inative "${SRC[@]}" -o "$OUT/selftest-host" -lm -lpthread
host_arch=$(uname -m)
"$OUT/selftest-host" scalar > "$OUT/host-scalar.txt"
cases=$(digests "$OUT/host-scalar.txt" | wc -l)
for isa in avx2 avx512; do
    rc=0
    "$OUT/selftest-host" "$isa" > "$OUT/host-$isa.txt" || rc=$?
    if [ "$rc" = 77 ]; then
        echo "native selftest ($host_arch): $isa SKIPPED: this CPU lacks it"
        continue
    elif [ "$rc" != 0 ]; then
        echo "native selftest ($host_arch): $isa FAILED (exit $rc)"; exit 1
    fi
    if ! diff <(digests "$OUT/host-scalar.txt") <(digests "$OUT/host-$isa.txt"); then
        echo "native selftest ($host_arch): $isa differs from scalar (lines above: < scalar, > $isa)"; exit 1
    fi
    echo "native selftest ($host_arch): $isa == scalar on all $cases cases"
done

# -- 2. aarch64 under qemu-user -------------------------------------------------------------
skip() {
    echo "aarch64 kernel check SKIPPED: $1 (Debian/Ubuntu: apt-get install gcc-aarch64-linux-gnu" \
         "libc6-dev-arm64-cross qemu-user)"
    exit 0
}
[ "$host_arch" = x86_64 ] || skip "the reference is the x86 scalar path and this machine is $host_arch"
command -v "$CROSS_CC" > /dev/null || skip "no cross compiler '$CROSS_CC'"
QEMU=$(command -v qemu-aarch64 || command -v qemu-aarch64-static || true)
[ -n "$QEMU" ] || skip "no qemu-aarch64 (qemu-user)"

# Static: qemu then needs no aarch64 sysroot at run time.
if ! "$CROSS_CC" $CFLAGS -static -Inative "${SRC[@]}" -o "$OUT/selftest-aarch64" -lm -lpthread 2> "$OUT/cross.log"; then
    grep -q "cannot find\|No such file" "$OUT/cross.log" && skip "the aarch64 C library is missing ($(head -1 "$OUT/cross.log"))"
    cat "$OUT/cross.log"; echo "aarch64 kernel check FAILED: cross build"; exit 1
fi
rc=0
timeout "$QEMU_TIMEOUT" "$QEMU" "$OUT/selftest-aarch64" scalar > "$OUT/aarch64-scalar.txt" || rc=$?
[ "$rc" = 124 ] && { echo "aarch64 kernel check FAILED: qemu run exceeded ${QEMU_TIMEOUT}s"; exit 1; }
[ "$rc" = 0 ] || { echo "aarch64 kernel check FAILED: the driver exited $rc under qemu"; exit 1; }
if ! diff <(digests "$OUT/host-scalar.txt") <(digests "$OUT/aarch64-scalar.txt"); then
    echo "aarch64 kernel check FAILED: results differ from x86 scalar (lines above: < x86, > aarch64)"; exit 1
fi
neon="not vectorised"
OBJDUMP=${CROSS_CC%gcc}objdump
if command -v "$OBJDUMP" > /dev/null; then
    # Into a variable first: grep -q closing the pipe early would fail the pipeline (pipefail).
    adam_asm=$("$OBJDUMP" -d --no-show-raw-insn "$OUT/selftest-aarch64" | awk '/<adam_scalar>:/,/^$/')
    vector_sqrts=$(grep -cE 'fsqrt[[:space:]]+v[0-9]+\.4s' <<< "$adam_asm" || true)
    [ "$vector_sqrts" -gt 0 ] && neon="NEON-vectorised by gcc ($vector_sqrts 4-wide fsqrt in adam_scalar)"
fi
echo "aarch64 kernel check: all $cases cases bit-identical to x86 scalar under $("$QEMU" --version | head -1);" \
     "AdamW loop $neon"
