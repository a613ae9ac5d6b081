"""sluice.Engine: the same request path in-process, without HTTP."""

from __future__ import annotations

import asyncio

import pytest

from sluice import Engine


@pytest.fixture(scope="module")
def engine():
    with Engine(max_total_tokens=4000) as e:
        yield e


def test_generate_one_and_many(engine):
    greedy = {"max_new_tokens": 8, "temperature": 0}
    one = engine.generate("The capital of France is", greedy)
    assert "Paris" in one["text"]
    many = engine.generate(["The capital of France is", "1, 2, 3,"], greedy)
    assert [m["text"] for m in many][0] == one["text"]
    assert many[1]["meta_info"]["completion_tokens"] == 8


def test_async_generate(engine):
    out = asyncio.run(engine.async_generate("1, 2, 3,", {"max_new_tokens": 4, "temperature": 0}))
    assert out["text"].strip().startswith("4")
