"""Compile checks of the CUDA hashing op (``csrc/cuda/``) with plain nvcc, for machines without a GPU.

What is checked:

* ``test_torch_glue_compiles``: the whole ``csrc/cuda/hash_kernel.cu`` (torch glue + kernels) compiles to
  an object file, host code and sm_80 device code (ptxas included), against the installed torch's
  headers with the flags torch extensions use. The CPU wheel ships the ATen/cuda and c10/cuda headers
  but not the CMake-generated ``c10/cuda/impl/cuda_cmake_macros.h``; ``C10_CUDA_NO_CMAKE_CONFIGURE_FILE``
  skips that include (the generated file only sets a Windows DLL-export macro). A CPU wheel has no
  ``libc10_cuda.so`` to link against, so instead every undefined symbol of the object must be defined by
  torch's CPU libraries, the CUDA runtime or the C/C++ runtimes — or lie in ``c10::cuda``, which is
  exactly what ``libc10_cuda.so`` exports.
* ``test_harness_*``: ``tests/ops/hash_kernel_harness.cu`` (no torch) includes the kernels header,
  compiles and links against the CUDA runtime, and runs Algorithm 1 on the host through the header's
  own insert / totals / extract functions, with racing threads on one table. Its output must be a
  lossless grouping equal to the CPU op's (same counts, same entries per partition). Where a GPU is
  present the harness also runs the kernels and compares them with its host run.

Not checked here: the op at run time on a GPU (allocation, ATen cumsum, streams, the dispatcher);
``tests/ops/test_cuda_op.py`` does that on a CUDA machine.
"""

from __future__ import annotations

import concurrent.futures
import glob
import hashlib
import math
import os
import re
import shutil
import subprocess

import pytest
import torch

from zen_ext import ops

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
KERNEL_CU = os.path.join(ROOT, "csrc", "cuda", "hash_kernel.cu")
PULL_CU = os.path.join(ROOT, "csrc", "cuda", "pull_kernel.cu")
PULL_KERNELS = ("add_dense_kernel", "fill_words_kernel", "add_coo_kernel", "popcount_total_kernel",
                "word_popcount_kernel", "encode_kernel", "msg_word_popcount_kernel", "decode_kernel")
SEARCH_CU = os.path.join(ROOT, "csrc", "cuda", "dgc_search.cu")
SELECT_CU = os.path.join(ROOT, "csrc", "cuda", "dgc_kernel.cu")
SAMPLE_CU = os.path.join(ROOT, "csrc", "cuda", "dgc_sample.cu")
KEPT_CU = os.path.join(ROOT, "csrc", "cuda", "dgc_kept.cu")
CATCH_UP_CU = os.path.join(ROOT, "csrc", "cuda", "catch_up_adamw.cu")
INT4_CU = os.path.join(ROOT, "csrc", "cuda", "dgc_int4.cu")
LOWBIT_CU = os.path.join(ROOT, "csrc", "cuda", "lowbit.cu")
LOWBIT_FUSED_CU = os.path.join(ROOT, "csrc", "cuda", "lowbit_fused.cu")
HARNESS_CU = os.path.join(ROOT, "tests", "ops", "hash_kernel_harness.cu")
# One architecture keeps the check quick; sm_80 (A100) is the oldest the paper-class GPUs need.
GENCODE = ["-gencode", "arch=compute_80,code=sm_80"]
KERNELS = ("permute_kernel", "insert_kernel", "totals_kernel", "extract_kernel", "merge_overflow_kernel")
# Provided by the linker or crt objects at link time, not by any shared library.
LINK_TIME_SYMBOLS = {"_GLOBAL_OFFSET_TABLE_", "__dso_handle", "atexit"}


def _find_nvcc() -> str | None:
    for cand in (os.environ.get("NVCC"), shutil.which("nvcc"), "/usr/local/bin/nvcc", "/usr/local/cuda/bin/nvcc"):
        if cand and os.path.isfile(cand) and os.access(cand, os.X_OK):
            return cand
    return None


