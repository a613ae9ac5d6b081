"""Model weights by name, each read from the model file only when the model first asks for it.

A model takes its weights layer by layer and frees each source once it holds its own copy
(the kernels' packed blocks). Read eagerly, every source would be resident at once beside
the copies made from them: at 1 B parameters that is the model's size again at the peak of
start-up. Read when taken, the peak is the model plus one layer's sources.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, MutableMapping
from typing import TypeVar

T = TypeVar("T")


class LazyWeights(MutableMapping[str, T]):
    """A mapping whose values are made by their readers on first access, then kept until deleted.

    `transform` and `split` change a weight before it is read without reading it, so the
    renaming and reordering a file's tensors need stay as lazy as the reading.
    """

    def __init__(self, readers: dict[str, Callable[[], T]] | None = None) -> None:
        self._readers: dict[str, Callable[[], T]] = dict(readers or {})
        self._read: dict[str, T] = {}

    @classmethod
    def of(cls, weights: dict[str, T]) -> LazyWeights[T]:
        """Weights already in memory."""
        lazy: LazyWeights[T] = cls()
        lazy._read.update(weights)
        return lazy

    def __getitem__(self, name: str) -> T:
        if name not in self._read:
            self._read[name] = self._readers.pop(name)()  # KeyError: no such weight
        return self._read[name]

    def __setitem__(self, name: str, weight: T) -> None:
        self._readers.pop(name, None)
        self._read[name] = weight

    def __delitem__(self, name: str) -> None:
        if name in self._read:
            del self._read[name]
        else:
            del self._readers[name]

    def __contains__(self, name: object) -> bool:
        return name in self._read or name in self._readers

    def __iter__(self) -> Iterator[str]:
        yield from list(self._read)
        yield from list(self._readers)

    def __len__(self) -> int:
        return len(self._read) + len(self._readers)

    def transform(self, name: str, change: Callable[[T], T]) -> None:
        """The weight `name` becomes change(weight), applied when it is read."""
        if name in self._read:
            self._read[name] = change(self._read[name])
            return
        read = self._readers[name]
        self._readers[name] = lambda: change(read())

    def split(self, name: str, parts: list[str], divide: Callable[[T], list[T]]) -> None:
        """The weight `name` is replaced by `parts`, the pieces divide(weight) gives. It is read
        once, when the first part is, and let go with the last part."""
        if name in self._read:
            whole = self._read.pop(name)
            self._read.update(zip(parts, divide(whole), strict=True))
            return
        read = self._readers.pop(name)
        pieces: dict[str, T] = {}

        def read_part(part: str) -> T:
            if not pieces:
                pieces.update(zip(parts, divide(read()), strict=True))
            return pieces.pop(part)

        for part in parts:
            self._readers[part] = lambda part=part: read_part(part)  # type: ignore[misc]
