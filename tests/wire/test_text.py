from pergrad.wire.text import QUOTED_CHARS, quoted


def test_a_short_text_is_quoted_whole() -> None:
    assert quoted("mnist_mlp") == "'mnist_mlp'"


def test_a_long_text_is_cut_with_its_length_said() -> None:
    text = "m" * (QUOTED_CHARS + 1)
    assert quoted(text) == f"{'m' * QUOTED_CHARS!r}... ({QUOTED_CHARS + 1} characters)"
