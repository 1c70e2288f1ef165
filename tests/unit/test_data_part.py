"""--data_part splits the documents into two halves (pretrain on one, fine-tune on the other)."""

from __future__ import annotations

from recipes import common


def test_halves_split_the_documents_in_order():
    docs = [f"doc {i}" for i in range(7)]
    first, second = common.select_texts(docs, "first"), common.select_texts(docs, "second")
    assert first == docs[:3] and second == docs[3:] and first + second == docs
    assert common.select_texts(docs, "all") == docs
    assert common.select_texts(docs, "second", max_docs=2) == ["doc 3", "doc 4"]


def test_the_built_in_text_halves_hold_different_documents():
    docs = common.load_texts(common.BUILTIN_TEXT)
    first, second = common.select_texts(docs, "first"), common.select_texts(docs, "second")
    half = len(docs) // 2
    assert half > 20 and len(first) == half and len(second) == len(docs) - half and first[-1] is docs[half - 1]
    assert first[0] != second[0]
