"""Generated text holds whole characters only: generation cut by max_new_tokens inside a multi-byte character (the
tiny Qwen2-VL's byte-level BPE splits 'ß' and '😀' over several tokens) drops the incomplete character instead of
writing U+FFFD into a pre-annotation."""

from pipeline.model.families import FAMILIES
from pipeline.model.tiny import build_tokenizer
from pipeline.scoring import REPLACEMENT, decode_whole


def test_a_cut_inside_a_character_drops_it_and_whole_text_is_unchanged():
    tok = build_tokenizer(FAMILIES["qwen2_vl"])
    for word in ("Smaß", "Sma😀", "café"):
        ids = tok(word, add_special_tokens=False)["input_ids"]
        cuts = [tok.decode(ids[:k]) for k in range(1, len(ids))]
        assert any(REPLACEMENT in c for c in cuts), f"{word}: the tokenizer no longer splits a character"
        for k in range(1, len(ids)):
            text = decode_whole(tok, ids[:k])
            assert REPLACEMENT not in text and word.startswith(text), (word, k, text)
        assert decode_whole(tok, ids) == word
    assert decode_whole(tok, tok("Sma😀", add_special_tokens=False)["input_ids"][:3]) == "Sma"
    # A U+FFFD the model wrote inside its answer stays: only the cut at the end is repaired.
    inner = tok("a\ufffdb", add_special_tokens=False)["input_ids"]
    assert decode_whole(tok, inner) == "a\ufffdb"
