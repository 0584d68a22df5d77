"""Config-only shape dirs with the word tokenizer: dummy weights serve visible text."""

from __future__ import annotations

from pathlib import Path

from benchmarks.model_shapes import write_model_dir

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, vocab_size=4096, max_position_embeddings=1024,
            torch_dtype="float32")


def test_word_tokenizer_covers_the_vocabulary_and_round_trips(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    write_model_dir("qwen3-0.6b", tmp_path, "words", **TINY)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    assert tokenizer.vocab_size == 4096
    ids = [0, 17, 4092, 4093, 4094, 4095, 9]
    assert tokenizer.encode(tokenizer.decode(ids)) == ids
    assert all(tokenizer.decode([i]) for i in ids)


def test_dummy_model_generates_text(tmp_path: Path) -> None:
    from engine_core.llm import LLM
    from engine_core.sampling_params import SamplingParams

    write_model_dir("qwen3-0.6b", tmp_path, "words", **TINY)
    llm = LLM(str(tmp_path), load_format="dummy", max_model_len=256,
              num_gpu_blocks_override=64, device="cpu")
    out = llm.generate([[5, 6, 7, 8]], SamplingParams(temperature=0, max_tokens=6,
                                                      ignore_eos=True))[0].outputs[0]
    assert len(out.token_ids) == 6
    assert len(out.text.split()) == 6  # every sampled id decodes to one word
