"""Tokenizer: GGUF-built SmolLM2 tokenizer vs transformers, chat template, streaming decode."""

import ast
import os
import sysconfig

import pytest

from llmserve.tokenizer import IncrementalDetokenizer, Tokenizer, _pre_tokenizer

UNICODE_LINES = [
    "日本語のテキストを書きます。東京は大きい都市です。",
    "中文测试：今天天气很好，我们去公园散步吧！",
    "한국어 문장도 토큰화합니다.",
    "Emoji: 😀😃😄 👩‍👩‍👧‍👦 🇯🇵 🏳️‍🌈 ❤️‍🔥 👍🏽",
    "Accents: café, naïve, façade, Ångström, São Paulo, Zürich, Œuvre, ĳ",
    "Ελληνικά: Καλημέρα κόσμε",
    "Русский текст: Съешь же ещё этих мягких французских булок.",
    "עברית: שלום עולם",
    "العربية: مرحبا بالعالم ١٢٣٤٥",
    "हिन्दी: नमस्ते दुनिया",
    "ไทย: สวัสดีชาวโลก",
    "Math: ∀x∈ℝ, x² ≥ 0; ∑ᵢ aᵢ = ½ · ∫₀¹ f(t) dt ≈ 3.14159",
    "Numbers: 0 1 12 123 1234 12345 3.14 -42 1e-5 0x1F 1_000_000 ½ ⅔ Ⅻ ①",
    "Mixed: abc123def 99bottles a1b2c3 x  1 y   22 z\t3",
    "Whitespace:    four spaces\t\ttabs\n\nnewlines  \n  trailing   ",
    "   leading spaces",
    "trailing spaces   ",
    "\n\n\n",
    "\t\t\tindented with tabs",
    "Zero width: a\u200bb\u200cc\u200dd\ufeffe",
    "Combining: e\u0301 a\u0308 n\u0303 \u0915\u094d\u0937",
    "Control-ish: \x00\x01\x7f and bell \x07",
    "Quotes: “curly” ‘single’ «guillemets» „low“ — em – en …",
    "Contractions: I'm you're they've we'll she'd it's DON'T",
    "URLs: https://example.com/path?q=1&r=2#frag user@example.org",
    "Specials inline: <|im_start|>user hi<|im_end|> <|endoftext|> <file_sep> <gh_stars>",
    "Almost special: <|im_start| <im_end|> <| im_end |> <|IM_END|>",
    "Code: def f(x): return {'a': [1, 2, 3], \"b\": (x ** 2) // 3}  # comment",
    "Private use: \ue000\uf8ff and astral 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 𓀀 🀄",
    "",
    " ",
    "a",
]

_STDLIB_FILES = ("textwrap.py", "difflib.py", "json/decoder.py", "argparse.py", "fractions.py",
                 "email/_header_value_parser.py", "calendar.py", "statistics.py")


def _stdlib_corpus(max_lines=3000):
    """Lines, multi-line blocks and docstrings from standard-library sources (offline)."""
    root = sysconfig.get_paths()["stdlib"]
    lines, blocks, docs = [], [], []
    for rel in _STDLIB_FILES:
        path = os.path.join(root, rel)
        if not os.path.exists(path):
            continue
        with open(path, encoding="utf-8") as f:
            source = f.read()
        file_lines = source.splitlines()
        lines.extend(file_lines)
        blocks.extend("\n".join(file_lines[i:i + 12]) + "\n" for i in range(0, len(file_lines), 97))
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, (ast.FunctionDef, ast.ClassDef, ast.Module)):
                doc = ast.get_docstring(node, clean=False)
                if doc:
                    docs.append(doc)
    step = max(1, len(lines) // max_lines)
    return lines[::step][:max_lines] + blocks + docs


@pytest.fixture(scope="module")
def path(gguf_path):
    return gguf_path


@pytest.fixture(scope="module")
def tok(path):
    return Tokenizer.from_gguf(path)


@pytest.fixture(scope="module")
def hf_tok(path):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(os.path.dirname(path),
                                                      gguf_file=os.path.basename(path))


@pytest.fixture(scope="module")
def corpus():
    texts = _stdlib_corpus() + UNICODE_LINES
    texts += [" " * n + "x" + "\t" * (n % 3) + "\n" * (n % 4) for n in range(1, 20)]
    texts += [" ".join(str(7 ** k) for k in range(n)) for n in range(1, 30)]
    assert len(texts) > 2000
    return texts


def _smollm_pre_tokenizer():
    from tokenizers import pre_tokenizers

    # SmolLM2's own tokenizer.json: every digit split off, then GPT-2 byte-level splitting.
    return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                    pre_tokenizers.ByteLevel(add_prefix_space=False)])


