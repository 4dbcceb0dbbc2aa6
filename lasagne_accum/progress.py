"""The progress bar of :func:`lasagne_accum.run_epoch` and the examples."""

from __future__ import annotations

import sys
import time
from typing import Any, Iterable

__all__ = ["Progress"]


class Progress:
    """Wrap an iterable with a progress bar: tqdm when installed, else plain lines.

    Plain lines go to stderr at most every 5 seconds; ``enabled=False`` shows
    nothing; tqdm is never required. ``set(text)`` updates the text shown
    after the count (the current loss, say).

    Examples
    --------
    >>> bar = Progress(range(3), desc="epoch 1", enabled=False)
    >>> [i for i in bar]
    [0, 1, 2]
    """

    def __init__(
        self,
        iterable: Iterable[Any],
        total: int | None = None,
        desc: str = "",
        enabled: bool = True,
    ) -> None:
        self.iterable, self.desc, self.enabled = iterable, desc, enabled
        self.total = total if total is not None else len(iterable)  # type: ignore[arg-type]
        self.bar, self.postfix = None, ""
        if enabled:
            try:
                from tqdm.auto import tqdm
            except ImportError:
                tqdm = None
            if tqdm is not None:
                self.bar = tqdm(total=self.total, desc=desc, leave=False, file=sys.stderr)

    def set(self, text: str) -> None:
        self.postfix = text
        if self.bar is not None:
            self.bar.set_postfix_str(text, refresh=False)

    def __iter__(self):
        last = time.monotonic()
        try:
            for n, item in enumerate(self.iterable, 1):
                yield item
                if self.bar is not None:
                    self.bar.update(1)
                elif self.enabled and time.monotonic() - last > 5:
                    last = time.monotonic()
                    print(f"{self.desc}: {n}/{self.total} {self.postfix}", file=sys.stderr,
                          flush=True)
        finally:
            if self.bar is not None:
                self.bar.close()