NVCC = _find_nvcc()
pytestmark = [pytest.mark.nvcc, pytest.mark.skipif(NVCC is None, reason="nvcc not found (set NVCC or put it on PATH); "
                                 "the CUDA op cannot be compile-checked here")]


def _nvcc(args: list[str], timeout_s: int = 900) -> subprocess.CompletedProcess:
    proc = subprocess.run([NVCC, *args], capture_output=True, text=True, timeout=timeout_s)
    assert proc.returncode == 0, f"nvcc {' '.join(args)} failed:\n{proc.stderr[-6000:]}"
    return proc


def _ptxas_entries(stderr: str) -> str:
    return " ".join(re.findall(r"Compiling entry function '([^']+)'", stderr))


# ---------------------------------------------------------------------------------------------------
# The torch glue
# ---------------------------------------------------------------------------------------------------


def _torch_nvcc_flags() -> list[str]:
    from torch.utils import cpp_extension

    flags = ["-std=c++17", "-O3", "-Xcompiler", "-fPIC", *cpp_extension.COMMON_NVCC_FLAGS]
    flags += [f"-I{p}" for p in cpp_extension.include_paths()]
    flags += [
        "-DTORCH_EXTENSION_NAME=_C",
        "-DTORCH_API_INCLUDE_EXTENSION_H",
        f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
        "-DC10_CUDA_NO_CMAKE_CONFIGURE_FILE",
    ]
    return flags


def _exported_symbols(lib: str) -> set[str]:
    out = subprocess.run(["nm", "-D", "--defined-only", lib], capture_output=True, text=True).stdout
    return {line.split()[-1].split("@")[0] for line in out.splitlines() if line.strip()}


def _runtime_libraries() -> list[str]:
    torch_lib = os.path.join(os.path.dirname(torch.__file__), "lib")
    libs = glob.glob(os.path.join(torch_lib, "*.so*"))
    cuda_roots = {os.environ.get("CUDA_HOME"), os.path.dirname(os.path.dirname(os.path.realpath(NVCC))), "/usr/local/cuda"}
    for root in filter(None, cuda_roots):
        libs += glob.glob(os.path.join(root, "lib*", "libcudart.so*"))
    for name in ("libstdc++.so.6", "libc.so.6", "libm.so.6", "libgcc_s.so.1"):
        path = subprocess.run(["g++", f"-print-file-name={name}"], capture_output=True, text=True).stdout.strip()
        if os.path.isfile(path):
            libs.append(path)
    return libs


def _check_object_links(obj) -> None:
    undefined = subprocess.run(["nm", "-u", str(obj)], capture_output=True, text=True).stdout.split()
    undefined = [s for s in undefined if s != "U"]
    defined = set().union(*map(_exported_symbols, _runtime_libraries()))
    unresolved = [s for s in undefined if s not in defined and s not in LINK_TIME_SYMBOLS]
    demangled = subprocess.run(["c++filt"], input="\n".join(unresolved), capture_output=True, text=True).stdout
    outside_c10_cuda = [s for s in demangled.splitlines() if s and not s.startswith("c10::cuda::")]
    assert not outside_c10_cuda, f"symbols no library provides: {outside_c10_cuda}"
    assert any(s.startswith("c10::cuda::getCurrentCUDAStream") for s in demangled.splitlines()), (
        "the op must launch on the current stream")


# Every source is compiled once per session, all of them started together on a pool as wide as the
# machine (each nvcc run is one process, most of it parsing torch's headers): on 2 cores the checks
# take half the time of compiling one file after the other. Each test waits for its own source only.
_POOL: concurrent.futures.ThreadPoolExecutor | None = None
_BUILDS: dict[str, concurrent.futures.Future] = {}
KEEP_PTX = (PULL_CU, SELECT_CU, SAMPLE_CU, INT4_CU, LOWBIT_FUSED_CU)  # the tests that read their PTX
# A successful compile is kept, as ccache would, under a key of everything that shapes it: nvcc's
# version, the command line, torch's version and every file under csrc/ and tests/ops/*.cu. Any change
# to them compiles again (and can fail); an unchanged tree reuses the object, ptxas's report and the
# PTX, and every check below still runs on them. ZEN_NVCC_CACHE=0 turns it off; ZEN_NVCC_CACHE=<dir>
# moves it (default ~/.cache/zen_ext/nvcc).
_CACHE_SETTING = os.environ.get("ZEN_NVCC_CACHE", "")
CACHE_DIR = None if _CACHE_SETTING == "0" else (
    _CACHE_SETTING or os.path.join(os.path.expanduser("~"), ".cache", "zen_ext", "nvcc"))