@pytest.fixture(scope="module")
def hf_ids(hf_tok, corpus):
    """transformers' ids for the corpus: as it builds the GGUF tokenizer, and with SmolLM2's
    digit-splitting pre-tokenizer (which transformers does not apply for pre="smollm")."""
    plain = hf_tok(corpus, add_special_tokens=False)["input_ids"]
    backend = hf_tok.backend_tokenizer
    original = backend.pre_tokenizer
    backend.pre_tokenizer = _smollm_pre_tokenizer()
    try:
        split = hf_tok(corpus, add_special_tokens=False)["input_ids"]
    finally:
        backend.pre_tokenizer = original
    return plain, split


def test_ids_match_transformers(tok, corpus, hf_ids):
    plain, split = hf_ids
    ours = tok.encode_batch(corpus)
    mismatches = [t for t, a, b in zip(corpus, ours, split) if a != b]
    assert not mismatches, f"{len(mismatches)} of {len(corpus)} differ, e.g. {mismatches[:3]}"
    # transformers' own GGUF build (no digit split) agrees wherever no number is involved.
    for text, a, b in zip(corpus, ours, plain):
        if a != b:
            assert any(c.isnumeric() for c in text), text
    assert [tok.encode(t) for t in corpus[:50]] == ours[:50]


def test_digits_split_like_llama_cpp(tok):
    # llama.cpp's "smollm" pre-tokenizer isolates \p{N} first, so the two spaces stay one token.
    ids = tok.encode("x  1")
    assert [tok.id_to_token(i) for i in ids] == ["x", "ĠĠ", "1"]
    assert tok.encode("2024") == [tok.token_to_id(c) for c in "2024"]


def test_decode_matches_transformers(tok, hf_tok, corpus, hf_ids):
    _, split = hf_ids
    for ids in split[::7]:
        assert tok.decode(ids) == hf_tok.decode(ids, skip_special_tokens=True)
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2 and len(ids) == 5
    assert tok.decode(ids) == "user\nhi"
    assert tok.decode(ids, skip_special_tokens=False) == "<|im_start|>user\nhi<|im_end|>"


def test_special_ids(tok, hf_tok):
    assert tok.vocab_size == 49152 == len(hf_tok)
    assert (tok.bos_token_id, tok.eos_token_id) == (1, 2)
    assert (hf_tok.bos_token_id, hf_tok.eos_token_id) == (1, 2)
    assert tok.stop_token_ids[0] == 2 and set(tok.stop_token_ids) == {0, 2}
    assert tok.special_token_ids == list(range(17))
    assert tok.encode("hi", add_special_tokens=True) == tok.encode("hi")  # add_bos_token False


CONVERSATIONS = [
    [{"role": "user", "content": "What is 2+2?"}],
    [{"role": "system", "content": "You are terse."},
     {"role": "user", "content": "Name a colour."}],
    [{"role": "system", "content": "Réponds en français. 😀"},
     {"role": "user", "content": "Bonjour"},
     {"role": "assistant", "content": "Salut ! 日本"},
     {"role": "user", "content": "Ça va ?\n\n  indented"}],
]


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("conv", range(len(CONVERSATIONS)))
def test_chat_template_matches_transformers(tok, hf_tok, conv, add_generation_prompt):
    messages = CONVERSATIONS[conv]
    ours = tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    ref = hf_tok.apply_chat_template(messages, tokenize=False,
                                     add_generation_prompt=add_generation_prompt)
    assert ours == ref
    assert ours.startswith("<|im_start|>system\n")


