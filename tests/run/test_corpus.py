"""The held-out corpus (``eigenhooks.run.corpus``): the standard library's docstrings, named, pinned and split.

The replication study (docs/findings.md, "The verdict's null") needs independent documents that every machine has,
in the same order, split the same way on every run: checked here on this interpreter's standard library and on a
folder of three files made for the test."""

from __future__ import annotations

import pytest

from eigenhooks.run.corpus import describe, digest, split, stdlib_docstrings


@pytest.fixture(scope="module")
def docs():
    return stdlib_docstrings()


def test_the_stdlib_corpus_is_many_named_documents_and_the_same_each_time(docs):
    assert len(docs) > 1000 and len({d.name for d in docs}) == len(docs)  # unique names
    assert all(len(d.text) >= 300 for d in docs) and len({d.text for d in docs}) == len(docs)  # no duplicate text
    assert digest(docs) == digest(stdlib_docstrings()) and "standard-library docstrings" in describe(docs)


def test_split_is_disjoint_whole_and_independent_of_order(docs):
    docs = docs[:400]
    a, b = split(docs, seed=0)
    assert {d.name for d in a}.isdisjoint({d.name for d in b}) and len(a) + len(b) == len(docs)
    assert 150 < len(a) < 250  # a fair coin per document
    ra, rb = split(list(reversed(docs)), seed=0)
    assert {d.name for d in ra} == {d.name for d in a} and {d.name for d in rb} == {d.name for d in b}
    assert {d.name for d in split(docs, seed=1)[0]} != {d.name for d in a}  # the seed chooses the halves


def test_documents_are_read_without_importing_and_in_file_order(tmp_path):
    (tmp_path / "b.py").write_text('"""' + "b " * 200 + '"""\nraise SystemExit("imported!")\n')
    (tmp_path / "a.py").write_text(
        '"""' + "a " * 200 + '"""\nclass K:\n    """' + "k " * 200 + '"""\n    def f(self):\n        """short"""\n'
    )
    (tmp_path / "test").mkdir()
    (tmp_path / "test" / "c.py").write_text('"""' + "c " * 200 + '"""\n')  # the test suites are left out
    docs = stdlib_docstrings(root=tmp_path)
    assert [d.name for d in docs] == ["a.py:<module>", "a.py:K", "b.py:<module>"]  # f's docstring is too short
