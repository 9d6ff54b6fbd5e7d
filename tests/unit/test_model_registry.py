"""The model registry (python/pagedkv/models/registry.py): each model_type's class, imported only
when a checkpoint needs it; the traits resolved from a config; docs/models.md's table is the
registry's; no other file tests a model_type."""

import pathlib
import re
import subprocess
import sys

import pytest
from transformers import AutoConfig, BertConfig

from pagedkv.models.loader import model_spec
from pagedkv.models import registry
from pagedkv.models.registry import Traits, resolve_traits

ROOT = pathlib.Path(__file__).resolve().parents[2]
TABLE_BEGIN = "<!-- model types: python -m pagedkv.models.registry --markdown -->"
TABLE_END = "<!-- end of model types -->"


def test_the_docs_table_of_model_types_is_the_registrys():
    docs = (ROOT / "docs" / "models.md").read_text()
    assert TABLE_BEGIN in docs and TABLE_END in docs, "docs/models.md lost the markers around its table"
    table = docs.split(TABLE_BEGIN, 1)[1].split(TABLE_END, 1)[0].strip("\n") + "\n"
    assert table == registry.supported_models_markdown(), (
        "docs/models.md's table of model types is not the registry's: paste python -m pagedkv.models.registry --markdown")


def test_each_model_type_names_a_class_of_its_module():
    for model_type, (module, name) in registry.MODELS.items():
        model_class = registry.model_class(model_type)
        assert (model_class.__module__, model_class.__name__) == (f"pagedkv.models.{module}", name)


def test_the_loader_imports_no_model_until_a_checkpoint_needs_one():
    # (models/ also holds the loader's own modules: the registry and the quantized checkpoint readers)
    check = ("import sys, pagedkv.models.loader, pagedkv.models.registry as r; "
             "print(sorted(m for m in sys.modules if m.removeprefix('pagedkv.models.') in {k for k, _ in r.MODELS.values()}))")
    imported = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, check=True).stdout
    assert imported.strip() == "[]"


def test_an_unsupported_model_type_is_refused_by_name(tmp_path):
    BertConfig(vocab_size=32, hidden_size=16, num_hidden_layers=1, num_attention_heads=2).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"model_type 'bert' is not supported; supported: \('llama', 'mistral'"):
        model_spec(str(tmp_path), None)


@pytest.mark.parametrize("model_type, options, expected", [
    ("llama", {}, Traits()),
    ("qwen2", {}, Traits(qkv_bias=True)),
    ("qwen3", {}, Traits(qk_norm="head")),
    ("olmo2", {}, Traits(qk_norm="projection")),
    ("glm4_moe", {"use_qk_norm": False}, Traits(unbiased_o_proj=True, router="biased_sigmoid",
                                                renormalize_experts=True)),
    ("glm4_moe", {"use_qk_norm": True}, Traits(qk_norm="head", unbiased_o_proj=True, router="biased_sigmoid",
                                               renormalize_experts=True)),
    ("exaone4", {"sliding_window": None, "sliding_window_pattern": None, "num_hidden_layers": 2,
                 "layer_types": ["full_attention"] * 2}, Traits(qk_norm="head")),
    ("exaone4", {"sliding_window": 4}, Traits(qk_norm="head", nope_full_layers=True)),
    ("gemma", {}, Traits()),
    ("gemma2", {}, Traits(sandwich_norms=True)),
    ("mixtral", {}, Traits(sparse_moe=True, renormalize_experts=True)),
    ("qwen2_moe", {"num_experts": 0}, Traits()),
    ("qwen3_moe", {"norm_topk_prob": False}, Traits(qk_norm="head", sparse_moe=True)),
    ("qwen3_moe", {"norm_topk_prob": True}, Traits(qk_norm="head", sparse_moe=True, renormalize_experts=True)),
    ("gpt_oss", {}, Traits(attention_sinks=True, sparse_moe=True, renormalize_experts=True, gpt_oss_experts=True)),
    ("deepseek_v2", {"norm_topk_prob": False}, Traits()),
    ("ernie4_5_moe", {}, Traits(interleaved_rope=True, renormalize_experts=True, router="biased_softmax")),
])
def test_traits_are_resolved_from_the_config(model_type, options, expected):
    assert resolve_traits(AutoConfig.for_model(model_type, **options)) == expected


def test_no_file_but_the_registry_tests_a_model_type():
    package = ROOT / "python" / "pagedkv"
    test = re.compile(r"model_type\s*(==|!=|\bin\b|\bnot in\b)|model_type\]|MODEL_TYPES")
    offenders = [f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
                 for path in sorted(package.rglob("*.py")) if path != package / "models" / "registry.py"
                 for number, line in enumerate(path.read_text().splitlines(), 1) if test.search(line)]
    assert offenders == []
