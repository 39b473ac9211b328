# Native targets, included by the top Makefile (which defines PY, NATIVE_SRC and `setup`).
#
# check-native: build native/*.c with AddressSanitizer + UndefinedBehaviorSanitizer into a second
# cffi module (native/build-asan/, selected by ZFCTL_NATIVE_VARIANT=asan in zfctl/_native.py) and
# run the kernel tests against it. Python itself is not instrumented, so the ASan runtime is
# LD_PRELOADed; leak checking is off because CPython and torch keep allocations until exit.
# Every SIMD load and store is checked (all three ISA paths run: the tests force each one), and
# the first report aborts the run. `make test` runs this target after pytest.
#
# check-arch: native/check-arch.sh, the kernels without Python: every ISA path of this machine
# against the scalar one, then an aarch64 cross build run under qemu-user against the x86 scalar
# results (it skips with one line when the cross compiler or qemu is missing). `make test` runs it
# last.

NATIVE_TESTS := tests/native/test_native_adam.py tests/native/test_native_kernels.py tests/native/test_native_api.py \
                tests/native/test_native_sum.py
ASAN_STAMP := native/build-asan/.stamp

.PHONY: check-native check-arch

$(ASAN_STAMP): $(STAMP) $(NATIVE_SRC)
	$(PY) native/build.py --sanitize
	touch $@

# -s: pytest must not capture fd 2, or a sanitizer report printed just before the abort is lost.
check-native: $(ASAN_STAMP)
	LD_PRELOAD="$$($(PY) native/build.py --asan-runtime)" \
	ASAN_OPTIONS=detect_leaks=0:abort_on_error=1 \
	UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
	ZFCTL_NATIVE_VARIANT=asan \
	$(PY) -m pytest -q -s -p no:cacheprovider $(NATIVE_TESTS)

check-arch: $(STAMP)
	PY=$(PY) native/check-arch.sh
