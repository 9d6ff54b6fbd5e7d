"""Every kernel instantiation compiles with NVRTC to a CUBIN for sm_90 (H100), and one of each
source for sm_80 (A100): no GPU needed, NVRTC comes from PyPI's nvidia-cuda-nvrtc wheel (a torch
dependency). A kernel that does not compile fails CI.

Compiling all 668 instantiations takes ~6 minutes on 2 cores, so a whole pass is recorded under a
key of what compiled (sources with their headers, NVRTC version, options, instantiations): in
tests/kernels/compiled_kernels.json, written by `scripts/compile_kernels.py` and committed with a
kernel change, and in `$XDG_CACHE_HOME/pagedkv/compiled_kernels.json` (default ~/.cache) by this
test. While either key holds, one instantiation per source compiles now (the compiler and every
source still load); the whole set compiles whenever anything in the key changes, or with
PAGEDKV_RECOMPILE_KERNELS=1."""

import json
import os
from pathlib import Path

import pytest

from pagedkv.kernels import nvrtc, sources

CHECKED_IN_RECORD = Path(__file__).with_name("compiled_kernels.json")
RECORD = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "pagedkv" / "compiled_kernels.json"
FULL_ARCH = "sm_90"  # (every instantiation; the other architecture compiles one per source)


def recorded_passes(record: Path) -> dict[str, str]:
    return json.loads(record.read_text()) if record.exists() else {}


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_every_kernel_compiles(arch):
    key = nvrtc.compile_key(arch)
    instantiations = sources.all_instantiations()
    vouched = any(recorded_passes(record).get(arch) == key for record in (CHECKED_IN_RECORD, RECORD))
    if not os.environ.get("PAGEDKV_RECOMPILE_KERNELS") and (arch != FULL_ARCH or vouched):
        instantiations = {source: expressions[:1] for source, expressions in instantiations.items()}
    lowered = nvrtc.compile_instantiations(instantiations, arch)
    assert set(lowered) == {e for expressions in instantiations.values() for e in expressions}
    assert all(name for name in lowered.values())
    if instantiations == sources.all_instantiations():
        RECORD.parent.mkdir(parents=True, exist_ok=True)
        RECORD.write_text(json.dumps({**recorded_passes(RECORD), arch: key}, indent=1, sort_keys=True) + "\n")


def test_the_compile_key_changes_with_the_sources(tmp_path, monkeypatch):
    import shutil

    copy = tmp_path / "cuda"
    shutil.copytree(sources.cuda_source_dir(), copy)
    monkeypatch.setenv("PAGEDKV_CUDA_DIR", str(copy))
    sources.digest.cache_clear()
    try:
        before = nvrtc.compile_key("sm_90")
        kernel = copy / "cache_ops.cu"
        kernel.write_text(kernel.read_text() + "\n// changed\n")
        sources.digest.cache_clear()
        assert nvrtc.compile_key("sm_90") != before and nvrtc.compile_key("sm_80") != nvrtc.compile_key("sm_90")
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