@pytest.fixture(scope="module")
def build_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("nvcc")


def _inputs_digest() -> str:
    h = hashlib.sha256()
    version = subprocess.run([NVCC, "--version"], capture_output=True, text=True).stdout
    h.update(f"{version}\ntorch {torch.__version__}\n".encode())
    files = sorted(glob.glob(os.path.join(ROOT, "csrc", "**", "*"), recursive=True)
                   + glob.glob(os.path.join(ROOT, "tests", "ops", "*.cu")))
    for f in files:
        if os.path.isfile(f):
            h.update(os.path.relpath(f, ROOT).encode())
            with open(f, "rb") as fh:
                h.update(hashlib.sha256(fh.read()).digest())
    return h.hexdigest()


def _nvcc_cached(args: list[str], out, keep, digest: str) -> subprocess.CompletedProcess:
    """``nvcc args`` writing ``out`` (and PTX into ``keep``), or the kept result of the same inputs."""
    # Paths are keyed relative to the checkout and the build folder, so a fresh clone elsewhere (CI) hits.
    key = hashlib.sha256((digest + "\0".join(a.replace(str(out.parent), "<build>").replace(ROOT, "<root>")
                                              for a in args)).encode()).hexdigest()
    entry = os.path.join(CACHE_DIR, key[:32]) if CACHE_DIR else None
    if entry and os.path.isfile(os.path.join(entry, "stderr")):
        shutil.copy(os.path.join(entry, "out"), out)
        os.chmod(out, 0o755)
        if keep is not None:
            for f in glob.glob(os.path.join(entry, "*.ptx")):
                shutil.copy(f, keep)
        with open(os.path.join(entry, "stderr")) as fh:
            return subprocess.CompletedProcess([NVCC, *args], 0, "", fh.read())
    proc = subprocess.run([NVCC, *args], capture_output=True, text=True, timeout=900)
    if entry and proc.returncode == 0:
        tmp = f"{entry}.tmp{os.getpid()}"
        os.makedirs(tmp, exist_ok=True)
        shutil.copy(out, os.path.join(tmp, "out"))
        for f in glob.glob(str(keep / "*.ptx")) if keep is not None else ():
            shutil.copy(f, tmp)
        with open(os.path.join(tmp, "stderr"), "w") as fh:
            fh.write(proc.stderr)
        try:
            os.rename(tmp, entry)  # atomic: a concurrent session sees all of it or none
        except OSError:  # another session stored it first
            shutil.rmtree(tmp, ignore_errors=True)
    return proc


def _start_builds(build_dir) -> None:
    global _POOL
    if _BUILDS:
        return
    _POOL = concurrent.futures.ThreadPoolExecutor(max_workers=max(1, os.cpu_count() or 1))
    flags = _torch_nvcc_flags()
    digest = _inputs_digest()
    for cu in (KERNEL_CU, PULL_CU, SEARCH_CU, SELECT_CU, SAMPLE_CU, KEPT_CU, CATCH_UP_CU, INT4_CU, LOWBIT_CU,
               LOWBIT_FUSED_CU):
        obj = build_dir / (os.path.basename(cu) + ".o")
        keep = build_dir / (os.path.basename(cu) + ".keep")
        extra = ["-keep", "-keep-dir", str(keep)] if cu in KEEP_PTX else []
        if extra:
            keep.mkdir()
        args = ["-c", cu, "-o", str(obj), *flags, *GENCODE, "-Xptxas", "-v", *extra]
        _BUILDS[cu] = _POOL.submit(_nvcc_cached, args, obj, keep if extra else None, digest)
    exe = build_dir / "hash_kernel_harness"
    _BUILDS[HARNESS_CU] = _POOL.submit(
        _nvcc_cached, ["-std=c++17", "-O2", *GENCODE, "-Xptxas", "-v", HARNESS_CU, "-o", str(exe)], exe, None, digest)
    _POOL.shutdown(wait=False)


