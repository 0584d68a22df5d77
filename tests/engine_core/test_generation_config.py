"""generation_config.json as vLLM applies it: its eos ids stop requests (unless ignore_eos),
its sampling values are defaults of requests that omit them (--generation-config,
--override-generation-config)."""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

import pytest

from engine_core import LLM, SamplingParams
from engine_core.arg_utils import add_engine_args, engine_config_from_args
from engine_core.config import ModelConfig
from engine_core.errors import ConfigError
from engine_core.models.generation_config import GenerationDefaults, load_generation_defaults

IM_END = 2  # the demo tokenizer's <|im_end|>: in generation_config.json's eos ids only
ENDOFTEXT = 0  # <|endoftext|>: config.json's eos (the engine's own) and the tokenizer's


def _model_dir(tmp_path: Path, generation: dict | None, eos: int | list[int] = 0) -> Path:
    """A folder with the config.json keys the loader reads (and a generation config)."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "vocab_size": 100, "hidden_size": 8,
        "intermediate_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2,
        "eos_token_id": eos}))
    if generation is not None:
        (tmp_path / "generation_config.json").write_text(json.dumps(generation))
    return tmp_path


def _load(path: Path, tokenizer_eos: int | None = None, **model: object) -> GenerationDefaults:
    return load_generation_defaults(ModelConfig(model=str(path), **model), tokenizer_eos)


QWEN_LIKE = {"eos_token_id": [7, 9], "temperature": 0.7, "top_p": 0.8, "top_k": 20,
             "repetition_penalty": 1.05, "do_sample": True, "pad_token_id": 9}


def test_auto_reads_the_models_sampling_values_and_eos_ids(tmp_path, caplog):
    caplog.set_level(logging.INFO, "pdserve.generation_config")
    got = _load(_model_dir(tmp_path, QWEN_LIKE, eos=7), tokenizer_eos=7)
    # 7 is config.json's eos: the engine stops at it already (stop_reason None, as vLLM's
    # primary eos); 9 only the generation config names.
    assert got.stop_token_ids == (9,)
    assert got.sampling == {"temperature": 0.7, "top_p": 0.8, "top_k": 20,
                            "repetition_penalty": 1.05}
    assert "Default sampling parameters" in caplog.text and "0.7" in caplog.text


def test_vllm_mode_ignores_sampling_values_but_not_eos_ids(tmp_path):
    got = _load(_model_dir(tmp_path, QWEN_LIKE, eos=7), generation_config="vllm")
    assert got.sampling == {} and got.stop_token_ids == (9,)


def test_override_sets_values_over_the_files(tmp_path):
    path = _model_dir(tmp_path, QWEN_LIKE, eos=7)
    got = _load(path, override_generation_config={"temperature": 0.2, "min_p": 0.1})
    assert got.sampling["temperature"] == 0.2 and got.sampling["min_p"] == 0.1
    assert got.sampling["top_k"] == 20
    only = _load(path, generation_config="vllm", override_generation_config={"top_k": 5})
    assert only.sampling == {"top_k": 5}


def test_a_folder_names_its_own_file(tmp_path):
    model = _model_dir(tmp_path / "model", {"eos_token_id": 3, "temperature": 0.5})
    elsewhere = _model_dir(tmp_path / "other", {"eos_token_id": [4], "top_p": 0.5})
    got = _load(model, generation_config=str(elsewhere))
    assert got.sampling == {"top_p": 0.5} and got.stop_token_ids == (4,)
    with pytest.raises(ConfigError, match="generation_config.json"):
        _load(model, generation_config=str(tmp_path / "nowhere"))


def test_tokenizer_eos_stops_too_and_ids_outside_the_vocabulary_are_dropped(tmp_path):
    got = _load(_model_dir(tmp_path, {"eos_token_id": [5, 100, 5]}), tokenizer_eos=6)
    assert got.stop_token_ids == (5, 6)
    assert _load(_model_dir(tmp_path / "none", None)).stop_token_ids == ()


@pytest.mark.parametrize("override,match", [
    ({"temperature": -1}, "temperature"), ({"top_p": "high"}, "top_p"),
])
def test_bad_default_values_are_a_startup_error(tmp_path, override, match):
    with pytest.raises(ConfigError, match=match):
        _load(_model_dir(tmp_path, {}), override_generation_config=override)


def test_unsupported_override_keys_are_refused():
    with pytest.raises(ConfigError, match="max_new_tokens"):
        ModelConfig(model="m", override_generation_config={"max_new_tokens": 5})


def test_request_values_win_and_ignore_eos_adds_no_stop_ids():
    defaults = GenerationDefaults((9, 4), {"temperature": 0.7, "top_k": 20})
    kwargs = defaults.request_kwargs({"temperature": 0.0, "stop_token_ids": [4, 1]})
    assert kwargs == {"temperature": 0.0, "top_k": 20, "stop_token_ids": [4, 1, 9]}
    assert "stop_token_ids" not in defaults.request_kwargs({"ignore_eos": True})
    params = SamplingParams(stop_token_ids=[1])
    assert defaults.stopping(params).stop_token_ids == [1, 9, 4]
    assert params.stop_token_ids == [1]  # the caller's params are not changed
    ignoring = SamplingParams(ignore_eos=True)
    assert defaults.stopping(ignoring) is ignoring


def _flags(*argv: str) -> argparse.Namespace:
    parser = add_engine_args(argparse.ArgumentParser())
    parser.add_argument("model")
    return parser.parse_args(["/m", *argv])


def test_flags_reach_the_model_config():
    config = engine_config_from_args(_flags(
        "--generation-config", "vllm", "--override-generation-config", '{"temperature": 0.5}'))
    assert config.model.generation_config == "vllm"
    assert config.model.override_generation_config == {"temperature": 0.5}
    assert engine_config_from_args(_flags()).model.generation_config == "auto"
    for bad in ("{not json", "[1]", '{"eos_token_id": 3}'):
        with pytest.raises(ConfigError, match="--override-generation-config"):
            engine_config_from_args(_flags("--override-generation-config", bad))


# ---- the offline LLM ------------------------------------------------------------------


@pytest.fixture(scope="module")
def llm(tiny_checkpoint) -> LLM:
    return LLM(str(tiny_checkpoint("qwen3")), max_model_len=128, num_gpu_blocks_override=64)


def test_generation_config_eos_stops_a_request(llm):
    """The checkpoint's generation_config.json names <|im_end|> an eos token: vLLM stops
    there ("stop", the id as stop_reason, no text for it); it used to run to max_tokens."""
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=6, logit_bias={IM_END: 100}))[0].outputs[0]
    assert (out.token_ids, out.finish_reason, out.stop_reason, out.text) == (
        [IM_END], "stop", IM_END, "")
    ignoring = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=6, ignore_eos=True,
                                                        logit_bias={IM_END: 100}))[0].outputs[0]
    assert ignoring.token_ids == [IM_END] * 6 and ignoring.finish_reason == "length"
    eos = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=6, logit_bias={ENDOFTEXT: 100}))[0].outputs[0]
    assert (eos.token_ids, eos.finish_reason, eos.stop_reason) == ([ENDOFTEXT], "stop", None)


def test_min_tokens_holds_back_generation_config_eos(llm):
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=6, min_tokens=3,
                                                   logit_bias={IM_END: 100}))[0].outputs[0]
    assert len(out.token_ids) == 4 and out.token_ids[-1] == IM_END
    assert IM_END not in out.token_ids[:3] and out.stop_reason == IM_END


def test_default_params_come_from_the_generation_config(tiny_checkpoint, tmp_path):
    """A folder (--generation-config PATH) asking for greedy decoding: generate() without
    params is greedy; an override wins over the file; explicit params win over both."""
    folder = tmp_path / "greedy"
    folder.mkdir()
    (folder / "generation_config.json").write_text(json.dumps({"temperature": 0.0,
                                                              "top_k": 3}))
    llm = LLM(str(tiny_checkpoint("qwen3")), max_model_len=128, num_gpu_blocks_override=64,
              generation_config=str(folder), override_generation_config={"top_k": 1})
    defaults = llm.get_default_sampling_params()
    assert (defaults.temperature, defaults.top_k) == (0.0, 1)
    prompts = [[5, 6, 7], [9, 10]]
    greedy = SamplingParams(temperature=0.0, max_tokens=16)
    assert ([o.outputs[0].token_ids for o in llm.generate(prompts)]
            == [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)])
    assert llm.get_default_sampling_params().max_tokens == 16  # vLLM's offline default
