"""Every kernel instantiation compiles with NVRTC to a CUBIN for sm_90 (H100), and one of each
source for sm_80 (A100; all of them with PAGEDKV_RECOMPILE_KERNELS=1): no GPU needed, NVRTC
comes from PyPI's nvidia-cuda-nvrtc wheel (a torch dependency). A kernel that does not compile
fails CI.

Compiling every instantiation takes ~4 minutes on 2 cores, so a pass is recorded outside the
tree (`$XDG_CACHE_HOME/pagedkv/compiled_kernels.json`, default ~/.cache) under a key of the
sources' digest (headers included), the NVRTC version, the options and the instantiations: while
the key holds, one instantiation per source compiles; the whole set compiles again whenever any
of them changes, or with PAGEDKV_RECOMPILE_KERNELS=1."""

import hashlib
import json
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from pagedkv.kernels import nvrtc, sources

RECORD = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "pagedkv" / "compiled_kernels.json"
FULL_ARCH = "sm_90"  # (every instantiation; the other architecture compiles one per source)


def compile_source(source: str, expressions: list[str], arch: str) -> dict[str, str]:
    options = [f"--gpu-architecture={arch}", f"-I{sources.cuda_source_dir()}", *sources.COMPILE_OPTIONS]
    return nvrtc.compile_to_cubin(sources.read_source(source), source, expressions, options)


def compile_key(arch: str) -> str:
    """What a pass for `arch` vouches for: these sources, compiler, options and instantiations."""
    facts = [sources.digest(), list(nvrtc.nvrtc_version()), arch, list(sources.COMPILE_OPTIONS),
             sorted(e for expressions in sources.all_instantiations().values() for e in expressions)]
    return hashlib.sha256(json.dumps(facts).encode()).hexdigest()[:16]


def recorded_passes() -> dict[str, str]:
    return json.loads(RECORD.read_text()) if RECORD.exists() else {}


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_every_kernel_compiles(arch):
    key = compile_key(arch)
    instantiations = sources.all_instantiations()
    recompile = os.environ.get("PAGEDKV_RECOMPILE_KERNELS")
    if not recompile and (arch != FULL_ARCH or recorded_passes().get(arch) == key):
        # Compiled whole before under this key (or not the full architecture): one instantiation per
        # source still compiles now (the compiler and the sources load here), the rest is vouched
        # for by the record.
        instantiations = {source: expressions[:1] for source, expressions in instantiations.items()}
    chunks = []
    for source, expressions in instantiations.items():
        # Split the big attention source in a few programs compiled in parallel.
        for begin in range(0, len(expressions), 80):
            chunks.append((source, expressions[begin : begin + 80]))
    with ThreadPoolExecutor(max_workers=2) as pool:
        results = list(pool.map(lambda chunk: compile_source(*chunk, arch), chunks))
    lowered = {expression: name for result in results for expression, name in result.items()}
    assert set(lowered) == {e for expressions in instantiations.values() for e in expressions}
    assert all(name for name in lowered.values())
    if instantiations == sources.all_instantiations():
        RECORD.parent.mkdir(parents=True, exist_ok=True)
        RECORD.write_text(json.dumps({**recorded_passes(), arch: key}, indent=1, sort_keys=True) + "\n")


def test_the_compile_key_changes_with_the_sources(tmp_path, monkeypatch):
    import shutil

    copy = tmp_path / "cuda"
    shutil.copytree(sources.cuda_source_dir(), copy)
    monkeypatch.setenv("PAGEDKV_CUDA_DIR", str(copy))
    sources.digest.cache_clear()
    try:
        before = compile_key("sm_90")
        kernel = copy / "cache_ops.cu"
        kernel.write_text(kernel.read_text() + "\n// changed\n")
        sources.digest.cache_clear()
        assert compile_key("sm_90") != before and compile_key("sm_80") != compile_key("sm_90")
    finally:
        sources.digest.cache_clear()


def test_a_broken_kernel_fails_with_the_compiler_log():
    broken = sources.read_source(sources.CACHE_OPS_SOURCE).replace("= cache[source + word]", "= no_such_name", 1)
    options = ["--gpu-architecture=sm_90", f"-I{sources.cuda_source_dir()}"]
    with pytest.raises(nvrtc.KernelCompileError, match="no_such_name"):
        nvrtc.compile_to_cubin(broken, "cache_ops.cu", [sources.COPY_BLOCKS_KERNEL], options)


def test_the_sources_digest_covers_included_headers(tmp_path, monkeypatch):
    """CuPy's disk cache keys on the compiled text and options only: the launcher passes this
    digest as an option, so a changed header must change it."""
    import shutil

    copy = tmp_path / "cuda"
    shutil.copytree(sources.cuda_source_dir(), copy)
    monkeypatch.setenv("PAGEDKV_CUDA_DIR", str(copy))
    sources.digest.cache_clear()
    try:
        before = sources.digest()
        header = copy / "pagedkv_common.cuh"
        header.write_text(header.read_text() + "\n// changed\n")
        sources.digest.cache_clear()
        assert sources.digest() != before
    finally:
        sources.digest.cache_clear()