def test_chat_template_helpers():
    t = Tokenizer(None, chat_template="{{ strftime_now('%Y') }}{% if messages|length > 1 %}"
                                      "{{ raise_exception('one message only') }}{% endif %}")
    assert t.apply_chat_template([{"role": "user", "content": "x"}]).isdigit()
    from jinja2.exceptions import TemplateError

    with pytest.raises(TemplateError, match="one message only"):
        t.apply_chat_template([{"role": "user", "content": "x"}] * 2)
    with pytest.raises(ValueError, match="no chat template"):
        Tokenizer(None).apply_chat_template([])


STREAMS = [
    "😀👩‍👩‍👧‍👦🇯🇵 emoji streams ❤️‍🔥",
    "東京タワーは高いです。中文分词测试。한국어",
    "mixed: café ñ 🀄 𝔘𝔫𝔦 ∑ and ascii",
]


@pytest.mark.parametrize("text", STREAMS)
def test_incremental_detokenizer(tok, text):
    ids = tok.encode(text)
    detok = IncrementalDetokenizer(tok)
    deltas = [detok.add(i) for i in ids]
    assert all("\ufffd" not in d for d in deltas)
    assert "" in deltas  # some character was split across tokens and held back
    assert "".join(deltas) + detok.flush() == tok.decode(ids) == text
    assert detok.text == text


def test_incremental_detokenizer_specials_and_partial_tail(tok):
    ids = tok.encode("<|im_start|>assistant\n日本<|im_end|>")
    for skip in (True, False):
        detok = IncrementalDetokenizer(tok, skip_special_tokens=skip)
        text = "".join(detok.add(i) for i in ids) + detok.flush()
        assert text == tok.decode(ids, skip_special_tokens=skip)
    ids = tok.encode("ok 😀")[:-1]  # the emoji's last byte never arrives
    detok = IncrementalDetokenizer(tok)
    streamed = "".join(detok.add(i) for i in ids)
    assert "\ufffd" not in streamed
    assert streamed + detok.flush() == tok.decode(ids)
    ids = tok.encode("Hello there, 世界 🌍!")
    detok = IncrementalDetokenizer(tok, prompt_ids=ids[:3])
    streamed = "".join(detok.add(i) for i in ids[3:]) + detok.flush()
    assert tok.decode(ids[:3]) + streamed == tok.decode(ids)


def test_tokenizer_json_round_trip(tok, corpus, tmp_path):
    (tmp_path / "tokenizer.json").write_text(tok.to_tokenizer_json())
    again = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    sample = corpus[::5]
    assert again.encode_batch(sample) == tok.encode_batch(sample)
    for name, content in tok.files().items():
        (tmp_path / name).write_text(content)
    loaded = Tokenizer.from_pretrained_dir(str(tmp_path))
    assert (loaded.bos_token_id, loaded.eos_token_id) == (1, 2)
    assert loaded.stop_token_ids == tok.stop_token_ids
    messages = CONVERSATIONS[1]
    assert loaded.apply_chat_template(messages) == tok.apply_chat_template(messages)
    assert loaded.encode_batch(sample) == tok.encode_batch(sample)


def test_transformers_reads_our_files(tok, hf_tok, tmp_path):
    """A directory with our tokenizer files is a valid transformers tokenizer."""
    transformers = pytest.importorskip("transformers")
    for name, content in tok.files().items():
        (tmp_path / name).write_text(content)
    loaded = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    text = "x  1 日本 😀 <|im_end|>"
    assert loaded.encode(text, add_special_tokens=False) == tok.encode(text)
    assert loaded.eos_token_id == 2


def test_errors(tmp_path):
    with pytest.raises(ValueError, match="weird-pre"):
        _pre_tokenizer("weird-pre", "x.gguf")
    with pytest.raises(ValueError, match="no tokenizer.json"):
        Tokenizer.from_pretrained_dir(str(tmp_path))
    bad = tmp_path / "tokenizer.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="tokenizer.json"):
        Tokenizer.from_file(str(bad))
