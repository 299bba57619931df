"""The ``llmserve`` command: dispatch, flag spelling, and the chat's streaming loop."""

import pytest

from llmserve import cli
from llmserve.config import preset
from llmserve.engine import Engine, EngineConfig
from llmserve.model import init_params
from llmserve.reference import generate_reference
from llmserve.sampling_params import SamplingParams
from llmserve.serve import default_model_name


def test_usage_and_unknown_subcommand(capsys):
    for argv, code in ((["llmserve"], 2), (["llmserve", "frobnicate"], 2),
                       (["llmserve", "--help"], 0)):
        with pytest.raises(SystemExit) as e:
            cli.main(argv)
        assert e.value.code == code
        assert "llmserve serve" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="usage: llmserve bench"):
        cli.main(["llmserve", "bench", "nope"])


def test_flag_spelling_and_model_names():
    assert cli.dashes_to_underscores(["--served-model-name=a-b", "--max-num-seqs", "4", "-v"]) \
        == ["--served_model_name=a-b", "--max_num_seqs", "4", "-v"]
    assert default_model_name(None) == "SmolLM2-135M-Instruct"
    assert default_model_name("/models/llama-3/") == "llama-3"
    assert default_model_name("/m/qwen.gguf") == "qwen"


def test_chat_streams_the_reply(gguf_path):
    from llmserve.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf(gguf_path)
    cfg = preset("tiny-9-3").replace(vocab_size=tok.vocab_size)
    params = init_params(cfg, seed=1)
    engine = Engine(cfg, params, tok, EngineConfig(
        max_model_len=128, max_num_seqs=2, page_size=8, prefill_buckets=((1, 64),),
        decode_buckets=(2,)))
    prompt = tok.apply_chat_template([{"role": "user", "content": "Hello there"}])
    pieces = []
    text = cli.stream_reply(engine, "c0", prompt, SamplingParams(
        temperature=0, max_tokens=12, ignore_eos=True), pieces.append)
    want = generate_reference(params, cfg, [tok.encode(prompt)], 12)[0]
    assert "".join(pieces) == text == tok.decode(want)
    assert len(pieces) > 1  # it streamed