def test_compile_cache_key_covers_every_source(tmp_path, monkeypatch):
    # A kept compile is reused only for the same inputs: any byte of csrc/ or a test .cu changes the key.
    shutil.copytree(os.path.join(ROOT, "csrc"), tmp_path / "csrc")
    (tmp_path / "tests" / "ops").mkdir(parents=True)
    shutil.copy(HARNESS_CU, tmp_path / "tests" / "ops")
    monkeypatch.setitem(globals(), "ROOT", str(tmp_path))
    before = _inputs_digest()
    assert _inputs_digest() == before
    for edited in (tmp_path / "csrc" / "cuda" / "dgc_kept.cu", tmp_path / "tests" / "ops" / "hash_kernel_harness.cu"):
        edited.write_text(edited.read_text() + "\n// edited\n")
        assert _inputs_digest() != before
        before = _inputs_digest()


def _built(cu: str, build_dir) -> subprocess.CompletedProcess:
    _start_builds(build_dir)
    proc = _BUILDS[cu].result()
    assert proc.returncode == 0, f"nvcc {' '.join(proc.args)} failed:\n{proc.stderr[-6000:]}"
    return proc


def _compile_and_link(cu: str, build_dir) -> str:
    """``cu`` compiled with torch's flags to an object (ptxas verbose), its symbols checked to link;
    returns the kernels ptxas compiled."""
    if not shutil.which("nm") or not shutil.which("c++filt") or not shutil.which("g++"):
        pytest.skip("binutils (nm, c++filt) and g++ are needed for the symbol check")
    proc = _built(cu, build_dir)
    _check_object_links(build_dir / (os.path.basename(cu) + ".o"))
    return _ptxas_entries(proc.stderr)


def _kept_ptx(cu: str, build_dir) -> str:
    return "\n".join(open(f).read() for f in glob.glob(str(build_dir / (os.path.basename(cu) + ".keep") / "*.ptx")))


@pytest.mark.timeout(1200)
def test_torch_glue_compiles(build_dir):
    entries = _compile_and_link(KERNEL_CU, build_dir)
    for kernel in KERNELS:
        assert kernel in entries, f"ptxas compiled no {kernel}: {entries}"
    assert "insert_kernelIi" in entries and "insert_kernelIl" in entries, "both slot widths must be instantiated"


@pytest.mark.timeout(1200)
def test_pull_kernels_compile(build_dir):
    """``csrc/cuda/pull_kernel.cu`` (aggregate_push, encode_pull, decode_pull_) compiles and links."""
    entries = _compile_and_link(PULL_CU, build_dir)
    for kernel in PULL_KERNELS:
        assert kernel in entries, f"ptxas compiled no {kernel}: {entries}"
    # Every value dtype of the dispatch (fp32, fp64, fp16, bf16) has its encode kernel.
    for tag in ("IffE", "IddE", "IN3c104HalfEfE", "IN3c108BFloat16EfE"):
        assert f"encode_kernel{tag}" in entries, f"encode_kernel not instantiated for {tag}: {entries}"
    # No byte store of a converted half value (the pattern ptxas miscompiles: docs/gpu.md).
    ptx = _kept_ptx(PULL_CU, build_dir)
    assert "encode_kernel" in ptx, "nvcc -keep left no PTX"
    assert _byte_stores_of_converted_halves(ptx) == [], "encode_pull stores a converted bf16/fp16 value byte-wise"


@pytest.mark.timeout(1200)
def test_dgc_search_kernel_compiles(build_dir):
    """``csrc/cuda/dgc_search.cu`` (dgc_threshold_search) compiles and links, one kernel per memory dtype."""
    entries = _compile_and_link(SEARCH_CU, build_dir)
    for tag in ("IfE", "IdE", "IN3c108BFloat16EE", "IN3c104HalfEE"):
        assert f"threshold_search_kernel{tag}" in entries, f"threshold_search_kernel not instantiated for {tag}: {entries}"


