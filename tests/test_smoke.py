from dflash.data.corpus import embedded_corpus, is_heldout
from dflash.data.tokenizer import ByteTokenizer


def test_byte_tokenizer_round_trip() -> None:
    tok = ByteTokenizer()
    text = "def f(x):\n    return x  # ünïcode"
    assert tok.decode(tok.encode(text)) == text


def test_embedded_split_is_deterministic_and_nonempty() -> None:
    train, heldout = embedded_corpus("train"), embedded_corpus("heldout")
    assert len(train) > 10 * len(heldout) > 0
    assert is_heldout("json/decoder.py", 0.05) == is_heldout("json/decoder.py", 0.05)
