"""Build the native CPU-Adam (native/*.c) into a cffi extension module.

    .venv/bin/python native/build.py              # zfctl/_zfnative.*.so (what `make setup` runs)
    .venv/bin/python native/build.py --sanitize   # native/build-asan/_zfnative_asan.*.so (check-native)
    .venv/bin/python native/build.py --cflags     # the release flags, for native/check-arch.sh

cffi "API mode, out of line": cffi writes a C wrapper around the declarations in zfnative.h and
compiles it with our sources into one CPython extension; calls release the GIL. For wheel builds,
`ffibuilder` below is the object setuptools' `cffi_modules=["native/build.py:ffibuilder"]` wants.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

from cffi import FFI, VerificationError

NATIVE = Path(__file__).resolve().parent
ROOT = NATIVE.parent
SOURCES = ["api.c", "pool.c", "kern_scalar.c", "kern_avx2.c", "kern_avx512.c"]

# -O3: vectorise the scalar reference loops too (on aarch64 they are the only path). -fno-math-errno:
# otherwise sqrtf must be able to set errno, so GCC emits a call instead of sqrtps and the loop does
# not vectorise (2.5x slower). -fno-trapping-math: lets GCC compute both sides of the fp16
# conversions' selects (an FP add might "trap"), without which the fp16 loops keep their branches
# and stay scalar; it changes no value, only which exception flags may be raised.
# -ffp-contract=off: no fused multiply-adds except the explicit ones, which keeps the SIMD and
# scalar paths bit-identical. No -ffast-math: it would reorder and break exactness vs torch.
FP_FLAGS = ["-fno-math-errno", "-fno-trapping-math", "-ffp-contract=off"]
RELEASE_FLAGS = ["-std=c11", "-O3", *FP_FLAGS, "-Wall", "-Wextra"]
# The sanitizer build keeps the same FP flags (same results) and aborts on the first report.
SANITIZE_FLAGS = [
    "-std=c11", "-O1", "-g", "-fno-omit-frame-pointer", *FP_FLAGS,
    "-fsanitize=address,undefined", "-fno-sanitize-recover=all",
]


def cdef_text() -> str:
    """The declarations between the CDEF markers of zfnative.h (one source of truth)."""
    header = (NATIVE / "zfnative.h").read_text()
    match = re.search(r"/\* CDEF-BEGIN \*/(.*)/\* CDEF-END \*/", header, re.DOTALL)
    if not match:
        raise RuntimeError("native/zfnative.h lost its CDEF-BEGIN/CDEF-END markers")
    return match.group(1)


def make_builder(module: str = "zfctl._zfnative", *, sanitize: bool = False, absolute: bool = False) -> FFI:
    """A cffi builder for `module`. Paths are relative to the repository root, as setuptools wants;
    `absolute` for `FFI.compile`, which runs the compiler inside its temporary directory."""
    flags = SANITIZE_FLAGS if sanitize else RELEASE_FLAGS
    base = f"{NATIVE}" if absolute else "native"
    builder = FFI()
    builder.cdef(cdef_text())
    builder.set_source(
        module,
        '#include "zfnative.h"',
        sources=[f"{base}/{name}" for name in SOURCES],
        include_dirs=[base],
        extra_compile_args=flags,
        extra_link_args=["-fsanitize=address,undefined"] if sanitize else [],
        libraries=["m", "pthread"],
    )
    return builder


ffibuilder = make_builder()


def _compiler_or_exit() -> None:
    """Fail with one actionable line when there is no C compiler, instead of a distutils trace."""
    cc = (os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc").split()[0]
    if shutil.which(cc) is None:
        sys.exit(
            f"zfctl: building the native CPU-Adam needs a C compiler, and '{cc}' was not found. "
            "Install one (Debian/Ubuntu: apt-get install build-essential; or set CC=gcc) and rerun "
            "`make setup`."
        )


def build(*, sanitize: bool = False) -> Path:
    """Compile and return the path of the extension module."""
    _compiler_or_exit()
    if sanitize:
        builder = make_builder("_zfnative_asan", sanitize=True, absolute=True)
        return Path(builder.compile(tmpdir=str(NATIVE / "build-asan"), verbose=False))
    # Build in native/build-release, then copy only the .so into the package; a failed build
    # leaves any previous module untouched.
    builder = make_builder(absolute=True)
    so = Path(builder.compile(tmpdir=str(NATIVE / "build-release"), verbose=False))
    dest = ROOT / "zfctl" / so.name
    tmp = dest.with_suffix(".tmp")
    shutil.copyfile(so, tmp)
    os.replace(tmp, dest)
    return dest


def asan_runtime() -> str:
    """The ASan runtime of the compiler that builds us: an uninstrumented python must LD_PRELOAD it."""
    cc = (os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc").split()[0]
    for name in ("libasan.so", "libclang_rt.asan-x86_64.so"):
        found = subprocess.run([cc, f"-print-file-name={name}"], check=False, capture_output=True, text=True)
        found = found.stdout.strip()
        if os.path.isabs(found) and os.path.exists(found):
            return found
    sys.exit(f"zfctl: no ASan runtime found for '{cc}' (Debian/Ubuntu: apt-get install libasan8)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sanitize", action="store_true", help="ASan/UBSan build for make check-native")
    parser.add_argument("--asan-runtime", action="store_true", help="print the ASan runtime library and exit")
    parser.add_argument("--cflags", action="store_true",
                        help="print the release compiler flags and exit (native/check-arch.sh builds with them)")
    args = parser.parse_args()
    if args.asan_runtime:
        print(asan_runtime())
        return
    if args.cflags:
        print(" ".join(RELEASE_FLAGS))
        return
    try:
        path = build(sanitize=args.sanitize)
    except (VerificationError, OSError) as exc:  # cffi wraps the compiler's CompileError/LinkError
        sys.exit(f"zfctl: building the native CPU-Adam failed: {exc}")
    print(f"built {path.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