@pytest.mark.timeout(1200)
def test_dgc_kept_kernels_compile(build_dir):
    """``csrc/cuda/dgc_kept.cu`` (dgc_gather_kept) compiles and links: the count kernel and the gather
    kernel for every value dtype."""
    entries = _compile_and_link(KEPT_CU, build_dir)
    assert "kept_count_kernel" in entries, entries
    for tag in ("IfE", "IdE", "IN3c108BFloat16EE", "IN3c104HalfEE"):
        assert f"gather_kept_kernel{tag}" in entries, f"gather_kept_kernel not instantiated for {tag}: {entries}"


@pytest.mark.timeout(1200)
def test_catch_up_adamw_kernel_compiles(build_dir):
    """``csrc/cuda/catch_up_adamw.cu`` (CatchUpAdamW's fused step) compiles and links, the kernel for
    every parameter dtype it takes (the per-element logic, csrc/catch_up_adamw.h, runs in the CPU op)."""
    entries = _compile_and_link(CATCH_UP_CU, build_dir)
    for tag in ("IfE", "IN3c108BFloat16EE", "IN3c104HalfEE"):
        assert f"catch_up_adamw_kernel{tag}" in entries, f"catch_up_adamw_kernel not instantiated for {tag}: {entries}"


@pytest.mark.timeout(1200)
def test_dgc_select_kernels_compile(build_dir):
    """``csrc/cuda/dgc_kernel.cu`` (dgc_accumulate_select_) compiles and links, both kernels for every
    supported pair of memory and gradient dtypes; the update's multiply and add stay two roundings (no fused multiply-add in the PTX), as on
    the CPU op and in torch."""
    entries = _compile_and_link(SELECT_CU, build_dir)
    # The update for (memory, gradient) fp32/fp32, fp64/fp64, fp32/bf16, fp32/fp16; the compaction per memory dtype.
    for tag in ("IffE", "IddE", "IfN3c108BFloat16EE", "IfN3c104HalfEE"):
        assert f"accumulate_mark_kernel{tag}" in entries, f"accumulate_mark_kernel not instantiated for {tag}: {entries}"
    for tag in ("IfE", "IdE"):
        assert f"compact_kernel{tag}" in entries, f"compact_kernel not instantiated for {tag}: {entries}"
    ptx = _kept_ptx(SELECT_CU, build_dir)
    bodies = [b for b in re.split(r"\n\.(?:visible \.)?entry ", ptx)[1:] if "accumulate_mark_kernel" in b.split("(")[0]]
    assert len(bodies) == 4 and not any(re.search(r"\bfma\.", b) for b in bodies), "the update must not fuse"


@pytest.mark.timeout(1200)
def test_dgc_sample_kernels_compile(build_dir):
    """``csrc/cuda/dgc_sample.cu`` (dgc_sample_keys, dgc_sort_unkey, dgc_all_finite) compiles and links, the sampling kernel
    for fp32, bf16 and fp16 gradients; the pending update's multiply and add stay two roundings (no
    fused multiply-add in the PTX), as in the CPU op and in torch."""
    entries = _compile_and_link(SAMPLE_CU, build_dir)
    for tag in ("IfE", "IN3c108BFloat16EE", "IN3c104HalfEE"):
        assert f"sample_keys_kernel{tag}" in entries, f"sample_keys_kernel not instantiated for {tag}: {entries}"
    assert "unkey_kernel" in entries
    for tag in ("IfE", "IdE", "IN3c108BFloat16EE", "IN3c104HalfEE"):
        assert f"all_finite_kernel{tag}" in entries, f"all_finite_kernel not instantiated for {tag}: {entries}"
    ptx = _kept_ptx(SAMPLE_CU, build_dir)
    bodies = [b for b in re.split(r"\n\.(?:visible \.)?entry ", ptx)[1:] if "sample_keys_kernel" in b.split("(")[0]]
    assert len(bodies) == 3 and not any(re.search(r"\bfma\.", b) for b in bodies), "the update must not fuse"


