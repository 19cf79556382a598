from dflash.data import ByteTokenizer, embedded_corpus


def test_byte_tokenizer_round_trip() -> None:
    tok = ByteTokenizer()
    text = "def f(x):\n    return x  # ünïcode"
    assert tok.decode(tok.encode(text)) == text


def test_embedded_split_is_disjoint_and_nonempty() -> None:
    train, heldout = embedded_corpus("train"), embedded_corpus("heldout")
    assert train and heldout
    assert not set(train) & set(heldout)
