"""Writing tiny random-weight HF checkpoints with an offline-built tokenizer."""



def save_tiny_checkpoint(directory, model) -> str:
    """Saves a random HF model as safetensors next to a word-level tokenizer over ids 0-255
    (<unk>, <s>, </s>, then w3..w255); returns the directory."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    model.save_pretrained(directory, safe_serialization=True)
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, 256)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    tokenizer.save_pretrained(directory)
    return str(directory)
