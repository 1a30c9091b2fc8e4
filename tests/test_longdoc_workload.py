"""The longdoc workload (adapt/bench/workloads.py): long documentation and a request to
summarise it, built from the held-out stdlib files, and its mix with chat."""

from __future__ import annotations

from adapt.bench.workloads import LONGDOC_MIN_CHARS, LONGDOC_PART_CHARS, WORKLOADS, make_workload


def test_longdoc_prompts_are_long_documents_to_summarise():
    prompts = make_workload("longdoc", 6, seed=0)
    assert len(prompts) == 6 and {p["workload"] for p in prompts} == {"longdoc"}
    for p in prompts:
        (message,) = p["messages"]
        text = message["content"]
        assert message["role"] == "user" and text.rstrip().endswith("in one short paragraph.")
        doc = text.split("\n\n", 1)[1].rsplit("\n\n", 1)[0]
        assert LONGDOC_MIN_CHARS <= len(doc) <= LONGDOC_MIN_CHARS + LONGDOC_PART_CHARS + 200
    assert len({p["messages"][0]["content"] for p in prompts}) == 6  # different documents
    assert make_workload("longdoc", 6, seed=0) == prompts  # seeded


def test_longdoc_chat_alternates_the_two_classes():
    assert "longdoc" in WORKLOADS and "longdoc-chat" in WORKLOADS
    mix = make_workload("longdoc-chat", 5, seed=1)
    assert [p["workload"] for p in mix] == ["longdoc", "chat", "longdoc", "chat", "longdoc"]
    assert len(mix[1]["messages"][0]["content"]) < LONGDOC_MIN_CHARS < len(mix[0]["messages"][0]["content"])
