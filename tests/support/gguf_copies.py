"""A GGUF file's copy with its quantized tensors stored as another type (BF16 here), in Python
with gguf-py (llama.cpp's llama-quantize is not installed in CI): every metadata field and float
tensor as it was, each quantized tensor dequantized and stored again."""

import os

import gguf
import numpy as np


def requantized_copy(source: str, target: str, kind: gguf.GGMLQuantizationType, file_type: gguf.LlamaFileType) -> str:
    reader = gguf.GGUFReader(source)
    architecture = reader.fields[gguf.Keys.General.ARCHITECTURE].contents()
    writer = gguf.GGUFWriter(target, architecture)
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue  # (the writer writes these itself)
        value_type = field.types[0]
        value = int(file_type) if field.name == gguf.Keys.General.FILE_TYPE else field.contents()
        writer.add_key_value(field.name, value, value_type,
                             sub_type=field.types[-1] if value_type == gguf.GGUFValueType.ARRAY else None)
    for tensor in reader.tensors:
        if tensor.tensor_type in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
            writer.add_tensor(tensor.name, np.array(tensor.data))
        else:
            values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
            writer.add_tensor(tensor.name, gguf.quants.quantize(values, kind), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return target


def tiny_gguf(target: str, architecture: str, kind: gguf.GGMLQuantizationType, hidden: int = 128, layers: int = 2,
              heads: int = 4, kv_heads: int = 2, intermediate: int = 256, qkv_bias: bool = False,
              tied: bool = True, seed: int = 0, part_kinds: dict | None = None) -> str:
    """A GGUF of random weights of `architecture` ("llama", "qwen2", ...) at a tiny shape, its
    matrices stored as `kind` (a layer's "attn_v" etc. as `part_kinds` names, as a Q4_K_M file
    mixes types), norms and biases float32, with the embedded model's tokenizer."""
    from pagedkv.models.loader import default_model_path

    source = gguf.GGUFReader(os.path.join(*default_model_path()))
    writer = gguf.GGUFWriter(target, architecture)
    for field in source.fields.values():
        if field.name.startswith(("general.", "tokenizer.")) and field.name != gguf.Keys.General.ARCHITECTURE:
            value_type = field.types[0]
            writer.add_key_value(field.name, field.contents(), value_type,
                                 sub_type=field.types[-1] if value_type == gguf.GGUFValueType.ARRAY else None)
    vocab = len(source.fields["tokenizer.ggml.tokens"].data)
    for key, value in (("context_length", 2048), ("embedding_length", hidden), ("block_count", layers),
                       ("feed_forward_length", intermediate), ("attention.head_count", heads),
                       ("attention.head_count_kv", kv_heads), ("vocab_size", vocab)):
        writer.add_uint32(f"{architecture}.{key}", value)
    writer.add_float32(f"{architecture}.rope.freq_base", 10000.0)
    writer.add_float32(f"{architecture}.attention.layer_norm_rms_epsilon", 1e-6)
    rng = np.random.default_rng(seed)

    def matrix(name: str, rows: int, columns: int) -> None:
        values = rng.standard_normal((rows, columns), dtype=np.float32) * 0.05
        stored = (part_kinds or {}).get(name.split(".")[2] if name.startswith("blk.") else name, kind)
        writer.add_tensor(name, gguf.quants.quantize(values, stored), raw_dtype=stored)

    def vector(name: str, size: int, around: float) -> None:
        writer.add_tensor(name, (around + 0.1 * rng.standard_normal(size)).astype(np.float32))

    kv_rows = kv_heads * (hidden // heads)
    matrix("token_embd.weight", vocab, hidden)
    vector("output_norm.weight", hidden, 1.0)
    if not tied:
        matrix("output.weight", vocab, hidden)
    for i in range(layers):
        vector(f"blk.{i}.attn_norm.weight", hidden, 1.0)
        vector(f"blk.{i}.ffn_norm.weight", hidden, 1.0)
        for part, rows in (("attn_q", hidden), ("attn_k", kv_rows), ("attn_v", kv_rows)):
            matrix(f"blk.{i}.{part}.weight", rows, hidden)
            if qkv_bias:
                vector(f"blk.{i}.{part}.bias", rows, 0.0)
        matrix(f"blk.{i}.attn_output.weight", hidden, hidden)
        matrix(f"blk.{i}.ffn_gate.weight", intermediate, hidden)
        matrix(f"blk.{i}.ffn_up.weight", intermediate, hidden)
        matrix(f"blk.{i}.ffn_down.weight", hidden, intermediate)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return target