def _instantiated(entries: str, kernel: str, arg: str) -> bool:
    """Whether ptxas compiled ``kernel`` templated on ``arg`` (a struct of an anonymous namespace, whose
    mangled name carries a per-file hash between the two)."""
    return any(kernel in e and arg in e for e in entries.split())


@pytest.mark.timeout(1200)
def test_lowbit_kernels_compile(build_dir):
    """``csrc/cuda/lowbit.cu`` (quantize_blocks, dequantize_blocks: zen.dgc.value_bits) compiles and links, the
    quantize kernel for every value dtype."""
    entries = _compile_and_link(LOWBIT_CU, build_dir)
    assert "dequantize_kernel" in entries, entries
    for tag in ("IfE", "IdE", "IN3c108BFloat16EE", "IN3c104HalfEE"):
        assert _instantiated(entries, "quantize_kernel", f"PlainSrc{tag}"), f"no quantize_kernel for {tag}: {entries}"


@pytest.mark.timeout(1200)
def test_lowbit_fused_kernels_compile(build_dir):
    """``csrc/cuda/lowbit_fused.cu`` (quantize_sent_, dequantize_add_blocks_, quantize_owned_) compiles and links:
    the sender's quantize kernel for every value dtype, the owner's for both index dtypes, the aggregation for
    both; the sums and differences stay single roundings (no fused multiply-add in the PTX), as in torch."""
    entries = _compile_and_link(LOWBIT_FUSED_CU, build_dir)
    for tag in ("IfE", "IdE", "IN3c108BFloat16EE", "IN3c104HalfEE"):
        assert _instantiated(entries, "quantize_kernel", f"SentSrc{tag}"), f"no sender kernel for {tag}: {entries}"
    for tag in ("IiE", "IlE"):
        assert _instantiated(entries, "quantize_kernel", f"OwnedSrc{tag}"), f"no owner kernel for {tag}: {entries}"
        assert f"dequantize_add_kernel{tag}" in entries, f"no aggregation kernel for {tag}: {entries}"
    ptx = _kept_ptx(LOWBIT_FUSED_CU, build_dir)
    assert "dequantize_add_kernel" in ptx, "nvcc -keep left no PTX"
    assert not re.search(r"\bfma\.", ptx), "a sum or difference was fused into a multiply-add"


@pytest.mark.timeout(1200)
def test_dgc_int4_kernels_compile(build_dir):
    """``csrc/cuda/dgc_int4.cu`` (dgc_int4_select, dgc_int4_requantize_) compiles and links, every kernel
    for fp32, bf16 and fp16 gradients; dequantization, the velocity update and quantization stay separate
    roundings (no fused multiply-add in the PTX), as in the CPU op and in torch, and no code byte is
    stored from a converted half (the kept error casts through the gradient's dtype)."""
    entries = _compile_and_link(INT4_CU, build_dir)
    for kernel in ("int4_mark_kernel", "int4_compact_kernel", "int4_requantize_kernel"):
        for tag in ("IfE", "IN3c108BFloat16EE", "IN3c104HalfEE"):
            assert f"{kernel}{tag}" in entries, f"{kernel} not instantiated for {tag}: {entries}"
    ptx = _kept_ptx(INT4_CU, build_dir)
    bodies = [b for b in re.split(r"\n\.(?:visible \.)?entry ", ptx)[1:] if "int4_" in b.split("(")[0]]
    assert len(bodies) == 9 and not any(re.search(r"\bfma\.", b) for b in bodies), "an operation was fused"
    assert _byte_stores_of_converted_halves(ptx) == []


def _byte_stores_of_converted_halves(ptx: str) -> list[str]:
    """``st.*.u8`` instructions whose source register holds a ``cvt.rn.{f16,bf16}.f32`` result.

    ptxas (CUDA 13.0, sm_90) compiles such a store as a numeric float-to-uint8 conversion
    (``F2I.U8.F16.TRUNC``) instead of storing the low byte of the half's bits: a bf16/fp16 value written
    through ``memcpy`` into a byte buffer lost its low byte (docs/gpu.md; the reproducer: ``STORE16_CU``).
    """
    bad = []
    for body in re.split(r"\n\.(?:visible \.)?entry ", ptx)[1:]:
        halves = set(re.findall(r"cvt\.rn\.b?f16\.f32\s+(%rs\d+)", body))
        bad += [m.group(0) for m in re.finditer(r"st\.\w+\.u8\s+\[[^\]]+\],\s*(%rs\d+)", body) if m.group(1) in halves]
    return bad


