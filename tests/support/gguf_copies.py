"""A GGUF file's copy with its quantized tensors stored as another type (BF16 here), in Python
with gguf-py (llama.cpp's llama-quantize is not installed in CI): every metadata field and float
tensor as it was, each quantized tensor dequantized and stored again."""

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
