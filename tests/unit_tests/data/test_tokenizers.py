"""Tokenizers behind --tokenizer-type: ids, EOD, vocabulary size and bad inputs."""

from __future__ import annotations

import json

import pytest

from megatron_lsgd.training.tokenizer import TokenizerConfig, build_tokenizer, padded_vocab_size
from megatron_lsgd.training.tokenizer.gpt2_bpe import bytes_to_unicode

from datatest_utils import SP_MODEL

TEXT = "def f(x):\n    return x  + 1  # Ünïcødé 😀\n\nDone."


def test_null_tokenizer():
    tok = build_tokenizer(TokenizerConfig("NullTokenizer", vocab_size=1000))
    assert (tok.vocab_size, tok.eod) == (1000, 999)
    assert tok.tokenize("3 1 4") == [3, 1, 4] and tok.detokenize([3, 1, 4]) == "3 1 4"
    with pytest.raises(ValueError, match="outside"):
        tok.tokenize("1000")
    with pytest.raises(ValueError, match="needs --vocab-size"):
        build_tokenizer(TokenizerConfig("NullTokenizer"))


def test_sentencepiece_tokenizer_megatron_layout():
    tok = build_tokenizer(TokenizerConfig("SentencePieceTokenizer", tokenizer_model=SP_MODEL))
    # 8192 pieces, then <CLS> <SEP> <EOD> <MASK> <PAD> appended (the model has no pad piece).
    assert tok.vocab_size == 8197 and tok.eod == 8194
    ids = tok.tokenize(TEXT)
    assert max(ids) < 8192 and tok.detokenize(ids) == TEXT
    special = tok.tokenize("a<EOD>b")  # appended specials written literally map to their ids
    assert special.count(8194) == 1 and tok.detokenize(special) == "a<EOD>b"
    assert padded_vocab_size(tok.vocab_size, 128, 2) == 8448


def test_gpt_sentencepiece_tokenizer():
    tok = build_tokenizer(TokenizerConfig("GPTSentencePieceTokenizer", tokenizer_model=SP_MODEL))
    assert (tok.vocab_size, tok.eod) == (8192, 2)
    assert tok.detokenize(tok.tokenize(TEXT)) == TEXT


def test_sentencepiece_bad_model(tmp_path):
    with pytest.raises(FileNotFoundError, match="missing.model"):
        build_tokenizer(TokenizerConfig("SentencePieceTokenizer", tokenizer_model=str(tmp_path / "missing.model")))
    bad = tmp_path / "bad.model"
    bad.write_bytes(b"not a model")
    with pytest.raises(ValueError, match="bad.model: not a valid sentencepiece model"):
        build_tokenizer(TokenizerConfig("GPTSentencePieceTokenizer", tokenizer_model=str(bad)))


@pytest.fixture
def gpt2_files(tmp_path):
    symbols = list(bytes_to_unicode().values())
    merges = [("l", "l"), ("h", "e"), ("he", "ll"), ("hell", "o"), ("Ġ", "w"), ("Ġw", "o")]
    vocab = {s: i for i, s in enumerate(symbols)}
    for a, b in merges:
        vocab[a + b] = len(vocab)
    vocab["<|endoftext|>"] = len(vocab)
    (tmp_path / "vocab.json").write_text(json.dumps(vocab))
    (tmp_path / "merges.txt").write_text("#version: 0.2\n" + "\n".join(f"{a} {b}" for a, b in merges) + "\n")
    return str(tmp_path / "vocab.json"), str(tmp_path / "merges.txt"), vocab


def test_gpt2_bpe(gpt2_files):
    vocab_file, merge_file, vocab = gpt2_files
    tok = build_tokenizer(TokenizerConfig("GPT2BPETokenizer", vocab_file=vocab_file, merge_file=merge_file))
    assert tok.vocab_size == 263 and tok.eod == vocab["<|endoftext|>"]
    ids = tok.tokenize("hello world")
    assert [tok.decoder[i] for i in ids] == ["hello", "Ġwo", "r", "l", "d"]
    assert tok.detokenize(tok.tokenize(TEXT)) == TEXT


def test_gpt2_bpe_bad_files(gpt2_files, tmp_path):
    vocab_file, merge_file, _ = gpt2_files
    with pytest.raises(FileNotFoundError, match="nomerges.txt"):
        build_tokenizer(TokenizerConfig("GPT2BPETokenizer", vocab_file=vocab_file,
                                        merge_file=str(tmp_path / "nomerges.txt")))
    bad = tmp_path / "bad_merges.txt"
    bad.write_text("l l\nthree parts here\n")
    with pytest.raises(ValueError, match=r"bad_merges.txt:2: expected two space-separated symbols"):
        build_tokenizer(TokenizerConfig("GPT2BPETokenizer", vocab_file=vocab_file, merge_file=str(bad)))
    no_eod = tmp_path / "noeod.json"
    no_eod.write_text(json.dumps({"a": 0}))
    with pytest.raises(ValueError, match=r"noeod.json: vocabulary has no <\|endoftext\|>"):
        build_tokenizer(TokenizerConfig("GPT2BPETokenizer", vocab_file=str(no_eod), merge_file=merge_file))


def test_huggingface_tokenizer(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import models, pre_tokenizers, trainers

    hf = tokenizers.Tokenizer(models.BPE(unk_token="[UNK]"))
    hf.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.BpeTrainer(vocab_size=120, special_tokens=["[UNK]", "<|endoftext|>"])
    hf.train_from_iterator(["hello world", "the world says hello", "held worlds"] * 10, trainer)
    (tmp_path / "dir").mkdir()
    hf.save(str(tmp_path / "dir" / "tokenizer.json"))
    for path in (str(tmp_path / "dir" / "tokenizer.json"), str(tmp_path / "dir")):
        tok = build_tokenizer(TokenizerConfig("HuggingFaceTokenizer", tokenizer_model=path))
        assert tok.eod == hf.token_to_id("<|endoftext|>") and tok.vocab_size == hf.get_vocab_size()
        ids = tok.tokenize("hello world")
        assert ids == hf.encode("hello world").ids and "hello" in tok.detokenize(ids)
    with pytest.raises(FileNotFoundError, match="nothing-here"):
        build_tokenizer(TokenizerConfig("HuggingFaceTokenizer", tokenizer_model=str(tmp_path / "nothing-here")))


def test_unknown_tokenizer_type():
    with pytest.raises(ValueError, match="choose one of"):
        build_tokenizer(TokenizerConfig("WordPiece"))


def test_gpt2_bpe_matches_huggingface_byte_level(tmp_path):
    """Our BPE gives the same ids as the `tokenizers` byte-level BPE on its own vocab/merges."""
    pytest.importorskip("tokenizers")
    from tokenizers import ByteLevelBPETokenizer

    corpus = [TEXT, "The quick brown fox's 123 jumps; isn't it?", "  indented   code(x)\n\tand tabs"] * 20
    hf = ByteLevelBPETokenizer()
    hf.train_from_iterator(corpus, vocab_size=400, min_frequency=1, special_tokens=["<|endoftext|>"])
    hf.save_model(str(tmp_path))
    tok = build_tokenizer(TokenizerConfig("GPT2BPETokenizer", vocab_file=str(tmp_path / "vocab.json"),
                                          merge_file=str(tmp_path / "merges.txt")))
    for text in corpus[:3] + ["unseen wörds 42!"]:
        assert tok.tokenize(text) == hf.encode(text).ids
        assert tok.detokenize(tok.tokenize(text)) == text