# The kernels of the ptxas reproducer (docs/gpu.md): a Half/BFloat16 converted from fp32 and written
# into a byte buffer with memcpy (variant 0) or a byte loop (variant 2) got the saturated uint8 of the
# value as its low byte with nvcc 13.0 for sm_90 (an H200, 2026-11-26: bf16 214 of 300 values wrong);
# one aligned 16-bit store (variant 1, what csrc/cuda/pull_kernel.cu does) was exact.
STORE16_CU = r"""
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <cstdint>
#include <cstring>

struct H { uint16_t x; };  // like c10::Half
template <typename T> __device__ __forceinline__ void store(uint8_t* p, T v) { memcpy(p, &v, sizeof(T)); }

template <int V, bool BF>
__global__ void k(const float* acc, int n, uint8_t* out) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  float v = acc[i];
  H h;
  h.x = BF ? __bfloat16_as_ushort(__float2bfloat16(v)) : __half_as_ushort(__float2half(v));
  if (V == 0) store<H>(out + 2 * i, h);                                   // memcpy of the struct
  if (V == 1) *reinterpret_cast<uint16_t*>(out + 2 * i) = h.x;            // aligned u16
  if (V == 2) for (int b = 0; b < 2; ++b) out[2 * i + b] = reinterpret_cast<uint8_t*>(&h)[b];  // byte loop
}

template __global__ void k<0, false>(const float*, int, uint8_t*);
template __global__ void k<1, false>(const float*, int, uint8_t*);
template __global__ void k<2, false>(const float*, int, uint8_t*);
template __global__ void k<0, true>(const float*, int, uint8_t*);
template __global__ void k<1, true>(const float*, int, uint8_t*);
template __global__ void k<2, true>(const float*, int, uint8_t*);
"""


def test_byte_store_detector_finds_the_miscompiled_pattern(tmp_path):
    """The detector above flags the reproducer's memcpy and byte-loop variants, not its aligned store."""
    src, ptx = tmp_path / "store16.cu", tmp_path / "store16.ptx"
    src.write_text(STORE16_CU)
    _nvcc(["-O3", "-arch=sm_90", "-ptx", "-o", str(ptx), str(src)], timeout_s=300)
    text = ptx.read_text()
    per_kernel = {}
    for body in re.split(r"\n\.(?:visible \.)?entry ", text)[1:]:
        name = body.split("(", 1)[0]
        per_kernel[name] = _byte_stores_of_converted_halves("\n.entry " + body)
    variant = {name: int(re.search(r"ILi(\d)E", name).group(1)) for name in per_kernel}
    assert len(per_kernel) == 6, per_kernel
    for name, bad in per_kernel.items():
        assert bool(bad) == (variant[name] != 1), (name, bad)


# ---------------------------------------------------------------------------------------------------
# The torch-free harness
# ---------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def harness(build_dir):
    proc = _built(HARNESS_CU, build_dir)
    return str(build_dir / "hash_kernel_harness"), proc.stderr


def _run_harness(exe: str, idx: torch.Tensor, numel: int, n: int, keys: torch.Tensor, num_rehash: int = 3,
                 parallel_factor: float = 2.0, serial_factor: float = 0.1, threads: int = 4, slot_bits: int = 32):
    text = (
        f"{numel} {n} {num_rehash} {parallel_factor!r} {serial_factor!r} {threads} {slot_bits} {idx.numel()}\n"
        + " ".join(map(str, keys.tolist())) + "\n" + " ".join(map(str, idx.tolist())) + "\n"
    )
    proc = subprocess.run([exe], input=text, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = {line.split()[0]: line.split()[1:] for line in proc.stdout.splitlines()}
    as_tensor = lambda name: torch.tensor([int(x) for x in lines[name]], dtype=torch.int64)  # noqa: E731
    r1, r2 = (int(x) for x in lines["geometry"])
    device = " ".join(lines["device"])
    return as_tensor("counts"), as_tensor("order"), as_tensor("pos"), as_tensor("stats"), (r1, r2), device


def test_harness_builds_every_kernel(harness):
    _, ptxas_log = harness
    entries = _ptxas_entries(ptxas_log)
    for kernel in KERNELS:
        assert kernel in entries, f"ptxas compiled no {kernel}: {entries}"


def _per_partition_pairs(counts, order, pos):
    out, start = [], 0
    for c in counts.tolist():
        out.append(sorted(zip(order[start:start + c].tolist(), pos[start:start + c].tolist())))
        start += c
    return out


HARNESS_CASES = {
    # name: (numel, n, K, num_rehash, parallel_factor, serial_factor, slot_bits)
    "paper_defaults": (1 << 20, 16, 20000, 3, 2.0, 0.1, 32),
    "int64_slots": (1 << 20, 16, 20000, 3, 2.0, 0.1, 64),
    "tiny_domain_many_duplicates": (5, 7, 200, 3, 2.0, 0.1, 32),
    "one_partition": (1000, 1, 700, 3, 2.0, 0.1, 32),
    "more_partitions_than_indices": (1 << 16, 200, 50, 3, 2.0, 0.1, 32),
    "non_power_of_two_parts": (100003, 3, 5000, 2, 1.0, 0.1, 32),
    "numel_above_2_32": ((1 << 40) + 3, 8, 3000, 3, 2.0, 0.1, 32),
    "serial_only_k0": (4096, 4, 1000, 0, 2.0, 0.5, 32),
    "forced_overflow": (1 << 20, 16, 20000, 1, 0.25, 0.0, 32),
    "forced_overflow_int64_slots": (1 << 20, 5, 20000, 2, 0.5, 0.05, 64),
}


@pytest.mark.parametrize("case", sorted(HARNESS_CASES))
def test_harness_host_run_matches_cpu_op(harness, case):
    exe, _ = harness
    numel, n, K, k, pf, sf, bits = HARNESS_CASES[case]
    gen = torch.Generator().manual_seed(K + n)
    idx = torch.randint(0, numel, (K,), generator=gen)
    idx[0], idx[1], idx[-1] = 0, numel - 1, 0  # index 0 twice (empty marker), the last index
    idx[2:10] = idx[10]  # a run of duplicates
    keys = ops.derive_keys(1234)
    counts, order, pos, stats, (r1, r2), device = _run_harness(exe, idx, numel, n, keys, k, pf, sf, 4, bits)
    ref_counts, ref_order, ref_pos, _ = ops.hash_partition(idx, numel, n, keys)

    assert torch.equal(counts, ref_counts)
    assert torch.equal(torch.sort(order).values, torch.arange(K)), "every input entry exactly once (lossless)"
    assert _per_partition_pairs(counts, order, pos) == _per_partition_pairs(ref_counts, ref_order, ref_pos)
    collisions, serial, overflows = stats.tolist()
    assert (r1, r2) == (math.ceil(pf * K / n), math.ceil(sf * math.ceil(pf * K / n))), "documented geometry"
    assert collisions >= k * serial and overflows <= serial <= K
    if k == 0:
        assert serial == K and collisions == 0
    if sf == 0:
        assert overflows == serial > 0
    if case.startswith("forced_overflow"):
        assert overflows > 0
    if case in ("paper_defaults", "int64_slots"):
        # Load factor 0.5 with k = 3 sends a few percent to serial memory (seeds.md §1.5: ~3 %).
        assert 0 < serial < 0.1 * K and overflows == 0
    assert device.startswith("none") or device == "match", device


def test_harness_single_thread_is_deterministic(harness):
    exe, _ = harness
    idx = torch.randint(0, 1 << 16, (3000,), generator=torch.Generator().manual_seed(7))
    keys = ops.derive_keys(5)
    first = _run_harness(exe, idx, 1 << 16, 6, keys, threads=1)
    second = _run_harness(exe, idx, 1 << 16, 6, keys, threads=1)
    for a, b in zip(first[:4], second[:4]):
        assert torch.equal(a, b)
